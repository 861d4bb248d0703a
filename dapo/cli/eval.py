"""``dapo eval``: the paper's protocol with intervals, and paired comparisons of two runs.

    dapo eval MODEL_DIR --data FILE [--k 32] [--pass-k 1,8,32] [--temperature 1.0]
              [--top-p 0.7] [--max-new-tokens N] [--seed S] [--greedy] [--out DIR]
    dapo eval --compare A.jsonl B.jsonl          (or eval directories, or two models + --data)

MODEL_DIR is any saved causal LM (a run's ``model/``, a checkpoint exported with ``dapo
export`` (a LoRA run's with ``--merge``: an adapter directory is refused, naming that fix)),
a Hugging Face Hub model id, or ``embedded`` for the demo's starting policy; ``--data
arith`` is the demo's held-out split.
"""

# Only the standard library at module level (see dapo.cli).

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from dapo.cli.compare_files import data_needed, read_problems, refuse_model_files, same_problems
from dapo.cli.data import add_format_args
from dapo.cli.flags import GivenOnce

DEFAULT_OUT = "evals"  # dapo.api.evaluation.DEFAULT_OUT (not imported here: see dapo.cli)


def add_parser(subparsers: argparse._SubParsersAction) -> None:

    ev = subparsers.add_parser(
        "eval",
        help="avg@k, pass@k, maj@k with 95%% bootstrap intervals; --compare two evaluations",
        description=__doc__,
    )
    ev.add_argument("model", nargs="?", help="a model directory, a Hub id, or 'embedded'")
    ev.add_argument("--data", help="Parquet/JSONL problem file (DAPO or flat), or 'arith'")
    ev.add_argument("--k", type=int, default=32, help="samples per problem (default 32)")
    ev.add_argument("--pass-k", default="", help="comma-separated k' <= k (default: 1,k)")
    _add_sampling_args(ev)
    ev.add_argument("--greedy", action="store_true", help="also report greedy accuracy")
    ev.add_argument("--num-problems", type=int, default=0, help="only the first N (0 = all)")
    ev.add_argument(
        "--reward-mode",
        default="",
        help="one verifier for every row: dapo, math_dapo_boxed, lenient, math_verify or any "
        "task name (default: each row's data_source)",
    )
    ev.add_argument(
        "--reward-function",
        default="",
        metavar="PATH.py:NAME",
        help="a reward function of your own for every row (as reward.function)",
    )
    ev.add_argument(
        "--stop-token-ids",
        default="",
        help="comma-separated token ids that also end a response (as rollout.stop_token_ids)",
    )
    ev.add_argument(
        "--system-prompt",
        default=None,
        help="a system message before every problem (as data.system_prompt; '' for an empty one)",
    )
    ev.add_argument(
        "--resamples", type=int, default=10_000, help="bootstrap resamples (default 10000)"
    )
    ev.add_argument(
        "--phrases",
        default="",
        help="comma-separated reflective phrases to count (default: wait, let me check, ...)",
    )
    ev.add_argument("--out", type=Path, help=f"output directory (default {DEFAULT_OUT}/<name>)")
    ev.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("A", "B"),
        help="compare two evaluations (problems.jsonl or its directory), or two models (--data)",
    )
    _add_engine_args(ev)
    _add_setting_args(ev)
    ev.set_defaults(func=cmd_eval)
    ev.set_defaults(eval_defaults=vars(ev.parse_args([])))  # what a flag not given holds


def _add_sampling_args(ev: argparse.ArgumentParser) -> None:
    """How responses are drawn."""
    ev.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)"
    )
    ev.add_argument(
        "--top-p", type=float, default=0.7, help="nucleus sampling, the paper's (default 0.7)"
    )
    ev.add_argument(
        "--max-new-tokens",
        type=int,
        default=20480,
        help="longest response in tokens, the paper's L_max (default 20480)",
    )
    ev.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed: the same seed, the same samples (default 0)",
    )


def _add_engine_args(ev: argparse.ArgumentParser) -> None:
    """Where and how the model runs."""
    from dapo.config import ModelConfig, RolloutConfig, choices

    ev.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or cuda:N (default auto: the first GPU if there is one, else cpu)",
    )
    ev.add_argument(
        "--engine",
        default="dapo",
        choices=choices(RolloutConfig, "engine"),
        help="rollout engine: dapo (the native one), hf (transformers' generate) or vllm "
        "(needs vLLM installed) (default dapo)",
    )
    ev.add_argument(
        "--dtype",
        default="float32",
        choices=choices(ModelConfig, "compute_dtype"),
        help="the dtype the model computes in (default float32)",
    )


