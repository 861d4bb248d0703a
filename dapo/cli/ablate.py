"""``dapo ablate --plan table1|eps-high|2x2|successors|async [--seeds 3]
[--budget steps=N|tokens=N|seconds=S] [--parallel K] [--target ACC] [--config FILE] [--out DIR]
[section.field=value ...]``: run every configuration of a plan at every seed as an ordinary
run under one directory, then print the table as markdown, with a verdict per row on the
paper's claim (Holm-Bonferroni over the table's p-values).

Finished runs are skipped and stopped ones resumed, so the same command continues an
interrupted ablation; a run of another configuration, or one already past the budget, is
refused, and so is an override of a field the plan sets (train.seed, run.preset, a row's
field, or the budget's) or of run.name and run.out_dir (ablate names each run and puts it
under --out). Each run gets run.threads = the cores split between the --parallel runs, or
the run.threads given. One ablation at a time runs in a directory: a second on the same --out
is refused, naming the process that runs it. Beside the runs it writes ``table.md``,
``table.json`` and the overlaid ``dapo report`` of all runs (``report/report.html``). A run
that fails leaves its log beside it; the others go on, and the command exits 1 naming it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dapo.cli.flags import GivenOnce

if TYPE_CHECKING:
    from dapo.ablate.plans import Job


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``ablate`` on the ``dapo`` command's subparsers."""
    from dapo.ablate.plans import PLANS

    p = subparsers.add_parser(
        "ablate",
        help="run a plan of configurations x seeds and print the ablation table",
        description=__doc__,
    )
    p.add_argument("--plan", required=True, choices=tuple(PLANS), help="which configurations")
    p.add_argument("--seeds", type=int, default=3, help="runs per configuration (default 3)")
    p.add_argument(
        "--budget",
        metavar="steps=N|tokens=N|seconds=S",
        help="equal compute per run: N rollout steps, N generated tokens or S seconds of "
        "training steps, each run stopping after the step that spends it (default: the "
        "config's train.steps)",
    )
    p.add_argument(
        "--target",
        type=float,
        metavar="ACC",
        help="held-out accuracy (0-1) whose cost in steps, tokens and seconds is compared "
        "(default: the first row's mean accuracy at the end)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="K",
        help="runs at a time, the cores split between them unless run.threads is given (default 1)",
    )
    p.add_argument(
        "--config",
        type=Path,
        action=GivenOnce,
        help="YAML file every run starts from (a recipe)",
    )
    p.add_argument("--out", type=Path, help="the ablation's directory (default runs/ablate-PLAN)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="for every run (one of a field the plan sets is refused)",
    )
    p.set_defaults(func=cmd_ablate)


def cmd_ablate(args: argparse.Namespace) -> int:
    from dapo.ablate import expand
    from dapo.ablate.runs import ablation_lock, run_jobs
    from dapo.api import training
    from dapo.config import load_config

    if args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}")
    if args.target is not None and not 0.0 <= args.target <= 1.0:
        raise ValueError(f"--target is a held-out accuracy in [0, 1], got {args.target}")
    jobs = expand(args.plan, seeds=args.seeds, budget=args.budget, extra=tuple(args.overrides))
    configs = [load_config(args.config, list(job.overrides)) for job in jobs]
    # Every configuration is checked before any run starts (its device, model, data and
    # context too for the first: the plan's rows change the algorithm, not these).
    training.check_inputs(configs[0])
    out = args.out or Path("runs") / f"ablate-{args.plan}"
    with ablation_lock(out):  # held until the table is written: one ablation at a time
        failed = run_jobs(jobs, out, parallel=args.parallel, config=args.config)
        try:
            _write_table(args, jobs, out)
        finally:  # named even when a finished run's files stop the table (exit 2 then)
            if failed:
                print(
                    f"dapo: error: {len(failed)} run(s) failed: {', '.join(failed)} "
                    f"(logs in {out})",
                    file=sys.stderr,
                )
    # A run failed on the way (exit 1), not a refusal before anything ran (2).
    return 1 if failed else 0


def _done(job: Job, out: Path, config: Path | None) -> bool:
    """Whether ``job``'s run is finished; a run refused as another configuration's (counted
    as failed by run_jobs) is not."""
    from dapo.ablate.runs import job_state

    try:
        return job_state(job, out, config) == "done"
    except ValueError:
        return False


def _write_table(args: argparse.Namespace, jobs: list[Job], out: Path) -> None:
    """Write and print the table of the runs done, their contrast (the 2x2's interaction)
    and their overlaid report."""
    from dapo.ablate import PLANS
    from dapo.ablate.plans import CONTRASTS
    from dapo.ablate.table import (
        ablation_table,
        as_json,
        contrast,
        contrast_line,
        markdown,
        read_result,
    )
    from dapo.run.nofollow import write_atomic

    done = [j for j in jobs if _done(j, out, args.config)]
    results: dict = {}
    for job in done:
        results.setdefault(job.row.name, {})[job.seed] = read_result(out / job.name)
    table = ablation_table(PLANS[args.plan](), results, target=args.target)
    text = markdown(table, missing=[j.name for j in jobs if j not in done])
    if args.plan in CONTRASTS:  # the 2x2's interaction
        name, weights = CONTRASTS[args.plan][0], CONTRASTS[args.plan][1]()
        found = contrast(results, weights)
        if found is not None:
            text += "\n" + contrast_line(name, weights, found)
            write_atomic(out / f"{name}.json", as_json([found]))
    # Never through a link: the ablation's directory may be a copy from elsewhere.
    write_atomic(out / "table.md", text)
    write_atomic(out / "table.json", as_json(table))
    if done:
        from dapo.cli.report import warn_line
        from dapo.report import make_report

        make_report([out / j.name for j in done], out / "report", warn=warn_line)
    print(text, end="")
