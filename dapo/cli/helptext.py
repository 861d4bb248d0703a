"""What ``--help`` prints: the commands' docstrings (reStructuredText, for the API docs) as
plain text, each paragraph wrapped to the terminal and indented blocks (command lines) kept
as written."""

from __future__ import annotations

import argparse
import re
import textwrap

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without reST markup: ``:mod:`dapo.x``` and ````x```` become ``dapo.x`` and ``x``."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


class Formatter(argparse.HelpFormatter):
    """Descriptions in paragraphs (argparse's default runs them together), markup removed."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for block in re.split(r"\n\s*\n", textwrap.dedent(plain(text)).strip("\n")):
            lines = block.splitlines()
            if any(line.startswith(" ") for line in lines):  # command lines, a list: as written
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                joined = " ".join(line.strip() for line in lines)
                paragraphs.append(
                    textwrap.fill(joined, width, initial_indent=indent, subsequent_indent=indent)
                )
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return None if action.help is None else plain(action.help)


def apply(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every parser of its subcommands the plain-text formatter."""
    parser.formatter_class = Formatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply(sub)
