"""The code task (dapo.reward.tasks.code): what is run, how it is graded, and hostile responses
graded incorrect within the time bound in every sandbox mode, through the real reward pool too.
"""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
from test_sandbox import FAST, MARGIN_S, Trap, every_mode

from dapo.reward import tasks
from dapo.reward.pool import Job, RewardPool
from dapo.reward.sandbox import run_python
from dapo.reward.tasks.base import NO_ANSWER, Score
from dapo.reward.tasks.code import HARNESS, MAX_PROGRAM_BYTES, extract_code, grade_code, verify_code

ADD = json.dumps({"entry_point": "add", "tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"})
HUMANEVAL = json.dumps(
    {
        "entry_point": "total",
        "prelude": "from typing import List",
        "tests": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n"
        "    assert candidate([]) == 0\n",
    }
)
RIGHT = "def add(a, b):\n    return a + b\n"
PASSED = Score(score=1.0, correct=True, pred="passed", vote="")


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}```\nIt adds."


def wrong(pred: str) -> Score:
    return Score(score=-1.0, correct=False, pred=pred, vote="")


@pytest.fixture
def trap(tmp_path, monkeypatch):
    trap = Trap(tmp_path, monkeypatch)
    yield trap
    trap.close()


def test_the_task_is_registered_as_code():
    assert tasks.get_task("code").verify is verify_code
    assert tasks.get_verifier("code")(fenced(RIGHT), ADD) == PASSED


@pytest.mark.parametrize(
    ("response", "program"),
    [
        (fenced("x = 1\n"), "x = 1"),
        ("x = 1", "x = 1"),  # no fence: the whole response
        (fenced("x = 1\n") + fenced("x = 2\n", "py"), "x = 2"),  # the last one wins
        (fenced("x = 1\n", "Python3") + fenced("ls\n", "bash"), "x = 1"),  # not bash
        (fenced("x = 1\n", "") + "\n```text\n5\n```", "x = 1"),  # bare, not text
        (fenced("x = 1\n") + fenced("x = 2\n", ""), "x = 1"),  # tagged before bare
        ("1. Code:\n   ```python\n   def f():\n       return 1\n   ```", "def f():\n    return 1"),
        ("```python\nx = 1\n```\n```python\ny = 2", "y = 2"),  # unclosed at the end
        ("```python\n```", ""),
    ],
)
def test_the_program_is_the_last_python_fence(response, program):
    assert extract_code(response) == program


def test_extraction_is_linear_in_the_response():
    start = time.process_time()  # CPU time: the work, however busy the machine is
    assert extract_code("```\n" * 200_000) == ""
    assert extract_code("```python\n" + "x\n" * 500_000) == "x\n" * 499_999 + "x"
    assert time.process_time() - start < 2.0


def test_a_right_program_passes_and_a_wrong_one_fails():
    assert grade_code(fenced(RIGHT), ADD) == PASSED
    assert grade_code(RIGHT, ADD) == PASSED  # bare, without a fence
    assert grade_code(fenced("def add(a, b):\n    return a - b\n"), ADD) == wrong("failed")
    assert grade_code(fenced("def add(a, b):\n    return a +\n"), ADD) == wrong("error")
    assert grade_code(fenced("def plus(a, b):\n    return a + b\n"), ADD) == wrong("no_entry_point")
    answer = "def total(xs: List[int]) -> int:\n    return sum(xs)\n"
    assert grade_code(fenced(answer), HUMANEVAL) == PASSED  # prelude, then check(candidate)
    assert grade_code(fenced(answer.replace("sum(xs)", "1")), HUMANEVAL) == wrong("failed")


def test_main_blocks_do_not_run_and_input_sees_end_of_file():
    program = RIGHT + "if __name__ == '__main__':\n    raise SystemExit(1)\n"
    assert grade_code(fenced(program), ADD) == PASSED
    assert grade_code(fenced(RIGHT + "input()\n"), ADD) == wrong("error")  # EOFError


@pytest.mark.parametrize(
    "ground_truth",
    [
        "not json",
        "[]",
        json.dumps({"tests": "assert True"}),
        json.dumps({"entry_point": "a b", "tests": "assert True"}),
        json.dumps({"entry_point": "add", "tests": 5}),
        json.dumps({"entry_point": "add", "tests": "  \n"}),
        json.dumps({"entry_point": "add", "tests": "assert True", "prelude": ["x"]}),
        "[" * 100_000,
        None,
        42,
    ],
)
def test_a_bad_ground_truth_is_graded_incorrect_without_running(ground_truth):
    start = time.monotonic()
    assert grade_code(fenced(RIGHT), ground_truth) is NO_ANSWER
    assert time.monotonic() - start < 0.5


