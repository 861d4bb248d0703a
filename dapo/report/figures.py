"""The report's figures: the paper's training-dynamics panels, clipping, dynamic-sampling cost
and held-out accuracy, several runs overlaid (one colour per run, past 20 runs a line style
too; a line breaks where a step logged null), and the mechanisms per configuration over its
seeds (:mod:`dapo.report.mechanisms`), as PNG files."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo.report.mechanisms import MECHANISMS_FIGURE, write_mechanisms
from dapo.report.runs import Run, is_number, kept_frac, line_series
from dapo.report.style import (
    finish_panel,
    grow_for_legend,
    legend_label,
    plot_line,
    run_styles,
    save_figure,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGURES = ("dynamics.png", "clipping.png", "sampling.png", "accuracy.png", MECHANISMS_FIGURE)


# A panel: title, y label, and the lines to draw per run as (metric, line style).
PanelSpec = tuple[str, str, list[tuple[str | Callable[[dict[str, Any]], Any], str]]]


def _line_panel(
    ax: Axes, runs: Sequence[Run], looks: list[tuple[Any, Any]], spec: PanelSpec
) -> None:
    title, ylabel, lines = spec
    drawn = False
    for run, (colour, run_style) in zip(runs, looks, strict=True):
        for key, style in lines:
            # The run's own style on its solid lines; a dashed one says which metric it is.
            linestyle = run_style if style == "-" else style
            steps, values = line_series(run, key)  # NaN where a step logged null: a break
            drawn |= plot_line(ax, steps, values, linestyle=linestyle, color=colour, linewidth=1.4)
    finish_panel(ax, title, ylabel, drawn)


def _figure_legend(
    fig: Any, runs: Sequence[Run], looks: list[tuple[Any, Any]], styles=(), max_cols: int = 4
) -> int:
    """Put one legend above the panels; return how many rows it takes."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linestyle=s, linewidth=2) for c, s in looks]
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


def grid_figure(
    runs: Sequence[Run], panels: list[PanelSpec], shape: tuple[int, int], styles=()
) -> Figure:
    """``panels`` on a ``shape`` grid, the runs overlaid, their legend above; the caller saves
    and closes it."""
    import matplotlib.pyplot as plt

    looks = run_styles(len(runs))
    rows, cols = shape
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    flat_axes = [ax for row in axes for ax in row]
    for ax, spec in zip(flat_axes, panels, strict=False):
        _line_panel(ax, runs, looks, spec)
    for ax in flat_axes[len(panels) :]:
        ax.set_visible(False)
    # Room at the top for the figure legend: a row's worth, and past one row the figure grows
    # by the rows, never the panels shrink.
    legend_rows = _figure_legend(fig, runs, looks, styles)
    top = grow_for_legend(fig, 3.8 * (0.05 + 0.035), legend_rows - 1)
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def accuracy_figure(runs: Sequence[Run]) -> Figure:
    """Held-out accuracy (band: its 95% interval) and rollout accuracy of each run, the legend
    above; the caller saves and closes it."""
    looks = run_styles(len(runs))
    fig, drawn, tools = _accuracy_axes(runs, looks)
    legend_rows = _figure_legend(
        fig,
        runs,
        looks,
        styles=(
            ("-", "val/accuracy (band: 95% CI)", {"marker": "o", "linewidth": 1.8}),
            ("-", "rollout/accuracy", {"linewidth": 0.8, "alpha": 0.55}),
            *((":", "val/tool_call_frac", {"marker": "s", "linewidth": 1.2}),) * tools,
        ),
        max_cols=2,
    )
    # Two rows (a run and the line kinds) have room at its size as made; more grow it.
    fig.tight_layout(rect=(0, 0, 1, grow_for_legend(fig, 4.8 * 0.13, legend_rows - 2)))
    return fig


def _accuracy_axes(runs: Sequence[Run], looks: list[tuple[Any, Any]]) -> tuple[Any, bool, bool]:
    """The accuracy figure's one panel drawn: (figure, anything drawn, any tool-call rate)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = tools = False
    for run, (colour, style) in zip(runs, looks, strict=True):
        steps, values = line_series(run, "rollout/accuracy")
        drawn |= plot_line(
            ax, steps, values, color=colour, linestyle=style, linewidth=0.8, alpha=0.55
        )
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
        steps, values = line_series(run, "val/accuracy")
        drawn |= plot_line(
            ax,
            steps,
            values,
            color=colour,
            linestyle=style,
            linewidth=1.8,
            marker="o",
            markersize=5,
        )
        steps, values = line_series(run, "val/tool_call_frac")  # runs with a tool (env.class)
        tools |= plot_line(
            ax, steps, values, color=colour, linewidth=1.2, linestyle=":", marker="s"
        )
    finish_panel(ax, "accuracy", "accuracy", drawn)
    return fig, drawn, tools


def write_figures(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    import matplotlib

    # Agg: reports are drawn on headless machines and in workers with no display.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    makers: list[Callable[[], Figure]] = [
        lambda: grid_figure(runs, dynamics, (2, 2), styles=(("-", "mean", {}), ("--", "max", {}))),
        lambda: grid_figure(runs, clipping, (1, 3)),
        lambda: grid_figure(runs, sampling, (1, 3)),
        lambda: accuracy_figure(runs),
    ]
    for make, path in zip(makers, paths, strict=False):
        fig = make()  # one at a time: a link in a figure's place stops the report at that one
        try:
            save_figure(fig, path)
        finally:
            plt.close(fig)
    write_mechanisms(runs, paths[4])
    return paths
