"""Progress on the console: a live ``rich`` display on a terminal, plain lines elsewhere.

The live display shows step / total, the phase the step is in (generate, reward, train, eval,
save), the ETA, and the latest reward, accuracy, length, dynamic-sampling kept fraction and
tokens/s. In a log file or CI (not a terminal) or with ``--quiet``, each step is one plain line
(:class:`dapo.run.metrics.MetricsLogger` prints it), which greps and diffs well.
"""

from __future__ import annotations

from typing import TextIO

# (metric, label, format) shown beside the bar.
LIVE_KEYS = (
    ("rollout/reward_mean", "reward", "+.3f"),
    ("rollout/accuracy", "acc", ".3f"),
    ("rollout/response_len_mean", "len", ".1f"),
    ("sampling/kept_frac", "kept", ".2f"),
    ("perf/gen_tokens_per_s", "gen tok/s", ".0f"),
    ("val/accuracy", "VAL", ".3f"),
)


def summary_line(metrics: dict[str, float]) -> str:
    parts = []
    for key, label, fmt in LIVE_KEYS:
        if metrics.get(key) is not None:
            parts.append(f"{label} {format(metrics[key], fmt)}")
    return "  ".join(parts)


class LiveProgress:
    """A rich progress bar over training steps, the current phase, and below it the latest
    figures (on their own line, so a narrow terminal never squeezes the bar away)."""

    def __init__(self, *, total: int, done: int, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        figures = {"line": ""}

        class _Progress(Progress):
            def get_renderables(self):
                yield self.make_tasks_table(self.tasks)
                yield Text(figures["line"])

        self._figures_line = figures
        self._progress = _Progress(
            TextColumn("[bold]{task.fields[phase]:<8}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=stream),
        )
        self._task = self._progress.add_task("train", total=total, completed=done, phase="")
        self._figures: dict[str, float] = {}
        self._progress.start()

    def phase(self, name: str) -> None:
        self._progress.update(self._task, phase=name)

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        self._figures.update({k: v for k, v in metrics.items() if v is not None})
        self._figures_line["line"] = summary_line(self._figures)
        self._progress.update(self._task, completed=step, phase="")

    def print(self, text: str) -> None:
        self._progress.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self._progress.stop()
