"""Tensor-parallel generation (``rollout.tp_size``) against one whole copy: decoding speed,
per-rank weight bytes, and whether the tokens match, on gloo ranks on this machine's CPUs.

    python benchmarks/tp_rollout.py                          # random Qwen2, ~100M, tp 2
    python benchmarks/tp_rollout.py --model models/smollm2-135m --tp 3 --rows 4
    python benchmarks/tp_rollout.py --device cuda --dtype bfloat16   # 2 ranks on one GPU (gloo)

The whole model decodes in this process (``--threads`` threads), then ``--tp`` gloo ranks
(``--rank-threads`` each) decode the same prompts from a copy split across them, filled from
the whole model with ``fill_tp_copy``: once with DTensor's forward, once with
``local_forward`` (local shards, plain collectives). Greedy, EOS ignored: every row is exactly
``--new-tokens`` long. The figure is generated tokens per second, prompt included, the best
of ``--reps`` runs after one warm-up. On a CPU, ranks share the cores and the all-reduces
are loopback TCP: this measures overhead, not the speed-up of GPUs on NVLink.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, Qwen2Config

from dapo.dist import tensor_parallel as tp
from dapo.rollout.native import decode


def build(args) -> torch.nn.Module:
    """The model on ``--device`` in ``--dtype``: a directory's, or a random Qwen2 of ~100M
    parameters (tied, 12 heads, 2 key-value heads, so that tp 2 splits it)."""
    dtype = getattr(torch, args.dtype)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        return model.to(args.device, dtype).eval()
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(args.device, dtype).eval()


def prompts(vocab: int, rows: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` prompts of 32 random tokens (no padding), the same in every process."""
    ids = torch.randint(3, vocab, (rows, 32), generator=torch.Generator().manual_seed(1))
    return ids.to(device), torch.ones_like(ids).to(device)


def timed(model, args) -> tuple[float, torch.Tensor]:
    """(best seconds over the repetitions, the tokens)."""
    ids, mask = prompts(model.config.vocab_size, args.rows, args.device)
    kwargs = dict(group_size=1, stop_token_ids=[0], pad_token_id=0, greedy=True, ignore_eos=True)
    decode(model, ids, mask, max_new_tokens=4, **kwargs)  # warm-up
    best, tokens = float("inf"), None
    for _ in range(args.reps):
        start = time.perf_counter()
        tokens, _, _ = decode(model, ids, mask, max_new_tokens=args.new_tokens, **kwargs)
        if args.device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, tokens.cpu()


def rank_main(rank: int, port: int, args, out: Path) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp
    )
    torch.set_num_threads(args.rank_threads)
    try:
        whole = build(args)
        mesh = tp.tp_mesh(args.tp, torch.device(args.device).type)
        dtype, device = getattr(torch, args.dtype), torch.device(args.device)
        result = {}
        for runtime, local in (("dtensor", False), ("local", True)):
            split = tp.tp_generation_copy(
                whole, mesh, dtype=dtype, device=device, local_forward=local
            )
            tp.fill_tp_copy(whole, split)
            seconds, tokens = timed(split, args)
            result[runtime] = {"seconds": seconds, "tokens": tokens}
            del split
        result["bytes"] = sum(
            (p.to_local() if hasattr(p, "to_local") else p).nbytes
            for p in tp.tp_generation_copy(whole, mesh, dtype=dtype, device=device).parameters()
        )
        torch.save(result, out / f"{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: random)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="tp 1's")
    parser.add_argument("--rank-threads", type=int, default=1, help="each tp rank's threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share cuda:0)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    whole = build(args)
    tp.require_tp_size(args.tp, args.tp, whole.config)
    params = sum(p.numel() for p in whole.parameters())
    generated = args.rows * args.new_tokens
    print(f"{params / 1e6:.1f}M parameters, {args.rows} rows x {args.new_tokens} tokens")
    ref = None
    for threads in args.threads:
        torch.set_num_threads(threads)
        seconds, ref = timed(whole, args)
        print(
            f"tp 1 ({threads} thread(s)): {generated / seconds:.1f} tokens/s, "
            f"{params * 4 / 2**20:.0f} MiB of weights"
        )
    del whole
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(rank_main, args=(port, args, Path(tmp)), nprocs=args.tp)
        ranks = [torch.load(Path(tmp) / f"{r}.pt") for r in range(args.tp)]
    held = max(r["bytes"] for r in ranks) / 2**20
    for runtime in ("dtensor", "local"):
        seconds = max(r[runtime]["seconds"] for r in ranks)
        same = all(torch.equal(r[runtime]["tokens"], ref) for r in ranks)
        print(
            f"tp {args.tp} ({args.tp} ranks x {args.rank_threads} thread(s), {runtime} forward):"
            f" {generated / seconds:.1f} tokens/s, {held:.0f} MiB of weights per rank, "
            f"tokens {'equal to' if same else 'DIFFERENT from'} tp 1"
        )


if __name__ == "__main__":
    main()
