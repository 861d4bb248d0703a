"""The embedded default: a tokenizer and a tiny Qwen2 policy built here, warm-started on the
arithmetic task, so ``dapo train`` runs end to end with no download.

RL needs a starting policy that is sometimes right (from random weights every group is
all-wrong and no gradient flows), so the tiny model first gets a short supervised phase on
worked solutions. The result is cached on disk keyed by every setting that shapes it, and
is rebuilt bit-for-bit from the seed when the cache is absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dapo.data.chat_render import DEMO_CHAT_TEMPLATE
from dapo.data.problems import Problem
from dapo.data.prompts import PROMPT_PREFIX, PROMPT_SUFFIX, render_prompt
from dapo.reward.tasks import arith

# Words keep their leading space (as in GPT-2's byte-level BPE), digits are single tokens so
# that numbers of any size are spelled, and every other character is a token of its own.
PIECE_PATTERN = r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|\n|\s"
# With the Python tool (arith.tool_share > 0), a fence is one piece, as in real tokenizers,
# so that the tool's turn end ("```") is a token of its own.
TOOL_PIECES = r"```(?:python|output)?|"
TOOL_CORPUS = "```python\nprint(7 * 8)\n```\n```output\n56\n```\n*"
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|unk|>")
CHAT_TEMPLATE = DEMO_CHAT_TEMPLATE


def _corpus(tools: bool = False) -> str:
    chat = "User: Assistant:\n" + (TOOL_CORPUS if tools else "")
    phrasing = " ".join(arith.PHRASINGS)
    digits = " ".join(f"{d} {d}" for d in "0123456789") + "".join("0123456789")
    # Sign and operator pieces with and without a leading space ("-3" and " - 3").
    ops = " + - = ? . , : ( ) $ \" ' +-=?.,:()$\"'"
    return PROMPT_PREFIX + PROMPT_SUFFIX + chat + phrasing + digits + ops + "\nAnswer: Answer:"


def build_tokenizer(tools: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary covers the DAPO template and the task (with
    ``tools``, the Python tool's fences and code too).

    Decoding concatenates pieces, so ``decode(encode(text)) == text`` for task text.
    """
    corpus, pattern = _corpus(tools), piece_pattern(tools)
    words = set(re.findall(r"[A-Za-z]+", corpus))
    # Every word both at a line start and after a space, whichever the text happened to show.
    pieces = sorted(set(re.findall(pattern, corpus)) | words | {" " + w for w in words})
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(pieces))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def piece_pattern(tools: bool) -> str:
    """The pieces text splits into (a fence is one with ``tools``)."""
    return TOOL_PIECES + PIECE_PATTERN if tools else PIECE_PATTERN


@dataclass(frozen=True)
class TinyModelSpec:
    """The embedded policy: a real Qwen2 architecture, 0.3M parameters at the defaults."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 512


def tiny_qwen2(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec, *, seed: int):
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


@dataclass(frozen=True)
class WarmupSpec:
    """The supervised warm-start: next-token loss on worked solutions only."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0


PROGRESS_EVERY_S = 15.0
"""How often the warm-up says where it is."""


