"""SIGINT / SIGTERM: the first finishes the running step and saves; a second aborts the step.

A preempted job gets SIGTERM and some seconds of grace: finishing the step and writing a
checkpoint keeps its work. An impatient second Ctrl-C cannot wait for that, so it aborts the
step in place (the weights are then mid-update and are not saved; the last checkpoint stands).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TextIO


def _launcher_grace() -> str:
    """What a rank adds under torchrun: its launcher's grace period (torchrun sets the run id)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    return (
        "; torchrun kills the ranks 30 s after it passes a signal on, unless it was launched "
        "with a longer --shutdown-timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"
    )


class StepAborted(Exception):
    """A second signal arrived while a step was running."""


class RunStopped(Exception):
    """Training stopped on a signal; ``exit_code`` is 128 + the signal number, by convention."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


def stopped_after(signum: int, step: int, steps: int, resume: str) -> RunStopped:
    """The stop, after step ``step`` of ``steps`` saved, that signal ``signum`` asked for."""
    return RunStopped(
        f"stopped by {signal.Signals(signum).name} after step {step} of {steps}; checkpoint "
        f"saved. Resume with: {resume}",
        signum,
    )


class GracefulStop:
    """Context manager that turns SIGINT/SIGTERM into ``requested`` and then ``StepAborted``."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            raise StepAborted(signal.Signals(signum).name)
        self.signum = signum
        print(
            f"\n{self.name} received: finishing this step, then saving a checkpoint "
            f"(send it again to abort the step without saving it){_launcher_grace()}",
            file=self.stream,
            flush=True,
        )

    def __enter__(self) -> GracefulStop:
        # Handlers can only be installed from the main thread (e.g. not in a worker thread).
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self.signum and kind is not None and not issubclass(kind, (StepAborted, RunStopped)):
            # The first signal promised a save, which this failure cut short (under torchrun
            # the signal is often torchrun's own, sent because another rank failed).
            print(
                f"{self.name} was received, but the run failed before it could stop after a "
                "save (its error follows): a resume starts from the last checkpoint written",
                file=self.stream,
                flush=True,
            )
