"""The ``vllm`` rollout engine: vLLM in the training process (colocated), given the trainer's
weights after every update.

vLLM brings what a hand-written decoding loop lacks at the paper's scale (paged KV cache,
continuous batching, CUDA graphs), and two obligations with it:

- it holds its own copy of the weights, so :meth:`VLLMEngine.sync_weights` loads the new ones
  (or the new LoRA adapters alone) after every optimizer update (in place, through the
  worker's ``reload_weights``, in the compute dtype; tied embeddings included, as
  ``state_dict`` lists ``lm_head.weight``) and resets the prefix cache, whose KV entries the
  old weights computed;
- its log-probs come from other kernels and batch shapes than the trainer's forward pass, so
  they never stand in for pi_old (``exact_logprobs = False``): the trainer recomputes pi_old
  and corrects for the gap (:mod:`dapo.algo.correction`).

The engine starts from the model's ``config.json`` alone with dummy weights (nothing is read
from disk), then takes the trainer's weights. Prompts go in as token ids and responses come
back as token ids (vLLM never sees the tokenizer), so both engines tokenize and decode alike.
One request per prompt with n = G and the prompt's seed: vLLM seeds sample j of a request with
seed + j, so a prompt's responses depend on its seed, not on the prompts beside it (up to the
float rounding of other batch shapes). Log-probs are vLLM's ``processed_logprobs``: after
temperature, as the native engine records them; with top-p < 1 they are of the truncated
distribution the tokens were really drawn from.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before it starts) so that the
weights are handed over as tensors. Starting it reseeds the global RNGs and, on a CPU, replaces
``torch.set_num_threads``: both are put back, so a run's own random stream and thread control
are what they would be without vLLM.

On GPUs, the engine runs on the run's compute device. vLLM's one-process executor takes its
GPU from the device *type* ("cuda": GPU 0, on every rank), so under ``torchrun`` it is started
with its external-launcher executor, whose worker takes the GPU from ``LOCAL_RANK`` (set to
this rank's GPU while it starts; each rank's engine is then one replica of an
external data-parallel group), and the trainer's current CUDA device, which vLLM's worker
sets, is put back and checked. Between rollouts it sleeps at level 2 (weights and KV cache
released, nothing copied to host memory: the weights are reloaded anyway, after every
update, or from the trainer's module when it wakes without one) when its source is a whole
module (one process, or a generator rank's copy under ``torchrun``), and at level 1 (the
weights kept in host memory) when its source is FSDP-sharded or has LoRA adapters (the
frozen base then stays loaded, and each sync moves the adapters alone).
``torch.cuda.empty_cache()`` hands the trainer's cached blocks back before it wakes.

Under ``torchrun`` the weights come straight from the FSDP2 shards, one whole tensor at a time
(:func:`dapo.dist.fsdp.whole_state`): the engine's copy is the only generation copy a rank
holds. With ``rollout.tp_size`` = k (``tensor_parallel_size``), each group of k consecutive
ranks (the groups of :func:`dapo.dist.tensor_parallel.tp_mesh`) runs one engine through the
external launcher, on CPUs too: each rank is one of its tensor-parallel workers, keeps its
slice of each tensor as it is loaded, and every rank of a group is given the same prompts
and seeds, so the group decodes in lockstep and returns the same rollout on each rank.

A policy with LoRA adapters (``model.lora``): the base is loaded once and each sync moves
the adapters alone (:mod:`dapo.rollout.vllm_lora`).

Shapes: see :mod:`dapo.rollout.base`.
"""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dapo import dist
from dapo.dist import fsdp
from dapo.extras import pip_install
from dapo.models import lora
from dapo.rollout import vllm_lora, vllm_process
from dapo.rollout.base import Prompts, Rollout, check_request, encode_prompts, finish_rollout
from dapo.run.seeding import derive_seed

CPU_KV_CACHE_GIB = 1.0
"""KV-cache size on a CPU when ``vllm.kv_cache_gib`` is 0 (vLLM's own default reserves a
fraction of all host memory, which the trainer needs)."""
SEED_LIMIT = 2**63
"""vLLM seeds sample j of a request with seed + j; seeds stay below this."""


def _check_cpu_head_size(config: Any) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // max(
        config.num_attention_heads, 1
    )
    if head_dim % 32:
        raise ValueError(
            "rollout.engine=vllm on a CPU needs an attention head size that is a multiple of 32 "
            f"(vLLM's CPU kernels); this model's is {head_dim}. Use rollout.engine=dapo, or for "
            "the embedded model an embedded.hidden that is a multiple of 128 (4 heads)"
        )


def _check_device(config: Any, device: torch.device) -> None:
    if device.type != "cuda":
        _check_cpu_head_size(config)
    elif not dist.launched() and (device.index or 0) != 0:
        raise ValueError(
            f"rollout.engine=vllm in one process runs on the first visible GPU, not "
            f"{device}: pick the GPU with CUDA_VISIBLE_DEVICES={device.index} "
            "and model.device=auto"
        )


def _vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(install_hint()) from e
    return vllm


