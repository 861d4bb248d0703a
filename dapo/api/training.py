"""A training run from start to end, as ``dapo train`` and :func:`dapo.train` run it.

Everything that can be wrong is checked before a model is loaded: the config (every bad
value at once), the run directory, the disk, the model path, the data, the verifiers or the
reward function, the tokenizer and the context length. Then the run directory is opened
(rank 0), the policy loaded, and :func:`dapo.training.loop.fit` trains it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo.config import Config, config_warnings
from dapo.config.local_paths import absolute_paths

if TYPE_CHECKING:
    from dapo.run.disk_space import RunSpace
    from dapo.run.rundir import NewRun
    from dapo.training.inputs import RunData


def describe(cfg: Config) -> str:
    """The run's batch sizes in their units, printed at start."""
    t, r = cfg.train, cfg.rollout
    return (
        f"preset {cfg.run.preset} on base {cfg.run.base}: {t.prompts_per_step} prompts/step x "
        f"{r.group_size} responses/prompt = {cfg.responses_per_step} responses/step; "
        f"{t.responses_per_minibatch} responses/mini-batch x {t.epochs} epoch(s) = "
        f"{cfg.updates_per_step} gradient updates/step; "
        f"{'packed ' if t.packing else ''}micro-batches of <= {t.tokens_per_microbatch} "
        f"{'' if t.packing else 'padded '}tokens; L_max {r.max_new_tokens} tokens"
    )


def run(
    cfg: Config,
    resume_dir: Path | None = None,
    *,
    overwrite: bool = False,
    dry_run: bool = False,
    world_size: int | None = None,
    reward_fn: Callable[..., Any] | None = None,
) -> Path | None:
    """Train ``cfg`` (or, with ``dry_run``, print what the run would be): in this process, or
    as one rank of a ``torchrun`` job. The run directory, or None after a dry run."""
    from dapo import dist

    if dist.launched() and not dry_run:
        from dapo.dist import roles

        try:
            run_dir = run_rank(cfg, resume_dir, overwrite=overwrite, reward_fn=reward_fn)
        except BaseException:
            # Not destroyed here: the other ranks may be waiting in a collective on it (with
            # NCCL the destroy itself can hang). This rank's exit makes torchrun stop them.
            roles.forget()
            raise
        roles.forget()
        dist.shutdown()
        return run_dir
    for warning in config_warnings(cfg):
        print(f"dapo: warning: {warning}", file=sys.stderr)
    return _train(cfg, resume_dir, overwrite, dry_run, world_size, reward_fn)


def run_rank(
    cfg: Config, resume_dir: Path | None, *, overwrite: bool, reward_fn: Callable[..., Any] | None
) -> Path | None:
    """One rank of a ``torchrun`` job: rank 0 checks and creates the run directory and
    prints; the other ranks follow it with their standard output silenced (their errors
    still reach standard error, naming the rank)."""
    from dapo import dist
    from dapo.dist import roles
    from dapo.run.interrupt import RunStopped
    from dapo.run.launcher import watch_launcher

    d = cfg.dist
    dist.init_from_env(timeout_s=d.timeout_s, wait_timeout_s=d.wait_timeout_s)
    watch_launcher(dist.rank())
    check_same_config(cfg)
    roles.check(d.rollout_ranks, dist.job_size())
    roles.split(d.rollout_ranks, wait_timeout_s=d.wait_timeout_s, timeout_s=d.timeout_s)
    if not dist.is_main():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    else:
        for warning in config_warnings(cfg):
            print(f"dapo: warning: {warning}", file=sys.stderr)
    try:
        if roles.generating():
            return generator_rank(cfg, reward_fn)
        return _train(cfg, resume_dir, overwrite, False, None, reward_fn)
    except Exception as exc:
        # A stop signal after a save is no failure: the run says it stopped, and how to resume.
        if dist.job_size() > 1 and not isinstance(exc, RunStopped):
            print(f"dapo: rank {dist.global_rank()} of {dist.job_size()} failed:", file=sys.stderr)
        raise


