"""Checkpoints of a run under ``torchrun``: the same directory, protocol and ``latest`` pointer
as :mod:`dapo.run.checkpoint`, with the weights and the optimizer state in ``state/`` as
``torch.distributed.checkpoint`` shards that every rank writes in parallel.

A checkpoint directory then holds ``state/`` (DCP: loadable at any world size, one process
included; safetensors shards and the optimizer's settings as JSON), ``rng/rank_N.*`` (each
rank's generators, safetensors and JSON), ``model/`` (config, generation config and
tokenizer, no weights), ``trainer.json`` (one global data cursor and the counters) and
``manifest.json`` (each file's size and SHA-256: every rank hashes a share of the files, on
saving and on resuming).
Either kind of checkpoint resumes at any world size: :func:`load` reads both.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from dapo import dist
from dapo.dist import dcp, fsdp
from dapo.run import checkpoint, launcher, manifest, model_files, state_files
from dapo.run.checkpoint import CheckpointError
from dapo.run.nofollow import LinkRefused, no_link


def save(
    run_dir: Path,
    *,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
    device: torch.device | None = None,
    rollouts: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Every rank writes its shards into one temporary directory; rank 0 then writes the rest
    (``rollouts`` generated ahead of training as ``rollouts.safetensors``), renames it into
    place and moves ``latest``; every rank returns once it has."""
    if dist.any_rank(not fsdp.all_finite(model)):
        resumable = checkpoint.find_latest(Path(run_dir)) is not None
        raise CheckpointError(
            launcher.nonfinite_refusal(step, resumable=resumable, run_dir=run_dir)
        )
    root = Path(run_dir) / checkpoint.CKPT_DIR
    name = checkpoint.step_dir_name(step)
    tmp = root / f".tmp-{name}-{dist.broadcast(os.getpid())}"
    refused = None
    if dist.is_main():
        try:
            for entry in (root, tmp, root / name):
                no_link(entry)
        except LinkRefused as exc:
            refused = str(exc)
        else:
            root.mkdir(exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
    refused = dist.broadcast(refused, patient=True)  # every rank stops, not rank 0 alone
    if refused is not None:
        raise LinkRefused(refused)
    failed = _write_shards(tmp, model, optimizer, device)
    if failed is not None:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write the checkpoint of step {step} under {root}: {failed}; resume "
            f"with: {launcher.resume_command(run_dir)}"
        )
    digests = _shared_digests(tmp)
    problem = None
    if dist.is_main():
        try:
            _finish(tmp, root / name, step, model, tokenizer, trainer_state, rollouts, digests)
        except (OSError, SafetensorError) as exc:  # safetensors' own error is no OSError
            shutil.rmtree(tmp, ignore_errors=True)
            why = checkpoint.write_failure(exc)
            problem = f"could not write the checkpoint of step {step} under {root}: {why}"
        else:
            checkpoint.prune(root, keep=keep, protect=name)
    problem = dist.broadcast(problem, patient=True)  # after rank 0's writes, syncs, deletes
    if problem is not None:
        raise CheckpointError(f"{problem}; resume with: {launcher.resume_command(run_dir)}")
    return root / name


def _write_shards(
    tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Any
) -> str | None:
    """Every rank's shards and generators under ``tmp``; why a rank could not write them (a
    full disk), the same on every rank, or None."""
    failed = None
    try:
        dcp.save(tmp / "state", model, optimizer)
        state_files.save_rng(checkpoint.capture_rng(device), tmp / "rng" / f"rank_{dist.rank()}")
    except (OSError, SafetensorError) as exc:  # safetensors' own error is no OSError
        failed = checkpoint.write_failure(exc)
    # Also waits for every rank's shards, written and synced at their own pace.
    failures = [f for f in dist.gather_lists([failed], patient=True) if f is not None]
    return failures[0] if failures else None


def _shared_digests(tmp: Path) -> dict[str, str]:
    """The SHA-256 of every file under ``tmp`` so far, each rank hashing a share of them."""
    names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    names = dist.broadcast(names)  # rank 0's listing: the one the manifest is made from
    mine = names[dist.rank() :: dist.world_size()]
    return dict(dist.gather_lists([(n, manifest.sha256(tmp / n)) for n in mine], patient=True))


def _finish(
    tmp: Path, final: Path, step: int, model, tokenizer, trainer_state, rollouts, digests
) -> None:
    if rollouts is not None:
        save_file(rollouts, tmp / checkpoint.ROLLOUTS_FILE)
    model.config.save_pretrained(tmp / "model")
    if getattr(model, "generation_config", None) is not None:  # its stop tokens, for an export
        model.generation_config.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    trainer = {
        "format_version": checkpoint.FORMAT_VERSION,
        "step": step,
        "world_size": dist.world_size(),
        **trainer_state,
    }
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1) + "\n")
    checkpoint.publish(tmp, final, step, digests)


