"""What a run reads before it trains: its problems, and whether they fit the model.

Everything here is cheap next to loading weights (a 32B model takes minutes), so a run, and
``dapo train --dry-run``, finds a bad file, an unknown verifier or an over-long prompt first.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dapo.config import Config, RewardConfig
from dapo.data.problems import Problem
from dapo.data.prompts import render_prompts
from dapo.extras import pip_install
from dapo.models.policy import context_length, model_dir
from dapo.reward import custom, tasks
from dapo.training import gpu_memory, prompt_checks


@dataclass
class RunData:
    train: list[Problem]
    val: list[Problem]
    warmup_pairs: list[tuple[Problem, str]] = field(default_factory=list)
    """(problem, worked solution) for the embedded model's warm-start; empty with files."""
    val_copies: int = 1
    """How many rows of the val file repeat each problem (AIME 2024: 32)."""
    notes: list[str] = field(default_factory=list)
    """One line per file: rows, problems, repeats, skipped rows."""
    warnings: list[str] = field(default_factory=list)
    """What the checks found the run should know (printed, and kept in summary.json)."""
    train_rows: dict[str, int] = field(default_factory=dict)
    """uid -> the row (from 0) of ``data.train_file`` its problem was first read at, for
    messages that name it; empty for the embedded task (as ``val_rows`` for the val file)."""
    val_rows: dict[str, int] = field(default_factory=dict)


def load_run_data(cfg: Config) -> RunData:
    """The embedded task's splits, or ``data.train_file`` and ``data.val_file``."""
    d, a = cfg.data, cfg.arith
    if not d.train_file:
        from dapo.reward.tasks import arith

        train, val, warmup = arith.make_splits(
            a.num_train,
            a.num_val,
            a.num_warmup if cfg.model.path == "embedded" else 0,
            seed=a.seed,
            min_terms=a.min_terms,
            max_terms=a.max_terms,
            max_operand=a.max_operand,
            operators=a.operators,
            style=a.solution,
            tool_share=a.tool_share,
            prompt=a.prompt,
            shots=a.shots,
        )
        return RunData([p for p, _ in train], [p for p, _ in val], warmup)

    from dapo.data.files import LoadedData, load_problems

    def load(path: str, dedup: bool) -> LoadedData:
        return load_problems(
            path,
            fmt=d.format,
            question_key=d.question_key,
            answer_key=d.answer_key,
            data_source=d.data_source,
            wrap_template=d.wrap_template,
            dedup=dedup,
            on_bad_row=d.on_bad_row,
            truth_rules=tasks.truth_rules(cfg.reward.mode, cfg.reward.function),
        )

    # The val file is always merged: evaluation samples k responses per distinct problem,
    # so AIME's 32 copies of a problem must be one problem x 32, whatever data.dedup says.
    train, val = load(d.train_file, d.dedup), load(d.val_file, True)
    for data in (train, val):
        data.check_usable()  # every row skipped (data.on_bad_row=skip)
    # AIME 2024 repeats each problem 32 times: evaluation samples k per problem instead.
    val_copies = max(val.copies.values(), default=1)
    notes = []
    for name, data in (("train", train), ("val", val)):
        repeats = sum(data.copies.values()) - len(data.copies)
        line = f"{name}: {data.path}: {data.rows} rows, {len(data.problems)} problems"
        line += f" ({repeats} repeated rows merged)" if repeats else ""  # 0 without dedup
        line += f", {len(data.skipped)} bad rows skipped" if data.skipped else ""
        notes.append(line)
    rows = {"train_rows": train.first_row, "val_rows": val.first_row}
    e, n = cfg.eval, len(val.problems)
    one = prompt_checks.one_sample_warning(e.num_samples, val_copies, n, d.val_file, e.temperature)
    warnings = [one] if one else []  # k = 1 where avg@32 was likely meant
    return RunData(train.problems, val.problems, [], val_copies, notes, warnings, **rows)


def problem_place(cfg: Config, data: RunData, i: int) -> str:
    """Where problem ``i`` of ``data.train + data.val`` comes from, for a message: the train
    or val file and the row it was first read at (the embedded task's: its uid)."""
    n = len(data.train)
    split, path, rows = ("train", cfg.data.train_file, data.train_rows)
    if i >= n:
        split, path, rows, i = "val", cfg.data.val_file, data.val_rows, i - n
    uid = (data.train if split == "train" else data.val)[i].uid
    return f"{split} file {path}, row {rows[uid]}" if uid in rows else f"{split} problem {uid}"


