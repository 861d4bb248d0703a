"""Tests for dapo.data (files, rows, tools) and ``dapo data``: reading, validating and converting
problem files.

Fixture files are built in tmp_path; the tests on the real files under ../shared/data skip
when those are absent.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.cli.data import add_parser, format_check
from dapo.data.files import DataError, load_problems
from dapo.data.prompts import PROMPT_PREFIX, PROMPT_SUFFIX, dapo_prompt, strip_template
from dapo.data.rows import BadRow
from dapo.data.tools import check_file, convert_file

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
AIME = SHARED_DATA / "aime-2024" / "aime-2024.parquet"
AIME_DEDUP30 = SHARED_DATA / "aime-2024-dedup30" / "aime-2024.parquet"
DAPO_17K = SHARED_DATA / "dapo-math-17k" / "dapo_math_17k.parquet"

# extra_info.index -> ground truth, from ../shared/data/aime-2024/SOURCE.md.
AIME_ANSWERS = {
    0: "45", 1: "116", 2: "540", 3: "468", 4: "385", 5: "23", 6: "371", 7: "33", 8: "104",
    9: "809", 10: "73", 11: "601", 12: "80", 13: "315", 14: "721", 15: "127", 16: "197",
    17: "294", 18: "902", 19: "211", 20: "110", 21: "113", 22: "55", 23: "104", 24: "25",
    25: "204", 26: "236", 27: "480", 28: "321", 29: "699",
}  # fmt: skip


# --- fixtures ----------------------------------------------------------------------------------


def dapo_row(problem, answer, *, index=None, source="math_dapo", wrapped=True):
    content = dapo_prompt(problem) if wrapped else problem
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
    }
    if index is not None:
        row["extra_info"] = {"index": index}
    return row


def write(path: Path, rows: list) -> Path:
    """Parquet through pyarrow, or JSON Lines (any JSON value per line) by the extension."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_cli(argv: list[str]) -> int:
    """``dapo <argv>`` as dapo.cli will dispatch it, with only the data commands."""
    parser = argparse.ArgumentParser(prog="dapo")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture()
def dapo_file(tmp_path):
    rows = [
        dapo_row("What is 1+1?", "2", index=10),
        dapo_row("What is 2+3?", "5", index=11),
        dapo_row("What is 1+1?", "2", index=10),  # a repeat, as in the AIME file
        dapo_row("What is 7-9?", "-2", index=12),
        dapo_row("What is 1+1?", "2", index=10),
    ]
    return write(tmp_path / "train.parquet", rows)


# --- loading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dapo_rows_merge_repeats_by_index(tmp_path, dapo_file, suffix):
    path = dapo_file
    if suffix == ".jsonl":
        path = write(tmp_path / "train.jsonl", pq.read_table(dapo_file).to_pylist())
    data = load_problems(path)
    assert data.fmt == "dapo" and data.rows == 5 and data.skipped == []
    assert [p.uid for p in data.problems] == ["10", "11", "12"]  # first-seen order
    assert data.copies == {"10": 3, "11": 1, "12": 1}
    first = data.problems[0]
    assert first.messages == ({"role": "user", "content": dapo_prompt("What is 1+1?")},)
    assert first.answer == "2" and first.data_source == "math_dapo"
    assert data.problems[2].answer == "-2"


def test_repeats_without_index_merge_by_prompt_and_uid_is_a_hash(tmp_path):
    rows = [dapo_row("Find x.", "3"), dapo_row("Find y.", "4"), dapo_row("Find x.", "3")]
    data = load_problems(write(tmp_path / "a.jsonl", rows))
    assert len(data.problems) == 2 and sorted(data.copies.values()) == [1, 2]
    assert all(re.fullmatch(r"[0-9a-f]{16}", p.uid) for p in data.problems)
    # The same prompt gives the same uid in another file (sampling is seeded by uid).
    again = load_problems(write(tmp_path / "b.parquet", rows[:1]))
    assert again.problems[0].uid == data.problems[0].uid