def test_no_program_or_too_long_a_one_is_not_run():
    assert grade_code(fenced(""), ADD) == wrong("no_code")
    assert grade_code("   \n", ADD) == wrong("no_code")
    assert grade_code(None, ADD) is NO_ANSWER  # type: ignore[arg-type]
    too_long = RIGHT + "#" * MAX_PROGRAM_BYTES
    assert grade_code(fenced(too_long), ADD) == wrong("too_long")


CHEATS = {
    "sys.exit(0) before the tests": (RIGHT + "import sys\nsys.exit(0)\n", "error"),
    "SystemExit before the tests": (RIGHT + "raise SystemExit(0)\n", "error"),
    "os._exit(0) before the tests": (RIGHT + "import os\nos._exit(0)\n", "exited_early"),
    "os._exit(0) during the tests": (
        "import os\ndef add(a, b):\n    os._exit(0)\n",
        "exited_early",
    ),
    "printing a made-up nonce": ("def add(a, b):\n    print('0' * 32)\n    return 0\n", "failed"),
    "patching builtins": (
        "import builtins\nbuiltins.AssertionError = None\nbuiltins.len = lambda x: 3\n"
        "def add(a, b):\n    return [0]\n",
        "failed",
    ),
    "closing stdout": (RIGHT + "import os\nos.close(1)\n", "failed"),
}


@pytest.mark.parametrize("name", CHEATS)
def test_ending_before_the_tests_or_patching_the_grader_fails(name):
    program, pred = CHEATS[name]
    truth = json.dumps({"entry_point": "add", "tests": "assert len(add(1, 2)) == 3"})
    assert grade_code(fenced(program), ADD if "len" not in program else truth) == wrong(pred)


def test_check_is_called_once_whether_or_not_the_tests_call_it():
    once = "calls = []\ndef check(candidate):\n    calls.append(1)\n    assert len(calls) == 1\n"
    once += "    assert candidate(1, 2) == 3\n"
    for tests in (once, once + "check(add)\n"):  # called by the harness, by the tests
        truth = json.dumps({"entry_point": "add", "tests": tests})
        assert grade_code(fenced(RIGHT), truth) == PASSED
        assert grade_code(fenced("def add(a, b):\n    return 0\n"), truth) == wrong("failed")


def test_a_program_defining_check_does_not_replace_the_tests_check():
    cheat = "def total(xs):\n    return 0\ndef check(candidate):\n    pass\n"
    assert grade_code(fenced(cheat), HUMANEVAL) == wrong("failed")


def test_the_program_never_reads_the_nonce_from_stdin():
    payload = {
        "entry_point": "add",
        "tests": "assert add(1, 1) == 2",
        "prelude": "",
        "call_check": 0,
    }
    program = "import os, sys\nprint(repr(sys.stdin.read()), repr(os.read(0, 100)))\n" + RIGHT
    stdin = json.dumps({**payload, "program": program, "nonce": "feedbeef"}).encode()
    result = run_python(HARNESS, stdin=stdin, limits=FAST)
    assert result.returncode == 0
    assert result.stdout == b"'' b''\n\nfeedbeef\n"  # the nonce only after the last test


def test_known_limit_a_program_that_walks_the_harness_frames_can_forge_the_nonce():
    # Documented in the module: the program and the harness share an interpreter.
    forger = (
        "import os, sys\nnonce = sys._getframe(1).f_locals['nonce']\n"
        "os.write(1, b'\\n' + nonce + b'\\n')\nos._exit(0)\n"
    )
    assert grade_code(fenced(forger), ADD) == PASSED


# --- hostile responses -------------------------------------------------------------------------


def hostile(trap: Trap) -> dict[str, tuple[str, str]]:
    """Hostile responses, each a right ``add`` and then an attack that is not caught, with the
    grade each must get."""
    outside = str(trap.outside[0])
    victims = f"(os.getppid(), 1, {trap.victim.pid}, {os.getpid()})"
    attacks = {
        "infinite loop": ("while True:\n    pass\n", "timeout"),
        "fork bomb": ("import os\nwhile True:\n    os.fork()\n", "error"),
        "8 GB allocation": ("x = bytearray(8 * 2**30)\n", "memory"),
        "write outside": (f"open({outside!r}, 'w').write('x')\n", "error"),
        "socket": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {trap.port}))\n",
            "error",
        ),
        "environment": (
            "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())\n",
            "error",
        ),
        "kill the parent": (f"import os\nfor pid in {victims}:\n    os.kill(pid, 9)\n", "error"),
        "daemon": (
            "import subprocess\nsubprocess.Popen(['/bin/sh', '-c', "
            f"'sleep 30; : {trap.marker}'], start_new_session=True)\n",
            "error",
        ),
        "1 GB of output": (
            "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)\n",
            "output_limit",
        ),
        "exit 0 before the tests": ("import os\nos._exit(0)\n", "exited_early"),
    }
    return {name: (fenced(RIGHT + code), pred) for name, (code, pred) in attacks.items()}