def check_verifiers(cfg: Config, data: RunData) -> None:
    """Every row must have a verifier before the first rollout, not at it (and the warning of
    a sandbox mode that isolates nothing, for ``code`` rows or the environment's tool)."""
    # Before the return below: a reward function grades no code, but the tool still runs it.
    # Only process asked for by name is process (auto never falls back to it): no other
    # setting loads the environment again.
    if cfg.env.tool_sandbox == "process" and tool_sandbox_mode(cfg) == "process":
        data.warnings.append(tool_process_warning(cfg))
    if cfg.reward.function:
        return  # it grades every row, whatever its data_source (check_reward_function)
    sources = {cfg.reward.mode} if cfg.reward.mode else {p.data_source for p in data.train}
    names = {tasks.get_task(cfg.reward.mode or source).name for source in sources}
    graders = set(names)  # the train rows' alone: what the policy learns from
    if not cfg.reward.mode:  # with a mode, evaluation grades val rows by it too
        names |= {tasks.get_task(p.data_source).name for p in data.val if p.data_source}
    if "code" in names and check_code_sandbox(cfg) == "process":
        from dapo.reward.sandbox import process_mode_warning

        data.warnings.append(process_mode_warning())
    unasked = prompt_checks.answer_line_warning(cfg.data, data.train, graders)
    if unasked:
        data.warnings.append(unasked)


def check_code_sandbox(cfg: Config) -> str:
    """The sandbox mode ``code`` rows will run in; ValueError naming the fix when this
    machine has no such mode, or when a program may outlive its grading deadline."""
    from dapo.reward import sandbox

    if cfg.code.wall_s >= cfg.reward.timeout_s:
        raise ValueError(
            f"code.wall_s={cfg.code.wall_s:g} must be below reward.timeout_s="
            f"{cfg.reward.timeout_s:g}: a program at its limit must still be graded in time"
        )
    mode = sandbox.pick_mode(cfg.code.sandbox)
    print(f"code rows: graded in the {mode} sandbox (code.sandbox={cfg.code.sandbox})")
    return mode


def check_environment(cfg: Config) -> None:
    """Load the environment ``env.class`` names (its file imported, its sandbox found) before
    any model loads; ValueError naming the fix."""
    from dapo.env import load_environment

    env = load_environment(cfg.env.class_, cfg.env)
    if env is not None:
        print(
            f"episodes: env.class={cfg.env.class_} ({type(env).__name__}), up to "
            f"{cfg.env.max_turns} model turns, L_max {cfg.rollout.max_new_tokens} in all"
        )
    mode = env_tool_mode(env)
    if mode:
        print(f"tool calls: run in the {mode} sandbox (env.tool_sandbox={cfg.env.tool_sandbox})")


def env_tool_mode(env: Any) -> str | None:
    """The sandbox mode the Python tool of ``env`` (a :class:`dapo.env.MathTool`, a subclass
    of it included) runs model-written code in, ``env.tool_sandbox`` resolved; None for no
    environment, or one without that tool."""
    from dapo.env import MathTool

    return env.mode if isinstance(env, MathTool) else None


def tool_sandbox_mode(cfg: Config) -> str | None:
    """:func:`env_tool_mode` of the environment ``cfg.env.class_`` names (loaded again: the
    checks that keep warnings come after :func:`check_environment`, which returns none)."""
    if not cfg.env.class_:
        return None
    from dapo.env import load_environment

    return env_tool_mode(load_environment(cfg.env.class_, cfg.env))


def tool_process_warning(cfg: Config) -> str:
    """:func:`dapo.reward.sandbox.process_mode_warning`, naming the tool's setting: what
    ``env.tool_sandbox=process`` leaves the model's code is what ``code.sandbox=process``
    leaves a ``code`` row's program."""
    from dapo.reward.sandbox import process_mode_warning

    what = process_mode_warning().split(": ", 1)[-1]  # past "code.sandbox=process: "
    return f"env.tool_sandbox=process (the Python tool of env.class={cfg.env.class_}): {what}"


