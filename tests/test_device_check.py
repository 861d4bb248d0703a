"""A device check that needs no GPU (issue 33, item 6): the passes a GPU run takes, with the
model and every input on a device other than the CPU, so that a tensor made without the
compute device fails.

The device is ``meta`` under :class:`DeviceCheck`, a ``FakeTensorMode``: tensors hold no data,
and every op checks that its tensors share one device, a CPU 0-d scalar aside, as on CUDA.
Plain meta tensors check less (``meta @ cpu`` passes), and a fake ``cuda:0`` cannot run a model
on the CPU-only torch wheel: Python indexing needs a CUDA device guard, which that build lacks,
and autograd on it aborts the process. Fake meta runs forward and backward. Each pass also has
a negative test: one place made to create its tensor on the CPU, and the check raises.

Covered: ``response_logprobs``, forward and backward: the shared-prompt pass (its KV cache
indexed by row) and the full forward, with and without entropy, the chunked head over several
chunks and the model's own logits; ``algo.policy_loss`` in every loss_fn, ratio_level and
loss_agg (dual-clip, weights), ``kl_k3``, ``token_sums``; ``fill_logprobs`` (pi_old, grpo's
pi_ref) and ``minibatch_update`` (micro-batches, the loss and KL, backward, clipping, AdamW's
step) for the dapo and grpo presets; ``NativeEngine.generate``: ``encode_prompts``, the prefill
and its row cache, the drawing of a token (CPU uniforms moved to the device, per-prompt seeds,
top-p, greedy), rows leaving the batch and the cache, a step on the cache, ``finish_rollout``;
``HFEngine.generate`` for one token; both engines' merged copy of a LoRA policy
(``model.lora.merged_sampling``); ``collate(...).to(device)``; ``train.packing``'s pass,
its GPU attention too (one variable-length call, PyTorch's kernel stood in); the CUDA-graph
path's loop (``static_decode`` without graphs: its buffers, the step, the draw, the
read-backs). Where a GPU would wait: reads back to the host, and blocking copies to the device
(``DeviceCheck.copies``): the micro-batches and the packed layout reach the device by
asynchronous copies from page-locked memory (``dapo.data.transfer``, pinning stood in).

Stepped around, as fake tensors hold no data: a value read from a tensor (``.item()``,
``float()``, ``bool()``) is answered by the function that reads it (``READS_*``; a read with
no answer fails): the logits are finite, half the rows finish at the first step, metrics, the
gradient norm and AdamW's step count are 1, transformers' checks inside ``generate`` are True
(it warns about the special tokens, and every row finishes after one token), ids decode as
EOS; ``nonzero`` sees every element set, ``unique`` groups of G rows. Autocast is off on meta
(it has no meta backend; the runs are float32). grpo's reference copy is made by the test.

Not covered: values; bf16/fp16 autocast and the GradScaler; a second step after rows left;
``update``'s host-side work (the mini-batch split, the sampler's log-prob check, rollout
correction weights), ``Rollout.samples``; FSDP, vLLM; what only a GPU shows (kernels, memory,
streams), and an embedding fed CPU ids, which CUDA refuses and meta lets pass.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import dapo
from dapo import algo
from dapo.algo import logits as head_maths
from dapo.config import load_config
from dapo.data import transfer
from dapo.data.batch import Batch, Episode, collate, length_sorted, split_microbatches
from dapo.data.problems import Problem
from dapo.models import logprobs, packing
from dapo.rollout import native, parking, static_decode
from dapo.rollout.base import encode_prompts
from dapo.rollout.hf import HFEngine
from dapo.training.old_logprobs import fill_logprobs
from dapo.training.state import TrainState, build_state
from dapo.training.update import minibatch_update

DEVICE = torch.device("meta")
CPU = torch.device("cpu")
PACKAGE = os.path.dirname(os.path.abspath(dapo.__file__)) + os.sep
TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
G, P, T = 2, 5, 6  # responses per prompt, prompt and response tokens
aten = torch.ops.aten
SCALAR_READS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default)

# transformers 4.x asks whether the attention mask pads; 5.x sees fake tensors and builds the
# mask without asking. It pads here too, so the mask is built.
READS_FORWARD = {"_ignore_causal_mask_sdpa": False}
# The mini-batch's metrics and gradient norm, read back in one transfer; the host's prompt
# ranks of the micro-batch order (all equal here); AdamW's step counters (host tensors).
READS_UPDATE = {"read": 1.0, "length_sorted": 0, "_step_or_skip": 1}
# The logits' NaN check (sampled or greedy). Half the rows finish at the first step:
# RowCache.keep (dapo/rollout/kv_cache.py) keeps 2 of 4.
READS_DECODE = {"check_finite": True, "retire": True, "keep": 2}


def mixed_devices():
    """What a mix of devices raises: FakeTensorMode's check, or a meta kernel's own."""
    return pytest.raises(RuntimeError, match="on the same device|Mismatching .* device")


class DeviceCheck(FakeTensorMode):
    """Fake tensors whose ops check devices. What data would decide is answered: a value read
    from a tensor as ``reads`` says (:meth:`read`), ``nonzero`` as every element set, ``unique``
    of rows as groups of G rows. ``answered`` lists what it answered, in order.

    ``syncs`` lists, by the dapo function that caused it, every point where a GPU would wait
    for its queue of kernels: a value read from a tensor on the device, a copy from the device
    to the host, an op on the device whose output size depends on the data (nonzero,
    unique). Reads of host tensors are answered but not listed: they wait for nothing.

    ``copies`` lists, the same way, every blocking copy from the host to the device: on CUDA
    PyTorch synchronises the stream after one (``memcpy_and_sync``), so the host waits for the
    queue as it does at a read. They are a ``.to`` or ``copy_`` of a host tensor without
    ``non_blocking``, and a tensor made on the device from host data (``torch.tensor``,
    ``as_tensor``, ``new_tensor``: :class:`FromHost`)."""

    def __init__(self, reads: dict[str, object] | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.reads = READS_FORWARD | (reads or {})
        self.answered: list[str] = []
        self.syncs: list[str] = []
        self.copies: list[str] = []
        self.from_host = FromHost(self.copies)

    def __enter__(self):
        mode = super().__enter__()
        self.from_host.__enter__()  # FakeTensorMode's own code enters the mode again: nested
        return mode

    def __exit__(self, *exc):
        try:
            self.from_host.__exit__(*exc)
        finally:
            suppress = super().__exit__(*exc)
        return suppress

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        x = args[0] if args else None
        if blocking_copy_to_device(func, args, kwargs or {}):
            self.copies.append(dapo_site())
        if func is aten.detach_.default and not isinstance(x, FakeTensor):
            # torch.tensor(data, device="meta") makes a plain meta tensor, which FakeTensorMode
            # converts when an op takes it, but refuses to detach_ in place (inference mode).
            return func(*args, **(kwargs or {}))
        if not isinstance(x, FakeTensor):
            return super().__torch_dispatch__(func, types, args, kwargs)
        to_host = func is aten._to_copy.default and (kwargs or {}).get("device") == CPU
        data_sized = func in (aten.nonzero.default, aten.unique_dim.default)
        if x.device == DEVICE and (func in SCALAR_READS or to_host or data_sized):
            self.syncs.append(dapo_site())
        if func in SCALAR_READS:
            return self.read()
        if func is aten.nonzero.default:
            self.answered.append("nonzero")
            return x.new_empty((x.numel(), x.dim()), dtype=torch.long)
        if func is aten.unique_dim.default:
            assert args[1] == 0, "unique over rows only"
            self.answered.append("unique")
            groups = -(-x.shape[0] // G)
            inverse, counts = (x.new_empty(n, dtype=torch.long) for n in (len(x), groups))
            return x[::G].clone(), inverse, counts
        return super().__torch_dispatch__(func, types, args, kwargs)

    def read(self):
        """``reads``' answer for the first function it names among those the read runs in,
        torch's aside, from the one that reads out to the first of dapo's; none fails."""
        sites = call_sites()
        site = next((s for s in sites if s in self.reads), None)
        self.answered.append(site or sites[0] if sites else "(this test)")
        if site is None:
            raise AssertionError(f"{sites or 'this test'} reads a value: the check has no answer")
        return self.reads[site]


def blocking_copy_to_device(func, args, kwargs) -> bool:
    """Whether a dispatched op copies a host tensor to DEVICE without ``non_blocking``."""
    if func is aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
    elif func is aten.copy_.default:
        source, target = args[1], args[0].device
        kwargs = {"non_blocking": args[2] if len(args) > 2 else kwargs.get("non_blocking")}
    else:
        return False
    return source.device == CPU and target == DEVICE and not kwargs.get("non_blocking")


class FromHost:
    """Lists in ``copies`` every tensor made on DEVICE from host data, by wrapping the three
    factories that do it (``torch.tensor``, ``torch.as_tensor``, ``Tensor.new_tensor``): they
    copy their data from the host and wait. A context manager."""

    FACTORIES = ((torch, "tensor"), (torch, "as_tensor"), (torch.Tensor, "new_tensor"))

    def __init__(self, copies: list[str]) -> None:
        self.copies = copies
        self.saved: list = []
        self.depth = 0

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:  # the outermost entry wraps, its exit unwraps
            for owner, name in self.FACTORIES:
                real = getattr(owner, name)
                self.saved.append((owner, name, real))
                setattr(owner, name, self.watched(real, method=owner is torch.Tensor))
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        while not self.depth and self.saved:
            setattr(*self.saved.pop())

    def watched(self, real, *, method: bool):
        def factory(*args, **kwargs):
            data = args[1] if method else args[0]  # (torch takes the device by keyword only)
            device = kwargs.get("device", args[0].device if method else None)
            made = real(*args, **kwargs)
            on_device = isinstance(data, torch.Tensor) and data.device == DEVICE
            # An empty one copies nothing (a cache's first keys): no wait.
            if device is not None and torch.device(device) == DEVICE and not on_device:
                if made.numel():
                    self.copies.append(dapo_site())
            return made

        return factory


def call_sites(files: list[str] | None = None) -> list[str]:
    """The functions a dispatched op runs in, torch's and this file's aside, from the one
    that called torch out to the first of dapo's (their files appended to ``files``)."""
    frame, sites = inspect.currentframe(), []
    while frame.f_code.co_filename == __file__:  # this file's own frames (the modes')
        frame = frame.f_back
    while frame is not None and frame.f_code.co_filename != __file__:  # the test's: none
        if not frame.f_code.co_filename.startswith(TORCH):
            sites.append(frame.f_code.co_name)
            if files is not None:
                files.append(frame.f_code.co_filename)
        if frame.f_code.co_filename.startswith(PACKAGE):
            break
        frame = frame.f_back
    return sites


