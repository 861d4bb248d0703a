"""``dapo report RUN_DIR...``: plot one or more run directories into a self-contained HTML page.

Reads each run's ``config.yaml``, ``metrics.jsonl`` and ``summary.json``, draws the paper's
training-dynamics panels, clipping, dynamic-sampling cost and held-out accuracy (several runs
overlaid, one colour per run), and writes the PNGs and ``report.html`` (images embedded, so the
page opens offline and can be mailed as one file).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only the standard library at module level: dapo/cli.py imports this to build its parser, and
# matplotlib/yaml are needed only when a report is drawn.
if TYPE_CHECKING:
    from matplotlib.axes import Axes

FIGURES = ("dynamics.png", "clipping.png", "sampling.png", "accuracy.png")
# Per-run fields that always differ between runs and say nothing about the experiment.
IGNORED_CONFIG_FIELDS = frozenset({"run.name", "run.out_dir"})

Series = tuple[list[float], list[float]]


@dataclass
class Run:
    """One run directory as read from disk."""

    name: str
    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    summary: dict[str, Any] = field(default_factory=dict)
    samples: list[Any] = field(default_factory=list)

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.rows if _is_number(r.get("step"))]
        return int(max(steps)) if steps else None


def read_run(run_dir: Path | str) -> Run:
    """Read a run directory; unreadable metrics lines are counted in ``skipped``, not raised."""
    import yaml

    path = Path(run_dir)
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"{path}: not a run directory (no metrics.jsonl)")

    config: dict[str, Any] = {}
    config_path = path / "config.yaml"
    if config_path.is_file():
        try:
            loaded = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ValueError(f"{config_path}: not valid YAML: {exc}") from exc
        if isinstance(loaded, dict):
            config = loaded

    rows: list[dict[str, Any]] = []
    skipped = 0
    # errors="replace": a crash mid-write can leave bytes that are not UTF-8; that line is then
    # skipped like any other garbage instead of failing the whole report.
    with metrics_path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(row, dict):
                skipped += 1
                continue
            rows.append(row)

    summary: dict[str, Any] = {}
    summary_path = path / "summary.json"
    if summary_path.is_file():
        try:
            loaded_summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            # A run that crashed before finishing has no usable summary; the curves still count.
            loaded_summary = {}
        if isinstance(loaded_summary, dict):
            summary = loaded_summary

    samples = []
    samples_path = path / "samples.jsonl"
    if samples_path.is_file():
        for line in samples_path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                sample = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(sample, dict) and "response" in sample:
                samples.append(sample)

    return Run(
        name=path.resolve().name,
        path=path,
        config=config,
        rows=rows,
        skipped=skipped,
        summary=summary,
        samples=samples,
    )


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _flatten(sub, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def config_differences(runs: Sequence[Run]) -> list[tuple[str, list[Any]]]:
    """Dotted config fields whose values differ across ``runs``, with each run's value.

    A field missing from some run's config counts as ``None`` there (older runs lack newer
    fields). Fields come in config order, grouped by section.
    """
    flat: list[dict[str, Any]] = []
    for run in runs:
        out: dict[str, Any] = {}
        _flatten(run.config, "", out)
        flat.append(out)
    keys: dict[str, None] = {}
    for cfg in flat:
        keys.update(dict.fromkeys(cfg))
    # Group by section so a field only some runs have sits with its section, not at the end.
    sections = list(dict.fromkeys(key.split(".", 1)[0] for key in keys))
    ordered = sorted(keys, key=lambda k: sections.index(k.split(".", 1)[0]))
    diffs = []
    for key in ordered:
        if key in IGNORED_CONFIG_FIELDS:
            continue
        values = [cfg.get(key) for cfg in flat]
        if any(v != values[0] for v in values[1:]):
            diffs.append((key, values))
    return diffs


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _series(run: Run, key: str | Callable[[dict[str, Any]], Any]) -> Series:
    """(steps, values) of one metric, leaving out rows where it is absent, null or not finite."""
    steps: list[float] = []
    values: list[float] = []
    for row in run.rows:
        step = row.get("step")
        value = key(row) if callable(key) else row.get(key)
        if _is_number(step) and _is_number(value):
            steps.append(float(step))
            values.append(float(value))
    return steps, values


def _kept_frac(row: dict[str, Any]) -> float | None:
    # Older runs may log only the counts; the ratio is the same quantity.
    if _is_number(row.get("sampling/kept_frac")):
        return row["sampling/kept_frac"]
    kept, drawn = row.get("sampling/groups_kept"), row.get("sampling/prompts_drawn")
    if _is_number(kept) and _is_number(drawn) and drawn > 0:
        return kept / drawn
    return None


def _colours(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _no_data(ax: Axes) -> None:
    ax.text(
        0.5,
        0.5,
        "no data",
        transform=ax.transAxes,
        ha="center",
        va="center",
        color="grey",
        fontsize=12,
    )


# A panel: title, y label, and the lines to draw per run as (metric, line style).
PanelSpec = tuple[str, str, list[tuple[str | Callable[[dict[str, Any]], Any], str]]]


def _line_panel(ax: Axes, runs: Sequence[Run], colours: list[Any], spec: PanelSpec) -> None:
    title, ylabel, lines = spec
    drawn = False
    for run, colour in zip(runs, colours, strict=True):
        for key, style in lines:
            steps, values = _series(run, key)
            if not steps:
                continue
            # A single point is invisible as a line; show it as a marker.
            marker = "o" if len(steps) == 1 else None
            ax.plot(steps, values, linestyle=style, color=colour, linewidth=1.4, marker=marker)
            drawn = True
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if not drawn:
        _no_data(ax)


def _figure_legend(
    fig: Any, runs: Sequence[Run], colours: list[Any], styles=(), max_cols: int = 4
) -> int:
    """Put one legend above the panels; return how many rows it takes."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=2) for c in colours]
    labels = [run.name for run in runs]
    for style, label, kwargs in styles:
        handles.append(Line2D([], [], color="black", linestyle=style, **kwargs))
        labels.append(label)
    fig.legend(
        handles,
        labels,
        loc="upper center",
        ncol=min(len(labels), max_cols),
        frameon=False,
        fontsize=9,
        bbox_to_anchor=(0.5, 1.0),
    )
    return math.ceil(len(labels) / max_cols)


