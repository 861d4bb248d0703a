"""The CUDA-graph path's step compiled by torch.compile (``rollout.compile_step``), run on the
CPU without graphs: the same tokens and log-probs as the uncompiled step, one trace for every
layer, batch size, attention width and rollout, no graph break, and the engine's fallback
when the compiler fails. On a GPU, ``benchmarks/decode_check.py`` compares the compiled
graphs with the uncompiled ones and ``benchmarks/gpu.py`` measures them."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from test_static_decode import MODELS, SIZES, STOPS, batch_sizes_seen, model_of, prompts
from torch._dynamo.testing import CompileCounter
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo.models.demo import build_tokenizer
from dapo.rollout import make_engine, native, static_decode
from dapo.rollout.decoder_step import DecoderStep, layer_step, step_inputs, unsupported_reason

pytestmark = pytest.mark.usefixtures("fresh_traces")


def run(model, *, compile=None, ids_mask=None, new_tokens: int = 40, group: int = 4, **options):
    ids, mask = ids_mask or prompts()
    with torch.inference_mode():
        return static_decode.static_decode(
            model,
            ids,
            mask,
            group_size=group,
            max_new_tokens=new_tokens,
            stop_token_ids=options.pop("stops", STOPS),
            pad_token_id=0,
            graphs=False,
            compile=compile,
            **options,
        )


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("fuse", [False, True], ids=["weights as they are", "fused"])
def test_the_traced_step_draws_what_the_step_draws(arch, fuse, monkeypatch):
    monkeypatch.setattr(static_decode, "DecoderStep", functools.partial(DecoderStep, fuse=fuse))
    model = model_of(arch)
    for options in ({"seed": [1, 2, 3]}, {"top_p": 0.7, "temperature": 0.8}):
        plain = run(model, **options)
        traced = run(model, compile="aot_eager", **options)
        assert torch.equal(traced[0], plain[0])
        torch.testing.assert_close(traced[1], plain[1], rtol=0, atol=1e-5)
        # Rows finish at different steps; the compiled batch never shrinks below 2 rows.
        assert plain[2] <= traced[2]


def test_inductor_kernels_draw_the_same_tokens():
    """inductor's own kernels (C++ on a CPU, Triton on a GPU): fused norms and adds sum in
    another order, so log-probs agree to 1e-5 in float32, and the tokens are the same."""
    model = model_of("qwen3 (head norms)")
    plain = run(model, top_p=0.9, seed=[4, 5, 6])
    compiled = run(model, compile="inductor", top_p=0.9, seed=[4, 5, 6])
    assert torch.equal(compiled[0], plain[0])
    torch.testing.assert_close(compiled[1], plain[1], rtol=0, atol=1e-5)


def test_one_trace_serves_every_layer_width_batch_and_rollout(monkeypatch):
    """Widths in steps of 16 over 60 tokens, a read-back every 4 steps (rows finish: the
    batch shrinks through 8, 4, 2), then rollouts of other prompt lengths, rows and lengths:
    each compiled function is traced once."""
    monkeypatch.setattr(static_decode, "WIDTH_STEP", 16)
    monkeypatch.setattr(static_decode, "CHECK_EVERY", 4)
    sizes = batch_sizes_seen(monkeypatch)
    counter = CompileCounter()
    model = model_of("qwen2")
    ids, mask = prompts()
    run(model, compile=counter, new_tokens=60, seed=[4, 5, 6])
    assert sizes and min(sizes) == 2 and set(sizes) <= {8, 4, 2}
    run(model, compile=counter, ids_mask=(ids[:2, 2:], mask[:2, 2:]), new_tokens=33, group=3)
    run(model, compile=counter, new_tokens=5, stops=[], ignore_eos=True)
    assert counter.frame_count == 3  # step_inputs, layer_step and block_masses, once each


def test_no_graph_break():
    """What ``torch._dynamo.explain`` finds in the step's two functions: one graph each."""
    model = model_of("qwen3 (head norms)")
    step = DecoderStep(model, None)
    rows, width = 6, 32
    cache = step.new_cache(rows, width + 16, torch.device("cpu"))
    valid = torch.ones(rows, width, dtype=torch.bool)
    position = torch.arange(rows) + 3
    inputs = dict(scaling=step.rope_scaling, dtype=torch.float32, compute=torch.float32)
    explained = torch._dynamo.explain(step_inputs)(position, valid, step.inv_freq, **inputs)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    cos, sin, bias = step_inputs(position, valid, step.inv_freq, **inputs)
    hidden = torch.randn(rows, 64)
    args = (hidden, cos, sin, bias, cache[0], cache[1], torch.tensor([7]), step.layers[0])
    explained = torch._dynamo.explain(layer_step)(*args, **step.shape)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_an_mlp_activation_other_than_silu_is_refused():
    model = Qwen2ForCausalLM(Qwen2Config(**SIZES, hidden_act="gelu"))
    assert "'gelu'" in unsupported_reason(model)
    assert unsupported_reason(model_of("qwen2")) is None


