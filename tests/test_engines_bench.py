"""`benchmarks/engines.py` on the embedded demo model, so that the benchmark keeps working: its
JSON line has one object per engine and length, each engine produced exactly rows x T tokens
(the script checks the count and stops otherwise), and an engine that is not installed is
skipped with a note rather than failing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_json_line_has_each_engine_and_length():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--rows", "8", "--group", "4", "--new-tokens", "3", "5", "--reps", "2"]
    done = subprocess.run(
        [sys.executable, "benchmarks/engines.py", *args, "--engines", "dapo", "hf", "vllm"]
        + ["--threads", "1", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    engines = ["dapo", "hf"]
    if importlib.util.find_spec("vllm") is None:
        assert "vllm is not installed here: skipped" in done.stderr
    else:
        engines.append("vllm")
    assert [(r["engine"], r["new_tokens"]) for r in rows] == [
        (e, t) for t in (3, 5) for e in engines
    ]
    for r in rows:
        assert r["rows"] == 8 and len(r["reps"]) == 2 and r["tokens_per_s"] > 0
        assert sorted(r["reps"])[0] <= r["tokens_per_s"] <= sorted(r["reps"])[1]
    assert "dapo      3" in done.stdout and "1.00x" in done.stdout  # the table, hf as the unit
