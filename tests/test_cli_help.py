"""``dapo --help`` and every command's help: plain text (no reST markup, no notes meant for
developers), every option explained with its default, ``dapo --version``."""

from __future__ import annotations

import argparse

import pytest

from dapo import __version__
from dapo.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, name: str = "dapo"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


PARSERS = dict(_parsers(build_parser()))


def test_every_command_is_listed():
    assert {"dapo train", "dapo eval", "dapo export", "dapo data check", "dapo model import"} <= (
        set(PARSERS)
    )


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_is_plain_text_and_every_option_has_help_and_default(name):
    parser = PARSERS[name]
    text = parser.format_help()
    for markup in ("``", ":mod:", ":func:", ":class:", ":meth:", "Imports only the standard"):
        assert markup not in text, (name, markup)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        label = action.option_strings or [action.dest]
        assert action.help and action.help != argparse.SUPPRESS, (name, label)
        default = action.default
        if action.option_strings and default not in (None, False, "", argparse.SUPPRESS, []):
            shown = formatter._expand_help(action)
            assert f"default {default}" in shown or f"default: {default}" in shown, (
                name, label, shown
            )  # fmt: skip


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"dapo {__version__}"


def test_the_exit_statuses_are_documented():
    text = PARSERS["dapo"].format_help()
    for line in ("  0    done", "  1    the run failed", "  2    bad settings or input"):
        assert line in text
    words = " ".join(PARSERS["dapo data check"].format_help().split())  # wrapped to the terminal
    assert "Exit status 0 when every row is usable, 1 when some are not" in words
    assert "2 when FILE cannot be read as problems" in words
