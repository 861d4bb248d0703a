"""The mechanisms figure: what the paper's techniques act on, per configuration over its seeds.

Runs named ``<configuration>-seed<N>`` in one directory (as ``dapo ablate`` lays them out) are
one configuration; each panel draws, per configuration, the mean over its seeds and a band
from the lowest to the highest seed at the steps every seed reached (one seed: its own line),
and past the last of those, when seeds stopped at different steps (a ``tokens=N`` budget), each
seed that went on as a thin line of its own, so no stretch of the mean is over fewer seeds
than its legend says:

- entropy: the paper finds it collapses under a symmetric clip, not under Clip-Higher
  (DAPO §3.1);
- all-correct groups and the groups that carry a gradient: without dynamic sampling the
  effective batch shrinks as groups become all right (§3.2);
- response length and the truncated share: responses that reach L_max, what overlong
  filtering, soft punishment and token-level weighting act on (§3.3, §3.4);
- the upper clip's share of tokens: how often the upper bound binds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo.report.runs import Run, config_differences, is_number, last_rows
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

MECHANISMS_FIGURE = "mechanisms.png"

PANELS = (
    ("entropy", "nats / token", "train/entropy"),
    ("all-correct groups", "share of groups drawn", "sampling/all_correct_frac"),
    ("groups with a gradient", "groups", "sampling/groups_with_gradient"),
    ("response length", "tokens (mean)", "rollout/response_len_mean"),
    ("truncated responses", "share of responses", "rollout/truncated_frac"),
    ("upper clip active", "share of tokens", "clip/high_frac"),
)

_SEED = re.compile(r"-seed\d+$")


def configurations(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by configuration, in first-seen order: by the directory that holds them
    and their own directory's name without a ``-seed<N>`` suffix (``dapo ablate`` writes
    ``OUT/<configuration>-seed<N>``). Runs of one name under two directories (two ablations,
    perhaps of other settings) are two configurations, labelled apart by as many of their
    directories' trailing components as tell them apart (``A/x``, ``B/x``). Runs of one name
    whose configs differ beyond ``train.seed`` are not seeds of one configuration: each set
    of equal configs is drawn apart, labelled by its runs' directories (:func:`mixed_seeds`
    says which fields differ)."""
    return {label: members for _, label, members, _ in _grouped(runs)}


def mixed_seeds(runs: Sequence[Run]) -> list[str]:
    """One warning per configuration name whose runs' configs differ beyond ``train.seed``,
    naming it and (up to three of) the fields: the mechanisms figure draws them apart, not
    averaged (its legend names each set's runs)."""
    warnings: dict[str, str] = {}
    for name, _, _, fields in _grouped(runs):
        if fields:
            more = f" and {len(fields) - 3} more" if len(fields) > 3 else ""
            shown = ", ".join(fields[:3]) + more
            warnings[name] = (
                f"the runs named {name}-seed<N> are not seeds of one configuration: their "
                f"configs differ in {shown}; the mechanisms figure draws each config apart, "
                "not averaged (give one configuration's seeds to average them)"
            )
    return list(warnings.values())


def _grouped(runs: Sequence[Run]) -> list[tuple[str, str, list[Run], list[str]]]:
    """Per configuration: its name's label, its own label, its runs, and the fields in which
    the runs of its name differ beyond the seed."""
    groups: dict[tuple[Path, str], list[Run]] = {}
    for run in runs:
        path = run.path.resolve()
        groups.setdefault((path.parent, _SEED.sub("", path.name)), []).append(run)
    out = []
    for (parent, name), members in groups.items():
        label = _label(parent, name, list(groups))
        differ = [(k, v) for k, v in config_differences(members) if k != SEED_FIELD]
        parts: dict[tuple[str, ...], list[Run]] = {}
        for i, run in enumerate(members):
            parts.setdefault(tuple(repr(values[i]) for _, values in differ), []).append(run)
        fields = [key for key, _ in differ]
        for part in parts.values():
            own = label
            if len(parts) > 1:
                own = f"{label} [{', '.join(run.path.resolve().name for run in part)}]"
            out.append((label, own, part, fields))
    return out


SEED_FIELD = "train.seed"
"""The one config field in which seeds of a configuration differ (``dapo ablate`` sets it)."""


def _label(parent: Path, name: str, groups: Sequence[tuple[Path, str]]) -> str:
    """``name``, after the fewest trailing components of ``parent`` that no other group of
    that name has."""
    others = [other for other, same in groups if same == name and other != parent]
    for depth in range(len(parent.parts) + 1):
        tail = parent.parts[len(parent.parts) - depth :]
        if all(other.parts[len(other.parts) - depth :] != tail for other in others):
            return str(Path(*tail, name))
    return str(parent / name)  # not reached: two groups of one name have two parents


def across_seeds(runs: Sequence[Run], key: str) -> tuple[list[float], ...]:
    """(steps, mean, low, high) of ``key`` over the runs, at the steps every run reached (the
    shortest run's last step and before), each run's last line of a step counting once: a
    resume at an unevaluated checkpoint logs that step twice, and one run is one seed. A step
    where some run lacks a figure (null: it trained no token) is NaN, a break in the line,
    not a mean over fewer seeds; a step no run logs ``key`` at is left out. One run: its own
    line."""
    values, present, common = _per_step(runs, key)
    steps = sorted(s for s in present if common is not None and s <= common)
    mean, low, high = [], [], []
    for step in steps:
        seen = [v[step] for v in values if step in v]
        full = len(seen) == len(runs)
        mean.append(sum(seen) / len(seen) if full else math.nan)
        low.append(min(seen) if full else math.nan)
        high.append(max(seen) if full else math.nan)
    return steps, mean, low, high


