"""What every figure of the report shares: run colours, literal legend labels, a panel's frame."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo.run.nofollow import open_binary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def run_colours(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def run_styles(n: int) -> list[tuple[Any, Any]]:
    """(colour, line style) of ``n`` runs, no two alike: :func:`run_colours`, solid, and past
    the colour map's colours (20 for more than 10 runs) the colours again, each round with its
    own pattern: dash-dot, then a dash and 2, 3, ... dots. Dashed and dotted stay the panels'
    own (a response length's max, the tool-call rate), so no round uses them."""
    size = 10 if n <= 10 else 20  # the colour map's size, as run_colours picks it
    return [(colour, line_style(i // size)) for i, colour in enumerate(run_colours(n))]


def line_style(round_: int) -> Any:
    """The line style of the runs in the ``round_``-th pass over the colour map (0: solid)."""
    if round_ == 0:
        return "-"
    if round_ == 1:
        return "-."
    return (0, (4.0, 1.5) + (1.0, 1.5) * round_)


def dash_pattern(style: Any) -> list[float]:
    """The on-off lengths, in line widths, of a run's non-solid :func:`line_style`."""
    if style == "-.":
        import matplotlib

        return list(matplotlib.rcParams["lines.dashdot_pattern"])
    return list(style[1])


def plot_line(ax: Axes, steps: list[float], values: list[float], **kwargs: Any) -> bool:
    """``ax.plot`` of one series that may hold NaN (where the line breaks); whether anything
    was drawn. A point with no finite neighbour (a series of one step, or one between two
    breaks) is invisible as a line, so it gets a marker, unless the line has its own."""
    finite = [math.isfinite(v) for v in values]
    if not any(finite):
        return False
    if "marker" not in kwargs:
        if len(steps) == 1:
            kwargs["marker"] = "o"
        else:
            lone = [
                i
                for i, ok in enumerate(finite)
                if ok and not (i and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])
            ]
            if lone:
                kwargs.update(marker="o", markevery=lone)
    ax.plot(steps, values, **kwargs)
    return True


LEGEND_ROW_IN = 0.21
"""Inches a legend row takes at 9 pt (measured: 0.2025), with a little room."""


def grow_for_legend(
    fig: Figure, top_in: float, extra_rows: int, row_in: float = LEGEND_ROW_IN
) -> float:
    """The top of ``tight_layout``'s rect for a legend over the panels that takes ``top_in``
    inches at the figure's size as made, plus ``extra_rows`` rows of ``row_in`` inches: the
    figure grows by those rows, so the panels keep their height whatever the number of runs
    (shrinking them left 48 runs' panels a sliver under the legend, and matplotlib warned
    "Tight layout not applied")."""
    extra = max(extra_rows, 0) * row_in
    if extra:
        fig.set_figheight(fig.get_figheight() + extra)
    return 1 - (top_in + extra) / fig.get_figheight()


def no_data(ax: Axes) -> None:
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


def legend_label(name: str) -> str:
    """A run name as matplotlib shows it literally: "$" would open a formula otherwise (and a
    name starting with "_", which automatic legends hide, shows: labels are given explicitly)."""
    return name.replace("$", r"\$")


def finish_panel(ax: Axes, title: str, ylabel: str, drawn: bool) -> None:
    """Title, axis labels and grid of a panel over steps; "no data" where nothing was drawn."""
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if not drawn:
        no_data(ax)


def save_figure(fig: Figure, path: Path) -> None:
    """``fig`` as a PNG at ``path``, opened with ``O_NOFOLLOW``: the report directory may sit in
    a run directory from elsewhere, and a PNG's name there may be a link leading anywhere
    (docs/security.md)."""
    with open_binary(path) as f:
        fig.savefig(f, format="png", dpi=110)
