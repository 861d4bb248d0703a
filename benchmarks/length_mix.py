"""A realistic mix of prompt and response lengths for the training benchmark
(``benchmarks/gpu.py``'s padded-against-packed section).

Prompt lengths follow DAPO-Math-17k: the quantiles below are of its 17,917 prompts as
SmolLM2-135M's tokenizer and chat template encode them (its system line included; mean 134
tokens), measured on 2026-11-27 with ``python benchmarks/length_mix.py --measure
PATH/dapo_math_17k.parquet --tokenizer models/smollm2-135m`` (the 0.999 quantile stands for
the maximum, 1,602). A length is drawn by inverse CDF, linear between quantiles, and scaled
to the section's mean prompt.

Response lengths are long-tailed up to L_max, as RL responses are (many short, a few running
into the limit): log-normal with median L_max / 4 and sigma 0.8, cut at L_max (about 4% of
rows reach it, as truncated responses do), at least 1 token.
"""

from __future__ import annotations

import argparse
import math

import torch

PROMPT_QUANTILES = (
    (0.0, 42),
    (0.1, 70),
    (0.2, 83),
    (0.3, 95),
    (0.4, 107),
    (0.5, 118),
    (0.6, 131),
    (0.7, 147),
    (0.8, 169),
    (0.9, 207),
    (0.95, 254),
    (0.99, 406),
    (1.0, 931),
)
PROMPT_MEAN = 134.2
"""DAPO-Math-17k's mean prompt, in the same tokens."""


def prompt_length(u: float, mean: float) -> int:
    """The prompt length at uniform ``u``, scaled so that the mix's mean is about ``mean``."""
    for (q0, v0), (q1, v1) in zip(PROMPT_QUANTILES, PROMPT_QUANTILES[1:], strict=False):
        if u <= q1:
            tokens = v0 + (v1 - v0) * (u - q0) / (q1 - q0)
            return max(1, round(tokens * mean / PROMPT_MEAN))
    return max(1, round(PROMPT_QUANTILES[-1][1] * mean / PROMPT_MEAN))


def response_length(z: float, l_max: int) -> int:
    """The response length at standard normal ``z``: log-normal, median L_max / 4, sigma 0.8,
    cut to [1, L_max]."""
    return min(l_max, max(1, round(l_max / 4 * math.exp(0.8 * z))))


def draw(rows: int, *, prompt_mean: float, l_max: int, seed: int = 3) -> list[tuple[int, int]]:
    """(prompt, response) lengths of ``rows`` rows."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=g, dtype=torch.float64).tolist()
    z = torch.randn(rows, generator=g, dtype=torch.float64).tolist()
    return [
        (prompt_length(a, prompt_mean), response_length(b, l_max))
        for a, b in zip(u, z, strict=True)
    ]


def measure(path: str, tokenizer: str) -> list[tuple[float, int]]:
    """The quantiles of a DAPO-format Parquet file's prompts, chat-templated by ``tokenizer``."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    rows = pq.read_table(path, columns=["prompt"]).to_pylist()
    lengths = torch.tensor(
        [
            len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"])
            for r in rows
        ],
        dtype=torch.float64,
    )
    print(f"{len(rows)} prompts, mean {lengths.mean():.1f} tokens")
    levels = [q for q, _ in PROMPT_QUANTILES[:-1]] + [0.999]
    return [(q, int(lengths.quantile(q))) for q in levels]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", required=True, help="a DAPO-format Parquet file")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory")
    args = parser.parse_args()
    for q, tokens in measure(args.measure, args.tokenizer):
        print(f"quantile {q}: {tokens}")
