"""The training state: the objects a run trains with, and the counters a resumed run restores.

:class:`TrainState` holds the policy, its optimizer, the prompt sampler, the engine that
evaluates (and, taking turns, generates), the frozen copies under ``torchrun`` and the step's
counters; :func:`build_state` makes it from the config. The step (:mod:`dapo.training.step`)
and its update (:mod:`dapo.training.update`) read the config sections they need from
``state.cfg`` and hand each function below them the sections it uses; the loop
(:mod:`dapo.training.loop`) saves and restores :meth:`TrainState.state_dict`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo import dist
from dapo.config import Config
from dapo.config.env import EnvConfig
from dapo.data.problems import Problem, PromptSampler
from dapo.dist import fsdp
from dapo.env import load_environment
from dapo.models import lora
from dapo.models.packing import use_packing
from dapo.models.policy import DTYPES, compute_device, model_dir, stop_token_ids
from dapo.reward.custom import make_resolver
from dapo.reward.pool import RewardPool
from dapo.rollout import Engine, make_engine
from dapo.rollout.base import LiveModelEngine
from dapo.rollout.episodes import EpisodeRunner, with_turn_ends
from dapo.run import model_files
from dapo.run.metrics import accumulate
from dapo.training.copies import copies_and_shards, fill_tp_copy
from dapo.training.rounds import Drawer


@dataclass
class TrainState:
    cfg: Config
    """The run's config, as checked before the run started; never written to."""
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    sampler: PromptSampler
    engine: Engine
    """Evaluates, and draws the rollouts when they are drawn in turn; told after each step's
    updates to sample from the new weights."""
    ref_model: torch.nn.Module | None = None
    """The frozen KL reference (a copy of the starting policy); None without a KL term, and
    with LoRA, whose reference is the policy with its adapters off (:meth:`reference`)."""
    ref_adapters_off: bool = False
    """The KL reference is the policy with its LoRA adapters switched off: the base model."""
    base_model: dict[str, Any] | None = None
    """With LoRA: the frozen base the adapters belong to (path, revision, digest), which
    every checkpoint names and a resume checks; None otherwise."""
    pool: RewardPool | None = None
    """Grades responses; None grades in-process (exceptions caught, hangs not stoppable)."""
    step: int = 0
    consecutive_skips: int = 0
    """Updates skipped in a row for a non-finite loss or gradient norm."""
    on_phase: Callable[[str], None] = lambda _phase: None
    """Told each phase of a step as it starts (generate, reward, train, eval, save)."""
    timers: dict[str, float] = field(default_factory=dict)
    """Seconds (and counts) of the running step's phases, for the perf/* metrics."""
    sampling_prior: tuple[int, int] = (0, 0)
    """(mixed groups, prompts drawn) of the last step drawn in turn: its kept fraction sizes
    the next step's rounds."""
    sampler_logprobs_checked: bool = False  # against a forward pass, in this process
    scaler: torch.amp.GradScaler | None = None
    """Scales the loss of float16 computation on float32 weights (its gradients underflow
    otherwise); None in float32 and bfloat16."""

    device: torch.device = torch.device("cpu")
    """The run's compute device (:func:`~dapo.models.policy.compute_device`): every tensor of
    the step goes there, not where a parameter is (CPU offload keeps shards on the host)."""
    gen_model: torch.nn.Module | None = None
    """Under FSDP: a copy of the policy in the compute dtype that the engine samples from (a
    sharded model's forward is a collective, and ranks generate different lengths), whole or
    split over ``tp_mesh``'s groups, refreshed from the shards by :meth:`sync_engine`; None in
    one process, and for the vllm engine (it loads its own weights from the shards)."""
    engine_behind: bool = False
    """The engine's weights are older than the policy's: with generator ranks the trainers'
    engine only evaluates, so it is refreshed before an evaluation, not after every update."""
    tp_mesh: Any = None
    """With ``rollout.tp_size`` > 1: the ("dp", "tp") mesh of the ranks that generate together
    (:mod:`dapo.dist.tensor_parallel`); None otherwise."""
    episodes: EpisodeRunner | None = None
    """Runs the environment's multi-turn episodes on ``engine`` (``env.class``), for the
    rollouts drawn in turn and for evaluation; None: single-turn."""

    def sync_engine(self) -> None:
        """Tell the engine the weights changed (after updates, after a resume); under FSDP,
        gather the shards into the whole copy first. Timed (``perf/weight_sync_s``) where
        there is something to copy: a gather, or an engine with its own weights (vllm)."""
        t0 = time.perf_counter()
        if self.tp_mesh is not None and self.gen_model is not None:
            fill_tp_copy(self.model, self.gen_model)
        elif self.gen_model is not None:
            fsdp.gather_into(self.model, self.gen_model)
        self.engine.sync_weights(self.model if self.gen_model is None else self.gen_model)
        if self.gen_model is not None or not isinstance(self.engine, LiveModelEngine):
            accumulate(self.timers, "weight_sync", time.perf_counter() - t0)
        self.engine_behind = False

    @property
    def has_reference(self) -> bool:
        """Whether the loss has a KL term against a frozen reference."""
        return self.ref_model is not None or self.ref_adapters_off

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The KL reference for the block: its frozen copy, or the policy with its adapters
        off."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        with lora.adapters_off(self.model):
            yield self.model

    def state_dict(self) -> dict[str, Any]:
        """The counters and cursors a resumed run needs (JSON); the weights and the optimizer
        state are saved beside them by :func:`dapo.run.checkpoint.save`."""
        state = {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "consecutive_skips": self.consecutive_skips,
            "sampling_prior": list(self.sampling_prior),
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.consecutive_skips = state["consecutive_skips"]
        self.sampling_prior = tuple(state.get("sampling_prior", (0, 0)))
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def _base_model(cfg: Config, model: torch.nn.Module) -> dict[str, Any] | None:
    if not lora.enabled(model):
        return None
    where = None if cfg.model.path == "embedded" else model_dir(cfg)
    base = model_files.base_reference(cfg.model.path, cfg.model.revision, where, model)
    # The adapters' shape and scale as trained, and the dtype the base was loaded in: a
    # resume may change model.lora or model.param_dtype (--force), and an export of an
    # earlier step must merge with the settings of that step.
    trained = {"lora": lora.trained_settings(cfg.model.lora), "param_dtype": cfg.model.param_dtype}
    return {**base, **trained}


def drawer_for(cfg: Config, **objects: Any) -> Drawer:
    """A drawer of rounds following ``cfg``'s sections, around ``objects`` (tokenizer, engine,
    sampler, model; optionally pool, tp_mesh, timers, on_phase, stopping)."""
    t = cfg.train
    sections = (cfg.rollout, cfg.sampling, cfg.algo, cfg.data, cfg.reward.grader)
    if "episodes" not in objects:  # a drawer of its own engine: a runner of its own too
        objects["episodes"] = runner_for(
            cfg, objects["engine"], objects["tokenizer"], objects.get("tp_mesh")
        )
    return Drawer(*sections, t.seed, t.prompts_per_step, **objects)


def runner_for(
    cfg: Config, engine: Engine, tokenizer: Any, tp_mesh: Any = None
) -> EpisodeRunner | None:
    """The runner of the environment the run's ``env`` section names, on ``engine``, its
    episodes' rewards within ``reward.max_abs``, the first rank of each ``tp_mesh`` group
    answering for the group; None for single-turn rollouts (no ``env.class``)."""
    settings = cfg.env
    env = load_environment(settings.class_, settings)
    if env is None:
        return None
    agree = None
    if tp_mesh is not None:
        agree = functools.partial(dist.from_first_of, tp_mesh.get_group("tp"))
    return EpisodeRunner(
        engine,
        tokenizer,
        env,
        max_turns=settings.max_turns,
        max_observation_tokens=settings.max_observation_tokens,
        workers=settings.workers,
        step_timeout_s=settings.step_timeout_s,
        max_abs=cfg.reward.max_abs,
        agree=agree,
    )


def close_episodes(runner: EpisodeRunner | None) -> None:
    """Close the environment of ``runner`` (one :func:`runner_for` made) when its run or
    evaluation ends: the Python tool's helper processes stop here, not at the interpreter's
    exit (:meth:`dapo.env.python_tool.Launcher.close`)."""
    if runner is not None:
        runner.env.close()


def engine_options(cfg: Config) -> dict[str, bool]:
    """The dapo and hf engines' settings from the run's config (``make_engine``'s keywords)."""
    return dict(
        cuda_graphs=cfg.rollout.cuda_graphs,
        compile_step=cfg.rollout.compile_step,
        merged_sampling=cfg.model.lora.merged_sampling,
    )


def engine_stops(stops: Sequence[int], tokenizer: Any, settings: EnvConfig) -> list[int]:
    """:func:`with_turn_ends` of the environment ``settings`` names."""
    return with_turn_ends(stops, tokenizer, load_environment(settings.class_, settings))


def reward_pool(cfg: Config, reward_fn: Callable[..., Any] | None = None) -> RewardPool:
    """The pool that grades the run's responses (``reward.*``; ``reward_fn``: the function
    ``reward.function`` names, given in Python; code rows under ``code.*``)."""
    r = cfg.reward
    return RewardPool(
        workers=r.workers,
        timeout_s=r.timeout_s,
        memory_mb=r.memory_mb,
        batch_timeout_s=r.batch_timeout_s,
        resolve=make_resolver(r.function, reward_fn, cfg.code),
        max_abs=r.max_abs,
    )


FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Devices whose runs step torch's fused AdamW kernel (:func:`adamw`)."""


def adamw(params: list[torch.nn.Parameter], **hyper: Any) -> torch.optim.AdamW:
    """AdamW over ``params``: torch's fused kernel when they are all on CUDA devices, else
    torch's default (a CPU run steps bit for bit as before).

    On CUDA torch defaults to its multi-tensor ``foreach`` path: some ten element-wise passes
    over the weights, gradients and moments, each reading and writing them in memory. The
    fused kernel reads each once and writes the weight and moments once (28 bytes a float32
    weight). A resumed run keeps this choice whichever kind wrote its checkpoint
    (:func:`dapo.dist.dcp.kernels_kept`)."""
    fused = bool(params) and all(p.device.type in FUSED_DEVICE_TYPES for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **hyper)


def build_state(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    train_problems: list[Problem],
    device: torch.device | None = None,
) -> TrainState:
    """The run's state around ``model``, computing on ``device`` (default: ``model.device``'s,
    :func:`compute_device`); under ``torchrun``, see :mod:`dapo.training.copies`."""
    device = device or compute_device(cfg.model.device)
    compute = DTYPES[cfg.model.compute_dtype]
    ref_model, gen_model, tp_mesh = copies_and_shards(cfg, model, compute, device)
    if cfg.train.packing:  # the passes that train or score; generation copies attend as before
        for scorer in (model, ref_model):
            if scorer is not None:
                use_packing(scorer)
    o = cfg.optim
    # Only what trains: with LoRA the adapters, whose state is all the optimizer holds.
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(trained, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    sampler = PromptSampler(train_problems, seed=cfg.train.seed)
    stops = engine_stops(
        stop_token_ids(model, tokenizer, cfg.rollout.stop_token_ids), tokenizer, cfg.env
    )
    engine = make_engine(
        cfg.rollout.engine,
        gen_model or model,
        tokenizer,
        stops,
        compute,
        vllm=vars(cfg.vllm) | ({"tensor_parallel_size": cfg.rollout.tp_size} if tp_mesh else {}),
        device=device,
        **engine_options(cfg),
    )
    scaler = None
    if compute == torch.float16 and next(model.parameters()).dtype == torch.float32:
        scaler = torch.amp.GradScaler(device.type)
    return TrainState(
        cfg,
        model,
        tokenizer,
        optimizer,
        sampler,
        engine,
        ref_model=ref_model,
        ref_adapters_off=cfg.algo.kl_coef > 0 and lora.enabled(model),
        base_model=_base_model(cfg, model),
        scaler=scaler,
        device=device,
        gen_model=gen_model,
        tp_mesh=tp_mesh,
        episodes=runner_for(cfg, engine, tokenizer, tp_mesh),
    )
