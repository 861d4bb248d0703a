"""Which rows of a problem file are usable: the one verdict that ``load_problems``, ``dapo
data check`` and ``dapo data convert`` share, so that convert writes no row check lists.

A row is unusable when it does not parse (:mod:`dapo.data.rows`), when it repeats a problem
with another answer or shares an index with another prompt (:class:`Repeats`), or, where
the caller gives the tasks' rules (``dapo data`` gives the registry's ``Task.check_truth``;
this module sits below the registry), when its ground truth breaks its task's rules.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable

from dapo.data.rows import BadRow, Row

TruthRules = Callable[[str], Callable[[str], str | None] | None]
"""data_source -> its task's rule for ground truths (why one is unusable, or None), or None
for a task that grades any text."""


def _prompt_hash(messages: tuple[dict[str, str], ...]) -> str:
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class Repeats:
    """Which rows hold the same problem: the same ``extra_info.index``, else the same prompt."""

    def __init__(self) -> None:
        self.answers: dict[str, str] = {}  # uid -> ground truth of its first copy
        self.first_row: dict[str, int] = {}
        self.seen: Counter[str] = Counter()  # uid -> rows so far
        self._by_index: dict[str, str] = {}
        self._by_prompt: dict[tuple[tuple[str, str], ...], str] = {}
        self._prompts: dict[str, tuple[tuple[str, str], ...]] = {}  # uid -> first prompt

    def identify(self, r: Row) -> str | BadRow:
        """Count row ``r`` under its problem's uid and return the uid; a BadRow instead when it
        repeats a problem with another answer, or shares an index with another prompt."""
        key = tuple((m["role"], m["content"]) for m in r.messages)
        uid = self._by_index.get(r.index) if r.index is not None else None
        if uid is not None and key != self._prompts[uid]:
            # Two files concatenated, each indexed 0..N-1: the index alone would silently
            # merge two different problems (and blame the second one's answer).
            return BadRow(
                r.row,
                "extra_info.index",
                f"index {r.index} is also row {self.first_row[uid]}'s, whose prompt differs; "
                "give each problem its own index",
            )
        if uid is None:
            uid = self._by_prompt.get(key)
        if uid is not None and r.answer.strip() != self.answers[uid].strip():
            return BadRow(
                r.row,
                r.answer_field,
                f"ground truth {r.answer!r} differs from row {self.first_row[uid]}'s "
                f"{self.answers[uid]!r} for the same problem",
            )
        if uid is None:
            uid = r.index if r.index is not None else _prompt_hash(r.raw_messages)
            self.answers[uid] = r.answer
            self.first_row[uid] = r.row
            self._prompts[uid] = key
        if r.index is not None:
            self._by_index.setdefault(r.index, uid)
        self._by_prompt.setdefault(key, uid)
        self.seen[uid] += 1
        return uid


class Screen:
    """The verdict on each row of one file, in order: its problem's uid, or a BadRow."""

    def __init__(self, truth_rules: TruthRules | None = None) -> None:
        self.repeats = Repeats()
        self.truth_rules = truth_rules
        self.checked: Counter[str] = Counter()
        """data_source -> problems whose ground truth its task's rules checked (bad ones too)."""

    def __call__(self, r: Row | BadRow, data_source: str | None = None) -> str | BadRow:
        """Row ``r``'s uid, or why it is unusable. ``data_source``: the one the row will
        carry (``convert --data-source``), whose rules apply; default the row's own. Every
        copy of a problem whose ground truth breaks the rules is a bad row, not only the
        first: each would be written or trained on."""
        if isinstance(r, BadRow):
            return r
        uid = self.repeats.identify(r)
        source = data_source or r.data_source
        rule = None if self.truth_rules is None else self.truth_rules(source)
        if isinstance(uid, BadRow) or rule is None:
            return uid
        self.checked[source] += self.repeats.seen[uid] == 1
        reason = rule(r.answer)
        return uid if reason is None else BadRow(r.row, r.answer_field, reason)
