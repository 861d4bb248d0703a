"""Output places that cannot be written: a path under a file, a file where a directory goes, a
read-only or full disk, a symbolic link, a place another process took meanwhile. Each is named
with its fix (exit status 2, or 1 for a full disk), never a traceback, and nothing half
written is left behind."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from helpers import fake_checkpoint

from dapo.api.export_dir import MARKER, prepare, publish
from dapo.cli import main, path_refused
from dapo.models.demo import (
    TinyModelSpec,
    WarmupSpec,
    build_tokenizer,
    load_embedded,
    save_to_cache,
    tiny_qwen2,
)
from dapo.models.gguf import import_gguf
from dapo.models.write_errors import disk_errno
from dapo.reward.tasks.arith import make_splits

FIX_NOTDIR = "a part of the path is a file, not a directory: give another path"
FIX_EXISTS = "something of that name is in the way: remove it or give another path"


@pytest.fixture()
def a_file(tmp_path):
    path = tmp_path / "ofile"
    path.write_text("mine")
    return path


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_an_out_under_a_file_is_named_with_the_fix(tmp_path, a_file, capsys):
    run = tmp_path / "run"
    fake_checkpoint(run)
    assert main(["ablate", "--plan", "successors", "--out", str(a_file / "ab")]) == 2
    assert _error(capsys) == f"dapo: error: cannot access {a_file / 'ab'}: Not a directory; " + (
        FIX_NOTDIR
    )
    assert main(["export", str(run), "--out", str(a_file / "sub" / "x")]) == 2
    assert _error(capsys) == (
        f"dapo: error: cannot access {a_file / 'sub'}: Not a directory; {FIX_NOTDIR}"
    )
    assert a_file.read_text() == "mine"


def test_an_out_that_is_a_file_is_named_with_the_fix(tmp_path, a_file, capsys):
    run = tmp_path / "run"
    fake_checkpoint(run)
    assert main(["export", str(run), "--out", str(a_file / "x")]) == 2
    assert _error(capsys) == f"dapo: error: cannot create {a_file}: File exists; {FIX_EXISTS}"
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert main(["report", str(run), "--out", str(a_file)]) == 2
    assert _error(capsys) == f"dapo: error: cannot create {a_file}: File exists; {FIX_EXISTS}"
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize(
    ("code", "strerror", "message", "status"),
    [
        (errno.EROFS, "Read-only file system", "cannot write /ro/x: Read-only file system; "
         "give a path on a writable file system", 2),
        (errno.EACCES, "Permission denied", "cannot access /ro/x: Permission denied; check its "
         "permissions (and its directory's), or give another path", 2),
        (errno.ENOSPC, "No space left on device", "cannot write /ro/x: No space left on device; "
         "the disk is full: free space, or give a path on another disk", 1),
    ],
)  # fmt: skip
def test_a_read_only_unreadable_or_full_place_is_named(code, strerror, message, status):
    # Root ignores permissions and a test can mount nothing: the errors as the OS raises them.
    assert path_refused(OSError(code, strerror, "/ro/x")) == (message, status)


def test_an_oserror_about_no_path_the_user_gave_keeps_its_traceback():
    assert path_refused(OSError(errno.EPERM, "landlock_restrict_self")) is None  # no file name
    assert path_refused(OSError(errno.EBADF, "Bad file descriptor", "/x")) is None
    assert path_refused(FileNotFoundError(errno.ENOENT, "No such file", "/x")) is None
    assert path_refused(RuntimeError("a bug")) is None
    own = FileExistsError("--out x exists; choose another or pass --overwrite")
    assert path_refused(own) == ("--out x exists; choose another or pass --overwrite", 2)


SMALL_SPEC = TinyModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)


def test_an_unwritable_demo_cache_warns_and_the_run_goes_on(a_file, capsys):
    pairs = make_splits(4, 1, seed=0)[0]
    model, tokenizer = load_embedded(
        pairs, cache_dir=a_file / "cache", spec=SMALL_SPEC, warmup=WarmupSpec(2, 2), log=print
    )
    assert model.config.hidden_size == 16 and len(tokenizer) == model.config.vocab_size
    err = capsys.readouterr().err.strip()
    assert err == (
        f"dapo: warning: cannot cache the warmed-up demo model at {a_file / 'cache'} (Not a "
        "directory); set embedded.cache_dir to a writable directory"
    )
    assert a_file.read_text() == "mine"


class FullDiskTokenizer:
    """A tokenizer whose save fails as on a full disk: after the model's files are written."""

    def save_pretrained(self, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))


