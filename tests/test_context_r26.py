"""Prompts longer than the model's context (review r26).

A prompt that fills the context alone leaves no room for a response at any budget: ``dapo
train`` and ``dapo eval`` lead their fix with dropping it or a longer-context model, not with
a smaller max-new-tokens, which cannot help; where a smaller budget fits, the message is as
before. ``dapo bench`` checks its train prompts against the context as ``dapo train`` does,
before the model loads (a rotary model generates past its context: the timing would be of no
run's steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import question_file, save_model, small_run

from dapo.api.eval_inputs import EvalRequest, problems_of
from dapo.cli import main
from dapo.data.problems import Problem
from dapo.models import policy
from dapo.training import bench
from dapo.training.prompt_checks import context_overrun, drop_long

SEVENS = lambda n: "Compute " + " + ".join(["7"] * n) + "."  # noqa: E731  (2n + 7 tokens)
SHORT = ["What is 1 + 1 ?", "What is 2 + 2 ?"]

jsonl = question_file


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the checks must come before one."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the context was checked")

    monkeypatch.setattr(policy, "load_policy", refuse)


def overrun(lengths: list[int], limit: int, max_new: int) -> str | None:
    return context_overrun(
        lengths,
        limit,
        max_new,
        budget="B",
        where=lambda i: f"row {i}",
        fix="Lower B, or drop them",
        alone="Drop them",
    )


# --- the message: which fix leads -----------------------------------------------------------


def test_a_prompt_that_fills_the_context_alone_is_not_told_to_lower_the_budget():
    # 100 tokens of a 100-token context: not one new token fits, whatever B is.
    assert overrun([10, 100, 99], 100, 2) == (
        "2 prompt(s) plus B=2 exceed the model's context of 100 tokens (longest: row 1, 100 "
        "prompt tokens: no room for a response). Drop them: 1 prompt(s) fill the context "
        "alone, and no B leaves room for a response to them"
    )
    assert overrun([120, 130, 5], 100, 8).endswith(
        "(longest: row 1, 130 prompt tokens: no room for a response). Drop them: 2 prompt(s) "
        "fill the context alone, and no B leaves room for a response to them"
    )


def test_where_a_smaller_budget_fits_the_message_is_as_before():
    # One token short of the context: a budget of 1 fits, and lowering it is the fix.
    assert overrun([10, 99], 100, 2) == (
        "1 prompt(s) plus B=2 exceed the model's context of 100 tokens (longest: row 1, 99 "
        "prompt tokens: at most 1 new tokens fit). Lower B, or drop them"
    )
    assert overrun([10, 99], 100, 1) is None


def test_skip_that_drops_every_prompt_says_no_budget_helps_when_none_would():
    problems = [Problem(uid=f"p{i}", messages=(), answer=str(i)) for i in range(2)]
    rows = {"p0": 0, "p1": 1}
    with pytest.raises(ValueError) as every:
        drop_long(problems, [512, 807], 512, 16, "t.jsonl", rows)
    assert str(every.value).endswith(
        "none of its 2 problems is left to train on; use a model with a longer context: every "
        "prompt fills the context alone, and no rollout.max_new_tokens leaves room for a response"
    )
    with pytest.raises(ValueError) as some:  # 511 tokens: a budget of 1 keeps it
        drop_long(problems, [511, 807], 512, 16, "t.jsonl", rows)
    assert str(some.value).endswith(
        "none of its 2 problems is left to train on; lower rollout.max_new_tokens, or use a "
        "model with a longer context"
    )


# --- dapo train and dapo eval ---------------------------------------------------------------


def test_train_names_the_fix_for_a_val_prompt_that_fills_the_context(tmp_path, capsys):
    model = save_model(tmp_path / "m", "qwen2", context=64)
    train = jsonl(tmp_path / "train.jsonl", SHORT)
    val = jsonl(tmp_path / "val.jsonl", [SHORT[0], SEVENS(40)])  # 87 tokens of 64
    args = ["train", "--dry-run", *small_run(tmp_path, model, train, val)]
    capsys.readouterr()  # the model's save: its progress lines
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "dapo: error: 1 prompt(s) plus rollout.max_new_tokens=16 exceed the model's context of "
        f"64 tokens (longest: val file {val}, row 1, 87 prompt tokens: no room for a "
        "response). Drop the longest problems from the file, or use a model with a longer "
        "context: 1 prompt(s) fill the context alone, and no rollout.max_new_tokens leaves "
        "room for a response to them\n"
    )


def test_eval_keeps_the_smaller_budget_fix_where_it_fits(tmp_path, no_model_loads):
    model = save_model(tmp_path / "m", "qwen2", context=64)
    data = jsonl(tmp_path / "val.jsonl", [SHORT[0], SEVENS(20)])  # 47 tokens of 64
    request = EvalRequest(model=str(model), data=str(data), k=1, max_new_tokens=40)
    with pytest.raises(ValueError) as refused:
        problems_of(request)
    assert str(refused.value) == (
        f"{model}: 1 prompt(s) plus --max-new-tokens=40 exceed the model's context of 64 "
        f"tokens (longest: --data {data}, row 1, 47 prompt tokens: at most 17 new tokens "
        "fit). Give a smaller --max-new-tokens (a run's evaluation samples up to its "
        "rollout.max_new_tokens), drop the longest problems from the file, or evaluate a "
        "model with a longer context"
    )


# --- dapo bench: the train prompts against the context, before the model loads ---------------


def bench_args(tmp_path: Path, model: Path, train: Path, val: Path, *extra: str) -> list[str]:
    overrides = small_run(tmp_path, model, train, val, *extra)
    return ["bench", "--steps", "1", "--warmup", "0", *overrides]


def test_bench_refuses_prompt_and_budget_past_the_context(tmp_path, capsys, no_model_loads):
    model = save_model(tmp_path / "m", "qwen2", context=64)
    train = jsonl(tmp_path / "train.jsonl", [SHORT[0], SEVENS(20)])  # 47 tokens of 64
    val = jsonl(tmp_path / "val.jsonl", SHORT)
    args = bench_args(tmp_path, model, train, val, "rollout.max_new_tokens=40", "--fixed-length")
    capsys.readouterr()  # the model's save: its progress lines
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no JSON: nothing was timed
    assert captured.err == (
        "dapo: error: 1 prompt(s) plus rollout.max_new_tokens=40 exceed the model's context of "
        f"64 tokens (longest: train file {train}, row 1, 47 prompt tokens: at most 17 new "
        "tokens fit). Lower rollout.max_new_tokens (and eval.max_new_tokens), set "
        "data.on_long_prompt=skip to drop them, drop the longest problems from the file, or "
        "use a model with a longer context\n"
    )


def test_bench_refuses_the_embedded_model_past_its_512_positions(capsys, no_model_loads):
    # The default bench: the embedded demo, whose 512 positions a rotary model generates past.
    assert main(["bench", "--steps", "1", "rollout.max_new_tokens=600"]) == 2
    err = capsys.readouterr().err
    assert "prompt(s) plus rollout.max_new_tokens=600 exceed the model's context of 512" in err
    assert "new tokens fit). Lower rollout.max_new_tokens" in err


def test_bench_skip_drops_the_long_prompts_and_says_so(tmp_path, capsys, monkeypatch):
    model = save_model(tmp_path / "m", "qwen2", context=64)
    train = jsonl(tmp_path / "train.jsonl", [SHORT[0], SEVENS(40), SHORT[1]])  # row 1: 87
    val = jsonl(tmp_path / "val.jsonl", [SHORT[0], SEVENS(40)])  # a bench samples no val
    trained = []

    def stop(cfg, model, tokenizer, problems):  # what the steps would train on, then stop
        trained.extend(p.answer for p in problems)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "build_state", stop)
    with pytest.raises(KeyboardInterrupt):
        main(bench_args(tmp_path, model, train, val, "data.on_long_prompt=skip"))
    assert trained == ["0", "2"]
    assert (
        f"train: {train}: 1 problem(s) dropped (data.on_long_prompt=skip): their prompts plus "
        "rollout.max_new_tokens=16 exceed the model's context of 64 tokens (over 48 prompt "
        "tokens; longest: row 1, 87 tokens); 2 kept\n"
    ) in capsys.readouterr().err


def test_bench_within_the_context_runs(tmp_path, capsys):
    model = save_model(tmp_path / "m", "qwen2", context=64)
    train = jsonl(tmp_path / "train.jsonl", [SHORT[0], SEVENS(20)])  # 47 + 17 = 64: fits
    val = jsonl(tmp_path / "val.jsonl", SHORT)
    args = bench_args(tmp_path, model, train, val, "rollout.max_new_tokens=17", "--fixed-length")
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["response_len_mean"] == 17.0