def generator_rank(cfg: Config, reward_fn: Callable[..., Any] | None) -> None:
    """A generator rank (``dist.rollout_ranks``): the trainers' checks, the policy loaded
    whole once trainer rank 0 has built (or cached) it, then steps drawn until the trainers
    stop it (:mod:`dapo.training.generator_ranks`). It writes nothing."""
    import torch

    from dapo import dist
    from dapo.models import policy
    from dapo.training.generator_ranks import generate_on_this_rank

    cfg, data, tokenizer, _ = _checked_inputs(cfg, reward_fn, dist.job_size())
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if cfg.run.deterministic:  # the generators' kernels too, as the trainers'
        from dapo.run.determinism import make_deterministic

        make_deterministic()
    torch.manual_seed(cfg.train.seed)
    dist.wait_for_all(everyone=True)
    # Read in the dtype the engine samples in, on the host: the float32 weights of a 32B model
    # (131 GB) would fill the rank's GPU before a cast.
    model, tokenizer = policy.load_policy(
        cfg,
        data.warmup_pairs,
        tokenizer,
        log=lambda _: None,
        device=torch.device("cpu"),
        dtype=policy.generation_dtype(cfg),
    )
    generate_on_this_rank(cfg, model, tokenizer, data.train, reward_fn)


def check_inputs(cfg: Config) -> None:
    """Refuse ``cfg``'s run as ``dapo train`` would before its run directory is made (one
    process; no reward function given in Python): what ``dapo ablate`` checks first."""
    _checked_inputs(cfg, None, 1)


def _checked_inputs(
    cfg: Config, reward_fn: Callable[..., Any] | None, world_size: int
) -> tuple[Config, RunData, Any, dict[str, float]]:
    """The device, model path, tensor-parallel size, optional packages, data, verifiers,
    tokenizer and context, checked: everything but the run directory, before anything on
    disk changes. The config comes back settled (the reward function's spec and digest,
    ``eval.num_samples`` from the data when 0) as a new object: nothing writes into a config
    after its checks, ``cfg`` included."""
    from dapo.models import policy
    from dapo.training import inputs

    cfg = absolute_paths(cfg)  # its config.yaml then reads the same from any directory
    policy.compute_device(cfg.model.device)  # raises now if it is absent or not this rank's
    if cfg.model.path != "embedded":
        policy.check_model_path(cfg)
    inputs.check_tensor_parallel(cfg, world_size)
    inputs.check_packing(cfg)
    inputs.check_lora(cfg)
    inputs.check_async(cfg, world_size)
    if cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("run.wandb=true needs the wandb package: pip install wandb")
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from dapo.rollout.vllm_engine import install_hint

        raise ValueError(install_hint())
    reward, warnings = inputs.check_reward_function(cfg, reward_fn)
    inputs.check_environment(cfg)
    for warning in warnings:
        print(f"dapo: warning: {warning}", file=sys.stderr)
    data = inputs.load_run_data(cfg)
    samples = cfg.eval.num_samples or data.val_copies
    cfg = dataclasses.replace(
        cfg, reward=reward, eval=dataclasses.replace(cfg.eval, num_samples=samples)
    )
    inputs.check_verifiers(cfg, data)
    tokenizer = policy.load_tokenizer(cfg)
    return cfg, data, tokenizer, inputs.check_context(cfg, data, tokenizer)


