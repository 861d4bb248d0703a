"""YAML files dapo reads from elsewhere: a ``--config`` file, a recipe, a run's ``config.yaml``
(``dapo train --resume``, ``dapo export``, ``dapo eval --config``, ``dapo report``).

Read by a SafeLoader (no tag runs code) that refuses aliases: a few hundred bytes of nested
aliases (a "billion laughs") expand to billions of values once read, and dapo writes none.
A key written twice in one mapping is refused too: YAML keeps the last silently, so a second
``optim:`` block dropped the whole first one. A file over :data:`MAX_FILE_BYTES` is refused
before it is parsed. Every way such a file can fail to read is an error naming it, never a
traceback.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml

SHOWN_CHARS = 200
"""At most this many characters of a value read from a file are shown in an error."""

MAX_FILE_BYTES = 1 << 20
"""The largest YAML file dapo reads (1 MiB): a run's saved ``config.yaml`` is a few KiB, and
the pure-Python parser takes seconds a megabyte."""

_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_WRITTEN_TAG = "tag:dapo,2024:written-number"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlFileError(ValueError):
    """A YAML file dapo cannot read; the message names it, ``reason`` says why alone."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class WrittenNumber:
    """A number of a config file, with its text as written (``read_yaml_file(...,
    numbers_as_written=True)``): YAML 1.1 reads ``0612`` as octal 394 and ``12:30`` as 750,
    and a text field keeps what was written (:func:`dapo.config.file_values.file_number`)."""

    __slots__ = ("text", "value")

    def __init__(self, value: int | float, text: str) -> None:
        self.value, self.text = value, text

    def __repr__(self) -> str:
        return self.text


def shorten(text: str) -> str:
    """``text``, its middle cut out past :data:`SHOWN_CHARS` characters."""
    if len(text) <= SHOWN_CHARS:
        return text
    keep = SHOWN_CHARS // 2
    return f"{text[:keep]}...{text[-keep // 2 :]} ({len(text)} characters)"


def repeated_key(root: yaml.Node, prefix: str = "") -> tuple[str, int, int] | None:
    """A key written twice in one mapping of the document ``root`` (YAML keeps the last one
    silently): its dotted place (after ``prefix``), the line of the repeat and the line of
    the first; None when no key repeats. Keys are compared as written (``lr`` and ``"lr"``
    are one key)."""
    stack, seen_nodes = [(root, prefix)], set()
    while stack:  # not recursive: a document may nest as deep as the parser recurses
        node, path = stack.pop()
        if id(node) in seen_nodes:  # an alias (where allowed) reaches a node twice
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name is None or key.tag == _MERGE_TAG:
                continue  # a list or mapping as a key: the constructor names it
            where = f"{path}.{name}" if path else name
            line = key.start_mark.line + 1
            if (key.tag, name) in first:
                return where, line, first[key.tag, name]
            first[key.tag, name] = line
            stack.append((value, where))
    return None


class _FileLoader(yaml.SafeLoader):
    """A SafeLoader that stops at the first alias (an anchor alone is harmless) and at a key
    written twice; with ``numbers_as_written``, a plain number that is a value (not a key)
    becomes a :class:`WrittenNumber`."""

    path = Path()
    numbers_as_written = False

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
        node = super().compose_node(parent, index)
        # A mapping's value (index: its key node) or a list's item, never a key, and a plain
        # number YAML resolved itself (an explicit !!int is read as it says).
        is_key = isinstance(parent, yaml.MappingNode) and index is None
        if self.numbers_as_written and parent is not None and not is_key:
            plain = isinstance(node, yaml.ScalarNode) and node.style is None
            if plain and node.tag in _NUMBER_TAGS and node.tag == self._implicit(node):
                node.tag = _WRITTEN_TAG
        return node

    def _implicit(self, node: yaml.ScalarNode) -> str:
        return self.resolve(yaml.ScalarNode, node.value, (True, False))

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        repeated = None if node is None else repeated_key(node)
        if repeated is not None:
            where, line, first = repeated
            raise YamlFileError(
                self.path,
                f"line {line}: {shorten(where)} is written twice (first on line {first}), and "
                "YAML keeps only the last, dropping the first silently: write it once (merge "
                "the two into one)",
            )
        return node

    def construct_written_number(self, node: yaml.ScalarNode) -> WrittenNumber:
        construct = self.yaml_constructors[self._implicit(node)]
        return WrittenNumber(construct(self, node), node.value)


_FileLoader.add_constructor(_WRITTEN_TAG, _FileLoader.construct_written_number)


def read_override_value(text: str, key: str, numbers_as_written: bool) -> Any:
    """The list or mapping of the command line's ``key=text`` (``[1, 2]``, ``{rank: 8}``),
    a key written twice refused (YAML would keep the last, silently); with
    ``numbers_as_written``, read as a config file's values are: each plain number a
    :class:`WrittenNumber`, so that ``010`` and ``0x10`` are refused as in a file, not read as
    YAML 1.1's octal and hex."""
    repeated = repeated_key(yaml.compose(text, Loader=yaml.SafeLoader), key)
    if repeated is not None:
        raise ValueError(f"{repeated[0]} is written twice in {clipped_repr(text)}; write it once")
    loader = _FileLoader(text)
    loader.path, loader.numbers_as_written = Path("<command line>"), numbers_as_written
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_file(path: Path, *, numbers_as_written: bool = False) -> Any:
    """The YAML document in ``path``, aliases and repeated keys refused. Raises ``OSError``
    when the file cannot be read (the caller words it), and :class:`YamlFileError` when it is
    over :data:`MAX_FILE_BYTES`, not UTF-8, not YAML, holds an alias or a key twice, an
    integer past Python's digit limit, or nests deeper than the parser recurses.

    ``numbers_as_written``: each plain number that is a value is a :class:`WrittenNumber`
    (a config file's, read by :func:`dapo.config.load_config`)."""
    with open(path, "rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise YamlFileError(
            path,
            f"larger than {MAX_FILE_BYTES // (1 << 20)} MiB, the most dapo reads from a YAML "
            "file (a run's config.yaml is a few KiB): give the config file meant",
        )
    try:  # as Path.read_text reads it: universal newlines
        text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()
    except UnicodeDecodeError as exc:
        raise YamlFileError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    loader = _FileLoader(text)
    loader.path, loader.numbers_as_written = path, numbers_as_written
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
    return shorten(repr(value))
