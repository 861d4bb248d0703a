"""The embedded task: multi-term integer arithmetic in the DAPO prompt format.

Deterministic from a seed, no download. A problem such as ``Compute 7 + 3 - 2 + 5.`` has a
worked solution of one line per operation and a final ``Answer: 13`` line, so responses
grow with the number of terms (2 to 4 terms: about 10 to 25 tokens), which is what makes
the overlong shaping of the demo bite.
"""

from __future__ import annotations

import random

from dapo.data import Problem, dapo_prompt

PHRASINGS = (
    "Compute {expr}.",
    "What is {expr}?",
    "Evaluate {expr}.",
    "Find the value of {expr}.",
    "Calculate {expr}.",
)
DATA_SOURCE = "arith"


def _expression(rng: random.Random, min_terms: int, max_terms: int, max_operand: int, ops: str):
    n = rng.randint(min_terms, max_terms)
    terms = [rng.randint(1, max_operand) for _ in range(n)]
    ops = [rng.choice(ops) for _ in range(n - 1)]
    return terms, ops


def worked_solution(terms: list[int], ops: list[str]) -> tuple[str, int]:
    """One line per operation, then the answer line the DAPO prompt asks for."""
    lines, acc = [], terms[0]
    for op, t in zip(ops, terms[1:], strict=True):
        nxt = acc + t if op == "+" else acc - t
        lines.append(f"{acc} {op} {t} = {nxt}")
        acc = nxt
    lines.append(f"Answer: {acc}")
    return "\n".join(lines), acc


def make_splits(
    num_train: int,
    num_val: int,
    *,
    seed: int,
    min_terms: int = 2,
    max_terms: int = 4,
    max_operand: int = 9,
    operators: str = "+",
) -> tuple[list[tuple[Problem, str]], list[tuple[Problem, str]]]:
    """Disjoint (train, held-out) lists of (problem, worked solution) pairs.

    The held-out split is drawn first, so its problems do not change with ``num_train``.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    splits = []
    for split, n in (("val", num_val), ("train", num_train)):
        out: list[tuple[Problem, str]] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 100 * n + 1000:
                raise ValueError(
                    f"could not draw {num_train} + {num_val} distinct problems with "
                    f"{min_terms}-{max_terms} terms up to {max_operand} ({operators!r}); lower "
                    "data.num_train / data.num_val or raise data.max_terms"
                )
            terms, ops = _expression(rng, min_terms, max_terms, max_operand, operators)
            expr = " ".join(
                [str(terms[0])] + [f"{o} {t}" for o, t in zip(ops, terms[1:], strict=True)]
            )
            if expr in seen:
                continue
            seen.add(expr)
            text = rng.choice(PHRASINGS).format(expr=expr)
            solution, answer = worked_solution(terms, ops)
            problem = Problem(
                uid=f"arith-{split}-{len(out)}",
                messages=({"role": "user", "content": dapo_prompt(text)},),
                answer=str(answer),
                data_source=DATA_SOURCE,
            )
            out.append((problem, solution))
        splits.append(out)
    val, train = splits
    return train, val