def _grid_figure(
    runs: Sequence[Run], panels: list[PanelSpec], shape: tuple[int, int], path: Path, styles=()
) -> None:
    import matplotlib.pyplot as plt

    colours = _colours(len(runs))
    rows, cols = shape
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    flat_axes = [ax for row in axes for ax in row]
    for ax, spec in zip(flat_axes, panels, strict=False):
        _line_panel(ax, runs, colours, spec)
    for ax in flat_axes[len(panels) :]:
        ax.set_visible(False)
    # Leave room at the top for the figure legend, more when it wraps onto several rows.
    legend_rows = _figure_legend(fig, runs, colours, styles)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.05 + 0.035 * legend_rows) / rows))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _accuracy_figure(runs: Sequence[Run], path: Path) -> None:
    import matplotlib.pyplot as plt

    colours = _colours(len(runs))
    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = False
    for run, colour in zip(runs, colours, strict=True):
        steps, values = _series(run, "rollout/accuracy")
        if steps:
            ax.plot(steps, values, color=colour, linewidth=0.8, alpha=0.55)
            drawn = True
        # The interval is drawn only where both ends were logged: older runs have neither.
        band = [
            (float(r["step"]), float(r["val/accuracy_low"]), float(r["val/accuracy_high"]))
            for r in run.rows
            if _is_number(r.get("step"))
            and _is_number(r.get("val/accuracy"))
            and _is_number(r.get("val/accuracy_low"))
            and _is_number(r.get("val/accuracy_high"))
        ]
        if band:
            bx, lo, hi = zip(*band, strict=True)
            ax.fill_between(bx, lo, hi, color=colour, alpha=0.18, linewidth=0)
            drawn = True
        steps, values = _series(run, "val/accuracy")
        if steps:
            ax.plot(steps, values, color=colour, linewidth=1.8, marker="o", markersize=5)
            drawn = True
    ax.set_title("accuracy", fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.grid(True, alpha=0.3)
    if not drawn:
        _no_data(ax)
    legend_rows = _figure_legend(
        fig,
        runs,
        colours,
        styles=(
            ("-", "val/accuracy (band: 95% CI)", {"marker": "o", "linewidth": 1.8}),
            ("-", "rollout/accuracy", {"linewidth": 0.8, "alpha": 0.55}),
        ),
        max_cols=2,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.04 - 0.045 * legend_rows))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_figures(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    import matplotlib

    # Agg: reports are drawn on headless machines and in workers with no display.
    matplotlib.use("Agg")

    dynamics: list[PanelSpec] = [
        (
            "response length",
            "tokens",
            [
                ("rollout/response_len_mean", "-"),
                ("rollout/response_len_max", "--"),
            ],
        ),
        ("reward mean", "reward", [("rollout/reward_mean", "-")]),
        ("entropy", "nats / token", [("train/entropy", "-")]),
        ("mean token probability", "probability", [("train/token_prob_mean", "-")]),
    ]
    clipping: list[PanelSpec] = [
        ("lower clip active", "fraction of tokens", [("clip/low_frac", "-")]),
        ("upper clip active", "fraction of tokens", [("clip/high_frac", "-")]),
        ("up-clipped tokens: mean π_old prob", "probability", [("clip/high_prob_mean", "-")]),
    ]
    sampling: list[PanelSpec] = [
        ("sampling rounds", "rounds", [("sampling/rounds", "-")]),
        ("kept fraction (kept / drawn)", "fraction", [(_kept_frac, "-")]),
        ("tokens per kept group", "tokens", [("sampling/tokens_per_kept_group", "-")]),
    ]
    paths = [out_dir / name for name in FIGURES]
    _grid_figure(
        runs,
        dynamics,
        (2, 2),
        paths[0],
        styles=(("-", "mean", {}), ("--", "max", {})),
    )
    _grid_figure(runs, clipping, (1, 3), paths[1])
    _grid_figure(runs, sampling, (1, 3), paths[2])
    _accuracy_figure(runs, paths[3])
    return paths


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fmt_acc(value: Any) -> str:
    return f"{value:.3f}" if _is_number(value) else "—"


def _skipped_text(n: int) -> str:
    return f"{n} line skipped" if n == 1 else f"{n} lines skipped"


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
pre { white-space: pre-wrap; margin: 0; max-width: 60em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; font-size: 0.9em; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.warn { color: #a40; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #eee; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em;
  vertical-align: middle; }
code { font-size: 0.9em; }
"""


def _html(runs: Sequence[Run], figures: list[Path]) -> str:
    from matplotlib.colors import to_hex

    colours = [to_hex(c) for c in _colours(len(runs))]
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>DAPO report: {esc(', '.join(r.name for r in runs))}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>DAPO run report</h1>",
        "<h2>Runs</h2>",
        "<table><tr><th>run</th><th>directory</th><th>steps</th><th>metrics lines</th>"
        "<th>val accuracy start</th><th>val accuracy end</th></tr>",
    ]
    for run, colour in zip(runs, colours, strict=True):
        steps = run.summary.get("steps", run.last_step)
        skipped = _skipped_text(run.skipped)
        if run.skipped:
            skipped = f'<span class="warn">{skipped}</span>'
        parts.append(
            f'<tr><td><span class="swatch" style="background:{colour}"></span>{esc(run.name)}'
            f"</td><td><code>{esc(str(run.path))}</code></td>"
            f'<td class="num">{esc(_fmt(steps))}</td>'
            f"<td>{len(run.rows)} read, {skipped}</td>"
            f'<td class="num">{_fmt_acc(run.summary.get("val/accuracy_start"))}</td>'
            f'<td class="num">{_fmt_acc(run.summary.get("val/accuracy_end"))}</td></tr>'
        )
    parts.append("</table>")
    parts.append("<h2>Figures</h2>")
    for path in figures:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(
            f'<figure><img alt="{esc(path.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{esc(path.name)}</figcaption></figure>"
        )
    parts.append("<h2>Config differences</h2>")
    if len(runs) < 2:
        parts.append("<p>single run</p>")
    else:
        diffs = config_differences(runs)
        if not diffs:
            parts.append("<p>none: the runs have the same config</p>")
        else:
            header = "".join(f"<th>{esc(r.name)}</th>" for r in runs)
            parts.append(f"<table><tr><th>field</th>{header}</tr>")
            for key, values in diffs:
                cells = "".join(f"<td>{esc(_fmt(v))}</td>" for v in values)
                parts.append(f"<tr><td><code>{esc(key)}</code></td>{cells}</tr>")
            parts.append("</table>")
    parts.append("<h2>Sample responses</h2>")
    shown = False
    for run in runs:
        if not run.samples:
            continue
        shown = True
        step = run.samples[0].get("step", "?")
        parts.append(f"<h3>{esc(run.name)}: final evaluation (step {esc(str(step))})</h3>")
        parts.append(
            "<table><tr><th>kind</th><th>problem</th><th>answer / truth</th><th>response</th></tr>"
        )
        for x in run.samples:
            verdict = "correct" if x.get("correct") else "wrong"
            parts.append(
                f"<tr><td>{esc(str(x.get('kind', '')))}</td><td><code>{esc(str(x.get('uid')))}"
                f"</code></td><td>{esc(str(x.get('answer')))} / "
                f"{esc(str(x.get('ground_truth')))} ({verdict})</td>"
                f"<td><pre>{esc(str(x.get('response'))[-2000:])}</pre></td></tr>"
            )
        parts.append("</table>")
    if not shown:
        parts.append("<p>none: the runs have no samples.jsonl (written at the end of a run)</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def make_report(run_dirs: Sequence[Path | str], out_dir: Path | str) -> Path:
    """Write the four figures and ``report.html`` into ``out_dir``; return the HTML path."""
    if not run_dirs:
        raise ValueError("no run directories given")
    runs = [read_run(d) for d in run_dirs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = _write_figures(runs, out)
    html_path = out / "report.html"
    html_path.write_text(_html(runs, figures), encoding="utf-8")
    return html_path


def add_report_parser(subparsers: argparse._SubParsersAction) -> None:
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
    out_dir = args.out if args.out is not None else Path(args.run_dirs[0]) / "report"
    html_path = make_report(args.run_dirs, out_dir)
    for name in FIGURES:
        print(Path(out_dir) / name)
    print(html_path)
    return 0
