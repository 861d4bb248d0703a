"""``dapo eval``: the paper's protocol with intervals, and paired comparisons of two runs.

    dapo eval MODEL_DIR --data FILE [--k 32] [--pass-k 1,8,32] [--temperature 1.0]
              [--top-p 0.7] [--max-new-tokens N] [--seed S] [--greedy] [--out DIR]
    dapo eval --compare A.jsonl B.jsonl          (or eval directories, or two models + --data)

MODEL_DIR is any saved causal LM (a run's ``model/`` or a checkpoint's ``model/``), or
``embedded`` for the demo's starting policy; ``--data arith`` is the demo's held-out split.
Imports only the standard library at module level (see :mod:`dapo.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_OUT = "evals"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from dapo.config import ModelConfig, RolloutConfig, choices

    ev = subparsers.add_parser(
        "eval",
        help="avg@k, pass@k, maj@k with 95%% bootstrap intervals; --compare two evaluations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("model", nargs="?", help="a saved model directory, or 'embedded'")
    ev.add_argument("--data", help="Parquet/JSONL problem file (DAPO or flat), or 'arith'")
    ev.add_argument("--k", type=int, default=32, help="samples per problem (default 32)")
    ev.add_argument("--pass-k", default="", help="comma-separated k' <= k (default: 1,k)")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--top-p", type=float, default=0.7)
    ev.add_argument("--max-new-tokens", type=int, default=20480)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--greedy", action="store_true", help="also report greedy accuracy")
    ev.add_argument("--num-problems", type=int, default=0, help="only the first N (0 = all)")
    ev.add_argument("--reward-mode", default="", help="dapo, lenient or math_verify for every row")
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
    ev.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    ev.add_argument(
        "--phrases",
        default="",
        help="comma-separated reflective phrases to count (default: wait, let me check, ...)",
    )
    ev.add_argument("--out", type=Path, help=f"output directory (default {DEFAULT_OUT}/<name>)")
    ev.add_argument("--device", default="auto")
    ev.add_argument(
        "--engine",
        default="dapo",
        choices=choices(RolloutConfig, "engine"),
        help="rollout engine: dapo (default) or hf (transformers generate)",
    )
    ev.add_argument("--dtype", default="float32", choices=choices(ModelConfig, "compute_dtype"))
    ev.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("A", "B"),
        help="compare two evaluations (problems.jsonl or its directory), or two models (--data)",
    )
    _add_setting_args(ev)
    ev.set_defaults(func=cmd_eval)


def _add_setting_args(ev: argparse.ArgumentParser) -> None:
    ev.add_argument(
        "--config",
        help="a run's YAML (a recipe, a run's config.yaml): its arith section shapes --data arith",
    )
    ev.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads (default 0: auto, fewer while other processes keep cores busy)",
    )


def _ks(text: str, k: int) -> list[int]:
    if not text:
        return sorted({1, k})
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--pass-k {text!r}: give comma-separated integers, e.g. 1,8,32") from None
    bad = [x for x in ks if not 1 <= x <= k]
    if bad:
        raise ValueError(f"--pass-k: {bad} not in 1..k={k}; pass@k' needs k' <= k samples")
    return ks


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated token ids, e.g. 151645") from None


def _phrases(text: str) -> tuple[str, ...]:
    from dapo.eval.metrics import REFLECTIVE_PHRASES

    return tuple(p.strip() for p in text.split(",") if p.strip()) or REFLECTIVE_PHRASES


def _problems(args: argparse.Namespace):
    if args.data == "arith":
        from dapo.config import load_config
        from dapo.train.inputs import load_run_data

        # The held-out split `dapo train` evaluates on (with --config: that run's arith task).
        cfg = load_config(args.config, ["data.train_file=", "data.val_file="])
        problems = load_run_data(cfg).val
    else:
        from dapo.data.files import load_problems

        if args.config:
            raise ValueError("--config shapes --data arith only; a data file is read as it is")
        problems = load_problems(args.data).problems
    return problems[: args.num_problems] if args.num_problems else problems


def _model(args: argparse.Namespace):
    """The policy to evaluate on ``--device`` in ``--dtype``, and its tokenizer."""
    from dapo.config import load_config
    from dapo.models import policy
    from dapo.train import inputs

    if args.model == "embedded":
        # The demo's starting policy, from the warm-up cache (built first if missing).
        cfg = load_config(None, [])
        warmup, tokenizer = inputs.load_run_data(cfg).warmup_pairs, None
    else:
        cfg = load_config(None, [f"model.path={args.model}"])
        warmup, tokenizer = [], policy.load_tokenizer(cfg)
    # Set after the config is checked: the demo base reuses sampler log-probs in training,
    # which needs float32; an evaluation does not train.
    cfg.model.device = args.device
    # Weights in --dtype too: an evaluation holds no optimizer state to keep in float32.
    cfg.model.param_dtype = cfg.model.compute_dtype = args.dtype
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731 - stdout is the result table
    return policy.load_policy(cfg, warmup, tokenizer, log=log)


def _metrics(records: list[dict], ks: list[int], phrases) -> dict[str, dict[str, float]]:
    from dapo.eval.metrics import record_metrics

    return {r["uid"]: record_metrics(r, ks=ks, phrases=phrases) for r in records}


def _table(summary: dict, title: str) -> str:
    lines = [title, f"{'metric':<18} mean [95% bootstrap interval over problems]"]
    lines += [f"{name:<18} {iv}" for name, iv in summary.items()]
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check(args: argparse.Namespace) -> None:
    if not args.model or not args.data:
        raise ValueError("dapo eval needs MODEL_DIR and --data FILE (or --compare A B)")
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = auto), got {args.threads}")
    if args.model != "embedded" and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"{args.model} is not a saved model directory (no config.json)")


def cmd_eval(args: argparse.Namespace) -> int:
    if args.compare:
        return cmd_compare(args)
    _check(args)
    ks, phrases = _ks(args.pass_k, args.k), _phrases(args.phrases)
    problems = _problems(args)
    from dapo.eval.evaluate import sample_records
    from dapo.eval.journal import Journal
    from dapo.eval.metrics import summarize
    from dapo.models.policy import stop_token_ids
    from dapo.reward.pool import RewardPool
    from dapo.rollout import make_engine

    out = _out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    journal = Journal(out, _protocol(args, len(problems)))
    done = journal.resume([p.uid for p in problems])
    if done:
        print(f"resuming: {len(done)} of {len(problems)} problems already in {journal.path}")
    model, tokenizer = _model(args)
    model.eval()
    extra = _ids(args.stop_token_ids, "--stop-token-ids")
    t0 = time.perf_counter()
    before_batch = _progress(args, t0)
    with RewardPool(workers=1) as pool:
        records = done + sample_records(
            make_engine(args.engine, model, tokenizer, stop_token_ids(model, tokenizer, extra)),
            tokenizer,
            problems[len(done) :],
            first_index=len(done),
            k=args.k,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            pool=pool,
            greedy=args.greedy,
            system_prompt=args.system_prompt,
            reward_mode=args.reward_mode,
            before_batch=lambda i, n: before_batch(len(done) + i, len(done) + n),
            after_batch=journal.append,
        )
    before_batch(len(problems), len(problems))
    per_problem = _metrics(records, ks, phrases)
    summary = summarize(list(per_problem.values()), resamples=args.resamples, seed=args.seed)
    _save(args, out, records, per_problem, summary, seconds=time.perf_counter() - t0)
    journal.finish()
    title = (
        f"{args.model} on {args.data}: {len(problems)} problems x {args.k} samples "
        f"(T {args.temperature}, top_p {args.top_p}, seed {args.seed})"
    )
    print(_table(summary, title))
    print(f"wrote {out / 'summary.json'} and {out / 'problems.jsonl'}")
    return 0


def _progress(args: argparse.Namespace, t0: float):
    """Before each batch: the thread count for it (``--threads``), and a progress line."""
    import torch

    from dapo.run.threads import ThreadGovernor

    governor = ThreadGovernor() if args.threads == 0 else None
    if args.threads:
        torch.set_num_threads(args.threads)

    def before_batch(done: int, total: int) -> None:
        threads = governor.adjust() if governor is not None else torch.get_num_threads()
        print(
            f"  {done}/{total} problems, {time.perf_counter() - t0:.0f} s, {threads} threads",
            file=sys.stderr,
            flush=True,
        )

    return before_batch


def _protocol(args: argparse.Namespace, problems: int) -> dict:
    """What the evaluation is: its records repeat exactly when all of this does."""
    return {
        "model": str(args.model),
        "data": str(args.data),
        "problems": problems,
        "k": args.k,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "system_prompt": args.system_prompt,
        "stop_token_ids": args.stop_token_ids,
        "engine": args.engine,
        "greedy": args.greedy,
        "reward_mode": args.reward_mode,
        "dtype": args.dtype,
    }


def _save(args, out: Path, records: list[dict], per_problem: dict, summary, *, seconds) -> None:
    """summary.json (the protocol and the metrics) and problems.jsonl (one record each)."""
    protocol = {
        **_protocol(args, len(records)),
        "resamples": args.resamples,
        "reward_faults": sum(r["faults"] for r in records),
        "seconds": round(seconds, 1),
    }
    result = {
        "protocol": protocol,
        "metrics": {k: {"mean": v.mean, "low": v.low, "high": v.high} for k, v in summary.items()},
    }
    _write(out / "summary.json", json.dumps(result, indent=2) + "\n")
    lines = [json.dumps({**r, "metrics": per_problem[r["uid"]]}) for r in records]
    _write(out / "problems.jsonl", "\n".join(lines) + "\n")


def _out_dir(args: argparse.Namespace) -> Path:
    if args.out:
        return args.out
    if args.model == "embedded":
        name = "embedded"
    else:
        path = Path(args.model).resolve()
        # runs/<name>/model and checkpoints/step_N/model: the parent says which one.
        name = f"{path.parent.name}-{path.name}" if path.name == "model" else path.name
    return Path(DEFAULT_OUT) / f"{name}-{Path(args.data).stem}-k{args.k}"


def _is_model(path: Path) -> bool:
    return str(path) == "embedded" or (path / "config.json").is_file()


def _read_problems(path: Path) -> dict[str, dict[str, float]]:
    path = path / "problems.jsonl" if path.is_dir() else path
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--compare: cannot read {path}: {exc.strerror}") from None
    out = {}
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            out[record["uid"]] = record["metrics"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"--compare: {path} line {i + 1} is not a dapo eval record (uid, metrics)"
            ) from None
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    from dapo.eval.metrics import compare

    a_path, b_path = args.compare
    if _is_model(a_path) or _is_model(b_path):
        # Two models (or a model and a saved evaluation): evaluate each model first, with the
        # same data, k and seed, so that both sides see the same problems.
        if not args.data:
            raise ValueError("--compare with a model directory needs --data FILE (or arith)")
        evaluated = []
        for side, path in (("A", a_path), ("B", b_path)):
            if _is_model(path):
                one = argparse.Namespace(**{**vars(args), "model": str(path), "compare": None})
                one.out = args.out / side if args.out else None
                cmd_eval(one)
                path = _out_dir(one)
            evaluated.append(path)
        a_path, b_path = evaluated
    a, b = _read_problems(a_path), _read_problems(b_path)
    common = a.keys() & b.keys()
    result = compare(a, b, resamples=args.resamples, seed=args.seed)
    print(f"A = {a_path}\nB = {b_path}\n{len(common)} problems in both", end="")
    dropped = len(a) + len(b) - 2 * len(common)
    print(f" ({dropped} only in one, left out)" if dropped else "")
    print(f"{'metric':<18} {'A':<24} {'B':<24} {'B - A [95% paired]':<26} p (permutation)")
    for name, row in result.items():
        if name == "changed":
            continue
        print(f"{name:<18} {row['a']!s:<24} {row['b']!s:<24} {row['diff']!s:<26} {row['p']:.4f}")
    changed = result["changed"]
    print(f"\nproblems whose avg@k changed: {len(changed)}")
    for uid, va, vb in changed[:10]:
        print(f"  {uid}: {va:.3f} -> {vb:.3f}")
    if len(changed) > 10:
        print(f"  ... and {len(changed) - 10} more")
    return 0