NAMES = [
    "infinite loop",
    "fork bomb",
    "8 GB allocation",
    "write outside",
    "socket",
    "environment",
    "kill the parent",
    "daemon",
    "1 GB of output",
    "exit 0 before the tests",
]


@pytest.mark.parametrize("mode", every_mode())
@pytest.mark.parametrize("name", NAMES)
def test_a_hostile_response_is_graded_incorrect_within_the_bound(name, mode, trap):
    response, pred = hostile(trap)[name]
    start = time.monotonic()
    score = grade_code(response, ADD, limits=FAST, mode=mode)
    assert time.monotonic() - start < FAST.wall_s + MARGIN_S
    assert score == wrong(pred)
    assert trap.escaped() == []


def in_process_mode(data_source: str):
    """A resolver for the pool: the code task in process mode, where the program's parent is
    the reward worker itself."""
    assert data_source == "code"
    return functools.partial(grade_code, mode="process")


@pytest.mark.parametrize("resolve", [tasks.get_verifier, in_process_mode])
def test_the_reward_pool_grades_hostile_responses_and_keeps_going(trap, resolve):
    attacks = hostile(trap)
    responses = [fenced(RIGHT)] + [attacks[n][0] for n in ("kill the parent", "daemon")]
    responses += [attacks["1 GB of output"][0], fenced("def add(a, b):\n    return 0\n")]
    with RewardPool(workers=1, timeout_s=10.0, resolve=resolve) as pool:
        for _ in range(2):  # the same worker grades the next batch too
            result = pool.grade([Job("code", r, ADD) for r in responses])
            assert result.faults == []
            assert [s.pred for s in result.scores] == [
                "passed",
                "error",
                "error",
                "output_limit",
                "failed",
            ]
            assert [s.score for s in result.scores] == [1.0, -1.0, -1.0, -1.0, -1.0]
    assert trap.escaped() == []


def test_without_an_isolating_mode_a_code_run_stops_unless_process_is_asked_for(
    monkeypatch, tmp_path
):
    """auto never falls back to process mode: on a machine with neither bubblewrap nor user
    namespaces the run stops before any model loads, naming the fixes and the opt-in; asked
    for by name, process mode runs, and the run says what it leaves a program."""
    from dapo.config import load_config
    from dapo.data.problems import Problem
    from dapo.reward import sandbox
    from dapo.training import inputs

    rows = [Problem("c", (), json.dumps({"entry_point": "f", "tests": "f()"}), "code")]
    data = inputs.RunData(rows, rows)
    monkeypatch.setenv("PATH", str(tmp_path))  # neither bwrap nor unshare can be found
    sandbox.forget_probes()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match=r"bubblewrap.*code\.sandbox=process"):
            inputs.check_verifiers(load_config(None, []), data)
        assert data.warnings == []
        inputs.check_verifiers(load_config(None, ["code.sandbox=process"]), data)
        assert data.warnings == [sandbox.process_mode_warning()]
        assert "without namespaces of its own, on the host's network" in data.warnings[0]
    finally:
        monkeypatch.undo()
        sandbox.forget_probes()


def test_the_runs_warnings_are_kept_in_its_summary(tmp_path, tiny_model, tokenizer):
    from helpers import setup_run

    from dapo.training import loop

    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, "train.steps=1")
    loop.fit(cfg, tiny_model, tokenizer, train, val, run_dir=run_dir, warnings=["a warning"])
    assert json.loads((run_dir / "summary.json").read_text())["warnings"] == ["a warning"]


@pytest.mark.parametrize("mode", [m for m in every_mode() if m.values[0] != "bwrap"])
def test_a_response_that_fills_the_disk_is_graded_disk_limit(mode):
    """In unshare and process modes the working directory is on the host's disk: a program
    that fills it past tmp_bytes is killed and graded ``disk_limit`` (bwrap's tmpfs refuses
    the write: the program raises)."""
    from test_sandbox import FILL_DISK

    from dapo.reward.sandbox import SandboxLimits

    limits = SandboxLimits(wall_s=4.0, tmp_bytes=8 * 2**20)
    score = grade_code(fenced(RIGHT + FILL_DISK), ADD, limits=limits, mode=mode)
    assert score == wrong("disk_limit")


@pytest.mark.parametrize("mode", every_mode())
def test_a_busy_loop_stopped_by_the_cpu_limit_is_a_timeout(mode):
    """cpu_s below wall_s (as code.wall_s - 1 is): a loop with a core of its own spends its
    CPU seconds first and is SIGKILLed (unshare reports it as exit 1); still an infinite loop,
    so ``timeout``, not ``killed`` nor ``failed``."""
    from dapo.reward.sandbox import SandboxLimits

    limits = SandboxLimits(wall_s=5.0, cpu_s=1.0)  # the CPU limit first, even on a loaded machine
    loop = fenced("def add(a, b):\n    while True:\n        pass\n")
    assert grade_code(loop, ADD, limits=limits, mode=mode) == wrong("timeout")
