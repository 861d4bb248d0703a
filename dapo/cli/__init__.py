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
import os
import sys
import traceback

from dapo.cli import ablate, bench, data, export, helptext, model, report, train
from dapo.cli import eval as eval_

__all__ = ["build_parser", "main", "parse_args"]


EXIT_STATUS = """\
exit status:
  0    done (dapo data check: every row usable)
  1    the run failed on the way (dynamic sampling exhausted, a non-finite update, a bad
       checkpoint); dapo data check: some rows unusable (listed)
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
    from transformers.utils import logging as hf_logging

    from dapo.run.checkpoint import CheckpointError
    from dapo.run.interrupt import RunStopped
    from dapo.training.sampling import DynamicSamplingExhausted
    from dapo.training.update import NonFiniteError

    # Loading/saving bars of a tiny model are noise in a log that prints one line per step.
    hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (ValueError, FileExistsError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return failed(2)
    except (DynamicSamplingExhausted, CheckpointError, NonFiniteError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return failed(1)
    except RunStopped as exc:
        print(f"dapo: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception:
        if not launched():
            raise
        traceback.print_exc()
        return failed(1)


def launched() -> bool:
    """Whether this process is a rank of a torchrun job."""
    from dapo import dist

    return dist.launched()


def before_exit() -> None:
    """What a rank leaving with ``os._exit`` does first, as no finalizer will: the vllm
    engine's temporary directory (its config and LoRA adapters) removed."""
    engine = sys.modules.get("dapo.rollout.vllm_engine")
    if engine is not None:
        engine.remove_temporary_dirs()


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
