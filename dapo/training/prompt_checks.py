"""Checks of the prompts a run trains on or an evaluation samples from, shared by ``dapo
train`` (:mod:`dapo.training.inputs`) and ``dapo eval`` (:mod:`dapo.api.eval_inputs`): does
the longest fit the model's context with the tokens to be generated, and does any ask for
the ``Answer:`` line the DAPO verifiers grade by."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence

from dapo.config import DataConfig
from dapo.data.problems import Problem

ANSWER_LINE_TASKS = frozenset({"math_dapo", "math_lenient"})
"""The verifiers (task names) that grade the last ``Answer:`` line and nothing else: a
response without one scores -1, however right its answer (math_dapo_boxed and math_verify
fall back to the last ``\\boxed{}``)."""

ANSWER_REQUESTS = (
    "The last line of your response should be of the form Answer: $Answer",
    'Remember to put your answer on its own line after "Answer:".',
)
"""The two sentences of the DAPO template (:data:`dapo.data.prompts.PROMPT_PREFIX` and
``PROMPT_SUFFIX``) that ask for the line. A problem's own text is not matched for a bare
"Answer:": 20 rows of DAPO-Math-17k hold one inside the problem, and ask for nothing."""


def asks_for_answer_line(problems: Iterable[Problem], system_prompt: str | None) -> bool:
    """Whether a model prompted with ``problems`` is told to end with an ``Answer:`` line: by
    the system prompt or a row's own system message (an instruction a user wrote: any
    "Answer:" in it counts), by a worked example's (an assistant turn before the question,
    as the embedded task's chat prompt has), or by a message holding a sentence of the DAPO
    template that asks for it (:data:`ANSWER_REQUESTS`)."""
    if system_prompt and "Answer:" in system_prompt:
        return True
    for p in problems:
        for m in p.messages:
            text = m.get("content") or ""
            if m.get("role") in ("system", "assistant") and "Answer:" in text:
                return True
            if any(sentence in text for sentence in ANSWER_REQUESTS):
                return True
    return False


def answer_line_warning(
    d: DataConfig, problems: Sequence[Problem], graders: set[str]
) -> str | None:
    """The warning for ``d.train_file`` (empty: the embedded task) when its ``problems`` are
    graded by an ``Answer:`` line alone (``graders``: the task names) and neither they nor
    ``d.system_prompt`` ask for one (a copy that lost the DAPO template: rewards near -1
    everywhere); None otherwise. A warning, not a refusal: a model's chat template may ask
    for the line itself."""
    if not graders or not graders <= ANSWER_LINE_TASKS:
        return None
    if asks_for_answer_line(problems, d.system_prompt):
        return None
    where, convert = "train (the embedded task)", ""
    if d.train_file:
        where, convert = d.train_file, f", or convert the file ({convert_command(d)})"
    return (
        f"{where}: none of its {len(problems)} problems asks for an `Answer:` line, which "
        f"{', '.join(sorted(graders))} grades by (a response without one scores -1), and "
        "data.system_prompt does not either: a copy that lost the DAPO template (as the "
        f"shared DAPO-Math-17k did)? Set data.wrap_template=true{convert}, or give a "
        "data.system_prompt that asks for the line"
    )


def convert_command(d: DataConfig) -> str:
    """The ``dapo data convert`` command that writes ``d.train_file`` wrapped in the DAPO
    template, reading it as the run does (its flags that differ from the defaults)."""
    read_as = (
        ("format", d.format, "auto"),
        ("question-key", d.question_key, "question"),
        ("answer-key", d.answer_key, "answer"),
        ("on-bad-row", d.on_bad_row, "error"),  # DAPO-Math-17k's 11 disagreeing repeats
    )
    flags = "".join(f" --{k} {shlex.quote(v)}" for k, v, default in read_as if v != default)
    return (
        f"`dapo data convert {shlex.quote(d.train_file)} OUT.parquet --to dapo{flags}` and "
        "train on OUT.parquet"
    )


def context_overrun(
    lengths: Sequence[int],
    limit: int | None,
    max_new: int,
    *,
    budget: str,
    where: Callable[[int], str],
    fix: str,
    alone: str,
) -> str | None:
    """Why the longest of the prompts (``lengths``, in tokens) plus ``max_new`` generated
    tokens (the setting ``budget`` names) overruns ``limit``, the model's context; None when
    every prompt fits, or the context is unknown. ``where(i)`` names prompt i (its file and
    row); ``fix`` ends the message, or ``alone`` when the longest prompt fills the context by
    itself: then no smaller ``budget`` can help, and a fix that leads with one misleads."""
    if limit is None or not lengths:
        return None
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + max_new <= limit:
        return None
    over = sum(1 for n in lengths if n + max_new > limit)
    room = limit - lengths[longest]
    left = f"at most {room} new tokens fit" if room > 0 else "no room for a response"
    if room <= 0:
        full = sum(1 for n in lengths if n >= limit)
        fix = (
            f"{alone}: {full} prompt(s) fill the context alone, and no {budget} leaves room "
            "for a response to them"
        )
    return (
        f"{over} prompt(s) plus {budget}={max_new} exceed the model's context of {limit} "
        f"tokens (longest: {where(longest)}, {lengths[longest]} prompt tokens: {left}). {fix}"
    )


def drop_long(
    problems: Sequence[Problem],
    lengths: Sequence[int],
    limit: int | None,
    max_new: int,
    path: str,
    rows: Mapping[str, int],
) -> tuple[list[Problem], list[int], str | None]:
    """``data.on_long_prompt=skip``: the ``problems`` (read from ``path``; ``rows``: uid ->
    its row there) whose prompts (``lengths``, in tokens) fit ``limit``, the model's context,
    with ``max_new`` generated tokens, in order, with their lengths, and the line that counts
    the others (None when none is dropped). Deterministic from the file, the tokenizer and
    the settings, so every rank of a job drops the same ones. ValueError when none fits:
    nothing is left to train on."""
    drop = set() if limit is None else {i for i, n in enumerate(lengths) if n + max_new > limit}
    if not drop:
        return list(problems), list(lengths), None
    longest = max(sorted(drop), key=lengths.__getitem__)  # the first of the longest
    uid = problems[longest].uid
    place = f"row {rows[uid]}" if uid in rows else f"problem {uid}"
    line = (
        f"train: {path}: {len(drop)} problem(s) dropped (data.on_long_prompt=skip): their "
        f"prompts plus rollout.max_new_tokens={max_new} exceed the model's context of {limit} "
        f"tokens (over {limit - max_new} prompt tokens; longest: {place}, "
        f"{lengths[longest]} tokens)"
    )
    if len(drop) == len(lengths):
        fix = "lower rollout.max_new_tokens, or use a model with a longer context"
        if min(lengths) >= limit:  # no budget makes room: leading with one misleads
            fix = (
                "use a model with a longer context: every prompt fills the context alone, "
                "and no rollout.max_new_tokens leaves room for a response"
            )
        raise ValueError(f"{line}: none of its {len(lengths)} problems is left to train on; {fix}")
    keep = [i for i in range(len(lengths)) if i not in drop]
    kept = f"; {len(keep)} kept"
    return [problems[i] for i in keep], [lengths[i] for i in keep], line + kept


def one_sample_warning(
    num_samples: int, copies: int, problems: int, where: str, temperature: float
) -> str | None:
    """The warning for ``eval.num_samples=0`` (k = the val file's repeats) with a val file
    (``where``) that repeats none of its ``problems``: each is sampled once, at
    ``temperature``, so the score is avg@1, noisier than the paper's avg@32; None otherwise."""
    if num_samples or copies > 1:
        return None
    return (
        f"eval.num_samples=0 takes k from the val file's repeats, and {where} repeats none of "
        f"its {problems} problems: evaluation is avg@1 over {problems} problems (one sample "
        f"each at eval.temperature={temperature:g}); set eval.num_samples=32 for the paper's "
        "avg@32"
    )
