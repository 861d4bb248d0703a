"""Multi-turn episodes: the model's turns, an environment's observations between them.

:class:`EpisodeRunner` drives any engine through episodes of an environment
(:mod:`dapo.env`). The first turn of every row is one ordinary ``generate`` call (a prompt's
G rows share its prefill); a row's turn ends at a stop token of the policy or at one of the
environment's turn-end tokens (the engine is built to stop at both: :func:`with_turn_ends`).
The environment then answers every row whose turn ended, its tools running concurrently on
``workers`` threads; the rows that go on are continued together in one more ``generate``
call, each from its own tokens so far (token ids, never re-encoded text, so that the trained
tokens are the sampled ones). The native engine continues a row from the KV cache its last
turn left (:mod:`dapo.rollout.parking`: only the turn-end token and the observation are
prefilled); vLLM's prefix cache finds the episode's prefix; the hf engine computes it again.

A stop that the environment answers with nothing (no text, no tool, not the end: the opening
fence of a code block) is a pause, not the end of a turn: the model goes on in the same turn.

Bounds: ``max_turns`` model turns (a pause is not one, and the last turn's stops end the
episode); at most ``PAUSES_PER_TURN`` x ``max_turns`` pauses; each observation within
``max_observation_tokens`` (cut, with a marker); the whole response, model and environment
tokens together, within the call's ``max_new_tokens`` (L_max). A row that reaches L_max is
truncated, and a turn that ends there is not answered: no tool runs for it.

Seeds: turn 1 draws from the prompt's seed, as a single-turn rollout does; the t-th draw
(t > 1: a turn, or the rest of a turn after a pause) of row g of prompt i from (that seed, g,
t): a row's episode does not depend on the rows beside it, in its call or on other ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dapo.data.batch import Trace
from dapo.data.problems import Problem
from dapo.env import Environment, History, Observation, turn_end_ids
from dapo.env.base import checked_observation, messages_of, model_text_of
from dapo.reward.jobs import MAX_ABS_SCORE
from dapo.reward.tasks import Score
from dapo.rollout.base import Engine, Rollout, concat_rollouts
from dapo.rollout.env_steps import run_steps
from dapo.run.seeding import derive_seed

CUT_MARKER = "\n... (cut)\n"
"""Ends an observation cut to ``env.max_observation_tokens``."""
CHARS_PER_TOKEN = 32  # characters of an observation read per token kept: far above a token's

PAUSES_PER_TURN = 4
"""An episode may pause (stop at a turn end the environment answers with nothing) this many
times per ``env.max_turns``: a model that writes fence after fence would otherwise cost a
``generate`` call per token, up to L_max. Past it, the episode ends."""


def with_turn_ends(stops: Sequence[int], tokenizer: Any, env: Environment | None) -> list[int]:
    """The stop tokens of an engine that runs ``env``'s episodes: the policy's ``stops`` and
    the environment's turn-end tokens (``stops`` alone without an environment)."""
    ends = [] if env is None else turn_end_ids(tokenizer, env.turn_ends)
    return list(dict.fromkeys([*stops, *ends]))


def environment_score(trace: Trace | None, verified: Score) -> Score:
    """An episode's score: its environment's when it gave one, else the verifier's."""
    if trace is None or trace.reward is None:
        return verified
    reward = float(trace.reward)
    return replace(verified, score=reward, correct=reward > 0)


@dataclass
class _Row:
    """One episode under way, on the host."""

    problem: Problem
    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env: list[bool] = field(default_factory=list)
    segments: list[tuple[str, bool]] = field(default_factory=list)
    """Each turn's and observation's text, and whether the environment wrote it."""
    turns: int = 0
    draws: int = 0
    """``generate`` calls that wrote this row's tokens: its turns and the rests of its paused
    turns (the index of the next one's seed)."""
    pauses: int = 0
    paused: bool = False
    """The last stop was a pause: the next draw goes on with the same turn."""
    truncated: bool = False
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    reward: float | None = None
    parked: Any = None
    """The engine's KV cache of the row after its last turn, while the episode goes on."""

    def history(self, finished: bool) -> History:
        model_text = model_text_of(self.segments)
        transcript = "".join(t for t, _ in self.segments)
        return History(self.problem, model_text, transcript, self.turns, finished)

    def trace(self) -> Trace:
        return Trace(
            turns=self.turns,
            env_tokens=sum(self.env),
            tool_calls=self.calls,
            tool_errors=self.errors,
            tool_seconds=self.seconds,
            reward=self.reward,
            transcript="".join(t for t, _ in self.segments),
        )


