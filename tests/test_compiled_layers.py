"""Compiled decoder layers (``train.compile``, dapo/models/compiled_layers.py) against eager
ones, through a real transformer in float32 on the CPU: the same log-probs and gradient to
float rounding, packed and padded; one graph whatever the layout; generation from a cache
stays eager; activation checkpointing recomputes the compiled layer; a deep copy runs its own
layers; a compiler error falls back with a warning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from dapo.data.batch import collate
from dapo.dist import fsdp
from dapo.models import compiled_layers
from dapo.models.compiled_layers import compile_layers, is_compiled
from dapo.models.logprobs import batch_logprobs
from dapo.models.packing import use_packing
from tests.test_packing import gradients, groups

# aot_eager traces and partitions exactly as inductor does, without generating C++: the
# graphs and their count are the same, in a fraction of the time.
FAST = "aot_eager"


pytestmark = pytest.mark.usefixtures("fresh_traces")


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    "layout", [["train.packing=true"], ["train.share_prompts=false"]], ids=["packed", "padded"]
)
def test_compiled_layers_give_the_eager_gradient(tiny_model, tokenizer, layout):
    """Through ``build_state`` (the switch as a run sets it), with inductor's own kernels:
    the loss and every parameter's gradient of eager layers, to float32 rounding."""
    eps = groups()
    twin = copy.deepcopy(tiny_model)
    eager, e_sums = gradients(tiny_model, tokenizer, eps, *layout)
    got, c_sums = gradients(twin, tokenizer, eps, *layout, "train.compile=true")
    assert all(is_compiled(layer) for layer in fsdp.decoder_layers(twin))
    assert graphs() > 0  # it did compile
    assert c_sums["loss"] == pytest.approx(e_sums["loss"], rel=1e-6)
    assert c_sums["tokens"] == e_sums["tokens"]
    for want, have in zip(eager, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-7)


def test_one_graph_serves_every_layer_and_layout(tiny_model):
    """Three micro-batches of other lengths and groups, two layers: the graphs compiled for
    the first layer's first call serve the other layer and the rest (the layer's and its
    attention module's code, each cut at the packed attention: 4 at most; per layer, or
    per layout, it would grow)."""
    use_packing(tiny_model)
    eager = copy.deepcopy(tiny_model)
    compile_layers(tiny_model, backend=FAST)
    eps = groups()
    counts = []
    for rows in (eps[:3], eps[3:5], eps[5:]):
        b = collate(rows, pad_id=0, packed=True)
        with torch.no_grad():
            want, _ = batch_logprobs(eager, b)
            have, _ = batch_logprobs(tiny_model, b)
        torch.testing.assert_close(have, want, rtol=0, atol=1e-6)
        counts.append(graphs())
    assert counts[0] == counts[1] == counts[2] <= 4


def test_generation_from_a_cache_stays_eager(tiny_model, tokenizer):
    """Decoding continues from a KV cache: the wrapped layers run it eagerly (no graph), and
    the tokens are the unwrapped model's, bit for bit."""
    eager = copy.deepcopy(tiny_model)
    compile_layers(tiny_model, backend=FAST)
    ids = torch.tensor([[5, 6, 7, 8]])
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        want = eager.generate(ids, **options)
        have = tiny_model.generate(ids, **options)
    assert torch.equal(have, want)
    assert graphs() == 0


def test_checkpointing_recomputes_the_compiled_layer(tiny_model):
    """Compiled, then checkpointed (the order the run uses): the backward's recomputation
    gives the eager gradient, and the layers' activations are not kept."""
    use_packing(tiny_model)
    eager = copy.deepcopy(tiny_model)
    compile_layers(tiny_model, backend=FAST)
    fsdp.checkpoint_layers(tiny_model)
    assert all(is_compiled(layer) for layer in fsdp.decoder_layers(tiny_model))
    b = collate(groups(), pad_id=0, packed=True)

    def saved_and_grads(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t
        ):
            logp_BT, _ = batch_logprobs(model.train(), b)
        logp_BT.sum().backward()
        return sum(saved), [p.grad for p in model.parameters()]

    (kept, want), (kept_ckpt, have) = saved_and_grads(eager), saved_and_grads(tiny_model)
    assert kept_ckpt < kept / 2
    for w, h in zip(want, have, strict=True):
        # Float32 rounding of sums the traced graph orders its own way: relative to the
        # gradient's scale, not to each element (a small element of a sum of larger terms
        # keeps their rounding: 2.4e-7 at an element of 0.004 on one Xeon's kernels, in a
        # gradient whose largest element is about 2).
        torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


def test_a_deep_copy_runs_its_own_layers(tiny_model):
    """The generation copy of ``train.async_staleness`` is a deep copy of the wrapped policy:
    its layers must compute with its own weights, not call back into the policy's (as a
    closure over the policy's forward would)."""
    plain = copy.deepcopy(tiny_model)
    compile_layers(tiny_model, backend=FAST)
    fsdp.checkpoint_layers(tiny_model)
    twin = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p, q in zip(twin.parameters(), plain.parameters(), strict=True):
            p.mul_(0.5)
            q.mul_(0.5)
    b = collate(groups()[:3], pad_id=0)
    with torch.no_grad():
        want, _ = batch_logprobs(plain, b, share_prompts=False)
        have, _ = batch_logprobs(twin, b, share_prompts=False)
    torch.testing.assert_close(have, want, rtol=0, atol=1e-6)


