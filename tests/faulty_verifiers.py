"""Verifiers that misbehave on purpose, for tests of dapo.reward.pool.

They live in their own module, not in the test file, because worker processes
(forkserver or spawn) unpickle ``resolve`` by reference and must import it: pytest
puts ``tests/`` on ``sys.path``, multiprocessing passes ``sys.path`` to children, and
this module imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from dapo.reward.tasks.base import RewardFn, Score
from dapo.reward.tasks.math_dapo import math_score


def _raise(response: str, answer: str) -> Score:
    # Multi-line on purpose: a Fault's detail must still be one line.
    raise ValueError(f"cannot grade {response[:20]!r}\nsecond line")


def _raise_long(response: str, answer: str) -> Score:
    raise ValueError("x" * 1_000_000)


def _hang(response: str, answer: str) -> Score:
    while True:
        pass


def _sleep(response: str, answer: str) -> Score:
    time.sleep(3600)
    raise AssertionError("unreachable")


def _hog(response: str, answer: str) -> Score:
    # bytes(n) is calloc'ed: the address space grows (what RLIMIT_AS limits) while
    # untouched zero pages cost no RAM, so the test is gentle on the machine.
    kept = []
    while True:
        kept.append(bytes(50 * 2**20))


def _exit(response: str, answer: str) -> Score:
    os._exit(3)


def _segfault(response: str, answer: str) -> Score:
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(3600)
    raise AssertionError("unreachable")


def _sys_exit(response: str, answer: str) -> Score:
    sys.exit(0)


def _interrupt(response: str, answer: str) -> Score:
    raise KeyboardInterrupt  # Ctrl-C while grading: the caller's to act on


def _not_a_score(response: str, answer: str) -> Score:
    return 1.0  # type: ignore[return-value]


def _nan_score(response: str, answer: str) -> Score:
    return Score(score=float("nan"), correct=True, pred="1")


def _memory_error(response: str, answer: str) -> Score:
    raise MemoryError("simulated")


def _recurse(response: str, answer: str) -> Score:
    return _recurse(response, answer)


def _long_pred(response: str, answer: str) -> Score:
    return Score(score=-1.0, correct=False, pred="7" * 100_000)


def _huge_score(response: str, answer: str) -> Score:
    return Score(score=1e200, correct=True, pred="1")  # finite: it would pass a NaN check


def _chatty(response: str, answer: str) -> Score:
    print("x" * 10_000)  # Python's stdout: captured, capped
    os.write(1, b"y" * 10_000)  # the descriptor itself: a worker's goes to /dev/null
    return Score(score=1.0, correct=True, pred="1")


def _bytes_out(response: str, answer: str) -> Score:
    sys.stdout.write(b"raw bytes")  # type: ignore[arg-type]  # a text stream refuses bytes
    return Score(score=1.0, correct=True, pred="1")


def _str_correct(response: str, answer: str) -> Score:
    return Score(score=-1.0, correct="False", pred="")  # type: ignore[arg-type]  # truthy


def _int_vote(response: str, answer: str) -> Score:
    return Score(score=1.0, correct=True, pred="1", vote=1)  # type: ignore[arg-type]


def _numpy_correct(response: str, answer: str) -> Score:
    import numpy as np  # only here: the other verifiers' workers load no numpy

    return Score(score=1.0, correct=np.isclose(1.0, 1.0), pred="1")  # numpy.bool_: a bool


def _probe(response: str, answer: str) -> Score:
    # Reports where and with what it ran: "<pid> <torch imported?>".
    return Score(score=1.0, correct=True, pred=f"{os.getpid()} {'torch' in sys.modules}")


VERIFIERS: dict[str, RewardFn] = {
    "ok": math_score,
    "raise": _raise,
    "raise_long": _raise_long,
    "hang": _hang,
    "sleep": _sleep,
    "hog": _hog,
    "exit": _exit,
    "segfault": _segfault,
    "sys_exit": _sys_exit,
    "interrupt": _interrupt,
    "notascore": _not_a_score,
    "nan": _nan_score,
    "memory_error": _memory_error,
    "recurse": _recurse,
    "long_pred": _long_pred,
    "huge": _huge_score,
    "chatty": _chatty,
    "probe": _probe,
    "bytes_out": _bytes_out,
    "str_correct": _str_correct,
    "numpy_correct": _numpy_correct,
    "int_vote": _int_vote,
}


def resolve(data_source: str) -> RewardFn:
    try:
        return VERIFIERS[data_source]
    except KeyError:
        raise ValueError(f"no verifier {data_source!r}") from None