def _train(
    cfg: Config,
    resume_dir: Path | None,
    overwrite: bool,
    dry_run: bool,
    world_size: int | None,
    reward_fn: Callable[..., Any] | None,
) -> Path | None:
    """Check every input, then open the run directory (rank 0) and train; with ``dry_run``,
    print what the run would be. An earlier run that ``overwrite`` replaces is moved aside
    only after every check, and removed only once the new run has started."""
    import torch

    from dapo import dist
    from dapo.models import policy
    from dapo.run import run_files, rundir
    from dapo.run.determinism import make_deterministic
    from dapo.training.loop import fit

    ranks = dist.planned_ranks(world_size) if dry_run else dist.job_size()
    cfg, data, tokenizer, lengths = _checked_inputs(cfg, reward_fn, ranks)
    longest = int(lengths["prompt_tokens_max"])
    if dry_run:
        space = dist.is_main() and _checked_run_dir(cfg, resume_dir, overwrite, data, longest)
        _print_dry_run(cfg, data, lengths, ranks, space=space or None)
        return None
    opened = _open_run_dir(cfg, resume_dir, overwrite, data, longest) if dist.is_main() else None
    run_dir = dist.broadcast(opened.path if opened else None)
    started = False
    try:
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        if cfg.run.deterministic:
            make_deterministic()
        torch.manual_seed(cfg.train.seed)
        _print_plan(cfg, data)
        print(f"run directory: {run_dir}")
        write_config = functools.partial(run_files.write_config, run_dir, cfg)
        if dist.is_main() and not resume_dir:  # a resume's, once its checkpoint is read
            write_config()
        # A resume starts from the same policy (the KL reference), then loads its checkpoint.
        # Under torchrun rank 0 builds the embedded one first; safetensors load into shards.
        if not dist.is_main():
            dist.wait_for_all(everyone=True)
        model, tokenizer = policy.load_policy(
            cfg, data.warmup_pairs, tokenizer, shard=True, training=True
        )
        if dist.is_main():
            dist.wait_for_all(everyone=True)
        started = True
        if opened is not None and resume_dir is None:
            rundir.finish_replacing(opened)  # rank 0 may delete a whole replaced run here
        dist.wait_for_all()  # the other trainers wait for it as long as that takes
        options = dict(reward_fn=reward_fn, warnings=data.warnings, resume=bool(resume_dir))
        options["on_resume"] = write_config if dist.is_main() else None
        fit(cfg, model, tokenizer, data.train, data.val, run_dir=run_dir, **options)
    finally:
        if opened is not None:
            if not started and resume_dir is None:
                rundir.undo_new_run(opened)
            elif opened.lock is not None:
                opened.lock.release()
    return Path(run_dir)


def check_same_config(cfg: Config) -> None:
    """Refuse a job whose ranks hold different configs (a node given another file or other
    overrides): each would train its own shard its own way, or wait on a collective the
    others never reach, with nothing to name the cause."""
    from dapo import dist

    configs = dist.gather_lists([cfg.to_dict()])
    ranks = {}
    for rank, other in enumerate(configs[1:], start=1):
        fields = [
            f"{section}.{key}={other[section].get(key)!r} (rank 0: {value!r})"
            for section, values in configs[0].items()
            for key, value in values.items()
            if other.get(section, {}).get(key) != value
        ]
        if fields:
            ranks[rank] = ", ".join(fields[:3]) + (" ..." if len(fields) > 3 else "")
    if ranks:
        listing = "; ".join(f"rank {r}: {fields}" for r, fields in ranks.items())
        raise ValueError(
            f"the job's ranks were started with different settings: {listing}. Every rank "
            "(on every node) must run the same command, with the same config file and overrides"
        )


def _checked_run_dir(
    cfg: Config, resume_dir: Path | None, overwrite: bool, data: RunData, prompt_tokens: int
) -> RunSpace | None:
    """What can be told of the run directory without changing anything: a new run's would be
    refused; a resumed one is running, has no checkpoint (or a link, an altered one, one that
    resuming cannot read), is refused ``data`` or overrides (dapo.training.resume), or lacks
    room. A new run's room (``prompt_tokens``: its longest prompt) is returned."""
    from dapo import dist
    from dapo.run import checkpoint, disk_space, rundir, save_sizes, trainer_file
    from dapo.training import resume

    if resume_dir is None:
        plan = rundir.plan_new_run(cfg, overwrite=overwrite)
        # The run that --overwrite replaces is deleted before the first save.
        freed = save_sizes.tree_bytes(plan.path) if plan.replaces else 0
        return _check_new_run_space(cfg, plan.path, data, freed, prompt_tokens)
    found = checkpoint.find_latest(resume_dir)
    if found is None:
        rundir.refuse_if_running(resume_dir)  # before its first checkpoint: it did not stop
        why = checkpoint.unreadable(resume_dir)
        raise ValueError(
            f"--resume {resume_dir}: no complete checkpoint there: "
            + (why or "it stopped before its first one; start it again with --overwrite")
        )
    # Every file's digest and the counters, before a model loads (find_latest checked sizes):
    # a damaged file is named with its fix now, not after minutes of loading. Under torchrun
    # the ranks wait on rank 0 here, and hash a share each as they load the checkpoint.
    digests = dist.job_size() == 1
    trainer = checkpoint.read_trainer_state(found, digests=digests)
    trainer_file.check_resumable(trainer)
    # Warned once, as the run resumes.
    resume.check_resume(cfg, resume_dir, found, warn=False, problems=(data.train, data.val))
    rundir.check_writable(resume_dir)
    warning = disk_space.check_resume(resume_dir, cfg, _weights_dir(cfg), trainer, found)
    data.warnings.extend([warning] if warning else [])
    return None


