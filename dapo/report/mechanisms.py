"""The mechanisms figure: what the paper's techniques act on, per configuration over its seeds.

Runs named ``<configuration>-seed<N>`` in one directory (as ``dapo ablate`` lays them out) are
one configuration; each panel draws, per configuration, the mean over its seeds at every step
that two or more seeds logged (one seed: its own line) and a band from the lowest to the
highest seed:

- entropy: the paper finds it collapses under a symmetric clip, not under Clip-Higher
  (DAPO §3.1);
- all-correct groups and the groups that carry a gradient: without dynamic sampling the
  effective batch shrinks as groups become all right (§3.2);
- response length and the truncated share: responses that reach L_max, what overlong
  filtering, soft punishment and token-level weighting act on (§3.3, §3.4);
- the upper clip's share of tokens: how often the upper bound binds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from dapo.report.runs import Run, series
from dapo.report.style import finish_panel, legend_label, run_colours, save_figure

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
    directories' trailing components as tell them apart (``A/x``, ``B/x``)."""
    groups: dict[tuple[Path, str], list[Run]] = {}
    for run in runs:
        path = run.path.resolve()
        groups.setdefault((path.parent, _SEED.sub("", path.name)), []).append(run)
    return {
        _label(parent, name, list(groups)): members for (parent, name), members in groups.items()
    }


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
    """(steps, mean, low, high) of ``key`` over the runs, at every step logged by two or more
    of them (by the one run when there is one)."""
    per_step: dict[float, list[float]] = {}
    for run in runs:
        for step, value in zip(*series(run, key), strict=True):
            per_step.setdefault(step, []).append(value)
    need = min(2, len(runs))
    steps = sorted(s for s, v in per_step.items() if len(v) >= need)
    mean = [sum(per_step[s]) / len(per_step[s]) for s in steps]
    return steps, mean, [min(per_step[s]) for s in steps], [max(per_step[s]) for s in steps]


def write_mechanisms(runs: Sequence[Run], path: Path) -> Path:
    """Draw the six panels into ``path``, one colour per configuration."""
    import matplotlib.pyplot as plt

    groups = configurations(runs)
    colours = run_colours(len(groups))
    fig, axes = plt.subplots(2, 3, figsize=(15.6, 7.6), squeeze=False)
    for ax, (title, ylabel, key) in zip((a for row in axes for a in row), PANELS, strict=True):
        drawn = False
        for (name, members), colour in zip(groups.items(), colours, strict=True):
            steps, mean, low, high = across_seeds(members, key)
            if not steps:
                continue
            label = f"{legend_label(name)} ({len(members)} seed{'s' * (len(members) > 1)})"
            ax.plot(steps, mean, color=colour, linewidth=1.6, label=label)
            if len(members) > 1:
                ax.fill_between(steps, low, high, color=colour, alpha=0.18, linewidth=0)
            drawn = True
        if drawn:  # every panel is a count, share or entropy: from 0, so a flat line stays flat
            ax.set_ylim(bottom=0)
        finish_panel(ax, title, ylabel, drawn)
    handles, labels = next(
        (a.get_legend_handles_labels() for row in axes for a in row if a.get_lines()), ([], [])
    )
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 3), frameon=False)
    rows = -(-len(labels) // 3) if labels else 0
    fig.suptitle("mean over seeds; band: lowest to highest seed", y=0.005, va="bottom", fontsize=9)
    fig.tight_layout(rect=(0, 0.02, 1, 1 - 0.045 * rows))
    save_figure(fig, path)
    plt.close(fig)
    return path
