"""Crash-safe checkpoints: everything a resumed run needs to repeat the uninterrupted one.

A checkpoint is a directory ``checkpoints/step_NNNNNN`` in the run directory:

- ``model/``: the policy as ``save_pretrained`` writes it (safetensors, loadable by Hugging Face)
  and its tokenizer; when part of the policy is frozen (LoRA's base), only what trains, as
  ``trained.safetensors`` beside the config: the frozen weights are the base model's, which
  ``trainer.json`` names (``base_model``: path and digest);
- ``optimizer.safetensors`` and ``optimizer.json``: the optimiser's tensors, and its settings;
- ``rng.safetensors`` and ``rng.json``: python, numpy and torch (CPU and CUDA) generator states;
- ``trainer.json``: step counters, the prompt-order cursor, the metrics offset, carry-over;
- ``rollouts.safetensors``: with ``train.async_staleness`` or ``dist.rollout_ranks``, the
  rollouts already drawn for the next steps (:mod:`dapo.training.rollout_files`; their JSON
  part is in ``trainer.json``);
- ``manifest.json``: every file with its size and SHA-256, written last.

It is written into a temporary directory, fsynced, renamed into place, and only then is the
``latest`` pointer replaced, so kill -9 at any instant leaves the previous checkpoint whole.
Nothing in a checkpoint is pickled: tensors are safetensors, everything else JSON
(:mod:`dapo.run.state_files`). Resuming checks every file against the manifest's SHA-256, so a
file altered after it was written is named, not read; finding the latest checkpoint checks
sizes only.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from dapo.data.output import plain_mode
from dapo.dist.optim_groups import kernels_kept
from dapo.run import manifest, model_files, state_files
from dapo.run.launcher import nonfinite_refusal
from dapo.run.manifest import verify  # also checkpoint.verify, as callers have named it
from dapo.run.model_files import CheckpointError
from dapo.run.nofollow import fsync_dir, no_link, write_atomic
from dapo.run.own_files import CKPT_DIR, LATEST, prunable  # also checkpoint.CKPT_DIR
from dapo.run.rng_state import capture_rng, restore_rng  # also checkpoint.*, as callers name them
from dapo.run.trainer_file import checked_trainer
from dapo.run.write_failures import export_failed, going_on, write_failure  # also checkpoint.*

FORMAT_VERSION = 2
"""2: nothing pickled (the optimizer's state and the generators' as safetensors and JSON, DCP
shards as safetensors) and a SHA-256 per file in the manifest; 1: dapo before commit 96772cf."""
_STEP_RE = re.compile(r"^step_(\d{6,})$")


ROLLOUTS_FILE = "rollouts.safetensors"
"""With ``train.async_staleness``: the rollouts generated for the steps after the checkpoint."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under ``root``, by step number: past step 999,999 the names
    grow a digit, and step_1000000 sorts before step_999999 as a string."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


# ----------------------------------------------------------------------------- writing


def fsync_tree(root: Path) -> None:
    """Flush the files dapo wrote in ``root`` and the directories, after giving the files the
    mode the umask gives: safetensors writes its files 0600, so that another user could not
    load a model or checkpoint whose other files they could read."""
    mode = plain_mode()
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(d)


def write_pointer(ckpt_root: Path, name: str) -> None:
    write_atomic(ckpt_root / LATEST, name + "\n")


def _check_finite(model: torch.nn.Module, step: int, run_dir: Path) -> None:
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        why = nonfinite_refusal(step, resumable=find_latest(run_dir) is not None, run_dir=run_dir)
        raise CheckpointError(f"{why} (first: {bad[0]})")