def test_dedup_false_keeps_every_row(dapo_file):
    data = load_problems(dapo_file, dedup=False)
    assert [p.uid for p in data.problems] == ["10#0", "11#0", "10#1", "12#0", "10#2"]
    assert set(data.copies.values()) == {1}


def test_conflicting_repeat_is_a_bad_row(tmp_path):
    rows = [dapo_row("Find x.", "3", index=0), dapo_row("Find y.", "1"), dapo_row("Find x.", "4")]
    path = write(tmp_path / "c.parquet", rows)
    with pytest.raises(DataError) as err:
        load_problems(path)
    msg = str(err.value)
    assert str(path) in msg and "row 2" in msg and "reward_model.ground_truth" in msg
    assert "differs from row 0's" in msg and "on_bad_row=skip" in msg
    data = load_problems(path, on_bad_row="skip")
    assert [p.answer for p in data.problems] == ["3", "1"] and data.copies["0"] == 1
    assert (
        data.skipped == [BadRow(2, "reward_model.ground_truth", data.skipped[0].reason)]
        and "'4' differs from row 0's '3'" in data.skipped[0].reason
    )


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_flat_rows(tmp_path, suffix):
    rows = [
        {"q": "  What is 6*7?", "a": 42, "data_source": "arith"},
        {"q": "Name the answer.", "a": " x+1 ", "data_source": None},
    ]
    if suffix == ".parquet":  # one type per Parquet column
        rows[0]["a"] = "42"
    path = write(tmp_path / f"flat{suffix}", rows)
    data = load_problems(path, question_key="q", answer_key="a", data_source="mine")
    assert data.fmt == "flat"
    p0, p1 = data.problems
    assert p0.messages == ({"role": "user", "content": "  What is 6*7?"},)
    assert (p0.answer, p0.data_source) == ("42", "arith")
    # As written (the paper's verifier compares a boxed answer to it raw); the default source.
    assert (p1.answer, p1.data_source) == (" x+1 ", "mine")

    if suffix == ".jsonl":  # the answer column is a number in one row, a string in the other
        schema = dict(check_file(path, question_key="q", answer_key="a").schema)
        assert schema == {"q": "string", "a": "mixed: int | string", "data_source": "string"}

    wrapped = load_problems(path, question_key="q", answer_key="a", wrap_template=True)
    assert wrapped.problems[0].messages[0]["content"] == dapo_prompt("  What is 6*7?")
    assert [p.uid for p in wrapped.problems] == [p.uid for p in data.problems]


def test_wrap_template_on_a_dapo_file_never_wraps_twice(tmp_path):
    rows = [
        dapo_row("Raw problem one.", "1", index=0, wrapped=False),
        dapo_row("Wrapped problem two.", "2", index=1, wrapped=True),
        {
            **dapo_row("ignored", "3", index=2),
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Raw problem three."},
            ],
        },
    ]
    data = load_problems(write(tmp_path / "mixed.jsonl", rows), wrap_template=True)
    contents = [p.messages[-1]["content"] for p in data.problems]
    assert contents == [
        dapo_prompt("Raw problem one."),
        dapo_prompt("Wrapped problem two."),
        dapo_prompt("Raw problem three."),
    ]
    assert data.problems[2].messages[0] == {"role": "system", "content": "Be brief."}
    plain = load_problems(write(tmp_path / "mixed.jsonl", rows))
    assert plain.problems[0].messages[0]["content"] == "Raw problem one."


GOOD = dapo_row("Fine.", "1")

