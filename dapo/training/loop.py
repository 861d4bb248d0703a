"""The loop around the training step: evaluation and checkpoint cadence, resume, signals, and
the run's outputs (metrics.jsonl, TensorBoard, W&B, progress, summary, samples, the model).

``fit`` evaluates at the start, every ``eval.every`` steps and at the end; saves every
``train.save_every`` steps, on a stop signal and after the last step; and on ``resume``
restores the latest complete checkpoint and cuts ``metrics.jsonl`` back to what it had
logged, so that every step appears once and the run continues exactly.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from dapo import dist
from dapo.config import Config
from dapo.data.problems import Problem
from dapo.dist import fsdp, roles
from dapo.eval.evaluate import evaluate
from dapo.eval.metrics import pick_samples
from dapo.reward.pool import RewardPool
from dapo.rollout.base import close_engine
from dapo.run import checkpoint, launcher, model_files, run_files, sharded_checkpoint
from dapo.run.interrupt import GracefulStop, RunStopped, StepAborted, stopped_after
from dapo.run.metrics import MetricsLogger, NullLogger, open_wandb
from dapo.run.progress import LiveProgress
from dapo.run.seeding import derive_seed
from dapo.run.threads import ThreadGovernor
from dapo.training import resume as resume_checks
from dapo.training.final_model import save_final
from dapo.training.generator_ranks import rollout_source
from dapo.training.generator_thread import share_cores
from dapo.training.rollout_files import restore_ahead
from dapo.training.sampling import DynamicSamplingExhausted
from dapo.training.sources import InTurn, RolloutSource, StepRollouts
from dapo.training.state import TrainState, build_state, close_episodes, reward_pool
from dapo.training.step import train_step
from dapo.training.update import NonFiniteError


def fit(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    train_problems: list[Problem],
    val_problems: list[Problem],
    *,
    run_dir: Path,
    stream: TextIO | None = None,
    resume: bool = False,
    reward_fn: Callable[..., Any] | None = None,
    warnings: list[str] | None = None,
    on_resume: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Train for ``cfg.train.steps`` steps (or until ``train.max_gen_tokens`` or
    ``train.max_seconds`` is spent), evaluating at start, every ``eval.every`` and end.

    With ``resume``, the latest complete checkpoint in ``run_dir`` is restored first (the model
    given must be the starting policy: it is the KL reference) and ``metrics.jsonl`` is cut back
    to what that checkpoint had logged, so no step is missing or logged twice. ``reward_fn``
    is the function that ``reward.function`` names, when it was given in Python. ``on_resume``
    runs once the checkpoint is read and metrics.jsonl checked, before anything in ``run_dir``
    changes: a checkpoint that cannot be read, or a log cut or edited since, leaves the run as
    it was (rank 0 writes the resumed config.yaml there)."""
    stream = stream or sys.stdout
    run_dir = Path(run_dir)
    state = build_state(cfg, model, tokenizer, train_problems)

    def make_pool() -> RewardPool:
        return reward_pool(cfg, reward_fn)

    state.pool, failed = make_pool(), True
    try:
        loop = _Loop(state, val_problems, run_dir=run_dir, stream=stream, make_pool=make_pool)
        loop.warnings, loop.on_resume = list(warnings or []), on_resume
        summary, failed = loop.train(resume=resume), False
        return summary
    except RunStopped:  # stopped after a save on every rank: the engine closes as at the end
        failed = loop.failed
        raise
    except (NonFiniteError, DynamicSamplingExhausted) as exc:
        nan = isinstance(exc, NonFiniteError)
        fix = "optim.lr=<lower>" if nan else "sampling.max_rounds=<more>"
        raise type(exc)(f"{exc} {resume_checks.retry_hint(run_dir, fix)}") from None
    finally:
        state.pool.close()
        close_episodes(state.episodes)
        close_engine(state.engine, failed=failed)


