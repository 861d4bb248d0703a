"""Reading a Parquet problem file without letting it decompress into more memory than it
may hold.

Parquet stores a repeated string once, in a column chunk's dictionary, and each row that
holds it as a few bits; compressed, a 64 MiB string of one repeated character is a few
hundred bytes. A 5 KB file whose 16 rows each hold one such string decoded to 1 GiB of Arrow
data and as much again of Python strings (3.3 GB resident) with ``pq.read_table`` and
``to_pylist``, and passed ``dapo data check``. Here every text or binary column is read
dictionary-encoded (each distinct value decoded once), batch by batch, and measured with
pyarrow.compute before any row becomes Python objects:

- a value over ``max_value_bytes`` (the 16 MiB a JSON line may hold) is an error naming
  its row and column;
- a file whose values add up to over ``MAX_DECODED_BYTES`` is an error, checked first on
  the footer's sizes (pages whose compression alone is the bomb) and then batch by batch.

Row groups are read one at a time, so what pyarrow holds before a check is one row group's
dictionaries, a few copies of each (about 270 MB for the 64 MiB value above, where the
whole file took 3.3 GB). The footer is the writer's word: a hand-made file that understates
its page sizes there can still make pyarrow decompress one page (at most 2 GiB) first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dapo.data.progress import Progress

MAX_DECODED_BYTES = 2 * 2**30
"""The most a Parquet problem file may decode to: its text and binary values' bytes plus
VALUE_OVERHEAD per value (a null or a number costs Python at least that) and ROW_OVERHEAD
per row. By this measure the Hub's DAPO-Math-17k (1,791,700 rows: each record 100 times,
the prompt template in every prompt) is about 1.4 GiB, the 17,917-row copy 10 MB; rows like
these cost Python about twice their measure, so a file at the limit already takes some
4 GiB as records, and a crafted file of a few KB is held to this instead of what its
dictionary claims."""

VALUE_OVERHEAD = 8
ROW_OVERHEAD = 200
"""Each row becomes a Python dict of about this many bytes whatever its values: without it a
file of 250 million null rows (490 KB on disk) measured 1.9 GiB and took some 50 GB."""
BATCH_ROWS = 4096
TEXT_TYPES = tuple(
    getattr(pa.types, f"is_{t}", lambda _: False)  # the view types are pyarrow 16+
    for t in ("string", "binary", "large_string", "large_binary", "string_view", "binary_view")
)
LIST_TYPES = tuple(
    getattr(pa.types, f"is_{t}", lambda _: False)
    for t in ("list", "large_list", "fixed_size_list", "list_view", "large_list_view")
)


class ParquetTooLarge(ValueError):
    """A Parquet file whose values are larger than a problem file's; the message names the
    row and column, or the total, and the fix (not the file: the caller prefixes it)."""


def read_parquet(
    path: Path, max_value_bytes: int
) -> tuple[list[dict[str, Any]], list[str], list[tuple[str, str]]]:
    """The records, column names and (column, type) schema of the Parquet file ``path``,
    exactly as ``pq.read_table(path)`` gives them; a ParquetTooLarge before decoding more
    than the limits allow. pyarrow's errors (a file that is no Parquet) pass through."""
    plain = pq.ParquetDataset(path)  # read_table's own reader: its schema, its errors
    meta = plain.fragments[0].metadata
    leaves = [meta.schema.column(i) for i in range(meta.num_columns)]
    check_footer(meta, leaves, max_value_bytes)
    text = [c.path for c in leaves if c.physical_type == "BYTE_ARRAY"]
    fragment = pq.ParquetDataset(path, read_dictionary=text).fragments[0]
    records: list[dict[str, Any]] = []
    total = 0
    progress = Progress(f"reading {path.name}", meta.num_rows)
    for batch in batches(fragment):
        sizes = list(batch_sizes(batch))
        if any(largest > max_value_bytes for _, largest, _ in sizes):
            raise too_long_value(batch, len(records), max_value_bytes)
        total += sum(n for _, _, n in sizes) + ROW_OVERHEAD * batch.num_rows
        if total > MAX_DECODED_BYTES:
            raise too_large(f"by row {len(records) + batch.num_rows - 1}", total)
        # Decoded only now, within the limits; Table.cast: RecordBatch.cast is pyarrow 16+.
        records.extend(pa.Table.from_batches([batch]).cast(plain.schema).to_pylist())
        progress.update(len(records))
    schema = plain.schema
    return records, schema.names, [(f.name, str(f.type)) for f in schema]


