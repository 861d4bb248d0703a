"""What dapo writes in a run directory, checked entry by entry before ``--overwrite`` deletes it.

``--overwrite`` removes an earlier run whole, so a file a user put anywhere in it (notes in
``model/``, a checkpoint kept by hand in ``checkpoints/``, other event files in
``tensorboard/``) would go with it. Every entry is checked against what dapo writes there:
at the top, the names of :data:`OWN_ENTRIES`; in ``checkpoints/``, ``step_NNNNNN``
directories holding what their ``manifest.json`` lists, the ``latest`` pointer and the
temporaries of a save; in ``model/``, the files ``save_pretrained`` writes (and those the
checkpoints' ``model/`` list); in ``tensorboard/``, TensorBoard's event files. dapo writes
no symbolic link, so a link anywhere is not its own. The walk stops after
:data:`WALK_LIMIT` entries: a tree that large is refused, not walked for minutes.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from dapo.run import manifest
from dapo.run.lock import LOCK_NAME

CKPT_DIR = "checkpoints"
"""The run directory's checkpoints (:mod:`dapo.run.checkpoint`, which prunes with this module)."""
LATEST = "latest"
"""The file in ``checkpoints/`` naming the newest checkpoint."""
MARK = ".dapo-run"
"""Written when dapo creates a run directory: --overwrite deletes nothing without it."""
PROBE = ".write-test"
"""The start of the name of the file that checks a run directory is writable."""
# What dapo writes at the top of a run directory (and ".<name>.tmp" while writing one).
OWN_ENTRIES = (
    MARK,
    LOCK_NAME,
    PROBE,
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
WALK_LIMIT = 100_000
"""The most entries checked under a run directory before ``--overwrite`` refuses it."""
# save_pretrained's files besides the tokenizer's own (the checkpoints' manifests name those).
MODEL_FILES = frozenset(
    {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"}
    | {"tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json"}
    | {"chat_template.jinja", "chat_template.json", "merges.txt", "tokenizer.model"}
)
TEMPLATES_DIR = "additional_chat_templates"  # the tokenizer's named chat templates, *.jinja
_WEIGHTS = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_STEP = re.compile(r"^step_\d{6,}$")
_PROBE = re.compile(r"^\.write-test(-\d+)?$")
_EVENTS = "events.out.tfevents."  # TensorBoard's SummaryWriter: events.out.tfevents.<time>...
# What a checkpoint without a readable manifest may hold at its top (the rest is not checked).
STEP_ENTRIES = frozenset(
    {"model", "optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json", "rng"}
    | {"state", "trainer.json", "rollouts.safetensors", manifest.MANIFEST}
)


class TooManyEntries(ValueError):
    """The tree holds more than :data:`WALK_LIMIT` entries; it is not checked further."""


def is_own_entry(name: str) -> bool:
    """Whether dapo writes a top-level entry of this name into a run directory."""
    name = name.removeprefix(".").removesuffix(".tmp") if name.endswith(".tmp") else name
    if name.startswith("config.before-resume-") and name.endswith(".yaml"):
        return True
    return name in OWN_ENTRIES or bool(_PROBE.match(name))


def is_probe(name: str) -> bool:
    """Whether ``name`` is the writability probe's (``.write-test``, ``.write-test-<pid>``)."""
    return bool(_PROBE.match(name))


def foreign_entries(run_dir: Path, limit: int | None = None) -> list[str]:
    """What under ``run_dir`` dapo did not write, by path relative to it, all of it at once
    (a directory of the user's as one entry, not what it holds); [] when all is dapo's.
    Raises :class:`TooManyEntries` past ``limit`` entries (:data:`WALK_LIMIT`)."""
    walk = _Walk(Path(run_dir), WALK_LIMIT if limit is None else limit)
    top = walk.entries(walk.root)
    foreign = [e.name for e in top if e.is_symlink() or not is_own_entry(e.name)]
    # The checkpoints first: their manifests name the tokenizer's files, which model/ holds too.
    try:
        for entry in sorted(top, key=lambda e: e.name != CKPT_DIR):
            if not entry.is_symlink() and is_own_entry(entry.name):
                foreign += walk.check_top(entry)
    except TooManyEntries:
        if not foreign:
            raise
    return sorted(foreign)  # past the limit: what the top level shows is named


def check_replaceable(run_dir: Path) -> None:
    """Refuse to delete ``run_dir`` unless everything in it is dapo's (checked in depth:
    :mod:`dapo.run.own_files`), naming what is not (all of it) and the fix."""
    try:
        foreign = foreign_entries(run_dir)
    except TooManyEntries as exc:
        raise ValueError(
            f"--overwrite: {exc}, more than dapo checks before deleting a run (it deletes only "
            "what it wrote); delete it yourself if you no longer need it, or pick another "
            "run.name"
        ) from None
    if foreign:
        raise ValueError(
            f"--overwrite: {run_dir} holds files dapo did not write: {listing(foreign)}. Move "
            "them out of it first (dapo deletes only what it wrote), or pick another run.name"
        )


_kept_steps: set[Path] = set()
"""The checkpoints pruning kept for what dapo did not write in them, warned of once each."""


def prunable(step_dir: Path) -> bool:
    """Whether pruning may delete the checkpoint ``step_dir``: it holds only what its manifest
    lists (as ``--overwrite`` checks it). A link, or a file or directory a user put in it, is
    not dapo's to delete: the checkpoint is kept, with a warning (once a process) naming it."""
    why = None
    if step_dir.is_symlink():  # rmtree refuses a link anyway: named, not silently kept
        why = "is a link, which dapo never writes"
    else:
        try:
            foreign = _Walk(step_dir, WALK_LIMIT).check_step(str(step_dir))
            why = f"holds files dapo did not write ({listing(foreign)})" if foreign else None
        except (TooManyEntries, OSError) as exc:  # not checked whole: not deleted
            why = f"could not be checked for files dapo did not write ({exc})"
    if why is None:
        return True
    if step_dir not in _kept_steps:
        _kept_steps.add(step_dir)
        print(
            f"dapo: warning: {step_dir} {why}; it was kept, not pruned (train.keep_checkpoints "
            "deletes only what dapo wrote). Move out what is yours and delete the rest "
            f"yourself: rm -rf {shlex.quote(str(step_dir))}",
            file=sys.stderr,
        )
    return False


def listing(names: list[str], most: int = 8) -> str:
    """``names`` joined by commas, the first ``most`` of them."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class _Walk:
    """One bounded walk of a run directory: every entry listed counts against the limit."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root, self.limit, self.left = root, limit, limit
        self.model_files: set[str] = set()  # what the checkpoints' model/ holds, by manifest

    def entries(self, path: Path | str) -> list[os.DirEntry]:
        found = []
        with os.scandir(path) as listing:
            for entry in listing:
                self.left -= 1
                if self.left < 0:
                    raise TooManyEntries(f"{self.root} holds more than {self.limit} entries")
                found.append(entry)
        return sorted(found, key=lambda e: e.name)

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def check_top(self, entry: os.DirEntry) -> list[str]:
        """The foreign paths under the top-level entry ``entry`` (one of dapo's names)."""
        if not entry.is_dir(follow_symlinks=False):
            return []  # a file of dapo's name: its own
        if entry.name == CKPT_DIR:
            return self.check_checkpoints(entry.path)
        if entry.name == "model":
            return self.check_tree(entry.path, self.model_allows)
        if entry.name == "tensorboard":
            return self.check_tree(entry.path, lambda rel, is_dir: rel.startswith(_EVENTS))
        if entry.name.endswith(".tmp"):  # a write of dapo's cut short (.model.tmp): counted
            return self.check_tree(entry.path, lambda rel, is_dir: True)
        return []  # wandb/, report/: their writers' own layouts

    def check_checkpoints(self, path: str) -> list[str]:
        found = []
        for entry in self.entries(path):
            if entry.is_symlink():
                found.append(self.rel(entry.path))
            elif entry.name in (LATEST, f".{LATEST}.tmp") and entry.is_file():
                continue
            elif entry.name.startswith(".tmp-step_") and entry.is_dir():
                found += self.check_tree(entry.path, lambda rel, is_dir: True)  # a save's
            elif _STEP.match(entry.name) and entry.is_dir():
                found += self.check_step(entry.path)
            else:
                found.append(self.rel(entry.path))
        return found

    def check_step(self, path: str) -> list[str]:
        """A checkpoint holds what its manifest lists (without one: the names it may hold)."""
        files = manifest.manifest_files(Path(path))
        if isinstance(files, str):
            return self.check_tree(path, lambda rel, is_dir: rel.split("/")[0] in STEP_ENTRIES)
        listed = {*files, manifest.MANIFEST}
        dirs = {str(Path(f).parent) for f in listed} - {"."}
        dirs |= {str(p) for d in list(dirs) for p in Path(d).parents} - {"."}
        self.model_files |= {f.removeprefix("model/") for f in files if f.startswith("model/")}
        return self.check_tree(path, lambda rel, is_dir: rel in (dirs if is_dir else listed))

    def model_allows(self, rel: str, is_dir: bool) -> bool:
        if rel in self.model_files or any(f.startswith(f"{rel}/") for f in self.model_files):
            return True
        if is_dir:
            return rel == TEMPLATES_DIR
        if rel.startswith(f"{TEMPLATES_DIR}/"):
            return rel.count("/") == 1 and rel.endswith(".jinja")
        return rel in MODEL_FILES or bool(_WEIGHTS.match(rel))

    def check_tree(self, path: str, allows: Callable[[str, bool], bool]) -> list[str]:
        """The entries under ``path`` that ``allows(relative path, is a directory)`` refuses,
        and links (neither looked into)."""
        stack, found = [path], []
        while stack:
            for entry in self.entries(stack.pop()):
                rel = os.path.relpath(entry.path, path)
                is_dir = entry.is_dir(follow_symlinks=False)
                if entry.is_symlink() or not allows(rel, is_dir):
                    found.append(self.rel(entry.path))
                elif is_dir:
                    stack.append(entry.path)
        return found
