"""The metrics catalogue (dapo/run/metric_docs.py) and the code agree, both ways.

The reference page of metrics is generated from the catalogue; a metric the code writes but
the catalogue lacks would be undocumented, and an entry the code no longer writes would
document nothing. The code's names are read from its string literals (every metric is written
under a literal name; val/pass@k's number comes from eval.num_samples). A short training run
in test_end_to_end.py checks the names it actually logs against the catalogue too.
"""

import ast
import re
from pathlib import Path

from dapo.run.metric_docs import AREAS, METRICS, SUMMARY, metric_pattern

PACKAGE = Path(__file__).resolve().parents[1] / "dapo"
NAME = re.compile(r"^([a-z]+)/[a-z_@{}0-9]+$")


def _literals() -> dict[str, str]:
    """The package's string literals (f-strings with their fields in braces) -> a place."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "metric_docs.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if id(node) in parts:
                continue
            if isinstance(node, ast.JoinedStr):  # f"val/pass@{k}" -> "val/pass@{k}"
                text = "".join(
                    v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                    for v in node.values
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            found.setdefault(text, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def _metric_literals() -> dict[str, str]:
    return {k: v for k, v in _literals().items() if (m := NAME.match(k)) and m[1] in AREAS}


def test_every_metric_the_code_writes_is_documented():
    # perf/{p}_s is dapo bench reading the per-phase names back, not a metric of its own.
    written = {k: v for k, v in _metric_literals().items() if k != "perf/{p}_s"}
    missing = {k: v for k, v in written.items() if metric_pattern(k) is None and k not in SUMMARY}
    assert not missing, f"metrics missing from dapo/run/metric_docs.py: {missing}"


def test_every_documented_metric_is_written_by_the_code():
    written = _literals()
    stale = [name for name in [*METRICS, *SUMMARY] if name not in written]
    assert not stale, f"documented but never written: {stale}"


def test_each_metric_has_an_area_and_a_meaning():
    for name, meaning in METRICS.items():
        area = name.split("/")[0]
        assert area in AREAS, name
        assert meaning.endswith(".") and len(meaning) > 20, name
    assert metric_pattern("val/pass@32") == "val/pass@{k}"
    assert metric_pattern("val/pass@x") is None and metric_pattern("train/nothing") is None
