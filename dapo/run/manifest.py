"""A checkpoint's manifest: every file with its size and SHA-256, written last.

A checkpoint is complete when every file the manifest lists is there at its size (what
finding the latest checkpoint checks: it is fast), and the file that was written when its
SHA-256 matches too (what resuming checks, each rank of a job hashing a share of the files).
A file the manifest does not list, a link, or a path that leads outside the checkpoint makes
it neither.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def write(tmp: Path, format_version: int, step: int, digests: dict[str, str] | None) -> None:
    """The manifest of every file under ``tmp`` (``digests``: the SHA-256 already taken of
    some, by relative path; the others are hashed here)."""
    digests = digests or {}
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(tmp))
            files[rel] = {"bytes": p.stat().st_size, "sha256": digests.get(rel) or sha256(p)}
    text = json.dumps({"format_version": format_version, "step": step, "files": files}, indent=1)
    (tmp / MANIFEST).write_text(text + "\n")


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks of 16 MiB."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def manifest_files(ckpt: Path) -> dict[str, dict[str, Any]] | str:
    """The manifest's files, ``{relative path: {"bytes": n, "sha256": hex}}`` (format 1 gave
    sizes alone), or why they cannot be read."""
    path = ckpt / MANIFEST
    if not path.is_file() or path.is_symlink():
        return f"{ckpt} has no {MANIFEST}"
    try:
        files = json.loads(path.read_text())["files"]
        return {str(r): e if isinstance(e, dict) else {"bytes": int(e)} for r, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return f"{path} is unreadable: {exc}"  # RecursionError: nested deeper than json reads


def verify(ckpt: Path, *, digests: bool | tuple[int, int] = False) -> str | None:
    """None if ``ckpt`` is complete (every manifest file present at its size, and with
    ``digests`` of its SHA-256), else why not. ``digests=(k, n)``: only every n-th file from
    the k-th has its digest checked (each of n ranks takes a share). Files whose every digest
    matched in this process, unchanged since (:func:`_unchanged`), are not hashed again."""
    if Path(ckpt).is_symlink():
        return (
            f"{ckpt} is a link: a checkpoint is a directory of the run, never a link to one "
            "(it could lead outside the run); put the directory it leads to in its place"
        )
    files = manifest_files(ckpt)
    if isinstance(files, str):
        return files
    link = _first_link(ckpt)
    if link is not None:
        return (
            f"{link} is a link: a checkpoint holds only plain files and directories (a link "
            "could lead outside it); copy the checkpoint with the files the links point to"
        )
    extra = sorted(
        str(p.relative_to(ckpt))
        for p in ckpt.rglob("*")
        if not p.is_dir() and str(p.relative_to(ckpt)) not in {*files, MANIFEST}
    )
    if extra:
        return f"{ckpt / extra[0]} is not in the manifest: it was added after the checkpoint"
    for rel, entry in sorted(files.items()):
        path = ckpt / rel
        if not path.resolve().is_relative_to(ckpt.resolve()) or path.is_symlink():
            return f"{path} lies outside the checkpoint (a link, or '..' in the manifest)"
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != entry.get("bytes"):
            return f"{path} is {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}"
    return _check_digests(ckpt, files, digests) if digests else None


_hashed: dict[Path, tuple] = {}
"""The checkpoints whose every file's SHA-256 matched in this process, with what
:func:`_unchanged` saw of their files then: resuming in one process checks every digest
before the model loads, and again as it reads the checkpoint; hashing a large one twice
would cost minutes."""


def _check_digests(
    ckpt: Path, files: dict[str, Any], digests: bool | tuple[int, int]
) -> str | None:
    """Why a file of ``ckpt`` (its share: ``digests``, as :func:`verify` takes it) is not the
    one written, or None."""
    key, seen = Path(ckpt).resolve(), _unchanged(ckpt, files)
    if _hashed.get(key) == seen:
        return None
    for i, (rel, entry) in enumerate(sorted(files.items())):
        mine = digests is True or i % digests[1] == digests[0]
        if mine and sha256(ckpt / rel) != entry.get("sha256"):
            return (
                f"{ckpt / rel} is not the file that was written (its SHA-256 differs from the "
                "manifest's): it was altered or damaged since"
            )
    if digests is True:
        _hashed[key] = seen
    return None


def _unchanged(ckpt: Path, files: dict[str, Any]) -> tuple:
    """What tells a file rewritten or replaced since: each file's (and the manifest's)
    inode, size and modification and change times (a write moves the change time, which no
    program sets back)."""
    stats = [(rel, os.stat(ckpt / rel)) for rel in sorted({*files, MANIFEST})]
    return tuple((r, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for r, s in stats)


def _first_link(ckpt: Path) -> Path | None:
    """The first link under ``ckpt`` (to a file or a directory; none followed), or None."""
    for top, dirs, names in os.walk(ckpt, followlinks=False):
        for name in sorted(dirs) + sorted(names):
            if os.path.islink(os.path.join(top, name)):
                return Path(top) / name
    return None
