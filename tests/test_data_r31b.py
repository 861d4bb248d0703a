"""Data files ``dapo data`` and training refused with a traceback or a wrong reason, or let
through: Parquet values Python cannot hold, view-typed Parquet columns, a corrupted gzip and
lone surrogates in HumanEval, rows ``convert`` wrote though ``check`` lists them, JSON lines
that name a key twice, and a directory or FIFO given as the data file."""

from __future__ import annotations

import datetime
import functools
import gzip
import json
import os
import re
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.cli import main
from dapo.data import convert
from dapo.data.code_rows import humaneval_rows
from dapo.data.files import DataError, load_problems, read_table
from dapo.data.tools import check_file, convert_file


def _refused(capsys, argv: list[str]) -> str:
    """The one stderr line of a ``dapo`` command that exits 2 for its input."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


def _flat(**extra: pa.Array) -> pa.Table:
    return pa.table({"question": ["What is 1+1?", "What is 2+2?"], "answer": ["2", "4"], **extra})


# --- 1. Parquet values Python cannot hold ------------------------------------------------

BAD_UTF8 = pa.array([b"fine", b"caf\xe9"], pa.binary()).view(pa.string())  # no validation
TIME_FIX = "write the column as text or integers (Python's dates end at the year 9999), or drop it"
UTF8_FIX = "re-encode the column as UTF-8 text (or write it as binary), or drop it"


@pytest.mark.parametrize(
    "table, expected",
    [
        (
            _flat(day=pa.array([0, 3_000_000], pa.date32())),
            "row 1, column 'day': its date32[day] value is beyond the dates and times Python "
            f"holds (date value out of range); {TIME_FIX}",
        ),
        (
            _flat(created=pa.array([0, 2**60], pa.timestamp("ms"))),
            "row 1, column 'created': its timestamp[ms] value is beyond the dates and times "
            f"Python holds ({{why}}); {TIME_FIX}",
        ),
        (
            pa.table({"question": BAD_UTF8, "answer": ["2", "4"]}),
            "row 1, column 'question': its string value is not UTF-8 (byte 0xe9 at byte 3); "
            + UTF8_FIX,
        ),
        (
            pa.table(
                {
                    "prompt": [[{"role": "user", "content": "1+1?"}]] * 2,
                    "reward_model": pa.StructArray.from_arrays([BAD_UTF8], ["ground_truth"]),
                }
            ),
            "row 1, column 'reward_model.ground_truth': its string value is not UTF-8 (byte "
            f"0xe9 at byte 3); {UTF8_FIX}",
        ),
    ],
    ids=["date32", "timestamp", "invalid-utf8", "invalid-utf8-nested"],
)
def test_a_parquet_value_python_cannot_hold_names_the_file_row_and_column(
    tmp_path, capsys, table, expected
):
    path = tmp_path / "odd.parquet"
    pq.write_table(table, path)
    with pytest.raises(Exception) as raw:  # what pyarrow gives: no file, row or column named
        pq.read_table(path).to_pylist()
    assert isinstance(raw.value, (OverflowError, UnicodeDecodeError))
    pattern = re.escape(f"{path}: {expected}").replace(re.escape("{why}"), r"[^()]+")
    with pytest.raises(DataError) as caught:  # the training path
        load_problems(path)
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
    assert re.fullmatch("dapo: error: " + pattern, _refused(capsys, ["data", "check", str(path)]))
    dst = tmp_path / "out.jsonl"
    assert re.fullmatch(
        "dapo: error: " + pattern, _refused(capsys, ["data", "convert", str(path), str(dst)])
    )
    assert not dst.exists()


def test_a_parquet_file_of_valid_dates_still_reads_as_python_values(tmp_path):
    path = tmp_path / "dates.parquet"
    pq.write_table(_flat(day=pa.array([0, 2_932_896], pa.date32())), path)  # 9999-12-31
    assert [r["day"] for r in read_table(path).records] == [
        datetime.date(1970, 1, 1),
        datetime.date(9999, 12, 31),
    ]


# --- 5. view and large column types ----------------------------------------------------


def test_view_and_large_columns_read_as_read_table_gives_them(tmp_path):
    path = tmp_path / "views.parquet"
    table = pa.table(
        {
            "question": pa.array(["What is 1+1?", "What is 2+2?"], pa.string_view()),
            "answer": pa.array(["2", "4"], pa.large_string()),
            "raw": pa.array([b"x", b"y"], pa.binary_view()),
            "blob": pa.array([b"a", b"b"], pa.large_binary()),
            "meta": pa.array([{"tag": "p"}, {"tag": "q"}], pa.struct([("tag", pa.string_view())])),
            "tags": pa.array([["u"], ["v", "w"]], pa.list_(pa.string_view())),
            "kv": pa.array([[("k", b"1")], []], pa.map_(pa.string_view(), pa.binary_view())),
        }
    )
    pq.write_table(table, path)
    read = read_table(path)
    expected = pq.read_table(path)
    assert read.records == expected.to_pylist()
    assert read.records[1] == {
        "question": "What is 2+2?",
        "answer": "4",
        "raw": b"y",
        "blob": b"b",
        "meta": {"tag": "q"},
        "tags": ["v", "w"],
        "kv": [],
    }
    assert read.schema == [(f.name, str(f.type)) for f in expected.schema]
    assert ("question", "string_view") in read.schema
    data = load_problems(path)
    assert [(p.messages[0]["content"], p.answer) for p in data.problems] == [
        ("What is 1+1?", "2"),
        ("What is 2+2?", "4"),
    ]


# --- 2. HumanEval: a corrupted gzip, a lone surrogate -------------------------------------


def _humaneval(i: int, **fields: str) -> dict[str, str]:
    row = {
        "task_id": f"T/{i}",
        "prompt": f'def f{i}(x):\n    """Return x."""\n',
        "entry_point": f"f{i}",
        "test": "def check(c):\n    assert c(1) == 1\n",
    }
    return {**row, **fields}


def test_a_corrupted_humaneval_gzip_cannot_be_read_as_a_truncated_one_cannot(tmp_path, capsys):
    rows = [_humaneval(i, prompt=f'def f{i}(x):\n    """Return x."""\n' * 5) for i in range(20)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0)
    corrupt = tmp_path / "he.jsonl.gz"
    corrupt.write_bytes(data[:40] + bytes(b ^ 0xFF for b in data[40:60]) + data[60:])
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(data[: len(data) // 2])
    for path, why in [
        (corrupt, "Error -3 while decompressing data: invalid bit length repeat"),
        (truncated, "Compressed file ended before the end-of-stream marker was reached"),
    ]:
        expected = f"dapo: error: {path}: cannot be read: {why}"
        assert _refused(capsys, ["data", "check", str(path)]) == expected
        dst = tmp_path / "out.parquet"
        assert _refused(capsys, ["data", "convert", str(path), str(dst)]) == expected
        assert not dst.exists()


SURROGATE = (
    "holds a lone surrogate (U+D800 at character {at}), which is not text; the file's writer "
    "split a character: fix its encoding"
)


def test_a_lone_surrogate_in_a_humaneval_row_is_a_bad_row(tmp_path, capsys):
    src = tmp_path / "he.jsonl"
    rows = [_humaneval(0), _humaneval(1, prompt='def f1(x):\n    """\ud800"""\n'), _humaneval(2)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))  # ASCII: "\\ud800"
    at = humaneval_rows(src)[1]["prompt"][0]["content"].index("\ud800")
    bad = f"row 1, field prompt: {SURROGATE.format(at=at)}"
    capsys.readouterr()
    assert main(["data", "check", str(src)]) == 1
    out = capsys.readouterr().out
    assert f"bad rows: 1 (skipped)\n  {bad}\n" in out and "distinct problems: 2" in out
    dst = tmp_path / "out.jsonl"
    assert _refused(capsys, ["data", "convert", str(src), str(dst)]) == (
        f"dapo: error: {src}: row 1, field 'prompt': {SURROGATE.format(at=at)}; fix it, or "
        "pass --on-bad-row skip to leave such rows out"
    )
    assert main(["data", "convert", str(src), str(dst), "--on-bad-row", "skip"]) == 0
    assert f"wrote 2 of 3 rows (humaneval -> dapo) to {dst}" in capsys.readouterr().out
    written = [json.loads(line)["extra_info"]["index"] for line in dst.read_text().splitlines()]
    assert written == ["T/0", "T/2"]


# --- 3. convert leaves out exactly the rows check lists ---------------------------------


def _code_row(index: str, prompt: str, truth: str) -> dict:
    return {
        "data_source": "code",
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "code",
        "reward_model": {"ground_truth": truth, "style": "execution"},
        "extra_info": {"index": index},
    }


def _check_and_convert(src: Path, tmp_path: Path, capsys) -> tuple[list[str], list[str], Path]:
    """(the bad rows check lists, the rows convert --on-bad-row skip skipped, its output)."""
    listed = [str(b) for b in check_file(src).bad_rows]
    dst = tmp_path / "out.jsonl"
    with pytest.raises(DataError, match=re.escape(f"{src}: {listed[0].split(',')[0]}, field")):
        convert_file(src, dst)
    assert not dst.exists()
    result = convert_file(src, dst, on_bad_row="skip")
    assert result.rows_out + len(result.skipped) == result.rows_in
    capsys.readouterr()
    assert main(["data", "check", str(dst)]) == 0  # what convert wrote, check finds usable
    assert "bad rows: 0" in capsys.readouterr().out
    return listed, [str(b) for b in result.skipped], dst


def test_convert_skips_the_humaneval_rows_check_lists(tmp_path, capsys):
    src = tmp_path / "he.jsonl"
    rows = [_humaneval(0), _humaneval(1), _humaneval(0, prompt="def g(x):\n"), _humaneval(2)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    listed, skipped, dst = _check_and_convert(src, tmp_path, capsys)
    assert (
        listed
        == skipped
        == [
            "row 2, field extra_info.index: index T/0 is also row 0's, whose prompt differs; give "
            "each problem its own index"
        ]
    )
    written = [json.loads(line)["extra_info"]["index"] for line in dst.read_text().splitlines()]
    assert written == ["T/0", "T/1", "T/2"]


def test_convert_skips_the_code_rows_whose_ground_truth_check_lists(tmp_path, capsys):
    good = json.dumps({"entry_point": "f", "tests": "assert f(1) == 1\n", "prelude": ""})
    src = tmp_path / "code.jsonl"
    rows = [
        _code_row("a", "Write f.", "not JSON"),
        _code_row("b", "Write g.", good),
        _code_row("a", "Write f.", "not JSON"),  # a copy of row 0: as unusable
        _code_row("c", "Write h.", json.dumps({"entry_point": "h", "tests": "assert (\n"})),
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    field = "field reward_model.ground_truth"
    not_json = 'not JSON: expected {"entry_point": NAME, "tests": CODE}'
    listed, skipped, dst = _check_and_convert(src, tmp_path, capsys)
    assert (
        listed
        == skipped
        == [
            f"row 0, {field}: {not_json}",
            f"row 2, {field}: {not_json}",
            f"row 3, {field}: tests do not parse as Python (line 1): '(' was never closed",
        ]
    )
    assert [json.loads(line) for line in dst.read_text().splitlines()] == [
        {"question": "Write g.", "answer": good, "data_source": "code"}
    ]
    capsys.readouterr()
    assert main(["data", "check", str(src)]) == 1
    out = capsys.readouterr().out
    assert "code ground truths checked by the task's own rules: 3" in out
    assert "distinct problems: 1" in out and "bad rows: 3 (skipped)" in out


def test_convert_checks_the_ground_truths_by_the_data_source_it_writes(tmp_path):
    src = tmp_path / "flat.jsonl"
    src.write_text(json.dumps({"question": "Write f.", "answer": "not JSON"}) + "\n")
    dst = tmp_path / "out.parquet"
    assert convert_file(src, dst).rows_out == 1  # math_dapo grades any text
    dst.unlink()
    with pytest.raises(DataError, match=r"row 0, field 'answer': not JSON: expected"):
        convert_file(src, dst, data_source="code")
    assert not dst.exists()
    # dapo.data.convert itself knows no task: without the rules it converts the row.
    assert convert.convert_file(src, dst, data_source="code").rows_out == 1


# --- 4. a JSON line that names a key twice ----------------------------------------------


@pytest.mark.parametrize(
    "line, key",
    [
        ('{"question": "1+1?", "answer": "2", "answer": "3"}', "answer"),
        (
            '{"prompt": [{"role": "user", "content": "1+1?"}], '
            '"reward_model": {"ground_truth": "2", "ground_truth": "3"}}',
            "ground_truth",
        ),
    ],
)
def test_a_json_line_naming_a_key_twice_is_a_bad_row(tmp_path, capsys, line, key):
    path = tmp_path / "dup.jsonl"
    good = '{"question": "2+2?", "answer": "4"}' if key == "answer" else None
    if good is None:
        good = json.dumps(
            {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}
        )
    path.write_text(good + "\n" + line + "\n")
    reason = f"line 2 names the key {key!r} twice in one object; keep one of its values"
    with pytest.raises(DataError) as caught:
        load_problems(path)
    assert str(caught.value) == (
        f"{path}: row 1, field '(row)': {reason}; fix it, or pass data.on_bad_row=skip "
        "(--on-bad-row skip) to skip and count such rows"
    )
    capsys.readouterr()
    assert main(["data", "check", str(path)]) == 1
    assert f"bad rows: 1 (skipped)\n  row 1, field (row): {reason}\n" in capsys.readouterr().out


def test_a_humaneval_line_naming_a_key_twice_is_refused(tmp_path, capsys):
    src = tmp_path / "he.jsonl"
    src.write_text(
        json.dumps(_humaneval(0)) + "\n" + json.dumps(_humaneval(1))[:-1] + ', "test": "x"}\n'
    )
    assert _refused(capsys, ["data", "check", str(src)]) == (
        f"dapo: error: {src}: line 2 names the key 'test' twice in one object; keep one of its "
        "values"
    )


# --- 6. a directory or a FIFO given as the data file ------------------------------------


def test_a_directory_given_as_the_data_file_is_named_one(tmp_path, capsys):
    parts = tmp_path / "train.parquet"  # as Spark and datasets write a table
    parts.mkdir()
    for k in range(2):
        pq.write_table(_flat(), parts / f"part-{k}.parquet")
    split = tmp_path / "split=train"
    split.mkdir()
    (split / "data.jsonl").write_text("")
    empty = tmp_path / "empty.jsonl"
    empty.mkdir()
    for path, example in [
        (parts, "part-*.parquet"),
        (split, "data.jsonl"),
        (empty, "part-*.parquet"),
    ]:
        expected = (
            f"{path}: is a directory; give a file (one of its {example}, say): a data file is "
            "one Parquet or JSON Lines file"
        )
        with pytest.raises(DataError) as caught:
            load_problems(path)
        assert str(caught.value) == expected
        assert _refused(capsys, ["data", "check", str(path)]) == f"dapo: error: {expected}"
    assert _refused(capsys, ["data", "check", str(parts), "--format", "humaneval"]) == (
        f"dapo: error: {parts}: is a directory; give a file (one of its part-*.parquet, say): "
        "a data file is one Parquet or JSON Lines file"
    )


def _within(seconds: float, fifo: Path, call) -> object:
    """``call()``'s result, failing if it has not returned within ``seconds`` (an open() of
    ``fifo`` waiting for a writer: then one comes, so that the thread ends)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"still reading the FIFO after {seconds} s")
    return result[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_given_as_the_data_file_is_named_one_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    expected = f"{fifo}: is not a regular file (a FIFO); give a data file"
    with pytest.raises(DataError) as caught:
        load_problems(fifo)
    assert str(caught.value) == expected
    for flags in ([], ["--format", "humaneval"]):  # no open(): it would wait for a writer
        capsys.readouterr()
        argv = ["data", "check", str(fifo), *flags]
        assert _within(30, fifo, functools.partial(main, argv)) == 2
        assert capsys.readouterr().err == f"dapo: error: {expected}\n"
    with pytest.raises(DataError, match="no such data file"):  # a missing file still is one
        load_problems(tmp_path / "missing.jsonl")