def load(
    ckpt: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device | None = None,
) -> dict:
    """Restore weights, optimizer and generators from a checkpoint of either kind, written at
    any world size, into ``model`` (sharded or not); return its trainer state."""
    # Every file is checked against the manifest's digest, each rank hashing a share.
    problem = checkpoint.verify(ckpt, digests=(dist.rank(), dist.world_size()))
    problems = [p for p in dist.gather_lists([problem], patient=True) if p is not None]
    if problems:
        raise checkpoint.damaged(ckpt, problems[0])
    trainer = checkpoint.read_trainer_state(ckpt, digests=False)  # hashed just above
    try:
        if (ckpt / "state").is_dir():
            dcp.load(ckpt / "state", model, optimizer)
            # Each rank its own generators; a rank the checkpoint did not have takes rank 0's.
            rng = ckpt / "rng" / f"rank_{dist.rank()}"
            rng = rng if rng.with_suffix(".json").is_file() else ckpt / "rng" / "rank_0"
        elif fsdp.is_sharded(model):  # written by one process: whole tensors, sharded on load
            weights = {}
            for shard in sorted((ckpt / "model").glob("*.safetensors")):
                weights.update(model_files.read_tensors(shard))
            _add_tied(model, weights)
            optim = state_files.load_optimizer(ckpt / "optimizer")
            try:
                dcp.load_full(model, optimizer, weights, optim)
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
                # torch's error (an optimizer state of more parameters: IndexError) names no
                # file; running out of memory or a failed collective is no fault of the files
                if isinstance(exc, torch.OutOfMemoryError | dist.FAILED_COLLECTIVE):
                    raise
                what = f"{ckpt / 'model'} and {ckpt / 'optimizer'}.json / optimizer.safetensors"
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                raise checkpoint.damaged(
                    ckpt, f"{what} hold a state that does not fit this run's model ({why})"
                ) from None
            rng = ckpt / "rng"
        else:
            return checkpoint.load(
                ckpt, model=model, optimizer=optimizer, device=device, verified=True
            )
    except (state_files.StateFileError, dcp.UnsafeCheckpointError) as exc:
        raise CheckpointError(str(exc)) from None
    checkpoint.restore_rng_file(ckpt, rng, device)
    return trainer


def _add_tied(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    tied = dcp.tied_keys(model)
    if tied is not None and tied[0] not in weights and tied[1] in weights:
        weights[tied[0]] = weights[tied[1]]


def _same(weights: dict[str, torch.Tensor], head: str, inputs: str) -> bool:
    """Whether ``weights`` hold ``head`` as the very values of ``inputs`` (False where either
    is missing: on the ranks other than 0, which hold no weights)."""
    if head not in weights or inputs not in weights:
        return False
    a, b = weights[head], weights[inputs]
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def export_model(
    model: torch.nn.Module,
    tokenizer: Any,
    dest: Path,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    saver: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.nn.Module] | None = None,
) -> None:
    """The whole weights gathered on rank 0 and saved there in the Hugging Face format;
    ``transform`` (LoRA's merge) turns them into what is saved, and ``saver`` gives the
    model whose ``save_pretrained`` writes them (one whose config describes them: LoRA's
    :func:`dapo.models.merged_save.saving_model`; default ``model``)."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    refused = None
    if dist.is_main():
        try:
            no_link(dest), no_link(tmp)
        except LinkRefused as exc:
            refused = str(exc)
    refused = dist.broadcast(refused)  # every rank stops, not rank 0 alone
    if refused is not None:
        raise LinkRefused(refused)
    weights = dcp.full_weights(model)
    if transform is not None and dist.is_main():
        weights = transform(weights)
    tied = dcp.tied_keys(model)
    if tied is not None and _same(weights, *tied):
        # Stored once, as save_pretrained stores it; a head that LoRA adapted is its own now.
        weights.pop(tied[0])
    problem = None
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            target = model if saver is None else saver(model, weights)
            target.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            checkpoint.fsync_tree(tmp)
        except (OSError, SafetensorError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            problem = checkpoint.export_failed(dest, exc)
        else:
            if dest.exists():
                shutil.rmtree(dest)
            os.rename(tmp, dest)
            checkpoint.fsync_dir(dest.parent)
    # Rank 0 alone writes the whole model; every rank stops when it could not, not rank 0 alone.
    problem = dist.broadcast(problem, patient=True)
    if problem is not None:
        raise CheckpointError(problem)