def _on_host(out: Rollout) -> Rollout:
    """``out``'s per-row tensors on the CPU, read back once for all its rows."""
    names = ("response_ids_BT", "logprobs_BT", "lengths_B", "truncated_B")
    return replace(out, **{name: getattr(out, name).cpu() for name in names})


class EpisodeRunner:
    """Runs ``env``'s episodes on ``engine`` (built with :func:`with_turn_ends`)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        env: Environment,
        *,
        max_turns: int = 8,
        max_observation_tokens: int = 256,
        workers: int = 4,
        step_timeout_s: float = 60.0,
        max_abs: float = MAX_ABS_SCORE,
        agree: Callable[[Callable[[], list[Observation]]], list[Observation]] | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.env = engine, tokenizer, env
        # The ranks of a tensor-parallel group decode in lockstep: a tool whose output differs
        # between them (a set's order, a deadline) would fork their episodes, so one rank
        # answers for the group (dapo.dist.from_first_of).
        self.agree = agree or (lambda compute: compute())
        self.max_abs = max_abs  # reward.max_abs: the largest |reward| an episode may end with
        self.turn_ends = frozenset(turn_end_ids(tokenizer, env.turn_ends))
        stops = set(getattr(engine, "stop_token_ids", ()) or ())
        if stops and not self.turn_ends <= stops:
            raise ValueError(
                f"the rollout engine does not stop at the environment's turn ends "
                f"({sorted(self.turn_ends - stops)}): build it with the stop tokens of "
                "dapo.rollout.episodes.with_turn_ends"
            )
        self.max_turns, self.max_observation_tokens = max_turns, max_observation_tokens
        self.workers, self.step_timeout_s = workers, step_timeout_s
        self.parking = (
            {"park_at": sorted(self.turn_ends)}
            if getattr(engine, "continues_from_cache", False)
            else {}
        )
        """What asks the engine to keep the caches of rows that stop at a turn end."""

    def staged(self, problem: Problem) -> Problem:
        """``problem`` with the first messages of the environment (what the prompt renders)."""
        return replace(problem, messages=tuple(messages_of(self.env, problem)))

    def generate(
        self,
        problems: Sequence[Problem],
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        seed: int | Sequence[int] = 0,
        **sampling: Any,
    ) -> Rollout:
        """``group_size`` episodes of each problem (``prompts``: their rendered prompts, of
        :meth:`staged` problems), as the engine's ``generate`` returns responses; the
        sampling options (temperature, top_p, greedy, ignore_eos) go to every turn."""
        G = group_size
        first = self.engine.generate(
            prompts,
            group_size=G,
            max_new_tokens=max_new_tokens,
            seed=seed,
            **sampling,
            **self.parking,
        )
        prompt_seeds = (
            [derive_seed(seed, "prompt", i) for i in range(len(prompts))]
            if isinstance(seed, int)
            else [int(s) for s in seed]
        )
        rows = []
        ids_BP, mask_BP = first.prompt_ids_BP.cpu(), first.prompt_mask_BP.cpu().bool()
        for b in range(len(prompts) * G):
            prompt = ids_BP[b][mask_BP[b]].tolist()
            row_seed = derive_seed(prompt_seeds[b // G], "row", b % G)
            rows.append(_Row(problems[b // G], prompt, row_seed))
        slots, pending, out = first.slots, list(range(len(rows))), _on_host(first)
        while pending:
            asking = [
                b for j, b in enumerate(pending) if self._absorb(rows[b], out, j, max_new_tokens)
            ]
            pending = self._observe(rows, asking, max_new_tokens)
            if pending:
                pending, out = self._continue(rows, pending, max_new_tokens, sampling)
                out = _on_host(out)
                slots += out.slots
        return self._rollout(first, rows, slots)

    def _absorb(self, row: _Row, out: Rollout, j: int, max_new_tokens: int) -> bool:
        """Add row ``j`` of ``out`` (the row's latest turn) to ``row``, within L_max; whether
        the environment is to answer it."""
        length = int(out.lengths_B[j])
        ids = out.response_ids_BT[j, :length].tolist()
        logp = out.logprobs_BT[j, :length].float().tolist()
        room = max_new_tokens - len(row.tokens)
        ended = not bool(out.truncated_B[j])
        if len(ids) > room:
            ids, logp, ended = ids[:room], logp[:room], False
        row.turns += not row.paused
        row.draws += 1
        row.paused = False
        row.tokens += ids
        row.logprobs += logp
        row.env += [False] * len(ids)
        row.segments.append((self.tokenizer.decode(ids, skip_special_tokens=True), False))
        if ended and ids and ids[-1] in self.turn_ends and len(row.tokens) >= max_new_tokens:
            # A turn end at L_max: no room for an answer. A tool that ran would cost its time
            # and count as a call the model never saw. (The end of the message at L_max is
            # not truncated, and its environment still scores it.)
            ended = False
        row.truncated = not ended  # L_max came before the turn's end
        row.parked = out.parked[j] if out.parked is not None and ended else None
        return ended

    def _observe(self, rows: list[_Row], asking: list[int], max_new_tokens: int) -> list[int]:
        """The environment's answers to the rows ``asking`` (tools run concurrently); the
        rows that go on."""
        finished = {b: rows[b].tokens[-1] not in self.turn_ends for b in asking}
        for b in asking:
            if finished[b] or rows[b].turns >= self.max_turns:
                rows[b].parked = None  # the episode ends: its cache goes
        # A turn that ended at a turn end after the last turn allowed ends the episode: no
        # tool runs for an answer the model will not see.
        asking = [b for b in asking if finished[b] or rows[b].turns < self.max_turns]
        if not asking:
            return []
        histories = [rows[b].history(finished[b]) for b in asking]
        answers = self.agree(lambda: self._answers(histories))
        going_on = []
        for b, answer in zip(asking, answers, strict=True):
            if self._add_observation(rows[b], answer, max_new_tokens):
                going_on.append(b)
        for b in set(asking) - set(going_on):
            rows[b].parked = None
        return going_on

    def _answers(self, histories: list[History]) -> list[Observation]:
        bounds = dict(workers=self.workers, timeout_s=self.step_timeout_s)
        return run_steps(self._step, histories, name=type(self.env).__name__, **bounds)

    def _step(self, history: History) -> Observation:
        try:
            answer = self.env.step(history)
        except Exception as exc:
            raise RuntimeError(
                f"env.class: {type(self.env).__name__}.step raised on row "
                f"{history.problem.uid} (turn {history.turns}): {type(exc).__name__}: {exc}"
            ) from exc
        where = f"env.class: {type(self.env).__name__}.step on row {history.problem.uid}"
        if not isinstance(answer, Observation):
            raise TypeError(f"{where} returned {type(answer).__name__}; return an Observation")
        checked_observation(answer, where)
        if answer.done and answer.reward is not None:
            # A Python float from here on: a numpy or torch scalar passed the check but broke
            # the JSON of rollouts saved or sent (async runs, generator ranks).
            answer = dataclasses.replace(answer, reward=self._check_reward(answer.reward, history))
        return answer

    def _check_reward(self, reward: Any, history: History) -> float:
        """A finished episode's reward takes the verifier's place, so it is held to what a
        verifier's score is: a finite number within ``reward.max_abs``; returned as a float."""
        try:
            value = float(reward) if not isinstance(reward, str | bytes) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if math.isfinite(value) and abs(value) <= self.max_abs:
            return value
        raise ValueError(
            f"env.class: {type(self.env).__name__}.step ended row {history.problem.uid} "
            f"(turn {history.turns}) with reward {reward!r}; an episode's reward must be None "
            f"(the verifier grades) or a finite number within reward.max_abs={self.max_abs:g} "
            "(a NaN, an infinity or a larger reward would zero or NaN its group's advantages): "
            "return a finite float, scale it, or raise reward.max_abs"
        )

    def _add_observation(self, row: _Row, answer: Observation, max_new_tokens: int) -> bool:
        """Add the environment's ``answer`` to ``row``; whether the row goes on."""
        row.calls += int(answer.tool_call)
        row.errors += int(answer.error)
        row.seconds += answer.seconds
        if answer.done:
            row.reward = answer.reward
            return False
        if row.turns >= self.max_turns:
            return False
        if not answer.text and not answer.tool_call:  # a pause: the turn goes on
            row.pauses += 1  # ... unless the message ended at L_max: no room to go on in
            room = len(row.tokens) < max_new_tokens
            row.paused = room and row.pauses <= PAUSES_PER_TURN * self.max_turns
            return row.paused
        ids = self.observation_ids(answer.text)
        room = max_new_tokens - len(row.tokens)
        if len(ids) >= room:  # no room left for the model to answer: L_max reached
            ids, row.truncated = ids[:room], True
        row.tokens += ids
        row.logprobs += [0.0] * len(ids)
        row.env += [True] * len(ids)
        if ids:
            row.segments.append((self.tokenizer.decode(ids, skip_special_tokens=True), True))
        return not row.truncated

    def observation_ids(self, text: str) -> list[int]:
        """``text``'s tokens, cut to ``max_observation_tokens`` with :data:`CUT_MARKER`; only
        its first :data:`CHARS_PER_TOKEN` x that many characters are tokenized (a megabyte
        of output was tokenized whole, in the main thread, outside any deadline)."""
        limit = self.max_observation_tokens
        ids = self._plain_ids(text[: limit * CHARS_PER_TOKEN]) if text else []
        if len(ids) <= limit and len(text) <= limit * CHARS_PER_TOKEN:
            return ids
        marker = self._plain_ids(CUT_MARKER)
        if len(marker) >= limit:
            return ids[:limit]
        return ids[: limit - len(marker)] + marker

    def _plain_ids(self, text: str) -> list[int]:
        """``text``'s tokens as plain text: a tool that prints ``<|im_end|>`` or the EOS token's
        text gives those characters' tokens, never the special token (which would forge a turn
        of the chat or an end the model never wrote)."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]

    def _continue(
        self, rows: list[_Row], pending: list[int], max_new_tokens: int, sampling: dict
    ) -> tuple[list[int], Rollout]:
        """The next turn of the rows ``pending``, from their tokens so far: (the rows in the
        order of the rollout's, the rollout). One call; two when the engine continues from
        parked caches and some rows have none (an environment that goes on after a stop
        token other than a turn end): the prefill of a batch feeds every row as many tokens
        as the row that adds the most, so those rows are not batched with the others."""
        warm = [b for b in pending if rows[b].parked is not None]
        cold = [b for b in pending if rows[b].parked is None]
        if not warm or not cold:
            return pending, self._turn(rows, pending, max_new_tokens, sampling)
        parts = [self._turn(rows, part, max_new_tokens, sampling) for part in (warm, cold)]
        return warm + cold, concat_rollouts(parts, self.tokenizer.pad_token_id)

    def _turn(
        self, rows: list[_Row], pending: list[int], max_new_tokens: int, sampling: dict
    ) -> Rollout:
        contexts = [rows[b].prompt + rows[b].tokens for b in pending]
        seeds = [derive_seed(rows[b].seed, "turn", rows[b].draws + 1) for b in pending]
        room = max(max_new_tokens - len(rows[b].tokens) for b in pending)
        extra = dict(self.parking)
        if extra:
            extra["prefixes"] = [rows[b].parked for b in pending]
        return self.engine.generate(
            contexts, group_size=1, max_new_tokens=room, seed=seeds, **sampling, **extra
        )

    def _rollout(self, first: Rollout, rows: list[_Row], slots: int) -> Rollout:
        """The episodes as one rollout, padded on the host."""
        width = max([len(r.tokens) for r in rows] + [1])
        pad = self.tokenizer.pad_token_id
        B = len(rows)
        ids_BT = torch.full((B, width), pad, dtype=torch.long)
        logprobs_BT = torch.zeros((B, width), dtype=torch.float32)
        mask_BT = torch.zeros((B, width), dtype=torch.bool)
        env_BT = torch.zeros((B, width), dtype=torch.bool)
        for b, r in enumerate(rows):
            n = len(r.tokens)
            ids_BT[b, :n] = torch.tensor(r.tokens, dtype=torch.long)
            logprobs_BT[b, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
            mask_BT[b, :n] = True
            env_BT[b, :n] = torch.tensor(r.env, dtype=torch.bool)
        return Rollout(
            prompt_ids_BP=first.prompt_ids_BP.cpu(),
            prompt_mask_BP=first.prompt_mask_BP.cpu(),
            response_ids_BT=ids_BT,
            response_mask_BT=mask_BT,
            logprobs_BT=logprobs_BT,
            lengths_B=mask_BT.sum(dim=1),
            truncated_B=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
            texts=[r.history(False).model_text for r in rows],
            slots=slots,
            env_mask_BT=env_BT,
            traces=[r.trace() for r in rows],
        )
