"""``model.path`` as a directory: a local one, or a Hugging Face Hub model id resolved to its
snapshot in the Hub cache, the one ``from_pretrained`` would read.

A path that is an existing directory is a local model. Anything else shaped like a Hub id
(``Qwen/Qwen2.5-Math-1.5B``) is looked up with ``huggingface_hub``: in its cache
(``HF_HOME``, ``HF_HUB_CACHE``) and, unless ``HF_HUB_OFFLINE=1``, downloaded there first. Only
what dapo reads is fetched: safetensors weights, JSON configs and the tokenizer's files (its
chat templates included), never pickled ``*.bin`` weights or code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
"""The files of a Hub model dapo reads: configs, weights, tokenizer (sentencepiece,
merges/vocab, tiktoken) and its chat templates (``chat_template.jinja``, what recent
transformers writes, ``additional_chat_templates/*.jinja``, the older ``chat_template.json``;
a pattern matches in folders too). Pickled weights (``*.bin``, ``*.pt``) and code stay on
the Hub."""


def download_command(repo: str, revision: str | None = None) -> str:
    """The ``hf download`` command that fetches into the Hub cache what :func:`resolve` does."""
    at = f" --revision {revision}" if revision else ""
    return f"hf download {repo}{at} --include " + " ".join(f"'{p}'" for p in ALLOW_PATTERNS)


class HubModelError(ValueError):
    """A Hub model id that cannot be resolved; the message names it and the fix."""


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` is shaped like a Hub model id (``name`` or ``org/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def is_hub_id(path: str) -> bool:
    """Whether a model path names a Hub model: nothing there locally (a file that is there,
    ``model.gguf``, is a file, not an id), and shaped like an id."""
    return not Path(path).expanduser().exists() and looks_like_hub_id(path)


def file_refusal(path: str, setting: str = "model.path") -> str | None:
    """Why ``path``, an existing file rather than a directory, is no model (None when it is
    no file): a GGUF file is imported first, any other file's directory is the model."""
    local = Path(path).expanduser()
    if local.is_dir() or not local.exists():
        return None
    if local.suffix.lower() == ".gguf":
        return (
            f"{setting}={path} is a GGUF file, not a model directory: import it first, "
            f"`dapo model import {path} OUT_DIR`, and give OUT_DIR"
        )
    fix = "give the directory that holds the model's config.json, weights and tokenizer"
    if (local.parent / "config.json").is_file():
        fix = f"give its directory, {setting}={local.parent}"
    return f"{setting}={path} is a file, not a model directory: {fix}"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_root() -> str:
    """The Hub cache a model id resolves into (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve(
    path: str,
    revision: str | None = None,
    *,
    setting: str = "model.path",
    download: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """The local directory of the model ``path`` names: ``path`` itself when it is a
    directory, else the snapshot of the Hub id ``path`` at ``revision`` (default ``main``) in
    the cache, downloaded first unless offline or not ``download``."""
    local = Path(path).expanduser()
    if refusal := file_refusal(path, setting):
        raise ValueError(refusal)
    if not is_hub_id(path):
        if revision:
            raise HubModelError(
                f"model.revision={revision} is set, but {setting}={path} is a local path, not a "
                "Hub model id; unset model.revision"
            )
        return local
    key = (path, revision, cache_root(), offline(), download)
    if key not in _RESOLVED:
        _RESOLVED[key] = _snapshot(path, revision, setting, download=download, log=log)
    return _RESOLVED[key]


_RESOLVED: dict[tuple, Path] = {}


def _snapshot(
    repo: str, revision: str | None, setting: str, *, download: bool, log: Callable[[str], None]
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision}" if revision else ""
    local_only = offline() or not download
    where = f"{setting}={repo}{at}"
    if not local_only:
        log(f"model: {repo}{at} from the Hugging Face Hub into {cache_root()} (if not there yet)")
    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            allow_patterns=list(ALLOW_PATTERNS),
            local_files_only=local_only,
        )
    except GatedRepoError:
        raise HubModelError(
            f"{where}: a gated model; accept its terms on huggingface.co/{repo} and log in "
            "(hf auth login, or set HF_TOKEN), then run again"
        ) from None
    except RepositoryNotFoundError:
        raise HubModelError(
            f"{where}: no such local directory, and no Hub model of that id (or a private "
            "one: log in with hf auth login); check the spelling"
        ) from None
    except RevisionNotFoundError:
        raise HubModelError(
            f"{where}: the Hub model has no revision {revision!r}; give a branch, tag or "
            "commit it has in model.revision"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if offline() else "the Hub could not be reached"
        raise HubModelError(
            f"{where}: no such local directory, and the Hub model is not in the Hugging Face "
            f"cache ({cache_root()}) while {why}. Fetch it where there is network: "
            f"{download_command(repo, revision)} (same HF_HOME), "
            "or download it to a directory and give that path. If it is a directory: a "
            f"relative path is read from the working directory, {Path.cwd()} (a run saved "
            "before dapo kept its paths absolute names it as given: resume such a run from "
            "where it started)"
        ) from None
    return Path(folder)


def known_model_type(model_type: object) -> bool:
    """Whether transformers has the architecture of ``model_type`` (a config.json's): a
    config with ``auto_map`` for one it has not can load only by running the code beside it."""
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def model_code_refusal(path: Path) -> str | None:
    """Why the model directory ``path`` loads only by running code that came with it: its
    ``config.json`` names code of its own (``auto_map``) for a model type transformers does
    not have (transformers would say to pass ``trust_remote_code=True``, which dapo never
    does); None otherwise, or when there is no config to read."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "auto_map" not in config:
        return None
    kind = config.get("model_type")
    if known_model_type(kind):
        return None
    shown = "(none)" if kind is None else repr(kind)
    return (
        f"model.path={path}: its model_type {shown} is unknown to transformers and dapo runs "
        "no model code (config.json's auto_map names code that came with the model); give a "
        "model of an architecture transformers has (a newer transformers may have this one)"
    )


def tokenizer_code_refusal(path: Path, setting: str = "model.path") -> str | None:
    """Why the tokenizer in ``path`` loads only by running code that came with it: its
    ``tokenizer_config.json`` maps ``AutoTokenizer`` to code of its own (``auto_map``), as
    :func:`model_code_refusal` for the model; None when it maps none, or when its
    ``tokenizer_class`` is one transformers has (then the map is not followed, and the load
    failed for another reason)."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    auto = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto, dict) or "AutoTokenizer" not in auto:
        return None
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    kind = config.get("tokenizer_class")
    if isinstance(kind, str) and any(tokenizer_class_from_name(k) for k in (kind, kind + "Fast")):
        return None  # transformers' own class (as AutoTokenizer looks it up): not the code
    shown = repr(kind) if isinstance(kind, str) and len(kind) <= 80 else "(none)"
    return (
        f"{setting}={path}: its tokenizer class {shown} is not one transformers has and dapo "
        "runs no model code (tokenizer_config.json's auto_map names code that came with the "
        "model); give a model whose tokenizer transformers has (a newer transformers may "
        "have this one)"
    )


def no_safetensors(repo: str, revision: str | None, path: Path) -> HubModelError | None:
    """The error for a Hub model id whose snapshot ``path`` holds no weights because the
    repository has no ``*.safetensors`` (dapo fetches no pickled ``*.bin``), else None."""
    if not is_hub_id(repo) or Path(repo) == path:
        return None
    if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
        return None
    at = f" at revision {revision}" if revision else ""
    return HubModelError(
        f"model.path={repo}{at}: no weights dapo can read; dapo fetches only safetensors "
        "weights (*.safetensors) from the Hub, never pickled ones (*.bin), and this "
        "repository seems to have none. Convert its weights to safetensors locally, from a "
        "copy you trust (torch.load(FILE, weights_only=False), load them into the model, "
        "model.save_pretrained(DIR, safe_serialization=True)) and give model.path=DIR, or "
        "give a model.revision that has .safetensors files"
    )
