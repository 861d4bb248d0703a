"""The pip command that adds an optional extra (``vllm``, ``lora``, ``gguf``) the way this copy
of dapo was installed: from a source checkout (editable, or on ``PYTHONPATH``), from a local
directory, or from PyPI. An error's hint then works when pasted."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

DIST = "dapo-rl"


def pip_install(extra: str, package_file: str = __file__) -> str:
    """``pip install ...`` for ``extra``, fitted to where ``package_file`` (this module) is."""
    checkout = Path(package_file).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():  # imported from a source tree
        return f"pip install -e '{checkout}[{extra}]'"
    try:
        direct = json.loads(metadata.distribution(DIST).read_text("direct_url.json") or "null")
    except (metadata.PackageNotFoundError, ValueError):
        direct = None
    if isinstance(direct, dict) and str(direct.get("url", "")).startswith("file://"):
        source = unquote(urlparse(direct["url"]).path)
        if Path(source).is_dir():  # installed from a directory that is still there
            return f"pip install '{source}[{extra}]'"
    return f"pip install '{DIST}[{extra}]'"
