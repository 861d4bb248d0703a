"""Time the CUDA-graph path's draw (``sample_from_logits(..., by_blocks=True)``) at a
vocabulary, four ways: from the logits' block masses (what it draws with now, eager and
compiled), and from the float64 softmax inverted by blocks (what it drew with before), in
blocks that divide the vocabulary and padded to blocks of 256.

    python benchmarks/draw.py                          # Qwen's 151,936 tokens, 64 and 256 rows
    python benchmarks/draw.py --threads 2
    python benchmarks/draw.py --vocab 49152 --rows 80 --device cuda

Random float32 logits (N(0, 3^2)) and uniforms; the best of ``--reps`` calls each way (the
compiled one after its compiling call), and whether all ways drew the same tokens. The draw
is memory-bound: the softmax ways write and read a float64 copy and a float64 softmax of
every row (the padded one a wider copy of it too); the block masses read the float32 logits
once, the compiled ones in one kernel.
"""

from __future__ import annotations

import argparse

import torch
from gpu import best_seconds

from dapo.rollout import block_draw, sampling


def from_softmax(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw before block masses: the float64 softmax inverted by blocks, in row chunks."""
    rows = max(1, sampling.CDF_CHUNK_ELEMENTS // logits.shape[-1])
    out = []
    for logits_block, u_block in zip(logits.split(rows), u.split(rows), strict=True):
        probs, _ = sampling.sampling_probs(logits_block)
        out.append(sampling.invert_by_blocks(probs, u_block))
    return torch.cat(out)


def draw_each_way(rows: int, vocab: int, device: torch.device, reps: int, compile) -> dict:
    """Seconds of the draw each way, and whether they all drew the same tokens."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    u = torch.rand(rows, dtype=torch.float64, generator=g).to(device)
    chosen = sampling.block_tokens
    ways = {
        "masses": lambda: sampling.sample_from_logits(logits, u, check=False, by_blocks=True),
        "softmax": lambda: from_softmax(logits, u),
    }
    if compile:
        ways["compiled"] = lambda: sampling.sample_from_logits(
            logits, u, check=False, by_blocks=True, compile=compile
        )
    out = {"rows": rows, "vocab": vocab, "block": chosen(vocab)}
    tokens = {}
    for way, draw in ways.items():
        tokens[way] = draw()
        out[way] = best_seconds(device, draw, reps, 1)
    sampling.block_tokens = lambda v: block_draw.BLOCK_TOKENS  # what invert_by_blocks reads
    try:
        tokens["padded 256"] = from_softmax(logits, u)
        out["padded 256"] = best_seconds(device, lambda: from_softmax(logits, u), reps, 1)
    finally:
        sampling.block_tokens = chosen
    first = tokens["masses"]
    out["same_tokens"] = all(torch.equal(first, t) for t in tokens.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--compile", default="inductor", help="torch.compile backend, or 'none' (no compiled way)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    compile = None if args.compile == "none" else args.compile
    print(f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    for rows in args.rows:
        r = draw_each_way(rows, args.vocab, device, args.reps, compile)
        compiled = f", compiled {1e3 * r['compiled']:.1f} ms" if compile else ""
        print(
            f"{rows} rows x {args.vocab} tokens: blocks of {r['block']} from block masses "
            f"{1e3 * r['masses']:.1f} ms{compiled}; from the float64 softmax "
            f"{1e3 * r['softmax']:.1f} ms"
            f", padded blocks of 256 {1e3 * r['padded 256']:.1f} ms; same tokens: "
            f"{r['same_tokens']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
