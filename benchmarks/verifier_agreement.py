"""How the reward modes grade one corpus of model-like responses, against verl's references.

    python benchmarks/verifier_agreement.py [--n 5000] [--seed 0] [--reference DIR]

Prints, on the corpus of ``tests/test_math_dapo.py`` (answers in 21 spellings and 7 marker
forms, 15% boxed answers without an ``Answer:`` line): how often ``dapo`` (verl 0.4.1's rules)
and ``math_dapo_boxed`` (verl 0.9.1's) agree with their reference files and with each other,
and how ``lenient`` differs from each. The references are ``math_dapo-<version>.py`` in DIR
(``.verl-reference/``, filled by ``.ci/run``); a missing one is reported, not compared.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_math_dapo import model_like_corpus  # noqa: E402  (the tests' corpus, not a copy of it)

from dapo.reward.tasks.math_dapo import math_score, math_score_boxed  # noqa: E402
from dapo.reward.tasks.math_lenient import lenient_score  # noqa: E402


def _reference(path: Path) -> Callable | None:
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(path.stem.replace(".", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", type=Path, default=ROOT / ".verl-reference")
    args = parser.parse_args()
    corpus = model_like_corpus(args.n, seed=args.seed)
    n = len(corpus)
    print(f"{n} responses (seed {args.seed})")
    for version, ours in (("0.4.1", math_score), ("0.9.1", math_score_boxed)):
        ref = _reference(args.reference / f"math_dapo-{version}.py")
        if ref is None:
            print(f"verl {version}: no reference file in {args.reference}")
            continue
        same = sum(
            (r := ref(x, t))["acc"] == (s := ours(x, t)).correct and r["pred"] == s.pred
            for x, t in corpus
        )
        print(f"{ours.__name__} against verl {version}: {same} of {n} identical (grade and pred)")
    both = sum(math_score(x, t).correct == math_score_boxed(x, t).correct for x, t in corpus)
    boxed_only = sum(
        math_score_boxed(x, t).correct and not math_score(x, t).correct for x, t in corpus
    )
    print(
        f"dapo (0.4.1) and math_dapo_boxed (0.9.1) agree on {both} of {n} ({100 * both / n:.2f}%);"
        f" {boxed_only} are right only with the boxed fallback"
    )
    for name, grade in (("dapo", math_score), ("math_dapo_boxed", math_score_boxed)):
        only = sum(grade(x, t).correct and not lenient_score(x, t).correct for x, t in corpus)
        lenient = sum(lenient_score(x, t).correct and not grade(x, t).correct for x, t in corpus)
        print(
            f"lenient against {name}: {only + lenient} differ ({only} right only under {name}, "
            f"{lenient} only under lenient)"
        )


if __name__ == "__main__":
    main()
