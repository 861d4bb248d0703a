"""The one place a policy is loaded: model and tokenizer, device and dtype.

``model.path=embedded`` builds the demo's tiny Qwen2 (:mod:`dapo.models.demo`, warm-started on the
arith task and cached); any other path is a local Hugging Face directory, loaded with
transformers. Cheap checks (the directory, the tokenizer, the context length) come apart from
the weights, so a run can make them before a load that takes minutes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dapo.config import Config, ModelConfig, choices
from dapo.data.problems import Problem

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in choices(ModelConfig, "param_dtype")
}
"""model.param_dtype's and model.compute_dtype's choices as torch dtypes."""

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def device(name: str) -> torch.device:
    """``auto`` is CUDA when a device is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={name} but no CUDA device is visible; use model.device=cpu")
    return torch.device(name)


def check_model_path(cfg: Config) -> Path:
    """``model.path`` as a Hugging Face model directory, or a ValueError that says what it is."""
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path={path} is not a Hugging Face model directory (no config.json); "
            "give a directory written by save_pretrained, or model.path=embedded"
        )
    return path


def load_tokenizer(cfg: Config) -> Any:
    """The run's tokenizer, without the model: left padding, a pad token."""
    if cfg.model.path == "embedded":
        from dapo.models.demo import build_tokenizer

        return build_tokenizer()
    return tokenizer_from_dir(Path(cfg.model.path))


def tokenizer_from_dir(path: Path, *, setting: str = "model.path") -> Any:
    """The tokenizer saved in ``path`` as the trainer uses it: left padding, a pad token.
    ``setting`` names where the path came from, for the error messages."""
    from transformers import AutoTokenizer

    fix = "save one beside the model with tokenizer.save_pretrained(DIR)"
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        # AutoTokenizer does not always fail here: it can build something that tokenizes
        # every prompt to nothing.
        raise ValueError(
            f"{setting}={path}: no usable tokenizer there (none of {', '.join(TOKENIZER_FILES)}); "
            f"{fix}"
        )
    loader = AutoTokenizer
    if _tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
        # A tokenizer saved as a plain tokenizers backend (the demo's word-level one) must load
        # as exactly that: AutoTokenizer would substitute the model family's class (qwen2 ->
        # Qwen2Tokenizer), which tokenizes the same text differently.
        from transformers import PreTrainedTokenizerFast as loader
    try:
        tokenizer = loader.from_pretrained(path, padding_side="left")
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"{setting}={path}: no usable tokenizer there ({str(exc).splitlines()[0]}); {fix}"
        ) from None
    if tokenizer.pad_token is None:
        # Padding is masked everywhere; EOS is a token the model already has.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise ValueError(f"{setting}={path}: the tokenizer has neither a pad nor an EOS token")
    return tokenizer


def _tokenizer_class(path: Path) -> str:
    try:
        return str(json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return ""


def context_length(cfg: Config) -> int | None:
    """The model's maximum sequence length, read from its config (no weights loaded)."""
    if cfg.model.path == "embedded":
        from dapo.models.demo import TinyModelSpec

        return TinyModelSpec().max_positions
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(cfg.model.path), "max_position_embeddings", None)


def stop_token_ids(
    model: torch.nn.Module, tokenizer: Any, extra: Sequence[int] = ()
) -> tuple[int, ...]:
    """Every token that ends a response: the tokenizer's EOS, the model's
    ``generation_config.eos_token_id`` (an id or a list: instruct models stop on several, and
    one that runs past its turn invents text whose last ``Answer:`` is graded), and ``extra``
    (``rollout.stop_token_ids``). Sorted, each once."""
    ids = {tokenizer.eos_token_id, *extra}
    generation = getattr(model, "generation_config", None)
    listed = getattr(generation, "eos_token_id", None)
    ids.update(listed if isinstance(listed, (list, tuple)) else [listed])
    return tuple(sorted(i for i in ids if i is not None))


def load_policy(
    cfg: Config,
    warmup_pairs: Sequence[tuple[Problem, str]] = (),
    tokenizer: Any = None,
    log: Callable[[str], None] = print,
) -> tuple[torch.nn.Module, Any]:
    """The policy on ``model.device`` with its weights in ``model.param_dtype``, and its
    tokenizer.

    The embedded tiny Qwen2 is warm-started on ``warmup_pairs`` (problem, worked solution)
    when it is not cached yet; any other ``model.path`` is loaded with transformers.
    """
    if cfg.model.path == "embedded":
        model, tokenizer = _embedded(cfg, warmup_pairs, log)
    else:
        model, tokenizer = _pretrained(cfg, tokenizer)
    return model.to(device(cfg.model.device), dtype=DTYPES[cfg.model.param_dtype]), tokenizer


def _embedded(cfg: Config, warmup_pairs: Sequence[tuple[Problem, str]], log):
    from dapo.models import demo
    from dapo.reward.tasks import arith

    e, a = cfg.embedded, cfg.arith
    return demo.load_embedded(
        list(warmup_pairs),
        cache_dir=e.cache_dir,
        spec=demo.TinyModelSpec(
            hidden_size=e.hidden, intermediate_size=2 * e.hidden, num_layers=e.layers
        ),
        warmup=demo.WarmupSpec(steps=e.sft_steps, seed=cfg.train.seed),
        # Only what shapes the warm-up examples: RL and held-out sizes don't.
        task_key=(
            arith.TASK_VERSION,
            a.seed,
            a.min_terms,
            a.max_terms,
            a.operators,
            a.solution,
            a.num_warmup,
            # Appended only when set, so the demo's existing caches keep their keys.
            *((a.prompt, a.shots) if a.prompt != "dapo" else ()),
        ),
        log=log,
    )


def _pretrained(cfg: Config, tokenizer: Any):
    from transformers import AutoModelForCausalLM

    path = check_model_path(cfg)
    tokenizer = tokenizer or load_tokenizer(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.model.param_dtype])
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"model.path={path}: not a causal language model transformers can load "
            f"({str(exc).splitlines()[0]})"
        ) from None
    return model, tokenizer