def dapo_site() -> str:
    """The dapo function an op runs in; a library's own (transformers' inside a forward pass)
    is named with its library's function: ``"library: NAME (in DAPO_FUNCTION)"``."""
    files: list[str] = []
    sites = call_sites(files)
    if not sites:
        return "(this test)"
    if not files[0].startswith(PACKAGE):
        return f"library: {sites[0]} (in {sites[-1]})"
    return sites[-1]


@pytest.fixture(autouse=True)
def autocast_off_on_meta(monkeypatch):
    """torch.autocast and is_autocast_enabled refuse the meta device: off there, as a float32
    run (compute dtype = weights' dtype) has it; every other device is left as it is."""
    real_autocast, real_enabled = torch.autocast, torch.is_autocast_enabled

    def autocast(device_type, *args, **kwargs):
        if device_type == "meta":
            return contextlib.nullcontext()
        return real_autocast(device_type, *args, **kwargs)

    def is_autocast_enabled(device_type=None):
        if device_type == "meta":
            return False
        return real_enabled() if device_type is None else real_enabled(device_type)

    monkeypatch.setattr(torch, "autocast", autocast)
    monkeypatch.setattr(torch, "is_autocast_enabled", is_autocast_enabled)


def on_device(model):
    """``model`` with every weight and buffer (the rotary ``inv_freq`` too) a fake tensor on
    DEVICE, ties kept; inside the mode."""
    model.to_empty(device=DEVICE)
    if model.config.tie_word_embeddings:  # to_empty makes a new Parameter per module
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(isinstance(t, FakeTensor) and t.device == DEVICE for t in tensors)
    return model


