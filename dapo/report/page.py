"""The report's HTML page: runs, figures (embedded, so the page opens offline and can be
mailed as one file), config differences and sample responses."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo.report.runs import Run, config_differences, is_number, series
from dapo.report.style import run_colours


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
    from matplotlib.colors import to_hex

    esc = html.escape
    colours = [to_hex(c) for c in run_colours(len(runs))]
    tools = any(series(run, "val/tool_call_frac")[0] for run in runs)  # env.class runs
    parts = [
        "<h2>Runs</h2>",
        "<table><tr><th>run</th><th>directory</th><th>steps</th><th>metrics lines</th>"
        "<th>val accuracy start</th><th>val accuracy end</th>"
        + ("<th>tool-call rate start</th><th>tool-call rate end</th>" if tools else "")
        + "</tr>",
    ]
    for run, colour in zip(runs, colours, strict=True):
        steps = run.summary.get("steps", run.last_step)
        skipped = _skipped_text(run.skipped)
        if run.skipped:
            skipped = f'<span class="warn">{skipped}</span>'
        parts.append(
            f'<tr><td><span class="swatch" style="background:{colour}"></span>{esc(run.name)}'
            f"</td><td><code>{esc(str(run.path))}</code></td>"
            f'<td class="num">{esc(_fmt(steps))}</td>'
            f"<td>{len(run.rows)} read, {skipped}</td>"
            f'<td class="num">{_fmt_acc(run.summary.get("val/accuracy_start"))}</td>'
            f'<td class="num">{_fmt_acc(run.summary.get("val/accuracy_end"))}</td>'
            + (_tool_rates(run) if tools else "")
            + "</tr>"
        )
    parts.append("</table>")
    return parts


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
