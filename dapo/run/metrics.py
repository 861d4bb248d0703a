"""Metric logging: one JSON line per step in the run directory, one readable line on stdout, and
the same scalars, under the same names, as TensorBoard event files (and W&B when asked)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

from dapo.run import nofollow


def accumulate(sums: dict[str, float], key: str, value: float) -> None:
    """``sums[key] += value``, from 0: a step's metrics are sums divided once at the end."""
    sums[key] = sums.get(key, 0.0) + value


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; a null is explicit about it
    return value


class MetricsLogger:
    CONSOLE_KEYS = (
        ("rollout/accuracy", "acc", ".3f"),
        ("rollout/reward_mean", "reward", "+.3f"),
        ("rollout/response_len_mean", "len", ".1f"),
        ("sampling/rounds", "rounds", ".0f"),
        ("train/entropy", "entropy", ".3f"),
        ("clip/high_frac", "clip_hi", ".4f"),
        ("val/accuracy", "VAL", ".3f"),
        ("perf/step_s", "s", ".1f"),
    )

    def __init__(
        self,
        path: Path,
        stream: TextIO | None = None,
        tensorboard_dir: Path | None = None,
        wandb_run: Any = None,
    ) -> None:
        self.path = path
        self.stream = stream
        # Appended to in binary (tell() is a byte offset), never through a link: a resume
        # cuts this file back to a checkpoint's offset.
        self._file = nofollow.open_binary(path, append=True, readable=True)
        if tensorboard_dir is not None:
            nofollow.no_link(tensorboard_dir)
        self.tensorboard_dir = tensorboard_dir
        self.purge_step: int | None = None
        """Set on a resume: TensorBoard then hides what earlier files logged from this step on,
        as metrics.jsonl is cut back to the checkpoint."""
        self._tb = None
        self._tb_failed = False  # no more events once a write of them failed
        self._reported = False  # a failed write was reported: the first, and the only one
        self.wandb_run = wandb_run

    def _writer(self):
        if self._tb is None and self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tensorboard_dir), purge_step=self.purge_step)
        return self._tb

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._append(step, (json.dumps(record) + "\n").encode())
        if self.tensorboard_dir is not None and not self._tb_failed:
            try:
                writer = self._writer()
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        writer.add_scalar(key, value, step)
            except OSError as exc:  # its writer thread's, raised here (a full disk)
                self._tb_failed = True
                what = f"TensorBoard events of step {step}"
                raise self._refused(exc, self.tensorboard_dir, what) from exc
        if self.wandb_run is not None:
            # W&B keeps the first value of a step: after an exact resume, re-run steps repeat
            # what it already has.
            scalars = {k: v for k, v in record.items() if k != "step" and v is not None}
            self.wandb_run.log(scalars, step=step)
        if self.stream is not None:
            parts = [f"step {step:>4}"]
            for key, short, fmt in self.CONSOLE_KEYS:
                if metrics.get(key) is not None:
                    parts.append(f"{short} {format(metrics[key], fmt)}")
            print("  ".join(parts), file=self.stream, flush=True)

    def sync(self) -> int:
        """Flush to disk; the byte size, which a checkpoint records as its metrics offset."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise self._refused(exc, self.path) from exc
        if self._tb is not None and not self._tb_failed:
            try:
                self._tb.flush()
            except OSError as exc:
                self._tb_failed = True
                raise self._refused(exc, self.tensorboard_dir) from exc
        return self._file.tell()

    def _append(self, step: int, line: bytes) -> None:
        """Append ``line`` whole, or none of it: when the write fails (a full disk), the part
        that reached the file is cut off and the rest dropped unwritten (the file is closed
        without the flush that would try it again, and fail again, in ``close``). A resume
        cuts the log back to its checkpoint's offset, at or before this line, and logs its
        step again: once, as in the uninterrupted run."""
        start = self._file.tell()
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            try:
                os.ftruncate(self._file.fileno(), start)
            except OSError:
                pass  # a partial last line: the resume cuts it off, as after a crash
            self._file.raw.close()  # the buffered file's close then flushes nothing
            raise self._refused(exc, self.path, f"the metrics of step {step}") from exc

    def _refused(self, exc: OSError, target: Path | None, what: str = "") -> Exception:
        """The one-line error for a write to ``target`` (``what``: of which step) that failed
        with ``exc``: the checkpoint a resume uses, and the fix for that cause (free space, or
        lift ``ulimit -f``). A CheckpointError, which ``dapo train`` reports in one line."""
        # Imported here: checkpoint imports torch, which this module otherwise does not need.
        from dapo.run import checkpoint

        self._reported = True
        named = f"{target} ({what})" if what else str(target)
        return checkpoint.CheckpointError(checkpoint.write_failed(self.path.parent, 0, exc, named))

    def check_offset(self, size: int) -> None:
        """Refuse a log that :meth:`truncate` cannot cut back to ``size`` bytes (shorter, or
        not a line's end there), changing nothing: a resume checks it before it writes the
        run's config.yaml, so that a refused resume leaves the run as it was."""
        actual = os.fstat(self._file.fileno()).st_size  # the file opened, not what the path is now
        if actual < size:
            raise ValueError(
                f"{self.path} is {actual} bytes but the checkpoint logged {size}: it was cut or "
                "edited since; restore it, or start the run again with --overwrite"
            )
        if size and os.pread(self._file.fileno(), 1, size - 1) != b"\n":
            raise ValueError(
                f"{self.path}: byte {size} is not the end of a line; the file was edited since "
                "the checkpoint, restore it or start again with --overwrite"
            )

    def truncate(self, size: int) -> None:
        """Cut the log back to ``size`` bytes (a checkpoint's offset): steps logged after that
        checkpoint, and a line half-written by a crash, are dropped before the run re-does them."""
        self.check_offset(size)
        self._file.truncate(size)
        self._file.seek(size)

    def close(self) -> None:
        """Close every output. After a write failed and was reported (by ``log`` or ``sync``),
        what closing meets on the same full disk is not reported again: raised here, in the
        loop's ``finally``, it would replace the first error and chain a second traceback."""
        failed = None
        try:
            self._file.close()
        except OSError as exc:  # what was left unflushed: nothing, after log's own flush
            failed = exc, self.path
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as exc:
                failed = failed or (exc, self.tensorboard_dir)
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if failed is not None and not self._reported:
            raise self._refused(*failed)


def open_wandb(project: str, run_dir: Path, config: dict[str, Any]) -> Any:
    """A W&B run named (and identified) by the run directory, so a resume continues it."""
    import wandb

    return wandb.init(
        project=project,
        name=run_dir.name,
        id=run_dir.name,
        resume="allow",
        dir=str(run_dir),
        config=config,
    )


class NullLogger:
    """The logger of every rank but 0 under torchrun: rank 0 writes the run's metrics."""

    purge_step: int | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Nothing: rank 0 logs the step (its metrics are the same, reduced over ranks)."""

    def sync(self) -> int:
        return 0

    def check_offset(self, size: int) -> None:
        """Nothing: rank 0 checks the log."""

    def truncate(self, size: int) -> None:
        """Nothing: rank 0 cuts the log back."""

    def close(self) -> None:
        """Nothing to close."""