class ForgetsDevice:
    """``torch`` as one module sees it, except that its factories ignore ``device=`` and make
    their tensors on the CPU: the bug the check must catch."""

    FACTORIES = ("arange", "tensor", "zeros", "ones", "full", "empty")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self.FACTORIES:
            return lambda *args, device=None, **kwargs: attr(*args, **kwargs)
        return attr


def test_the_check_catches_a_cpu_tensor_and_allows_a_cpu_scalar():
    host = torch.ones(3, 4)  # made outside the mode: a real CPU tensor
    with DeviceCheck() as check:
        x = torch.ones(3, 4, device=DEVICE)
        assert isinstance(x, FakeTensor) and x.device == DEVICE
        assert (x * torch.tensor(2.0)).device == DEVICE  # a CPU 0-d scalar, as on CUDA
        mixes = [
            lambda: x + host,
            lambda: x @ torch.ones(4, 2),
            lambda: torch.cat([x, torch.ones(1, 4)]),
            lambda: x.gather(1, torch.zeros(3, 1, dtype=torch.long)),
            lambda: torch.searchsorted(x, torch.ones(3, 1)),
        ]
        for mix in mixes:
            with mixed_devices():
                mix()
        with pytest.raises(AssertionError, match="no answer"):
            bool(x.sum() > 0)  # a read the test did not answer fails
        assert check.answered == ["(this test)"]


PROMPTS = ["1 + 1 =", "12 + 30 ="]
PROBLEM = Problem(uid="p", messages=({"role": "user", "content": "1 + 1"},), answer="2")


def responses(vocab: int):
    """(prompt ids, prompt mask, response ids, response mask) of 2 prompts x G responses, made
    on DEVICE inside the mode."""
    prompt_ids = torch.randint(3, vocab, (2, P), device=DEVICE).repeat_interleave(G, dim=0)
    response_ids = torch.randint(3, vocab, (2 * G, T), device=DEVICE)
    ones = torch.ones(2 * G, P + T, dtype=torch.long, device=DEVICE)
    return prompt_ids, ones[:, :P], response_ids, ones[:, P:].bool()


def host_episodes(vocab: int) -> list[Episode]:
    """Two groups of G responses, of unequal lengths, on the host, as a run holds them."""
    g, out = torch.Generator().manual_seed(0), []
    for i in range(2):
        prompt = torch.randint(3, vocab, (P - i,), generator=g)
        for j, n in enumerate(range(T, T - G, -1)):
            zeros, response = torch.zeros(n), torch.randint(3, vocab, (n,), generator=g)
            per_token = dict(old_logprobs=zeros, ref_logprobs=zeros, loss_weights=zeros + 1)
            grade = dict(
                truncated=False, correct=j == 0, reward=float(j == 0), advantage=1.0 - 2 * j
            )
            out.append(Episode(prompt, response, zeros, **grade, **per_token))
    return out