def check_reward_function(
    cfg: Config, fn: Callable[..., Any] | None = None
) -> tuple[RewardConfig, list[str]]:
    """Load and check ``reward.function`` (or ``fn``, the function it names, given in Python)
    before any model loads: the ``reward`` section the run goes on with (the function's spec
    as resolved, its file's SHA-256 recorded; ``cfg`` itself is left as it is), and a warning
    when a resumed run's file changed since it started."""
    r = cfg.reward
    if not r.function:
        return r, []
    spec, sha = custom.check(r.function, fn)
    checked = dataclasses.replace(r, function=spec, function_sha256=sha)
    if r.function_sha256 and r.function_sha256 != sha:
        return checked, [
            f"reward.function={spec}: the file changed since the run started (SHA-256 "
            f"{r.function_sha256[:12]}... then, {sha[:12]}... now): the resumed run is graded "
            "by the new code; the run's earlier config is kept as config.before-resume-*.yaml"
        ]
    return checked, []


def prompt_lengths(cfg: Config, tokenizer: Any, problems: list[Problem]) -> list[int]:
    d = cfg.data
    texts = render_prompts(
        tokenizer, problems, chat_template=d.apply_chat_template, system_prompt=d.system_prompt
    )
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [len(x) for x in ids]


def missing_chat_template(cfg: Config, tokenizer: Any) -> str | None:
    """The warning for ``data.apply_chat_template=true`` with a tokenizer that has no chat
    template (prompts would then be the messages' raw text), naming the model and the fix."""
    if not cfg.data.apply_chat_template or getattr(tokenizer, "chat_template", None):
        return None
    from dapo.models import hub

    path, revision = cfg.model.path, cfg.model.revision
    where = f"model.path={path}{f' (model.revision={revision})' if revision else ''}"
    fetch = "put the model's chat template in its directory (chat_template.jinja)"
    if path != "embedded" and hub.is_hub_id(path):
        fetch = f"fetch its chat template with {hub.download_command(path, revision)}"
    return (
        f"data.apply_chat_template=true, but the tokenizer of {where} has no chat template, "
        "so every prompt is its messages' raw text; if the model has one, "
        f"{fetch}, else set data.apply_chat_template=false"
    )


def check_context(cfg: Config, data: RunData, tokenizer: Any) -> dict[str, float]:
    """Refuse prompts that overrun the model's context with the tokens generated for them:
    train prompts with ``rollout.max_new_tokens`` (``data.on_long_prompt=skip`` drops them,
    counted in ``data.notes``), val prompts with ``eval.max_new_tokens`` (never dropped: an
    eval set is not changed); warn, in ``data.warnings``, of a missing chat template.

    Returns prompt-length statistics (tokens) for the log and ``--dry-run``.
    """
    missing = missing_chat_template(cfg, tokenizer)
    if missing:
        data.warnings.append(missing)
    lengths = prompt_lengths(cfg, tokenizer, data.train + data.val)
    limit, n = context_length(cfg), len(data.train)
    train, val = lengths[:n], lengths[n:]
    rollout, evaluation = cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens
    if cfg.data.on_long_prompt == "skip":
        path = cfg.data.train_file or "the embedded task"
        data.train, train, line = prompt_checks.drop_long(
            data.train, train, limit, rollout, path, data.train_rows
        )
        data.notes += [line] if line else []
    fix = "drop the longest problems from the file, or use a model with a longer context"
    checks = (  # (lengths, first index, budget, its setting, the fix's start)
        (train, 0, rollout, "rollout", "set data.on_long_prompt=skip to drop them, "),
        (val, len(data.train), evaluation or rollout, "eval" if evaluation else "rollout", ""),
    )
    for split, offset, budget, name, skip in checks:
        ends = skip + fix  # all a prompt that fills the context alone leaves
        overrun = prompt_checks.context_overrun(
            split,
            limit,
            budget,
            budget=f"{name}.max_new_tokens",
            where=lambda i, offset=offset: problem_place(cfg, data, i + offset),
            fix=f"Lower rollout.max_new_tokens (and eval.max_new_tokens), {ends}",
            alone=ends[:1].upper() + ends[1:],
        )
        if overrun:
            raise ValueError(overrun)
    return {
        "prompt_tokens_min": min(train + val),
        "prompt_tokens_median": statistics.median(train + val),
        "prompt_tokens_max": max(train + val),
        "train_prompt_tokens_mean": statistics.fmean(train),
        "context": float(limit or 0),
    }


