"""The DAPO training step, top to bottom. No maths here: every formula is in :mod:`dapo.algo`.

One step (spec, "One training step"):

1. draw prompts, sample G responses each, grade them, shape rewards      ``rollout_round``
2. dynamic sampling: repeat 1 until N mixed groups are kept              ``sampling.collect_groups``
3. group-normalised advantages                                           ``assign_advantages``
4. pi_old (and pi_ref) log-probs, then mu epochs of mini-batch updates   ``update.update``

Phase 4, the update with its exact token-level accumulation, is :mod:`dapo.training.update`
(the divisor of each mini-batch, ``num_tokens``, an explicit value summed over ranks by
:mod:`dapo.dist`, not hidden inside the loss); the loop around the step (evaluation,
checkpoints, resume, signals, the run's outputs) is :mod:`dapo.training.loop`.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dapo import algo, dist
from dapo.config import Config
from dapo.data.batch import Episode
from dapo.data.problems import Problem, PromptSampler
from dapo.data.prompts import render_prompt
from dapo.dist import fsdp, tensor_parallel
from dapo.models.policy import DTYPES, compute_device, stop_token_ids
from dapo.reward.pool import GradeResult, RewardPool, grading_job
from dapo.rollout import Engine, Sample, generate_samples, make_engine
from dapo.rollout.base import LiveModelEngine
from dapo.run.metrics import accumulate
from dapo.run.seeding import derive_seed
from dapo.training import exchange, sampling
from dapo.training.copies import copies_and_shards
from dapo.training.perf import step_perf
from dapo.training.sampling import Group, SamplingResult, collect_groups
from dapo.training.update import update

if TYPE_CHECKING:
    from dapo.training.ahead import Ahead
    from dapo.training.remote import Remote


@dataclass
class TrainState:
    cfg: Config
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    sampler: PromptSampler
    engine: Engine
    """Draws the rollouts; told after each step's updates to sample from the new weights."""
    ref_model: torch.nn.Module | None = None
    pool: RewardPool | None = None
    """Grades responses; None grades in-process (exceptions caught, hangs not stoppable)."""
    step: int = 0
    consecutive_skips: int = 0
    """Updates skipped in a row for a non-finite loss or gradient norm."""
    on_phase: Callable[[str], None] = lambda _phase: None
    """Told each phase of a step as it starts (generate, reward, train, eval, save)."""
    timers: dict[str, float] = field(default_factory=dict)
    """Seconds (and counts) of the running step's phases, for the perf/* metrics."""
    sampling_prior: tuple[int, int] = (0, 0)  # (mixed groups, prompts drawn) of the last step
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

    def sync_engine(self) -> None:
        """Tell the engine the weights changed (after updates, after a resume); under FSDP,
        gather the shards into the whole copy first. Timed (``perf/weight_sync_s``) where
        there is something to copy: a gather, or an engine with its own weights (vllm)."""
        t0 = time.perf_counter()
        if self.tp_mesh is not None and self.gen_model is not None:
            tensor_parallel.fill_tp_copy(self.model, self.gen_model)
        elif self.gen_model is not None:
            fsdp.gather_into(self.model, self.gen_model)
        self.engine.sync_weights(self.model if self.gen_model is None else self.gen_model)
        if self.gen_model is not None or not isinstance(self.engine, LiveModelEngine):
            accumulate(self.timers, "weight_sync", time.perf_counter() - t0)

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
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
    )
    sampler = PromptSampler(train_problems, seed=cfg.train.seed)
    stops = stop_token_ids(model, tokenizer, cfg.rollout.stop_token_ids)
    engine = make_engine(
        cfg.rollout.engine,
        gen_model or model,
        tokenizer,
        stops,
        compute,
        vllm=vars(cfg.vllm) | ({"tensor_parallel_size": cfg.rollout.tp_size} if tp_mesh else {}),
        device=device,
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
        scaler=scaler,
        device=device,
        gen_model=gen_model,
        tp_mesh=tp_mesh,
    )


# ----------------------------------------------------------------------------- 1. rollout


