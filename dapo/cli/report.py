"""``dapo report RUN_DIR... [--out DIR]``: plot run directories into a self-contained HTML page.

Reads each run's ``config.yaml``, ``metrics.jsonl`` and ``summary.json``, draws the paper's
training-dynamics panels, clipping, dynamic-sampling cost and held-out accuracy (several runs
overlaid, one colour per run) and the mechanisms figure (``mechanisms.png``: entropy,
all-correct groups, groups with a gradient, response length, truncated responses and the
upper clip's share, per configuration as the mean over its seeds with a band from the lowest
to the highest; runs named ``<configuration>-seed<N>`` in one directory, as ``dapo ablate``
writes them, are one configuration), and writes the PNGs and ``report.html`` (images
embedded, so the page opens offline and can be mailed as one file).

An ablation's directory is not a run directory: give the runs inside it
(``dapo report DIR/*-seed*/``), or open the report ``dapo ablate`` wrote in ``DIR/report/``.
A run whose metrics.jsonl ends before the step its summary.json names is marked, its end
accuracy taken from summary.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``report`` on the ``dapo`` command's subparsers."""
    report = subparsers.add_parser(
        "report",
        help="plot run directories into a self-contained report.html",
        description=__doc__,
    )
    report.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories to overlay"
    )
    report.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where to write the PNGs and report.html (default: <first RUN_DIR>/report)",
    )
    report.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    """Write the report for ``args.run_dirs`` and print the paths written."""
    from dapo.report import FIGURES, make_report

    out_dir = args.out if args.out is not None else Path(args.run_dirs[0]) / "report"
    html_path = make_report(args.run_dirs, out_dir, warn=warn_line)
    for name in FIGURES:
        print(Path(out_dir) / name)
    print(html_path)
    return 0


def warn_line(message: str) -> None:
    """Print ``message`` to stderr as dapo's warnings are."""
    print(f"dapo: warning: {message}", file=sys.stderr)
