"""The config described: every field of every section with its type, default, docstring, and
the value each preset gives it. The configuration reference (``docs/reference/config.md``)
is generated from this, so the documentation cannot drift from the dataclasses.

The docstrings are the string literals under each field (attribute docstrings), read from
the source with :mod:`ast`: Python keeps no such docstring at run time.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from dapo.config import presets
from dapo.config.sections import Config, is_subsection, key_of, leaves


@dataclass(frozen=True)
class FieldInfo:
    section: str
    name: str
    type: str
    default: Any
    doc: str
    presets: dict[str, Any]  # preset name -> the value it sets, where it differs from default

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


@cache
def field_docs(section: type) -> dict[str, str]:
    """Field name -> its attribute docstring (the string literal right under the field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(section)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def section_classes() -> dict[str, type]:
    """Section name -> its dataclass, in the order of :class:`Config`."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def type_name(typ: Any) -> str:
    """A field type as a reader writes it: ``int``, ``list[int]``, ``"a" | "b"``."""
    if typing.get_origin(typ) is typing.Literal:
        return " | ".join(f'"{a}"' for a in typing.get_args(typ))
    if isinstance(typ, type) and not typing.get_args(typ):
        return typ.__name__
    return str(typ).replace("typing.", "")


def _flatten(cfg: Config) -> dict[str, Any]:
    return leaves(cfg)


def preset_values() -> dict[str, dict[str, Any]]:
    """Preset name -> {field: value} for every field it sets to other than the default.

    Bases are applied to the dataclass defaults (the paper base is those defaults), and each
    algorithm preset to the same defaults, as ``load_config`` applies it after a base.
    """
    defaults = _flatten(Config())
    out: dict[str, dict[str, Any]] = {}
    for name, preset in {**presets.BASES, **presets.ALGORITHMS}.items():
        values = _flatten(preset(Config()))
        out[name] = {k: v for k, v in values.items() if v != defaults[k]}
    return out


def describe() -> list[FieldInfo]:
    """Every field of every section, in declaration order; a subsection's fields in its
    place, named ``lora.rank`` in the ``model`` section."""
    by_preset = preset_values()
    infos: list[FieldInfo] = []
    for section, cls in section_classes().items():
        infos += _fields(section, "", cls, by_preset)
    return infos


def _fields(section: str, prefix: str, cls: type, by_preset: dict) -> list[FieldInfo]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    infos = []
    for f in dataclasses.fields(cls):
        if is_subsection(hints[f.name]):
            infos += _fields(section, f"{prefix}{f.name}.", hints[f.name], by_preset)
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        key = f"{section}.{prefix}{key_of(f.name)}"
        infos.append(
            FieldInfo(
                section=section,
                name=f"{prefix}{key_of(f.name)}",
                type=type_name(hints[f.name]),
                default=default,
                doc=docs.get(f.name, ""),
                presets={p: v[key] for p, v in by_preset.items() if key in v},
            )
        )
    return infos


def section_doc(section: str) -> str:
    """The section's own docstring, where its class has one (not the dataclass default)."""
    cls = section_classes()[section]
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else inspect.cleandoc(doc)