def batches(fragment: Any) -> Iterator[pa.RecordBatch]:
    """The fragment's rows in order, a row group at a time: a scan of the whole fragment
    decodes row groups ahead (their dictionaries too) before the first batch is measured."""
    for group in fragment.split_by_row_group():
        yield from group.to_batches(batch_size=BATCH_ROWS, batch_readahead=0, use_threads=False)


def check_footer(meta: Any, leaves: list[Any], max_value_bytes: int) -> None:
    """Refuse, from the footer alone, pages that decompress to more than a file may hold
    and fixed-size values each over ``max_value_bytes``."""
    for column in leaves:
        if column.physical_type == "FIXED_LEN_BYTE_ARRAY" and column.length > max_value_bytes:
            raise ParquetTooLarge(
                f"column {column.path!r} holds values of {column.length:,} bytes each, over "
                f"the {max_value_bytes // 2**20} MiB any problem needs; drop the column"
            )
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            total += chunk.total_uncompressed_size + VALUE_OVERHEAD * chunk.num_values
    total += ROW_OVERHEAD * meta.num_rows
    if total > MAX_DECODED_BYTES:
        raise too_large("by its footer", total)


def too_large(where: str, total: int) -> ParquetTooLarge:
    return ParquetTooLarge(
        f"decodes to over {size(total)} ({where}), more than the {size(MAX_DECODED_BYTES)} a "
        "problem file may hold (a Parquet file whose compression hides its size?); keep only "
        "the columns a problem needs (prompt, reward_model, data_source, extra_info; or the "
        "question and answer), or split it"
    )


def size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def too_long_value(batch: pa.RecordBatch, first_row: int, max_value_bytes: int) -> Exception:
    """The error for the first value of ``batch`` over ``max_value_bytes``, naming its row
    (counted from 0 in the file; ``first_row`` is the batch's first) and column."""
    for r in range(batch.num_rows):
        for column, largest, _ in batch_sizes(batch.slice(r, 1)):
            if largest > max_value_bytes:
                return ParquetTooLarge(
                    f"row {first_row + r}, column {column!r}: a value of {largest / 2**20:.1f} "
                    f"MiB, over the {max_value_bytes // 2**20} MiB any problem needs (JSON "
                    "Lines refuse such lines too); shorten it, or drop the row or the column"
                )
    raise AssertionError("a batch over the limit has no row over it")


def batch_sizes(batch: pa.RecordBatch) -> Iterator[tuple[str, int, int]]:
    """(column path, largest value, decoded bytes) of every leaf column of ``batch``."""
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        yield from leaf_sizes(name, column)


def leaf_sizes(name: str, array: pa.Array) -> Iterator[tuple[str, int, int]]:
    """(path, largest value, decoded bytes) of each leaf under ``array``: text and binary
    values by their lengths, a dictionary's without expanding it (each row's value length is
    looked up), anything else by its fixed width; every value costs VALUE_OVERHEAD more."""
    kind = array.type
    if isinstance(kind, pa.BaseExtensionType):  # arrow.json, arrow.uuid: measure the storage
        yield from leaf_sizes(name, array.storage)
        return
    if pa.types.is_struct(kind):
        for i, child in enumerate(array.flatten()):  # flatten: the slice's rows only
            yield from leaf_sizes(f"{name}.{kind.field(i).name}", child)
        return
    if pa.types.is_map(kind):  # list_flatten has no kernel for maps: as a list of structs
        array = pa.ListArray.from_arrays(array.offsets, array.values)
    if any(is_list(array.type) for is_list in LIST_TYPES):
        yield from leaf_sizes(name, array.flatten())  # flatten: the slice's values only
        return
    values = array.dictionary if pa.types.is_dictionary(kind) else array
    if any(is_text(values.type) for is_text in TEXT_TYPES):
        lengths = pc.binary_length(values)
        if values is not array:
            lengths = pc.take(lengths, array.indices)
        largest = pc.max(lengths).as_py() or 0
        data = pc.sum(lengths).as_py() or 0
    else:
        try:
            largest = max(values.type.bit_width // 8, 1)
        except ValueError:  # no fixed width (a null column): only the overhead
            largest = 0
        data = largest * len(array)
    yield name, largest, data + VALUE_OVERHEAD * len(array)
