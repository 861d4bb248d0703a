"""What every figure of the report shares: run colours, literal legend labels, a panel's frame."""

from __future__ import annotations

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
