"""The report's HTML page: runs, figures (embedded, so the page opens offline and can be
mailed as one file), config differences and sample responses."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo.report.mechanisms import MECHANISMS_FIGURE, mixed_seeds
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
        if path.name == MECHANISMS_FIGURE:
            parts += [f'<p class="warn">{esc(w)}</p>' for w in mixed_seeds(runs)]
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
        steps, marked = _steps_text(run)
        parts.append(
            f"<tr><td>{_swatch(*look)}{esc(run.name)}"
            f"</td><td><code>{esc(str(run.path))}</code></td>"
            f'<td class="num">{_warn(esc(steps)) if marked else esc(steps)}</td>'
            f"<td>{len(run.rows)} read, {skipped}</td>"
            + _start_end(run, "val/accuracy")
            + (_start_end(run, "val/tool_call_frac") if tools else "")
            + "</tr>"
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


def _warn(text: str) -> str:
    return f'<span class="warn">{text}</span>'


def _start_end(run: Run, key: str) -> str:
    """Cells of ``key``'s first and last evaluation, as its figure draws them: metrics.jsonl's,
    a step's last line counting (summary.json is the last finished run's; a resume may have
    gone on). A run whose metrics.jsonl ends before its summary.json's last step
    (:func:`_cut_short`) has its end from summary.json (``<key>_end``, so marked), or else
    marked with the step it comes from: it is not the final step's."""
    evaluated = [(s, row[key]) for s, row in last_rows(run).items() if is_number(row.get(key))]
    start = _fmt_acc(evaluated[0][1]) if evaluated else "—"
    end = _fmt_acc(evaluated[-1][1]) if evaluated else "—"
    if _cut_short(run):
        if not evaluated and is_number(run.summary.get(f"{key}_start")):
            start = _warn(f"{_fmt_acc(run.summary[f'{key}_start'])} (summary.json)")
        if is_number(run.summary.get(f"{key}_end")):
            end = _warn(f"{_fmt_acc(run.summary[f'{key}_end'])} (summary.json)")
        elif evaluated:
            end = _warn(f"{end} (step {evaluated[-1][0]:g})")
    else:  # the last evaluation logged null (no problem graded): say whose value this is
        last = max((s for s, row in last_rows(run).items() if key in row), default=None)
        if evaluated and last is not None and last != evaluated[-1][0]:
            end = _warn(f"{end} (step {evaluated[-1][0]:g}; step {last:g}'s is null)")
    return f'<td class="num">{start}</td><td class="num">{end}</td>'


def _cut_short(run: Run) -> bool:
    """Whether metrics.jsonl ends before the step summary.json says the run finished at (cut,
    or emptied, since: its last figures are not the final step's)."""
    finished, logged = run.summary.get("steps"), run.last_step
    return is_number(finished) and (logged is None or logged < finished)


def _steps_text(run: Run) -> tuple[str, bool]:
    """The steps the run made: summary.json's, or how far metrics.jsonl went when it went
    further (a resume that stopped before finishing) or there is no summary.json; and whether
    the text marks files that disagree (metrics.jsonl empty, or ending before summary.json's
    last step), drawn in the warning colour."""
    finished, logged = run.summary.get("steps"), run.last_step
    if "steps" not in run.summary:
        if logged is None:
            return (
                "nothing logged (metrics.jsonl holds no step), not finished (no summary.json)",
                True,
            )
        return f"logged to step {logged}, not finished (no summary.json)", False
    if _cut_short(run):
        ends = "holds no step" if logged is None else f"ends at step {logged}"
        return f"{_fmt(finished)} (summary.json), but metrics.jsonl {ends}", True
    if is_number(finished) and logged is not None and logged > finished:
        return f"logged to step {logged}, last finished at {_fmt(finished)}", False
    return _fmt(finished), False


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
