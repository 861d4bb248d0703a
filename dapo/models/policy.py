"""The one place a policy is loaded: model and tokenizer, device and dtype.

``model.path=embedded`` builds the demo's tiny Qwen2 (:mod:`dapo.models.demo`, warm-started on
the arith task and cached); any other path is a local Hugging Face directory or a Hub model id
(resolved to its snapshot in the Hugging Face cache: :mod:`dapo.models.hub`), loaded with
transformers. Cheap checks (the directory, the tokenizer, the context length) come apart from
the weights, so a run can make them before a load that takes minutes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

import torch

from dapo import dist
from dapo.config import Config, ModelConfig, choices
from dapo.data.problems import Problem
from dapo.models import hub
from dapo.models.casting import cast_weights

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in choices(ModelConfig, "param_dtype")
}
"""model.param_dtype's and model.compute_dtype's choices as torch dtypes."""

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def compute_device(name: str) -> torch.device:
    """The one device a run computes on, from ``model.device``, chosen once: every tensor of
    the run is made on it or moved to it (never found from a parameter: CPU offload keeps
    parameters on the CPU while the GPU computes).

    Under ``torchrun`` each rank has its own (:func:`dapo.dist.rank_device`: ``cuda:LOCAL_RANK``,
    or the one GPU a launcher such as ``srun`` shows each task), and a ``model.device`` that
    names another is refused. In one process, ``auto`` is ``cuda:0`` when a GPU is visible,
    else the CPU; ``cuda`` is the current CUDA device; ``cuda:N`` must be visible.
    """
    cuda = torch.cuda.is_available()
    if dist.launched():
        chosen = dist.launched_device()
        if name not in ("auto", chosen.type, str(chosen)):
            raise ValueError(
                f"model.device={name} under torchrun: each rank computes on its own device, "
                f"{chosen} for this one (LOCAL_RANK={os.environ.get('LOCAL_RANK', '0')}, "
                f"{torch.cuda.device_count() if cuda else 0} GPUs visible); set "
                "model.device=auto, or choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        return chosen
    if name == "auto":
        return torch.device("cuda", 0) if cuda else torch.device("cpu")
    if name.startswith("cuda"):
        if not cuda:
            raise ValueError(
                f"model.device={name} but no CUDA device is visible; use model.device=cpu"
            )
        index = int(name.split(":")[1]) if ":" in name else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"model.device={name} but only {torch.cuda.device_count()} GPUs are visible "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
        return torch.device("cuda", index)
    return torch.device(name)


def model_dir(cfg: Config, *, download: bool = True) -> Path:
    """The directory ``model.path`` names: itself, or the snapshot of a Hub model id in the
    Hugging Face cache (fetched there unless offline or not ``download``;
    :mod:`dapo.models.hub`)."""
    return hub.resolve(cfg.model.path, cfg.model.revision, download=download)


def check_model_path(cfg: Config) -> Path:
    """``model.path`` as a Hugging Face model directory (a Hub id resolved), or a ValueError
    that says what it is."""
    path = model_dir(cfg)
    if not (path / "config.json").is_file():
        from_hub = str(path) != cfg.model.path
        hint = f" (the Hub model {cfg.model.path}'s snapshot)" if from_hub else ""
        if not from_hub and not path.exists():
            hint = f" (no such directory{'' if path.is_absolute() else f' in {Path.cwd()}'})"
        if (path / "adapter_config.json").is_file():  # what `dapo export` of LoRA writes
            raise ValueError(
                f"model.path={path} is a LoRA adapter directory (adapter_config.json, no "
                "config.json), not a model: export the run merged, `dapo export RUN --merge "
                "--out DIR`, and give model.path=DIR"
            )
        raise ValueError(
            f"model.path={path}{hint} is not a Hugging Face model directory (no config.json); "
            "give a directory written by save_pretrained, a Hub model id (Qwen/Qwen2.5-0.5B), "
            "or model.path=embedded"
        )
    if refusal := hub.model_code_refusal(path):
        raise ValueError(refusal)
    return path


def load_tokenizer(cfg: Config) -> Any:
    """The run's tokenizer, without the model: left padding, a pad token."""
    if cfg.model.path == "embedded":
        from dapo.models.demo import build_tokenizer

        return build_tokenizer()
    return tokenizer_from_dir(model_dir(cfg))


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
        tokenizer = loader.from_pretrained(path, padding_side="left", trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        if refusal := hub.tokenizer_code_refusal(path, setting):  # not trust_remote_code
            raise ValueError(refusal) from None
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

    path = model_dir(cfg)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):
        if refusal := hub.model_code_refusal(path):  # not transformers' trust_remote_code
            raise ValueError(refusal) from None
        raise
    return getattr(config, "max_position_embeddings", None)