@pytest.mark.parametrize("head", ["chunked", "logits"])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("share_prompts", [True, False])
def test_logprob_pass_on_the_device(tiny_model, monkeypatch, head, with_entropy, share_prompts):
    vocab = tiny_model.config.vocab_size
    if head == "logits":  # a head that is not a plain Linear: the model's own logits
        monkeypatch.setattr(logprobs, "output_head", lambda model: None)
    else:  # 3 positions a chunk: the head's loops run several times, forward and backward
        monkeypatch.setattr(head_maths, "HEAD_CHUNK_ELEMENTS", 3 * vocab)
    with DeviceCheck() as check:
        model = on_device(tiny_model)
        logp, entropy = logprobs.response_logprobs(
            model,
            *responses(vocab),
            temperature=0.7,
            with_entropy=with_entropy,
            share_prompts=share_prompts,
        )
        assert logp.device == DEVICE and logp.shape == (2 * G, T)
        if with_entropy:
            assert entropy.device == DEVICE and entropy.shape == logp.shape
        else:
            assert entropy is None
        logp.sum().backward()
    assert all(p.grad is not None and p.grad.device == DEVICE for p in model.parameters())
    assert ("unique" in check.answered) == share_prompts  # the shared-prompt pass ran


@pytest.mark.parametrize("share_prompts", [True, False])
def test_logprob_pass_catches_a_cpu_tensor(tiny_model, monkeypatch, share_prompts):
    with DeviceCheck():
        model, inputs = on_device(tiny_model), responses(tiny_model.config.vocab_size)
        if share_prompts:  # the response positions (torch.arange) made on the CPU
            monkeypatch.setattr(logprobs, "torch", ForgetsDevice())
        else:  # or the response mask left on the host
            inputs = (*inputs[:3], torch.ones(2 * G, T, dtype=torch.bool))
        with mixed_devices():
            logprobs.response_logprobs(model, *inputs, share_prompts=share_prompts)


def test_losses_on_the_device():
    rows, tokens = 2 * G, 2 * G * T
    with DeviceCheck():
        logp = torch.zeros(rows, T, device=DEVICE, requires_grad=True)
        old, ref = torch.zeros(rows, T, device=DEVICE), torch.zeros(rows, T, device=DEVICE)
        adv, weights = torch.ones(rows, device=DEVICE), torch.ones(rows, T, device=DEVICE)
        mask = torch.ones(rows, T, dtype=torch.bool, device=DEVICE)
        for loss_fn in algo.LOSS_FNS:
            for ratio_level in algo.RATIO_LEVELS:
                for agg in algo.AGG_MODES:
                    divisors = dict(agg=agg, num_tokens=tokens, num_seqs=rows, norm_len=T)
                    loss, stats = algo.policy_loss(
                        logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0,
                        weights=weights, ratio_level=ratio_level, loss_fn=loss_fn,
                        return_stats=True, **divisors,
                    )  # fmt: skip
                    kl = algo.aggregate(algo.kl_k3(logp, ref), mask, **divisors)
                    (loss + 0.001 * kl).backward()
                    assert loss.device == kl.device == logp.grad.device == DEVICE
                    assert stats and all(v.device == DEVICE for v in stats.values())
        sums = algo.token_sums(torch.zeros(rows, T, device=DEVICE), old, mask)
        assert all(v.device == DEVICE for v in sums.values())
        with mixed_devices():  # pi_old left on the host
            algo.policy_loss(logp, torch.zeros(rows, T), adv, mask, eps_low=0.2, eps_high=0.28)


def run_config(preset: str, *extra: str):
    return load_config(
        None,
        [
            "model.compute_dtype=float32",  # no autocast: meta has none (bf16 is not checked)
            "train.recompute_old_logprobs=true",
            f"rollout.max_new_tokens={T}",
            "algo.l_cache=2",
            "train.responses_per_minibatch=4",
            "train.tokens_per_microbatch=24",  # 2 rows a micro-batch: 2 micro-batches
            "reward.workers=0",
            *extra,
        ],
        preset=preset,
    )


def train_state(preset: str, model, tokenizer, ref_model=None, *extra: str) -> TrainState:
    """build_state's state around ``model`` on DEVICE (inside the mode). grpo's frozen
    reference is ``ref_model`` (a copy of the starting policy, made outside the mode): the
    ``.to(dtype)`` build_state gives its copy changes nothing, and then cannot swap
    FakeTensorMode's parameters."""
    cfg = run_config(preset, *extra)
    kl_coef, cfg.algo.kl_coef = cfg.algo.kl_coef, 0.0
    state = build_state(cfg, on_device(model), tokenizer, [PROBLEM], DEVICE)
    if kl_coef > 0:
        cfg.algo.kl_coef = kl_coef
        state.ref_model = on_device(ref_model).eval().requires_grad_(False)
    return state


