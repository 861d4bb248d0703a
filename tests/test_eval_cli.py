"""`dapo eval` end to end on a tiny saved model, and `--compare` on hand-made result files."""

import importlib.util
import json

import pytest

from dapo.cli import main
from dapo.data.prompts import PROMPT_PREFIX
from dapo.reward.tasks import arith
from dapo.reward.tasks.base import gave_answer

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    from helpers import save_model  # the same tiny saved Qwen2 as the training tests

    root = tmp_path_factory.mktemp("eval")
    model_dir = save_model(root / "m", "qwen2")
    _, val, _ = arith.make_splits(0, 6, seed=0)
    with (root / "val.jsonl").open("w") as f:
        for p, _ in val:
            raw = p.messages[0]["content"][len(PROMPT_PREFIX) :].split("\n\n")[0]
            f.write(json.dumps({"question": raw, "answer": p.answer}) + "\n")
    return model_dir, root / "val.jsonl"


def test_a_row_without_a_verifier_is_refused_before_the_model_loads(
    tmp_path, model_and_data, capsys, monkeypatch
):
    """A data_source no task grades (AIME's copies say aime24), or a misspelt --reward-mode:
    refused, naming the fix; every response was graded wrong as a fault, and the table said
    avg@k 0.000."""
    from dapo.models import policy

    model_dir, data = model_and_data
    row = {
        "data_source": "aime24", "prompt": [{"role": "user", "content": "1 + 1?"}],
        "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0},
    }  # fmt: skip
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps(row) + "\n")
    loads: list = []
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: loads.append(a))
    assert _eval(model_dir, aime, tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "no reward function for data_source 'aime24'" in err and "--reward-mode dapo" in err
    assert _eval(model_dir, data, tmp_path / "b", "--reward-mode", "bogus") == 2
    assert "no reward function for data_source 'bogus'" in capsys.readouterr().err
    assert loads == [] and not (tmp_path / "a").exists()


def test_eval_reads_a_file_as_dapo_data_does(tmp_path, model_and_data, capsys):
    """Its own column names, a bad row skipped, the template added: the flags of `dapo data`,
    where the errors pointed to data.* settings dapo eval had no way to take."""
    model_dir, data = model_and_data
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    renamed = tmp_path / "renamed.jsonl"
    lines = [{"problem": r["question"], "solution": r["answer"]} for r in rows]
    lines.insert(1, {"problem": "no answer here"})  # row 1: unusable
    renamed.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _eval(model_dir, renamed, tmp_path / "a") == 2
    assert "--question-key/--answer-key" in capsys.readouterr().err
    keys = ["--question-key", "problem", "--answer-key", "solution"]
    assert _eval(model_dir, renamed, tmp_path / "b", *keys) == 2
    assert "(--on-bad-row skip)" in capsys.readouterr().err
    flags = [*keys, "--on-bad-row", "skip", "--wrap-template"]
    assert _eval(model_dir, renamed, tmp_path / "c", *flags, "--num-problems", "2") == 0
    assert "1 bad rows skipped (--on-bad-row skip); the first: row 1" in capsys.readouterr().err
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["protocol"]["problems"] == 2
    assert summary["protocol"]["data_options"] == {
        "question_key": "problem", "answer_key": "solution", "wrap_template": True,
        "on_bad_row": "skip",
    }  # fmt: skip
    records = [
        json.loads(x) for x in (tmp_path / "c" / "problems.jsonl").read_text().split("\n") if x
    ]
    assert [r["ground_truth"] for r in records] == [rows[0]["answer"], rows[1]["answer"]]
    assert main(["eval", "embedded", "--data", "arith", "--wrap-template"]) == 2
    assert "--data arith is generated, not read: --wrap-template" in capsys.readouterr().err


def _eval(model_dir, data, out, *extra):
    args = ["eval", str(model_dir), "--data", str(data), "--k", "4", "--max-new-tokens", "12"]
    return main([*args, "--resamples", "200", "--out", str(out), *extra])


def test_eval_writes_summary_and_records_and_repeats_with_a_seed(tmp_path, model_and_data, capsys):
    model_dir, data = model_and_data
    assert _eval(model_dir, data, tmp_path / "a", "--pass-k", "1,2,4", "--greedy") == 0
    out = capsys.readouterr().out
    assert "6 problems x 4 samples (T 1.0, top_p 0.7, seed 0)" in out
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    metrics = summary["metrics"]
    records = [json.loads(x) for x in (tmp_path / "a" / "problems.jsonl").read_text().splitlines()]
    # maj@k only where some response gave an answer to vote with: the tiny model rarely does
    # (math_dapo's pred is then "[INVALID]").
    voted = any(gave_answer(a) for r in records for a in r["answers"])
    majority = ("maj@k",) * voted
    for key in ("avg@k", "pass@1", "pass@2", "pass@4", *majority, "greedy", "len_mean"):
        assert metrics[key]["low"] <= metrics[key]["mean"] <= metrics[key]["high"], key
    assert ("maj@k" in metrics) == voted
    assert summary["protocol"]["k"] == 4 and summary["protocol"]["problems"] == 6
    assert len(records) == 6
    assert all(len(r["responses"]) == len(r["correct"]) == len(r["answers"]) == 4 for r in records)
    # The same seed gives the same samples, hence the same figures.
    assert _eval(model_dir, data, tmp_path / "b", "--pass-k", "1,2,4", "--greedy") == 0
    again = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert again["metrics"] == metrics
    assert (tmp_path / "a" / "problems.jsonl").read_text() == (
        tmp_path / "b" / "problems.jsonl"
    ).read_text()


def test_eval_errors_name_the_fix(tmp_path, model_and_data, capsys):
    model_dir, data = model_and_data
    assert _eval(model_dir, data, tmp_path / "a", "--pass-k", "8") == 2
    assert "--pass-k: [8] not in 1..k=4" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--data", str(data)]) == 2
    assert "not a saved model directory" in capsys.readouterr().err


def test_a_lora_adapter_directory_is_named_with_the_export_that_makes_a_model(tmp_path, capsys):
    adapter = tmp_path / "adapter"  # what `dapo export` writes of a LoRA run without --merge
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert main(["eval", str(adapter), "--data", str(tmp_path / "val.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{adapter} is a LoRA adapter directory (adapter_config.json, no config.json)" in err
    assert "`dapo export RUN --merge --out DIR`" in err


def test_bad_flags_are_refused_before_anything_is_written(tmp_path, model_and_data, capsys):
    model_dir, data = model_and_data
    assert _eval(model_dir, data, tmp_path / "a", "--seed", "-1") == 2
    assert "--seed must be a non-negative integer" in capsys.readouterr().err
    assert _eval(model_dir, data, tmp_path / "a", "--config", str(tmp_path / "no.yaml")) == 2
    assert "no.yaml: no such file" in capsys.readouterr().err
    # These were read once the output directory and its journal existed (exit 2 promises
    # nothing written), the vllm one as a traceback after the model had loaded.
    assert _eval(model_dir, data, tmp_path / "a", "--stop-token-ids", "abc") == 2
    assert "--stop-token-ids 'abc': give comma-separated token ids" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:
        assert _eval(model_dir, data, tmp_path / "a", "--engine", "vllm") == 2
        assert "--engine vllm needs vLLM (Python >= 3.11)" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    compare = ["eval", str(model_dir), "--compare", str(tmp_path / "x"), str(tmp_path / "y")]
    assert main(compare) == 2
    assert f"MODEL ({model_dir}) would not be used" in capsys.readouterr().err


def test_an_out_directory_holding_a_run_or_another_summary_is_refused(
    tmp_path, model_and_data, capsys
):
    model_dir, data = model_and_data
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "summary.json").write_text('{"steps": 3}\n')
    assert _eval(model_dir, data, run) == 2
    err = capsys.readouterr().err
    assert f"--out {run} is a training run's directory (its summary.json is the run's)" in err
    assert f"--out {run / 'evals' / 'NAME'}" in err
    (run / "metrics.jsonl").unlink()
    assert _eval(model_dir, data, run) == 2
    assert "holds a summary.json that dapo eval did not write" in capsys.readouterr().err
    assert (run / "summary.json").read_text() == '{"steps": 3}\n'
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]
    assert _eval(model_dir, data, run / "evals" / "a") == 0  # a directory of its own
    assert _eval(model_dir, data, run / "evals" / "a") == 0  # its own summary: written again


def test_default_directories_are_one_per_model_path(tmp_path):
    from dapo.api.evaluation import EvalRequest, out_dir

    a, b = (tmp_path / run / "checkpoints" / "step_000001" / "model" for run in ("a", "b"))
    one, other = (out_dir(EvalRequest(model=str(m), data="arith", k=16)) for m in (a, b))
    # `--compare runs/a/.../model runs/b/.../model` once wrote both into one directory and
    # compared B with itself.
    assert one != other and one.name.startswith("step_000001-model-")
    assert one.name.endswith("-arith-k16") and one.parent.name == "evals"
    assert out_dir(EvalRequest(model=str(a) + "/", data="arith", k=16)) == one


def _records(path, values):
    with path.open("w") as f:
        for i, v in enumerate(values):
            f.write(json.dumps({"uid": f"p{i}", "metrics": {"avg@k": v, "maj@k": float(v > 0.5)}}))
            f.write("\n")
    return path


def test_compare_refuses_problems_of_one_uid_and_other_ground_truths(tmp_path, capsys):
    """AIME's two copies number their 30 problems 0-29 in different orders: paired by uid,
    every pair was two different problems, and the table looked like any other."""

    def records(path, truths):
        lines = [{"uid": f"p{i}", "ground_truth": t, "metrics": {"avg@k": 0.5}} for i, t in truths]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return path

    a = records(tmp_path / "a.jsonl", [(0, "45"), (1, "204"), (2, "7")])
    b = records(tmp_path / "b.jsonl", [(0, "204"), (1, "45"), (2, "7")])
    assert main(["eval", "--compare", str(a), str(b), "--resamples", "50"]) == 2
    err = capsys.readouterr().err
    assert "2 problems of the same uid have other ground truths in A and B" in err
    assert "(uid p0: '45' vs '204')" in err
    same = records(tmp_path / "c.jsonl", [(0, "45"), (1, "204"), (3, "9")])
    assert main(["eval", "--compare", str(a), str(same), "--resamples", "50"]) == 0
    assert "2 problems in both (2 only in one, left out)" in capsys.readouterr().out


def test_compare_identical_and_clearly_better(tmp_path, capsys):
    base = [0.0] * 60 + [1.0] * 40
    better = [1.0] * 30 + [0.0] * 30 + [1.0] * 40  # 30 problems flipped from wrong to right
    a = _records(tmp_path / "a.jsonl", base)
    assert main(["eval", "--compare", str(a), str(a)]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("avg@k"))
    # every difference 0 on 100 problems: q = z^2 / (100 + z^2), not a zero width
    assert row.split()[-1] == "1.0000" and "0.000 [-0.037, 0.037]" in row
    b = _records(tmp_path / "b.jsonl", better)
    assert main(["eval", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("avg@k"))
    assert float(row.split()[-1]) < 0.01
    assert "problems whose avg@k changed: 30" in out and "p0: 0.000 -> 1.000" in out


def test_compare_of_saved_evaluations_refuses_flags_that_shape_an_evaluation(tmp_path, capsys):
    """Both sides already evaluated: --temperature or --data changed nothing, and the table
    printed as if it answered for them."""
    a = _records(tmp_path / "a.jsonl", [0.0, 1.0, 1.0])
    b = _records(tmp_path / "b.jsonl", [1.0, 1.0, 0.0])
    flags = ["--temperature", "0.6", "--data", "arith", "--greedy"]
    assert main(["eval", "--compare", str(a), str(b), *flags]) == 2
    assert capsys.readouterr().err == (
        f"dapo: error: --compare {a} {b} compares two evaluations already made; --data, "
        "--temperature, --greedy would not be used (they shape an evaluation). Drop them, or "
        "give a model directory as A or B to evaluate it with them\n"
    )
    assert main(["eval", "--compare", str(a), str(b), "--k", "8"]) == 2
    assert "--k would not be used (they shape an evaluation). Drop it," in capsys.readouterr().err
    # What comparing reads is taken: the bootstrap's resamples and seed, the threads.
    given = ["--resamples", "50", "--seed", "3", "--threads", "1"]
    assert main(["eval", "--compare", str(a), str(b), *given]) == 0
    assert "3 problems in both" in capsys.readouterr().out


def test_compare_two_model_directories_evaluates_both_on_the_same_problems(
    tmp_path, model_and_data, capsys
):
    model_dir, data = model_and_data
    args = ["eval", "--compare", str(model_dir), str(model_dir), "--data", str(data)]
    args += ["--k", "2", "--max-new-tokens", "8", "--resamples", "100", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "6 problems in both" in out
    # The same model and seed on both sides: no difference at all (the comparison's row is the
    # last avg@k line; each evaluation printed its own table first).
    row = [x for x in out.splitlines() if x.startswith("avg@k")][-1]
    assert row.split()[-1] == "1.0000"
    # Each side's column is its own evaluation's interval, drawn in its file's problem order as
    # summary.json's was (uid order resampled other problems: len_mean's bounds moved).
    summary = json.loads((tmp_path / "A" / "summary.json").read_text())["metrics"]
    table = out[out.rindex("B - A [95% paired]") :].splitlines()[1:]
    columns = {line.split()[0]: line[19:43].strip() for line in table if line[:1].strip()}
    for name, iv in summary.items():
        assert columns[name] == f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]", name
    assert (tmp_path / "A" / "problems.jsonl").is_file() and (
        tmp_path / "B" / "summary.json"
    ).is_file()


def test_eval_in_bfloat16(tmp_path, model_and_data):
    # The demo base reuses sampler log-probs in training, which needs float32; an evaluation
    # does not train, so --dtype must not trip that check.
    model_dir, data = model_and_data
    assert _eval(model_dir, data, tmp_path / "bf16", "--dtype", "bfloat16") == 0
    records = (tmp_path / "bf16" / "problems.jsonl").read_text().splitlines()
    assert len(records) == 6


def test_a_killed_evaluation_resumes_to_the_uninterrupted_result(
    tmp_path, model_and_data, capsys, monkeypatch
):
    from dapo.eval.journal import NAME, Journal

    model_dir, data = model_and_data
    args = ("--k", "64", "--seed", "3")  # 256 responses a batch: 4 problems, then 2
    assert _eval(model_dir, data, tmp_path / "whole", *args) == 0
    real_append, appended = Journal.append, []

    def killed_after_the_first_batch(self, records):
        if appended:
            raise KeyboardInterrupt  # as a kill between two batches
        real_append(self, records)
        appended.append(len(records))

    monkeypatch.setattr(Journal, "append", killed_after_the_first_batch)
    capsys.readouterr()
    assert _eval(model_dir, data, tmp_path / "resumed", *args) == 130  # as Ctrl-C exits
    assert capsys.readouterr().err.splitlines()[-1] + "\n" == (
        "dapo: evaluation stopped by SIGINT; the problems it finished are kept "
        "(problems.partial.jsonl in its output directory): run the same command again to "
        "continue\n"
    )
    assert appended == [4] and (tmp_path / "resumed" / NAME).is_file()
    assert not (tmp_path / "resumed" / "problems.jsonl").exists()
    monkeypatch.setattr(Journal, "append", real_append)
    capsys.readouterr()
    assert _eval(model_dir, data, tmp_path / "resumed", *args) == 0
    assert "resuming: 4 of 6 problems already in" in capsys.readouterr().out
    whole_records = (tmp_path / "whole" / "problems.jsonl").read_text()
    assert (tmp_path / "resumed" / "problems.jsonl").read_text() == whole_records
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed["metrics"] == whole["metrics"]
    assert not (tmp_path / "resumed" / NAME).exists()
    # Another protocol (another seed) does not reuse the journal's records.
    (tmp_path / "resumed" / NAME).write_text((tmp_path / "whole" / "problems.jsonl").read_text())
    assert _eval(model_dir, data, tmp_path / "resumed", "--k", "64", "--seed", "4") == 0
    assert "resuming" not in capsys.readouterr().out


def _killed_after_the_first_batch(monkeypatch, model_dir, out, *args) -> None:
    """An evaluation of arith interrupted once its first batch is in the journal."""
    from dapo.eval.journal import Journal

    real_append = Journal.append

    def killed(self, records):
        real_append(self, records)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Journal, "append", killed)
        assert _eval(model_dir, "arith", out, *args) == 130


def test_a_journal_left_under_another_config_is_not_resumed(
    tmp_path, model_and_data, capsys, monkeypatch
):
    from dapo.eval.journal import NAME

    model_dir, _ = model_and_data
    config = tmp_path / "run.yaml"
    config.write_text("reward:\n  max_abs: 100.0\n")  # a run's settings: they grade the records
    args = ("--k", "64", "--num-problems", "6", "--config", str(config))
    _killed_after_the_first_batch(monkeypatch, model_dir, tmp_path / "e", *args)
    assert (tmp_path / "e" / NAME).is_file()
    config.write_text("reward:\n  max_abs: 10.0\n")  # the same path, other settings
    capsys.readouterr()
    assert _eval(model_dir, "arith", tmp_path / "e", *args) == 0
    assert "resuming" not in capsys.readouterr().out
    protocol = json.loads((tmp_path / "e" / "summary.json").read_text())["protocol"]
    assert protocol["config"]["path"] == str(config) and len(protocol["config"]["sha256"]) == 64


def test_a_journal_of_a_model_rewritten_at_the_same_path_is_not_resumed(
    tmp_path, model_and_data, capsys, monkeypatch
):
    """The journal named the model by its path: a run's model/ saved again between an
    interrupted evaluation and its resumption mixed two models' records in one result."""
    import os
    import shutil

    from dapo.eval.journal import NAME

    model_dir = shutil.copytree(model_and_data[0], tmp_path / "model")
    args = ("--k", "64", "--num-problems", "6")
    _killed_after_the_first_batch(monkeypatch, model_dir, tmp_path / "e", *args)
    weights = next(model_dir.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    capsys.readouterr()
    assert _eval(model_dir, "arith", tmp_path / "e", *args) == 0
    assert "resuming" not in capsys.readouterr().out
    assert not (tmp_path / "e" / NAME).exists()


def test_bad_counts_are_refused_before_the_model_loads(tmp_path, model_and_data, capsys):
    model_dir, data = model_and_data
    # A negative count once dropped problems from the end; --resamples 0 once failed only
    # after every problem was sampled.
    assert _eval(model_dir, data, tmp_path / "a", "--num-problems", "-2") == 2
    assert "--num-problems must be >= 0 (0 = all), got -2" in capsys.readouterr().err
    assert _eval(model_dir, data, tmp_path / "b", "--resamples", "0") == 2  # the last one counts
    assert "resamples must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_maj_is_not_reported_when_the_reward_function_gives_no_pred(
    tmp_path, model_and_data, capsys
):
    model_dir, data = model_and_data
    fn = tmp_path / "always.py"
    fn.write_text("def always(response, ground_truth):\n    return True\n")
    out = tmp_path / "a"
    flags = ("--num-problems", "3", "--reward-function", f"{fn}:always")
    assert _eval(model_dir, data, out, *flags) == 0
    assert capsys.readouterr().out.count("maj@k") == 1  # the note, not a row of zeros
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["avg@k"]["mean"] == 1.0 and "maj@k" not in summary["metrics"]
    records = [json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all("maj@k" not in r["metrics"] for r in records)


def test_compare_names_a_hostile_line_instead_of_a_traceback(tmp_path, capsys):
    a = _records(tmp_path / "a.jsonl", [0.5] * 5)
    b = _records(tmp_path / "b.jsonl", [0.7] * 5)
    with b.open("a") as f:
        f.write("\n")  # a blank line holds no record: passed over
    assert main(["eval", "--compare", str(a), str(b), "--resamples", "100"]) == 0
    assert "problems whose avg@k changed: 5" in capsys.readouterr().out
    for i, line in enumerate(
        [
            '{"uid": "p0", "metrics": {"avg@k": 1' + "0" * 400 + "}}",  # beyond a float
            '{"uid": "p0", "metrics": {"avg@k": 1' + "0" * 5000 + "}}",  # too long for int()
            "[" * 100_000 + "]" * 100_000,  # deeper than the parser recurses
            '{"uid": "p0", "metrics": {"avg@k": "0.5"}}',
        ]
    ):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(json.dumps({"uid": "q", "metrics": {"avg@k": 0.5}}) + "\n" + line + "\n")
        assert main(["eval", "--compare", str(a), str(bad)]) == 2
        err = capsys.readouterr().err
        assert (
            f"--compare: {bad} line 2 is not a dapo eval record" in err and "Traceback" not in err
        )


def test_compare_names_a_gguf_file_and_a_file_of_no_record(tmp_path, capsys, monkeypatch):
    """A GGUF file given as a side was read as an evaluation ("not a dapo eval record", or
    "share no problems (0 vs 0 uids)" when empty); so was a file of blank lines."""
    a = _records(tmp_path / "a.jsonl", [0.5] * 3)
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    for sides in ([str(gguf), str(a)], [str(a), str(gguf), "--data", "arith"]):
        assert main(["eval", "--compare", *sides]) == 2
        assert capsys.readouterr().err == (
            f"dapo: error: --compare: {gguf} is a GGUF file, not a model directory: import it "
            f"first, `dapo model import {gguf} OUT_DIR`, and compare OUT_DIR (with --data)\n"
        )
    renamed = tmp_path / "my model.bin"  # a GGUF file by its first bytes; a quoted path
    renamed.write_bytes(gguf.read_bytes())
    assert main(["eval", "--compare", str(a), str(renamed)]) == 2
    assert f"`dapo model import '{renamed}' OUT_DIR`" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # evals/nothere: mistyped, and shaped like a Hub id
    assert main(["eval", "--compare", str(a), "evals/nothere"]) == 2
    assert capsys.readouterr().err == (
        "dapo: error: --compare with a model directory needs --data FILE (or arith); "
        "evals/nothere is no local path, so it was read as a Hub model id\n"
    )
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    assert main(["eval", "--compare", str(a), str(blank)]) == 2
    assert capsys.readouterr().err == (
        f"dapo: error: --compare: {blank} holds no dapo eval record (one JSON line per problem, "
        "as dapo eval writes problems.jsonl)\n"
    )


def test_compare_says_where_the_two_protocols_differ(tmp_path, capsys):
    """maj@k of k = 4 against k = 32, or two temperatures, are not one measure: the table
    printed them side by side without a word. Each side's summary.json is read."""
    sides = {}
    for side, k, temperature in (("A", 4, 1.0), ("B", 32, 0.6)):
        out = tmp_path / side
        out.mkdir()
        _records(out / "problems.jsonl", [0.5] * 5)
        protocol = {"k": k, "temperature": temperature, "top_p": 1.0, "data": f"{side}.parquet"}
        (out / "summary.json").write_text(json.dumps({"protocol": protocol, "metrics": {}}))
        sides[side] = out
    assert main(["eval", "--compare", str(sides["A"]), str(sides["B"]), "--resamples", "50"]) == 0
    out = capsys.readouterr().out
    assert "the two evaluations differ in protocol" in out
    assert "  k: 4 (A) vs 32 (B)" in out and "  temperature: 1.0 (A) vs 0.6 (B)" in out
    assert "top_p" not in out and "data:" not in out  # the same, or not a sampling setting
    assert main(["eval", "--compare", str(sides["A"]), str(sides["A"] / "problems.jsonl")]) == 0
    assert "differ in protocol" not in capsys.readouterr().out


def test_compare_names_how_the_data_was_read_the_config_and_the_phrases(tmp_path, capsys):
    """--wrap-template changes every prompt, a --config can turn tool episodes on, and
    --phrases changes what reflective_frac counts: --compare set them side by side unnamed."""
    config = {"path": "/a/run.yaml", "sha256": "1" * 64}
    protocols = {
        "A": {"k": 4, "config": config},
        "B": {"k": 4, "config": {**config, "sha256": "2" * 64}, "phrases": ["="]},
        "C": {"k": 4, "config": {**config, "path": "/b/run.yaml"}},  # one file, two places
        "D": {"k": 4, "config": config, "data_options": {"wrap_template": True}},
    }
    sides = {}
    for side, protocol in protocols.items():
        sides[side] = tmp_path / side
        sides[side].mkdir()
        _records(sides[side] / "problems.jsonl", [0.5] * 5)
        (sides[side] / "summary.json").write_text(json.dumps({"protocol": protocol}))

    def differences(a, b):
        assert main(["eval", "--compare", str(sides[a]), str(sides[b]), "--resamples", "20"]) == 0
        out = capsys.readouterr().out
        return [line for line in out.splitlines() if line.startswith("  ") and " vs " in line]

    assert differences("A", "B") == [
        f"  config: '{'1' * 64}' (A) vs '{'2' * 64}' (B)",
        "  phrases: None (A) vs ['='] (B)",
    ]
    assert differences("A", "C") == []
    assert differences("A", "D") == ["  data_options: None (A) vs {'wrap_template': True} (B)"]


def test_the_phrases_counted_are_saved_with_the_evaluation(tmp_path, model_and_data):
    model_dir, data = model_and_data
    args = ("--num-problems", "2", "--k", "2", "--phrases", "=, wait")
    assert _eval(model_dir, data, tmp_path / "a", *args) == 0
    assert _eval(model_dir, data, tmp_path / "b", *args[:4]) == 0
    protocols = [json.loads((tmp_path / s / "summary.json").read_text())["protocol"] for s in "ab"]
    assert protocols[0]["phrases"] == ["=", "wait"] and "phrases" not in protocols[1]


def test_eval_grades_under_the_run_configs_reward_bounds(tmp_path, model_and_data, monkeypatch):
    """--config's reward.* reach the pool: a program the run gives 30 s is no timeout fault in
    eval under the pool's 10 s default."""
    from dapo.reward.pool import RewardPool

    built, real_init = [], RewardPool.__init__

    def recording(self, **kwargs):
        built.append(kwargs)
        real_init(self, **kwargs)

    monkeypatch.setattr(RewardPool, "__init__", recording)
    model_dir, _ = model_and_data
    config = tmp_path / "run.yaml"
    config.write_text(
        "reward:\n  timeout_s: 30.0\n  memory_mb: 1000\n  batch_timeout_s: 77.0\n  workers: 2\n"
    )
    args = ("--num-problems", "2", "--config", str(config))
    assert _eval(model_dir, "arith", tmp_path / "e", *args) == 0
    bounds = [(b["workers"], b["timeout_s"], b["memory_mb"], b["batch_timeout_s"]) for b in built]
    assert bounds == [(2, 30.0, 1000, 77.0)]


def test_compare_takes_a_hub_model_id_for_a_model(tmp_path, capsys, monkeypatch):
    """A Hub id was read as the path of a problems.jsonl ("cannot read Org/name"), where
    dapo eval and dapo train take it for a model."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    a = _records(tmp_path / "a.jsonl", [1.0, 0.0])
    assert main(["eval", "--compare", str(a), "Org/no-such-model"]) == 2
    assert "--compare with a model directory needs --data" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--compare", str(a), "Org/no-such-model", "--data", "arith"]) == 2
    err = capsys.readouterr().err
    assert "Org/no-such-model" in err and "Hugging Face cache" in err and "cannot read" not in err


def test_faults_are_named_on_stderr_under_the_table(tmp_path, model_and_data, capsys):
    """A reward function that raises on some responses: the table alone read as a weak model.
    Each batch names its first fault and what the function printed; a line under the table
    counts them."""
    model_dir, data = model_and_data
    fn = tmp_path / "picky.py"
    second = json.loads(data.read_text().splitlines()[1])["answer"]
    fn.write_text(
        "def picky(response, ground_truth):\n"
        "    print('grading', ground_truth)\n"
        f"    if ground_truth == {second!r}:\n"
        "        raise ValueError('no grade for this one')\n"
        "    return True\n"
    )
    out = tmp_path / "a"
    flags = ("--num-problems", "3", "--k", "2", "--reward-function", f"{fn}:picky")
    assert _eval(model_dir, data, out, *flags) == 0
    err = capsys.readouterr().err
    assert (
        "evaluation, problems 1-3: the verifier failed on 2 response(s), graded incorrect; " in err
    )
    records = [json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines()]
    assert [r["faults"] for r in records] == [0, 2, 0]
    assert f"first (row {records[1]['uid']}): error: verifier " in err
    assert "raised ValueError: no grade for this one" in err
    assert "the verifiers printed:\ngrading " in err
    assert "2 of 6 responses could not be graded (reward faults, counted wrong)" in err
    assert json.loads((out / "summary.json").read_text())["protocol"]["reward_faults"] == 2


def test_sigterm_stops_an_evaluation_with_its_resume_hint_and_leaves_no_temp_dir(
    tmp_path, model_and_data
):
    # SIGTERM's default action ended dapo eval at once: no word of the kept problems, and
    # multiprocessing's forkserver directory (/tmp/pymp-*) left behind at every stop.
    import os
    import signal
    import subprocess
    import sys
    import time

    model_dir, data = model_and_data
    temp, out = tmp_path / "tmp", tmp_path / "e"
    temp.mkdir()
    cmd = [sys.executable, "-m", "dapo", "eval", str(model_dir), "--data", str(data)]
    cmd += ["--k", "64", "--max-new-tokens", "12", "--out", str(out), "--threads", "1"]
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "problems.partial.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    finished = (out / "problems.jsonl").is_file()  # a fast machine may finish first
    assert proc.returncode == (0 if finished else 143), err
    if not finished:
        assert err.endswith(
            "dapo: evaluation stopped by SIGTERM; the problems it finished are kept "
            "(problems.partial.jsonl in its output directory): run the same command again to "
            "continue\n"
        )
        assert "Traceback" not in err and (out / "problems.partial.jsonl").is_file()
    assert list(temp.iterdir()) == []
