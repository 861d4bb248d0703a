"""Where ``dapo export`` writes: a temporary directory beside ``--out``, renamed over it when
whole; an earlier export there replaced only when it holds nothing but what dapo export
wrote (its ``dapo-export.json`` lists every file), so that ``--overwrite`` deletes no
user's files."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
from pathlib import Path

from dapo import __version__
from dapo.reward.sandbox_runs import process_alive
from dapo.run import manifest
from dapo.run.checkpoint import CKPT_DIR
from dapo.run.nofollow import fsync_dir, no_link

TMP_PREFIX = ".%s.tmp-"
"""The name of an export's temporary directory beside ``--out`` NAME, before its pid."""
MARKER = "dapo-export.json"
"""What an export holds besides the model: where it came from; ``--overwrite`` replaces only
a directory that has one."""
EXPORT_FILES = {
    MARKER, "config.json", "generation_config.json", "model.safetensors.index.json",
    "adapter_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
    "tokenizer.model",
}  # fmt: skip
"""The files besides its weights that an export whose marker lists none may hold."""

TEMPLATES_DIR = "additional_chat_templates"
"""The one directory an export holds: the tokenizer's named chat templates beside its default
(``*.jinja``, as ``save_pretrained`` writes them)."""


def prepare(out: Path, overwrite: bool, run_dir: Path | None = None) -> Path:
    """The temporary directory the export is written into, beside ``out``; ``out`` checked
    to be absent, or (``overwrite``) a directory ``dapo export`` wrote, and outside the
    checkpoints of ``run_dir`` (the run exported)."""
    no_link(out)
    if run_dir is not None:
        check_outside_checkpoints(out, run_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; choose another or pass --overwrite")
    if out.exists():
        check_replaceable(out)
    return no_link(out.with_name(f"{TMP_PREFIX % out.name}{os.getpid()}"))


def check_outside_checkpoints(out: Path, run_dir: Path) -> None:
    """A ValueError unless ``out`` lies outside ``run_dir``'s checkpoints (links resolved):
    a file there that a checkpoint's manifest does not list makes the checkpoint not whole,
    and the next export or resume passes over it."""
    root = Path(os.path.realpath(run_dir / CKPT_DIR))
    if Path(os.path.realpath(out)).is_relative_to(root):
        raise ValueError(
            f"--out {out} is inside the run's {CKPT_DIR}/ ({root}): files written there make "
            f"its checkpoint not whole (the next export or resume passes over it); give an "
            f"--out outside {root}"
        )


def make_parents(out: Path) -> list[Path]:
    """``out``'s missing parent directories, made, as a list of those made: an export that
    fails removes them again (:func:`remove_made`), so a refused one leaves nothing."""
    missing = []
    for parent in out.parents:
        if parent.exists():
            break
        missing.append(parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    return missing


def remove_made(dirs: list[Path]) -> None:
    """The directories :func:`make_parents` made, deepest first, where they are still empty."""
    for made in dirs:
        with contextlib.suppress(OSError):
            made.rmdir()


def remove_stale(out: Path) -> None:
    """The temporary directories beside ``out`` of earlier exports to it whose process is
    gone (killed: SIGKILL or an out-of-memory kill leaves a model's weights there), and this
    process's own from an earlier call."""
    prefix = TMP_PREFIX % out.name
    for entry in out.parent.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name.removeprefix(prefix)
        if not pid.isdigit() or entry.is_symlink() or not entry.is_dir():
            continue
        # this process's own (an earlier export of it to the same --out) counts as gone
        if int(pid) == os.getpid() or not process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def check_replaceable(out: Path) -> None:
    """``out`` refused unless it holds only what ``dapo export`` wrote there: the files its
    ``dapo-export.json`` lists, or (an export from before that list) only the files an export
    writes, no directory."""
    keep = "it is left as it is: remove it yourself or choose another --out"
    marker = out / MARKER
    if not marker.is_file() or marker.is_symlink():
        raise FileExistsError(
            f"--out {out} exists and was not written by dapo export (no {MARKER}); {keep}"
        )
    try:
        listed = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        raise FileExistsError(f"--out {out}: {marker} is unreadable ({exc}); {keep}") from None
    mine = set(map(str, listed)) if isinstance(listed, list) else None
    foreign = sorted(e.name for e in out.iterdir() if not _written(e, mine))
    if foreign:
        raise FileExistsError(
            f"--out {out} holds what dapo export did not write: {', '.join(foreign[:10])}; "
            f"--overwrite replaces only an export's own files: {keep}"
        )


def _written(entry: Path, mine: set[str] | None) -> bool:
    """Whether ``dapo export`` wrote ``entry`` (a file, or the templates' directory of files),
    by its marker's list ``mine`` (None: an export from before the list, of files alone)."""
    if entry.is_symlink():
        return False
    if entry.is_file():
        return _exported(entry.name) if mine is None else entry.name in mine
    if mine is None or entry.name != TEMPLATES_DIR or not entry.is_dir():
        return False
    return all(
        f.is_file() and not f.is_symlink() and f"{TEMPLATES_DIR}/{f.name}" in mine
        for f in entry.iterdir()
    )


def written_files(tmp: Path) -> list[str]:
    """Every file of the export being written in ``tmp``, by its path there, and the marker."""
    files = [str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file()]
    return sorted([*files, MARKER])


def _exported(name: str) -> bool:
    """Whether an export from before ``dapo-export.json`` listed its files writes ``name``."""
    weights = name.endswith(".safetensors") and name.startswith(("model", "adapter_model"))
    return weights or name in EXPORT_FILES


def publish(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """``tmp`` renamed to ``out``. With ``overwrite``, an export there (checked again: the
    export took minutes, and another may have been published meanwhile) is replaced whole.

    Otherwise ``out`` is claimed with ``os.mkdir``, which fails when anything is there by
    now, and the rename replaces only that empty directory: of two exports to one new
    ``--out`` one wins and the other is refused. (A plain rename would not do: it replaces an
    empty directory that appeared meanwhile.)"""
    no_link(out)
    if overwrite and out.exists():
        check_replaceable(out)
        old = no_link(out.with_name(f".{out.name}.old-{os.getpid()}"))
        os.rename(out, old)
        os.rename(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    appeared = FileExistsError(
        f"--out {out} appeared meanwhile (another export or program made it while this one "
        "was written); give another --out, or --overwrite to replace an earlier export"
    )
    try:
        os.mkdir(out)
    except FileExistsError:
        raise appeared from None
    try:
        os.rename(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            out.rmdir()  # the claim, unless something was put in it (then it is not ours)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise appeared from None
        raise
    fsync_dir(out.parent)


def write_marker(
    tmp: Path,
    run_dir: Path,
    ckpt: Path,
    step: int,
    sharded: bool,
    lora: str | None,
    dtype: str | None,
    stops: tuple[int, ...],
) -> None:
    """``dapo-export.json``: where the export came from, and every file it wrote."""
    provenance = {
        "run": str(run_dir.resolve()),
        "step": step,
        "checkpoint_sha256": manifest.sha256(ckpt / manifest.MANIFEST),
        "sharded": sharded,
        "lora": lora,
        "dtype": dtype or "as stored",
        "stop_token_ids": list(stops),
        "dapo_version": __version__,
        "files": written_files(tmp),
    }
    (tmp / MARKER).write_text(json.dumps(provenance, indent=1) + "\n")
