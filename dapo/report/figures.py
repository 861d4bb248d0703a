"""The report's figures: the paper's training-dynamics panels, clipping, dynamic-sampling cost
and held-out accuracy, several runs overlaid (one colour per run), and the mechanisms per
configuration over its seeds (:mod:`dapo.report.mechanisms`), as PNG files."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo.report.mechanisms import MECHANISMS_FIGURE, write_mechanisms
from dapo.report.runs import Run, is_number, kept_frac, series
from dapo.report.style import finish_panel, legend_label, run_colours, save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes

FIGURES = ("dynamics.png", "clipping.png", "sampling.png", "accuracy.png", MECHANISMS_FIGURE)


# A panel: title, y label, and the lines to draw per run as (metric, line style).
PanelSpec = tuple[str, str, list[tuple[str | Callable[[dict[str, Any]], Any], str]]]


def _line_panel(ax: Axes, runs: Sequence[Run], colours: list[Any], spec: PanelSpec) -> None:
    title, ylabel, lines = spec
    drawn = False
    for run, colour in zip(runs, colours, strict=True):
        for key, style in lines:
            steps, values = series(run, key)
            if not steps:
                continue
            # A single point is invisible as a line; show it as a marker.
            marker = "o" if len(steps) == 1 else None
            ax.plot(steps, values, linestyle=style, color=colour, linewidth=1.4, marker=marker)
            drawn = True
    finish_panel(ax, title, ylabel, drawn)


def _figure_legend(
    fig: Any, runs: Sequence[Run], colours: list[Any], styles=(), max_cols: int = 4
) -> int:
    """Put one legend above the panels; return how many rows it takes."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=2) for c in colours]
    labels = [legend_label(run.name) for run in runs]
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

    colours = run_colours(len(runs))
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
    save_figure(fig, path)
    plt.close(fig)


def _accuracy_figure(runs: Sequence[Run], path: Path) -> None:
    import matplotlib.pyplot as plt

    colours = run_colours(len(runs))
    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = tools = False
    for run, colour in zip(runs, colours, strict=True):
        steps, values = series(run, "rollout/accuracy")
        if steps:
            ax.plot(steps, values, color=colour, linewidth=0.8, alpha=0.55)
            drawn = True
        # The interval is drawn only where both ends were logged: older runs have neither.
        band = [
            (float(r["step"]), float(r["val/accuracy_low"]), float(r["val/accuracy_high"]))
            for r in run.rows
            if is_number(r.get("step"))
            and is_number(r.get("val/accuracy"))
            and is_number(r.get("val/accuracy_low"))
            and is_number(r.get("val/accuracy_high"))
        ]
        if band:
            bx, lo, hi = zip(*band, strict=True)
            ax.fill_between(bx, lo, hi, color=colour, alpha=0.18, linewidth=0)
            drawn = True
        steps, values = series(run, "val/accuracy")
        if steps:
            ax.plot(steps, values, color=colour, linewidth=1.8, marker="o", markersize=5)
            drawn = True
        steps, values = series(run, "val/tool_call_frac")  # runs with a tool (env.class)
        if steps:
            ax.plot(steps, values, color=colour, linewidth=1.2, linestyle=":", marker="s")
            tools = True
    finish_panel(ax, "accuracy", "accuracy", drawn)
    legend_rows = _figure_legend(
        fig,
        runs,
        colours,
        styles=(
            ("-", "val/accuracy (band: 95% CI)", {"marker": "o", "linewidth": 1.8}),
            ("-", "rollout/accuracy", {"linewidth": 0.8, "alpha": 0.55}),
            *((":", "val/tool_call_frac", {"marker": "s", "linewidth": 1.2}),) * tools,
        ),
        max_cols=2,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.04 - 0.045 * legend_rows))
    save_figure(fig, path)
    plt.close(fig)


def write_figures(runs: Sequence[Run], out_dir: Path) -> list[Path]:
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
        ("kept fraction (kept / drawn)", "fraction", [(kept_frac, "-")]),
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
    write_mechanisms(runs, paths[4])
    return paths
