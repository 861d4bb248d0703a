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


class ParquetRefused(ValueError):
    """A Parquet file that is valid Parquet but no problem file; the message names the row
    and column (or the total) and the fix, not the file: the caller prefixes it."""


class ParquetTooLarge(ParquetRefused):
    """A Parquet file whose values are larger than a problem file's."""


class ParquetUndecodable(ParquetRefused):
    """A Parquet value that Python cannot represent: text that is not UTF-8, a date or time
    beyond Python's years 1 to 9999."""


def read_parquet(
    path: Path, max_value_bytes: int
) -> tuple[list[dict[str, Any]], list[str], list[tuple[str, str]]]:
    """The records, column names and (column, type) schema of the Parquet file ``path``,
    exactly as ``pq.read_table(path)`` gives them; a ParquetTooLarge before decoding more
    than the limits allow, a ParquetUndecodable for a value Python cannot hold (where
    ``to_pylist`` raises). pyarrow's errors (a file that is no Parquet) pass through."""
    plain = pq.ParquetDataset(path)  # read_table's own reader: its schema, its errors
    meta = plain.fragments[0].metadata
    leaves = [meta.schema.column(i) for i in range(meta.num_columns)]
    check_footer(meta, leaves, max_value_bytes)
    text = [c.path for c in leaves if c.physical_type == "BYTE_ARRAY"]
    fragment = pq.ParquetDataset(path, read_dictionary=text).fragments[0]
    # A dictionary has no cast to a view type: such columns go through their plain type.
    staged = pa.schema([f.with_type(without_views(f.type)) for f in plain.schema])
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
        table = pa.Table.from_batches([batch])
        if staged != plain.schema:
            table = table.cast(staged)
        records.extend(python_rows(table.cast(plain.schema), len(records)))
        progress.update(len(records))
    schema = plain.schema
    return records, schema.names, [(f.name, str(f.type)) for f in schema]


def without_views(kind: pa.DataType) -> pa.DataType:
    """``kind`` with each string_view and binary_view in it, at any depth, as string and
    binary: the values of a view column are read dictionary-encoded, and pyarrow casts a
    dictionary to its plain type, and that to the view type, but not the one to the other."""
    if getattr(pa.types, "is_string_view", lambda _: False)(kind):
        return pa.string()
    if getattr(pa.types, "is_binary_view", lambda _: False)(kind):
        return pa.binary()
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(without_views(f.type)) for f in kind])
    if pa.types.is_map(kind):
        key, item = kind.key_field, kind.item_field
        return pa.map_(
            key.with_type(without_views(key.type)), item.with_type(without_views(item.type))
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        field = kind.value_field
        make = pa.list_ if pa.types.is_list(kind) else pa.large_list
        return make(field.with_type(without_views(field.type)))
    if pa.types.is_fixed_size_list(kind):
        field = kind.value_field
        return pa.list_(field.with_type(without_views(field.type)), kind.list_size)
    return kind


def python_rows(table: pa.Table, first_row: int) -> list[dict[str, Any]]:
    """``table.to_pylist()``; a ParquetUndecodable naming the row (``first_row`` is the
    table's first, counted from 0 in the file) and column of the first value Python cannot
    hold, where pyarrow raises a bare OverflowError or UnicodeDecodeError naming neither."""
    try:
        return table.to_pylist()
    except (OverflowError, ValueError, pa.ArrowException) as exc:
        for name, column in zip(table.column_names, table.columns, strict=True):
            array = column.combine_chunks()
            for r in range(len(array)):
                try:
                    array[r].as_py()
                except (OverflowError, ValueError, pa.ArrowException) as err:
                    path, kind = value_path(name, array.slice(r, 1))
                    raise undecodable(first_row + r, path, kind, err) from None
        last = first_row + table.num_rows - 1
        raise ParquetUndecodable(
            f"rows {first_row} to {last}: a value cannot be read into Python ({exc}); write "
            "its column as text, or drop it"
        ) from None


def value_path(name: str, array: pa.Array) -> tuple[str, pa.DataType]:
    """The dotted path and type of the leaf of the one-row ``array`` that Python cannot hold
    (``name`` itself when it is not in a struct, or cannot be told)."""
    if pa.types.is_struct(array.type):
        for i, child in enumerate(array.flatten()):  # flatten: the slice's row only
            try:
                child.to_pylist()
            except (OverflowError, ValueError, pa.ArrowException):
                return value_path(f"{name}.{array.type.field(i).name}", child)
    if any(is_list(array.type) for is_list in LIST_TYPES):
        return value_path(name, array.flatten())
    return name, array.type


def undecodable(row: int, column: str, kind: pa.DataType, err: Exception) -> ParquetUndecodable:
    if isinstance(err, UnicodeDecodeError):
        why = (
            f"its {kind} value is not UTF-8 (byte 0x{err.object[err.start]:02x} at byte "
            f"{err.start})"
        )
        fix = "re-encode the column as UTF-8 text (or write it as binary), or drop it"
    elif pa.types.is_temporal(kind):
        why = f"its {kind} value is beyond the dates and times Python holds ({err})"
        fix = (
            "write the column as text or integers (Python's dates end at the year 9999), or drop it"
        )
    else:
        why = f"its {kind} value cannot be read into Python ({err})"
        fix = "write the column as text, or drop it"
    return ParquetUndecodable(f"row {row}, column {column!r}: {why}; {fix}")


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
