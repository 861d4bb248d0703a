"""Peak host memory of each rank while the policy is loaded and sharded under torchrun.

    torchrun --standalone --nproc-per-node 2 benchmarks/load_memory.py \\
        --model /work/models/smollm2-135m --path old|new|dcp [--compute-dtype bfloat16] [--kl]

``--path old`` is the whole load: every rank loads the whole model (``load_policy``), then
``build_state`` deep-copies it into the whole generation copy and shards it. ``--path new``
loads straight into shards (:mod:`dapo.models.sharded_load`), and ``build_state`` makes the
copies from the shards. ``--path dcp`` fills the same empty shards with
``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader`` instead, for comparison (the
policy only). The ranks load one after another, as ``dapo train`` does (the others wait in a
barrier), except with ``dcp``, whose load is a collective.

Per rank: the resident memory before loading (Python, torch, the model's transformers code);
the peak resident memory (VmHWM, reset before loading) once ``load_policy`` has returned
(sharded for ``new``; still whole for ``old``, which ``build_state`` shards), and once
``build_state`` has returned (the policy sharded, the generation copy made, with ``--kl`` the
KL reference too: everything before the first step); this rank's shard bytes, the largest
tensor's bytes (both in ``model.param_dtype``) and the whole model's. Then one JSON line.

Resident memory counts the pages of a memory-mapped file that were read: a safetensors file
stored in ``model.param_dtype`` is mapped, not copied, by ``from_pretrained``, so the whole
load's peak comes with the copies there; one in another dtype is converted into memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-arith.yaml"
MIB = 2**20


def status(field: str) -> int:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def shard_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(this rank's shard bytes, the largest whole parameter's bytes, the whole model's)."""
    from dapo.dist import fsdp

    mine = largest = whole = 0
    for p in model.parameters():
        local = fsdp.local_part(p)[0]
        mine += local.numel() * local.element_size()
        size = p.numel() * p.element_size()
        largest, whole = max(largest, size), whole + size
    return mine, largest, whole


def load_dcp(cfg, device: torch.device) -> torch.nn.Module:
    """The empty shards of ``sharded_load``, filled by ``dcp.load`` with
    ``HuggingFaceStorageReader`` (which also reads slices with ``get_slice``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from transformers import AutoConfig

    from dapo.dist import fsdp
    from dapo.models import policy, sharded_load

    path = Path(cfg.model.path)
    dtype = policy.DTYPES[cfg.model.param_dtype]
    model = sharded_load.empty_model(AutoConfig.from_pretrained(path), dtype)
    fsdp.shard(model, **sharded_load.shard_options(cfg))
    sharded_load.materialise(model, params_on=device, buffers_on=device)
    stored = sharded_load.weight_files(path) or {}
    state = {k: v for k, v in model.state_dict().items() if k in stored}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
    return model


def _import_model_code(path: Path) -> None:
    """Import the model's transformers module (about 90 MiB resident with what it imports),
    so that the figures after it are the weights'."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path))]


def measure(args: argparse.Namespace) -> dict:
    from dapo import dist
    from dapo.config import load_config
    from dapo.models import policy
    from dapo.reward.tasks import arith
    from dapo.training.state import build_state

    overrides = [f"model.path={args.model}", f"model.compute_dtype={args.compute_dtype}"]
    if args.compute_dtype != "float32":
        overrides.append("train.recompute_old_logprobs=true")
    if args.kl:
        overrides.append("algo.kl_coef=0.1")
    cfg = load_config(RECIPE, overrides)
    device = policy.compute_device(cfg.model.device)
    _import_model_code(Path(cfg.model.path))  # code, not weights: counted in "before"
    out = {"rank": dist.rank(), "rss_before_mib": status("VmRSS") / MIB}
    serial = args.path != "dcp"
    if serial and dist.rank() > 0:
        dist.wait_for_all()
    reset_peak()
    t0 = time.perf_counter()
    if args.path == "dcp":
        model = load_dcp(cfg, device)
    else:
        model, tokenizer = policy.load_policy(cfg, shard=args.path == "new", log=lambda _: None)
    out["load_s"] = time.perf_counter() - t0
    out["peak_load_mib"] = status("VmHWM") / MIB  # old: whole, sharded by build_state next
    if serial and dist.rank() == 0:
        dist.wait_for_all()
    if args.path != "dcp":
        # What `dapo train` does next: shard (old), the copies, the optimizer, the engine.
        build_state(cfg, model, tokenizer, [p for p, _ in arith.make_splits(8, 1, seed=0)[0]])
        out["peak_with_copies_mib"] = status("VmHWM") / MIB
    mine, largest, whole = shard_bytes(model)
    out.update(shard_mib=mine / MIB, largest_tensor_mib=largest / MIB, model_mib=whole / MIB)
    out["target_mib"] = out["rss_before_mib"] + (mine + largest) / MIB
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--path", choices=("old", "new", "dcp"), default="new")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--kl", action="store_true", help="also the GRPO KL reference")
    args = parser.parse_args()
    from dapo import dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_from_env(timeout_s=600)
    try:
        out = measure(args)
        ranks = dist.gather_lists([out])
        main_rank = dist.is_main()
    finally:
        dist.shutdown()
    if not main_rank:
        return
    print(f"path={args.path} compute={args.compute_dtype} kl={args.kl} model={args.model}")
    for r in ranks:
        copies = r.get("peak_with_copies_mib")
        print(
            f"rank {r['rank']}: before {r['rss_before_mib']:.0f} MiB; peak after load_policy "
            f"{r['peak_load_mib']:.0f} MiB"
            + (f", after build_state {copies:.0f} MiB" if copies is not None else "")
            + f"; shard {r['shard_mib']:.0f} MiB, largest tensor {r['largest_tensor_mib']:.0f} "
            f"MiB (before + shard + largest = {r['target_mib']:.0f} MiB), whole model "
            f"{r['model_mib']:.0f} MiB; load {r['load_s']:.1f} s"
        )
    print(json.dumps({"path": args.path, "compute_dtype": args.compute_dtype, "ranks": ranks}))


if __name__ == "__main__":
    main()
