"""``dapo export RUN [--step N] --out DIR [--merge]``: a checkpoint of a run as a Hugging Face
model directory (safetensors, config, tokenizer, and a generation config listing the run's
stop tokens), whichever way it was written: by one process, or as DCP shards by ``torchrun``
at any world size (gathered here, in one process). Evaluate it with ``dapo eval DIR``, load
it with ``from_pretrained(DIR)``, train from it with ``model.path=DIR``. A LoRA run's
checkpoint becomes a peft adapter directory (``PeftModel.from_pretrained(base, DIR)``), or
with ``--merge`` a whole model, the adapters merged into its base.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from dapo.config import ModelConfig, choices  # the standard library only

    export = subparsers.add_parser(
        "export",
        help="write a checkpoint of a run as a Hugging Face model directory",
        description=__doc__,
    )
    export.add_argument("run", type=Path, metavar="RUN", help="a run directory (runs/NAME)")
    export.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="the checkpoint of step N (default: the latest whole one; a newer one passed over "
        "is named in a warning)",
    )
    export.add_argument("--out", type=Path, required=True, metavar="DIR", help="new directory")
    export.add_argument(
        "--dtype",
        choices=choices(ModelConfig, "param_dtype"),
        help=(
            "the weights' dtype (default: as the checkpoint stores them, model.param_dtype; "
            "--merge over a bfloat16 or float16 base: float32, the merge unrounded)"
        ),
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run's checkpoint: the adapters merged into the base model's weights "
        "(default: a peft adapter directory)",
    )
    export.add_argument(
        "--base",
        metavar="MODEL",
        help="with --merge: the base model to merge into, a directory or Hub id (default: the "
        "run's model.path); it must be the base the adapters were trained on (its weights' "
        "SHA-256 is checked): for a base moved since the run; it replaces model.revision "
        "too (a Hub id is read at its default branch)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in DIR")
    export.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from dapo.api.exporting import export
    from dapo.models.write_errors import named_by

    with named_by(args.out):  # a full disk is --out's, not the temporary file's it met
        result = export(
            args.run,
            args.out,
            step=args.step,
            overwrite=args.overwrite,
            dtype=args.dtype,
            merge=args.merge,
            base=args.base,
        )
    print(result.out_dir)
    return 0