def save(
    run_dir: Path,
    *,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
    device: torch.device | None = None,
    rollouts: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically, point ``latest`` at it, keep the newest
    ``keep``; the generators of this process, and of its compute ``device``; ``rollouts``
    (generated ahead of training) as ``rollouts.safetensors``. On any failure the previous
    checkpoint and pointer are left as they were."""
    _check_finite(model, step, Path(run_dir))
    root = no_link(Path(run_dir) / CKPT_DIR)
    root.mkdir(exist_ok=True)
    name = step_dir_name(step)
    final = no_link(root / name)
    tmp = no_link(root / f".tmp-{name}-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        model_files.save(model, tokenizer, tmp / "model")
        state_files.save_optimizer(optimizer.state_dict(), tmp / "optimizer")
        state_files.save_rng(capture_rng(device), tmp / "rng")
        if rollouts is not None:
            save_file(rollouts, tmp / ROLLOUTS_FILE)
        trainer = {"format_version": FORMAT_VERSION, "step": step, **trainer_state}
        (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1) + "\n")
        publish(tmp, final, step)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(write_failed(run_dir, step, exc)) from exc
    prune(root, keep=keep, protect=name)
    return final


def write_failed(run_dir: Path, step: int, exc: Exception, what: str = "") -> str:
    """The message of a checkpoint (or of ``what``: another file of the run, metrics.jsonl)
    that could not be written (``exc``: why): the checkpoint left as it was, and the fix for
    that cause, naming the run's oldest checkpoints when deleting them frees space."""
    previous = read_pointer(run_dir)
    kept = f"the previous checkpoint {previous} is intact" if previous else "no checkpoint yet"
    older = older_than(previous) if previous is not None else []
    what = what or f"the checkpoint of step {step} under {Path(run_dir) / CKPT_DIR}"
    return (
        f"could not write {what}: {write_failure(exc)}; {kept}. "
        f"{going_on(run_dir, exc, previous, older)}"
    )


def older_than(ckpt: Path) -> list[Path]:
    """The checkpoints of the run before ``ckpt``, oldest first: what a resume from ``ckpt``
    does without."""
    found = _STEP_RE.match(ckpt.name)
    if found is None or not ckpt.parent.is_dir():
        return []
    return [d for d in step_dirs(ckpt.parent) if int(d.name[5:]) < int(found.group(1))]


def publish(tmp: Path, final: Path, step: int, digests: dict[str, str] | None = None) -> None:
    """The last moves of a save: the manifest of every file in ``tmp`` (its size and SHA-256;
    ``digests``: those already taken, by file), written last, an fsync, the rename to
    ``final`` (replacing a step re-run after a resume whole), and the ``latest`` pointer."""
    manifest.write(tmp, FORMAT_VERSION, step, digests)
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    write_pointer(final.parent, final.name)


def prune(root: Path, *, keep: int, protect: str) -> None:
    """Delete what precedes the newest ``keep`` complete checkpoints (each only when it holds
    nothing but what its manifest lists: :func:`own_files.prunable`), and stale temporaries."""
    steps = step_dirs(root)
    complete = [i for i, d in enumerate(steps) if d.name == protect or verify(d) is None]
    for old in steps[: complete[-keep] if len(complete) >= keep else 0]:
        if old.name != protect and prunable(old):
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):  # a save's, as save names them; nothing else
        shutil.rmtree(stale, ignore_errors=True)


# ----------------------------------------------------------------------------- reading


def refuse_links(path: Path) -> None:
    """Refuse a checkpoint's directory, ``checkpoints/`` or ``latest`` (``path``: any entry of
    ``checkpoints/``) when it, or the ``checkpoints/`` holding it, is a symbolic link: what a
    link leads to is another directory's (another run's, anyone's), and the next save there
    would be refused (:mod:`dapo.run.nofollow`). The error names the link and the fix."""
    root = path.parent
    if root.name == CKPT_DIR and root.is_symlink():
        link, fix = root, f"put the directory it leads to in its place: {_put_back(root)}"
    elif path.is_symlink() and path.name == LATEST:
        quoted = shlex.quote(str(path))
        link, fix = path, f"remove it (rm {quoted}): the newest whole checkpoint is then used"
    elif path.is_symlink():
        link = path
        fix = (
            f"put the directory it leads to in its place ({_put_back(path)}), or move the "
            f"link out of {root} to use the checkpoint before it"
        )
    else:
        return
    raise CheckpointError(
        f"{link} is a symbolic link: dapo reads no checkpoint through a link (it could lead "
        f"outside the run); {fix}"
    )


def _put_back(link: Path) -> str:
    """The commands that put the directory ``link`` leads to in its place."""
    link_q, target = shlex.quote(str(link)), shlex.quote(str(link.resolve()))
    return f"rm {link_q} && mv {target} {link_q}"


