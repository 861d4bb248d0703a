"""Flags shared by the commands: only the standard library (see :mod:`dapo.cli`)."""

from __future__ import annotations

import argparse
from typing import Any


class GivenOnce(argparse.Action):
    """Store a flag's value, refusing the flag a second time: argparse keeps the last of a
    flag given twice, so ``--config a.yaml --config b.yaml`` ran b.yaml alone and dropped
    a.yaml without a word. For a flag whose default is None."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None:
            raise argparse.ArgumentError(
                self,
                f"given twice ({before} and {values}): dapo reads one config file; merge the "
                "two into one, or set what the second changes as section.field=value overrides",
            )
        setattr(namespace, self.dest, values)
