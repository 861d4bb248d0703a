"""The report's HTML page: runs, figures (embedded, so the page opens offline and can be
mailed as one file), config differences and sample responses."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo.report.runs import Run, config_differences, is_number, last_rows, series
from dapo.report.style import dash_pattern, run_styles


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fmt_acc(value: Any) -> str:
    return f"{value:.3f}" if is_number(value) else "—"


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


def render_html(runs: Sequence[Run], figures: list[Path]) -> str:
    """The whole page: runs, figures, config differences, sample responses."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>DAPO report: {esc(', '.join(r.name for r in runs))}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>DAPO run report</h1>",
        *_runs_table(runs),
        *_gaps_table(runs),
        "<h2>Figures</h2>",
    ]
    for path in figures:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(
            f'<figure><img alt="{esc(path.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{esc(path.name)}</figcaption></figure>"
        )
    parts += _differences(runs) + _samples(runs)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _runs_table(runs: Sequence[Run]) -> list[str]:
    esc = html.escape
    looks = run_styles(len(runs))
    tools = any(series(run, "val/tool_call_frac")[0] for run in runs)  # env.class runs
    parts = [
        "<h2>Runs</h2>",
        "<table><tr><th>run</th><th>directory</th><th>steps</th><th>metrics lines</th>"
        "<th>val accuracy start</th><th>val accuracy end</th>"
        + ("<th>tool-call rate start</th><th>tool-call rate end</th>" if tools else "")
        + "</tr>",
    ]
    for run, look in zip(runs, looks, strict=True):
        skipped = _skipped_text(run.skipped)
        if run.skipped:
            skipped = f'<span class="warn">{skipped}</span>'
        # Start and end as the accuracy figure draws them: metrics.jsonl's first and last
        # evaluation (summary.json is the last finished run's; a resume may have gone on).
        start, end = _first_last(run, "val/accuracy")
        parts.append(
            f"<tr><td>{_swatch(*look)}{esc(run.name)}"
            f"</td><td><code>{esc(str(run.path))}</code></td>"
            f'<td class="num">{esc(_steps_text(run))}</td>'
            f"<td>{len(run.rows)} read, {skipped}</td>"
            f'<td class="num">{_fmt_acc(start)}</td>'
            f'<td class="num">{_fmt_acc(end)}</td>' + (_tool_rates(run) if tools else "") + "</tr>"
        )
    parts.append("</table>")
    return parts


def _gaps_table(runs: Sequence[Run]) -> list[str]:
    """Per run, what the figures' lines skip: updates skipped, steps with null metrics."""
    parts = [
        "<h2>Skipped updates and null metrics</h2>",
        "<p>A line in the figures breaks at a step that logged null.</p>",
        "<table><tr><th>run</th><th>skipped updates (train/skipped_updates)</th>"
        "<th>steps with null train/* metrics</th></tr>",
    ]
    for run in runs:
        parts.append(f"<tr><td>{html.escape(run.name)}</td>{_training_gaps(run)}</tr>")
    parts.append("</table>")
    return parts


def _swatch(colour: Any, style: Any) -> str:
    """A run's colour, and past the colour map's colours its line style, as in the figures."""
    from matplotlib.colors import to_hex

    if style == "-":
        return f'<span class="swatch" style="background:{to_hex(colour)}"></span>'
    dashes = ",".join(f"{2 * d:g}" for d in dash_pattern(style))  # at the stroke's width, 2
    return (
        '<svg width="28" height="10" style="vertical-align:middle;margin-right:0.4em">'
        f'<line x1="0" y1="5" x2="28" y2="5" stroke="{to_hex(colour)}" stroke-width="2" '
        f'stroke-dasharray="{dashes}"/></svg>'
    )


def _first_last(run: Run, key: str) -> tuple[Any, Any]:
    """``key``'s first and last finite value in metrics.jsonl, a step's last line counting."""
    values = [row[key] for row in last_rows(run).values() if is_number(row.get(key))]
    return (values[0], values[-1]) if values else (None, None)


def _steps_text(run: Run) -> str:
    """The steps the run made: summary.json's, or how far metrics.jsonl went when it went
    further (a resume that stopped before finishing) or there is no summary.json."""
    finished, logged = run.summary.get("steps"), run.last_step
    if logged is None:
        return _fmt(finished)
    if "steps" not in run.summary:
        return f"logged to step {logged}, not finished (no summary.json)"
    if is_number(finished) and logged > finished:
        return f"logged to step {logged}, last finished at {_fmt(finished)}"
    return _fmt(finished)


def _training_gaps(run: Run) -> str:
    """Cells of the updates skipped (train/skipped_updates over the steps) and the steps whose
    train/* metrics are null (no token trained, every update skipped): the breaks in the
    figures' lines."""
    rows = last_rows(run)
    key = "train/skipped_updates"
    counts = [row[key] for row in rows.values() if is_number(row.get(key))]
    total = _fmt(sum(counts)) if counts else "—"
    if counts and sum(counts):
        total = f'<span class="warn">{total}</span>'
    gaps, names = [], set()
    for step, row in rows.items():
        nulls = [k for k, v in row.items() if k.startswith("train/") and not is_number(v)]
        if nulls:
            gaps.append(step)
            names.update(nulls)
    text = "none"
    if gaps:
        listed = f"{_ranges(gaps)} ({', '.join(sorted(names))})"
        text = f'<span class="warn">{html.escape(listed)}</span>'
    return f'<td class="num">{total}</td><td>{text}</td>'


def _ranges(steps: list[float]) -> str:
    """Steps (in order) as runs of consecutive ones: ``1-3, 7``."""
    spans: list[list[float]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a:.15g}" if a == b else f"{a:.15g}-{b:.15g}" for a, b in spans)


def _tool_rates(run: Run) -> str:
    """Cells of the share of held-out episodes that called a tool, first and last evaluation."""
    _, values = series(run, "val/tool_call_frac")
    first, last = (values[0], values[-1]) if values else (None, None)
    return f'<td class="num">{_fmt_acc(first)}</td><td class="num">{_fmt_acc(last)}</td>'


def _differences(runs: Sequence[Run]) -> list[str]:
    esc = html.escape
    parts = ["<h2>Config differences</h2>"]
    if len(runs) < 2:
        return parts + ["<p>single run</p>"]
    diffs = config_differences(runs)
    if not diffs:
        return parts + ["<p>none: the runs have the same config</p>"]
    header = "".join(f"<th>{esc(r.name)}</th>" for r in runs)
    parts.append(f"<table><tr><th>field</th>{header}</tr>")
    for key, values in diffs:
        cells = "".join(f"<td>{esc(_fmt(v))}</td>" for v in values)
        parts.append(f"<tr><td><code>{esc(key)}</code></td>{cells}</tr>")
    parts.append("</table>")
    return parts


def _samples(runs: Sequence[Run]) -> list[str]:
    esc = html.escape
    parts = ["<h2>Sample responses</h2>"]
    for run in runs:
        if not run.samples:
            continue
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
    if len(parts) == 1:
        parts.append("<p>none: the runs have no samples.jsonl (written at the end of a run)</p>")
    return parts
