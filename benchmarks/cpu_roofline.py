"""This machine's roofline, and where a real model's training pass and decoding sit under it.

    python benchmarks/cpu_roofline.py [--model DIR] [--rows 64] [--prompt 88] [--response 64]

Measures, with torch's current thread count:
- the dense float32 matmul peak (GFLOP/s, best square matmul of 1024-4096);
- the memory bandwidth (GB/s, best copy of a 256 MiB tensor: bytes read + written);
then, on the model (a Hugging Face directory, e.g. from ``dapo model import``):
- a training pass as the trainer runs it (``dapo.models.logprobs.response_logprobs``, prompts shared
  within groups of 8, forward + backward of the token log-probs' sum) on ``--rows`` rows:
  achieved GFLOP/s, the FLOPs counted by :func:`training_flops` (those the pass computes),
  and its share of the matmul peak: a CPU "MFU";
- decoding with the native engine, ``--rows`` rows x ``--response`` tokens, EOS ignored:
  tokens/s against the bandwidth bound (each step reads every weight once, so at most
  rows x bandwidth / weight bytes tokens/s) and the compute bound (peak / 2 x parameters).
``--rows`` must be a multiple of 8 (whole groups). Prints text, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
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


def head_params(model) -> int:
    """The output head's weights (0 when it is not a Linear): counted apart, since the
    log-prob pass runs it on response positions only."""
    head = model.get_output_embeddings()
    return head.weight.numel() if isinstance(head, torch.nn.Linear) else 0


def training_flops(
    *,
    decoder_params: int,
    head_params: int,
    layers: int,
    width: int,
    rows: int,
    prompt: int,
    response: int,
    group: int = GROUP,
) -> float:
    """Model FLOPs (forward + backward: 3 x forward) of one shared-prompt log-prob pass, as
    ``response_logprobs`` computes it: each group's prompt runs once through the decoder, the
    rows' responses run on top of its KV cache, and only response positions go through the
    head. ``decoder_params``: the decoder's Linear weights; ``width``: heads x head_dim.
    Attention's QK^T and AV take 2 x 2 x width per query-key pair, causal pairs halved: P^2/2
    within a prompt, R x P + R^2/2 for a row's responses. The head's recompute in backward
    (the chunked head) is not counted: MFU counts the model's FLOPs, not the method's."""
    prompts = rows // group
    decoder = 6 * decoder_params * (prompts * prompt + rows * response)
    head = 6 * head_params * rows * response
    pairs = prompts * prompt * prompt / 2 + rows * (response * prompt + response * response / 2)
    return decoder + head + 3 * 2 * 2 * width * layers * pairs


def training_step(model: torch.nn.Module, args: argparse.Namespace) -> Callable[[], None]:
    """One pass to time: forward and backward of the log-probs' sum, on random tokens, the
    rows' prompts shared within groups of ``GROUP``."""
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

    return step


def training_pass(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    seconds = best_of(training_step(model, args), reps=3)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    flops = training_flops(
        decoder_params=matmul_params(model) - head_params(model),
        head_params=head_params(model),
        layers=cfg.num_hidden_layers,
        width=cfg.num_attention_heads * head_dim,
        rows=args.rows,
        prompt=args.prompt,
        response=args.response,
    )
    return {"seconds": seconds, "gflop": flops / 1e9, "gflops": flops / seconds / 1e9}


def decoding(model, tokenizer, args) -> dict:
    from dapo.rollout import make_engine

    engine = make_engine("dapo", model, tokenizer, (tokenizer.eos_token_id,))
    prompts = ["What is 6 + 8?"] * (args.rows // GROUP)
    last = []

    def run():
        last[:] = [
            engine.generate(
                prompts, group_size=GROUP, max_new_tokens=args.response, seed=0, ignore_eos=True
            )
        ]

    seconds = best_of(run, reps=2)
    # The rows and tokens the engine returned, not the ones asked for.
    rows, tokens = last[0].response_ids_BT.shape[0], int(last[0].lengths_B.sum())
    return {"seconds": seconds, "rows": rows, "tokens_per_s": tokens / seconds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a Hugging Face model directory")
    p.add_argument("--rows", type=int, default=64, help=f"responses (multiple of {GROUP})")
    p.add_argument("--prompt", type=int, default=88, help="prompt tokens per row")
    p.add_argument("--response", type=int, default=64, help="response tokens per row")
    args = p.parse_args(argv)
    # Rows come in groups of GROUP sharing a prompt: a partial group would leave rows
    # without a prompt (response_logprobs then fails on mismatched sizes).
    if args.rows < GROUP or args.rows % GROUP:
        p.error(f"--rows {args.rows}: must be a positive multiple of {GROUP} (e.g. --rows 64)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
        bw_bound = dec["rows"] * out["bandwidth_gbs"] * 1e9 / weight_bytes
        compute_bound = out["matmul_peak_gflops"] * 1e9 / (2 * matmul_params(model))
        out["decoding"] = {**dec, "bandwidth_bound": bw_bound, "compute_bound": compute_bound}
        print(
            f"decoding, {dec['rows']} rows x {args.response} tokens: {dec['tokens_per_s']:.0f} "
            f"tokens/s; bounds: bandwidth {bw_bound:.0f}, compute {compute_bound:.0f} tokens/s "
            f"({100 * dec['tokens_per_s'] / min(bw_bound, compute_bound):.0f}% of the lower)"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
