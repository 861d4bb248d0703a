"""Phases 1-2 of a step: rounds of rollouts until N groups of mixed correctness are kept.

A round draws prompts, samples G responses to each, grades them and shapes their rewards;
dynamic sampling (:mod:`dapo.training.sampling`) repeats rounds until N mixed groups are
kept. Every rollout source draws its steps here, with :func:`draw_step`, from a
:class:`Drawer`: the prompt sampler, an engine, a reward pool and the config sections they
follow (:func:`dapo.training.state.drawer_for` picks them from the config). The trainer's
process draws in turn with its own engine; a generator thread or a generator rank with a
drawer of its own (:mod:`dapo.training.sources`).

Under ranks each rank (or tensor-parallel group) generates its share of a round, and the
round's groups are gathered as summaries, so that every rank makes the same decisions
(:mod:`dapo.training.exchange`).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo import algo, dist
from dapo.config import AlgoConfig, DataConfig, RolloutConfig, SamplingConfig
from dapo.data.batch import Episode
from dapo.data.problems import Problem, PromptSampler
from dapo.data.prompts import render_prompts
from dapo.dist import tensor_parallel
from dapo.reward.pool import GradeResult, RewardPool, grading_job
from dapo.rollout import Engine, Sample, generate_samples
from dapo.rollout.episodes import EpisodeRunner, environment_score
from dapo.run.metrics import accumulate
from dapo.run.seeding import derive_seed
from dapo.training import sampling
from dapo.training.exchange import LocalGroups
from dapo.training.sampling import Group, SamplingResult, collect_groups


@dataclass
class Drawer:
    """What draws a step's rounds, and the config sections it follows."""

    rollout: RolloutConfig
    sampling: SamplingConfig
    shaping: AlgoConfig
    """The overlong shaping fields (``l_cache``, ``overlong_*``)."""
    data: DataConfig
    grader: str
    """``reward.grader``: what grades every row (empty: each row's data_source)."""
    seed: int
    """``train.seed``: every sampling seed derives from it."""
    num_groups: int
    """``train.prompts_per_step``: the N groups a step keeps."""
    tokenizer: Any
    engine: Engine
    sampler: PromptSampler
    model: torch.nn.Module
    """The module the engine samples from (set to eval mode before each round)."""
    pool: RewardPool | None = None
    """Grades responses; None grades in-process (exceptions caught, hangs not stoppable)."""
    tp_mesh: Any = None
    """With ``rollout.tp_size`` > 1: the mesh of the ranks that generate together."""
    timers: dict[str, float] = field(default_factory=dict)
    """``gen_slots`` and ``reward`` of the step being drawn (the perf/* metrics)."""
    on_phase: Callable[[str], None] = lambda _phase: None
    """Told each phase as it starts (generate, reward)."""
    stopping: Callable[[], bool] = lambda: False
    """Asked before each round: a closing source stops between two rounds."""
    episodes: EpisodeRunner | None = None
    """Runs multi-turn episodes of the run's environment (``env.class``); None: one turn."""


def draw_step(
    drawer: Drawer,
    *,
    step: int,
    version: int,
    prior: tuple[int, int],
    local: LocalGroups | None = None,
) -> SamplingResult | None:
    """Phases 1-2 of step ``step``, sampled from the weights after ``version`` steps:
    rounds of rollouts until N groups are kept, each round's size from the mixed share of
    ``prior`` (the last step's mixed groups and prompts drawn) and this step's so far.
    Under ranks ``local`` keeps this rank's whole groups (the result holds summaries). None
    when ``drawer.stopping()`` turned true between two rounds."""
    s = drawer.sampling
    sizes = functools.partial(
        sampling.round_size,
        num_groups=drawer.num_groups,
        dynamic=s.dynamic,
        prompts_per_round=s.prompts_per_round,
        oversample=s.oversample,
        prior=prior,
    )
    local = LocalGroups() if local is None else local
    return collect_groups(
        functools.partial(draw_round, drawer, local, step, version),
        num_groups=drawer.num_groups,
        dynamic=s.dynamic,
        max_rounds=s.max_rounds,
        on_max_rounds=s.on_max_rounds,
        round_size=sizes,
        stopping=drawer.stopping,
    )


def draw_round(
    drawer: Drawer, local: LocalGroups, step: int, version: int, round_index: int, size: int
) -> list[Group]:
    """A round of ``size`` prompts on every rank: each rank (tensor-parallel group) generates
    its share, gathered in order as summaries (``local`` keeps the whole groups): one
    process's decisions."""
    problems = drawer.sampler.next(size)
    seeds = round_seeds(drawer.seed, step, round_index, problems)
    mesh = drawer.tp_mesh
    if mesh is None:
        share, keep = dist.share(len(problems)), True
    else:  # every rank of a group generates the group's share; its first rank keeps it
        share = tensor_parallel.group_share(len(problems), mesh)
        keep = tensor_parallel.tp_coordinates(mesh)[1] == 0
    part = slice(share.start, share.stop)
    groups = rollout_round(
        drawer, problems[part], seeds=seeds[part], step=step, version=version, keep=keep
    )
    if dist.world_size() == 1:
        return groups  # tokens move once, to the rank that trains them (exchange.deliver):
    summaries = local.summarise(groups, round_index=round_index, start=share.start)
    return dist.gather_lists(summaries, patient=True)