def stop_token_ids(
    model: torch.nn.Module, tokenizer: Any, extra: Sequence[int] = ()
) -> tuple[int, ...]:
    """Every token that ends a response: the tokenizer's EOS, the model's
    ``generation_config.eos_token_id`` (an id or a list: instruct models stop on several, and
    one that runs past its turn invents text whose last ``Answer:`` is graded), and ``extra``
    (``rollout.stop_token_ids``). Sorted, each once."""
    return generation_stop_ids(getattr(model, "generation_config", None), tokenizer, extra)


def generation_stop_ids(
    generation: Any, tokenizer: Any, extra: Sequence[int] = ()
) -> tuple[int, ...]:
    """:func:`stop_token_ids` from a generation config (None: none) rather than a model."""
    ids = {tokenizer.eos_token_id, *extra}
    listed = getattr(generation, "eos_token_id", None)
    ids.update(listed if isinstance(listed, (list, tuple)) else [listed])
    return tuple(sorted(i for i in ids if i is not None))


def generation_dtype(cfg: Config) -> torch.dtype:
    """The dtype a frozen copy of the policy samples in: bfloat16 when that is the compute
    dtype, else the trained weights' (the rule of :func:`dapo.training.copies.frozen_dtype`)."""
    if cfg.model.compute_dtype == "bfloat16":
        return torch.bfloat16
    return DTYPES[cfg.model.param_dtype]


