"""Data loading at its edges: a reward.mode run on a val file of other data
sources, the recipes on the real DAPO-Math-17k, a shared extra_info.index, a chat template
that raises, colliding flat keys, indices past int64, data.dedup=false and the val file, an
empty data_source, and a conversion whose every row is bad.

The tests on the real files under ../shared/data skip when those are absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import save_model

from dapo.cli import main
from dapo.config import load_config
from dapo.config.setup import DataConfig
from dapo.data.files import DataError, load_problems
from dapo.data.problems import Problem
from dapo.data.prompts import dapo_prompt, render_prompt
from dapo.data.rows import BadRow
from dapo.data.tools import convert_file
from dapo.models.demo import build_tokenizer
from dapo.training.inputs import RunData, check_verifiers, load_run_data

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
DAPO_17K = SHARED / "dapo-math-17k" / "dapo_math_17k.parquet"
AIME = SHARED / "aime-2024" / "aime-2024.parquet"
AIME_DEDUP30 = SHARED / "aime-2024-dedup30" / "aime-2024.parquet"
needs_shared = pytest.mark.skipif(not DAPO_17K.is_file(), reason="../shared/data is absent")


def row(question: str, answer: str, *, index: object = None, source: object = "math_dapo"):
    rec = {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": answer},
    }
    if index is not None:
        rec["extra_info"] = {"index": index}
    return rec


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --- 1. reward.mode grades the val rows too ----------------------------------------------------


def test_reward_mode_needs_no_verifier_for_the_val_rows_data_sources():
    train = [Problem("t", ({"role": "user", "content": "1+1?"},), "2", "math_dapo")]
    val = [Problem("v", ({"role": "user", "content": "2+2?"},), "4", "aime24")]
    with pytest.raises(ValueError, match="aime24"):  # without a mode, the row's own is needed
        check_verifiers(load_config(None, []), RunData(train, val))
    check_verifiers(load_config(None, ["reward.mode=dapo"]), RunData(train, val))


def test_problems_that_never_ask_for_an_answer_line_are_named_under_math_dapo():
    """DAPO-Math-17k's shared copy lost the template: math_dapo grades by an `Answer:` line
    no prompt then asks for, and every response scores -1 unless the model guesses it."""
    bare = [Problem("t", ({"role": "user", "content": "1+1?"},), "2", "math_dapo")]
    val = [Problem("v", ({"role": "user", "content": "2+2?"},), "4", "math_dapo")]
    data = RunData(bare, val)
    check_verifiers(load_config(None, []), data)
    assert (
        len(data.warnings) == 1
        and "none of its 1 problems asks for an `Answer:` line" in (data.warnings[0])
    )
    assert "data.wrap_template=true" in data.warnings[0]
    asked = RunData([Problem("t", ({"role": "user", "content": dapo_prompt("1+1?")},), "2")], val)
    check_verifiers(load_config(None, []), asked)
    told = RunData(bare, val)
    check_verifiers(load_config(None, ['data.system_prompt="End with Answer: N"']), told)
    graded = RunData(bare, val)  # math_verify finds a boxed answer too: no warning
    check_verifiers(load_config(None, ["reward.mode=math_verify"]), graded)
    assert asked.warnings == told.warnings == graded.warnings == []


@pytest.mark.skipif(not AIME_DEDUP30.is_file(), reason="../shared/data is absent")
def test_a_dry_run_with_reward_mode_takes_the_aime24_val_file(tmp_path, capsys):
    model = save_model(tmp_path / "m", "qwen2", context=4096)
    train = jsonl(tmp_path / "train.jsonl", [row("What is 1+1?", "2"), row("2+2?", "4")])
    args = ["train", "--dry-run", f"model.path={model}", f"data.train_file={train}"]
    args += [f"data.val_file={AIME_DEDUP30}", "rollout.max_new_tokens=1024"]
    args += ["algo.l_cache=256", "reward.mode=dapo", f"run.out_dir={tmp_path}"]
    assert main(args) == 0, capsys.readouterr().err
    assert "val: " + str(AIME_DEDUP30) + ": 30 rows, 30 problems" in capsys.readouterr().out


# --- 2. the recipes train on the real DAPO-Math-17k as they are --------------------------------


@needs_shared
def test_the_recipe_dry_runs_on_the_real_files_without_on_bad_row_on_the_command_line(
    tmp_path, capsys
):
    model = save_model(tmp_path / "m", "qwen2", context=8192)
    args = ["train", "--config", str(ROOT / "recipes" / "dapo-qwen2.5-math-1.5b.yaml")]
    args += ["--dry-run", f"model.path={model}", f"run.out_dir={tmp_path}"]
    args += [f"data.train_file={DAPO_17K}", f"data.val_file={AIME}"]
    args += ["data.wrap_template=true"]  # this copy lost the template; no bad row is about it
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"train: {DAPO_17K}: 17917 rows, 17290 problems" in out
    assert "11 bad rows skipped" in out


# --- 3. a shared extra_info.index with another prompt ------------------------------------------


def test_an_index_shared_by_another_prompt_is_a_bad_row_not_a_merge(tmp_path):
    path = jsonl(
        tmp_path / "cat.jsonl",
        [row("What is 1+1?", "2", index=7), row("What is 2+3?", "5", index=7)]
        + [row("What is 1+1?", "2", index=7)],  # a true repeat still merges
    )
    data = load_problems(path, on_bad_row="skip")
    assert [p.answer for p in data.problems] == ["2"] and data.copies == {"7": 2}
    assert data.skipped == [
        BadRow(
            1,
            "extra_info.index",
            "index 7 is also row 0's, whose prompt differs; give each problem its own index",
        )
    ]
    with pytest.raises(DataError, match=r"row 1, field 'extra_info.index': index 7 is also row 0"):
        load_problems(path)


# --- 4. a chat template that raises ------------------------------------------------------------


def test_a_chat_template_that_raises_names_the_problem_and_the_fix():
    tok = build_tokenizer()
    tok.chat_template = (  # Gemma's refusal, as its template spells it
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    problem = Problem("p-17", ({"role": "user", "content": "What is 1+1?"},), "2")
    assert render_prompt(tok, problem) == "What is 1+1?"
    with pytest.raises(ValueError) as err:
        render_prompt(tok, problem, system_prompt="")
    text = str(err.value)
    assert text.startswith("problem p-17: ") and "System role not supported" in text
    assert "data.system_prompt=null" in text and "data.apply_chat_template=false" in text


# --- 5. colliding flat keys --------------------------------------------------------------------


@pytest.mark.parametrize(("question", "answer"), [("q", "q"), ("data_source", "a")])
def test_colliding_flat_keys_are_refused_and_nothing_is_written(tmp_path, question, answer):
    src = jsonl(tmp_path / "in.jsonl", [row("What is 1+1?", "2")])
    dst = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="must be three different columns"):
        convert_file(src, dst, to="flat", question_key=question, answer_key=answer)
    assert not dst.exists()
    flat = jsonl(tmp_path / "flat.jsonl", [{"q": "What is 1+1?", "a": "2"}])
    with pytest.raises(ValueError, match="must be three different columns"):
        load_problems(flat, fmt="flat", question_key=question, answer_key=answer)


def test_the_config_refuses_colliding_flat_keys():
    assert DataConfig(question_key="q", answer_key="a").check() == []
    assert DataConfig(question_key="q", answer_key="q").check() == [
        "data.question_key ('q'), data.answer_key ('q') and 'data_source' must be three "
        "different columns"
    ]
    assert len(DataConfig(answer_key="data_source").check()) == 1


# --- 6. an index past int64 --------------------------------------------------------------------


def test_an_index_past_int64_is_written_to_parquet_as_a_string(tmp_path):
    big = str(2**63)  # one past int64's largest
    src = jsonl(tmp_path / "in.jsonl", [row("1+1?", "2", index=big), row("2+2?", "4", index=3)])
    convert_file(src, tmp_path / "out.parquet", to="dapo")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("extra_info").type.field("index").type == pa.string()
    assert [r["extra_info"]["index"] for r in table.to_pylist()] == [big, "3"]
    # Within the range, the column stays int64, as the official files have it.
    small = jsonl(tmp_path / "s.jsonl", [row("1+1?", "2", index=str(2**63 - 1))])
    convert_file(small, tmp_path / "s.parquet", to="dapo")
    assert pq.read_table(tmp_path / "s.parquet").to_pylist()[0]["extra_info"]["index"] == 2**63 - 1


# --- 7. data.dedup=false leaves the val file merged --------------------------------------------


def test_dedup_false_keeps_train_rows_but_merges_the_val_file(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [row("1+1?", "2")] * 2 + [row("2+2?", "4")])
    val = jsonl(tmp_path / "val.jsonl", [row("3+3?", "6", index=0)] * 4 + [row("1+3?", "4")] * 4)
    files = [f"data.train_file={train}", f"data.val_file={val}", f"model.path={tmp_path}"]
    data = load_run_data(load_config(None, [*files, "data.dedup=false"]))
    assert [p.uid.split("#")[1] for p in data.train] == ["0", "1", "0"]
    assert [p.answer for p in data.val] == ["6", "4"] and data.val_copies == 4
    assert data.notes[1] == f"val: {val}: 8 rows, 2 problems (6 repeated rows merged)"


# --- 8. an empty data_source -------------------------------------------------------------------


def test_an_empty_data_source_falls_back_to_data_data_source(tmp_path):
    path = jsonl(tmp_path / "in.jsonl", [row("1+1?", "2", source=""), row("2+2?", "4")])
    data = load_problems(path, data_source="math_verify")
    assert [p.data_source for p in data.problems] == ["math_verify", "math_dapo"]
    flat = jsonl(tmp_path / "flat.jsonl", [{"question": "1+1?", "answer": "2", "data_source": ""}])
    assert load_problems(flat, data_source="lenient").problems[0].data_source == "lenient"


# --- 9. a conversion whose every row is bad ----------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_converting_a_file_of_only_bad_rows_is_an_error_and_writes_nothing(tmp_path, suffix):
    src = jsonl(tmp_path / "bad.jsonl", [row("1+1?", " "), row("2+2?", "")])
    dst = tmp_path / f"out{suffix}"
    with pytest.raises(DataError) as err:
        convert_file(src, dst, to="flat", on_bad_row="skip")
    assert str(err.value).startswith(f"{src}: none of its 2 rows is usable (2 bad; the first: ")
    assert not dst.exists() and list(tmp_path.iterdir()) == [src]


def test_converting_a_problem_repeated_with_another_answer_is_a_bad_row(tmp_path):
    """`dapo data check` called the later copy bad, and training refused it; convert wrote it
    as one more row."""
    rows = [row("2+2?", "4"), row("2+2?", "5"), row("3+3?", "6"), row("2+2?", "4")]
    src = jsonl(tmp_path / "repeats.jsonl", rows)
    dst = tmp_path / "out.parquet"
    with pytest.raises(
        DataError, match="row 1, field 'reward_model.ground_truth': ground truth '5' "
    ):
        convert_file(src, dst, to="dapo")
    assert not dst.exists()
    result = convert_file(src, dst, to="dapo", on_bad_row="skip")
    assert (result.rows_in, result.rows_out) == (4, 3)  # the same answer again is no conflict
    assert [b.row for b in result.skipped] == [1]
    answers = [r["reward_model"]["ground_truth"] for r in pq.read_table(dst).to_pylist()]
    assert answers == ["4", "6", "4"]