def past_common(runs: Sequence[Run], key: str) -> list[tuple[list[float], list[float]]]:
    """(steps, values) of ``key`` of each run that went on past the last step every run
    reached, from that step on (NaN where it logged null): what :func:`across_seeds` leaves
    out, drawn seed by seed."""
    values, present, common = _per_step(runs, key)
    tails = []
    for run, own in zip(runs, values, strict=True):
        rows = last_rows(run)
        steps = [
            s
            for s in sorted(present)
            if s in rows and key in rows[s] and (common is None or s >= common)
        ]
        if steps and (common is None or steps[-1] > common):
            tails.append((steps, [own.get(s, math.nan) for s in steps]))
    return tails


def common_step(runs: Sequence[Run]) -> float | None:
    """The last step every run reached (None when one logged no step)."""
    ends = [max(last_rows(run), default=None) for run in runs]
    return None if None in ends else min(ends)


def _per_step(
    runs: Sequence[Run], key: str
) -> tuple[list[dict[float, float]], set[float], float | None]:
    """Per run, its finite ``key`` per step (a step's last line); the steps where any run's
    line holds ``key`` (null included); :func:`common_step`."""
    values, present = [], set()
    for run in runs:
        own = {}
        for step, row in last_rows(run).items():
            if key in row:
                present.add(step)
                if is_number(row[key]):
                    own[step] = float(row[key])
        values.append(own)
    return values, present, common_step(runs)


def seeds_label(name: str, members: Sequence[Run]) -> str:
    """A configuration's legend entry: how many seeds, and, when they stopped at different
    steps, up to which step all of them count in the mean."""
    n = len(members)
    label = f"{legend_label(name)} ({n} seed{'s' * (n > 1)}"
    if _unequal(members):
        common = common_step(members)
        reach = "not all logged a step" if common is None else f"to step {common:.15g}"
        return f"{label} {reach}, then fewer)"
    return label + ")"


def _unequal(members: Sequence[Run]) -> bool:
    """Whether the seeds stopped at different steps (or one logged none)."""
    return len({max(last_rows(run), default=None) for run in members}) > 1


CAPTION = "mean over seeds; band: lowest to highest seed"
UNEQUAL_CAPTION = (
    "mean over seeds and band (lowest to highest seed) to the last step every seed of a "
    "configuration reached; thin lines: each seed that went on past it"
)


def mechanisms_figure(runs: Sequence[Run]) -> Figure:
    """The six panels, one colour (and past 20, line style) per configuration; the caller
    saves and closes it."""
    import matplotlib.pyplot as plt

    groups = configurations(runs)
    looks = run_styles(len(groups))
    fig, axes = plt.subplots(2, 3, figsize=(15.6, 7.6), squeeze=False)
    for ax, (title, ylabel, key) in zip((a for row in axes for a in row), PANELS, strict=True):
        drawn = False
        for (name, members), look in zip(groups.items(), looks, strict=True):
            drawn |= _draw_configuration(ax, members, key, seeds_label(name, members), look)
        if drawn:  # every panel is a count, share or entropy: from 0, so a flat line stays flat
            ax.set_ylim(bottom=0)
        finish_panel(ax, title, ylabel, drawn)
    handles, labels = next(
        (a.get_legend_handles_labels() for row in axes for a in row if a.get_lines()), ([], [])
    )
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 3), frameon=False)
    rows = -(-len(labels) // 3) if labels else 0
    unequal = any(_unequal(members) for members in groups.values())
    fig.suptitle(UNEQUAL_CAPTION if unequal else CAPTION, y=0.005, va="bottom", fontsize=9)
    # Two legend rows have room at the figure's size as made; more grow it, not the panels.
    top, bottom = 1 - 0.045 * rows, 0.02
    if rows > 2:
        height = fig.get_figheight()
        top = grow_for_legend(fig, 0.045 * height * 2, rows - 2, row_in=0.24)  # 10 pt: 0.225
        bottom = 0.02 * height / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, top))
    return fig


def _draw_configuration(
    ax: Axes, members: Sequence[Run], key: str, label: str, look: tuple[Any, Any]
) -> bool:
    """One configuration's mean, band and the seeds past the common step; whether drawn."""
    colour, style = look
    steps, mean, low, high = across_seeds(members, key)
    drawn = plot_line(ax, steps, mean, color=colour, linestyle=style, linewidth=1.6, label=label)
    if drawn and len(members) > 1:  # NaN (a seed's null) leaves a gap in the band too
        ax.fill_between(steps, low, high, color=colour, alpha=0.18, linewidth=0)
    for tail_steps, values in past_common(members, key):
        # Labelled when there is no mean (a seed stopped before this metric's first step),
        # so the legend still names the configuration.
        named = {} if drawn else {"label": label}
        drawn |= plot_line(
            ax, tail_steps, values, color=colour, linestyle=style, linewidth=0.7, alpha=0.8, **named
        )
    return drawn


def write_mechanisms(runs: Sequence[Run], path: Path) -> Path:
    """Draw the six panels (:func:`mechanisms_figure`) into ``path``."""
    import matplotlib.pyplot as plt

    fig = mechanisms_figure(runs)
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path
