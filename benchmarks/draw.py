"""Time the CUDA-graph path's draw (``sample_from_logits(..., by_blocks=True)``) at a
vocabulary, in blocks that divide it against the padded blocks of 256 it took before.

    python benchmarks/draw.py                          # Qwen's 151,936 tokens, 64 and 256 rows
    python benchmarks/draw.py --vocab 49152 --rows 80 --device cuda

Random float32 logits (N(0, 3^2)) and uniforms; the best of ``--reps`` calls each way, and
whether both ways drew the same tokens. The draw is memory-bound: the padded way copies the
float64 probabilities into a wider array first, 16 bytes a row and token more.
"""

from __future__ import annotations

import argparse

import torch
from gpu import best_seconds

from dapo.rollout import sampling


def draw_both_ways(rows: int, vocab: int, device: torch.device, reps: int) -> dict:
    """Seconds of the draw in the blocks the code picks, and padded to blocks of 256."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    u = torch.rand(rows, dtype=torch.float64, generator=g).to(device)
    chosen = sampling.block_tokens

    def draw():
        return sampling.sample_from_logits(logits, u, check=False, by_blocks=True)

    out = {"rows": rows, "vocab": vocab, "block": chosen(vocab)}
    tokens = {}
    for way, picks in (("padded 256", lambda v: sampling.BLOCK_TOKENS), ("chosen", chosen)):
        sampling.block_tokens = picks
        try:
            tokens[way] = draw()
            out[way] = best_seconds(device, draw, reps, 1)
        finally:
            sampling.block_tokens = chosen
    out["same_tokens"] = bool(torch.equal(tokens["padded 256"], tokens["chosen"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    for rows in args.rows:
        r = draw_both_ways(rows, args.vocab, device, args.reps)
        print(
            f"{rows} rows x {args.vocab} tokens: blocks of {r['block']} "
            f"{1e3 * r['chosen']:.1f} ms, padded blocks of 256 {1e3 * r['padded 256']:.1f} ms"
            f" ({r['padded 256'] / r['chosen']:.2f}x); same tokens: {r['same_tokens']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
