"""Held-out validation: avg@k accuracy under the paper's protocol (temperature 1.0, top_p 0.7),
and the k graded samples per problem that ``dapo eval`` summarises.

Samples are drawn by the run's rollout engine; the caller puts the model in eval mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from dapo import dist
from dapo.data.problems import Problem
from dapo.data.prompts import render_prompts
from dapo.eval.metrics import MAJORITY, record_metrics, summarize, without_unvoted_majority
from dapo.reward.pool import RewardPool, grading_job
from dapo.reward.tasks.base import vote_key
from dapo.rollout import Engine, Rollout
from dapo.rollout.episodes import EpisodeRunner, environment_score
from dapo.run.seeding import derive_seed


def evaluate(
    engine: Engine,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    num_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    prompts_per_batch: int = 64,
    pool: RewardPool | None = None,
    chat_template: bool = True,
    system_prompt: str | None = None,
    reward_mode: str = "",
    resamples: int = 1000,
    records_out: list | None = None,
    before_batch: Callable[[int, int], None] | None = None,
    rows_per_generate: int = 0,
    tp_mesh: Any = None,
    episodes: EpisodeRunner | None = None,
) -> dict[str, float]:
    """The held-out evaluation of training: ``dapo eval``'s samples and metrics, as val/*.

    ``val/accuracy`` is avg@k (the mean correctness over k samples of every problem), with a
    95% bootstrap interval over problems (``val/accuracy_low``, ``val/accuracy_high``);
    also pass@k, maj@k (not when no response had an answer to vote with), length and
    truncation. Seeded per problem, so the same weights give the same figures. ``pool``
    grades (default: in-process), with ``reward_mode`` for every row or else each row's
    data_source; a response the verifier fails on counts as incorrect and in
    ``val/reward_faults``. ``records_out``, when given, receives the per-problem records;
    ``before_batch`` is ``sample_records``'. A batch holds ``prompts_per_batch`` problems'
    k samples, or fewer problems when ``rows_per_generate`` (> 0) bounds the responses
    generated at once (training's ``rollout.rows_per_generate``: AIME's avg@32 is 960 rows).
    Under torchrun each rank (``tp_mesh``: each group of ranks that generate together)
    samples a share of the problems; seeded per problem, the records gathered are the ones one
    process would draw. ``episodes``: each sample an episode of the run's environment
    (``val/tool_call_frac``: the share that called a tool)."""
    k = num_samples
    share = _share(len(problems), tp_mesh)
    records = sample_records(
        engine,
        tokenizer,
        problems[share.start : share.stop],
        first_index=share.start,
        k=k,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        pool=pool or RewardPool(workers=0),
        chat_template=chat_template,
        system_prompt=system_prompt,
        reward_mode=reward_mode,
        responses_per_batch=_batch(prompts_per_batch * k, rows_per_generate, k),
        before_batch=before_batch,
        episodes=episodes,
    )
    per_problem, everyone = _exchange(records, k, tp_mesh)
    if records_out is not None:
        records_out[:] = everyone[: share.start] + records + everyone[share.stop :]
    per_problem = without_unvoted_majority(per_problem, everyone)
    summary = summarize(per_problem, resamples=resamples, seed=seed % 2**32)
    return val_metrics(summary, k, len(problems), sum(r["faults"] for r in everyone))


def val_metrics(summary: dict, k: int, num_problems: int, faults: int) -> dict[str, float]:
    """The val/* figures of an evaluation's ``summary`` (intervals per metric)."""
    acc = summary["avg@k"]
    out = {
        "val/accuracy": acc.mean,
        "val/accuracy_low": acc.low,
        "val/accuracy_high": acc.high,
        f"val/pass@{k}": summary[f"pass@{k}"].mean,
        "val/response_len_mean": summary["len_mean"].mean,
        "val/truncated_frac": summary["truncated_frac"].mean,
        "val/num_problems": float(num_problems),
        "val/num_samples": float(k),
        "val/reward_faults": float(faults),
    }
    if MAJORITY in summary:  # not when no response had a pred to vote with (custom rewards)
        out["val/maj@k"] = summary[MAJORITY].mean
    if "tool_call_frac" in summary:  # episodes of an environment (env.class)
        out["val/tool_call_frac"] = summary["tool_call_frac"].mean
    return out


def _batch(responses: int, rows_per_generate: int, k: int) -> int:
    """Responses per batch: ``responses``, or fewer (whole problems) under a row bound."""
    return min(responses, max(rows_per_generate, k)) if rows_per_generate else responses


def _share(n: int, tp_mesh: Any) -> range:
    """This rank's problems: its share, or its tensor-parallel group's (every rank of a group
    generates all of the group's, in lockstep)."""
    if tp_mesh is None:
        return dist.share(n)
    from dapo.dist import tensor_parallel

    return tensor_parallel.group_share(n, tp_mesh)


def _exchange(records: list[dict], k: int, tp_mesh: Any = None) -> tuple[list[dict], list[dict]]:
    """Every rank's (group's) per-problem metrics and records, in problem order, with the
    records' responses (and episodes' transcripts) left out: ranks exchange metrics and
    verdicts, not texts (at AIME's k = 32 and 20k-token responses those are tens of MB a
    rank)."""
    metrics = [record_metrics(r, ks=[k]) for r in records]
    light = [
        {key: v for key, v in r.items() if key not in ("responses", "transcripts")} for r in records
    ]
    contribution = list(zip(metrics, light, strict=True))
    if tp_mesh is not None:
        from dapo.dist import tensor_parallel

        contribution = tensor_parallel.group_contribution(contribution, tp_mesh)
    gathered = dist.gather_lists(contribution, patient=True)
    return [m for m, _ in gathered], [r for _, r in gathered]


def sample_records(
    engine: Engine,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    k: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    pool: RewardPool,
    greedy: bool = False,
    chat_template: bool = True,
    system_prompt: str | None = None,
    reward_mode: str = "",
    responses_per_batch: int = 256,
    before_batch: Callable[[int, int], None] | None = None,
    first_index: int = 0,
    after_batch: Callable[[list[dict]], None] | None = None,
    episodes: EpisodeRunner | None = None,
) -> list[dict]:
    """k graded samples of every problem, one record per problem (``dapo eval``'s raw data).

    A record holds the problem's uid, ground truth, and per sample the response, the extracted
    answer, correctness, length in tokens and truncation; with ``greedy``, also the greedy
    response's correctness. Each problem's samples are seeded from (seed, its index, counted
    from ``first_index``), so a fixed seed repeats the figures whatever the batch size.
    ``before_batch(done, total)`` is called before each batch with the problems done so far
    (progress, thread count); ``after_batch(records)`` after each, with its records (``dapo
    eval`` writes them to disk then). ``episodes``: each sample is a multi-turn episode of
    the environment it runs (a record's ``tool_calls`` counts each one's calls).
    """
    per_batch = max(1, responses_per_batch // k)
    records = []
    for start in range(0, len(problems), per_batch):
        if before_batch is not None:
            before_batch(start, len(problems))
        chunk = problems[start : start + per_batch]
        staged = chunk if episodes is None else [episodes.staged(p) for p in chunk]
        prompts = render_prompts(
            tokenizer, staged, chat_template=chat_template, system_prompt=system_prompt
        )
        generate = engine.generate if episodes is None else partial(episodes.generate, chunk)
        ro = generate(
            prompts,
            group_size=k,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=[derive_seed(seed, "problem", first_index + start + j) for j in range(len(chunk))],
        )
        jobs = [grading_job(chunk[i // k], text, reward_mode) for i, text in enumerate(ro.texts)]
        where = f"evaluation, problems {first_index + start + 1}-{first_index + start + len(chunk)}"
        uids = [p.uid for p in chunk]
        graded = _graded(pool, jobs, ro, where, [uid for uid in uids for _ in range(k)])
        greedy_correct = None
        if greedy:
            g = generate(prompts, group_size=1, max_new_tokens=max_new_tokens, greedy=True)
            greedy_jobs = [
                grading_job(p, text, reward_mode) for p, text in zip(chunk, g.texts, strict=True)
            ]
            greedy_graded = _graded(pool, greedy_jobs, g, f"{where}, greedy", uids)
            greedy_correct = [s.correct for s in greedy_graded.scores]
        batch = _records(chunk, ro, graded, k, greedy_correct)
        if after_batch is not None:
            after_batch(batch)
        records += batch
    return records


def _graded(pool: RewardPool, jobs: list, ro: Rollout, where: str, uids: list[str]) -> Any:
    """``jobs`` graded (environment scores in place), with the faults and what the verifiers
    printed on stderr, each job named by ``uids[its index]``."""
    graded = _with_environment(pool.grade(jobs), ro)
    for line in graded.warnings(where, uids.__getitem__):
        print(line, file=sys.stderr)
    return graded


def _with_environment(graded: Any, ro: Rollout) -> Any:
    """``graded`` with each episode's environment score in place of the verifier's, where
    the environment gave one."""
    if ro.traces is not None:
        graded.scores = [
            environment_score(t, s) for t, s in zip(ro.traces, graded.scores, strict=True)
        ]
    return graded


def _records(chunk, ro: Rollout, graded, k: int, greedy_correct) -> list[dict]:
    out = []
    for j, p in enumerate(chunk):
        rows = range(j * k, (j + 1) * k)
        record = {
            "uid": p.uid,
            "ground_truth": p.answer,
            "responses": [ro.texts[b] for b in rows],
            "answers": [graded.scores[b].pred for b in rows],
            "votes": [vote_key(graded.scores[b]) for b in rows],
            "correct": [bool(graded.scores[b].correct) for b in rows],
            "lengths": [int(ro.lengths_B[b]) - _env_tokens(ro, b) for b in rows],
            "truncated": [bool(ro.truncated_B[b]) for b in rows],
            "faults": sum(1 for f in graded.faults if f.index in rows),
        }
        if greedy_correct is not None:
            record["greedy_correct"] = greedy_correct[j]
        if ro.traces is not None:
            record["tool_calls"] = [ro.traces[b].tool_calls for b in rows]
            record["transcripts"] = [ro.traces[b].transcript for b in rows]
        out.append(record)
    return out


def _env_tokens(ro: Rollout, b: int) -> int:
    """Row ``b``'s tokens written by an environment (not the model's length)."""
    return 0 if ro.traces is None else ro.traces[b].env_tokens