def test_a_compiler_error_falls_back_to_eager(tiny_model):
    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    eager = copy.deepcopy(tiny_model)
    compile_layers(tiny_model, backend=broken)
    b = collate(groups()[:3], pad_id=0)
    with torch.no_grad(), pytest.warns(UserWarning, match="train.compile: torch.compile failed"):
        have, _ = batch_logprobs(tiny_model, b, share_prompts=False)
    want, _ = batch_logprobs(eager, b, share_prompts=False)
    torch.testing.assert_close(have, want, rtol=0, atol=0)
    shared = fsdp.decoder_layers(tiny_model)[0].forward.args[0]
    assert isinstance(shared, compiled_layers.CompiledForward) and not shared.on


def sharded_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: the policy compiled, checkpointed and sharded as a run under
    ``torchrun`` orders it; a packed micro-batch of half the rows, backward; the gradient."""
    from dapo.models.demo import build_tokenizer

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        torch.set_num_threads(1)
        model = two_layer_model(build_tokenizer())
        compile_layers(model, backend=FAST)
        fsdp.shard(model, compute_dtype=torch.float32, activation_checkpointing=True)
        eps = groups()
        rows = eps[:5] if rank == 0 else eps[5:]
        logp_BT, _ = batch_logprobs(model.train(), collate(rows, pad_id=0, packed=True))
        logp_BT.sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        torch.save({"grads": grads, "graphs": graphs()}, f"{out}/rank_{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def two_layer_model(tokenizer):
    from dapo.models.demo import TinyModelSpec, tiny_qwen2

    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)
    model = tiny_qwen2(tokenizer, spec, seed=0)
    use_packing(model)
    return model


def test_two_ranks_shard_the_compiled_layers(tokenizer, tmp_path):
    """FSDP2 gathers each layer's weights around the compiled forward (its hooks sit outside
    the wrapped forward): the ranks' summed gradient is one process's eager gradient."""
    from helpers import spawn_ranks

    spawn_ranks(sharded_rank, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=True) for r in range(2)]
    model = two_layer_model(tokenizer)
    eps = groups()
    for rows in (eps[:5], eps[5:]):
        logp_BT, _ = batch_logprobs(model.train(), collate(rows, pad_id=0, packed=True))
        logp_BT.sum().backward()
    for rank in ranks:
        assert 0 < rank["graphs"] <= 4
        for name, p in model.named_parameters():
            torch.testing.assert_close(rank["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


def test_the_memory_plan_counts_compiled_activations_as_eager():
    """``--dry-run`` with ``train.compile=true``: the same figures (eager's activations, an
    upper bound for compiled layers), the row saying so."""
    from dataclasses import replace

    from dapo.training.gpu_memory import PlanSettings, plan_memory
    from dapo.training.memory_table import format_plan
    from dapo.training.model_shape import KNOWN_SHAPES, ModelShape

    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-1.5b"])
    eager = PlanSettings(microbatch_tokens=8192, packing=True)
    compiled = replace(eager, compiled=True)
    assert plan_memory(shape, compiled) == replace(plan_memory(shape, eager), settings=compiled)
    row = "activations (8192 tokens, compiled: counted as eager, an upper bound)"
    assert row in format_plan(plan_memory(shape, compiled))
    assert "compiled" not in format_plan(plan_memory(shape, eager))


def test_a_backward_that_fails_to_compile_falls_back_before_the_pass_runs(tiny_model):
    """The backward's compiler fails: the failure comes out of the forward call (not later, in
    ``loss.backward()``, beyond the fallback), and the gradient is eager's."""
    from torch._dynamo.backends.common import aot_autograd

    def no_backward(graph, example_inputs):
        raise RuntimeError("no backward compiler")

    backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=no_backward)
    use_packing(tiny_model)
    eager = copy.deepcopy(tiny_model)
    compile_layers(tiny_model, backend=backend)
    b = collate(groups(), pad_id=0, packed=True)
    with pytest.warns(UserWarning, match="train.compile: torch.compile failed"):
        have, _ = batch_logprobs(tiny_model.train(), b)
    have.sum().backward()
    want, _ = batch_logprobs(eager.train(), b)
    want.sum().backward()
    for w, h in zip(eager.parameters(), tiny_model.parameters(), strict=True):
        torch.testing.assert_close(h.grad, w.grad, rtol=0, atol=0)


def test_a_failure_after_compiled_passes_stops_the_run(tiny_model):
    """Once compiled layers have run, falling back could leave checkpointed layers
    recomputing eagerly what they saved compiled: a later compiler failure is an error that
    names the switch."""
    failing = {"now": False}

    def sometimes(graph, example_inputs):
        if failing["now"]:
            raise RuntimeError("out of compiler")
        return graph.forward

    compile_layers(tiny_model, backend=sometimes)
    b = collate(groups()[:3], pad_id=0)
    batch_logprobs(tiny_model.train(), b, share_prompts=False)
    failing["now"] = True
    with torch.no_grad(), pytest.raises(RuntimeError, match="set train.compile=false"):
        batch_logprobs(tiny_model.eval(), b, share_prompts=False)
