"""Room on the disk for what a run will write, checked before the model loads: refused when
the next saves cannot fit, warned of when the whole run's cannot (every checkpoint that
``train.keep_checkpoints`` keeps, one more while a save is written, and the final ``model/``).
Sizes: :mod:`dapo.run.save_sizes`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo.config import Config
from dapo.run.save_sizes import (
    ahead_bytes,
    estimate_checkpoint_bytes,
    estimate_model_bytes,
    tree_bytes,
)

__all__ = [
    "RunSpace",
    "check_new_run",
    "check_resume",
    "check_space",
    "checkpoints_on_disk",
    "describe",
    "estimate_checkpoint_bytes",
    "estimate_model_bytes",
    "measure",
    "run_space_warning",
    "saves_left",
    "steps_left",
    "whole_run_bytes",
]


def steps_left(cfg: Config, trainer: dict[str, Any]) -> bool:
    """Whether a resume from the checkpoint whose ``trainer.json`` is ``trainer`` trains a
    step: not when train.steps are done or train.max_gen_tokens or max_seconds spent (as the
    loop decides); then it writes the final ``model/`` alone."""
    t, spent = cfg.train, trainer.get("spent") or {}
    if int(trainer.get("step", 0)) >= t.steps:
        return False
    tokens = t.max_gen_tokens and float(spent.get("gen_tokens", 0.0)) >= t.max_gen_tokens
    seconds = t.max_seconds and float(spent.get("step_seconds", 0.0)) >= t.max_seconds
    return not (tokens or seconds)


@dataclass(frozen=True)
class RunSpace:
    """What a run will write and the room it has, in bytes: :func:`measure`."""

    checkpoint: int
    """One checkpoint (the estimate, or a resume's latest when larger)."""
    ahead: int
    """What each checkpoint of a run that generates ahead holds beyond that (an upper
    bound: :func:`ahead_bytes`); warned of, not refused on."""
    model: int
    """The final ``model/``."""
    saves: int
    """The checkpoints the run writes if it trains to train.steps."""
    existing: int
    """A resume's checkpoints on the disk already."""
    free: int
    """The disk's free bytes, a run that ``--overwrite`` replaces counted as free."""

    def counts(self, keep: int) -> tuple[int, int]:
        """Checkpoints the run adds at most: while a save is written (the newest ``keep``
        beside it: older ones are pruned only after it is safe), and beside the final
        ``model/``."""
        return _added(self.saves, self.existing, keep)

    def on_disk(self, keep: int) -> tuple[int, int]:
        """Checkpoints on the disk at most, those there already included: while a save is
        written, and beside the final ``model/`` (the newest ``keep``, once pruned)."""
        return checkpoints_on_disk(self.saves, self.existing, keep)

    def need(self, keep: int, *, ahead: bool = True) -> int:
        """The most the run holds at once with train.keep_checkpoints=``keep``."""
        checkpoint = self.checkpoint + (self.ahead if ahead else 0)
        return whole_run_bytes(
            checkpoint, self.model, saves=self.saves, keep=keep, existing=self.existing
        )


def measure(
    run_dir: Path,
    cfg: Config,
    weights_dir: Path | None,
    *,
    step: int = 0,
    existing: int = 0,
    finishing: bool = False,
    latest: Path | None = None,
    freed: int = 0,
    prompt_tokens: int = 0,
) -> RunSpace:
    """The run's :class:`RunSpace`: at ``step`` (a resume's) with ``existing`` checkpoints on
    the disk, the newest ``latest`` (the next is taken to be at least its size: it holds what
    no estimate sees exactly, such as the rollouts drawn ahead); ``finishing``, a resume with no
    step left; ``freed``, what a replaced run (``--overwrite``) frees before the first save;
    ``prompt_tokens``, the longest prompt (for the rollouts drawn ahead)."""
    t = cfg.train
    saves = 0 if finishing else saves_left(step, t.steps, t.save_every)
    checkpoint = estimate_checkpoint_bytes(cfg, weights_dir) if saves else 0
    ahead = ahead_bytes(cfg, prompt_tokens) if saves else 0
    if saves and latest is not None:
        checkpoint = max(checkpoint, tree_bytes(latest))
        ahead = 0  # the latest checkpoint holds its own
    model = estimate_model_bytes(cfg, weights_dir)
    free = _free_bytes(run_dir) + freed
    return RunSpace(checkpoint, ahead, model, saves, existing, free)


def check_new_run(
    run_dir: Path,
    cfg: Config,
    weights_dir: Path | None,
    *,
    freed: int = 0,
    prompt_tokens: int = 0,
) -> tuple[RunSpace, str | None]:
    """A new run's :func:`check_space`, then its room and the whole run's warning (None when
    it fits); ``freed``: what the run it replaces (``--overwrite``) frees before its first
    save, ``prompt_tokens``: its longest prompt."""
    space = measure(run_dir, cfg, weights_dir, freed=freed, prompt_tokens=prompt_tokens)
    _refuse_without_room(space, run_dir, cfg, resume=False)
    return space, run_space_warning(space, run_dir, cfg)


def check_resume(
    run_dir: Path, cfg: Config, weights_dir: Path | None, trainer: dict[str, Any], latest: Path
) -> str | None:
    """A resume's :func:`check_space` (with no step left it writes the final ``model/``
    alone: room for a checkpoint is not asked), then the whole run's warning, counting the
    checkpoints beside ``latest``; ``trainer``: its ``trainer.json``."""
    from dapo.run import checkpoint

    finishing, step = not steps_left(cfg, trainer), int(trainer.get("step", 0))
    existing = len(checkpoint.step_dirs(latest.parent))
    space = measure(
        run_dir, cfg, weights_dir, step=step, existing=existing, finishing=finishing, latest=latest
    )
    _refuse_without_room(space, run_dir, cfg, resume=True)
    return None if finishing else run_space_warning(space, run_dir, cfg)


def check_space(
    run_dir: Path,
    cfg: Config,
    weights_dir: Path | None,
    *,
    resume: bool = False,
    finishing: bool = False,
    latest: Path | None = None,
    step: int = 0,
    freed: int = 0,
) -> None:
    """Refuse to start when the disk cannot hold what any train.keep_checkpoints writes:
    a new run, two checkpoints (the newest being written while the previous one is still the
    safe copy), or one and the final ``model/`` (which follows the last save); a resume,
    whose latest checkpoint is on the disk already, one more, or the final ``model/``;
    ``finishing``, a resume with no step left, the final ``model/`` alone. A run that writes a
    single checkpoint needs one and the final ``model/``. Arguments: :func:`measure` (a
    resume's checkpoints on the disk taken as its latest alone)."""
    space = measure(
        run_dir,
        cfg,
        weights_dir,
        step=step,
        existing=1 if resume else 0,
        finishing=finishing,
        latest=latest,
        freed=freed,
    )
    _refuse_without_room(space, run_dir, cfg, resume=resume)


def _refuse_without_room(space: RunSpace, run_dir: Path, cfg: Config, *, resume: bool) -> None:
    """:func:`check_space`'s refusal, for the run ``space`` measured: the room that
    train.keep_checkpoints=1 needs (the rollouts drawn ahead left out), or a ValueError."""
    need = space.need(1, ahead=False)
    if space.free >= need:
        return
    # A resumed run writes into its own directory: run.out_dir does not move it.
    where_to = (
        "copy the run directory to a larger disk and resume the copy"
        if resume
        else "set run.out_dir to a larger disk"
    )
    keep = cfg.train.keep_checkpoints
    more = (
        f" (train.keep_checkpoints={keep} will keep up to {space.on_disk(keep)[0]} at once)"
        if space.counts(keep)[0] > space.counts(1)[0]
        else ""
    )
    raise ValueError(
        f"run directory {run_dir} has {space.free / 2**20:.0f} MiB free, but "
        f"{'checkpointing' if space.saves else 'finishing the run'} needs about "
        f"{need / 2**20:.0f} MiB ({_what(cfg, space)}); free space or {where_to}{more}"
    )


def saves_left(step: int, steps: int, save_every: int) -> int:
    """How many checkpoints a run at ``step`` writes if it trains every step up to ``steps``:
    one at each multiple of ``save_every`` (0: none) after ``step``, and one after the last
    step unless that is such a multiple."""
    if step >= steps:
        return 0
    if not save_every:
        return 1
    return steps // save_every - step // save_every + (1 if steps % save_every else 0)


def whole_run_bytes(
    checkpoint: int, model: int, *, saves: int, keep: int, existing: int = 0
) -> int:
    """The most the disk must give a run that writes ``saves`` more checkpoints of
    ``checkpoint`` bytes, then its final ``model/`` of ``model`` bytes: the newest ``keep``
    checkpoints stay, one more while a save is written (older ones are pruned only after it is
    safe); ``existing``, the checkpoints a resumed run has on the disk already (a save beside
    them adds one before any is pruned)."""
    during, after = _added(saves, existing, keep)
    return max(during * checkpoint, after * checkpoint + model) if saves else model


def checkpoints_on_disk(saves: int, existing: int, keep: int) -> tuple[int, int]:
    """The most checkpoints on the disk, the ``existing`` ones included, of a run that writes
    ``saves`` more with train.keep_checkpoints=``keep``: while a save is written (the newest
    ``keep`` beside it: older ones are pruned only once it is safe), and beside the final
    ``model/`` (the newest ``keep``)."""
    if saves == 0:
        return existing, existing
    total = existing + saves
    return max(existing + 1, min(keep + 1, total)), min(keep, total)


def _added(saves: int, existing: int, keep: int) -> tuple[int, int]:
    """:func:`checkpoints_on_disk` less the ``existing`` checkpoints: what the run adds."""
    during, after = checkpoints_on_disk(saves, existing, keep)
    return during - existing, max(0, after - existing)


def run_space_warning(space: RunSpace, run_dir: Path, cfg: Config) -> str | None:
    """What to say when the disk holds the next save (:func:`check_space` passed) but not
    everything the run writes if it trains to train.steps (train.max_gen_tokens or
    max_seconds may stop it sooner): every checkpoint train.keep_checkpoints keeps, one more
    during a save, and the final ``model/``; None when it all fits."""
    t, mib = cfg.train, 2**20
    need = space.need(t.keep_checkpoints)
    if space.free >= need:
        return None
    # keep_checkpoints=1 is what check_space asked room for, bar the rollouts drawn ahead.
    fits = [k for k in range(1, t.keep_checkpoints) if space.need(k) <= space.free]
    fix = f"set train.keep_checkpoints={fits[-1]} or free space" if fits else "free space"
    during, after = space.on_disk(t.keep_checkpoints)
    saves = f"{space.saves} more checkpoint{'s' if space.saves != 1 else ''}"
    size = space.checkpoint + space.ahead
    ahead = f", {space.ahead / mib:.0f} of them rollouts drawn ahead" if space.ahead else ""
    return (
        f"run directory {run_dir} has {space.free / mib:.0f} MiB free, but the whole run needs "
        f"about {need / mib:.0f} MiB if it trains to train.steps={t.steps}: {saves} of about "
        f"{size / mib:.0f} MiB{ahead} (train.save_every={t.save_every}); at most {during} "
        f"checkpoints on the disk at once and {after} beside the final model/ of about "
        f"{space.model / mib:.0f} MiB (train.keep_checkpoints={t.keep_checkpoints}). It "
        "starts, and a save that finds the disk full stops it with its last checkpoint "
        f"intact, to resume; to fit, {fix}"
    )


def describe(space: RunSpace, cfg: Config) -> str:
    """The dry run's line on a new run's disk space: a checkpoint's size, the final
    ``model/``'s, the most the whole run holds at once and the disk's free space."""
    keep, mib = cfg.train.keep_checkpoints, 2**20
    ahead = f" (with up to {space.ahead / mib:,.0f} of rollouts drawn ahead)" if space.ahead else ""
    saves = f"{space.saves} save{'s' if space.saves != 1 else ''}"
    return (
        f"disk: a checkpoint about {(space.checkpoint + space.ahead) / mib:,.0f} MiB{ahead}, "
        f"the final model/ about {space.model / mib:,.0f} MiB; the run holds up to "
        f"{space.need(keep) / mib:,.0f} MiB at once ({saves}, train.keep_checkpoints={keep}); "
        f"{space.free / mib:,.0f} MiB free"
    )


def _what(cfg: Config, space: RunSpace) -> str:
    """What :func:`check_space`'s room is needed for, in words."""
    state = "of the adapters and their" if cfg.model.lora.rank else "of weights and"
    dtype = "float32" if cfg.model.lora.rank else cfg.model.param_dtype
    final = f"the final model/ in {dtype}"
    if not space.saves:
        return f"{final}: no step is left to train"
    during, after = space.counts(1)
    if during * space.checkpoint >= after * space.checkpoint + space.model:
        # a new run's two (during a save) outweigh one beside the model/; a resume's one
        count = "one more checkpoint" if space.existing else "two checkpoints"
        return f"{count} {state} optimiser state"
    before = f"a checkpoint {state} optimiser state, then " if after else ""
    return before + final


def _free_bytes(run_dir: Path) -> int:
    """The free bytes of the disk ``run_dir`` is on; a new run's directory does not exist yet,
    and its nearest ancestor is on the same disk."""
    where = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    return shutil.disk_usage(where).free
