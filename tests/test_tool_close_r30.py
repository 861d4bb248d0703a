"""The Python tool's helper processes stop when the run or evaluation that made them ends
(``Environment.close``), not at the interpreter's exit: there, Python 3.11 wakes each process
pool's manager thread without its lock, and one error skips the joins, so that a run which had
trained to its end hung at exit (a fresh-clone CI of 0674d29, generation ahead of training
with the tool). A pool the run closed leaves no manager thread for the exit to wait on."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import pytest
from helpers import quiet_fit, save_model, setup_run

from dapo.cli import main
from dapo.env import Environment, MathTool, Observation, load_environment
from dapo.env.python_tool import Launcher
from dapo.reward import sandbox
from dapo.rollout import env_steps
from dapo.rollout.env_steps import run_steps

pytestmark = pytest.mark.skipif(
    not sandbox.available_modes(), reason="no sandbox mode works on this machine"
)

TOOL_AT_START = '''
from dapo.env import MathTool, Observation

class ToolAtStart(MathTool):
    """Runs the tool as each row's episode starts, and ends the episode after its turn."""

    turn_ends = ()

    def messages(self, problem):
        assert self.run(["print(6 * 7)"]).text == "\\n```output\\n42\\n```\\n"
        return list(problem.messages)

    def step(self, history):
        return Observation(done=True)