def round_seeds(seed: int, step: int, round_index: int, problems: list[Problem]) -> list[int]:
    """Each problem's sampling seed, from (seed, step, round, its place in the round, its uid):
    never from a rank or a batch, so that the samples do not depend on the world size."""
    return [
        derive_seed(seed, step, round_index, "rollout", i, p.uid) for i, p in enumerate(problems)
    ]


def rollout_round(
    drawer: Drawer,
    problems: list[Problem],
    *,
    seeds: list[int],
    step: int,
    version: int,
    keep: bool = True,
) -> list[Group]:
    """G responses for each problem, graded and shaped, as one group per problem. Not
    ``keep``: generated (in lockstep with a tensor-parallel group's first rank, which keeps
    them) and dropped."""
    G = drawer.rollout.group_size
    if not problems:  # a rank whose share of a small round is empty
        return []
    drawer.model.eval()
    drawer.on_phase("generate")
    samples = sample_round(drawer, problems, seeds=seeds, count=keep)
    if not keep:
        return []
    jobs = [grading_job(problems[b // G], x.text, drawer.grader) for b, x in enumerate(samples)]
    drawer.on_phase("reward")
    t_reward = time.perf_counter()
    graded = (drawer.pool or RewardPool(workers=0)).grade(jobs)
    accumulate(drawer.timers, "reward", time.perf_counter() - t_reward)
    _warn_faults(step, graded, problems, G)
    fault_of = {f.index: f.kind for f in graded.faults}
    groups = []
    for i, problem in enumerate(problems):
        episodes = []
        for b in range(i * G, (i + 1) * G):
            x, score = samples[b], environment_score(samples[b].trace, graded.scores[b])
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
                    env_mask=x.env_mask,
                    trace=x.trace,
                )
            )
        shape_group(episodes, drawer.shaping, l_max=drawer.rollout.max_new_tokens)
        groups.append(Group(problem.uid, episodes, version=version))
    return groups


def sample_round(
    drawer: Drawer, problems: list[Problem], *, seeds: list[int], count: bool = True
) -> list[Sample]:
    """G responses per problem (samples i*G .. i*G+G-1 are problem i), problem i's drawn from
    ``seeds[i]`` alone, in calls of at most ``rollout.rows_per_generate`` rows; their slots
    counted in ``perf/gen_padding_frac`` when ``count``."""
    r, d = drawer.rollout, drawer.data
    staged = problems if drawer.episodes is None else map(drawer.episodes.staged, problems)
    prompts = render_prompts(
        drawer.tokenizer,
        list(staged),
        chat_template=d.apply_chat_template,
        system_prompt=d.system_prompt,
    )
    samples, slots = generate_samples(
        drawer.engine,
        prompts,
        episodes=drawer.episodes,
        problems=problems,
        group_size=r.group_size,
        rows_per_call=r.rows_per_generate,
        seed=seeds,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        ignore_eos=r.ignore_eos,
    )
    accumulate(drawer.timers, "gen_slots", float(slots) if count else 0.0)
    return samples


def shape_group(episodes: Sequence[Episode], shaping: AlgoConfig, *, l_max: int) -> None:
    """R = R_correct + R_length (soft overlong punishment), or overlong filtering, in place;
    with neither technique on, a truncated response scores a hard -1 and is incorrect (the
    naive baseline). ``l_max``: ``rollout.max_new_tokens``. A response's length is the
    model's tokens: an environment's observations count toward L_max (they end an episode
    there) but not in the soft punishment, which shapes what the model writes; an episode
    truncated at L_max is past it, as a truncated response is, whoever filled it."""
    lengths = [max(e.model_tokens, l_max) if e.truncated else e.model_tokens for e in episodes]
    rewards_B, correct_B, trainable_B = algo.shape_rewards(
        torch.tensor([e.reward for e in episodes], dtype=torch.float64),
        torch.tensor([e.correct for e in episodes]),
        torch.tensor(lengths),
        torch.tensor([e.truncated for e in episodes]),
        l_max=l_max,
        l_cache=shaping.l_cache,
        factor=shaping.overlong_factor,
        soft_punish=shaping.overlong_shaping,
        filter_truncated=shaping.overlong_filter,
    )
    shaped = zip(rewards_B.tolist(), correct_B.tolist(), trainable_B.tolist(), strict=True)
    for e, (reward, correct, keep) in zip(episodes, shaped, strict=True):
        e.reward, e.correct, e.trainable = reward, correct, keep


def _warn_faults(step: int, graded: GradeResult, problems: list[Problem], G: int) -> None:
    """Say what went wrong grading a round (the first fault, naming its row's uid), and what
    the verifiers printed (capped: dapo.reward.pool)."""
    for line in graded.warnings(f"step {step + 1}", lambda index: problems[index // G].uid):
        print(line, file=sys.stderr)