def shape_group(episodes: Sequence[Episode], cfg: Config) -> None:
    """R = R_correct + R_length (soft overlong punishment), or overlong filtering, in place;
    with neither technique on, a truncated response scores a hard -1 and is incorrect (the
    naive baseline)."""
    a = cfg.algo
    rewards_B, correct_B, trainable_B = algo.shape_rewards(
        torch.tensor([e.reward for e in episodes], dtype=torch.float64),
        torch.tensor([e.correct for e in episodes]),
        torch.tensor([e.length for e in episodes]),
        torch.tensor([e.truncated for e in episodes]),
        l_max=cfg.rollout.max_new_tokens,
        l_cache=a.l_cache,
        factor=a.overlong_factor,
        soft_punish=a.overlong_shaping,
        filter_truncated=a.overlong_filter,
    )
    shaped = zip(rewards_B.tolist(), correct_B.tolist(), trainable_B.tolist(), strict=True)
    for e, (reward, correct, keep) in zip(episodes, shaped, strict=True):
        e.reward, e.correct, e.trainable = reward, correct, keep


def sample_round(
    state: TrainState, problems: list[Problem], *, seeds: list[int], count: bool = True
) -> list[Sample]:
    """G responses per problem (samples i*G .. i*G+G-1 are problem i), problem i's drawn from
    ``seeds[i]`` alone, in calls of at most ``rollout.rows_per_generate`` rows; their slots
    counted in ``perf/gen_padding_frac`` when ``count``."""
    cfg, r = state.cfg, state.cfg.rollout
    prompts = [
        render_prompt(
            state.tokenizer,
            p,
            chat_template=cfg.data.apply_chat_template,
            system_prompt=cfg.data.system_prompt,
        )
        for p in problems
    ]
    samples, slots = generate_samples(
        state.engine,
        prompts,
        group_size=r.group_size,
        rows_per_call=r.rows_per_generate,
        seed=seeds,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        ignore_eos=r.ignore_eos,
    )
    accumulate(state.timers, "gen_slots", float(slots) if count else 0.0)
    return samples


