"""Numbers read from a config file, kept with their text as written.

YAML 1.1, which PyYAML reads, takes ``0612`` for octal 394, ``12:30`` for base 60 (750),
``0x10`` for 16 and ``1.50`` for 1.5: ``run: {name: 0612}`` named the run ``394`` and
``train: {steps: 010}`` ran 8 steps, where the same on the command line is ``0612`` and 10.
A text field keeps the number's text; a number field refuses any but a decimal one, which
YAML 1.2 and a reader's eye would take otherwise.
"""

from __future__ import annotations

import re
from typing import Any

from dapo.config.yaml_files import WrittenNumber

_DECIMAL_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)")


def _kind(text: str) -> str | None:
    """What other than decimal YAML 1.1 reads the number ``text`` as; None for decimal."""
    digits = text.lstrip("+-")
    if ":" in digits:
        return "base 60 (as a time, h:m:s)"
    if digits[:2] in ("0x", "0b"):
        return {"0x": "hexadecimal", "0b": "binary"}[digits[:2]]
    return None if _DECIMAL_INT.fullmatch(digits) else "octal"


def file_number(number: WrittenNumber, typ: Any, where: str) -> Any:
    """The value of a config file's ``number`` for a field of type ``typ`` (``Optional`` and
    ``Literal`` already read as their type): the text as written for a text field, the number
    for any other when it is written in decimal; an error naming the field otherwise."""
    if typ is str:
        return number.text
    kind = None
    if typ in (int, float) and (isinstance(number.value, int) or ":" in number.text):
        kind = _kind(number.text)
    if kind is not None:
        raise ValueError(
            f"{where}: YAML reads {number.text} as {kind}, {number.value!r}: write the number "
            "in decimal"
        )
    return number.value
