"""An evaluation's settings (:class:`EvalRequest`), and what ``dapo eval`` reads before its
model loads: the problems of ``--data`` (read as its flags say, every row's verifier found,
the code sandbox picked, and the sandbox of ``--config``'s tool), the settings of ``--config``,
and whether MODEL_DIR holds weights."""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class EvalRequest:
    """One evaluation's settings; the names are ``dapo eval``'s flags."""

    model: str
    data: str
    k: int = 32
    pass_k: str = ""
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: int = 20480
    seed: int = 0
    greedy: bool = False
    num_problems: int = 0
    reward_mode: str = ""
    reward_function: str = ""
    stop_token_ids: str = ""
    system_prompt: str | None = None
    resamples: int = 10_000
    phrases: str = ""
    out: Path | None = None
    device: str = "auto"
    engine: str = "dapo"
    dtype: str = "float32"
    config: str | None = None
    threads: int = 0
    format: str = "auto"
    question_key: str = "question"
    answer_key: str = "answer"
    wrap_template: bool = False
    on_bad_row: str = "error"


DATA_FLAGS = ("format", "question_key", "answer_key", "wrap_template", "on_bad_row")
"""The fields of :class:`EvalRequest` that say how a data file is read (``dapo data``'s
flags, by the same names)."""


def data_options(req: EvalRequest) -> dict[str, Any]:
    """``req``'s :data:`DATA_FLAGS` that differ from their defaults (as ``dapo data`` reads)."""
    defaults = {f.name: f.default for f in fields(EvalRequest)}
    return {k: getattr(req, k) for k in DATA_FLAGS if getattr(req, k) != defaults[k]}


def check_sampling(req: EvalRequest) -> None:
    """Refuse ``req``'s sampling settings that no engine draws with, before the model loads
    and the output directory is made (the engine would refuse them only then)."""
    from dapo.config.training import MIN_TEMPERATURE

    if req.k < 1:
        raise ValueError(f"--k must be >= 1, got {req.k}")
    if req.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {req.max_new_tokens}")
    if not MIN_TEMPERATURE <= req.temperature < math.inf:  # NaN too
        raise ValueError(
            f"--temperature must be a finite number >= {MIN_TEMPERATURE:g}, got "
            f"{req.temperature} (--greedy adds an argmax response's accuracy)"
        )
    if not 0 < req.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {req.top_p} (1: the whole distribution)")


def problems_of(req: EvalRequest) -> list:
    """``req``'s problems (the first ``num_problems``), each with a verifier and each prompt
    within the model's context with ``max_new_tokens`` (:func:`check_context`); a code row's
    sandbox picked (a machine without one fails here, naming the fix)."""
    problems, rows = _read(req)
    from dapo.reward import tasks

    # Every row's verifier, before the model loads: one missing graded every response wrong.
    graded = [] if req.reward_function else problems  # a reward function grades every row
    try:
        names = {tasks.get_task(req.reward_mode or p.data_source).name for p in graded}
    except ValueError as exc:
        raise ValueError(f"--data {req.data}: {exc} (dapo eval: --reward-mode dapo)") from None
    if "code" in names:
        from dapo.reward import sandbox

        mode = sandbox.pick_mode(run_config(req).code.sandbox)
        print(f"code rows: graded in the {mode} sandbox", file=sys.stderr)
        if mode == "process":
            print(f"dapo: warning: {sandbox.process_mode_warning()}", file=sys.stderr)
    _check_tool_sandbox(req)
    check_context(req, problems, rows)
    return problems


def check_data_fits(req: EvalRequest) -> None:
    """:func:`check_context` of ``req``'s problems, read quietly: ``--compare`` checks both
    models against the data before the first is sampled."""
    check_context(req, *_read(req, quiet=True))


def check_context(req: EvalRequest, problems: list, rows: dict[str, int]) -> None:
    """Refuse, before the model loads, prompts that with ``--max-new-tokens`` overrun the
    model's context, as ``dapo train`` refuses them (:func:`dapo.training.inputs.check_context`):
    counted as sampling renders them (the chat template, ``--system-prompt``). ``rows``:
    uid -> the row of ``--data`` the problem was first read at (empty for ``arith``)."""
    from dapo.config import load_config
    from dapo.models.policy import context_length, load_tokenizer
    from dapo.training.inputs import prompt_lengths
    from dapo.training.prompt_checks import context_overrun

    # The config the model loads with (evaluation._model), rendering as sampling does.
    cfg = load_config(None, [] if req.model == "embedded" else [f"model.path={req.model}"])
    cfg.data.apply_chat_template, cfg.data.system_prompt = True, req.system_prompt

    def where(i: int) -> str:
        uid = problems[i].uid
        return f"--data {req.data}, row {rows[uid]}" if uid in rows else f"problem {uid}"

    overrun = context_overrun(
        prompt_lengths(cfg, load_tokenizer(cfg), problems),
        context_length(cfg),
        req.max_new_tokens,
        budget="--max-new-tokens",
        where=where,
        fix="Give a smaller --max-new-tokens (a run's evaluation samples up to its "
        "rollout.max_new_tokens), drop the longest problems from the file, or evaluate a "
        "model with a longer context",
        alone="Drop the longest problems from the file, or evaluate a model with a longer context",
    )
    if overrun:
        raise ValueError(f"{req.model}: {overrun}")