def describe_budget(cfg: Config, stats: dict[str, float]) -> str:
    """Upper bound of tokens one step generates and trains on, before dynamic sampling."""
    t, r = cfg.train, cfg.rollout
    prompts = gpu_memory.round_prompts(cfg)  # with oversample, up to 4 x N prompts a round
    per_response = stats["train_prompt_tokens_mean"] + r.max_new_tokens
    total = prompts * r.group_size * per_response
    return (
        f"tokens per step: at most {prompts} prompts x {r.group_size} responses x "
        f"({stats['train_prompt_tokens_mean']:.0f} prompt + {r.max_new_tokens} response tokens) "
        f"= {total / 1e6:.2f}M per sampling round (dynamic sampling may draw up to "
        f"{cfg.sampling.max_rounds or 'unbounded'} rounds); "
        f"{t.prompts_per_step * r.group_size * per_response / 1e6:.2f}M trained on"
    )


def check_tensor_parallel(cfg: Config, world_size: int) -> None:
    """``rollout.tp_size`` against the launch and the model, before any model loads: the
    native and vllm engines only, under torchrun, a size that divides the world size and the
    model's heads (:func:`dapo.dist.tensor_parallel.check_tp_size`, from config.json alone)."""
    k = cfg.rollout.tp_size
    if k == 1:
        return
    if cfg.rollout.engine not in ("dapo", "vllm"):
        raise ValueError(
            f"rollout.tp_size={k} splits the native engine's copy or vLLM's; rollout.engine="
            f"{cfg.rollout.engine} generates from a whole copy per rank: use rollout.engine=dapo "
            "or vllm, or rollout.tp_size=1"
        )
    if world_size == 1:
        raise ValueError(
            f"rollout.tp_size={k} splits generation over {k} ranks of a torchrun job, and this "
            f"is one process: launch with torchrun --nproc-per-node N (N a multiple of {k}; "
            "a dry run: --world-size N), or set rollout.tp_size=1"
        )
    from dapo.dist.tensor_parallel import require_tp_size

    require_tp_size(k, world_size, _model_config(cfg))


def check_packing(cfg: Config) -> None:
    """``train.packing`` against the model's attention, from config.json alone, before any
    model loads: a sliding window or a layer not of full attention is refused
    (:func:`dapo.models.packing.packing_refusal`) at ``--dry-run`` too."""
    if not cfg.train.packing or cfg.model.path == "embedded":
        return
    from dapo.models.packing import packing_refusal

    why = packing_refusal(_model_config(cfg))
    if why:
        raise ValueError(why)


def check_lora(cfg: Config) -> None:
    """``model.lora``: peft installed."""
    if not cfg.model.lora.rank:
        return
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError(
            f"model.lora.rank > 0 needs peft: {pip_install('lora')} (or pip install peft)"
        ) from None


def check_async(cfg: Config, world_size: int) -> None:
    """``train.async_staleness`` generates in a thread of the one training process, or under
    torchrun on ranks of their own (``dist.rollout_ranks``); anything else is refused before
    any model loads."""
    from dapo.dist import roles

    k, generators = cfg.train.async_staleness, cfg.dist.rollout_ranks
    if generators:
        roles.check(generators, world_size)
        if cfg.rollout.tp_size > 1:
            raise ValueError(
                f"rollout.tp_size={cfg.rollout.tp_size} with dist.rollout_ranks={generators}: "
                "generator ranks each hold a whole copy of the policy (tensor parallelism "
                "among them is not built); set rollout.tp_size=1, or dist.rollout_ranks=0"
            )
        return
    if k and world_size > 1:
        raise ValueError(
            f"train.async_staleness={k} generates ahead of training in one process; under "
            f"torchrun ({world_size} ranks) generation and training take turns unless some "
            "ranks only generate: set dist.rollout_ranks=R (R < the world size), launch one "
            "process (python -m dapo train ...), or set train.async_staleness=0"
        )


def _model_config(cfg: Config) -> Any:
    """The policy's transformers config, read from config.json (no weights, no code)."""
    if cfg.model.path == "embedded":
        from dapo.models.demo import TinyModelSpec

        spec = TinyModelSpec()
        return {
            "model_type": "qwen2",
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "intermediate_size": 2 * cfg.embedded.hidden,
        }
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir(cfg), trust_remote_code=False)
