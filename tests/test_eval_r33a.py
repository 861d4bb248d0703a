"""Review r33a (evaluation): a --compare of models stopped by Ctrl-C compares nothing; a
tool-call share gets the fractions' interval; a file with no usable problem is refused in
one line; a p-value under 0.0001 is not printed as 0; the exact sign-flip test is computed
a block of patterns at a time; sampling flags no engine draws with are refused before
anything is written."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from dapo.cli import main
from dapo.eval import intervals
from dapo.eval.metrics import interval_of, paired_interval_of, summarize

EVAL = ["--k", "2", "--max-new-tokens", "12", "--resamples", "200"]


def _records(path: Path, values: list[float]) -> Path:
    lines = [
        {"uid": f"p{i}", "ground_truth": "1", "metrics": {"avg@k": v}} for i, v in enumerate(values)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_compare_of_models_stopped_by_ctrl_c_compares_nothing(tmp_path, capsys, monkeypatch):
    """The stopped side's exit status (130) comes back; before, an old A in --out was
    compared, exit 0."""
    from dapo.api import evaluation

    out = tmp_path / "cmp"
    (out / "A").mkdir(parents=True)  # what an earlier comparison left: must not be read
    _records(out / "A" / "problems.jsonl", [1.0] * 4)
    b = _records(tmp_path / "b.jsonl", [0.0] * 4)
    runs = []

    def interrupted(request):
        runs.append(request.model)
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "run", interrupted)
    argv = ["eval", "--compare", "embedded", str(b), "--data", "arith", *EVAL, "--out", str(out)]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert runs == ["embedded"] and "problems in both" not in captured.out
    assert "dapo: evaluation stopped by SIGINT" in captured.err


def test_a_tool_call_share_gets_the_fractions_interval():
    assert interval_of("tool_call_frac") is intervals.fraction_ci
    assert paired_interval_of("tool_call_frac") is intervals.paired_fraction_ci
    every = summarize([{"tool_call_frac": 1.0}] * 64, resamples=200)["tool_call_frac"]
    assert every.mean == 1.0 and every.high == 1.0 and 0.94 < every.low < 0.95  # not [1, 1]


def test_a_file_with_no_usable_problem_is_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "What is 1+1?", "answer": ""}) + "\n")
    argv = ["eval", "embedded", "--data", str(bad), *EVAL, "--out", str(tmp_path / "o")]
    assert main([*argv, "--on-bad-row", "skip"]) == 2
    err = capsys.readouterr().err
    assert f"dapo: error: {bad}: none of its 1 rows is usable (1 bad; the first: row 0" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_a_p_value_under_a_ten_thousandth_is_not_printed_as_zero(tmp_path, capsys):
    a = _records(tmp_path / "a.jsonl", [0.0] * 200)
    b = _records(tmp_path / "b.jsonl", [1.0 if i % 4 else 0.0 for i in range(200)])
    assert main(["eval", "--compare", str(a), str(b), "--resamples", "100000"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("avg@k"))
    assert row.endswith(" 1.0e-05") and "0.0000" not in row


def test_the_exact_sign_flip_test_is_the_same_a_block_at_a_time(monkeypatch):
    d_a, d_b = np.zeros(16), np.random.default_rng(0).normal(size=16)
    whole = intervals.paired_permutation_pvalue(d_a, d_b, resamples=2**16)
    monkeypatch.setattr(intervals, "RESAMPLE_CHUNK_ELEMENTS", 16 * 1000)  # 66 blocks of patterns
    tracemalloc.start()
    blocks = intervals.paired_permutation_pvalue(d_a, d_b, resamples=2**16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert blocks == whole and 0 < whole < 1
    assert peak < 2**16 * 16 * 8  # under one whole float64 matrix of the patterns (8 MiB)


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--temperature", "0", "--temperature must be a finite number >= 1e-05, got 0.0"),
        ("--temperature", "nan", "--temperature must be a finite number >= 1e-05, got nan"),
        ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
        ("--top-p", "2", "--top-p must be in (0, 1], got 2.0"),
        ("--max-new-tokens", "0", "--max-new-tokens must be >= 1, got 0"),
    ],
)
def test_sampling_flags_no_engine_draws_with_are_refused_first(tmp_path, capsys, flag, value, said):
    out = tmp_path / "o"
    argv = ["eval", "embedded", "--data", "arith", *EVAL, "--out", str(out), flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and not out.exists()
