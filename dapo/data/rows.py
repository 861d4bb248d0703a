"""One row of a problem file, validated: a usable :class:`Row`, or a :class:`BadRow` naming
the field and the reason.

The DAPO format's ``prompt`` is a list of {role, content} messages and its answer is
``reward_model.ground_truth``; the flat format has a question and an answer column. A row is
wrapped in the DAPO instruction template here when asked (never twice).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dapo.data.prompts import PROMPT_PREFIX, dapo_prompt

EMPTY_ANSWER = "empty answer"
GROUND_TRUTH = "reward_model.ground_truth"
_MESSAGE_FIELDS = ("role", "content")


@dataclass(frozen=True)
class BadRow:
    row: int
    """0-based position of the row in the file (JSON Lines: among its non-blank lines)."""
    field: str
    reason: str

    def __str__(self) -> str:
        return f"row {self.row}, field {self.field}: {self.reason}"


@dataclass(frozen=True)
class Row:
    row: int
    messages: tuple[dict[str, str], ...]  # as the model will see them
    raw_messages: tuple[dict[str, str], ...]  # as the file has them
    answer: str
    answer_field: str
    data_source: str
    index: str | None  # extra_info.index


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "list"
    return {int: "int", float: "float", str: "string"}.get(type(value), type(value).__name__)


def _wrap(content: str) -> str:
    # Never wrap twice: the official files already carry the template.
    return content if content.startswith(PROMPT_PREFIX) else dapo_prompt(content)


def last_user(messages: tuple[dict[str, str], ...]) -> int | None:
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] == "user":
            return k
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(value: str) -> str:
    """``value``, checked to be text: JSON can spell a lone surrogate (``"\\ud800"``), which
    no tokenizer, terminal or file can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}), "
            "which is not text; the file's writer split a character: fix its encoding"
        ) from None
    return value


def _answer(value: Any) -> str:
    """The ground truth as a string, as written: the paper's verifier compares a \\boxed{}
    answer with it unnormalised, so even its spaces count. Raises ValueError with the reason
    (missing, not a string or an integer, or blank)."""
    if value is None:
        raise ValueError("missing")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(
            f"must be a string or an integer, got {json_type(value)} {_short(value)}"
            "; write it as a string if it is meant as text"
        )
    text = _text(str(value))
    if not text.strip():
        raise ValueError(EMPTY_ANSWER)
    return text


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if value is None:
        raise ValueError("missing")
    if not isinstance(value, list):
        raise ValueError(
            f"must be a list of {{role, content}} messages, got {json_type(value)} {_short(value)}"
        )
    if not value:
        raise ValueError("empty prompt (no messages)")
    out = []
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and all(isinstance(m.get(f), str) for f in _MESSAGE_FIELDS)):
            raise ValueError(
                f"message {k} must be a {{role, content}} pair of strings, got {_short(m)}"
            )
        out.append({"role": _text(m["role"]), "content": _text(m["content"])})
    if not any(m["content"].strip() for m in out):
        raise ValueError("empty prompt (no message has any content)")
    return tuple(out)


def _data_source(value: Any, default: str) -> str:
    # An empty one is missing (the docs' promise, as for extra_info.index): data.data_source.
    if value is None or value == "":
        return default
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a non-empty string, got {_short(value)}")
    return _text(value)


def _index(extra_info: Any) -> str | None:
    if extra_info is None:
        return None
    if not isinstance(extra_info, dict):
        raise ValueError(f"must be a struct (object), got {_short(extra_info)}")
    index = extra_info.get("index")
    if index is None or index == "":
        return None
    if isinstance(index, bool) or not isinstance(index, (str, int)):
        raise ValueError(f"index must be an integer or a string, got {_short(index)}")
    return _text(str(index))


def check_keys(question_key: str, answer_key: str) -> None:
    """Refuse flat column names that collide: one column read (or written, by ``convert --to
    flat``) as two fields would make every question its own answer, or its verifier."""
    if len({question_key, answer_key, "data_source"}) < 3:
        raise ValueError(
            f"the question key ({question_key!r}), the answer key ({answer_key!r}) and "
            "'data_source' must be three different columns; name them with --question-key/"
            "--answer-key (data.question_key/answer_key)"
        )


def parse_row(
    i: int,
    rec: Any,
    *,
    fmt: str,
    question_key: str,
    answer_key: str,
    data_source: str,
    wrap_template: bool,
) -> Row | BadRow:
    """Validate one row; the first problem found is returned as a BadRow."""
    if isinstance(rec, str):  # a JSON line that is not an object
        return BadRow(i, "(row)", rec)
    name = "prompt"
    try:
        if fmt == "dapo":
            raw = _messages(rec.get("prompt"))
            name = "reward_model"
            reward_model = rec.get("reward_model")
            if reward_model is None:
                raise ValueError("missing")
            if not isinstance(reward_model, dict):
                raise ValueError(f"must be a struct (object), got {_short(reward_model)}")
            name, answer_field = GROUND_TRUTH, GROUND_TRUTH
            answer = _answer(reward_model.get("ground_truth"))
            name = "data_source"
            source = _data_source(rec.get("data_source"), data_source)
            name = "extra_info"
            index = _index(rec.get("extra_info"))
        else:
            name = question_key
            question = rec.get(question_key)
            if question is None:
                raise ValueError("missing")
            if not isinstance(question, str):
                raise ValueError(f"must be a string, got {json_type(question)} {_short(question)}")
            if not _text(question).strip():
                raise ValueError("empty prompt (blank question)")
            raw = ({"role": "user", "content": question},)
            name = answer_field = answer_key
            answer = _answer(rec.get(answer_key))
            name = "data_source"
            source = _data_source(rec.get("data_source"), data_source)
            index = None
        messages = raw
        if wrap_template:
            name = "prompt" if fmt == "dapo" else question_key
            k = last_user(raw)
            if k is None:
                raise ValueError("has no user message to wrap in the DAPO template")
            wrapped = dict(raw[k], content=_wrap(raw[k]["content"]))
            messages = raw[:k] + (wrapped,) + raw[k + 1 :]
    except ValueError as exc:
        return BadRow(i, name, str(exc))
    return Row(i, messages, raw, answer, answer_field, source, index)


def parse_rows(
    records: Sequence[Any],
    fmt: str,
    *,
    question_key: str,
    answer_key: str,
    data_source: str,
    wrap: bool,
) -> Iterator[Row | BadRow]:
    """``parse_row`` of every record, in order (a str record: a line that was no object)."""
    for i, rec in enumerate(records):
        yield parse_row(
            i,
            rec,
            fmt=fmt,
            question_key=question_key,
            answer_key=answer_key,
            data_source=data_source,
            wrap_template=wrap,
        )
