"""YAML files dapo reads from elsewhere: a ``--config`` file, a recipe, a run's ``config.yaml``
(``dapo train --resume``, ``dapo export``, ``dapo eval --config``, ``dapo report``).

Read by a SafeLoader (no tag runs code) that refuses aliases: a few hundred bytes of nested
aliases (a "billion laughs") expand to billions of values once read, and dapo writes none.
Every way such a file can fail to read is an error naming it, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SHOWN_CHARS = 200
"""At most this many characters of a value read from a file are shown in an error."""


class YamlFileError(ValueError):
    """A YAML file dapo cannot read; the message names it, ``reason`` says why alone."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class _NoAliasLoader(yaml.SafeLoader):
    """A SafeLoader that stops at the first alias (an anchor alone is harmless)."""

    path = Path()

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            name = event.anchor if len(event.anchor) <= 40 else f"{event.anchor[:40]}..."
            raise YamlFileError(
                self.path,
                f"line {event.start_mark.line + 1}: a YAML alias (*{name}): dapo accepts no "
                "YAML anchors and aliases (&name, *name) in a file it reads, as a few hundred "
                "bytes of nested aliases expand to billions of values; write each value out",
            )
        return super().compose_node(parent, index)


def read_yaml_file(path: Path) -> Any:
    """The YAML document in ``path``, aliases refused. Raises ``OSError`` when the file cannot
    be read (the caller words it), and :class:`YamlFileError` when it is not UTF-8, not YAML,
    holds an alias, an integer past Python's digit limit, or nests deeper than the parser
    recurses."""
    try:
        loader = _NoAliasLoader(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise YamlFileError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    loader.path = path
    try:
        return loader.get_single_data()
    except YamlFileError:
        raise
    except yaml.YAMLError as exc:
        raise YamlFileError(path, f"not valid YAML: {exc}") from None
    except RecursionError:
        raise YamlFileError(
            path, "its lists or mappings nest deeper than the YAML reader recurses"
        ) from None
    except ValueError as exc:  # an int of more digits than int() converts
        raise YamlFileError(path, f"not a value dapo reads: {exc}") from None
    finally:
        loader.dispose()


def clipped_repr(value: Any) -> str:
    """``repr(value)``, its middle cut out past :data:`SHOWN_CHARS` characters: a value read
    from a file may be megabytes long, and an error shows what it is, not all of it."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    keep = SHOWN_CHARS // 2
    return f"{text[:keep]}...{text[-keep // 2 :]} ({len(text)} characters)"