def rollout_round(
    state: TrainState, problems: list[Problem], *, seeds: list[int], keep: bool = True
) -> list[Group]:
    """G responses for each problem, graded and shaped, as one group per problem. Not
    ``keep``: generated (in lockstep with a tensor-parallel group's first rank, which keeps
    them) and dropped."""
    cfg = state.cfg
    G = cfg.rollout.group_size
    if not problems:  # a rank whose share of a small round is empty
        return []
    state.model.eval()
    state.on_phase("generate")
    samples = sample_round(state, problems, seeds=seeds, count=keep)
    if not keep:
        return []
    jobs = [grading_job(problems[b // G], x.text, cfg.reward.grader) for b, x in enumerate(samples)]
    state.on_phase("reward")
    t_reward = time.perf_counter()
    graded = (state.pool or RewardPool(workers=0)).grade(jobs)
    accumulate(state.timers, "reward", time.perf_counter() - t_reward)
    _warn_faults(state, graded)
    fault_of = {f.index: f.kind for f in graded.faults}
    groups = []
    for i, problem in enumerate(problems):
        episodes = []
        for b in range(i * G, (i + 1) * G):
            x, score = samples[b], graded.scores[b]
            episodes.append(
                Episode(
                    prompt_ids=x.prompt_ids,
                    response_ids=x.response_ids,
                    sampler_logprobs=x.logprobs,
                    truncated=x.truncated,
                    correct=score.correct,
                    reward=score.score,
                    text=x.text,
                    reward_fault=fault_of.get(b, ""),
                )
            )
        shape_group(episodes, cfg)
        groups.append(Group(problem.uid, episodes))
    return groups


def round_seeds(state: TrainState, round_index: int, problems: list[Problem]) -> list[int]:
    """Each problem's sampling seed, from (seed, step, round, its place in the round, its uid):
    never from a rank or a batch, so that the samples do not depend on the world size."""
    cfg = state.cfg
    return [
        derive_seed(cfg.train.seed, state.step, round_index, "rollout", i, p.uid)
        for i, p in enumerate(problems)
    ]


def _warn_faults(state: TrainState, graded: GradeResult) -> None:
    if graded.faults:
        first = graded.faults[0]
        print(
            f"dapo: warning: step {state.step + 1}: the verifier failed on "
            f"{len(graded.faults)} response(s), graded incorrect; first: {first.kind}: "
            f"{first.detail}",
            file=sys.stderr,
        )


# ----------------------------------------------------------------------------- 3. advantages


def assign_advantages(groups: Sequence[Group], *, eps: float, norm: str = "group") -> None:
    """Â_i = (R_i - mean(R_group)) / (std(R_group) + eps), the same for every token of o_i
    (``norm``: the group's std, the batch's, or none; ``algo.adv_norm``)."""
    if not groups:
        return
    scores_nG = torch.tensor([[e.reward for e in g.episodes] for g in groups], dtype=torch.float64)
    adv_nG = algo.group_advantages(scores_nG, eps=eps, norm=norm)
    for g, row in zip(groups, adv_nG.tolist(), strict=True):
        for e, a in zip(g.episodes, row, strict=True):
            e.advantage = a


# ----------------------------------------------------------------------------- the step


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up over ``optim.warmup_steps`` rollout steps, then constant (paper)."""
    if cfg.optim.warmup_steps == 0:
        return cfg.optim.lr
    return cfg.optim.lr * min(1.0, (step + 1) / cfg.optim.warmup_steps)


def draw_round(
    state: TrainState, held: exchange.Held, round_index: int, num_prompts: int
) -> list[Group]:
    """A round's groups on every rank: each rank (tensor-parallel group) generates its share,
    gathered in order as summaries (``held`` keeps the whole ones): one process's decisions."""
    problems = state.sampler.next(num_prompts)
    seeds = round_seeds(state, round_index, problems)
    mesh = state.tp_mesh
    if mesh is None:
        mine, keep = dist.share(len(problems)), True
    else:  # every rank of a group generates the group's share; its first rank keeps it
        mine = tensor_parallel.group_share(len(problems), mesh)
        keep = tensor_parallel.tp_coordinates(mesh)[1] == 0
    groups = rollout_round(
        state, problems[mine.start : mine.stop], seeds=seeds[mine.start : mine.stop], keep=keep
    )
    if dist.world_size() == 1:
        return groups  # tokens move once, to the rank that trains them (exchange.deliver):
    summaries = held.summarise(groups, round_index=round_index, start=mine.start)
    return dist.gather_lists(summaries, patient=True)


def collect_step(state: TrainState, held: exchange.Held) -> SamplingResult:
    """Phases 1-2 of step ``state.step``: rounds of rollouts until N groups are kept; the
    kept fraction is remembered for the next step's round sizes."""
    cfg, s = state.cfg, state.cfg.sampling
    n = cfg.train.prompts_per_step
    sizes = functools.partial(
        sampling.round_size,
        num_groups=n,
        dynamic=s.dynamic,
        prompts_per_round=s.prompts_per_round,
        oversample=s.oversample,
        prior=state.sampling_prior,
    )
    result = collect_groups(
        functools.partial(draw_round, state, held),
        num_groups=n,
        dynamic=s.dynamic,
        max_rounds=s.max_rounds,
        on_max_rounds=s.on_max_rounds,
        round_size=sizes,
    )
    state.sampling_prior = (result.groups_mixed, result.prompts_drawn)
    return result


def train_step(state: TrainState, ahead: Ahead | Remote | None = None) -> dict[str, float]:
    """One rollout step: rounds of rollouts until N groups are kept, advantages, the updates;
    with ``ahead`` (``train.async_staleness``), the rollouts it generated for this step."""
    cfg = state.cfg
    state.timers.clear()
    t0 = time.perf_counter()
    held = exchange.Held()
    result = collect_step(state, held) if ahead is None else ahead.take(state)
    t_gen = time.perf_counter() - t0

    assign_advantages(result.groups, eps=cfg.algo.adv_eps, norm=cfg.algo.adv_norm)
    episodes = [e for g in result.groups for e in g.episodes]
    t1 = time.perf_counter()
    state.on_phase("train")
    plan = exchange.training_plan(cfg, state.step, episodes)
    if dist.world_size() > 1 and ahead is None:  # generated ahead: whole on every rank
        episodes = exchange.deliver(result.groups, held, plan)
    metrics = update(state, episodes, lr=lr_at(cfg, state.step), plan=plan) if episodes else {}
    if metrics.get("train/updates") and getattr(ahead, "generators_elsewhere", False):
        state.engine_behind = True  # the generators get the weights; evaluation refreshes it
    elif metrics.get("train/updates"):
        state.sync_engine()
    t_train = time.perf_counter() - t1

    if dist.world_size() > 1 and ahead is None:  # each rank's slots (a generator's: summed)
        state.timers["gen_slots"] = dist.all_reduce_sum(state.timers.get("gen_slots", 0.0))
    metrics.update(sampling.rollout_metrics(result))
    metrics.update(step_perf(state, result, metrics, t0=t0, t_gen=t_gen, t_train=t_train))
    if "weight_sync" in state.timers:  # a gather and/or an engine's load (in train_s)
        metrics["perf/weight_sync_s"] = state.timers["weight_sync"]
    if ahead is not None:
        metrics.update(ahead.finish_step(state, result, metrics, waited=t_gen))
    state.step += 1
    return metrics
