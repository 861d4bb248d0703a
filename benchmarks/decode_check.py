"""Check the native engine's CUDA-graph decoding against its eager loops on one device.

    python benchmarks/decode_check.py                  # CUDA when present, else the CPU
    python benchmarks/decode_check.py --shape qwen2.5-0.5b --rows-per-prompt 8

A Qwen2 of random weights (the tiny one off CUDA), float32 master weights under bf16 autocast
on CUDA (float32 on a CPU), prompts of different lengths (left padding), a stop set of many
token ids (so rows finish at different steps and the batch shrinks), one seed per prompt,
top-p 0.9. Three ways of drawing the same rollout:

- ``eager``: :func:`dapo.rollout.native.decode`, transformers' forward, a read per token;
- ``static``: :func:`dapo.rollout.static_decode.static_decode` without graphs;
- ``graphs``: the same with every step replayed as a CUDA graph (CUDA only);
- ``compiled``: the graphs of the step compiled by inductor (``rollout.compile_step``; CUDA,
  or ``--compile`` on a CPU, without graphs).

Printed: whether static and graphs give the same tokens and log-probs (the same kernels: they
should, bit for bit; None off CUDA, where no graphs run, with a note saying so), how many
tokens eager and static, and graphs and compiled, share before their first difference
(rounding may move a draw near a CDF boundary), the largest log-prob gap over the shared
prefix, and the largest gap between the recorded log-probs and a teacher-forced forward pass
of the model over prompt and response (the quantity the objective's ratio divides by), for
the graphs and for the compiled step.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dapo.models.demo import build_tokenizer
from dapo.models.logprobs import autocast
from dapo.models.policy import compute_device
from dapo.rollout.base import encode_prompts
from dapo.rollout.native import decode
from dapo.rollout.static_decode import static_decode
from dapo.training.model_shape import KNOWN_SHAPES

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu import TINY_FIELDS, build_model  # noqa: E402  (the benchmark's own model)


def prompts(count: int) -> list[str]:
    """Prompts of 4 to 4 + 7 x (count - 1) digits: each row pads differently."""
    return [" ".join(str((i + k) % 10) for k in range(4 + 7 * i)) for i in range(count)]


@torch.inference_mode()
def teacher_forced(model, ids_BP, mask_BP, tokens_BT, keep_BT, compute, device) -> torch.Tensor:
    """log pi(token) of each response token from one forward pass over prompt and response."""
    ids = torch.cat([ids_BP, tokens_BT], dim=1)
    mask = torch.cat([mask_BP, keep_BT.long()], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with autocast(model, compute, device):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, ids_BP.shape[1] - 1 : -1].float()
    return logits.log_softmax(dim=-1).gather(2, tokens_BT[..., None]).squeeze(2)


def agreement(a, b) -> tuple[float, float]:
    """(fraction of tokens two rollouts share before a row's first difference, largest
    log-prob gap over that shared prefix)."""
    steps = min(a[0].shape[1], b[0].shape[1])
    differ = (a[0][:, :steps] != b[0][:, :steps]).long()
    shared = differ.cumsum(dim=1) == 0
    gap = ((a[1][:, :steps] - b[1][:, :steps]).abs() * shared).max()
    return float(shared.float().mean()), float(gap)


def forward_gap(model, prompt, run, stops, compute, device) -> float:
    """Largest gap between a rollout's recorded log-probs and a teacher-forced forward pass,
    over each row's tokens up to and including its stop token."""
    tokens, logprobs, _ = run
    is_stop = (tokens[:, :, None] == torch.tensor(stops, device=device)).any(-1).long()
    keep = (is_stop.cumsum(dim=1) - is_stop) == 0
    forward = teacher_forced(model, *prompt, tokens, keep, compute, device)
    return float(((forward - logprobs).abs() * keep).max())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(KNOWN_SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--rows-per-prompt", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=80)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", action="store_true", help="the compiled step on a CPU too")
    args = parser.parse_args(argv)
    device = compute_device(args.device)
    cuda = device.type == "cuda"
    tok = build_tokenizer()
    fields = KNOWN_SHAPES[args.shape] if cuda else TINY_FIELDS
    model = build_model(fields, tok, device).eval()
    compute = torch.bfloat16 if cuda else None
    ids, mask = encode_prompts(tok, prompts(args.prompts), device)
    vocab = fields["vocab_size"]
    # About 2% of the vocabulary stops a row: rows end over tens of steps.
    stops = list(range(7, vocab, 50))
    options = dict(
        group_size=args.rows_per_prompt,
        max_new_tokens=args.new_tokens,
        stop_token_ids=stops,
        pad_token_id=tok.pad_token_id,
        top_p=0.9,
        seed=list(range(100, 100 + args.prompts)),
    )
    runs = {}
    with torch.inference_mode():
        with autocast(model, compute, device):
            runs["eager"] = decode(model, ids, mask, **options)
        runs["static"] = static_decode(
            model, ids, mask, compute_dtype=compute, graphs=False, **options
        )
        if cuda:
            runs["graphs"] = static_decode(
                model, ids, mask, compute_dtype=compute, graphs=True, **options
            )
        if cuda or args.compile:
            runs["compiled"] = static_decode(
                model, ids, mask, compute_dtype=compute, graphs=cuda, compile="inductor", **options
            )
    result: dict = {"device": str(device), "shape": args.shape if cuda else "tiny"}
    for name, (tokens, _, slots) in runs.items():
        finished = (tokens[:, :, None] == torch.tensor(stops, device=device)).any(-1).any(-1)
        result[name] = {"steps": tokens.shape[1], "slots": slots, "finished": int(finished.sum())}
    last = "graphs" if cuda else "static"
    if cuda:
        a, b = runs["static"], runs["graphs"]
        equal = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
        result["static_vs_graphs_equal"] = equal
    else:  # no graphs ran: comparing static with itself would say True of nothing
        result["static_vs_graphs_equal"] = None
        result["static_vs_graphs_note"] = f"not compared: no CUDA graphs on {device.type}"
    result["eager_shared_token_frac"], result["eager_logprob_gap"] = agreement(
        runs["eager"], runs[last]
    )
    if "compiled" in runs:
        result["compiled_shared_token_frac"], result["compiled_logprob_gap"] = agreement(
            runs[last], runs["compiled"]
        )
    G = args.rows_per_prompt
    prompt = (ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0))
    for name in (last, "compiled"):
        if name in runs:
            gap = forward_gap(model, prompt, runs[name], stops, compute, device)
            result["forward_logprob_gap" + ("_compiled" if name == "compiled" else "")] = gap
    for key, value in result.items():
        print(f"{key}: {value}", flush=True)
    return result


if __name__ == "__main__":
    main()
