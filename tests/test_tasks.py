"""The task registry: one place from a name (a row's data_source, or reward.mode) to a verifier."""

import pickle

import pytest

from dapo.reward import tasks
from dapo.reward.tasks.base import Task
from dapo.reward.tasks.math_dapo import math_score, math_score_boxed
from dapo.reward.tasks.math_lenient import lenient_score
from dapo.reward.tasks.math_verify import math_verify_score


def test_every_task_file_is_registered_under_its_names():
    assert tasks.names() == (
        "arith",
        "code",
        "dapo",
        "lenient",
        "math_dapo",
        "math_dapo_boxed",
        "math_lenient",
        "math_verify",
    )
    assert [t.name for t in tasks.tasks()] == [
        "arith",
        "code",
        "math_dapo",
        "math_dapo_boxed",
        "math_lenient",
        "math_verify",
    ]
    assert tasks.get_verifier("math_dapo") is math_score  # the paper's rules, the default
    assert tasks.get_verifier("dapo") is math_score  # the reward.mode spelling
    assert tasks.get_verifier("math_dapo_boxed") is math_score_boxed  # verl 0.9.1's
    assert tasks.get_verifier("lenient") is lenient_score
    assert tasks.get_verifier("arith") is lenient_score
    assert tasks.get_verifier("math_verify") is math_verify_score
    assert tasks.REGISTRY["math_dapo"] is tasks.get_task("dapo")


def test_an_unknown_name_is_refused_with_the_known_ones_and_the_fix():
    with pytest.raises(ValueError, match="no_such_source") as info:
        tasks.get_verifier("no_such_source")
    message = str(info.value)
    known = "arith, code, dapo, lenient, math_dapo, math_dapo_boxed, math_lenient, math_verify"
    assert known in message
    assert "reward.mode=dapo" in message and "dapo/reward/tasks/" in message


def test_a_name_is_taken_once(monkeypatch):
    monkeypatch.setattr(tasks, "REGISTRY", dict(tasks.REGISTRY))
    with pytest.raises(ValueError, match="'dapo' is taken twice"):
        tasks.register(Task("other", math_score, "a copy", aliases=("dapo",)))
    tasks.register(Task("other", math_score, "a copy"))
    assert tasks.get_verifier("other") is math_score


def test_the_pool_resolver_is_picklable():
    # Reward workers receive the resolver by reference.
    assert pickle.loads(pickle.dumps(tasks.get_verifier)) is tasks.get_verifier


def test_no_task_imports_torch():
    import subprocess
    import sys

    code = "import sys, dapo.reward.tasks, dapo.reward.pool; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