def warm_start(
    model, tokenizer, examples: list[tuple[str, str]], spec: WarmupSpec, log=None
) -> list[float]:
    """Supervised phase on (prompt text, solution) pairs; returns the loss of every step.

    Only solution tokens (and the final EOS) carry loss, the prompt is context. ``log``, when
    given, is told the step and loss every ``PROGRESS_EVERY_S`` seconds (the tools recipe's
    600 steps take minutes on a laptop, in silence otherwise).
    """
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / spec.steps)
    encoded = []
    for prompt, solution in examples:
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        s_ids = tokenizer(solution, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        encoded.append((p_ids, s_ids))
    losses = []
    model.train()
    start = last = time.perf_counter()
    for step in range(spec.steps):
        if log is not None and losses and time.perf_counter() - last >= PROGRESS_EVERY_S:
            last = time.perf_counter()
            log(f"  warm-up step {step}/{spec.steps}, loss {losses[-1]:.3f}, {last - start:.0f} s")
        idx = torch.randint(len(encoded), (spec.batch_size,), generator=gen).tolist()
        width = max(len(encoded[i][0]) + len(encoded[i][1]) for i in idx)
        ids_BL = torch.full((len(idx), width), tokenizer.pad_token_id)
        labels_BL = torch.full((len(idx), width), -100)
        attn_BL = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p_ids, s_ids = encoded[i]
            seq = p_ids + s_ids
            ids_BL[row, : len(seq)] = torch.tensor(seq)
            labels_BL[row, len(p_ids) : len(seq)] = torch.tensor(s_ids)
            attn_BL[row, : len(seq)] = 1
        out = model(input_ids=ids_BL, attention_mask=attn_BL, labels=labels_BL)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    model.eval()
    return losses


def _cache_key(*parts: object) -> str:
    text = json.dumps([asdict(p) if hasattr(p, "__dataclass_fields__") else p for p in parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_embedded(
    pairs: list[tuple[Problem, str]],
    *,
    cache_dir: str | Path,
    spec: TinyModelSpec = TinyModelSpec(),
    warmup: WarmupSpec = WarmupSpec(),
    task_key: object = None,
    log=print,
):
    """The warm-started tiny policy, from the cache or built (deterministically) and cached.

    ``pairs`` are (problem, worked solution) pairs of the warm-up split, rendered only when
    the model is built; ``task_key`` identifies them in the cache key, so a different task
    never reuses another's weights.
    """
    tools = any("```" in solution for _, solution in pairs)  # arith.tool_share > 0
    tokenizer = build_tokenizer(tools)
    vocab = sorted(tokenizer.get_vocab().items())
    # The warm-up runs transformers' Qwen2 and torch's kernels: a new version of either may
    # build other weights, and so do the CPU kernels torch picks for the instruction set
    # (AVX2's and the plain kernels' weights differ by up to 0.02, and the demo's start
    # reads 0.173 and 0.177), so none reuses another's entry (a home shared across machines).
    kernels = torch.backends.cpu.get_cpu_capability()
    versions = (torch.__version__, transformers.__version__, kernels)
    key = _cache_key(spec, warmup, task_key, vocab, piece_pattern(tools), *versions)
    try:
        target = Path(cache_dir).expanduser() / f"embedded-{key}"
    except RuntimeError:  # "~" where HOME is unset and the uid has no passwd entry
        target = None
    if target is not None and (target / "model.safetensors").exists():
        model = Qwen2ForCausalLM.from_pretrained(target)
        return model, tokenizer
    log(
        f"building the embedded policy: {warmup.steps} supervised warm-up steps on this "
        f"CPU's {kernels} kernels" + (f" (cached at {target})" if target else "")
    )
    start = time.perf_counter()
    model = tiny_qwen2(tokenizer, spec, seed=warmup.seed)
    examples = [(render_prompt(tokenizer, p), solution) for p, solution in pairs]
    losses = warm_start(model, tokenizer, examples, warmup, log)
    log(f"warm-up done in {time.perf_counter() - start:.0f} s, final loss {losses[-1]:.3f}")
    if target is None:
        print(
            f"dapo: warning: cannot cache the warmed-up demo model at {cache_dir}: this user "
            "has no home directory (HOME is unset and the uid has no passwd entry); set "
            "embedded.cache_dir (or HOME) to a writable directory",
            file=sys.stderr,
        )
    else:
        save_to_cache(model, tokenizer, target)
    return model, tokenizer


def save_to_cache(model, tokenizer, target: Path) -> None:
    """``model`` and ``tokenizer`` saved as the cache entry ``target``, or a warning and
    nothing: the cache only saves the next run the warm-up, so a cache directory that
    cannot be written (read-only, full, a file in the way) must not fail this one.

    Written to a temporary sibling and renamed: a build interrupted or failing half-way (a
    full disk) never leaves an entry that looks complete; the sibling is removed when the
    save fails."""
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except Exception as exc:  # noqa: BLE001 - a full disk is safetensors' own error type
        shutil.rmtree(tmp, ignore_errors=True)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(
            f"dapo: warning: cannot cache the warmed-up demo model at {target.parent} "
            f"({why}); set embedded.cache_dir to a writable directory",
            file=sys.stderr,
        )
        return
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; theirs is equal