# (row written to a JSON Lines file as the second row, field named, a word of the reason)
BAD_DAPO_ROWS = [
    ({**GOOD, "prompt": None}, "prompt", "missing"),
    ({**GOOD, "prompt": "What is 1+1?"}, "prompt", "list of {role, content}"),
    ({**GOOD, "prompt": []}, "prompt", "empty prompt"),
    ({**GOOD, "prompt": [{"role": "user", "content": "  \n"}]}, "prompt", "empty prompt"),
    ({**GOOD, "prompt": [{"role": "user"}]}, "prompt", "message 0"),
    ({**GOOD, "prompt": [{"role": "user", "content": 5}]}, "prompt", "message 0"),
    ({**GOOD, "reward_model": None}, "reward_model", "missing"),
    ({**GOOD, "reward_model": "34"}, "reward_model", "struct"),
    ({**GOOD, "reward_model": {"style": "rule"}}, "reward_model.ground_truth", "missing"),
    ({**GOOD, "reward_model": {"ground_truth": " "}}, "reward_model.ground_truth", "empty answer"),
    ({**GOOD, "reward_model": {"ground_truth": 2.5}}, "reward_model.ground_truth", "float"),
    ({**GOOD, "reward_model": {"ground_truth": True}}, "reward_model.ground_truth", "bool"),
    ({**GOOD, "data_source": 7}, "data_source", "non-empty string"),
    ({**GOOD, "extra_info": {"index": 1.5}}, "extra_info", "index must be"),
    ({**GOOD, "extra_info": [1]}, "extra_info", "struct"),
    ([1, 2], "(row)", "not an object"),
]


@pytest.mark.parametrize(("row", "field", "reason"), BAD_DAPO_ROWS)
def test_bad_dapo_row_names_file_row_and_field(tmp_path, row, field, reason):
    path = write(tmp_path / "bad.jsonl", [GOOD, row, dapo_row("Also fine.", "2")])
    with pytest.raises(DataError) as err:
        load_problems(path, fmt="dapo")
    msg = str(err.value)
    assert msg.startswith(f"{path}: row 1, field '{field}': ")
    assert reason in msg and "on_bad_row=skip" in msg
    data = load_problems(path, fmt="dapo", on_bad_row="skip")
    assert [b.row for b in data.skipped] == [1] and data.skipped[0].field == field
    assert len(data.problems) == 2 and data.rows == 3


def test_invalid_json_line_is_a_bad_row(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n{not json\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(DataError, match=r"row 1, field '\(row\)': line 3 is not valid JSON"):
        load_problems(path)
    data = load_problems(path, on_bad_row="skip")
    assert data.rows == 3 and len(data.problems) == 1 and data.copies == {data.problems[0].uid: 2}


def test_an_integer_beyond_64_bits_is_an_answer_not_a_traceback(tmp_path):
    # pyarrow refuses such an integer (OverflowError); the rows are read as JSON all the same.
    path = write(
        tmp_path / "big.jsonl",
        [{"question": "Big?", "answer": 2**63}, {"question": "Q?", "answer": 3}],
    )
    data = load_problems(path)
    assert [p.answer for p in data.problems] == [str(2**63), "3"]


BAD_FLAT_ROWS = [
    ({"answer": "1"}, "question", "missing"),
    ({"question": 12, "answer": "1"}, "question", "must be a string"),
    ({"question": "   ", "answer": "1"}, "question", "empty prompt"),
    ({"question": "Q?"}, "answer", "missing"),
    ({"question": "Q?", "answer": ""}, "answer", "empty answer"),
    ({"question": "Q?", "answer": [1]}, "answer", "list"),
]


@pytest.mark.parametrize(("row", "field", "reason"), BAD_FLAT_ROWS)
def test_bad_flat_row_names_file_row_and_field(tmp_path, row, field, reason):
    path = write(tmp_path / "bad.jsonl", [{"question": "Ok?", "answer": "3"}, row])
    with pytest.raises(DataError, match=re.escape(f"{path}: row 1, field '{field}': ")) as err:
        load_problems(path)
    assert reason in str(err.value)
    data = load_problems(path, on_bad_row="skip")
    assert len(data.problems) == 1 and [(b.row, b.field) for b in data.skipped] == [(1, field)]


def test_bad_rows_in_parquet(tmp_path):
    rows = [GOOD, {**GOOD, "reward_model": {"ground_truth": None, "style": "x"}}, GOOD]
    rows.append({**GOOD, "prompt": None})
    path = write(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=r"row 1, field 'reward_model.ground_truth': missing"):
        load_problems(path)
    data = load_problems(path, on_bad_row="skip")
    assert [(b.row, b.field) for b in data.skipped] == [
        (1, "reward_model.ground_truth"),
        (3, "prompt"),
    ]
    assert len(data.problems) == 1 and data.rows == 4


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match=r"train\.csv.*\.parquet, \.jsonl, \.json"):
        load_problems(tmp_path / "train.csv")
    with pytest.raises(DataError, match="no such data file$"):
        load_problems(tmp_path / "absent.parquet")
    with pytest.raises(DataError) as caught:
        load_problems("absent.parquet")
    assert str(caught.value) == (
        f"absent.parquet: no such data file (a relative path is read from {Path.cwd()})"
    )
    flat = write(tmp_path / "flat.jsonl", [{"problem": "Q?", "solution": "1"}])
    with pytest.raises(DataError, match="no column 'question', 'answer'.*--question-key"):
        load_problems(flat)
    assert load_problems(flat, question_key="problem", answer_key="solution").rows == 1
    with pytest.raises(DataError, match="no column 'prompt'"):
        load_problems(flat, fmt="dapo")
    with pytest.raises(ValueError, match="data format must be one of"):
        load_problems(flat, fmt="csv")
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        load_problems(flat, on_bad_row="ignore")
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"question": "Q?", "answer": "1"}], indent=1))
    with pytest.raises(DataError, match="array.json: holds a JSON array; write one JSON object"):
        load_problems(array)
    not_parquet = tmp_path / "junk.parquet"
    not_parquet.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match="junk.parquet: cannot be read as Parquet"):
        load_problems(not_parquet)


