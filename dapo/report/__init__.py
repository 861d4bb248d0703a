"""``dapo report RUN_DIR...``: plot one or more run directories into a self-contained HTML page.

Reads each run's ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` (:mod:`.runs`), draws
the paper's training-dynamics panels, clipping, dynamic-sampling cost and held-out accuracy
(several runs overlaid, one colour per run; :mod:`.figures`), and the mechanisms the techniques
act on per configuration, mean and band over seeds (:mod:`.mechanisms`), and writes the PNGs and
``report.html`` (images embedded, so the page opens offline and can be mailed as one file;
:mod:`.page`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dapo.report.figures import FIGURES, write_figures
from dapo.report.page import render_html
from dapo.report.runs import Run, config_differences, read_run

__all__ = ["FIGURES", "Run", "config_differences", "make_report", "read_run"]


def make_report(run_dirs: Sequence[Path | str], out_dir: Path | str) -> Path:
    """Write the five figures and ``report.html`` into ``out_dir``; return the HTML path."""
    if not run_dirs:
        raise ValueError("no run directories given")
    runs = [read_run(d) for d in run_dirs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = write_figures(runs, out)
    html_path = out / "report.html"
    html_path.write_text(render_html(runs, figures), encoding="utf-8")
    return html_path
