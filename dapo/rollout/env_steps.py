"""An environment's answers to the turns that ended together: its ``step`` calls on a few
threads, each bounded in time.

``step`` reads the model's text, which is untrusted: a regex that backtracks on it, or a loop
that never ends, would otherwise hang training or evaluation without a word. A thread cannot
be stopped, so one past its deadline is left behind (a daemon: it keeps no process alive) and
the run stops, naming the environment, the row and the turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dapo.env import History, Observation

POLL_S = 0.05
"""How often the caller looks for a step past its deadline while the steps run."""


def run_steps(
    step: Callable[[History], Observation],
    histories: Sequence[History],
    *,
    workers: int,
    timeout_s: float,
    name: str,
) -> list[Observation]:
    """``step`` of every history, ``workers`` at a time, in order; the first exception a step
    raised is raised here once every step has ended, and a step that runs past ``timeout_s``
    seconds raises a TimeoutError naming ``name`` (the environment's class)."""
    results: list[Any] = [None] * len(histories)
    todo = list(range(len(histories)))[::-1]  # popped from the end: in order
    running: dict[int, float] = {}
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
                running[i] = time.monotonic()
            try:
                results[i] = (step(histories[i]), None)
            except BaseException as exc:  # raised again in the caller's thread
                results[i] = (None, exc)
            with lock:
                del running[i]

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(workers, len(todo)))]
    try:  # from the first start: a Ctrl-C may land while a thread starts
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(POLL_S)
                with lock:
                    late = [i for i, t in running.items() if time.monotonic() - t > timeout_s]
                    if late:
                        todo.clear()  # the other threads take no more
                if late:
                    raise TimeoutError(_late(histories[min(late)], timeout_s, name))
    except BaseException:  # a Ctrl-C too: no step starts after it
        with lock:
            todo.clear()
        raise
    for _, exc in results:
        if exc is not None:
            raise exc
    return [value for value, _ in results]


def _late(history: History, timeout_s: float, name: str) -> str:
    return (
        f"env.class: {name}.step ran past env.step_timeout_s={timeout_s:g} s on row "
        f"{history.problem.uid} (turn {history.turns}): bound what it does with the model's "
        "text (a regex, a loop), or raise env.step_timeout_s"
    )
