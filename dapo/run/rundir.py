"""The run directory: created, refused or replaced, and checked before any model is loaded.

A run directory holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``model/``,
``summary.json`` and ``samples.jsonl`` (the last two written here too), and two files of
dapo's own: ``.dapo-run``, the mark that dapo created it (``--overwrite`` deletes nothing
without it, and nothing in it that dapo did not write), and ``.dapo-lock``, held by the
process that runs in it (:mod:`dapo.run.lock`). Every check runs before the (possibly long)
model load, so a typo in a path or a full disk costs seconds, not the minutes of loading a
32B model; and every check of the command runs before an earlier run is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from dapo.config import Config, dump_yaml
from dapo.run.checkpoint import CKPT_DIR
from dapo.run.lock import LOCK_NAME, RunLock
from dapo.run.nofollow import LinkRefused, no_link, open_binary, write_atomic

MARK = ".dapo-run"
"""Written when dapo creates a run directory: --overwrite deletes nothing without it."""
# What dapo writes at the top of a run directory (and ".<name>.tmp" while writing one).
OWN_ENTRIES = (
    MARK,
    LOCK_NAME,
    ".write-test",
    "config.yaml",
    "metrics.jsonl",
    "tensorboard",
    CKPT_DIR,
    "model",
    "summary.json",
    "samples.jsonl",
    "val_problems.json",
    "wandb",
    "report",  # dapo report RUN_DIR without --out
)
RUN_MARKERS = ("config.yaml", "metrics.jsonl", CKPT_DIR)  # a run, marked or from before marks
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in (MARK, *RUN_MARKERS))


def holds_a_run(path: Path) -> bool:
    """Whether files only dapo writes are in ``path`` (its mark, metrics.jsonl,
    checkpoints/): a run's directory, not a folder of the user's holding a config.yaml."""
    return any((path / m).exists() for m in (MARK, *RUN_MARKERS) if m != "config.yaml")


def is_own_entry(name: str) -> bool:
    """Whether dapo writes a top-level entry of this name into a run directory."""
    name = name.removeprefix(".").removesuffix(".tmp") if name.endswith(".tmp") else name
    if name.startswith("config.before-resume-") and name.endswith(".yaml"):
        return True
    return name in OWN_ENTRIES


@dataclass
class NewRun:
    """Where a new run goes, decided before anything on disk changes (:func:`plan_new_run`),
    then made (:func:`start_new_run`); an earlier run it replaces is moved aside and removed
    only once the new run has started (:func:`finish_replacing`), or put back
    (:func:`undo_new_run`)."""

    path: Path
    replaces: bool = False
    aside: Path | None = None
    lock: RunLock | None = None
    created: bool = False  # this process made the directory (else it was there, empty)


def plan_new_run(cfg: Config, *, overwrite: bool = False) -> NewRun:
    """The directory of a new run, checked: free, or (with ``overwrite``) holding a run that
    dapo created and nothing else. Changes nothing on disk."""
    name = cfg.run.name or f"{cfg.run.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.run.out_dir).expanduser() / name
    if run_dir.is_symlink():
        raise ValueError(f"run directory {run_dir} is a symbolic link; choose another run.name")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} is a file; choose another run.name")
    above = next((p for p in run_dir.parents if p.exists() or p.is_symlink()), None)
    if above is not None and not above.is_dir():  # the run could never be created there
        raise ValueError(
            f"run.out_dir={cfg.run.out_dir}: {above} is a file, not a directory; choose "
            "another run.out_dir"
        )
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if not entries:
        return NewRun(run_dir)
    if not is_run_dir(run_dir):
        raise ValueError(
            f"run directory {run_dir} is not empty and holds no dapo run; choose another "
            "run.name or run.out_dir (dapo never deletes what it did not write)"
        )
    if not overwrite:
        raise FileExistsError(
            f"run directory {run_dir} already holds a run; continue it with "
            f"`dapo train --resume {run_dir}`, replace it with --overwrite, or pick another "
            "run.name"
        )
    if not (run_dir / MARK).is_file():
        raise ValueError(
            f"--overwrite: {run_dir} has no {MARK} mark, so dapo did not create it (or a dapo "
            "from before runs were marked did) and will not delete it. It holds: "
            f"{_listing(entries)}. Delete it yourself if it is an old run you no longer need, "
            "or pick another run.name"
        )
    foreign = [e for e in entries if not is_own_entry(e)]
    if foreign:
        raise ValueError(
            f"--overwrite: {run_dir} holds files dapo did not write: {_listing(foreign)}. Move "
            "them out of it first (dapo deletes only what it wrote), or pick another run.name"
        )
    return NewRun(run_dir, replaces=True)


def _listing(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def start_new_run(plan: NewRun) -> Path:
    """Create the run directory of ``plan``, marked and locked for this process. An earlier
    run it replaces is locked (refused while another process uses it) and moved aside."""
    run_dir = plan.path
    if plan.replaces:
        old_lock = RunLock(run_dir).acquire()
        plan.aside = run_dir.with_name(f".{run_dir.name}.replaced-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(run_dir, plan.aside)
        finally:
            old_lock.release()
        print(f"dapo: the earlier run in {run_dir} is kept at {plan.aside} until this one starts")
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            run_dir.mkdir()
            plan.created = True
        except FileExistsError:
            if not run_dir.is_dir():
                raise
            # Empty when planned: the user's, or another run's by now (the lock decides).
    except OSError as exc:
        undo_new_run(plan)
        raise ValueError(
            f"cannot create run directory {run_dir}: {exc.strerror}; set run.out_dir to a "
            "writable place"
        ) from exc
    try:
        check_writable(run_dir)
        plan.lock = RunLock(run_dir).acquire()
        mark = {"run_id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_atomic(run_dir / MARK, json.dumps(mark) + "\n")
    except Exception:
        undo_new_run(plan)
        raise
    return run_dir


def finish_replacing(plan: NewRun) -> None:
    """The new run has started: remove the run it replaced (only dapo's own entries)."""
    if plan.aside is None:
        return
    aside, plan.aside = plan.aside, None
    if all(is_own_entry(p.name) for p in aside.iterdir()):
        shutil.rmtree(aside)
    else:  # something appeared in it meanwhile: keep it for its owner
        print(f"dapo: warning: {aside} holds files dapo did not write; it was kept")


def undo_new_run(plan: NewRun) -> None:
    """The new run failed before it started: remove what it wrote (its directory, when it
    made it) and put the run it replaced back. A directory it found stays, and nothing of a
    run whose lock it did not hold is touched (two runs started at once under one name)."""
    held, run_dir = plan.lock is not None, plan.path
    if plan.lock is not None:
        plan.lock.release()
        plan.lock = None
    own = run_dir.is_dir() and all(is_own_entry(p.name) for p in run_dir.iterdir())
    if held and own and plan.created:
        shutil.rmtree(run_dir)
    elif held and own:  # the user's empty directory: emptied again, kept
        for entry in run_dir.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    elif plan.created and run_dir.is_dir():
        with contextlib.suppress(OSError):  # never locked: removed only if still empty
            run_dir.rmdir()
    if plan.aside is not None and not run_dir.exists():
        os.rename(plan.aside, run_dir)
        plan.aside = None


def existing_run_dir(path: str | Path) -> Path:
    """The directory given to ``--resume``, checked to hold a run."""
    run_dir = Path(path)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(
            f"--resume {run_dir}: not a dapo run directory (no config.yaml); give the directory "
            "that `dapo train` printed as its run directory"
        )
    return run_dir


def check_writable(run_dir: Path) -> None:
    probe = run_dir / ".write-test"
    try:
        with open_binary(probe) as f:  # never through a link
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except LinkRefused:
        raise
    except OSError as exc:
        raise ValueError(
            f"run directory {run_dir} is not writable ({exc.strerror}); fix its permissions or "
            "set run.out_dir to a writable place"
        ) from exc


def estimate_checkpoint_bytes(cfg: Config, weights_dir: Path | None) -> int:
    """About what one checkpoint takes: weights plus AdamW's two moments, in model.param_dtype.

    Estimated from the weight files on disk in ``weights_dir`` (the model's directory, a Hub
    id's snapshot; None for the embedded model, from its shape), so it needs no model in
    memory.
    """
    per_param = DTYPE_BYTES[cfg.model.param_dtype]
    if weights_dir is None:
        h, layers = cfg.embedded.hidden, cfg.embedded.layers
        vocab = 4096  # an upper bound of the word-level demo vocabulary
        params = vocab * h + layers * (4 * h * h + 3 * h * 2 * h)
    else:
        path = weights_dir
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        weights += sum(f.stat().st_size for f in path.glob("*.bin"))
        stored = 2
        try:
            meta = json.loads((path / "config.json").read_text())
            stored = DTYPE_BYTES.get(str(meta.get("torch_dtype") or meta.get("dtype")), 2)
        except (OSError, ValueError):
            pass
        params = weights // stored
    return 3 * params * per_param


def check_space(run_dir: Path, cfg: Config, weights_dir: Path | None) -> None:
    """Refuse to start when the disk cannot hold two checkpoints (the newest being written
    while the previous one is still the safe copy) of the model in ``weights_dir``."""
    need = 2 * estimate_checkpoint_bytes(cfg, weights_dir)
    # A new run's directory does not exist yet: its nearest ancestor is on the same disk.
    where = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < need:
        raise ValueError(
            f"run directory {run_dir} has {free / 2**20:.0f} MiB free, but checkpointing needs "
            f"about {need / 2**20:.0f} MiB (two checkpoints of weights and optimiser state); free "
            f"space or set run.out_dir to a larger disk (train.keep_checkpoints="
            f"{cfg.train.keep_checkpoints} will keep up to {cfg.train.keep_checkpoints + 1} at "
            "once)"
        )


def write_config(run_dir: Path, cfg: Config) -> None:
    """Write ``config.yaml``; a different one already there (a forced resume) is kept aside."""
    path = no_link(run_dir / "config.yaml")
    text = dump_yaml(cfg)
    if path.is_file() and path.read_text() != text:
        k = 1
        while os.path.lexists(run_dir / f"config.before-resume-{k}.yaml"):  # links count
            k += 1
        # A copy, not a move: killed right here, the run must still have a config.yaml.
        with open_binary(run_dir / f"config.before-resume-{k}.yaml", exclusive=True) as f:
            f.write(path.read_bytes())
    write_atomic(path, text)


def write_summary(run_dir: Path, summary: dict[str, float]) -> None:
    """``summary.json``: the run's steps, held-out accuracy at start and end, and time."""
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")


def write_samples(run_dir: Path, step: int, samples: list[dict]) -> None:
    """``samples.jsonl``: a few responses of the final evaluation, for ``dapo report``."""
    text = "".join(json.dumps({"step": step, **x}) + "\n" for x in samples)
    write_atomic(run_dir / "samples.jsonl", text)


def write_val_problems(run_dir: Path, step: int, records: list[dict]) -> None:
    """``val_problems.json``: each held-out problem's accuracy (the mean correctness of its k
    samples) at the final evaluation, by uid, so that runs can be compared problem by problem."""
    doc = {
        "step": step,
        "uid": [r["uid"] for r in records],
        "accuracy": [sum(r["correct"]) / len(r["correct"]) for r in records],
    }
    write_atomic(run_dir / "val_problems.json", json.dumps(doc) + "\n")
