"""What a run and an evaluation check of their prompts before any model loads (review r19):
``dapo eval`` refuses prompts that with ``--max-new-tokens`` overrun the model's context, as
``dapo train`` does (``--compare`` and ``--config`` included); both name the file and row of
the longest prompt; and a train file whose problems never ask for the ``Answer:`` line their
verifier grades by is warned of.

The test on the real DAPO-Math-17k copy skips when ../shared/data is absent.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers import question_file, save_model, small_run

from dapo.api.eval_inputs import EvalRequest, problems_of
from dapo.cli import main
from dapo.config import DataConfig, load_config
from dapo.data.files import load_problems
from dapo.data.problems import Problem
from dapo.data.prompts import dapo_prompt
from dapo.models import policy
from dapo.training.inputs import RunData, check_verifiers
from dapo.training.prompt_checks import ANSWER_REQUESTS, answer_line_warning

ROOT = Path(__file__).resolve().parents[1]
DAPO_17K = ROOT.parent / "shared" / "data" / "dapo-math-17k" / "dapo_math_17k.parquet"

LONG = "Compute " + " + ".join(["7"] * 400) + "."  # 807 tokens of the demo's tokenizer


jsonl = question_file


def dry_run(tmp_path: Path, model: Path, train: Path, val: Path, *extra: str) -> list[str]:
    return ["train", "--dry-run", *small_run(tmp_path, model, train, val, *extra)]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the checks must come before one."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the context was checked")

    monkeypatch.setattr(policy, "load_policy", refuse)


# --- dapo eval: prompt + --max-new-tokens against the model's context --------------------------


def test_eval_refuses_a_prompt_past_the_embedded_context_naming_file_and_row(
    tmp_path, capsys, no_model_loads
):
    data = jsonl(tmp_path / "long.jsonl", ["Compute 2 + 3.", LONG])
    out = tmp_path / "evals" / "long"
    args = ["eval", "embedded", "--data", str(data), "--k", "1", "--max-new-tokens", "8"]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        "embedded: 1 prompt(s) plus --max-new-tokens=8 exceed the model's context of 512 "
        f"tokens (longest: --data {data}, row 1, 807 prompt tokens: no room for a response)"
    ) in err
    # 807 tokens fill the 512 alone: a smaller --max-new-tokens cannot help, and is not led with.
    assert (
        "no room for a response). Drop the longest problems from the file, or evaluate a model "
        "with a longer context: 1 prompt(s) fill the context alone, and no --max-new-tokens "
        "leaves room for a response to them\n"
    ) in err
    assert "--max-new-tokens (a run's" not in err
    assert not out.exists()


def test_eval_refuses_the_default_max_new_tokens_past_a_short_context(tmp_path, capsys):
    model = save_model(tmp_path / "m", "qwen2", context=64)
    data = jsonl(tmp_path / "val.jsonl", ["What is 1 + 1 ?", "What is 2 + 2 + 3 ?"])
    args = ["eval", str(model), "--data", str(data), "--k", "1", "--out", str(tmp_path / "e")]
    assert main(args) == 2  # --max-new-tokens 20480, the paper's L_max
    err = capsys.readouterr().err
    assert "2 prompt(s) plus --max-new-tokens=20480 exceed the model's context of 64" in err
    assert f"--data {data}, row 1," in err
    room = int(re.search(r"at most (\d+) new tokens fit", err)[1])
    # The room it names is exact: one token more is refused, that many sample.
    request = EvalRequest(model=str(model), data=str(data), k=1, max_new_tokens=room)
    assert [p.answer for p in problems_of(request)] == ["0", "1"]
    request.max_new_tokens = room + 1
    with pytest.raises(ValueError, match=f"1 prompt\\(s\\) plus --max-new-tokens={room + 1} "):
        problems_of(request)
    # --num-problems 1 leaves the longer one out: the first alone is checked.
    request.num_problems = 1
    assert len(problems_of(request)) == 1


def test_eval_counts_the_system_prompt_as_sampling_renders_it(tmp_path):
    model = save_model(tmp_path / "m", "qwen2", context=64)
    data = jsonl(tmp_path / "val.jsonl", ["What is 1 + 1 ?"])
    request = EvalRequest(model=str(model), data=str(data), k=1, max_new_tokens=40)
    problems_of(request)
    request.system_prompt = " ".join(["7"] * 30)  # 30 more prompt tokens: over 64
    with pytest.raises(ValueError, match="exceed the model's context of 64 tokens"):
        problems_of(request)


def test_compare_checks_the_second_model_before_the_first_is_sampled(
    tmp_path, capsys, no_model_loads
):
    roomy = save_model(tmp_path / "a", "qwen2", context=512)
    short = save_model(tmp_path / "b", "qwen2", context=32)
    data = jsonl(tmp_path / "val.jsonl", ["What is 1 + 1 ?", "What is 2 + 2 + 3 ?"])
    args = ["eval", "--compare", str(roomy), str(short), "--data", str(data), "--k", "1"]
    assert main([*args, "--max-new-tokens", "30", "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert f"{short}: " in err and "exceed the model's context of 32 tokens" in err
    assert not (tmp_path / "cmp").exists()  # A was not sampled


def test_eval_with_a_run_config_checks_its_arith_split(tmp_path, capsys, no_model_loads):
    config = ROOT / "recipes" / "demo-long.yaml"
    args = ["eval", "embedded", "--data", "arith", "--config", str(config), "--k", "1"]
    assert main([*args, "--out", str(tmp_path / "e")]) == 2  # 20480 new tokens, 512 positions
    err = capsys.readouterr().err
    assert "plus --max-new-tokens=20480 exceed the model's context of 512 tokens" in err
    assert re.search(r"\(longest: problem \S+, \d+ prompt tokens: at most \d+ new tokens", err)
    request = EvalRequest(model="embedded", data="arith", config=str(config), max_new_tokens=40)
    assert problems_of(request)  # the recipe's own L_max fits


# --- dapo train: the refusal names the train or val file and its row ---------------------------


def test_train_names_the_file_and_row_of_the_longest_prompt(tmp_path, capsys):
    model = save_model(tmp_path / "m", "qwen2", context=512)
    short = ["What is 1 + 1 ?", "What is 2 + 2 ?"]
    train = jsonl(tmp_path / "train.jsonl", [*short, LONG])
    with train.open("a") as f:  # the long one repeated: its first row (2) is named, not 3
        f.write(train.read_text().splitlines()[2] + "\n")
    val = jsonl(tmp_path / "val.jsonl", short)
    assert main(dry_run(tmp_path, model, train, val)) == 2
    err = capsys.readouterr().err
    assert (
        "1 prompt(s) plus rollout.max_new_tokens=16 exceed the model's context of 512 tokens "
        f"(longest: train file {train}, row 2, 807 prompt tokens: no room for a response)"
    ) in err
    assert (
        "no room for a response). Set data.on_long_prompt=skip to drop them, drop the longest "
        "problems from the file, or use a model with a longer context: 1 prompt(s) fill the "
        "context alone, and no rollout.max_new_tokens leaves room for a response to them\n"
    ) in err
    assert "Lower rollout.max_new_tokens" not in err
    # In the val file, as the val file's; a larger eval.max_new_tokens is the one named.
    fits = jsonl(tmp_path / "fits.jsonl", short)
    long_val = jsonl(tmp_path / "long_val.jsonl", [short[0], " ".join(["7"] * 30)])
    model64 = save_model(tmp_path / "m64", "qwen2", context=64)
    args = dry_run(tmp_path, model64, fits, long_val, "eval.max_new_tokens=40")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "1 prompt(s) plus eval.max_new_tokens=40 exceed the model's context of 64" in err
    assert f"(longest: val file {long_val}, row 1, " in err


# --- a train file that never asks for the Answer: line -----------------------------------------


def test_the_template_sentences_matched_are_the_dapo_templates():
    wrapped = dapo_prompt("What is 1 + 1?")
    assert all(sentence in wrapped for sentence in ANSWER_REQUESTS)


def test_dry_run_warns_of_an_unwrapped_file_and_not_of_a_wrapped_one(tmp_path, capsys):
    model = save_model(tmp_path / "m", "qwen2", context=512)
    # A problem that holds "Answer:" in its own text asks for nothing (20 rows of the shared
    # DAPO-Math-17k copy do): the old check took it for the instruction.
    train = jsonl(tmp_path / "raw.jsonl", ["What is 1 + 1 ?", "Answer: the sum of 2 and 2 ?"])
    val = jsonl(tmp_path / "val.jsonl", ["What is 3 + 3 ?"])
    assert main(dry_run(tmp_path, model, train, val, "reward.mode=dapo")) == 0
    captured = capsys.readouterr()
    warning = (
        f"dapo: warning: {train}: none of its 2 problems asks for an `Answer:` line, which "
        "math_dapo grades by (a response without one scores -1)"
    )
    assert warning in captured.err
    assert "Set data.wrap_template=true, or convert the file (`dapo data convert " in captured.err
    assert "dry run: config, tokenizer and data are valid" in captured.out  # not a refusal
    for fixed in ("data.wrap_template=true", 'data.system_prompt="End with Answer: N"'):
        assert main(dry_run(tmp_path, model, train, val, "reward.mode=dapo", fixed)) == 0
        assert "asks for an `Answer:` line" not in capsys.readouterr().err, fixed
    # math_lenient grades the line alone too; math_verify also reads a \boxed{} answer.
    assert main(dry_run(tmp_path, model, train, val, "reward.mode=lenient")) == 0
    assert "which math_lenient grades by" in capsys.readouterr().err
    assert main(dry_run(tmp_path, model, train, val, "reward.mode=math_verify")) == 0
    assert "asks for an `Answer:` line" not in capsys.readouterr().err


def test_a_worked_example_or_a_system_message_asks_for_the_line():
    graders = {"math_dapo"}
    question = {"role": "user", "content": "What is 1 + 1?"}
    d = DataConfig(train_file="t.jsonl")
    bare = [Problem("a", (question,), "2")]
    assert "none of its 1 problems" in answer_line_warning(d, bare, graders)
    for role in ("assistant", "system"):
        told = {"role": role, "content": "3 + 4 = 7\nAnswer: 7"}
        assert answer_line_warning(d, [Problem("b", (told, question), "2")], graders) is None
    d.on_bad_row = "skip"
    assert "--to dapo --on-bad-row skip` and train on OUT.parquet" in answer_line_warning(
        d, bare, graders
    )


@pytest.mark.skipif(not DAPO_17K.is_file(), reason="../shared/data is absent")
def test_the_shared_dapo_math_17k_copy_is_warned_of_and_its_converted_copy_is_not(tmp_path, capsys):
    cfg = load_config(None, ["reward.mode=dapo", 'data.system_prompt=""'])  # the recipe's
    cfg.data.train_file, cfg.data.on_bad_row = str(DAPO_17K), "skip"  # as the warning reads

    def warnings(path: Path, wrap: bool) -> list[str]:
        loaded = load_problems(path, on_bad_row="skip", wrap_template=wrap)
        data = RunData(loaded.problems, loaded.problems[:1])
        check_verifiers(cfg, data)
        return data.warnings

    (raw,) = warnings(DAPO_17K, wrap=False)
    assert raw.startswith(f"{DAPO_17K}: none of its 17290 problems asks for an `Answer:` line")
    assert warnings(DAPO_17K, wrap=True) == []
    # The command the warning gives converts the file into one that is not warned of.
    command = shlex.split(re.search(r"\(`(dapo data convert [^`]+)`", raw)[1])
    out = tmp_path / "OUT.parquet"
    command[command.index("OUT.parquet")] = str(out)
    assert main(command[1:]) == 0, capsys.readouterr().err
    assert warnings(out, wrap=False) == []
