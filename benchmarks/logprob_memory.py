"""Peak memory of per-token log-probs, forward and backward, through a [tokens x vocab] head.

    python benchmarks/logprob_memory.py --tokens 8192 --vocab 152064 --hidden 896

``plain`` computes the full logits, log_softmax and a gather (autograd keeps [N, V] tensors);
``chunked`` is ``dapo.algo.token_logprobs_from_hidden`` (a chunk of tokens at a time, logits
recomputed in backward). Each measurement runs in a fresh process, because peak memory (the
kernel's high-water mark, VmHWM) cannot be reset within one; the figure is that peak minus
the process's peak once the inputs exist (hidden states, the head's weight and its gradient
buffer, which both ways hold). A process is capped at --limit-gb of address space, so a
measurement that does not fit reports that instead of taking the machine down. On a GPU
(--device cuda) the figure is torch.cuda.max_memory_allocated, from the same starting point.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure(args: argparse.Namespace) -> dict:
    import torch

    from dapo.algo import token_logprobs_from_hidden

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_()
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=g)).to(device)
    weight.requires_grad_()
    weight.grad = torch.zeros_like(weight)  # both ways accumulate into it
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated() / 2**20
    else:
        base = _vm_hwm_mb()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    start = time.perf_counter()
    with autocast:
        if args.way == "plain":
            logits = torch.nn.functional.linear(hidden, weight).float()
            logp = logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
        else:
            logp, _ = token_logprobs_from_hidden(hidden, weight, tokens)
    logp.sum().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _vm_hwm_mb()
    return {"extra_peak_mb": round(peak - base), "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit-gb", type=float, default=20.0)
    parser.add_argument("--way", choices=("plain", "chunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:  # a child: one measurement
        if args.device == "cpu":
            cap = int(args.limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        args.tokens = args.tokens[0]
        try:
            print(json.dumps(_measure(args)))
        except (MemoryError, RuntimeError) as exc:
            print(json.dumps({"error": f"did not fit ({type(exc).__name__})"}))
        return
    print(f"head [tokens x {args.vocab}] from hidden {args.hidden}, {args.dtype}, {args.device}")
    for tokens in args.tokens:
        for way in ("plain", "chunked"):
            child = [sys.executable, __file__, "--way", way, "--tokens", str(tokens)]
            child += ["--vocab", str(args.vocab), "--hidden", str(args.hidden)]
            child += ["--dtype", args.dtype, "--device", args.device]
            child += ["--threads", str(args.threads), "--limit-gb", str(args.limit_gb)]
            done = subprocess.run(child, capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if lines else {"error": done.stderr[-300:]}
            print(f"{tokens:>7} tokens  {way:<8} {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
