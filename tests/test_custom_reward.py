"""reward.function / reward_fn: a user's own reward, checked before any model loads, run in the
reward workers under their bounds, recorded with its file's hash; and the Python API
(dapo.train, dapo.evaluate, dapo.load_config) that the commands call."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import user_rewards
from helpers import SMALL, logged_metrics

import dapo
from dapo.cli import main
from dapo.config import load_config
from dapo.reward import custom
from dapo.reward.pool import Job, RewardPool
from dapo.reward.tasks import Score

USER = Path(user_rewards.__file__).resolve()

# The embedded demo, a few seconds: SMALL without the in-process grading, so that the user's
# function runs in a worker process as it does in a real run.
TINY = [x for x in SMALL if not x.startswith("reward.workers")] + [
    "train.steps=2",
    "arith.num_val=8",
    "run.threads=1",
    "run.progress=plain",
]


# --- what a function may return -----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.0, Score(1.0, True, "")),
        (0.0, Score(0.0, False, "")),  # correct only when > 0
        (-0.5, Score(-0.5, False, "")),
        (3, Score(3.0, True, "")),
        (np.float32(0.25), Score(0.25, True, "")),
        (True, Score(1.0, True, "")),  # a bool is the paper's R_correct: +1 / -1
        (False, Score(-1.0, False, "")),
        ({"score": 0.5}, Score(0.5, True, "")),
        ({"score": 0.5, "correct": False, "pred": "x"}, Score(0.5, False, "x")),
        ({"score": -1, "pred": 7}, Score(-1.0, False, "")),  # a pred that is no string: dropped
        ({"score": 1, "pred": "0.5", "vote": "1/2"}, Score(1.0, True, "0.5", vote="1/2")),
        (Score(1.0, True, "passed", vote=""), Score(1.0, True, "passed", vote="")),
        (Score(1.0, False, "kept"), Score(1.0, False, "kept")),
        (np.True_, Score(1.0, True, "")),  # numpy's bool is a bool: np.isclose(...) returns one
        (np.isclose(1.0, 2.0), Score(-1.0, False, "")),
        ({"score": 1.0, "correct": np.True_}, Score(1.0, True, "")),
    ],
)
def test_returned_values_become_scores(value, expected) -> None:
    score = custom.to_score(value)
    assert score == expected and type(score.correct) is bool


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (np.array(1.0), "returned numpy.ndarray;"),
        ({"score": np.True_}, "its 'score' is numpy.bool"),
        ({"score": 1.0, "correct": np.float64(1.0)}, "its 'correct' is numpy.float64, not a bool"),
        ({"score": 1.0, "vote": 2}, "its 'vote' is int, not a str"),
    ],
)
def test_a_refused_value_is_named_with_its_module(value, named) -> None:
    with pytest.raises(TypeError, match=named):
        custom.to_score(value)


@pytest.mark.parametrize(
    "value", [None, [1.0], "1.0", {"correct": True}, {"score": "1"}, {"score": 1, "correct": 1}]
)
def test_other_returned_values_are_type_errors_that_say_what_to_return(value) -> None:
    with pytest.raises(TypeError, match="not a number|not a bool|return a float, a bool"):
        custom.to_score(value)


# --- checked before any model loads ---------------------------------------------------------


def test_a_file_spec_is_loaded_checked_and_hashed() -> None:
    import hashlib

    sha = custom.check_spec(f"{USER}:ends_with_answer")
    assert sha == hashlib.sha256(USER.read_bytes()).hexdigest()
    fn = custom.load_function(f"{USER}:ends_with_answer")
    assert fn("... Answer: 17", "17") == 1.0 and fn("Answer: 16", "17") == -1.0
    # A module spec finds the same source file.
    assert custom.spec_file("user_rewards:as_bool") == USER


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon.py", "is not TARGET:NAME"),
        ("x.py:not-a-name", "is not TARGET:NAME"),
        ("/nonexistent/r.py:f", "no file /nonexistent/r.py"),
        ("no_such_module_xyz:f", "no module 'no_such_module_xyz'"),
        (f"{USER}:missing", "has no 'missing'"),
        (f"{USER}:one_argument", r"cannot be called as one_argument\(response, ground_truth\)"),
        (f"{USER}:NOT_A_FUNCTION", "is a int, not a function"),
    ],
)
def test_bad_specs_are_refused_naming_the_path_and_the_fix(spec, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        custom.check_spec(spec)
    assert "PATH.py:NAME" in str(err.value) or "is not TARGET" in str(err.value)


def test_a_file_that_fails_to_import_is_named(tmp_path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_module_abc\n")
    with pytest.raises(ValueError, match=f"importing {bad} raised ModuleNotFoundError"):
        custom.check_spec(f"{bad}:f")


def test_the_config_refuses_a_function_beside_a_mode_and_a_malformed_spec() -> None:
    with pytest.raises(ValueError) as err:
        load_config(None, ["reward.function=r.py:f", "reward.mode=dapo"])
    assert "give one of them" in str(err.value)
    with pytest.raises(ValueError, match="is not TARGET:NAME"):
        load_config(None, ["reward.function=r.py"])
    assert load_config(None, ["reward.function=r.py:f"]).reward.grader == "r.py:f"
    assert load_config(None, ["reward.mode=lenient"]).reward.grader == "lenient"


def test_a_missing_file_stops_dapo_train_before_anything_is_written(tmp_path, capsys) -> None:
    code = main(["train", f"run.out_dir={tmp_path}", f"reward.function={tmp_path}/r.py:f"])
    assert code == 2
    assert f"no file {tmp_path}/r.py" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- functions given in Python --------------------------------------------------------------


def test_a_lambda_or_a_nested_function_is_refused_with_the_reason() -> None:
    def nested(response, ground_truth):
        return 1.0

    for fn in (lambda r, g: 1.0, nested):
        with pytest.raises(ValueError, match="import it by name, so a lambda, a nested function"):
            custom.spec_of(fn)
    assert custom.spec_of(json.dumps) == "json:dumps"  # installed: by name from anywhere


def test_a_module_of_the_callers_own_directory_is_named_by_its_file() -> None:
    """`from my_reward import score` in a script recorded my_reward:score, which imports only
    with the script's directory on sys.path: `dapo train --resume` failed from anywhere else,
    and the path its error suggested was refused as a change of the run."""
    assert custom.spec_of(user_rewards.as_bool) == f"{USER}:as_bool"


def test_a_script_that_multiprocessing_spawned_names_its_functions_by_its_file(tmp_path):
    """A sweep's script, run again in a spawned (or forkserver) child, is __mp_main__ there:
    its reward function was named '__mp_main__:reward', which no worker could import."""
    script = tmp_path / "sweep.py"
    script.write_text(
        "import multiprocessing\n"
        "from dapo.reward import custom\n\n"
        "def reward(response, ground_truth):\n"
        "    return 1.0\n\n"
        "def spec(_):\n"
        "    return custom.spec_of(reward)\n\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "        print(pool.map(spec, [0])[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(custom.__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{script.resolve()}:reward"


# --- in the workers, under their bounds -----------------------------------------------------


def test_the_workers_grade_with_the_users_function_and_count_its_failures() -> None:
    jobs = [Job("anything", "so Answer: 17", "17"), Job("anything", "Answer: 16", "17")]
    with RewardPool(workers=1, resolve=custom.CustomReward(f"{USER}:ends_with_answer")) as pool:
        result = pool.grade(jobs)
    assert result.scores == [Score(1.0, True, ""), Score(-1.0, False, "")]
    assert result.faults == []

    cases = {"raises": "error", "as_list": "error", "nan": "error", "sleeps": "timeout"}
    for name, kind in cases.items():
        resolve = custom.CustomReward(f"user_rewards:{name}")
        with RewardPool(workers=1, timeout_s=1.0, resolve=resolve) as pool:
            result = pool.grade(jobs[:1])
        assert result.scores[0].score == -1.0 and not result.scores[0].correct, name
        assert [f.kind for f in result.faults] == [kind], name
    assert "return a float, a bool, a Score" in _detail("as_list")
    assert "the user's reward failed" in _detail("raises")


def test_the_users_file_is_imported_as_a_worker_starts_not_in_a_deadline(tmp_path) -> None:
    # A slow import (torch, a model) is start-up time: no response's deadline pays for it.
    slow = tmp_path / "slow_reward.py"
    slow.write_text("import time\ntime.sleep(1.5)\ndef score(r, g):\n    return 1.0\n")
    with RewardPool(workers=1, timeout_s=1.0, resolve=custom.CustomReward(f"{slow}:score")) as pool:
        result = pool.grade([Job("x", "a", "1"), Job("x", "b", "1")])
    assert result.faults == [] and [s.score for s in result.scores] == [1.0, 1.0]


def test_a_users_file_that_cannot_load_stops_the_pool_naming_it(tmp_path, monkeypatch) -> None:
    from dapo.reward import pool as reward_pool

    broken = tmp_path / "broken_reward.py"
    broken.write_text("1 / 0\ndef score(r, g):\n    return 1.0\n")
    with RewardPool(workers=1, resolve=custom.CustomReward(f"{broken}:score")) as pool:
        with pytest.raises(
            RuntimeError, match=re.escape(f"importing {broken} raised ZeroDivisionError")
        ):
            pool.grade([Job("x", "a", "1")])
    # An import past the start-up allowance: the file is named, not a timeout fault per response.
    monkeypatch.setattr(reward_pool, "STARTUP_TIMEOUT_S", 1.0)
    stuck = tmp_path / "stuck_reward.py"
    stuck.write_text("import time\ntime.sleep(30)\ndef score(r, g):\n    return 1.0\n")
    with RewardPool(
        workers=1, timeout_s=0.5, resolve=custom.CustomReward(f"{stuck}:score")
    ) as pool:
        with pytest.raises(
            RuntimeError, match=r"did not start within 1 s .*" + re.escape(f"{stuck}:score")
        ):
            pool.grade([Job("x", "a", "1")])


def _detail(name: str) -> str:
    resolve = custom.CustomReward(f"user_rewards:{name}")
    with RewardPool(workers=0, resolve=resolve) as pool:
        return pool.grade([Job(f"user_rewards:{name}", "x", "y")]).faults[0].detail


def test_a_function_given_in_python_reaches_the_workers_by_name() -> None:
    resolve = custom.make_resolver("user_rewards:as_bool", user_rewards.as_bool)
    with RewardPool(workers=1, resolve=resolve) as pool:
        scores = pool.grade([Job("x", "it is 17", "17"), Job("x", "it is 16", "17")]).scores
    assert scores == [Score(1.0, True, ""), Score(-1.0, False, "")]


# --- the Python API and the command line -------------------------------------------------


def test_dapo_train_with_reward_fn_is_the_command_with_reward_function(tmp_path, capsys) -> None:
    spec = f"{USER}:ends_with_answer"  # a module of the tests' own directory: by its file
    base = [*TINY, f"run.out_dir={tmp_path}"]
    result = dapo.train(overrides=[*base, "run.name=api"], reward_fn=user_rewards.ends_with_answer)
    assert main(["train", *base, "run.name=cli", f"reward.function={spec}"]) == 0
    summary = json.loads((tmp_path / "api" / "summary.json").read_text())
    assert result.run_dir == tmp_path / "api" and result.steps == 2
    assert result.start_accuracy == summary["val/accuracy_start"]
    assert result.end_accuracy == summary["val/accuracy_end"]
    # The same run by either door: every metric of every step, the time aside.
    assert logged_metrics(tmp_path / "api") == logged_metrics(tmp_path / "cli")
    saved = load_config(tmp_path / "api" / "config.yaml")
    assert saved.reward.function == spec
    assert saved.reward.function_sha256 == custom.file_sha256(USER)
    assert f"reward: {spec} (SHA-256" in capsys.readouterr().out


def test_a_resume_whose_reward_file_changed_warns_and_keeps_the_old_config(tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text("def f(response, ground_truth):\n    return 1.0\n")
    args = [*TINY, "train.steps=1", f"run.out_dir={tmp_path}", "run.name=r"]
    assert main(["train", *args, f"reward.function={reward}:f"]) == 0
    reward.write_text("def f(response, ground_truth):\n    return -1.0\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "r"), "train.steps=2"]) == 0
    assert "the file changed since the run started" in capsys.readouterr().err
    assert (tmp_path / "r" / "config.before-resume-1.yaml").is_file()
    assert load_config(tmp_path / "r" / "config.yaml").reward.function_sha256 == (
        custom.file_sha256(reward)
    )


def test_a_resume_refuses_a_reward_file_that_came_with_the_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "r"
    args = [*TINY, "train.steps=1", f"run.out_dir={tmp_path}", "run.name=r"]
    assert main(["train", *args, f"reward.function={USER}:ends_with_answer"]) == 0
    planted = run_dir / "planted.py"
    planted.write_text("def f(response, ground_truth):\n    return 1.0\n")
    capsys.readouterr()
    code = main(["train", "--resume", str(run_dir), f"reward.function={planted}:f", "--force"])
    assert code == 2
    assert "dapo runs no code that came with a run directory" in capsys.readouterr().err


def test_dapo_evaluate_grades_with_reward_fn_as_the_command_does(tmp_path) -> None:
    common = {"k": 2, "num_problems": 3, "max_new_tokens": 24, "threads": 1}
    result = dapo.evaluate(
        "embedded", "arith", out=tmp_path / "api", reward_fn=user_rewards.as_bool, **common
    )
    flags = ["--k", "2", "--num-problems", "3", "--max-new-tokens", "24", "--threads", "1"]
    spec = "--reward-function=user_rewards:as_bool"
    assert (
        main(["eval", "embedded", "--data", "arith", *flags, spec, "--out", str(tmp_path / "cli")])
        == 0
    )
    cli = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert result.out_dir == tmp_path / "api"
    assert result.metrics == cli["metrics"]
    assert result.protocol["reward_function"] == f"{USER}:as_bool"
    assert 0.0 <= result.metrics["avg@k"]["mean"] <= 1.0
    assert not math.isnan(result.metrics["avg@k"]["mean"])


def test_load_config_is_the_commands_config() -> None:
    cfg = dapo.load_config(None, ["optim.lr=2e-6"])
    assert cfg.optim.lr == 2e-6 and cfg.run.base == "demo"
    assert (
        dapo.load_config(preset="grpo").algo.eps_high
        == load_config(None, [], preset="grpo").algo.eps_high
    )
    assert {"train", "evaluate", "load_config"} <= set(dir(dapo))


def test_the_command_line_runs_through_the_api(monkeypatch, tmp_path) -> None:
    from dapo.api import training

    seen = {}
    monkeypatch.setattr(training, "run", lambda cfg, resume_dir, **kw: seen.update(cfg=cfg, **kw))
    assert main(["train", "optim.lr=3e-6", f"run.out_dir={tmp_path}", "--dry-run"]) == 0
    assert seen["cfg"].optim.lr == 3e-6 and seen["dry_run"] is True


def test_overrides_may_be_a_mapping_and_results_read_as_mappings(tmp_path) -> None:
    cfg = dapo.load_config(None, {"train.steps": 3, "sampling.dynamic": False, "run.name": "x"})
    assert (cfg.train.steps, cfg.sampling.dynamic, cfg.run.name) == (3, False, "x")
    with pytest.raises(ValueError, match="not 'train.steps=3'"):
        dapo.load_config(None, "train.steps=3")
    summary = {"steps": 2, "val/accuracy_start": 0.25, "val/accuracy_end": 0.5}
    result = dapo.TrainResult(tmp_path, 2, 0.25, 0.5, summary)
    assert result["run_dir"] == tmp_path and result["val/accuracy_end"] == 0.5
    metrics = {"avg@k": {"mean": 0.5, "low": 0.25, "high": 0.75}}
    ev = dapo.EvalResult(tmp_path, metrics, {"k": 4})
    assert ev["avg@k"]["mean"] == 0.5 and ev["protocol"] == {"k": 4}


def test_scores_beyond_max_abs_are_counted_faults_and_training_stays_finite(tmp_path, capsys):
    """1e308 twice in a group made its advantages NaN, and a later error blamed optim.lr: such
    a score is a fault (graded incorrect, reward/faults), named with its row."""
    base = [*TINY, f"run.out_dir={tmp_path}", "run.name=huge", "reward.workers=1"]
    assert main(["train", *base, "reward.function=user_rewards:huge_for_the_right"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "huge" / "metrics.jsonl").open()][1:]
    assert sum(r["reward/faults"] for r in rows) > 0
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    err = capsys.readouterr().err
    assert "out_of_bounds: verifier" in err and "beyond reward.max_abs=1e+06" in err
    assert "first (row " in err


def test_eval_refuses_code_that_came_with_the_run_directory_of_its_config(tmp_path, capsys):
    """`dapo eval --config RUN/config.yaml` (as its help invites) imported the env.class that
    config named inside RUN: code that came with a directory from elsewhere."""
    from dapo.config import dump_yaml

    run_dir = tmp_path / "foreign"
    run_dir.mkdir()
    marker = tmp_path / "ran"
    planted = run_dir / "planted.py"
    planted.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nclass Env: pass\n")
    (run_dir / "metrics.jsonl").write_text("")
    cfg = load_config(None, [f"env.class={planted}:Env"])
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    args = ["--data", "arith", "--k", "1", "--num-problems", "1", "--out", str(tmp_path / "e")]
    assert main(["eval", "embedded", *args, "--config", str(run_dir / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"env.class={planted}:Env is a file inside the run directory {run_dir}" in err
    assert not marker.exists() and not (tmp_path / "e").exists()