def load_policy(
    cfg: Config,
    warmup_pairs: Sequence[tuple[Problem, str]] = (),
    tokenizer: Any = None,
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
    *,
    shard: bool = False,
    dtype: torch.dtype | None = None,
    training: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """The policy on ``device`` (default: :func:`compute_device` of ``model.device``) with its
    weights in ``dtype`` (default ``model.param_dtype``; a model directory is read in it, so
    a bfloat16 copy never passes through float32), and its tokenizer.

    The embedded tiny Qwen2 is warm-started on ``warmup_pairs`` (problem, worked solution)
    when it is not cached yet; any other ``model.path`` is loaded with transformers. With
    ``shard`` under ``torchrun``, a model stored as safetensors is loaded straight into FSDP
    shards (:mod:`dapo.models.sharded_load`: each rank reads only its rows), and the model
    returned is sharded; otherwise it is whole. With ``model.lora.rank`` > 0 it carries
    adapters, and only they are trainable (:mod:`dapo.models.lora`). The model's own dropout
    is off (:mod:`dapo.models.dropout`), and rotary embeddings that change with a call's
    length are pinned (:mod:`dapo.models.rotary`); each said in ``log`` when ``training``.
    """
    device = device or compute_device(cfg.model.device)
    dtype = dtype or DTYPES[cfg.model.param_dtype]
    if shard and dist.active() and cfg.model.path != "embedded":
        from dapo.models import sharded_load

        model = sharded_load.load(cfg, check_model_path(cfg), device, log)
        if model is not None:
            tokenizer = tokenizer or load_tokenizer(cfg)
            check_vocabulary(model, tokenizer, cfg.model.path)
            return _settled(model, log if training else None), tokenizer
    if cfg.model.path == "embedded":
        model, tokenizer = _embedded(cfg, warmup_pairs, log)
    else:
        model, tokenizer = _pretrained(cfg, tokenizer, dtype)
        check_vocabulary(model, tokenizer, cfg.model.path)
    model = cast_weights(model, dtype, device)
    _settled(model, log if training else None)  # before LoRA's dropout, which is a setting
    if cfg.model.lora.rank:
        from dapo.models import lora

        lora.apply(model, cfg.model.lora, seed=cfg.train.seed)
        log(lora.describe(model))
    return model, tokenizer


def _settled(model: torch.nn.Module, log: Callable[[str], None] | None):
    """``model`` without its dropout, its length-dependent rotary embeddings pinned: each
    row's log-probs its own, whatever else is in the forward pass."""
    from dapo.models import dropout, rotary

    for note in (dropout.disable(model), rotary.pin(model)):
        if note is not None and log is not None:
            log(note)
    return model


def check_vocabulary(model: torch.nn.Module, tokenizer: Any, path: str | Path) -> None:
    """Refuse a tokenizer with ids the model has no embedding for (a tokenizer from another
    model, or tokens added without resizing the model): the first such id in a prompt or an
    observation would stop the run with an IndexError deep in the forward pass."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(
            f"model.path={path}: the tokenizer has {len(tokenizer):,} tokens but the model "
            f"embeds only {rows:,} (ids {rows:,} and up have no embedding); use the tokenizer "
            "saved with this model, or, after adding tokens, model.resize_token_embeddings("
            "len(tokenizer)) and save both"
        )


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
            *((a.max_operand, a.tool_share) if (a.max_operand, a.tool_share) != (9, 0.0) else ()),
        ),
        log=log,
    )


def _pretrained(cfg: Config, tokenizer: Any, dtype: torch.dtype):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from dapo.models import pickled, sharded_load

    path = check_model_path(cfg)
    tokenizer = tokenizer or load_tokenizer(cfg)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=False, output_loading_info=True
        )
    except (OSError, ValueError, SafetensorError, UnpicklingError) as exc:
        if pickled.refused_pickle(exc):
            raise pickled.pickled_weights(path) from None
        hub_error = hub.no_safetensors(cfg.model.path, cfg.model.revision, path)
        if isinstance(exc, OSError) and hub_error is not None:
            raise hub_error from None  # not "no file named model.safetensors" in the snapshot
        # A truncated or garbled safetensors file (transformers may raise any of these for
        # it, and SafetensorError names no file): say which, and the fix.
        sharded_load.check_weight_files(path)
        if isinstance(exc, SafetensorError):
            raise sharded_load.damaged_weights(None, path, exc) from None
        raise ValueError(
            f"model.path={path}: not a causal language model transformers can load "
            f"({str(exc).splitlines()[0]})"
        ) from None
    except RuntimeError as exc:
        if "mismatch" not in str(exc):  # transformers 5: ignore_mismatched_sizes; 4: size mismatch
            raise
        raise ValueError(
            f"model.path={path}: a weight in its files has another shape than the model its "
            f"config.json builds ({str(exc).splitlines()[0]}); re-save the model with "
            "model.save_pretrained(DIR, safe_serialization=True), or check that config.json "
            "belongs to these weights"
        ) from None
    missing = _untrained_weight(model, info["missing_keys"])
    if missing is not None:
        # transformers initialised it at random and says so only in a log table; a sharded
        # load (dapo.models.sharded_load) refuses the same directory in these words.
        raise sharded_load.missing_weight(missing, path, _weights_file(path, missing))
    return model, tokenizer


def _untrained_weight(model: torch.nn.Module, missing_keys: Sequence[str]) -> str | None:
    """The first of ``missing_keys`` (what ``from_pretrained`` reports the files lacked) that
    names a parameter left at its random initialisation, or the first parameter left on the
    meta device (transformers 4 reports no key that the index names but its file lacks):
    not a buffer (the constructor's values are the model's own), and not a weight tied to
    one that was loaded (a tied ``lm_head`` is stored once, as the embedding)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(missing_keys) | {name for name, p in params.items() if p.is_meta}
    loaded = {id(p) for name, p in params.items() if name not in missing}
    for name in sorted(missing):
        if name in params and id(params[name]) not in loaded:
            return name
    return None


def _weights_file(path: Path, name: str) -> Path | None:
    """The safetensors file of ``path`` that should hold the weight ``name``: the one file,
    or the one its index names (None: the index names none, or only .bin weights)."""
    from dapo.models import sharded_load

    if (path / sharded_load.SAFE_INDEX).is_file():
        return (sharded_load.weight_files(path) or {}).get(name)
    single = path / sharded_load.SAFE_WEIGHTS
    return single if single.is_file() else None
