"""Run directories as ``dapo report`` reads them: config, metrics lines, summary, samples;
and what differs between the configs of several runs."""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo.config import MOVED_KEYS
from dapo.config.yaml_files import YamlFileError, read_yaml_file

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
    _by_step: tuple[list, int, dict] | None = field(
        default=None, init=False, repr=False, compare=False
    )  # the rows last_rows read (the list itself, and its length then) and its answer

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.rows if is_number(r.get("step"))]
        return int(max(steps)) if steps else None


def read_runs(run_dirs: Sequence[Path | str]) -> list[Run]:
    """Read run directories, each once (a directory given twice is not two seeds), and name
    them apart: runs whose directories share a name (``A/dapo``, ``B/dapo``) are called by as
    many trailing path components as tell them apart, so no two are grouped as one."""
    runs: dict[Path, Run] = {}
    for run_dir in run_dirs:
        run = read_run(run_dir)
        runs.setdefault(run.path.resolve(), run)
    for path, run in runs.items():
        run.name = _distinct_name(path, [other for other in runs if other != path])
    return list(runs.values())


def _distinct_name(path: Path, others: Sequence[Path]) -> str:
    """The fewest trailing components of ``path`` that none of ``others`` ends with."""
    for depth in range(1, len(path.parts) + 1):
        name = Path(*path.parts[-depth:])
        if not any(Path(*other.parts[-depth:]) == name for other in others):
            break
    return str(name)


def read_run(run_dir: Path | str) -> Run:
    """Read a run directory; unreadable metrics lines are counted in ``skipped``, not raised."""
    path = Path(run_dir)
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(not_a_run(path))
    rows, skipped = _read_rows(metrics_path)
    return Run(
        name=path.resolve().name,
        path=path,
        config=_read_config(path / "config.yaml"),
        rows=rows,
        skipped=skipped,
        summary=_read_summary(path / "summary.json"),
        samples=_read_samples(path / "samples.jsonl"),
    )


WANTED = "give run directories (each holding metrics.jsonl)"
SEED_RUN = re.compile(r"-seed\d+$")
"""A run directory's name as ``dapo ablate`` writes it: ``<configuration>-seed<N>``."""


def not_a_run(path: Path) -> str:
    """Why ``path``, which has no metrics.jsonl, is no run directory, and what to give: a path
    not there, a file, an ablation's directory or one holding runs (their directories)."""
    if not path.exists():
        return f"{path}: does not exist; {WANTED}"
    if not path.is_dir():
        return f"{path}: not a directory; {WANTED}"
    inside = _runs_inside(path)
    if (path / "table.md").is_file() or any(SEED_RUN.search(p.name) for p in inside):
        where = shlex.quote(str(path))
        report = path / "report" / "report.html"
        written = f"; the report of all its runs is {report}" if report.is_file() else ""
        return (
            f"{path}: an ablation's directory (dapo ablate), not a run directory: give the run "
            f"directories inside it, as in dapo report {where}/*-seed*/{written}"
        )
    if inside:
        listed = " ".join(shlex.quote(str(p)) for p in inside[:3])
        more = " ..." if len(inside) > 3 else ""
        return (
            f"{path}: a directory of {len(inside)} run(s), not a run directory: give the run "
            f"directories inside it, as in dapo report {listed}{more}"
        )
    return f"{path}: not a run directory (no metrics.jsonl); {WANTED}"


def _runs_inside(path: Path) -> list[Path]:
    """The run directories (holding metrics.jsonl) directly inside ``path``, by name."""
    try:
        return sorted(p for p in path.iterdir() if (p / "metrics.jsonl").is_file())
    except OSError:  # not readable: nothing to name
        return []


def nothing_logged(runs: Sequence[Run]) -> str:
    """Why ``runs`` give nothing to plot ("" when one logged a step): every metrics.jsonl
    holds no step (a run before its first step ended, or a file emptied)."""
    if any(run.last_step is not None for run in runs):
        return ""
    names = ", ".join(str(run.path / "metrics.jsonl") for run in runs)
    verb = "holds" if len(runs) == 1 else "hold"
    return (
        f"nothing to plot: {names} {verb} no step (a run that has not logged its first step "
        "yet, or whose metrics.jsonl was emptied); give a run that logged a step"
    )


def _read_config(config_path: Path) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:  # aliases refused: a few hundred bytes of nested ones expand to billions of keys
            loaded = read_yaml_file(config_path)
        except YamlFileError as exc:
            raise ValueError(f"{config_path}: not a readable config: {exc.reason}") from None
        if isinstance(loaded, dict):
            config = loaded
    return config


