"""A Parquet problem file is measured before its rows become Python objects
(:mod:`dapo.data.parquet_read`): a small file whose dictionary or compression hides a huge
decoded size is refused, naming the row and column (or the total) and the fix, without the
memory it claims; every other file reads exactly as ``pq.read_table(path).to_pylist()``."""

from __future__ import annotations

import decimal
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.data import parquet_read
from dapo.data.files import MAX_LINE_BYTES, DataError, load_problems, read_table

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REAL_FILES = [
    SHARED_DATA / "dapo-math-17k" / "dapo_math_17k.parquet",
    SHARED_DATA / "aime-2024" / "aime-2024.parquet",
]
MiB = 2**20


def _bomb(path: Path, rows: int, value_bytes: int) -> Path:
    """``rows`` flat rows whose answer is one string of ``value_bytes``, stored once in a
    dictionary: a file of a few KB that decodes to rows * value_bytes (the reviewer's
    bomb, built without the decoded column ever existing here)."""
    answer = pa.DictionaryArray.from_arrays(
        pa.array([0] * rows, pa.int32()), pa.array(["7" * value_bytes], pa.large_string())
    )
    table = pa.table({"question": ["What is 1+1?"] * rows, "answer": answer})
    # No stored Arrow schema: the answer reads back as a plain string column, decoded densely.
    pq.write_table(table, path, compression="zstd", store_schema=False)
    return path


READ_IN_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from dapo.data.files import DataError, read_table
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        read_table(sys.argv[1])
        error = None
    except DataError as exc:
        error = str(exc)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"error": error, "grew_mib": grew / 1024}))
    """
)


def test_a_dictionary_bomb_is_refused_before_it_is_decoded(tmp_path):
    path = _bomb(tmp_path / "bomb.parquet", rows=64, value_bytes=20 * MiB)
    assert path.stat().st_size < 10_000  # 1.25 GiB of answers once decoded
    done = subprocess.run(
        [sys.executable, "-c", READ_IN_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout)
    assert result["error"] == (
        f"{path}: row 0, column 'answer': a value of 20.0 MiB, over the 16 MiB any problem "
        "needs (JSON Lines refuse such lines too); shorten it, or drop the row or the column"
    )
    # Reading it whole took 2.6 GB (Arrow's copy and Python's); measuring it, the dictionary's
    # one value and a few copies of it.
    assert result["grew_mib"] < 400, result


def test_the_row_and_the_nested_column_of_a_long_value_are_named(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"problem {i}"}],
            "reward_model": {"ground_truth": str(i), "style": "rule"},
        }
        for i in range(10)
    ]
    rows[7]["reward_model"]["ground_truth"] = "1" * (MAX_LINE_BYTES + 1)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "gt.parquet", row_group_size=3)
    rows[7]["reward_model"]["ground_truth"] = "7"
    rows[5]["prompt"].append({"role": "user", "content": "x" * (17 * MiB)})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompt.parquet", row_group_size=4)
    with pytest.raises(DataError) as gt:
        load_problems(tmp_path / "gt.parquet", on_bad_row="skip")
    assert str(gt.value).startswith(
        f"{tmp_path / 'gt.parquet'}: row 7, column 'reward_model.ground_truth': a value of "
        "16.0 MiB, over the 16 MiB"
    )
    with pytest.raises(DataError, match=r"row 5, column 'prompt\.content': a value of 17\.0 MiB"):
        read_table(tmp_path / "prompt.parquet")


def test_a_file_decoding_to_more_than_the_total_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_read, "MAX_DECODED_BYTES", 64 * MiB)
    path = _bomb(tmp_path / "many.parquet", rows=100, value_bytes=MiB)  # 100 MiB decoded
    with pytest.raises(DataError) as err:
        read_table(path)
    assert str(err.value) == (
        f"{path}: decodes to over 100 MiB (by row 99), more than the 64 MiB a problem file "
        "may hold (a Parquet file whose compression hides its size?); keep only the columns "
        "a problem needs (prompt, reward_model, data_source, extra_info; or the question and "
        "answer), or split it"
    )


def test_pages_that_decompress_past_the_total_are_refused_by_the_footer(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_read, "MAX_DECODED_BYTES", 16 * MiB)
    path = tmp_path / "plain.parquet"
    answers = pa.array([str(i) * (4 * MiB) for i in range(6)])  # compressed, 24 MiB plain
    pq.write_table(
        pa.table({"question": ["q"] * 6, "answer": answers}),
        path,
        use_dictionary=False,
        compression="zstd",
    )
    assert path.stat().st_size < 100_000
    with pytest.raises(
        DataError, match=r"plain\.parquet: decodes to over 24 MiB \(by its footer\)"
    ):
        read_table(path)


def test_many_narrow_rows_are_counted_at_what_python_makes_of_them(tmp_path, monkeypatch):
    # Each row is a dict of ~200 bytes whatever it holds: 250 million null rows were a 490 KB
    # file measured at 1.9 GiB (8 bytes a value) that took some 50 GB to read.
    monkeypatch.setattr(parquet_read, "MAX_DECODED_BYTES", 64 * MiB)
    path = tmp_path / "narrow.parquet"
    pq.write_table(pa.table({"nothing": pa.nulls(400_000)}), path, compression="zstd")
    assert path.stat().st_size < 10_000
    # 400,000 x (200 + 8) bytes = 79.3 MiB, over 64 MiB by the footer alone
    with pytest.raises(
        DataError, match=r"narrow\.parquet: decodes to over 79 MiB \(by its footer\)"
    ):
        read_table(path)


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.parent.name)
def test_the_real_files_read_exactly_as_read_table_reads_them(path):
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    table = pq.read_table(path)
    got = read_table(path)
    assert got.records == table.to_pylist()
    assert got.columns == table.column_names
    assert got.schema == [(f.name, str(f.type)) for f in table.schema]


def test_every_column_type_reads_as_read_table_reads_it(tmp_path):
    rows = 3000  # past one dictionary page, in several row groups
    table = pa.table(
        {
            "text": [f"problem {i % 700} " * (i % 50) for i in range(rows)],
            "big": pa.array([f"v{i % 9}" for i in range(rows)], pa.large_string()),
            "bytes": [bytes([i % 256]) * 3 for i in range(rows)],
            "tags": [[f"t{i % 5}", None] if i % 3 else None for i in range(rows)],
            "meta": pa.array(
                [[("k", str(i))] for i in range(rows)], pa.map_(pa.string(), pa.string())
            ),
            "nested": [{"a": {"b": f"x{i}"}, "n": i} if i % 4 else None for i in range(rows)],
            "price": pa.array([decimal.Decimal(i) / 100 for i in range(rows)], pa.decimal128(9, 2)),
            "fixed": pa.array([b"ab"] * rows, pa.binary(2)),
            "nothing": pa.nulls(rows),
            "coded": pa.array([f"c{i % 3}" for i in range(rows)]).dictionary_encode(),
        }
    )
    path = tmp_path / "types.parquet"
    pq.write_table(table, path, row_group_size=1100, dictionary_pagesize_limit=4096)
    expected = pq.read_table(path)
    got = read_table(path)
    assert got.records == expected.to_pylist()
    assert got.schema == [(f.name, str(f.type)) for f in expected.schema]
