"""The Python tool's helper processes stop when the run or evaluation that made them ends
(``Environment.close``), not at the interpreter's exit: there, Python 3.11 wakes each process
pool's manager thread without its lock, and one error skips the joins, so that a run which had
trained to its end hung at exit (a fresh-clone CI of 0674d29, generation ahead of training
with the tool). A pool the run closed leaves no manager thread for the exit to wait on."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers import quiet_fit, save_model, setup_run

from dapo.cli import main
from dapo.env import Environment, MathTool
from dapo.env.python_tool import Launcher
from dapo.reward import sandbox

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
