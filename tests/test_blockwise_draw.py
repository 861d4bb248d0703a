"""The CUDA-graph path's draw from the logits' block masses (dapo.rollout.block_draw), eager
and compiled, on the CPU: the tokens the float64 softmax's two-level and one-running-sum
inversions draw, never a token of zero probability, a valid index for a NaN row, one trace
for every batch size, and (inductor on a CPU) one fused kernel for the block masses."""

from __future__ import annotations

import pytest
import torch
from test_static_decode import STOPS, batch_sizes_seen, model_of, prompts
from torch._dynamo.testing import CompileCounter

from dapo.rollout import block_draw, sampling, static_decode

WAYS = {"eager": None, "inductor": "inductor"}


pytestmark = pytest.mark.usefixtures("fresh_traces")


def from_probabilities(logits_AV: torch.Tensor, u_A: torch.Tensor) -> torch.Tensor:
    """The draw before block masses: the float64 softmax, inverted by blocks."""
    probs_AV, _ = sampling.sampling_probs(logits_AV)
    return sampling.invert_by_blocks(probs_AV, u_A)


def random_rows(rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """N(0, 4^2) logits with every 7th token masked (-inf) and, in row 5, a whole block; u
    random but for 0, the largest u below 1, 0.5 and a tiny one."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[:, ::7] = float("-inf")
    block = block_draw.block_tokens(vocab)
    logits[5, block : 2 * block] = float("-inf")
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-300], dtype=torch.float64)
    return logits, u


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    "vocab, rows", [(151936, 300), (49152, 200), (1000, 200)], ids=["qwen", "smollm2", "padded"]
)
def test_block_masses_draw_what_the_float64_softmax_draws(vocab, rows, way):
    """Qwen's 151,936 (blocks of 128), SmolLM2's 49,152 (256) and 1,000, which no power of
    two from 64 to 256 divides (padded to blocks of 256)."""
    logits, u = random_rows(rows, vocab)
    drawn = sampling.sample_from_logits(logits, u, check=False, by_blocks=True, compile=WAYS[way])
    assert torch.equal(drawn, from_probabilities(logits, u))
    assert torch.equal(drawn, sampling.sample_from_logits(logits, u))
    assert not (drawn % 7 == 0).any()
    assert drawn[1].item() == (logits[1].isfinite().nonzero()[-1]).item()  # u just below 1


@pytest.mark.parametrize("way", WAYS)
def test_temperature_and_masked_tokens_through_draw_tokens(way):
    """At temperature 0.6 with stop tokens masked: the tokens and log-probs of the eager
    loop's draw (one running sum over the vocabulary)."""
    logits, u = random_rows(64, 1088, seed=1)
    masked = torch.tensor([3, 500, 1087])
    draw = dict(temperature=0.6, top_p=1.0, greedy=False, masked_tokens=masked, check=False)
    token, logp = sampling.draw_tokens(logits, u, **draw, by_blocks=True, compile=WAYS[way])
    eager_token, eager_logp = sampling.draw_tokens(logits, u, **draw)
    assert torch.equal(token, eager_token) and torch.equal(logp, eager_logp)
    assert not torch.isin(token, masked).any()


@pytest.mark.parametrize("way", WAYS)
def test_a_token_of_zero_probability_is_never_drawn(way):
    """Rows of few finite tokens (and logits beyond float64's exp, and tokens whose
    probability underflows to 0), at the u that land on their boundaries: never a masked
    token, nor one of zero probability; the token the float64 softmax draws."""
    vocab = 640  # blocks of 128
    logits = torch.full((6, vocab), float("-inf"))
    logits[:, [130, 131, 400, 401]] = 0.0  # a quarter each: the boundaries are exact
    logits[3, [130, 131, 400, 401]] = 900.0  # exp(900) overflows float64: offsets needed
    logits[4, [130, 131]] = -1000.0  # exp(-1000) is 0 in float64
    logits[5] = torch.arange(vocab) * -3.0  # underflowing tails, block masses of 0 included
    u = torch.tensor([0.0, 0.25, 0.5 - 2**-54, 1 - 2**-53, 1e-300, 1 - 2**-53], dtype=torch.float64)
    drawn = sampling.sample_from_logits(logits, u, check=False, by_blocks=True, compile=WAYS[way])
    assert drawn.tolist() == [130, 131, 131, 401, 400, drawn[5].item()]
    probs, _ = sampling.sampling_probs(logits)
    assert (probs.gather(1, drawn[:, None]) > 0).all()
    assert torch.equal(drawn, from_probabilities(logits, u))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("vocab", [97, 1088])
def test_rows_of_nan_draw_a_valid_index(vocab, way):
    """A NaN row, a row of NaN and -inf, one of only -inf and one with +inf: an index
    inside the vocabulary (the loop raises at its next read-back); the other rows as before."""
    logits, u = random_rows(8, vocab, seed=2)
    logits[1] = float("nan")
    logits[2, ::2], logits[2, 1::2] = float("nan"), float("-inf")
    logits[6] = float("-inf")
    logits[7, 3] = float("inf")
    drawn = sampling.sample_from_logits(logits, u, check=False, by_blocks=True, compile=WAYS[way])
    assert ((drawn >= 0) & (drawn < vocab)).all()
    keep = [0, 3, 4, 5]
    assert torch.equal(drawn[keep], sampling.sample_from_logits(logits[keep], u[keep]))


def test_the_block_masses_are_the_softmax_times_its_normaliser():
    """Each block's sum of exp(l - the row's maximum) in float64, padded with -inf to 4
    blocks of 256: a block of only -inf has mass 0, and logits past float64's exp (750)
    are taken relative to their maxima."""
    logits, _ = random_rows(6, 1000)
    logits = logits[2:].clone()  # the last row's second block is all -inf
    logits[2] += 750.0
    mass, top = block_draw.block_masses(logits)
    assert mass.shape == (4, 4) and mass.dtype == torch.float64
    assert mass[3, 1].item() == 0.0 and mass.isfinite().all()
    assert torch.equal(top[:, 0], logits.amax(dim=-1))
    padded = torch.nn.functional.pad(logits.double(), (0, 24), value=float("-inf"))
    expected = (padded - top.double()).exp().view(4, 4, 256).sum(dim=-1)
    torch.testing.assert_close(mass, expected, rtol=1e-14, atol=0)


def test_the_compiled_masses_are_traced_once_without_a_graph_break():
    """One graph, no break, and one trace for 2 to 300 rows."""
    logits, _ = random_rows(64, 1088)
    explained = torch._dynamo.explain(block_draw.block_masses)(logits)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    counter = CompileCounter()
    masses = block_draw.compiled_masses(counter)
    for rows in (64, 2, 3, 17, 300):
        rows_logits = torch.randn(rows, 1088, generator=torch.Generator().manual_seed(rows))
        mass, top = masses(rows_logits)
        assert torch.equal(mass, block_draw.block_masses(rows_logits)[0])
    assert counter.frame_count == 1


def test_inductor_fuses_the_block_masses_into_one_kernel():
    """On a CPU, inductor writes one C++ kernel for the whole of ``block_masses``: every
    reduction and the float64 arithmetic in it, no [rows, V] array written."""
    from torch._inductor.utils import run_and_get_code

    logits, _ = random_rows(16, 1000)
    masses = block_draw.compiled_masses("inductor")
    (mass, _), codes = run_and_get_code(masses, logits)
    kernels = sum(code.count("async_compile.cpp_pybinding(") for code in codes)
    assert kernels == 1
    # Its float64 sums add in another order (vectors of 8): equal to rounding.
    torch.testing.assert_close(mass, block_draw.block_masses(logits)[0], rtol=1e-14, atol=0)


def test_a_compiled_rollout_traces_the_draw_once(monkeypatch):
    """static_decode with a compiled step, a read-back every 4 steps (the batch shrinks
    through 8, 4 and 2 rows): step_inputs, layer_step and block_masses each traced once."""
    monkeypatch.setattr(static_decode, "CHECK_EVERY", 4)
    sizes = batch_sizes_seen(monkeypatch)
    counter = CompileCounter()
    ids, mask = prompts()
    with torch.inference_mode():
        static_decode.static_decode(
            model_of("qwen2"),
            ids,
            mask,
            group_size=4,
            max_new_tokens=60,
            stop_token_ids=STOPS,
            pad_token_id=0,
            graphs=False,
            compile=counter,
            seed=[4, 5, 6],
        )
    assert sizes and min(sizes) == 2 and set(sizes) <= {8, 4, 2}
    assert counter.frame_count == 3