# --- check -------------------------------------------------------------------------------------


@pytest.fixture()
def messy_file(tmp_path):
    rows = [
        dapo_row("P0", "10", index=0),
        dapo_row("P1", "\\frac{1}{2}", index=1, source="other"),
        dapo_row("P0", "10", index=5),  # a repeat found by its prompt
        dapo_row("P2", "  ", index=2),  # empty answer
        dapo_row("P3", "x^2", index=3, wrapped=False),
        dapo_row("P0", "11", index=0),  # conflicting repeat
        dapo_row(" P3 ", "9", index=4, wrapped=False),  # a whitespace twin of P3
    ]
    return write(tmp_path / "messy.jsonl", rows)


def test_check_file_counts(messy_file):
    s = check_file(messy_file)
    assert (s.fmt, s.rows, s.problems) == ("dapo", 7, 4)
    assert (s.duplicate_rows, s.repeated_problems, s.max_copies) == (1, 1, 2)
    assert s.empty_answers == 1
    assert s.non_integer_answers == 2
    assert s.non_integer_examples == [(1, "\\frac{1}{2}"), (4, "x^2")]
    assert s.data_sources == {"math_dapo": 3, "other": 1} and s.unknown_sources == ["other"]
    assert s.templated == 2 and s.whitespace_twins == 1
    assert [(b.row, b.field) for b in s.bad_rows] == [
        (3, "reward_model.ground_truth"),
        (5, "reward_model.ground_truth"),
    ]
    assert not s.clean and s.prompt_tokens is None
    assert dict(s.schema)["prompt"] == "list<item: struct<role: string, content: string>>"


def test_check_command_prints_figures_and_exit_status(messy_file, dapo_file, capsys):
    assert run_cli(["data", "check", str(messy_file)]) == 1
    out = capsys.readouterr().out
    for line in [
        "rows: 7",
        "distinct problems: 4",
        "duplicate rows: 1 (1 problems appear more than once",
        "empty answers: 1",
        "non-integer answers: 2 (e.g. row 1: '\\\\frac{1}{2}', row 4: 'x^2')",
        "no verifier in dapo.reward.tasks for: other",
        "bad rows: 2 (skipped)",
        "  row 5, field reward_model.ground_truth: ground truth '11' differs from row 0's '10'",
    ]:
        assert line in out, line
    assert run_cli(["data", "check", str(dapo_file)]) == 0
    assert "bad rows: 0" in capsys.readouterr().out