def _add_setting_args(ev: argparse.ArgumentParser) -> None:
    add_format_args(ev)
    ev.add_argument(
        "--wrap-template",
        action="store_true",
        help="wrap each problem in the DAPO instruction template, unless it starts with it (a "
        "copy that lost it: the shared DAPO-Math-17k)",
    )
    ev.add_argument(
        "--on-bad-row",
        choices=("error", "skip"),
        default="error",
        help="error: stop at the first unusable row; skip: leave such rows out and say how "
        "many (default error)",
    )
    ev.add_argument(
        "--config",
        action=GivenOnce,
        help="a run's YAML (a recipe, a run's config.yaml): its arith section shapes --data "
        "arith, its env section (env.class) makes each sample an episode with the tool, and "
        "its reward and code sections grade as the run does (reward.function or reward.mode "
        "where neither --reward-function nor --reward-mode is given; reward.workers, "
        "timeout_s, memory_mb, batch_timeout_s; code.*)",
    )
    ev.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads (default 0: auto, fewer while other processes keep cores busy)",
    )


def _request(args: argparse.Namespace) -> Any:
    """The flags as :class:`dapo.api.evaluation.EvalRequest` (the same names)."""
    from dataclasses import fields

    from dapo.api.evaluation import EvalRequest

    return EvalRequest(**{f.name: getattr(args, f.name) for f in fields(EvalRequest)})


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM during ``dapo eval``: a KeyboardInterrupt, so that no ``except
    Exception`` on the way (a verifier's, graded in-process) takes it for a fault."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    # As an exception, so the reward workers' pool and multiprocessing's clean-up run
    # (SIGTERM's default action left /tmp/pymp-* behind at every stop).
    raise Stopped(signum)


def _stop_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The stop ``exc`` is, or that it was raised while handling: a stop raised inside torch's
    vmap (transformers 4.x builds its masks with it) breaks functorch's layer stack, whose
    clean-up then fails with an internal assert in its place."""
    from dapo.exception_chain import found_in_chain

    return found_in_chain(exc, KeyboardInterrupt)


def cmd_eval(args: argparse.Namespace) -> int:
    if args.compare:
        return cmd_compare(args)
    from dapo.api.evaluation import run

    request = _request(args)
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        run(request)
    except (KeyboardInterrupt, Exception) as exc:
        stop = _stop_behind(exc)
        if stop is None:
            raise
        signum = getattr(stop, "signum", signal.SIGINT)
        print(
            f"dapo: evaluation stopped by {signal.Signals(signum).name}; the problems it "
            "finished are kept (problems.partial.jsonl in its output directory): run the same "
            "command again to continue",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return 0


def _is_model(path: Path) -> bool:
    """A model to evaluate: ``embedded``, a model directory, or a Hub id (``org/name``, no
    such local path), which ``dapo eval`` reads from the Hub cache as training does."""
    if str(path) == "embedded" or (path / "config.json").is_file():
        return True
    from dapo.models.hub import looks_like_hub_id

    return not path.exists() and "/" in str(path) and looks_like_hub_id(str(path))


def cmd_compare(args: argparse.Namespace) -> int:
    from dapo.api.eval_inputs import check_data_fits
    from dapo.api.evaluation import check_request, out_dir
    from dapo.eval.metrics import compare

    a_path, b_path = args.compare
    if args.model:
        raise ValueError(
            f"--compare A B compares two evaluations or models; MODEL ({args.model}) would not "
            "be used: drop it, or give it as A or B"
        )
    refuse_model_files(a_path, b_path)
    if _is_model(a_path) or _is_model(b_path):
        # Two models (or a model and a saved evaluation): evaluate each model first, with the
        # same data, k and seed, so that both sides see the same problems.
        if not args.data:
            raise data_needed(a_path, b_path)
        ones = {}
        for side, path in (("A", a_path), ("B", b_path)):
            if _is_model(path):
                one = argparse.Namespace(**{**vars(args), "model": str(path), "compare": None})
                one.out = args.out / side if args.out else None
                check_request(_request(one))  # both sides, before A is sampled for minutes
                ones[side] = one
        for one in ones.values():  # then the data in each model's context (B's too)
            check_data_fits(_request(one))
        for one in ones.values():
            if status := cmd_eval(one):  # stopped (Ctrl-C, SIGTERM): nothing to compare
                return status
        a_path, b_path = (
            out_dir(_request(ones[side])) if side in ones else path
            for side, path in (("A", a_path), ("B", b_path))
        )
    else:
        _refuse_unused_flags(args)
    (a, truths_a), (b, truths_b) = read_problems(a_path), read_problems(b_path)
    same_problems(truths_a, truths_b)
    common = a.keys() & b.keys()
    result = compare(a, b, resamples=args.resamples, seed=args.seed)
    print(f"A = {a_path}\nB = {b_path}\n{len(common)} problems in both", end="")
    dropped = len(a) + len(b) - 2 * len(common)
    print(f" ({dropped} only in one, left out)" if dropped else "")
    for line in protocol_differences(a_path, b_path):
        print(line)
    print(f"{'metric':<18} {'A':<24} {'B':<24} {'B - A [95% paired]':<26} p (permutation)")
    for name, row in result.items():
        if name == "changed":
            continue
        print(f"{name:<18} {row['a']!s:<24} {row['b']!s:<24} {row['diff']!s:<26} {_p(row['p'])}")
    changed = result["changed"]
    print(f"\nproblems whose avg@k changed: {len(changed)}")
    for uid, va, vb in changed[:10]:
        print(f"  {uid}: {va:.3f} -> {vb:.3f}")
    if len(changed) > 10:
        print(f"  ... and {len(changed) - 10} more")
    return 0


def _p(value: float) -> str:
    """A p-value to 4 decimals, or (under 0.0001, never 0) in 2 digits, not as 0.0000."""
    return f"{value:.4f}" if value >= 0.0001 else f"{value:.1e}"


COMPARE_FLAGS = frozenset({"compare", "resamples", "seed", "threads", "func", "eval_defaults"})
"""What comparing two saved evaluations reads (``--seed``: the bootstrap's)."""


def _refuse_unused_flags(args: argparse.Namespace) -> None:
    """Refuse the flags that shape an evaluation when both sides of --compare are
    evaluations already made: a --temperature or --data given there would change nothing
    while the table seemed to answer for it."""
    defaults = getattr(args, "eval_defaults", {})
    given = [
        f"--{key.replace('_', '-')}"
        for key, default in defaults.items()
        if key not in COMPARE_FLAGS and getattr(args, key, default) != default
    ]
    if given:
        raise ValueError(
            f"--compare {args.compare[0]} {args.compare[1]} compares two evaluations already "
            f"made; {', '.join(given)} would not be used (they shape an evaluation). Drop "
            f"{'them' if len(given) > 1 else 'it'}, or give a model directory as A or B to "
            "evaluate it with them"
        )


SAMPLING = ("k", "temperature", "top_p", "max_new_tokens", "greedy", "system_prompt")
SAMPLING += ("stop_token_ids", "reward_mode", "reward_function", "engine", "dtype")
SAMPLING += ("data_options", "config", "phrases")
"""What two evaluations' summary.json must share for their rows to measure the same thing:
how they sampled, graded, read the data (``--wrap-template``, the keys), the ``--config``
(its env, code and reward settings; by digest) and the phrases ``reflective_frac`` counts."""


def protocol_differences(a_path: Path, b_path: Path) -> list[str]:
    """One line per sampling or grading setting the two evaluations' summary.json files (beside
    their problems.jsonl) disagree on: maj@k of k = 4 against k = 32, or two temperatures,
    are not the same measure, and the table alone would not say so. Nothing when either side
    has no readable summary."""
    protocols = [_protocol(p) for p in (a_path, b_path)]
    if None in protocols:
        return []
    a, b = ({**p, "config": _digest(p.get("config"))} for p in protocols)
    lines = [
        f"  {key}: {a.get(key)!r} (A) vs {b.get(key)!r} (B)"
        for key in SAMPLING
        if a.get(key) != b.get(key)
    ]
    head = "the two evaluations differ in protocol (rows below compare unlike measures):"
    return [head, *lines] if lines else []


def _digest(config: Any) -> Any:
    """A ``--config``'s digest: the same file read from two places is the same config."""
    return config.get("sha256") if isinstance(config, dict) else config


def _protocol(path: Path) -> dict[str, Any] | None:
    if not path.is_dir() and path.name != "problems.jsonl":
        return None  # a records file of its own: no summary of its protocol beside it
    from dapo.api.evaluation import saved_protocol

    return saved_protocol((path if path.is_dir() else path.parent) / "summary.json")