'''


@pytest.fixture()
def launched(monkeypatch) -> list[str]:
    """The sources the tool's launchers ran in this process."""
    sources, real = [], Launcher.run

    def run(self, source, limits, mode):
        sources.append(source)
        return real(self, source, limits, mode)

    monkeypatch.setattr(Launcher, "run", run)
    return sources


def _pool_threads() -> set[threading.Thread]:
    """The live manager threads of process pools in this process."""
    return {t for t in threading.enumerate() if type(t).__module__ == "concurrent.futures.process"}


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _env_file(tmp_path) -> str:
    path = tmp_path / "tool_at_start.py"
    path.write_text(TOOL_AT_START)
    return f"{path}:ToolAtStart"


def test_closing_the_tool_stops_its_helpers_and_a_later_call_starts_new_ones():
    before = _pool_threads()
    tool = MathTool()
    assert tool.run(["print(6 * 7)"]).text == "\n```output\n42\n```\n"
    helpers = list(tool.launcher._pool._processes)
    assert helpers and _pool_threads() - before  # the helpers and their manager thread
    tool.close()
    assert tool.launcher._pool is None
    assert _pool_threads() - before == set()
    assert all(_gone(pid) for pid in helpers)
    tool.close()  # twice: nothing to stop
    assert tool.run(["print(7 * 8)"]).text == "\n```output\n56\n```\n"
    tool.close()
    assert _pool_threads() - before == set()


def test_the_base_environment_closes_as_a_no_op():
    assert Environment().close() is None


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_run_with_the_tool_leaves_no_process_pool_behind(
    tmp_path, tiny_model, tokenizer, staleness, launched
):
    """k = 0: the trainer's runner; k = 1: the generator thread's runner (its own engine's)
    too. The tool ran in the run, and its pools are gone when fit returns."""
    before = _pool_threads()
    overrides = (f"env.class={_env_file(tmp_path)}", "train.steps=2")
    cfg, train, val, run_dir, _ = setup_run(
        tmp_path, tiny_model, *overrides, f"train.async_staleness={staleness}"
    )
    assert quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)["steps"] == 2
    assert len(launched) >= 4  # 2 prompts a step, 2 steps
    assert _pool_threads() - before == set()


def test_an_instance_serves_every_runner_and_a_later_run(
    tmp_path, tiny_model, tokenizer, launched, monkeypatch
):
    """``env.class=PATH:INSTANCE``: one object for the trainer's runner and the generator
    thread's (k = 1), closed by each, and a later run in the process (k = 0) calls its tool
    again and closes it once more."""
    path = tmp_path / "tool_instance.py"
    path.write_text(TOOL_AT_START + "\nTOOL = ToolAtStart()\n")
    spec = f"{path}:TOOL"
    tool = load_environment(spec)
    assert load_environment(spec) is tool and isinstance(tool, MathTool)
    closes, real = [], Launcher.close
    monkeypatch.setattr(Launcher, "close", lambda self: (closes.append(self), real(self)))
    before = _pool_threads()
    for staleness, closed in [(1, 2), (0, 3)]:
        overrides = (f"env.class={spec}", "train.steps=2", f"train.async_staleness={staleness}")
        (root := tmp_path / f"k{staleness}").mkdir()
        cfg, train, val, run_dir, start = setup_run(root, tiny_model, *overrides)
        calls = len(launched)
        assert quiet_fit(cfg, start, tokenizer, train, val, run_dir)["steps"] == 2
        assert len(launched) - calls >= 4  # 2 prompts a step, 2 steps
        assert closes == [tool.launcher] * closed
        assert tool.launcher._pool is None and _pool_threads() - before == set()


def test_an_evaluation_with_the_tool_leaves_no_process_pool_behind(tmp_path, launched):
    model = save_model(tmp_path / "model", "qwen2")
    config = tmp_path / "eval.yaml"
    config.write_text(f"env:\n  class: {_env_file(tmp_path)}\n")
    before = _pool_threads()
    flags = ["--k", "2", "--num-problems", "2", "--max-new-tokens", "4", "--resamples", "10"]
    out = tmp_path / "eval"
    assert main(["eval", str(model), "--data", "arith", "--config", str(config), *flags,
                 "--threads", "1", "--out", str(out)]) == 0  # fmt: skip
    assert len(launched) == 2  # one per problem
    assert _pool_threads() - before == set()


def test_a_call_that_races_the_close_is_answered_not_raised(monkeypatch):
    """A step thread took the pool just before the run's end closed it: its call comes back
    as an observation ("not run"), not a RuntimeError out of the executor."""
    tool = MathTool()
    assert tool.run(["print(1)"]).text == "\n```output\n1\n```\n"
    real = Launcher._submit

    def closed_meanwhile(self, pool, *args):
        self.close()  # between the call taking the pool and its submit
        return real(self, pool, *args)

    monkeypatch.setattr(Launcher, "_submit", closed_meanwhile)
    answer = tool.run(["print(2)"])
    assert answer.error and "not run: the tool was closed: the run is ending" in answer.text
    assert tool.launcher._pool is None


def test_a_pool_that_fails_on_its_own_is_dropped_and_its_error_raised(monkeypatch):
    """A RuntimeError of a pool nobody closed (a manager thread it could not start) is the
    run's error, not "closed"; the pool, which would hang the next call, is dropped."""
    tool = MathTool()
    assert tool.run(["print(1)"]).text == "\n```output\n1\n```\n"
    pool = tool.launcher._pool

    def cannot(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pool, "submit", cannot)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        tool.run(["print(2)"])
    assert tool.launcher._pool is None
    monkeypatch.undo()
    pool.shutdown()
    assert tool.run(["print(3)"]).text == "\n```output\n3\n```\n"
    tool.close()


class _Interrupt(Exception):
    pass


def test_an_interrupt_while_steps_run_starts_no_more_steps():
    """Ctrl-C in the caller's thread while env steps run: the step threads take no more
    steps (they went on through all 40, each a tool call that could outlive the tool's
    close)."""
    started = []

    def step(history):
        started.append(history)
        time.sleep(0.1)
        return Observation()

    def interrupt(*_):
        raise _Interrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.35)
        with pytest.raises(_Interrupt):
            run_steps(step, list(range(40)), workers=2, timeout_s=60, name="Slow")
        at_interrupt = len(started)
        time.sleep(2.5)  # 40 steps of 0.1 s on 2 threads would have ended by now
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert 4 <= at_interrupt <= 10
    assert len(started) <= at_interrupt + 2  # a step each thread had taken as it came


def test_an_interrupt_while_the_step_threads_start_stops_the_started_ones(monkeypatch):
    """The Ctrl-C lands in the second thread's start: the first, already started, took
    every step (the queue was cleared only for an interrupt in the waiting loop)."""
    started, starts = [], []

    class Interrupted(threading.Thread):
        def start(self):
            starts.append(self)
            if len(starts) == 2:
                raise _Interrupt
            super().start()

    def step(history):
        started.append(history)
        time.sleep(0.05)
        return Observation()

    fake = types.SimpleNamespace(Thread=Interrupted, Lock=threading.Lock)
    monkeypatch.setattr(env_steps, "threading", fake)
    with pytest.raises(_Interrupt):
        run_steps(step, list(range(40)), workers=2, timeout_s=60, name="Slow")
    time.sleep(1.0)  # 40 steps of 0.05 s on one thread would be half done
    assert 1 <= len(started) <= 2