def install_hint(setting: str = "rollout.engine=vllm") -> str:
    """What to run when vLLM is missing (the command fits how dapo was installed), for the
    ``setting`` that asked for it."""
    return (
        f"{setting} needs vLLM (Python >= 3.11): {pip_install('vllm')}; on a "
        "machine without a GPU, the CPU install lines are in docs/guides/rollout-engines.md"
    )


class VLLMEngine:
    """Samples with a colocated vLLM engine; see the module docstring. It computes in
    ``compute_dtype`` (default: the model's); the keyword options are the run's ``vllm``
    config section (:class:`dapo.config.setup.VLLMConfig` documents each)."""

    exact_logprobs = False

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        stop_token_ids: Sequence[int] = (),
        compute_dtype: torch.dtype | None = None,
        *,
        gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float = 0.0,
        max_num_seqs: int = 256,
        enforce_eager: bool = False,
        sleep: bool = True,
        device: torch.device | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        vllm = _vllm()
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids) or (tokenizer.eos_token_id,)
        param = next(model.parameters())
        self.dtype = compute_dtype or param.dtype
        self.device = device or param.device
        self.on_gpu = self.device.type == "cuda"
        _check_device(model.config, self.device)
        self.sleeps = self.on_gpu and sleep
        self.tp_size = tensor_parallel_size
        # A sharded source is reloaded by gathers that every rank joins in step, which the
        # wake-up before each generate call (as many as a rank's share of prompts needs)
        # cannot promise; and with LoRA a dropped base would go to vLLM again at every sync,
        # where the adapters alone move. Either way the weights sleep in host memory.
        self.sleep_level = 1 if fsdp.is_sharded(model) or lora.enabled(model) else 2
        self._asleep: set[str] = set()
        self._source: torch.nn.Module = model
        """The module whose weights the engine holds (reloaded after a level-2 sleep)."""
        self.last_sync_s = 0.0
        """Seconds the last :meth:`sync_weights` took."""
        self.last_sync_bytes = 0
        """Bytes of the tensors the last :meth:`sync_weights` handed to vLLM."""
        # config.json is all vLLM reads: it starts with dummy weights and takes ours below.
        self._dir = tempfile.mkdtemp(prefix="dapo-vllm-")
        vllm_process.TEMPORARY_DIRS.add(self._dir)
        weakref.finalize(self, vllm_process.remove_temporary_dirs, self._dir)
        model.config.save_pretrained(self._dir)
        self.adapters = vllm_lora.AdapterSlot(model, self._dir) if lora.enabled(model) else None
        """The LoRA adapter vLLM serves, when the policy has adapters."""
        self._base_loaded = False
        kwargs = self._llm_options(
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            sleep=sleep,
        )
        kwargs.update(vllm_lora.llm_options(model))
        self.shared_memory_released = self._start(vllm, kwargs)
        """Names of the CPU tensor-parallel group's shared memory this rank removed once the
        engine started (:func:`dapo.rollout.vllm_process.release_shared_memory`)."""
        self.sync_weights(model)

    def _start(self, vllm: Any, kwargs: dict[str, Any]) -> list[str]:
        """Start vLLM in this process with ``kwargs``, leaving the process as it was; returns
        the names of shared memory removed once it started (CPU tensor parallelism)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with vllm_process.state_kept(), vllm_process.on_device(self.device):
            with vllm_process.shared_memory_checked():
                self.llm = vllm.LLM(**kwargs)
        if self.tp_size > 1 and not self.on_gpu:
            return vllm_process.release_shared_memory()
        return []

    def _llm_options(
        self,
        *,
        gpu_memory_utilization: float,
        kv_cache_gib: float,
        max_num_seqs: int,
        enforce_eager: bool,
        sleep: bool,
    ) -> dict[str, Any]:
        """``vllm.LLM``'s arguments for this engine (see the module docstring)."""
        kwargs: dict[str, Any] = dict(
            model=self._dir,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=str(self.dtype).removeprefix("torch."),
            seed=0,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # never a checkpoint's sampling defaults
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager or not self.on_gpu,
        )
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep)
        else:
            # A seeded request whose prompt is cut across two scheduler steps has its sampled
            # token discarded and its generator rewound, which a CPU generator cannot do.
            kwargs["enable_chunked_prefill"] = False
            # vLLM pins its OpenMP threads to cores, and in-process they are the trainer's too:
            # pinned, the demo generated 4.6k tokens/s and trained 4.6k; unpinned 6.8k and 6.7k.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kv_gib = kv_cache_gib or (0.0 if self.on_gpu else CPU_KV_CACHE_GIB)
        if kv_gib:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        if self.on_gpu and dist.launched():
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.tp_size > 1:  # one engine per group of consecutive ranks, as tp_mesh groups them
            kwargs["tensor_parallel_size"] = self.tp_size
            kwargs["distributed_executor_backend"] = "external_launcher"
        return kwargs

    def close(self) -> None:
        """Shut vLLM down while the process group is still there: its teardown destroys its
        own groups and the default one (under torchrun, the trainer's, which is done with it:
        the run calls this last). Left to exit time, it would find that group gone."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load ``model``'s current weights into the engine (in the compute dtype, one tensor at
        a time; with LoRA, the adapters alone once the base is there) and drop the prefix
        cache, which holds KV entries of the old weights."""
        t0 = time.perf_counter()
        self._source = model
        self._wake(["weights"], reload=False)
        self._load(model)
        self.last_sync_s = time.perf_counter() - t0

    def _load(self, model: torch.nn.Module) -> None:
        # One whole tensor at a time (gathered from the shards under FSDP2); with tensor
        # parallelism vLLM's layers keep their slice of each and drop the rest.
        self.last_sync_bytes = 0
        weights = None
        if self.adapters is None:
            weights = fsdp.whole_state(model, self.dtype)
        elif not self._base_loaded:  # once, and after a sleep that dropped it
            weights = vllm_lora.base_weights(model, self.dtype)
        if weights is not None:
            weights = self._counted(weights)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self._base_loaded = True
        if self.adapters is not None:
            self.adapters.load(self.llm, model, self.dtype, self._counted)
        self.llm.reset_prefix_cache()

    def _counted(self, weights: vllm_lora.Weights) -> vllm_lora.Weights:
        for name, tensor in weights:
            self.last_sync_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def _wake(self, tags: list[str] | None = None, *, reload: bool = True) -> None:
        """Wake what sleeps of ``tags`` (all by default). The trainer's cached GPU blocks go
        back first, or vLLM would find the memory it gave up still held; weights a level-2
        sleep discarded are reloaded from the module they came from (unless the caller
        loads new ones)."""
        wanted = set(self._asleep) if tags is None else self._asleep & set(tags)
        if not wanted:
            return
        if self.on_gpu:
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=sorted(wanted))
        self._asleep -= wanted
        if "weights" in wanted and self.sleep_level == 2:
            self._base_loaded = False  # dropped (level 1 keeps base and adapter in host memory)
            if reload:
                self._load(self._source)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Prompts,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | Sequence[int] = 0,
        greedy: bool = False,
        ignore_eos: bool = False,
    ) -> Rollout:
        """See :class:`dapo.rollout.base.Engine`. With one ``seed``, prompt i's seed is derived
        from (seed, "prompt", i)."""
        check_request(prompts, group_size, max_new_tokens, temperature, top_p, greedy)
        if isinstance(seed, int):
            seeds = [derive_seed(seed, "prompt", i) for i in range(len(prompts))]
        else:
            seeds = [int(s) for s in seed]
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one each")
        ids_nP, mask_nP = encode_prompts(self.tokenizer, prompts, torch.device("cpu"))
        requests = [
            {"prompt_token_ids": ids[m.bool()].tolist()}
            for ids, m in zip(ids_nP, mask_nP, strict=True)
        ]
        params = [
            self._params(
                s,
                group_size,
                max_new_tokens,
                temperature,
                top_p,
                greedy=greedy,
                ignore_eos=ignore_eos,
            )
            for s in seeds
        ]
        self._wake()
        adapter = {"lora_request": self.adapters.request} if self.adapters else {}
        outputs = self.llm.generate(requests, params, use_tqdm=False, **adapter)
        if self.sleeps:  # give the memory back to the trainer until the next rollout
            # Level 2: the weights are dropped, not copied to host memory (level 1): they are
            # reloaded after the update anyway (level 1 for a sharded source or LoRA's frozen
            # base: see __init__).
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}
        rows = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        if len(rows) != len(prompts) * group_size:
            raise RuntimeError(
                f"vLLM returned {len(rows)} responses for {len(prompts)} x {group_size}"
            )
        response_ids_BT, logprobs_BT = self._padded(rows)
        return finish_rollout(
            self.tokenizer,
            ids_nP.repeat_interleave(group_size, dim=0),
            mask_nP.repeat_interleave(group_size, dim=0),
            response_ids_BT,
            logprobs_BT,
            sum(len(c.token_ids) for c in rows),  # continuous batching: no padded slots
            self.stop_token_ids,
        )

    def _params(self, seed, group_size, max_new_tokens, temperature, top_p, *, greedy, ignore_eos):
        """One prompt's request: G samples from ``seed``, every knob set explicitly."""
        from vllm import SamplingParams

        return SamplingParams(
            n=group_size,
            max_tokens=max_new_tokens,
            min_tokens=max_new_tokens if ignore_eos else 0,  # benchmarks: fixed work
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=0,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            seed=seed % (SEED_LIMIT - group_size),
            stop_token_ids=list(self.stop_token_ids),
            logprobs=0,
            detokenize=False,
        )

    def _padded(self, rows: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, log-probs) of vLLM's completions, right padded to the longest."""
        width = max(len(c.token_ids) for c in rows)
        response_ids_BT = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        logprobs_BT = torch.zeros((len(rows), width))
        for b, c in enumerate(rows):
            tokens = list(c.token_ids)
            response_ids_BT[b, : len(tokens)] = torch.tensor(tokens)
            logprobs_BT[b, : len(tokens)] = torch.tensor(
                [step[t].logprob for step, t in zip(c.logprobs, tokens, strict=True)]
            )
        return response_ids_BT, logprobs_BT
