"""The embedded task: multi-term integer arithmetic in the DAPO prompt format.

Deterministic from a seed, no download. A problem such as ``Compute 7 + 3 + 2 + 5.`` has a
worked solution, either on one line (``7 + 3 + 2 + 5 = 17``, the demo's ``direct`` style) or
one line per operation (``steps``), then the ``Answer: 17`` line the DAPO prompt asks for.
Responses grow with the number of terms (2 to 5 terms: 10 to 18 tokens in the direct style),
so the demo's L_max and L_cache are set just above the longest correct answer.

The task owns its settings (``ArithConfig``, the ``arith`` section of a run's config) and is
graded by the lenient rules (:mod:`dapo.reward.tasks.math_lenient`): its prompts ask for the same
``Answer:`` line, and the demo's published figures were measured with those rules.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Literal

from dapo.data.problems import Problem
from dapo.data.prompts import dapo_prompt
from dapo.reward.tasks.base import Task
from dapo.reward.tasks.math_lenient import lenient_score

PHRASINGS = (
    "Compute {expr}.",
    "What is {expr}?",
    "Evaluate {expr}.",
    "Find the value of {expr}.",
    "Calculate {expr}.",
)
DATA_SOURCE = "arith"
# Part of the embedded model's cache key: bump it whenever the problems a seed gives change.
TASK_VERSION = 1
STYLES = ("steps", "direct")
"""Worked-solution styles; ``mixed`` picks one of them per problem."""


@dataclass
class ArithConfig:
    """The ``arith`` section: the embedded task's problems (used when data.train_file is empty)."""

    num_train: int = 20000
    """RL training problems drawn from the embedded task."""
    num_val: int = 256
    """Held-out problems, disjoint from the training ones."""
    num_warmup: int = 4000
    """Problems of the embedded model's supervised warm-start, disjoint from both."""
    min_terms: int = 2
    """Fewest terms in a problem."""
    max_terms: int = 5
    """Most terms in a problem (more terms: longer, harder responses)."""
    operators: str = "+"
    """Operators the task draws from (any of ``+-*``; ``*`` is what the tool demo, too hard
    for the tiny model to compute in its head, multiplies)."""
    max_operand: int = 9
    """Largest term (terms are drawn from 1 to it): 99 makes products of two-digit numbers."""
    solution: Literal["direct", "steps", "mixed"] = "direct"
    """Worked-solution style of the warm-up: ``direct`` (one line), ``steps`` (a line per
    operation) or ``mixed`` (either, at random)."""
    tool_share: float = 0.0
    """Share of the warm-up's worked solutions that compute with the Python tool instead (a
    ```python block that prints the expression, its output block, then the Answer line): the
    format of ``env.class=math_tool``, shown on a minority so that RL has a tool use to
    reinforce (recipes/demo-tools.yaml). With ``prompt: chat``, also the share of the
    ``shots`` examples that do (the last ones, at least one when above 0)."""
    seed: int = 1234
    """Seed of the task's problems."""
    prompt: Literal["dapo", "chat"] = "dapo"
    """How a problem is put to the model: ``dapo``, the DAPO instruction template (the demo's
    model is warm-started on it); ``chat``, the bare question as the last user turn of a chat
    whose earlier turns are ``shots`` worked examples, for an instruct model that does not
    follow the DAPO instruction cold (SmolLM2-135M: ~2% of answers graded right with the
    template, ~30% with two examples)."""
    shots: int = 2
    """Worked examples before each question when ``prompt`` is ``chat``."""

    def check(self) -> list[str]:
        """What is wrong with these settings, one message per problem."""
        errors = []
        if not (self.num_train >= 1 and self.num_val >= 1):
            errors.append("arith.num_train and arith.num_val must be >= 1")
        if self.num_warmup < 1:
            errors.append("arith.num_warmup must be >= 1")
        if not (set(self.operators) <= set("+-*") and self.operators != ""):
            errors.append("arith.operators must be a non-empty string of +, - and *")
        if self.max_operand < 1:
            errors.append("arith.max_operand must be >= 1")
        if not 0 <= self.tool_share <= 1:
            errors.append("arith.tool_share must be in [0, 1]")
        if not 1 <= self.min_terms <= self.max_terms:
            errors.append("arith.min_terms must be >= 1 and <= arith.max_terms")
        if self.shots < 0:
            errors.append("arith.shots must be >= 0")
        return errors


def _expression(rng: random.Random, min_terms: int, max_terms: int, max_operand: int, ops: str):
    n = rng.randint(min_terms, max_terms)
    terms = [rng.randint(1, max_operand) for _ in range(n)]
    ops = [rng.choice(ops) for _ in range(n - 1)]
    return terms, ops


def worked_solution(terms: list[int], ops: list[str], style: str = "steps") -> tuple[str, int]:
    """The solution text and the answer.

    ``steps``: one line per operation (``7 + 3 = 10``, ``10 - 2 = 8``, ...); ``direct``: the
    whole expression equals the result on one line. Both end with the ``Answer:`` line the
    DAPO prompt asks for. (``mixed`` is resolved to one of the two by ``make_splits``.)
    """
    if style not in STYLES:
        raise ValueError(f"solution style must be one of {STYLES}, got {style!r}")
    lines, acc = [], terms[0]
    for op, t in zip(ops, terms[1:], strict=True):
        nxt = acc + t if op == "+" else acc - t if op == "-" else acc * t
        lines.append(f"{acc} {op} {t} = {nxt}")
        acc = nxt
    if style == "direct":
        lines = [f"{_expr(terms, ops)} = {acc}"]
    lines.append(f"Answer: {acc}")
    return "\n".join(lines), acc