@pytest.mark.parametrize("preset", ["dapo", "grpo"])
def test_training_update_on_the_device(tiny_model, tokenizer, preset):
    episodes, ref_model = host_episodes(len(tokenizer)), copy.deepcopy(tiny_model)
    with DeviceCheck(READS_UPDATE) as check:
        state = train_state(preset, tiny_model, tokenizer, ref_model)
        # pi_old (and grpo's pi_ref) by forward passes, brought back to the host's episodes
        fill_logprobs(state.model, episodes, "old_logprobs", state)
        if state.ref_model is not None:
            fill_logprobs(state.ref_model, episodes, "ref_logprobs", state)
        sums = minibatch_update(state, episodes)
    assert (state.ref_model is not None) == (preset == "grpo")
    olds, refs = [e.old_logprobs for e in episodes], [e.ref_logprobs for e in episodes]
    assert all(isinstance(x, FakeTensor) and x.device.type == "cpu" for x in olds)
    assert all(isinstance(x, FakeTensor) for x in refs) == (preset == "grpo")
    assert sums["updates"] == 1.0  # the loss, backward, clipping and AdamW's step ran
    assert ("kl_sum" in sums) == (preset == "grpo")
    params = list(state.model.parameters())
    moments = [m for s in state.optimizer.state.values() for m in s.values() if m.dim() > 0]
    assert len(moments) == 2 * len(params) and all(m.device == DEVICE for m in moments)
    assert all(p.device == DEVICE for p in params)
    assert check.answered.count("unique") >= 2  # each micro-batch shared its group's prompt


def test_packed_training_update_on_the_device(tiny_model, tokenizer):
    """``train.packing``: the packed layout's indices go to the device with the batch, and the
    packed forward, its per-row attention and the scatter back stay there."""
    episodes = host_episodes(len(tokenizer))
    # collate reads the rows' prompt indices on the host (no wait): answered as one prompt.
    with DeviceCheck(READS_UPDATE | {"collate": 0}) as check:
        state = train_state("dapo", tiny_model, tokenizer, None, "train.packing=true")
        fill_logprobs(state.model, episodes, "old_logprobs", state)
        sums = minibatch_update(state, episodes)
    assert sums["updates"] == 1.0 and sums["slots"] == sums["real"]  # packed: no padding
    assert all(p.grad is None and p.device == DEVICE for p in state.model.parameters())
    assert check.syncs.count("_shared_prompt_pass") == 0  # prompts are shared in the pack


def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """A stand-in for PyTorch's CUDA-only ``varlen_attn`` whose ops meet all its tensors."""
    touched = k.sum() + v.sum() + cu_q.sum() + cu_k.sum()
    return q * 1 + touched * 0


def packed_update_through_varlen(tokenizer, tiny_model, monkeypatch):
    monkeypatch.setattr(packing, "varlen_dtype", lambda query: query.dtype)
    monkeypatch.setattr(packing, "varlen_kernel", lambda: (fake_varlen_attn, True))
    episodes = host_episodes(len(tokenizer))
    with DeviceCheck(READS_UPDATE | {"collate": 0}) as check:
        state = train_state("dapo", tiny_model, tokenizer, None, "train.packing=true")
        fill_logprobs(state.model, episodes, "old_logprobs", state)
        return minibatch_update(state, episodes), check


def test_packed_training_update_through_varlen_on_the_device(tiny_model, tokenizer, monkeypatch):
    """The GPU's packed attention (one variable-length flash call, ``varlen_packed``): its
    offsets and the gathered prompt keys are made on the compute device."""
    calls = []
    monkeypatch.setattr(packing, "varlen_layout", counted(packing.varlen_layout, calls))
    sums, _ = packed_update_through_varlen(tokenizer, tiny_model, monkeypatch)
    assert sums["updates"] == 1.0 and calls  # the varlen path ran
    assert all(layout.key_index is not None for layout in calls)  # prompts shared: gathered


def test_packed_varlen_catches_a_cpu_tensor(tiny_model, tokenizer, monkeypatch):
    """Negative: offsets built on the host are caught."""
    built = packing.varlen_layout.__wrapped__
    monkeypatch.setattr(
        packing, "varlen_layout", lambda groups, device: built(groups, torch.device("cpu"))
    )
    with mixed_devices():
        packed_update_through_varlen(tokenizer, tiny_model, monkeypatch)


def counted(fn, calls: list):
    def call(*args, **kwargs):
        calls.append(fn(*args, **kwargs))
        return calls[-1]

    return call