def _check_tool_sandbox(req: EvalRequest) -> None:
    """Say which sandbox the Python tool of ``--config``'s ``env.class`` runs the model's code
    in, and warn, as for code rows, of ``process``, which isolates nothing."""
    if not req.config:
        return  # the defaults: no environment
    from dapo.training.inputs import tool_process_warning, tool_sandbox_mode

    cfg = run_config(req)
    mode = tool_sandbox_mode(cfg)
    if mode:
        print(f"tool calls: run in the {mode} sandbox", file=sys.stderr)
    if mode == "process":
        print(f"dapo: warning: {tool_process_warning(cfg)}", file=sys.stderr)


def run_config(req: EvalRequest) -> Any:
    """``--config`` (a run's settings: its sandbox, its reward bound), else the defaults. A
    run directory's config.yaml may not name code inside that directory (its env.class):
    the directory may come from elsewhere, and dapo runs no code that came with one."""
    from dapo.config import load_config
    from dapo.reward import custom
    from dapo.run import rundir

    if not req.config:
        return load_config(None, [])
    cfg = load_config(req.config)
    home = Path(req.config).resolve().parent
    if rundir.holds_a_run(home) and (found := custom.file_inside(home, cfg)):
        key, spec = found
        raise ValueError(
            f"--config {req.config}: {key}={spec} is a file inside the run directory {home}, "
            "and dapo runs no code that came with a run directory; copy it elsewhere, read "
            f"it, and give a config whose {key} names the copy"
        )
    return cfg


def graded_as_the_run(req: EvalRequest, own_function: bool) -> None:
    """``req`` graded as its ``--config``'s run graded: that run's ``reward.function`` or
    ``reward.mode``, where neither the command (``--reward-function``, ``--reward-mode``) nor
    the caller (``own_function``: a Python callable) names how to grade."""
    graded = run_config(req).reward  # its refusals too (code inside a run directory)
    if not (own_function or req.reward_function or req.reward_mode):
        req.reward_function, req.reward_mode = graded.function, graded.mode


def weightless_checkpoint_model(model: Path) -> str | None:
    """Why ``model`` is not a model to evaluate when it is the ``model/`` of a checkpoint
    written under torchrun: its config and tokenizer, the weights being DCP shards in the
    sibling ``state/`` (transformers would say only that no model.safetensors is there). None
    for a directory that holds weights, or is no such ``model/``."""
    from dapo.run.checkpoint import CKPT_DIR

    here = Path(os.path.abspath(model))  # "." and ".." have no parent to look at
    weights = [*here.glob("*.safetensors"), *here.glob("*.bin")]
    if weights or not (here / "config.json").is_file() or not (here.parent / "state").is_dir():
        return None
    ckpt = here.parent
    step = re.fullmatch(r"step_(\d{6,})", ckpt.name)
    if step and ckpt.parent.name == CKPT_DIR:
        run = ckpt.parent.parent
        shown = run if model.is_absolute() else os.path.relpath(run)  # as the user spelled it
        export = f"dapo export {shlex.quote(str(shown))} --step {int(step[1])} --out DIR"
    else:  # moved out of its run directory: no run or step to name
        export = "dapo export RUN_DIR --step N --out DIR"
    return (
        "the config and tokenizer of a checkpoint written under torchrun, without its weights "
        f"(DCP shards in the checkpoint's state/): export the checkpoint, `{export}` (with "
        "--merge for a LoRA run), and evaluate DIR"
    )


def _read(req: EvalRequest, *, quiet: bool = False) -> tuple[list, dict[str, int]]:
    """``req``'s problems (the first ``num_problems``), and uid -> the row each was first
    read at (empty for ``arith``); ``quiet``: without the note of skipped rows."""
    if req.data == "arith":
        from dapo.config import load_config
        from dapo.training.inputs import load_run_data

        if data_options(req):
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in data_options(req))
            raise ValueError(f"--data arith is generated, not read: {flags} shape files only")
        # The held-out split `dapo train` evaluates on (with --config: that run's arith task).
        cfg = load_config(req.config, ["data.train_file=", "data.val_file="])
        problems, rows = load_run_data(cfg).val, {}
    else:
        from dapo.data.files import load_problems
        from dapo.reward import tasks

        if req.config:
            raise ValueError("--config shapes --data arith only; a data file is read as it is")
        loaded = load_problems(
            req.data,
            fmt=req.format,
            question_key=req.question_key,
            answer_key=req.answer_key,
            wrap_template=req.wrap_template,
            on_bad_row=req.on_bad_row,
            truth_rules=tasks.truth_rules(req.reward_mode, req.reward_function),
        )
        loaded.check_usable()
        if loaded.skipped and not quiet:
            print(
                f"{req.data}: {len(loaded.skipped)} bad rows skipped (--on-bad-row skip); the "
                f"first: {loaded.skipped[0]}",
                file=sys.stderr,
            )
        problems, rows = loaded.problems, loaded.first_row
    return (problems[: req.num_problems] if req.num_problems else problems), rows