def test_check_prompt_tokens_with_a_local_tokenizer(tmp_path, dapo_file, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    s = check_file(dapo_file, tokenizer=tmp_path / "tok")
    t = s.prompt_tokens
    assert list(t) == ["min", "median", "p90", "p99", "max"]
    assert 0 < t["min"] <= t["median"] <= t["p90"] <= t["p99"] <= t["max"]
    assert "prompt tokens: min " in format_check(s)
    with pytest.raises(ValueError, match="not a directory"):
        check_file(dapo_file, tokenizer=tmp_path / "nowhere")


# --- convert -----------------------------------------------------------------------------------


def test_convert_flat_to_dapo_and_back(tmp_path, capsys):
    flat = write(
        tmp_path / "flat.jsonl",
        [{"question": "What is 2+2?", "answer": 4}, {"question": "Half of 8?", "answer": "4"}],
    )
    out = tmp_path / "dapo.parquet"
    assert run_cli(["data", "convert", str(flat), str(out)]) == 0
    assert "wrote 2 of 2 rows (flat -> dapo)" in capsys.readouterr().out
    rows = pq.read_table(out).to_pylist()
    assert rows[0] == {
        "data_source": "math_dapo",
        "prompt": [{"content": dapo_prompt("What is 2+2?"), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "4", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": 0, "raw_problem": "What is 2+2?"},
    }
    assert load_problems(out).problems[1].messages[0]["content"] == dapo_prompt("Half of 8?")

    back = tmp_path / "back.jsonl"
    result = convert_file(out, back, question_key="problem", data_source="arith")
    assert (result.src_fmt, result.to, result.rows_out) == ("dapo", "flat", 2)
    lines = [json.loads(line) for line in back.read_text().splitlines()]
    assert lines == [
        {"problem": "What is 2+2?", "answer": "4", "data_source": "arith"},
        {"problem": "Half of 8?", "answer": "4", "data_source": "arith"},
    ]


def test_convert_dapo_to_dapo_wraps_raw_problems_once(tmp_path):
    rows = [
        dapo_row("Raw.", "1", index="a", wrapped=False, source="DAPO-17k"),
        dapo_row("Wrapped.", "2", index="b", source="DAPO-17k"),
    ]
    out = tmp_path / "out.jsonl"
    result = convert_file(write(tmp_path / "in.parquet", rows), out, to="dapo")
    assert result.wrapped == 1
    got = [json.loads(line) for line in out.read_text().splitlines()]
    contents = [r["prompt"][0]["content"] for r in got]
    assert contents == [dapo_prompt("Raw."), dapo_prompt("Wrapped.")]
    assert [r["extra_info"] for r in got] == [
        {"index": "a", "raw_problem": "Raw."},
        {"index": "b", "raw_problem": "Wrapped."},
    ]
    assert {r["data_source"] for r in got} == {"math_dapo"}


def test_convert_never_wraps_a_templated_message_twice(tmp_path):
    # The template's start with another end (a trailing newline): kept as it is, as loading
    # keeps it (rows._wrap), where it was once wrapped a second time and counted as unwrapped.
    content = dapo_prompt("Almost.") + "\n"
    row = {**dapo_row("x", "1", index="a"), "prompt": [{"role": "user", "content": content}]}
    out = tmp_path / "out.jsonl"
    result = convert_file(write(tmp_path / "in.jsonl", [row]), out, to="dapo")
    (got,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result.wrapped == 0 and got["prompt"][0]["content"] == content


def test_convert_gives_a_row_without_an_index_one_no_other_row_holds(tmp_path):
    # Row 0 has no index; row 1's own index is "0": the filled-in index may not be "0", or
    # the converted file would hold one problem where the input held two.
    rows = [dapo_row("First.", "1"), dapo_row("Second.", "2", index="0"), dapo_row("Third.", "3")]
    src = write(tmp_path / "in.jsonl", rows)
    assert len(load_problems(src).problems) == 3
    out = tmp_path / "out.jsonl"
    convert_file(src, out, to="dapo")
    got = [json.loads(line)["extra_info"]["index"] for line in out.read_text().splitlines()]
    assert got == ["row-0", "0", "2"] and len(load_problems(out).problems) == 3
    plain = tmp_path / "plain.jsonl"  # no index anywhere: the row numbers, an integer column
    convert_file(
        write(tmp_path / "p.jsonl", [dapo_row("A.", "1"), dapo_row("B.", "2")]), plain, to="dapo"
    )
    assert [json.loads(x)["extra_info"]["index"] for x in plain.read_text().splitlines()] == [0, 1]


def test_convert_refuses_and_creates_nothing_on_error(tmp_path, dapo_file):
    with pytest.raises(ValueError, match="is the input file"):
        run_cli(["data", "convert", str(dapo_file), str(dapo_file)])
    bad = write(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "reward_model": {"ground_truth": ""}}])
    before = sorted(tmp_path.iterdir())
    with pytest.raises(DataError, match=r"bad\.jsonl: row 1, field .* --on-bad-row skip"):
        convert_file(bad, tmp_path / "out.parquet")
    with pytest.raises(DataError, match="unknown output file type '.csv'"):
        convert_file(dapo_file, tmp_path / "out.csv")
    with pytest.raises(DataError, match="does not exist"):
        convert_file(dapo_file, tmp_path / "no" / "out.parquet")
    under = tmp_path / "bad.jsonl" / "out.parquet"  # under a file
    with pytest.raises(DataError, match=r"bad\.jsonl is a file, not a directory$"):
        convert_file(dapo_file, under)
    assert sorted(tmp_path.iterdir()) == before  # no output, no temporary file left
    assert pq.read_table(dapo_file).num_rows == 5  # the input is untouched
    (tmp_path / "evals").mkdir()  # a directory: named as one (it read "unknown file type")
    with pytest.raises(DataError, match="evals: is a directory; give an output file name"):
        convert_file(dapo_file, tmp_path / "evals")
    assert not any((tmp_path / "evals").iterdir())

    result = convert_file(bad, tmp_path / "out.parquet", on_bad_row="skip")
    assert result.rows_out == 1 and [b.row for b in result.skipped] == [1]


def test_strip_template():
    assert strip_template(dapo_prompt("x")) == "x"
    assert strip_template(dapo_prompt("")) == ""
    assert strip_template("x") == "x"
    assert strip_template(PROMPT_PREFIX + "x") == PROMPT_PREFIX + "x"


# --- the real files ----------------------------------------------------------------------------


def need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"{path} is not here (../shared/data is outside the repo)")
    return path


def test_official_aime_file():
    data = load_problems(need(AIME))
    assert data.rows == 960 and len(data.problems) == 30 and data.skipped == []
    assert set(data.copies.values()) == {32}
    assert {int(p.uid): p.answer for p in data.problems} == AIME_ANSWERS
    assert all(re.fullmatch(r"[0-9]+", p.answer) for p in data.problems)
    assert {p.data_source for p in data.problems} == {"math_dapo"}
    # Its prompts are exactly our template around extra_info.raw_problem.
    for row in pq.read_table(AIME).to_pylist():
        assert row["prompt"][0]["content"] == dapo_prompt(row["extra_info"]["raw_problem"])
    # Wrapping what is already wrapped changes nothing.
    assert load_problems(AIME, wrap_template=True).problems == data.problems


def test_aime_dedup30_copy_has_the_same_answers():
    data = load_problems(need(AIME_DEDUP30))
    assert data.rows == 30 and set(data.copies.values()) == {1}
    assert sorted(p.answer for p in data.problems) == sorted(AIME_ANSWERS.values())
    assert data.problems[0].answer == "204"  # 2024 I P1, the Aya walk problem


def test_check_dapo_math_17k():
    s = check_file(need(DAPO_17K))
    assert (s.rows, s.problems) == (17_917, 17_290)
    assert s.non_integer_answers == 0 and s.empty_answers == 0
    assert s.data_sources == {"DAPO-17k": 17_290} and s.unknown_sources == ["DAPO-17k"]
    assert s.templated == 0
    # 627 rows repeat a problem; 11 of them give it another answer than its first copy
    # (e.g. row 10714's 683 against row 5915's -1), so they are reported, not used.
    assert s.duplicate_rows + len(s.bad_rows) == 17_917 - 17_290
    assert len(s.bad_rows) == 11
    assert {b.field for b in s.bad_rows} == {"reward_model.ground_truth"}
    assert all("differs from row" in b.reason for b in s.bad_rows)


def test_convert_dapo_math_17k_rebuilds_official_prompts(tmp_path, capsys):
    src = need(DAPO_17K)
    out = tmp_path / "dapo-math-17k.parquet"
    # Its 11 rows that repeat a problem with another answer are bad rows, as check says.
    with pytest.raises(DataError) as refused:
        run_cli(["data", "convert", str(src), str(out), "--to", "dapo"])
    assert "row 179, field 'reward_model.ground_truth': ground truth '6' differs from row 35" in (
        str(refused.value)
    )
    assert not out.exists() and "pass --on-bad-row skip" in str(refused.value)
    skip = ["--on-bad-row", "skip"]
    assert run_cli(["data", "convert", str(src), str(out), "--to", "dapo", *skip]) == 0
    assert "wrote 17,906 of 17,917 rows" in capsys.readouterr().out
    skipped = {b.row for b in check_file(src).bad_rows}
    original = [r for i, r in enumerate(pq.read_table(src).to_pylist()) if i not in skipped]
    converted = pq.read_table(out).to_pylist()
    assert len(converted) == len(original) == 17_906
    for old, new in zip(original, converted, strict=True):
        raw = old["prompt"][0]["content"]
        assert new["prompt"] == [{"content": PROMPT_PREFIX + raw + PROMPT_SUFFIX, "role": "user"}]
        assert new["data_source"] == "math_dapo" and new["ability"] == "MATH"
        assert new["reward_model"]["ground_truth"] == old["reward_model"]["ground_truth"]
        assert new["extra_info"] == {"index": old["extra_info"]["index"], "raw_problem": raw}
    # The same bytes as the official AIME file's prompts around their raw problems.
    if AIME.is_file():
        aime = pq.read_table(AIME).slice(0, 1).to_pylist()[0]
        raw = aime["extra_info"]["raw_problem"]
        assert aime["prompt"][0]["content"] == PROMPT_PREFIX + raw + PROMPT_SUFFIX


def test_a_dapo_file_without_reward_model_names_that_field(tmp_path):
    path = tmp_path / "no_answers.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}]}) + "\n")
    with pytest.raises(DataError) as info:
        load_problems(path)
    message = str(info.value)
    assert "read as dapo format, it has no column 'reward_model'" in message
    assert "reward_model.ground_truth" in message


def test_the_ground_truth_reaches_the_verifier_as_written(tmp_path):
    """The reference grades a \\boxed{} answer against the ground truth unnormalised, and
    normalises an Answer: line's both sides with the same rules: stripping the file's value
    first would change both verdicts."""
    from dapo.reward.tasks.math_dapo import math_score

    path = write(
        tmp_path / "spaced.jsonl",
        [{"question": "q1", "answer": " 12"}, {"question": "q2", "answer": "5 a "}],
    )
    boxed, spaced = load_problems(path, fmt="flat").problems
    assert (boxed.answer, spaced.answer) == (" 12", "5 a ")
    assert not math_score("so \\boxed{12}", boxed.answer).correct  # " 12" != "12", as written
    assert math_score("Answer: 5", spaced.answer).correct  # "5 a " -> "5"