def tool_solution(terms: list[int], ops: list[str]) -> tuple[str, int]:
    """The solution that computes with the Python tool: the code block, the output block the
    tool answers with (``dapo.env.python_tool.output_block``'s format), the Answer line.
    Operators apply left to right, as in :func:`worked_solution`."""
    _, answer = worked_solution(terms, ops, "direct")
    code = str(terms[0])
    for op, t in zip(ops, terms[1:], strict=True):
        code = (
            f"({code}) {op} {t}"
            if op == "*" and ("+" in code or "-" in code)
            else f"{code} {op} {t}"
        )
    return f"```python\nprint({code})\n```\n```output\n{answer}\n```\nAnswer: {answer}", answer


def _expr(terms: list[int], ops: list[str]) -> str:
    return " ".join([str(terms[0])] + [f"{o} {t}" for o, t in zip(ops, terms[1:], strict=True)])


# Share of the problem space each split owns. A problem's split is a function of its text alone,
# so the splits never share a problem, while each one samples the same mix of 2- to 5-term
# problems (drawing distinct problems instead would exhaust the 81 two-term ones and skew it).
SPLIT_SHARES = (("val", 0.1), ("warmup", 0.3), ("train", 0.6))


def _unit(text: str) -> float:
    """A stable hash of ``text`` in [0, 1)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2**64


def split_of(expr: str) -> str:
    """The split that owns ``expr``: a stable hash of its text, cut by ``SPLIT_SHARES``."""
    u = _unit(expr)
    for name, share in SPLIT_SHARES:
        if u < share:
            return name
        u -= share
    return SPLIT_SHARES[-1][0]


def make_splits(
    num_train: int,
    num_val: int,
    num_warmup: int = 0,
    *,
    seed: int,
    min_terms: int = 2,
    max_terms: int = 5,
    max_operand: int = 9,
    operators: str = "+",
    style: str = "direct",
    prompt: str = "dapo",
    shots: int = 2,
    tool_share: float = 0.0,
) -> tuple[list[tuple[Problem, str]], ...]:
    """(train, held-out, warm-up) lists of (problem, worked solution) pairs, i.i.d. per split.

    No problem is in two splits. The warm-up split is for the supervised warm-start only: were
    it the RL training split, the warm-started policy would have memorised the problems RL
    trains on, and RL would learn nothing that carries over to held-out problems. A split may
    repeat a problem (there are only 81 two-term sums), as a sample of the task would.

    ``prompt="chat"`` puts each question after ``shots`` worked examples (user question,
    assistant solution in the ``steps`` style); the examples are warm-up-split problems, so
    they are never a training or held-out problem, and the same for every question.
    ``tool_share``: the share of problems whose solution computes with the Python tool
    (:func:`tool_solution`), chosen by a hash of the problem's text (the stream of problems
    is the same at any share).
    """
    if prompt not in ("dapo", "chat"):
        raise ValueError(f"prompt must be 'dapo' or 'chat', got {prompt!r}")
    context = chat_examples(
        seed, shots, min_terms, max_terms, max_operand, operators, tool_share=tool_share
    )
    wanted = {"train": num_train, "val": num_val, "warmup": num_warmup}
    out: dict[str, list[tuple[Problem, str]]] = {name: [] for name in wanted}
    rng = random.Random(seed)
    while any(len(out[k]) < n for k, n in wanted.items()):
        terms, ops = _expression(rng, min_terms, max_terms, max_operand, operators)
        expr = _expr(terms, ops)
        # Drawn before the split check, so one split's size never shifts another's stream.
        text = rng.choice(PHRASINGS).format(expr=expr)
        this_style = style if style != "mixed" else rng.choice(STYLES)
        split = split_of(expr)
        if len(out[split]) >= wanted[split]:
            continue
        solution, answer = worked_solution(terms, ops, this_style)
        if tool_share and _unit(f"tool:{text}") < tool_share:
            solution, answer = tool_solution(terms, ops)
        question = dapo_prompt(text) if prompt == "dapo" else text
        problem = Problem(
            uid=f"arith-{split}-{len(out[split])}",
            messages=(
                *(context if prompt == "chat" else ()),
                {"role": "user", "content": question},
            ),
            answer=str(answer),
            data_source=DATA_SOURCE,
        )
        out[split].append((problem, solution))
    return out["train"], out["val"], out["warmup"]


def chat_examples(
    seed: int,
    shots: int,
    min_terms: int,
    max_terms: int,
    max_operand: int,
    operators: str,
    *,
    tool_share: float = 0.0,
) -> tuple[dict[str, str], ...]:
    """``shots`` worked examples as chat turns (user, assistant, ...), warm-up-split problems
    drawn from their own stream (the splits' stream is the same with or without them). The
    last ``ceil(shots x tool_share)`` compute with the Python tool (:func:`tool_solution`):
    the examples are an instruct model's warm-start, and the one nearest the question is the
    one it follows most."""
    rng, turns = random.Random(f"arith-shots-{seed}"), []
    tools = math.ceil(shots * tool_share)
    while len(turns) < 2 * shots:
        terms, ops = _expression(rng, max(min_terms, 2), max(max_terms, 2), max_operand, operators)
        if split_of(_expr(terms, ops)) != "warmup":
            continue
        solution, _ = worked_solution(terms, ops, "steps")
        if len(turns) // 2 >= shots - tools:
            solution, _ = tool_solution(terms, ops)
        question = rng.choice(PHRASINGS).format(expr=_expr(terms, ops))
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": solution}]
    return tuple(turns)


TASKS = (
    Task(
        DATA_SOURCE,
        lenient_score,
        "the embedded arithmetic task, graded by the lenient rules (its demo's figures were)",
    ),
)
