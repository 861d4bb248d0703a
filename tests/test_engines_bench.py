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
from types import SimpleNamespace

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


def _calls(monkeypatch, device: str) -> tuple[list, list]:
    """(each engine's compute dtype, every generate call's (new tokens, seed)) of a run of
    the script with ``--device device``, the engines stubbed (no CUDA needed)."""
    import torch
    from helpers import load_script

    script = load_script("benchmarks/engines.py")
    dtypes, calls = [], []

    class Stub:
        device = torch.device("cpu")

        def generate(self, prompts, *, group_size, max_new_tokens, seed=None, ignore_eos):
            calls.append((max_new_tokens, seed))
            rows = len(prompts) * group_size
            return SimpleNamespace(lengths_B=torch.full((rows,), max_new_tokens))

    def make_engine(name, model, tokenizer, stop, dtype=None, *, device):
        dtypes.append(dtype)
        return Stub()

    model, tokenizer = script.load("")
    monkeypatch.setattr(
        script, "prepare", lambda args: (SimpleNamespace(type=device), model, tokenizer)
    )
    monkeypatch.setattr(script, "make_engine", make_engine)
    args = ["--rows", "8", "--group", "4", "--new-tokens", "3", "5", "--reps", "2"]
    script.main([*args, "--engines", "dapo", "hf", "--device", device])
    return dtypes, calls


def test_on_cuda_engines_run_bf16_each_length_after_an_identical_untimed_call(monkeypatch):
    import torch

    dtypes, calls = _calls(monkeypatch, "cuda")
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    # Per engine: the 4-token warm-up, then per length one untimed call and the 2 timed ones.
    assert calls.count((4, None)) == 2
    for t in (3, 5):
        assert calls.count((t, 0)) == 2 * 2 and calls.count((t, 1)) == 2
    # On a CPU the published figures' setup: the float32 model's own dtype, no extra calls.
    dtypes, calls = _calls(monkeypatch, "cpu")
    assert dtypes == [None, None]
    assert [c for c in calls if c[0] == 3] == [(3, 0), (3, 0), (3, 1), (3, 1)]
