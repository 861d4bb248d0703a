"""This machine's roofline, and where a real model's training pass and decoding sit under it.

    python benchmarks/cpu_roofline.py [--model DIR] [--rows 64] [--prompt 88] [--response 64]

Measures, with torch's current thread count:
- the dense float32 matmul peak (GFLOP/s, best square matmul of 1024-4096);
- the memory bandwidth (GB/s, best copy of a 256 MiB tensor: bytes read + written);
then, on the model (a Hugging Face directory, e.g. from ``dapo model import``):
- a training pass as the trainer runs it (``dapo.models.logprobs.response_logprobs``, prompts shared
  within groups of 8, forward + backward of the token log-probs' sum) on ``--rows`` rows:
  achieved GFLOP/s, counted as 6 x matmul parameters x computed positions (attention's
  score matmuls added), and its share of the matmul peak: a CPU "MFU";
- decoding with the native engine, ``--rows`` rows x ``--response`` tokens, EOS ignored:
  tokens/s against the bandwidth bound (each step reads every weight once, so at most
  rows x bandwidth / weight bytes tokens/s) and the compute bound (peak / 2 x parameters).
Prints text, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

GROUP = 8


def best_of(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_peak() -> float:
    best = 0.0
    for n in (1024, 2048, 4096):
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = max(best, 2 * n**3 / best_of(lambda a=a, b=b: a @ b, reps=3) / 1e9)
    return best


def bandwidth() -> float:
    a = torch.empty(64 * 2**20)  # 256 MiB of float32
    a.normal_()
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / best_of(lambda: b.copy_(a)) / 1e9


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: every Linear, the output head included
    (a tied head counts once, as the matmul it is); the input embedding is a lookup."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def training_pass(model, args) -> dict:
    from dapo.models.logprobs import response_logprobs

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.rows // GROUP, args.prompt), generator=g)
    prompt_ids = prompts.repeat_interleave(GROUP, dim=0)
    response_ids = torch.randint(0, vocab, (args.rows, args.response), generator=g)
    ones = torch.ones_like

    def step():
        model.zero_grad(set_to_none=True)
        logp, _ = response_logprobs(
            model, prompt_ids, ones(prompt_ids), response_ids, ones(response_ids)
        )
        logp.sum().backward()

    seconds = best_of(step, reps=3)
    positions = prompts.numel() + response_ids.numel()  # prompts run once per group
    cfg = model.config
    width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    length = args.prompt + args.response
    # QK^T and AV: 2 x 2 x width per query-key pair, causal half, x3 for forward + backward.
    attention = 3 * 2 * 2 * width * cfg.num_hidden_layers * args.rows * length * length / 2
    flops = 6 * matmul_params(model) * positions + attention
    return {"seconds": seconds, "gflop": flops / 1e9, "gflops": flops / seconds / 1e9}


def decoding(model, tokenizer, args) -> dict:
    from dapo.rollout import make_engine

    engine = make_engine("dapo", model, tokenizer, (tokenizer.eos_token_id,))
    prompts = ["What is 6 + 8?"] * (args.rows // GROUP)

    def run():
        engine.generate(
            prompts, group_size=GROUP, max_new_tokens=args.response, seed=0, ignore_eos=True
        )

    seconds = best_of(run, reps=2)
    return {"seconds": seconds, "tokens_per_s": args.rows * args.response / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a Hugging Face model directory")
    p.add_argument("--rows", type=int, default=64, help="responses (multiple of 8)")
    p.add_argument("--prompt", type=int, default=88, help="prompt tokens per row")
    p.add_argument("--response", type=int, default=64, help="response tokens per row")
    args = p.parse_args()
    out = {"threads": torch.get_num_threads(), "matmul_peak_gflops": matmul_peak()}
    out["bandwidth_gbs"] = bandwidth()
    print(
        f"threads {out['threads']}: matmul peak {out['matmul_peak_gflops']:.1f} GFLOP/s, "
        f"bandwidth {out['bandwidth_gbs']:.1f} GB/s"
    )
    if args.model:
        from transformers import AutoModelForCausalLM

        from dapo.models.policy import tokenizer_from_dir

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        params = sum(q.numel() for q in model.parameters())
        train = training_pass(model.train(), args)
        out["training"] = {**train, "mfu": train["gflops"] / out["matmul_peak_gflops"]}
        print(
            f"training pass, {args.rows} rows x ({args.prompt} + {args.response}) tokens: "
            f"{train['seconds']:.2f} s, {train['gflops']:.1f} GFLOP/s = "
            f"{100 * out['training']['mfu']:.0f}% of the matmul peak"
        )
        dec = decoding(model.eval(), tokenizer_from_dir(args.model), args)
        weight_bytes = params * 4
        bw_bound = args.rows * out["bandwidth_gbs"] * 1e9 / weight_bytes
        compute_bound = out["matmul_peak_gflops"] * 1e9 / (2 * matmul_params(model))
        out["decoding"] = {**dec, "bandwidth_bound": bw_bound, "compute_bound": compute_bound}
        print(
            f"decoding, {args.rows} rows x {args.response} tokens: {dec['tokens_per_s']:.0f} "
            f"tokens/s; bounds: bandwidth {bw_bound:.0f}, compute {compute_bound:.0f} tokens/s "
            f"({100 * dec['tokens_per_s'] / min(bw_bound, compute_bound):.0f}% of the lower)"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