def read_pointer(run_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, None without one; a link for ``checkpoints/`` or
    ``latest`` is refused (:func:`refuse_links`): followed, it would read another run's."""
    pointer = Path(run_dir) / CKPT_DIR / LATEST
    refuse_links(pointer)
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    # Only a checkpoint of this run: a pointer edited to lead elsewhere is ignored.
    return pointer.parent / name if _STEP_RE.match(name) else None


def find_latest(run_dir: Path) -> Path | None:
    """The checkpoint ``latest`` points to; if that one is not whole (sizes checked, not
    digests), the newest complete one. A link for ``checkpoints/``, ``latest`` or a step's
    directory is refused, naming it (:func:`refuse_links`)."""
    root = Path(run_dir) / CKPT_DIR
    pointed = read_pointer(run_dir)
    if not root.is_dir():
        return None
    steps = step_dirs(root)
    for step in steps:
        refuse_links(step)
    if pointed is not None and pointed.is_dir() and verify(pointed) is None:
        return pointed
    for ckpt in reversed(steps):
        if verify(ckpt) is None:
            return ckpt
    return None


def unreadable(run_dir: Path) -> str:
    """When :func:`find_latest` found nothing: what is wrong with the newest checkpoint (the
    one ``latest`` names, else the newest step) and the fix; "" when none was written."""
    root = Path(run_dir) / CKPT_DIR
    steps = step_dirs(root) if root.is_dir() else []
    pointed = read_pointer(run_dir)
    newest = pointed if pointed is not None and pointed.is_dir() else (steps or [None])[-1]
    why = None if newest is None else verify(newest)
    if why is None:
        return ""
    return (
        f"the newest, {newest.name}, is not whole: {why}. Put back what was written (remove "
        "a file added since, such as .DS_Store), or use an older copy of the run"
    )


def passed_over(run_dir: Path, ckpt: Path) -> str:
    """Why the checkpoint ``latest`` names is not ``ckpt``, the one :func:`find_latest`
    chose (it is not whole); "" when it is."""
    pointed = read_pointer(run_dir)
    if pointed is None or pointed == ckpt or not pointed.is_dir():
        return ""
    return f"{pointed.name}, the newest, was passed over: {verify(pointed)}"


def load(
    ckpt: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device | None = None,
    verified: bool = False,
) -> dict:
    """Restore weights, optimiser and RNG (``device``'s generator too) from ``ckpt``; return
    its trainer state. Every file is checked against the manifest's digest first, unless the
    caller has (``verified``)."""
    trainer = read_trainer_state(ckpt, digests=not verified)
    model_files.load(model, ckpt / "model")
    stem = ckpt / "optimizer"
    try:
        optim = state_files.load_optimizer(stem)
        # State tensors go to their parameters' devices, step counters where AdamW keeps them;
        # the run's config's betas and weight decay stay (kernels_kept).
        with kernels_kept(optimizer):
            optimizer.load_state_dict(optim)
    except state_files.StateFileError as exc:
        raise CheckpointError(str(exc)) from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # torch's, naming no file
        raise damaged(ckpt, state_files.unfit(stem, exc, "this run's optimizer")) from None
    restore_rng_file(ckpt, ckpt / "rng", device)
    return trainer


def restore_rng_file(ckpt: Path, stem: Path, device: torch.device | None = None) -> None:
    """:func:`restore_rng` of the states :func:`state_files.save_rng` wrote as ``stem.*`` in
    the checkpoint ``ckpt``; a state the generators refuse (a list cut short) is an error
    naming the files and the fix, not the generator's own ("state vector is the wrong size")."""
    try:
        state = state_files.load_rng(stem)
    except state_files.StateFileError as exc:
        raise CheckpointError(str(exc)) from None
    try:
        restore_rng(state, device)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        raise damaged(ckpt, state_files.unfit(stem, exc, "the generators")) from None


def damaged(ckpt: Path, problem: str) -> CheckpointError:
    """The error for a checkpoint that cannot be used (``problem``: what is wrong, naming the
    file), with the fix: its directory moved aside, the newest whole one before it is used."""
    ckpt = Path(ckpt)
    step = _STEP_RE.match(ckpt.name)
    steps = step_dirs(ckpt.parent) if step and ckpt.parent.is_dir() else []
    number = int(step.group(1)) if step else 0
    earlier = [d for d in steps if int(d.name[5:]) < number and verify(d) is None]
    fix = (
        f"Move {ckpt.name} out of {ckpt.parent} to use {earlier[-1].name}, the newest whole "
        "checkpoint before it"
        if earlier
        else "Restore it from a copy of the run: no whole checkpoint precedes it"
    )
    return CheckpointError(f"checkpoint {ckpt} is incomplete or altered: {problem}. {fix}")


def read_trainer_state(ckpt: Path, *, digests: bool | tuple[int, int] = True) -> dict:
    """``trainer.json`` of a checkpoint whose every file is the one written (``digests``: as
    :func:`verify` takes it), in this format."""
    refuse_links(Path(ckpt))
    problem = verify(ckpt, digests=digests)
    if problem is not None:
        raise damaged(ckpt, problem)
    try:
        trainer = json.loads((ckpt / "trainer.json").read_text())
        version = trainer.get("format_version")
    except (OSError, ValueError, AttributeError, RecursionError) as exc:  # JSON nested too deep
        raise CheckpointError(f"{ckpt / 'trainer.json'} is unreadable: {exc!r}") from None
    if version == 1:
        raise CheckpointError(
            f"{ckpt} was written by an older dapo (checkpoint format 1, before commit 96772cf), "
            "whose optimizer and generator states are pickled; this dapo reads no pickle from a "
            "checkpoint. Resume it with the dapo that wrote it, or start the run again"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt} has checkpoint format {version}, this dapo reads format {FORMAT_VERSION}"
        )
    return checked_trainer(trainer, ckpt / "trainer.json")


def load_rollouts(ckpt: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``rollouts.safetensors`` (rollouts generated ahead of training); none
    when the checkpoint has no such file."""
    path = Path(ckpt) / ROLLOUTS_FILE
    return model_files.read_tensors(path) if path.is_file() else {}


# ----------------------------------------------------------------------------- outputs


def export_model(
    model: torch.nn.Module,
    tokenizer: Any,
    dest: Path,
    weights: dict[str, torch.Tensor] | None = None,
) -> None:
    """``save_pretrained`` into ``dest`` atomically (an existing ``dest`` is replaced whole);
    ``weights``: the state dict to save in place of the model's own (LoRA's merged one)."""
    no_link(dest)
    tmp = no_link(dest.with_name(f".{dest.name}.tmp"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(export_failed(dest, exc)) from exc
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    fsync_dir(dest.parent)