_BAD = object()
"""What :func:`_json` gives for text that is not JSON it can read."""


def _json(text: str) -> Any:
    """``text`` parsed, else ``_BAD``: run directories come from elsewhere, and besides broken
    JSON a line may hold a 5000-digit int (ValueError) or nesting deeper than the parser
    recurses (RecursionError); such a line is skipped like any other garbage."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _BAD


def _read_rows(metrics_path: Path) -> tuple[list[dict[str, Any]], int]:
    rows: list[dict[str, Any]] = []
    skipped = 0
    # errors="replace": a crash mid-write can leave bytes that are not UTF-8; that line is then
    # skipped like any other garbage instead of failing the whole report.
    with metrics_path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = _json(line)
            if not isinstance(row, dict):  # _BAD included
                skipped += 1
                continue
            rows.append(row)
    return rows, skipped


def _read_summary(summary_path: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    if summary_path.is_file():
        # A run that crashed before finishing has no usable summary; the curves still count.
        loaded_summary = _json(summary_path.read_text(encoding="utf-8", errors="replace"))
        if isinstance(loaded_summary, dict):
            summary = loaded_summary
    return summary


def _read_samples(samples_path: Path) -> list[Any]:
    samples = []
    if samples_path.is_file():
        for line in samples_path.read_text(encoding="utf-8", errors="replace").splitlines():
            sample = _json(line)
            if isinstance(sample, dict) and "response" in sample:
                samples.append(sample)
    return samples


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _flatten(sub, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def config_differences(runs: Sequence[Run]) -> list[tuple[str, list[Any]]]:
    """Dotted config fields whose values differ across ``runs``, with each run's value.

    A field missing from some run's config counts as ``None`` there (older runs lack newer
    fields); a field that moved since a run was saved is compared at its new place. Fields
    come in config order, grouped by section.
    """
    flat: list[dict[str, Any]] = []
    for run in runs:
        out: dict[str, Any] = {}
        _flatten(run.config, "", out)
        flat.append({MOVED_KEYS.get(key, key): value for key, value in out.items()})
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


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool) that converts to a float: a 400-digit int does not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


def series(run: Run, key: str | Callable[[dict[str, Any]], Any]) -> Series:
    """(steps, values) of one metric, leaving out rows where it is absent, null or not finite."""
    steps: list[float] = []
    values: list[float] = []
    for row in run.rows:
        step = row.get("step")
        value = key(row) if callable(key) else row.get(key)
        if is_number(step) and is_number(value):
            steps.append(float(step))
            values.append(float(value))
    return steps, values


def line_series(run: Run, key: str | Callable[[dict[str, Any]], Any]) -> Series:
    """:func:`series` for a line: a step whose line holds ``key`` with null (or any value not a
    finite number) keeps its place with NaN, so the line breaks there instead of running
    straight across a step that logged no figure (``update`` logs null for a step that
    trained no token). A step whose line lacks ``key`` is left out as before: not every metric
    is logged every step (``val/*`` every ``eval.every``)."""
    if callable(key):
        return series(run, key)
    steps: list[float] = []
    values: list[float] = []
    for row in run.rows:
        step = row.get("step")
        if is_number(step) and key in row:
            value = row[key]
            steps.append(float(step))
            values.append(float(value) if is_number(value) else math.nan)
    return steps, values


def last_rows(run: Run) -> dict[float, dict[str, Any]]:
    """Each step's last line, by step: a run resumed at a checkpoint its evaluation had not
    reached logs that step twice (docs/guides/resume-and-failures.md), and the later line is
    the one that stands. Computed once per run and shared (read it, do not change it): a
    report asks for it some 40 times, 12 of the 20 s a log of 200 MB took."""
    cached = run._by_step
    if cached is None or cached[0] is not run.rows or cached[1] != len(run.rows):
        rows: dict[float, dict[str, Any]] = {}
        for row in run.rows:
            if is_number(row.get("step")):
                rows[float(row["step"])] = row
        cached = run._by_step = run.rows, len(run.rows), dict(sorted(rows.items()))
    return cached[2]


def kept_frac(row: dict[str, Any]) -> float | None:
    # Older runs may log only the counts; the ratio is the same quantity.
    if is_number(row.get("sampling/kept_frac")):
        return row["sampling/kept_frac"]
    kept, drawn = row.get("sampling/groups_kept"), row.get("sampling/prompts_drawn")
    if is_number(kept) and is_number(drawn) and drawn > 0:
        return kept / drawn
    return None