def _check_new_run_space(
    cfg: Config, run_dir: Path, data: RunData, freed: int, prompt_tokens: int
) -> RunSpace:
    """Refuse a new run whose disk cannot hold its first saves; warn (``data.warnings``) when
    it cannot hold the whole run's. ``freed``: what the run it replaces frees."""
    from dapo.run import disk_space

    space, warning = disk_space.check_new_run(
        run_dir, cfg, _weights_dir(cfg), freed=freed, prompt_tokens=prompt_tokens
    )
    data.warnings.extend([warning] if warning else [])
    return space


def _weights_dir(cfg: Config) -> Path | None:
    """The model's directory (a Hub id's snapshot), or None for the embedded model."""
    from dapo.models import policy

    return None if cfg.model.path == "embedded" else policy.model_dir(cfg)


def _open_run_dir(
    cfg: Config, resume_dir: Path | None, overwrite: bool, data: RunData, prompt_tokens: int
) -> NewRun:
    """The run directory, locked for this process: a new one created (an earlier run it
    replaces moved aside), or the resumed one checked to hold a checkpoint; both checked to
    be writable with room for checkpoints (``prompt_tokens``: the longest prompt)."""
    from dapo.run import rundir, save_sizes
    from dapo.run.lock import RunLock

    if resume_dir is not None:
        _checked_run_dir(cfg, resume_dir, overwrite, data, prompt_tokens)
        return rundir.NewRun(resume_dir, lock=RunLock(resume_dir).acquire())
    # Planned once: an automatic name holds the time, and a second plan could name another.
    opened = rundir.plan_new_run(cfg, overwrite=overwrite)
    run_dir = rundir.start_new_run(opened)
    try:
        # The earlier run set aside is deleted before the first save.
        freed = save_sizes.tree_bytes(opened.aside) if opened.aside else 0
        _check_new_run_space(cfg, run_dir, data, freed, prompt_tokens)
    except Exception:
        rundir.undo_new_run(opened)
        raise
    return opened


def _print_plan(cfg: Config, data: RunData) -> None:
    print(describe(cfg))
    if cfg.reward.function:
        print(
            f"reward: {cfg.reward.function} (SHA-256 {cfg.reward.function_sha256[:12]}...) "
            "grades every row"
        )
    for line in data.notes:
        print(line)
    from dapo import dist

    for warning in data.warnings if dist.is_main() else ():
        print(f"dapo: warning: {warning}", file=sys.stderr)


def _print_dry_run(
    cfg: Config,
    data: RunData,
    lengths: dict[str, float],
    world_size: int,
    *,
    space: RunSpace | None,
) -> None:
    """``space``: a new run's room (rank 0's); a resume's is checked and warned of alone."""
    from dapo.config import dump_yaml
    from dapo.run import disk_space
    from dapo.training import inputs, memory_table

    print(dump_yaml(cfg), end="")
    _print_plan(cfg, data)
    print(
        f"train {len(data.train)} problems, val {len(data.val)} problems x "
        f"{cfg.eval.num_samples} samples; prompt tokens min {lengths['prompt_tokens_min']}, "
        f"median {lengths['prompt_tokens_median']:.0f}, max {lengths['prompt_tokens_max']} "
        f"(model context {lengths['context']:.0f})"
    )
    print(inputs.describe_budget(cfg, lengths))
    memory_table.print_plan(
        cfg, world_size=world_size, prompt_tokens=int(lengths["prompt_tokens_max"])
    )
    if space is not None:
        print(disk_space.describe(space, cfg))
    print("dry run: config, tokenizer and data are valid; nothing was trained or written")
