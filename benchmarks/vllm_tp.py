"""The vllm engine at ``rollout.tp_size`` = k against k = 1: whether the tokens match, what a
rank's engine holds, and decoding speed, on gloo ranks on this machine's CPUs (vLLM's CPU
build; run it in the environment ``.ci/run-vllm`` makes).

    .venv-vllm/bin/python benchmarks/vllm_tp.py --model /work/models/smollm2-135m --tp 3

One engine of tensor parallel size 1 (one rank), then one of size ``--tp`` (that many ranks,
vLLM's external launcher, as a ``torchrun`` job runs it). Each rank loads the whole model,
hands it to :class:`dapo.rollout.vllm_engine.VLLMEngine` one tensor at a time (as under FSDP2,
where each tensor is gathered from the shards first). The figures:

- ``engine_mib``: the rank's resident memory after the engine started and loaded its weights,
  minus before (vLLM imported, the model loaded: the trainer's policy, which the engine keeps
  to reload from). It holds the engine's weights (its slice at k > 1), its KV cache
  (``--kv-gib`` on every rank; vLLM needs room for one row of the model's context, 0.35 GiB
  for SmolLM2's 8192 tokens) and vLLM's own buffers;
- ``embed_rows``: the rows of the embedding the rank's engine holds (vocabulary-parallel);
- tokens/s: greedy, EOS ignored (every row exactly ``--new-tokens`` long), prompt included,
  the best of ``--reps`` after a warm-up. On a CPU the ranks share the cores and the
  all-reduces are loopback: this measures overhead, not a GPU group's speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rank_main(rank: int, port: int, args, world: int, out: Path) -> None:
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(args.rank_threads)
    import vllm  # noqa: F401  (its import is not the engine's memory)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.rollout.vllm_engine import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    gc.collect()
    before = rss_mib()  # the trainer's policy stays: the engine reloads from it
    engine = VLLMEngine(model, tokenizer, kv_cache_gib=args.kv_gib, tensor_parallel_size=world)
    gc.collect()
    engine_mib = rss_mib() - before

    def rows(worker) -> int:
        return int(worker.model_runner.model.model.embed_tokens.weight.shape[0])

    (embed_rows,) = engine.llm.collective_rpc(rows)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tokenizer.vocab_size, (args.rows, 32), generator=generator)
    prompts = tokenizer.batch_decode(ids)
    kwargs = dict(group_size=1, greedy=True, ignore_eos=True)
    engine.generate(prompts, max_new_tokens=4, **kwargs)  # warm-up
    best = float("inf")
    for _ in range(args.reps):
        start = time.perf_counter()
        ro = engine.generate(prompts, max_new_tokens=args.new_tokens, **kwargs)
        best = min(best, time.perf_counter() - start)
    tokens = int(ro.prompt_mask_BP.sum() + ro.response_mask_BT.sum())
    record = {
        "rank": rank,
        "engine_mib": round(engine_mib, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "embed_rows": embed_rows,
        "tokens_per_s": round(tokens / best, 1),
        "response_ids": ro.response_ids_BT.tolist(),
        "logprobs": ro.logprobs_BT.tolist(),
    }
    (out / f"tp{world}-rank{rank}.json").write_text(json.dumps(record))
    engine.close()


def run(args, world: int, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"tensor parallel size {world}: {world} rank(s) start ...", flush=True)
    mp.start_processes(rank_main, args=(port, args, world, out), nprocs=world, start_method="spawn")
    return [json.loads((out / f"tp{world}-rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--tp", type=int, default=2, help="the tensor parallel size to compare")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--kv-gib", type=float, default=0.5)
    parser.add_argument("--rank-threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        one, split = run(args, 1, Path(d)), run(args, args.tp, Path(d))
    same = all(r["response_ids"] == one[0]["response_ids"] for r in split)
    gap = max(
        abs(a - b)
        for r in split
        for row_a, row_b in zip(r["logprobs"], one[0]["logprobs"], strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    )
    print(f"model {args.model}, {args.rows} rows x {args.new_tokens} new tokens, float32")
    print(f"{'tp':>3} {'rank':>4} {'engine MiB':>10} {'peak RSS MiB':>12} {'embed rows':>10} tok/s")
    for r in one + split:
        world = 1 if r in one else args.tp
        print(
            f"{world:>3} {r['rank']:>4} {r['engine_mib']:>10.1f} {r['peak_rss_mib']:>12.1f} "
            f"{r['embed_rows']:>10} {r['tokens_per_s']}"
        )
    print(f"tp {args.tp} tokens equal tp 1's on every rank: {same}; largest log-prob gap {gap:.2e}")


if __name__ == "__main__":
    main()
