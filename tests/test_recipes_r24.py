"""The recipes end to end (review r24).

``data.on_long_prompt``: ``skip`` drops the train prompts that with ``rollout.max_new_tokens``
overrun the model's context, before training, in one counted line naming the file, the
longest row and the limit; ``error`` (the default) refuses them as before; val prompts are
never dropped; a file of which none fits is refused. ``eval.num_samples=0`` on a val file
that repeats nothing is warned of (avg@1). A recipe's memory plan takes the longest prompt
its run can get. ``dapo data make`` creates the output's directories.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import question_file, save_model, small_run

from dapo.cli import main
from dapo.config import load_config
from dapo.models.policy import load_tokenizer
from dapo.training.inputs import check_context, load_run_data

SEVENS = lambda n: "Compute " + " + ".join(["7"] * n) + "."  # noqa: E731  (2n + 7 tokens)
SHORT = ["What is 1 + 1 ?", "What is 2 + 2 ?", "What is 3 + 3 ?", "What is 4 + 4 ?"]


jsonl = question_file


@pytest.fixture
def setup(tmp_path):
    """A 512-token model, a train file whose rows 1 and 4 are too long (807 and 607 prompt
    tokens with 16 new ones), and a val file that fits."""
    model = save_model(tmp_path / "m", "qwen2", context=512)
    questions = [SHORT[0], SEVENS(400), SHORT[1], SHORT[2], SEVENS(300), SHORT[3]]
    train = jsonl(tmp_path / "train.jsonl", questions)
    val = jsonl(tmp_path / "val.jsonl", SHORT[:2])
    return tmp_path, model, train, val


overrides = small_run


def dropped(path: Path, n: int, kept: int, row: int, tokens: int) -> str:
    return (
        f"train: {path}: {n} problem(s) dropped (data.on_long_prompt=skip): their prompts plus "
        "rollout.max_new_tokens=16 exceed the model's context of 512 tokens (over 496 prompt "
        f"tokens; longest: row {row}, {tokens} tokens); {kept} kept"
    )


def test_skip_drops_exactly_the_long_rows_and_keeps_the_others_in_order(setup):
    tmp_path, model, train, val = setup
    cfg = load_config(None, overrides(*setup, "data.on_long_prompt=skip"))
    data = load_run_data(cfg)
    stats = check_context(cfg, data, load_tokenizer(cfg))
    assert [p.answer for p in data.train] == ["0", "2", "3", "5"]  # rows 1 and 4 dropped
    assert [p.answer for p in data.val] == ["0", "1"]
    assert dropped(train, 2, 4, 1, 807) in data.notes
    assert stats["prompt_tokens_max"] < 496  # the kept prompts' lengths alone
    # Every rank of a job reads the file and drops the same problems: the same uids again.
    again = load_run_data(cfg)
    check_context(cfg, again, load_tokenizer(cfg))
    assert [p.uid for p in again.train] == [p.uid for p in data.train]


def test_the_dry_run_prints_the_line_and_the_default_still_refuses(setup, capsys):
    tmp_path, model, train, val = setup
    args = ["train", "--dry-run", *overrides(*setup)]
    assert main([*args, "data.on_long_prompt=skip"]) == 0
    out = capsys.readouterr().out
    assert dropped(train, 2, 4, 1, 807) in out
    assert "train 4 problems, val 2 problems" in out
    assert main(args) == 2  # data.on_long_prompt=error, the default
    err = capsys.readouterr().err
    assert (
        "2 prompt(s) plus rollout.max_new_tokens=16 exceed the model's context of 512 tokens "
        f"(longest: train file {train}, row 1, 807 prompt tokens: no room for a response). "
        "Set data.on_long_prompt=skip to drop them, drop the longest problems from the file, "
        "or use a model with a longer context: 2 prompt(s) fill the context alone, and no "
        "rollout.max_new_tokens leaves room for a response to them\n"
    ) in err


def test_a_long_val_prompt_is_refused_with_skip_too(setup, capsys):
    tmp_path, model, train, val = setup
    long_val = jsonl(tmp_path / "long_val.jsonl", [SHORT[0], SEVENS(300)])
    args = ["train", "--dry-run", *overrides(tmp_path, model, train, long_val)]
    assert main([*args, "data.on_long_prompt=skip"]) == 2
    err = capsys.readouterr().err
    assert (
        "1 prompt(s) plus rollout.max_new_tokens=16 exceed the model's context of 512 tokens "
        f"(longest: val file {long_val}, row 1, 607 prompt tokens"
    ) in err
    assert "on_long_prompt" not in err  # an eval set is never changed


def test_a_file_of_which_no_prompt_fits_is_refused(tmp_path, capsys):
    model = save_model(tmp_path / "m", "qwen2", context=512)
    train = jsonl(tmp_path / "train.jsonl", [SEVENS(300), SEVENS(400)])
    val = jsonl(tmp_path / "val.jsonl", SHORT[:1])
    args = ["train", "--dry-run", *overrides(tmp_path, model, train, val)]
    assert main([*args, "data.on_long_prompt=skip"]) == 2
    err = capsys.readouterr().err
    assert (
        f"train: {train}: 2 problem(s) dropped (data.on_long_prompt=skip): their prompts plus "
        "rollout.max_new_tokens=16 exceed the model's context of 512 tokens (over 496 prompt "
        "tokens; longest: row 1, 807 tokens): none of its 2 problems is left to train on"
    ) in err


# --- eval.num_samples=0 with a val file that repeats nothing: avg@1, warned of -----------------

AIME_DEDUP = Path(__file__).resolve().parents[2] / "shared/data/aime-2024-dedup30/aime-2024.parquet"


def test_num_samples_0_on_a_val_file_without_repeats_warns_of_avg_at_1(setup, capsys):
    tmp_path, model, train, val = setup
    args = [
        "train",
        "--dry-run",
        *overrides(*setup, "data.on_long_prompt=skip"),
        "eval.num_samples=0",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "val 2 problems x 1 samples" in captured.out
    assert (
        f"dapo: warning: eval.num_samples=0 takes k from the val file's repeats, and {val} "
        "repeats none of its 2 problems: evaluation is avg@1 over 2 problems (one sample each "
        "at eval.temperature=1); set eval.num_samples=32 for the paper's avg@32\n"
    ) in captured.err
    # k given, or a val file that repeats each problem (k = its repeats): no warning.
    assert main([*args[:-1], "eval.num_samples=1"]) == 0
    assert "avg@1" not in capsys.readouterr().err
    repeated = tmp_path / "rep.jsonl"
    repeated.write_text(2 * (json.dumps({"question": SHORT[0], "answer": "2"}) + "\n"))
    skip = "data.on_long_prompt=skip"
    assert main(["train", "--dry-run", *overrides(tmp_path, model, train, repeated, skip)]) == 0
    assert "avg@1" not in capsys.readouterr().err


@pytest.mark.skipif(not AIME_DEDUP.is_file(), reason="../shared/data is absent")
def test_the_deduplicated_aime_file_is_warned_of(setup, capsys):
    tmp_path, _, train, val = setup
    model = save_model(tmp_path / "m2k", "qwen2", context=2048)  # AIME's prompts: up to 537
    args = [*overrides(tmp_path, model, train, AIME_DEDUP, "data.on_long_prompt=skip")]
    args += ["eval.num_samples=0", "reward.mode=dapo"]
    assert main(["train", "--dry-run", *args]) == 0
    captured = capsys.readouterr()
    assert "val 30 problems x 1 samples" in captured.out
    assert "repeats none of its 30 problems: evaluation is avg@1 over 30 problems" in captured.err


# --- the memory plan of a recipe: the longest prompt its run can get ---------------------------

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_a_recipes_plan_takes_the_longest_prompt_its_context_leaves(capsys):
    from dapo import memory_plan

    planned = {r: memory_plan.recipe_plan(RECIPES / r)["prompt_tokens"] for r in PLANNED}
    assert planned == PLANNED
    assert memory_plan.main(["--config", str(RECIPES / "dapo-qwen2.5-math-1.5b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "Qwen2.5-Math-1.5B on 1 x 80 GB (79.19 GiB usable), prompts of 1024 tokens: " in out
    assert "64.86 GiB generating" in out  # 384 rows x (1024 + 3072) tokens of KV cache: 42 GiB
    row = memory_plan.recipe_plan(RECIPES / "dapo-qwen2.5-math-1.5b.yaml", prompt_tokens=512)
    assert (row["prompt_tokens"], row["kv_cache_gib"]) == (512, 36.75)  # --prompt-tokens 512


PLANNED = {
    "dapo-qwen2.5-math-1.5b.yaml": 1024,  # context 4096 - L_max 3072
    "dapo-qwen2.5-math-1.5b-48gb.yaml": 1024,
    "dapo-qwen2.5-0.5b-24gb.yaml": 2048,  # context 32768: memory_plan.PROMPT_TOKENS
    "dapo-qwen2.5-7b.yaml": 2048,
    "demo.yaml": 484,  # the embedded model's 512 positions - 28
    "demo-long.yaml": 472,
    "smollm2-135m-tools.yaml": 256,  # hardware.prompt_tokens
}


# --- dapo data make: the output's directories created, as dapo model import does ------------


def test_data_make_creates_the_outputs_directories(tmp_path, capsys):
    dst = tmp_path / "fresh" / "data" / "code-easy-train.jsonl"  # neither directory exists
    args = ["data", "make", "code-easy", str(dst), "--count", "3", "--seed", "0"]
    assert main(args) == 0
    assert f"wrote 3 code-easy problems to {dst}" in capsys.readouterr().out
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["data_source"] for r in rows] == ["code"] * 3
    # An unknown file type is refused before anything is created.
    assert main(["data", "make", "code-easy", str(tmp_path / "other" / "x.txt")]) == 2
    assert "unknown output file type '.txt'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    # A parent that is a file is still named.
    (tmp_path / "f").write_text("")
    assert main(["data", "make", "code-easy", str(tmp_path / "f" / "x.jsonl")]) == 2
    assert f"directory {tmp_path / 'f'} is a file, not a directory" in capsys.readouterr().err
