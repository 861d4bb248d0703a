"""Command line: ``dapo train | eval | export | data | model | bench | report | ablate``, one
module per command.

With no arguments, ``dapo train`` runs the embedded CPU demo end to end.

Only the standard library at module level, here and in every command module: verifier worker
processes re-run the ``dapo`` console script (multiprocessing's spawn/forkserver do that to a
__main__ script), and each one would otherwise import torch and transformers, seconds per
worker. Building the parser imports the torch-free config (for the choices a flag shares with
a config field, ~60 ms); each command imports everything heavy when it runs.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback

from dapo.cli import ablate, bench, data, export, helptext, model, report, train
from dapo.cli import eval as eval_
from dapo.cli.host import host_refused, import_refused

__all__ = ["build_parser", "main", "parse_args"]


EXIT_STATUS = """\
exit status:
  0    done (dapo data check: every row usable)
  1    the run failed on the way (dynamic sampling exhausted, a non-finite update, a bad
       checkpoint); dapo data check: some rows unusable (listed); dapo ablate: a run of
       the ablation failed (named, its log beside it)
  2    bad settings or input, refused before anything was written (the message names the
       field, file or row, and the fix)
  128+N  stopped by signal N (130: Ctrl-C, 143: SIGTERM): a first signal finishes the step
       and saves a checkpoint; resume with dapo train --resume RUN_DIR"""


def build_parser() -> argparse.ArgumentParser:
    intro = __doc__.split("\n\nOnly the standard library")[0]
    parser = argparse.ArgumentParser(
        prog="dapo", description=intro, epilog=EXIT_STATUS, formatter_class=helptext.Formatter
    )
    parser.add_argument("--version", action="version", version=f"dapo {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (train, bench, data, model, eval_, export, report, ablate):
        command.add_parser(sub)
    helptext.apply(parser)
    return parser


def _version() -> str:
    """The installed distribution's version (the package's own when run from a checkout)."""
    from importlib import metadata

    try:
        return metadata.version("dapo-rl")
    except metadata.PackageNotFoundError:
        from dapo import __version__

        return __version__


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with config overrides (``section.field=value``) allowed anywhere:
    ``dapo train a=b --overwrite c=d`` as well as before or after every flag."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [x for x in extra if "=" in x and not x.startswith("-")]
    if extra and (overrides != extra or not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refused = once_per_rank(args.command)
    if refused is not None:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once a node, not once a rank
            print(f"dapo: error: {refused}", file=sys.stderr)
        return 2  # nothing started: no process group to leave with os._exit
    try:
        from transformers.utils import logging as hf_logging

        from dapo.run.checkpoint import CheckpointError
        from dapo.run.console import ReaderMayLeave
        from dapo.run.interrupt import RunStopped
        from dapo.training.sampling import DynamicSamplingExhausted
        from dapo.training.update import NonFiniteError
    except OSError as exc:  # torch makes its compiler's cache directory as it loads
        print(f"dapo: error: {import_refused(exc)}", file=sys.stderr)
        return 2

    # Loading/saving bars of a tiny model are noise in a log that prints one line per step.
    hf_logging.disable_progress_bar()
    previous = sys.stdout
    if args.command in LONG_COMMANDS and not isinstance(previous, ReaderMayLeave):
        sys.stdout = ReaderMayLeave(previous, args.command)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return failed(2)
    except (DynamicSamplingExhausted, CheckpointError, NonFiniteError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return failed(1)
    except RunStopped as exc:
        print(f"dapo: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        refused = path_refused(exc) or host_refused(exc)
        if refused is not None:
            if refused[0] is not None:
                print(f"dapo: error: {refused[0]}", file=sys.stderr)
            return failed(refused[1])
        if not launched():
            raise
        traceback.print_exc()
        return failed(1)
    finally:
        sys.stdout = previous


WRITABLE = "check its permissions (and its directory's), or give another path"
PATH_ERRORS = {
    errno.EROFS: ("cannot write", 2, "give a path on a writable file system"),
    errno.EACCES: ("cannot access", 2, WRITABLE),
    errno.EPERM: ("cannot access", 2, WRITABLE),
    errno.EEXIST: (
        "cannot create",
        2,
        "something of that name is in the way: remove it or give another path",
    ),
    errno.ENOTDIR: (
        "cannot access",
        2,
        "a part of the path is a file, not a directory: give another path",
    ),
    errno.EISDIR: ("cannot use", 2, "it is a directory where a file is wanted: give a file's path"),
    errno.ENOSPC: (
        "cannot write",
        1,
        "the disk is full: free space, or give a path on another disk",
    ),
    errno.EDQUOT: ("cannot write", 1, "the disk quota is spent: free space, or give another path"),
    errno.EFBIG: ("cannot write", 1, "a file size limit was reached (ulimit -f): lift it"),
}
"""The OSErrors that are about a path the user gave (an output location that is read-only,
taken, under a file, full): errno -> what could not be done, exit status (a full disk stops a
command on the way: 1), the fix. Only these, and only with a file name, lose their traceback:
any other OSError may be a bug, and its traceback is what finds it."""


def path_refused(exc: BaseException) -> tuple[str, int] | None:
    """The message and exit status for ``exc`` when it is a path the user gave that cannot be
    written (``PATH_ERRORS``); a ``FileExistsError`` dapo raised itself (its message names the
    flag and the fix, no file name) as it is; None for anything else."""
    if not isinstance(exc, OSError):
        return None
    if isinstance(exc, FileExistsError) and exc.filename is None:
        return str(exc), 2
    known = PATH_ERRORS.get(exc.errno)
    # A copy or a rename names its destination second: the place that could not be written.
    path = exc.filename2 if exc.filename2 is not None else exc.filename
    if known is None or not isinstance(path, (str, bytes, os.PathLike)):
        return None
    verb, code, fix = known
    return f"{verb} {os.fsdecode(path)}: {exc.strerror}; {fix}", code


LONG_COMMANDS = frozenset({"train", "eval", "ablate"})
"""The commands that go on when their stdout's reader leaves: their results are in files."""

