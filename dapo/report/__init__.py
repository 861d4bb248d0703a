"""``dapo report RUN_DIR...``: plot one or more run directories into a self-contained HTML page.

Reads each run's ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` (:mod:`.runs`), draws
the paper's training-dynamics panels, clipping, dynamic-sampling cost and held-out accuracy
(several runs overlaid, one colour per run; :mod:`.figures`), and the mechanisms the techniques
act on per configuration, mean and band over seeds (:mod:`.mechanisms`), and writes the PNGs and
``report.html`` (images embedded, so the page opens offline and can be mailed as one file;
:mod:`.page`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from dapo.report.figures import FIGURES, write_figures
from dapo.report.mechanisms import mixed_seeds
from dapo.report.page import render_html
from dapo.report.runs import Run, config_differences, nothing_logged, read_run, read_runs
from dapo.run.nofollow import no_link, write_atomic

__all__ = ["FIGURES", "Run", "config_differences", "make_report", "read_run", "read_runs"]


def make_report(
    run_dirs: Sequence[Path | str],
    out_dir: Path | str,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Write the five figures and ``report.html`` into ``out_dir``; return the HTML path.
    ``warn``, when given, is called with each warning the page also shows (runs of one
    configuration's name whose configs differ beyond the seed).

    ``out_dir`` (by default a run directory's ``report/``, and run directories come from
    elsewhere) is refused when it is a symbolic link, and every file is written with
    ``O_NOFOLLOW``: a link in a file's place is refused, naming it, never written through."""
    if not run_dirs:
        raise ValueError("no run directories given")
    runs = read_runs(run_dirs)
    empty = nothing_logged(runs)
    if empty:  # figures with no line in them, and no step to name
        raise ValueError(empty)
    out = no_link(Path(out_dir))
    out.mkdir(parents=True, exist_ok=True)
    no_link(out)  # made a link between the check and mkdir: refused all the same
    for warning in mixed_seeds(runs) if warn is not None else ():
        warn(warning)
    figures = write_figures(runs, out)
    html_path = out / "report.html"
    write_atomic(html_path, render_html(runs, figures))
    return html_path