def test_batch_sizes_start_at_the_smallest():
    assert static_decode.batch_sizes(12) == [1, 2, 4, 8, 12]
    assert static_decode.batch_sizes(12, 2) == [2, 4, 8, 12]
    assert static_decode.batch_sizes(1, 2) == [1]


def test_a_compiler_error_falls_back_to_the_uncompiled_step(monkeypatch):
    """The engine's CUDA-graph path (forced here; graphs off on a CPU) with a compiler that
    fails: one warning, the rollout the uncompiled step draws, and no compiling after."""

    def broken(graph, example_inputs):
        raise RuntimeError("nvcc: not found")

    traced = []
    real = static_decode.static_decode
    monkeypatch.setattr(
        native,
        "static_decode",
        lambda *a, **kw: (traced.append(kw.get("compile")), real(*a, **kw))[1],
    )
    monkeypatch.setattr(native, "COMPILE_BACKEND", broken)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SIZES, "vocab_size": 128})).eval()
    engine = make_engine("dapo", model, build_tokenizer())
    engine.static_path = lambda: True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = engine.generate(["1 + 2"], group_size=2, max_new_tokens=6, seed=3)
        second = engine.generate(["1 + 2"], group_size=2, max_new_tokens=6, seed=3)
    assert traced == [broken, None, None] and engine.compile_step is False
    fell_back = [str(w.message) for w in caught if "compile_step" in str(w.message)]
    assert len(fell_back) == 1 and "nvcc: not found" in fell_back[0]
    assert first.texts == second.texts and torch.equal(first.logprobs_BT, second.logprobs_BT)


def test_the_engine_hands_on_its_mode_and_width_step(monkeypatch):
    """``compile_mode`` reaches ``torch.compile`` for both compiled functions, and the
    engine's ``width_step`` its loop; the rollout is the default one's (benchmarks/gpu.py
    --variants times these settings on a GPU)."""
    modes = []
    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: (modes.append(kw.get("mode")), real_compile(fn, **kw))[1]
    )
    handed = []
    real = static_decode.static_decode
    monkeypatch.setattr(
        native,
        "static_decode",
        lambda *a, **kw: (
            handed.append((kw.get("compile_mode"), kw["width_step"])),
            real(*a, **kw),
        )[1],
    )

    def backend(graph, example_inputs, **options):  # new: no wrapper cached by another test
        return graph.forward

    monkeypatch.setattr(native, "COMPILE_BACKEND", backend)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SIZES, "vocab_size": 128})).eval()
    engine = make_engine("dapo", model, build_tokenizer())
    engine.static_path = lambda: True
    plain = engine.generate(["1 + 2"], group_size=2, max_new_tokens=20, seed=3)
    engine.compile_mode, engine.width_step = "max-autotune-no-cudagraphs", 16
    varied = engine.generate(["1 + 2"], group_size=2, max_new_tokens=20, seed=3)
    assert handed == [(None, None), ("max-autotune-no-cudagraphs", 16)]
    assert modes == [None] * 3 + ["max-autotune-no-cudagraphs"] * 3
    assert plain.texts == varied.texts
    torch.testing.assert_close(varied.logprobs_BT, plain.logprobs_BT, rtol=0, atol=1e-6)


def test_ignore_eos_without_stop_tokens():
    """No stop set at all (ignore_eos with an empty list): nothing is masked, and every row
    runs to the end."""
    tokens, logprobs, _ = run(model_of("qwen2"), new_tokens=9, stops=[], ignore_eos=True)
    assert tokens.shape == (12, 9) and torch.isfinite(logprobs).all()