@pytest.mark.parametrize("preset", ["dapo", "grpo"])
def test_a_minibatch_update_waits_for_the_device_once_however_many_micro_batches(
    tiny_model, tokenizer, preset
):
    """The mini-batch's metrics (and grpo's KL) and its gradient norm stay on the device
    until the update is done, then come back in one transfer: on a GPU each read waits for
    every kernel queued before it, so a read per micro-batch would stall each one. One
    micro-batch and four (a row each) wait the same once; a micro-batch used to read ~10
    values (forward_slots, _micro_sums, the KL) and ``torch.unique`` of its prompts."""
    syncs = {}
    for budget in (1000, P + T):  # every row in one micro-batch, or one row per micro-batch
        model, reference = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
        episodes = host_episodes(len(tokenizer))
        with DeviceCheck(READS_UPDATE) as check:
            state = train_state(preset, model, tokenizer, reference)
            state.cfg.train.tokens_per_microbatch = budget
            fill_logprobs(state.model, episodes, "old_logprobs", state)
            if state.ref_model is not None:
                fill_logprobs(state.ref_model, episodes, "ref_logprobs", state)
            check.syncs.clear()
            assert minibatch_update(state, episodes)["updates"] == 1.0
        syncs[budget] = check.syncs
    assert len(micro_batches_of(episodes, P + T)) == 4
    # transformers before 5.0 reads its attention mask once per forward pass (a read of its
    # own: 5.x on a GPU too, to pick SDPA's causal path); dapo's own waits are counted.
    own = {
        budget: [site for site in found if not site.startswith("library:")]
        for budget, found in syncs.items()
    }
    assert own[1000] == own[P + T] == ["read"]


def micro_batches_of(episodes: list[Episode], budget: int) -> list[list[int]]:
    order = length_sorted(episodes, range(len(episodes)))
    return split_microbatches(episodes, order, max_tokens=budget)


def test_the_pi_old_pass_brings_its_log_probs_back_in_one_transfer(tiny_model, tokenizer):
    episodes = host_episodes(len(tokenizer))
    with DeviceCheck(READS_UPDATE) as check:
        state = train_state("dapo", tiny_model, tokenizer)
        state.cfg.train.tokens_per_microbatch = P + T  # four micro-batches
        fill_logprobs(state.model, episodes, "old_logprobs", state)
    assert [site for site in check.syncs if not site.startswith("library:")] == ["fill_logprobs"]
    assert [e.old_logprobs.shape for e in episodes] == [(e.length,) for e in episodes]


def test_training_update_catches_a_batch_left_on_the_host(tiny_model, tokenizer, monkeypatch):
    episodes = host_episodes(len(tokenizer))
    with DeviceCheck(READS_UPDATE):
        state = train_state("dapo", tiny_model, tokenizer)
        monkeypatch.setattr(Batch, "to", lambda self, device: self)  # never moved
        with mixed_devices():
            minibatch_update(state, episodes)