def test_a_cache_entry_that_fails_half_way_leaves_nothing_behind(tmp_path, capsys):
    tokenizer = build_tokenizer()
    model = tiny_qwen2(tokenizer, SMALL_SPEC, seed=0)
    save_to_cache(model, FullDiskTokenizer(), tmp_path / "embedded-abc")
    assert os.listdir(tmp_path) == []  # no entry, and no half-written sibling
    assert capsys.readouterr().err == (
        f"dapo: warning: cannot cache the warmed-up demo model at {tmp_path} (No space left on "
        "device); set embedded.cache_dir to a writable directory\n"
    )
    save_to_cache(model, tokenizer, tmp_path / "embedded-abc")
    saved = set(os.listdir(tmp_path / "embedded-abc"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= saved
    assert os.listdir(tmp_path) == ["embedded-abc"]


def test_model_import_into_a_link_is_refused_before_converting(tmp_path, capsys):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")  # refused before anything reads past the magic
    (tmp_path / "empty").mkdir()
    link = tmp_path / "elink"
    link.symlink_to("empty")
    expected = (
        f"{link} is a symbolic link: dapo model import writes a new directory in its place, "
        f"not through a link; give the directory itself ({tmp_path / 'empty'}) or another OUT_DIR"
    )
    with pytest.raises(ValueError) as refused:
        import_gguf(str(source), link, log=lambda _: None)
    assert str(refused.value) == expected
    assert main(["model", "import", str(source), str(link)]) == 2
    assert _error(capsys) == f"dapo: error: {expected}"
    assert link.is_symlink() and os.listdir(tmp_path / "empty") == []
    assert sorted(os.listdir(tmp_path)) == ["elink", "empty", "model.gguf"]


def _export_written(tmp):
    """What an export writes into its temporary directory (the model files stand in)."""
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    (tmp / MARKER).write_text(json.dumps({"files": ["config.json", MARKER]}))


@pytest.mark.parametrize("appeared", ["another export", "an empty directory", "a file"])
def test_an_out_that_appears_during_an_export_is_not_replaced(tmp_path, appeared):
    out = tmp_path / "same"
    tmp = prepare(out, overwrite=False)  # the check: --out is absent
    _export_written(tmp)
    if appeared == "another export":  # another dapo export to the same --out finished first
        other = tmp_path / ".same.tmp-other"  # another process's temporary directory
        _export_written(other)
        (other / "config.json").write_text('{"theirs": 1}')
        publish(other, out, overwrite=False)
    elif appeared == "an empty directory":
        out.mkdir()
    else:
        out.write_text("mine")
    with pytest.raises(FileExistsError) as refused:
        publish(tmp, out, overwrite=False)
    assert str(refused.value) == (
        f"--out {out} appeared meanwhile (another export or program made it while this one was "
        "written); give another --out, or --overwrite to replace an earlier export"
    )
    if appeared == "another export":
        assert (out / "config.json").read_text() == '{"theirs": 1}'
    elif appeared == "an empty directory":
        assert os.listdir(out) == []
    else:
        assert out.read_text() == "mine"
    assert (tmp / "config.json").is_file()  # left for the export's own clean-up


def test_an_out_absent_at_publish_is_written_and_overwrite_rechecks(tmp_path):
    out = tmp_path / "out"
    tmp = prepare(out, overwrite=False)
    _export_written(tmp)
    publish(tmp, out, overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "config.json").read_text() == "{}"
    tmp = prepare(out, overwrite=True)  # an export: replaceable
    _export_written(tmp)
    (out / "notes.txt").write_text("mine")  # added while the new export was written
    with pytest.raises(FileExistsError, match="holds what dapo export did not write: notes.txt"):
        publish(tmp, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    (tmp / "config.json").write_text('{"new": 1}')
    publish(tmp, out, overwrite=True)
    assert (out / "config.json").read_text() == '{"new": 1}' and not tmp.exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the old export removed


WRITES_PAST_A_SIZE_LIMIT = r"""
import os, resource, signal, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from dapo.models.demo import TinyModelSpec, build_tokenizer, save_to_cache, tiny_qwen2
from dapo.models.write_errors import named_by

root = Path(sys.argv[1])
tokenizer = build_tokenizer()
spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2)
model = tiny_qwen2(tokenizer, spec, seed=0)
# A write past RLIMIT_FSIZE fails with EFBIG, as a full disk fails with ENOSPC: safetensors
# raises its own SafetensorError for it, not an OSError.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
save_to_cache(model, tokenizer, root / "cache" / "embedded-abc")
print(sorted(os.listdir(root / "cache")))
try:
    with named_by(root / "out"):
        save_file({"w": torch.zeros(100_000)}, str(root / ".out.tmp" ))
except OSError as exc:
    print(exc.errno, exc.filename, type(exc.__cause__).__name__)
"""


def test_a_write_past_a_limit_warns_for_the_cache_and_names_the_out_place(tmp_path):
    (tmp_path / "cache").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", WRITES_PAST_A_SIZE_LIMIT, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "dapo: warning: cannot cache the warmed-up demo model at " in done.stderr
    assert "File too large" in done.stderr  # in the words of the safetensors installed
    assert done.stdout.splitlines() == ["[]", f"{errno.EFBIG} {tmp_path / 'out'} SafetensorError"]
    assert path_refused(OSError(errno.EFBIG, "File too large", str(tmp_path / "out"))) == (
        f"cannot write {tmp_path / 'out'}: File too large; a file size limit was reached "
        "(ulimit -f): lift it",
        1,
    )
    copy = OSError(errno.ENOSPC, "No space left on device", "/ckpt/model.safetensors", None, "/o")
    assert path_refused(copy)[0].startswith("cannot write /o: No space left on device")


class SafetensorError(Exception):
    """What safetensors raises for a failed write (its Rust error, no OSError): by name."""


@pytest.mark.parametrize(
    "text",
    [
        "Error while serializing: I/O error: No space left on device (os error 28)",  # >= 0.5
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
        'left on device" })',  # 0.4.3, the floor
    ],
)
def test_a_full_disk_in_safetensors_words_is_read_in_either_version(text):
    assert disk_errno(SafetensorError(text)) == errno.ENOSPC
    assert disk_errno(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
    assert disk_errno(OSError(errno.ENOENT, "No such file", "/x")) is None