class _Loop:
    """One run's outputs and what the loop keeps between steps besides the TrainState: the
    held-out results of the start and the latest evaluation, and the time trained so far."""

    def __init__(
        self,
        state: TrainState,
        val_problems: list[Problem],
        *,
        run_dir: Path,
        stream: TextIO,
        make_pool: Callable[[], RewardPool] | None = None,
    ) -> None:
        cfg = state.cfg
        self.make_pool = make_pool
        self.warnings: list[str] = []  # the checks' warnings, kept in summary.json
        self.on_resume: Callable[[], None] | None = None
        self.state, self.val_problems = state, val_problems
        self.run_dir, self.stream = run_dir, stream
        tty = getattr(stream, "isatty", lambda: False)()
        self.live = cfg.run.progress == "auto" and dist.is_main() and tty
        # Live: the rich display replaces the plain per-step lines; everything else is printed
        # through it so the two never interleave.
        wandb_run = None
        if cfg.run.wandb and dist.is_main():
            wandb_run = open_wandb(cfg.run.wandb_project, run_dir, cfg.to_dict())
        self.logger = (
            MetricsLogger(
                run_dir / "metrics.jsonl",
                stream=None if self.live else stream,
                tensorboard_dir=run_dir / "tensorboard" if cfg.run.tensorboard else None,
                wandb_run=wandb_run,
            )
            if dist.is_main()
            else NullLogger()
        )
        self.progress: LiveProgress | None = None
        self.records: list[dict] = []  # of the latest evaluation, for samples.jsonl
        self.val_start: dict[str, float] = {}
        self.val_last: dict[str, float] = {}
        self.val_step = 0  # the step val_last is of: a resume with no step left evaluates anew
        self.seconds_before = 0.0
        self.spent = {"gen_tokens": 0.0, "step_seconds": 0.0}  # against train.max_*
        self.t_start = time.perf_counter()
        self.saved_at: int | None = None
        # Generation ahead of training (train.async_staleness): a thread with its own share
        # of the cores; run.threads=0: threads follow the cores other processes leave free.
        self.source: RolloutSource = InTurn()
        self.restored: tuple[list[StepRollouts], tuple[int, int]] | None = None
        beside = bool(cfg.train.async_staleness) and not roles.roles()  # not other ranks
        self.gen_threads, most = share_cores(cfg, beside=beside)
        if most and cfg.run.threads:
            torch.set_num_threads(most)
        self.threads = ThreadGovernor(most) if cfg.run.threads == 0 else None
        self.base = state.base_model  # LoRA's frozen base, named in every checkpoint
        self.failed = True  # until the steps end, or stop after a save: see train
        self.after_step = False  # past the step's updates (what a second signal aborts)

    def train(self, *, resume: bool) -> dict[str, Any]:
        state, cfg = self.state, self.state.cfg
        if resume:
            self.restore()
        self.source = rollout_source(
            state, make_pool=self.make_pool, threads=self.gen_threads, restored=self.restored
        )
        if self.live:
            self.progress = LiveProgress(total=cfg.train.steps, done=state.step, stream=self.stream)
            state.on_phase = self.progress.phase
        stop = GracefulStop()
        try:
            with stop:
                if not resume:
                    self.val_start = self.val_last = self.validate()
                    self.logger.log(0, self.val_start)
                    self.say(
                        f"held-out accuracy at start: {self.val_start['val/accuracy']:.3f} "
                        f"(avg@{cfg.eval.num_samples} over {len(self.val_problems)} problems)"
                    )
                self.steps(stop)
            self.failed = False
        except RunStopped:
            # Raised by steps() after the save, on every rank alike: as clean an end as the
            # last step's, so the generator ranks are told to stop and their rollouts taken
            # (closed as failing, they would wait for weights until torchrun killed them).
            self.failed = False
            raise
        except StepAborted:
            step = state.step if self.after_step else state.step + 1
            raise resume_checks.aborted(self.run_dir, step, not self.after_step, stop) from None
        finally:
            self.source.close(failed=self.failed)
            self.logger.close()
            if self.progress is not None:
                self.progress.close()
        return self.finish()

    def steps(self, stop: GracefulStop) -> None:
        """Steps until the last, or a stop signal; then the final checkpoint and model."""
        state, t, e = self.state, self.state.cfg.train, self.state.cfg.eval
        # Checked once per step: under torchrun, budget_spent is a collective.
        done = state.step >= t.steps or self.budget_spent()
        if done and self.val_step < state.step:
            # A resume with no step left, not evaluated there: the run ends evaluated at it.
            self.say(f"no step left after step {state.step}: evaluating its policy to end the run")
            self.val_last = self.validate()
            if self.records and dist.is_main():
                self.write_records()
            again = resume_checks.logged_again(self.run_dir, state.step, self.val_last)
            self.logger.log(state.step, again)  # its step again, the figures added
        while not done and not self.stopping(stop):
            self.adjust_threads()
            self.after_step = False
            metrics = train_step(state, self.source)
            self.after_step = True  # the step's updates are done: its evaluation and save follow
            metrics["perf/threads"] = float(torch.get_num_threads())
            self.spent["gen_tokens"] += metrics.get("sampling/tokens_generated", 0.0)
            self.spent["step_seconds"] += metrics.get("perf/step_s", 0.0)
            is_last = done = state.step >= t.steps or self.budget_spent()
            if is_last or (e.every and state.step % e.every == 0):
                self.val_last = self.validate()
                metrics.update(self.val_last)
            if is_last and self.records and dist.is_main():  # before the final checkpoint
                self.write_records()
            self.logger.log(state.step, metrics)
            if self.progress is not None:
                self.progress.step_done(state.step, metrics)
            if is_last or self.stopping(stop) or (t.save_every and state.step % t.save_every == 0):
                self.save()
        if self.saved_at != state.step:
            self.save()
        signum = 0 if done else self.stopping(stop)
        if signum:  # the same step, and signal, on every rank
            raise stopped_after(signum, state.step, t.steps, launcher.resume_command(self.run_dir))
        save_final(state.model, state.tokenizer, self.run_dir, self.say)

    def write_records(self) -> None:
        """The final evaluation's samples.jsonl (dapo report) and val_problems.json (dapo
        ablate), before the final checkpoint: a run killed after it resumes with both."""
        run_files.write_samples(self.run_dir, self.state.step, pick_samples(self.records))
        run_files.write_val_problems(self.run_dir, self.state.step, self.records)

    def budget_spent(self) -> bool:
        """Whether ``train.max_gen_tokens`` or ``train.max_seconds`` is reached (on any rank:
        step times differ between ranks, and all ranks stop after the same step)."""
        t = self.state.cfg.train
        if not (t.max_gen_tokens or t.max_seconds):
            return False
        tokens = t.max_gen_tokens and self.spent["gen_tokens"] >= t.max_gen_tokens
        seconds = t.max_seconds and self.spent["step_seconds"] >= t.max_seconds
        return dist.any_rank(bool(tokens or seconds))

    def stopping(self, stop: GracefulStop) -> int:
        """The stop signal that reached any rank (a generator rank's, relayed by the source),
        or 0: all ranks stop after the same step, named for the same signal."""
        return int(dist.all_reduce_max(stop.signum or self.source.signal_received))

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.print(text)
        else:
            print(text, file=self.stream)

    def adjust_threads(self, *_: int) -> None:
        if self.threads is not None:
            self.threads.adjust()

    def validate(self) -> dict[str, float]:
        """The held-out evaluation, seeded the same every time (same weights, same figures)."""
        state, cfg = self.state, self.state.cfg
        state.on_phase("eval")
        self.val_step = state.step
        if state.engine_behind:
            state.sync_engine()
        state.model.eval()
        return evaluate(
            state.engine,
            state.tokenizer,
            self.val_problems,
            num_samples=cfg.eval.num_samples,
            temperature=cfg.eval.temperature,
            top_p=cfg.eval.top_p,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
            seed=derive_seed(cfg.train.seed, "eval"),
            pool=state.pool,
            chat_template=cfg.data.apply_chat_template,
            system_prompt=cfg.data.system_prompt,
            reward_mode=cfg.reward.grader,
            records_out=self.records,
            before_batch=self.adjust_threads,
            rows_per_generate=cfg.rollout.rows_per_generate,
            tp_mesh=state.tp_mesh,
            episodes=state.episodes,
        )

    def restore(self) -> None:
        """Continue from the latest complete checkpoint: weights, optimizer, RNG, counters."""
        state = self.state
        ckpt = checkpoint.find_latest(self.run_dir)
        if ckpt is None:
            why = checkpoint.unreadable(self.run_dir) or "start again with --overwrite"
            raise checkpoint.CheckpointError(f"{self.run_dir}: no checkpoint to resume; {why}")
        problems = (state.sampler.problems, self.val_problems)
        resume_checks.check_resume(state.cfg, self.run_dir, ckpt, problems=problems)
        info = sharded_checkpoint.load(
            ckpt, model=state.model, optimizer=state.optimizer, device=state.device
        )
        wrong = self.base and model_files.check_base(info.get("base_model"), self.base, ckpt)
        if wrong:
            raise checkpoint.CheckpointError(wrong)
        state.load_state_dict(info)
        state.sync_engine()
        k = state.cfg.train.async_staleness
        consumed = bool(k or roles.roles())
        self.restored = restore_ahead(info, ckpt, step=state.step, staleness=k, consumed=consumed)
        # Before config.yaml is written: a metrics.jsonl cut or edited since refuses the resume.
        self.logger.check_offset(info["metrics_bytes"])
        if self.on_resume is not None:
            self.on_resume()
        self.val_start, self.val_last = info["val_start"], info["val_last"]
        self.val_step = resume_checks.evaluated_at(info, state.step)
        self.seconds_before = info["train_seconds"]
        self.spent = dict(info.get("spent", self.spent))
        self.logger.truncate(info["metrics_bytes"])
        self.logger.purge_step = state.step + 1
        self.saved_at = state.step
        print(resume_checks.resumed_from(self.run_dir, ckpt, state.step), file=self.stream)

    def save(self) -> Path:
        state = self.state
        state.on_phase("save")
        save = sharded_checkpoint.save if fsdp.is_sharded(state.model) else checkpoint.save
        ahead, rollouts = {}, {}
        drawn_ahead = self.source.settle(state)
        if drawn_ahead is not None:  # the rollouts drawn for the next steps are saved too
            ahead["ahead"], rollouts["rollouts"] = drawn_ahead
        ckpt = save(
            self.run_dir,
            step=state.step,
            model=state.model,
            tokenizer=state.tokenizer,
            optimizer=state.optimizer,
            device=state.device,
            trainer_state={
                **state.state_dict(),
                "val_start": self.val_start,
                "val_last": self.val_last,
                "val_step": self.val_step,
                "val_set": resume_checks.val_set(self.val_problems),
                "train_seconds": self.seconds(),
                "spent": self.spent,
                "metrics_bytes": self.logger.sync(),
                **({"base_model": self.base} if self.base is not None else {}),
                **ahead,
            },
            keep=state.cfg.train.keep_checkpoints,
            **rollouts,
        )
        self.saved_at = state.step
        return ckpt

    def seconds(self) -> float:
        """Seconds trained, over every process of a resumed run."""
        return self.seconds_before + time.perf_counter() - self.t_start

    def finish(self) -> dict[str, Any]:
        """summary.json, samples.jsonl and the closing line."""
        step, run_dir, t = self.state.step, self.run_dir, self.state.cfg.train
        summary = {
            "steps": step,
            "val/accuracy_start": self.val_start["val/accuracy"],
            "val/accuracy_end": self.val_last["val/accuracy"],
            "train_seconds": self.seconds(),
            "gen_tokens": self.spent["gen_tokens"],
            "step_seconds": self.spent["step_seconds"],
            # What the run was asked for, so that dapo ablate can tell a finished run.
            "limits": {k: getattr(t, k) for k in ("steps", "max_gen_tokens", "max_seconds")},
        }
        if self.warnings:
            summary["warnings"] = self.warnings
        if not dist.is_main():
            return summary
        run_files.write_summary(run_dir, summary)
        start, end = summary["val/accuracy_start"], summary["val/accuracy_end"]
        spent = (
            f" ({self.spent['gen_tokens']:,.0f} tokens generated, "
            f"{self.spent['step_seconds']:.0f} s of steps)"
            if t.max_gen_tokens or t.max_seconds
            else ""
        )
        print(
            f"held-out accuracy: {start:.3f} -> {end:.3f} ({100 * (end - start):+.1f} points) "
            f"after {step} steps{spent}; model saved to {run_dir / 'model'}",
            file=self.stream,
        )
        return summary