@pytest.mark.parametrize(
    "sampling", [{}, {"top_p": 0.9, "temperature": 0.7, "seed": [1, 2]}, {"greedy": True}]
)
def test_native_engine_on_the_device(tiny_model, tokenizer, sampling):
    reads = READS_DECODE | {"finish_rollout": tokenizer.eos_token_id}
    with DeviceCheck(reads) as check:
        engine = native.NativeEngine(on_device(tiny_model), tokenizer)
        assert engine.device == DEVICE
        rollout = engine.generate(PROMPTS, group_size=G, max_new_tokens=2, **sampling)
    tensors = [v for v in vars(rollout).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 7 and all(t.device == DEVICE for t in tensors)
    assert rollout.response_ids_BT.shape == rollout.logprobs_BT.shape == (2 * G, 2)
    assert check.answered.count("retire") == 2  # rows finished and left, the others stepped


def test_native_engine_catches_a_cpu_tensor(tiny_model, tokenizer, monkeypatch):
    reads = READS_DECODE | {"finish_rollout": tokenizer.eos_token_id}
    with DeviceCheck(reads):
        engine = native.NativeEngine(on_device(tiny_model), tokenizer)
        monkeypatch.setattr(native, "torch", ForgetsDevice())  # stop tokens, rows on the CPU
        with mixed_devices():
            engine.generate(PROMPTS, group_size=G, max_new_tokens=2)


def test_hf_engine_on_the_device(tiny_model, tokenizer):
    # Every value transformers' generate reads answers True: its checks of the special tokens
    # warn, and every row has finished after one token.
    reads = {"generate": True, "finish_rollout": tokenizer.eos_token_id}
    with DeviceCheck(reads):
        engine = HFEngine(on_device(tiny_model), tokenizer)
        rollout = engine.generate(PROMPTS, group_size=G, max_new_tokens=2)
    tensors = [v for v in vars(rollout).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 7 and all(t.device == DEVICE for t in tensors)
    assert rollout.logprobs_BT.shape == (2 * G, 1)


@pytest.mark.parametrize("engine_class", [native.NativeEngine, HFEngine])
def test_lora_merged_sampling_on_the_device(tiny_model, tokenizer, engine_class, monkeypatch):
    """A LoRA policy samples from a merged copy made on the device from its weights."""
    pytest.importorskip("peft")
    from dapo.config import LoraConfig
    from dapo.models import lora

    made, real = [], lora.merged_copy
    monkeypatch.setattr(lora, "merged_copy", lambda m: made.append(real(m)) or made[-1])
    reads = READS_DECODE | {"generate": True, "finish_rollout": tokenizer.eos_token_id}
    adapted = lora.apply(copy.deepcopy(tiny_model), LoraConfig(rank=2))
    with DeviceCheck(reads):
        engine = engine_class(on_device(adapted), tokenizer)
        rollout = engine.generate(PROMPTS, group_size=G, max_new_tokens=2)
    assert len(made) == 1 and rollout.response_ids_BT.device == DEVICE
    tensors = [*made[0].parameters(), *made[0].buffers()]
    assert all(isinstance(t, FakeTensor) and t.device == DEVICE for t in tensors)


def test_prompts_and_batches_go_to_the_device(tokenizer):
    episodes = host_episodes(len(tokenizer))
    with DeviceCheck():
        ids, mask = encode_prompts(tokenizer, PROMPTS, DEVICE)
        batch = collate(episodes, pad_id=tokenizer.pad_token_id).to(DEVICE)
    assert ids.device == mask.device == DEVICE and ids.shape == mask.shape and len(ids) == 2
    fields = vars(batch)
    assert fields.pop("packing") is None  # padded (train.packing's layout: the test above)
    assert len(fields) == 13 and all(v.device == DEVICE for v in fields.values())


def test_static_decoding_on_the_device(tiny_model, tokenizer, monkeypatch):
    """The CUDA-graph path's loop (graphs off: meta runs eagerly) with every buffer on the
    device; its only waits are the read-backs, one per ``CHECK_EVERY`` steps."""
    monkeypatch.setattr(static_decode, "CHECK_EVERY", 2)
    reads = {"read_back": False}  # no row has finished at any read-back
    with DeviceCheck(reads) as check:
        model = on_device(tiny_model)
        ids, mask = encode_prompts(tokenizer, PROMPTS, DEVICE)
        tokens, logprobs, slots = static_decode.static_decode(
            model,
            ids,
            mask,
            group_size=G,
            max_new_tokens=5,
            stop_token_ids=[0],
            pad_token_id=tokenizer.pad_token_id,
            top_p=0.9,
            seed=[1, 2],
            graphs=False,
        )
    assert tokens.device == logprobs.device == DEVICE and tokens.shape == (2 * G, 5)
    assert slots == 5 * 2 * G
    own = [site for site in check.syncs if not site.startswith("library:")]
    # Five steps: the first drawn from the prefill, then steps 1-4 on the buffers, read back
    # after every second one and after the last: 3 waits, none per token.
    assert own == ["read_back"] * 3


def test_static_decoding_catches_a_cpu_tensor(tiny_model, tokenizer, monkeypatch):
    with DeviceCheck({"read_back": False}):
        model = on_device(tiny_model)
        ids, mask = encode_prompts(tokenizer, PROMPTS, DEVICE)
        monkeypatch.setattr(static_decode, "torch", ForgetsDevice())  # state on the CPU
        with mixed_devices():
            static_decode.static_decode(
                model,
                ids,
                mask,
                group_size=G,
                max_new_tokens=3,
                stop_token_ids=[0],
                pad_token_id=tokenizer.pad_token_id,
                graphs=False,
            )


def test_episodes_continue_from_parked_caches_on_the_device(tiny_model, tokenizer):
    """A turn whose rows park their caches at a turn end (token 2), then the next turn from
    them (dapo/rollout/parking.py): the parked keys stay on the device, and the prefix cache,
    the prefill over the added tokens and the decoding after it run there. Reads: every row
    of the first turn ends at step 0 with token 2 after 2 tokens, and parks as row 0."""
    reads = READS_DECODE | {"finish_rollout": tokenizer.eos_token_id, "park": 0, "rows": 2}
    with DeviceCheck(reads):
        engine = native.NativeEngine(on_device(tiny_model), tokenizer)
        first = engine.generate(PROMPTS, group_size=G, max_new_tokens=2, park_at=[2])
        parked = first.parked[0]
        assert parked is not None and first.parked[1:] == [None] * (2 * G - 1)
        assert all(t.device == DEVICE for t in parked.keys + parked.values)
        contexts = [[*parked.tokens, 2, 5, 6], [3, 4, 5]]
        rollout = engine.generate(
            contexts, group_size=1, max_new_tokens=2, prefixes=[parked, None], park_at=[2]
        )
    tensors = [v for v in vars(rollout).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 7 and all(t.device == DEVICE for t in tensors)
    assert rollout.response_ids_BT.shape == (2, 2)


def test_parking_catches_a_cpu_tensor(tiny_model, tokenizer, monkeypatch):
    reads = READS_DECODE | {"finish_rollout": tokenizer.eos_token_id, "park": 0, "rows": 2}
    with DeviceCheck(reads):
        engine = native.NativeEngine(on_device(tiny_model), tokenizer)
        monkeypatch.setattr(parking, "torch", ForgetsDevice())  # the turn-end tokens on the CPU
        with mixed_devices():
            engine.generate(PROMPTS, group_size=G, max_new_tokens=2, park_at=[2])


@pytest.fixture
def pinned(monkeypatch) -> list[tuple[int, ...]]:
    """DEVICE taken for a CUDA device by :mod:`dapo.data.transfer`: host tensors go through
    page-locked memory (pinning stood in: the CPU wheel cannot pin) and an asynchronous copy.
    Lists the shapes pinned."""
    shapes: list[tuple[int, ...]] = []

    def pin_memory(self, *args, **kwargs):
        # A strided source would be copied through a pageable temporary: none is pinned.
        assert self.is_contiguous(), f"a strided tensor {tuple(self.shape)} pinned"
        shapes.append(tuple(self.shape))
        return self

    monkeypatch.setattr(transfer, "ASYNC_DEVICE_TYPES", ("cuda", DEVICE.type))
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return shapes


def test_the_check_lists_blocking_copies_to_the_device():
    host = torch.ones(3)
    ops = {  # whether each op is a blocking copy to the device
        "to": (lambda: host.to(DEVICE), True),
        "copy_": (lambda: torch.empty(3, device=DEVICE).copy_(host), True),
        "tensor": (lambda: torch.tensor([1, 2], device=DEVICE), True),
        "as_tensor": (lambda: torch.as_tensor([1, 2], device=DEVICE), True),
        "new_tensor": (lambda: torch.ones(2, device=DEVICE).new_tensor(3.0), True),
        "to, non_blocking": (lambda: host.to(DEVICE, non_blocking=True), False),
        "copy_, non_blocking": (
            lambda: torch.empty(3, device=DEVICE).copy_(host, non_blocking=True),
            False,
        ),
        "a fill": (lambda: torch.full((), 3.0, device=DEVICE), False),
        "empty": (lambda: torch.tensor([], device=DEVICE), False),
        "on the host": (lambda: torch.tensor([1, 2]), False),
    }
    with DeviceCheck() as check:
        for name, (op, blocking) in ops.items():
            before = len(check.copies)
            op()
            assert len(check.copies) - before == int(blocking), name
    assert torch.tensor is not ops["tensor"][0]  # the factories are unwrapped after the block


def test_to_device_pins_and_copies_asynchronously(pinned):
    host = torch.arange(6).view(2, 3)
    factory = torch.tensor
    assert transfer.to_device(host, "cpu") is host
    with DeviceCheck() as check:
        moved = transfer.to_device(host, DEVICE)
        assert transfer.to_device(moved, DEVICE) is moved  # there already
        column = transfer.to_device(host[:, 1:], DEVICE)  # strided: made contiguous first
    assert moved.device == DEVICE and moved.shape == (2, 3) and moved.dtype == torch.long
    assert column.device == DEVICE and column.shape == (2, 2)
    assert check.copies == [] and pinned == [(2, 3), (2, 2)]
    assert torch.tensor is factory  # DeviceCheck unwrapped it


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("asynchronous", [True, False])
def test_micro_batches_reach_the_device_without_waiting(
    tiny_model, tokenizer, request, packed, asynchronous
):
    """On CUDA a blocking copy from the host waits for the queue, so each micro-batch's copies
    would wait for the backward pass of the one before it, and the card would idle while the
    host collates the next. The pi_old pass's and the update's host tensors (the collated
    micro-batches, the packed layout) go through page-locked memory and an asynchronous copy:
    no copy waits. Without that (``asynchronous`` False: what a plain ``.to`` did), the check
    finds each of them."""
    shapes = request.getfixturevalue("pinned") if asynchronous else []
    episodes = host_episodes(len(tokenizer))
    extra = ("train.packing=true",) if packed else ()
    with DeviceCheck(READS_UPDATE | {"collate": 0}) as check:
        state = train_state("dapo", tiny_model, tokenizer, None, *extra)
        check.copies.clear()
        fill_logprobs(state.model, episodes, "old_logprobs", state)
        assert minibatch_update(state, episodes)["updates"] == 1.0
    # Two passes (pi_old, the update) of two micro-batches, each of 13 tensors, 4 more packed.
    moved = 2 * 2 * (17 if packed else 13)
    if asynchronous:
        assert check.copies == [] and len(shapes) == moved
    else:
        assert check.copies == ["to_device"] * moved


def test_the_varlen_layout_reaches_the_device_without_waiting(
    tiny_model, tokenizer, monkeypatch, pinned
):
    calls = []
    packing.varlen_layout.cache_clear()  # a layout of an earlier test would not be copied
    monkeypatch.setattr(packing, "varlen_layout", counted(packing.varlen_layout, calls))
    sums, check = packed_update_through_varlen(tokenizer, tiny_model, monkeypatch)
    # The layouts were built under the check (a blocking copy would be listed) and pinned.
    assert sums["updates"] == 1.0 and calls and check.copies == []
    assert len(pinned) > 2 * 2 * 17  # the micro-batches' tensors and the layouts' offsets