RANKED_COMMANDS = frozenset({"train"})
"""The commands whose ranks under torchrun share one job; any other would run whole on each."""


def once_per_rank(command: str) -> str | None:
    """Why ``command`` may not run here: under a torchrun job of several ranks, each would run
    it whole (two exports into one directory, one of them failing; an evaluation writing its
    files twice at once). None in one process, under torchrun of one rank, or for ``train``.
    The environment is read as :func:`dapo.dist.launched` reads it, without importing torch."""
    if command in RANKED_COMMANDS or not all(
        name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR")
    ):
        return None
    if os.environ["WORLD_SIZE"].strip() == "1":
        return None
    return (
        f"dapo {command} runs in one process; torchrun starts it once per rank (WORLD_SIZE="
        f"{os.environ['WORLD_SIZE']}): run python -m dapo {command} ... (or dapo {command} ...) "
        "without torchrun (only dapo train uses ranks)"
    )


def launched() -> bool:
    """Whether this process is a rank of a torchrun job."""
    from dapo import dist

    return dist.launched()


def before_exit() -> None:
    """What a rank leaving with ``os._exit`` does first, as no finalizer will: the vllm
    engine's temporary directory (its config and LoRA adapters) removed."""
    vllm_process = sys.modules.get("dapo.rollout.vllm_process")
    if vllm_process is not None:
        vllm_process.remove_temporary_dirs()


def failed(code: int) -> int:
    """``code``; a rank of a torchrun job that failed leaves at once instead: its exit would
    destroy its process groups, which waits (up to ``dist.wait_timeout_s``, two hours) for a
    receive still posted to a rank that is waiting on it (a generator rank's next weights),
    and torchrun stops the other ranks only once this one has exited."""
    if launched():
        before_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
