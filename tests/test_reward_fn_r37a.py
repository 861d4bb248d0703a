"""Review r37a: a reward file that ends the program as it is imported, a reward_fn defined under
the script's ``if __name__ == "__main__":``, a reward path without .py, and a reward function
that changes the working directory in a run graded in-process (reward.workers=0)."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
from helpers import SMALL

from dapo.cli import main
from dapo.config import load_config
from dapo.reward import custom
from dapo.run import rundir

GUARD = '`if __name__ == "__main__":`'


# --- a reward file that calls sys.exit as it is imported -------------------------------------


@pytest.mark.parametrize(
    ("source", "code"),
    [
        ("import sys\nsys.exit(0)\n", "0"),
        ("import sys\nsys.exit('bye from import')\n", "'bye from import'"),
        # argparse at module level reads dapo's own command line: usage, then exit 2
        ("import argparse\np = argparse.ArgumentParser()\nARGS = p.parse_args()\n", "2"),
    ],
)
def test_a_reward_file_that_exits_at_import_stops_the_run_naming_it(
    tmp_path, capsys, monkeypatch, source, code
) -> None:
    monkeypatch.setattr(sys, "argv", ["dapo", "train", "reward.function=..."])  # not pytest's
    path = tmp_path / "rf_exit.py"
    path.write_text(source + "def score(r, g):\n    return 1.0\n")
    spec = f"{path}:score"
    out = tmp_path / "runs"
    rc = main(["train", *SMALL, f"run.out_dir={out}", f"reward.function={spec}"])
    assert rc == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"dapo: error: reward.function={spec!r}: importing {path} called sys.exit({code}) (a "
        f"script that parses its own command line?); keep a script's work under {GUARD}, so "
        "that importing the file only defines functions"
    )
    assert not out.exists()  # refused before the run directory is made


def test_a_keyboard_interrupt_while_importing_is_not_turned_into_an_error(tmp_path) -> None:
    path = tmp_path / "rf_kb.py"
    path.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        custom.check_spec(f"{path}:score")


# --- a reward path without .py ---------------------------------------------------------------


def test_a_reward_file_without_py_is_refused_with_the_rename(tmp_path, monkeypatch) -> None:
    (tmp_path / "rewards_noext").write_text("def score(r, g):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "rewards_noext"
    with pytest.raises(ValueError) as err:
        custom.check_spec("./rewards_noext:score")
    assert str(err.value) == (
        f"reward.function='./rewards_noext:score': {path} is not a .py file, and Python imports "
        f"a file only by that name; rename it to rewards_noext.py and give "
        f"reward.function={path}.py:score"
    )


# --- a reward_fn defined under the script's main guard ---------------------------------------


def _script_function(tmp_path, monkeypatch, source: str, name: str = "score"):
    """``name`` as defined when ``source`` (a script) runs as __main__ (without running it:
    the function is made alone, as if the script had defined it)."""
    script = tmp_path / "api_main.py"
    script.write_text(source)
    fake = types.ModuleType("__main__")
    fake.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", fake)
    scope: dict = {"__name__": "__main__"}
    exec(f"def {name}(response, ground_truth):\n    return 1.0\n", scope)
    return script, scope[name]


def test_a_reward_fn_under_the_main_guard_is_refused_before_a_model_loads(
    tmp_path, monkeypatch
) -> None:
    source = (
        "import dapo\n"
        "if __name__ == '__main__':\n"
        "    def score(response, ground_truth):\n"
        "        return 1.0\n"
        "    raise SystemExit('the script ran')\n"
    )
    script, fn = _script_function(tmp_path, monkeypatch, source)
    with pytest.raises(ValueError) as err:
        custom.spec_of(fn)
    assert str(err.value) == (
        f"reward_fn=score is not defined at the top level of {script.resolve()}: reward "
        f"workers (and a resume) import that file as a module, where the block under {GUARD} "
        f"does not run; define it with def at the top level of the file, outside {GUARD}"
    )


@pytest.mark.parametrize(
    "source",
    [
        "def score(response, ground_truth):\n    return 1.0\n",
        "try:\n    from fast import score\nexcept ImportError:\n    def score(r, g):\n"
        "        return 1.0\n",
        "import os\nif os.name:\n    def score(r, g):\n        return 1.0\n",
        "if __name__ == '__main__':\n    pass\nelse:\n    def score(r, g):\n        return 1.0\n",
        "if '__main__' != __name__:\n    pass\ndef helper(r, g):\n    return 1.0\nscore = helper\n",
        "from os.path import join as score\n",
    ],
)
def test_a_reward_fn_the_file_defines_when_imported_is_named_by_its_file(
    tmp_path, monkeypatch, source
) -> None:
    script, fn = _script_function(tmp_path, monkeypatch, source)
    assert custom.spec_of(fn) == f"{script.resolve()}:score"


def test_dapo_train_refuses_a_main_guard_reward_fn_before_the_run_directory(
    tmp_path, monkeypatch
) -> None:
    import dapo

    source = "if __name__ == '__main__':\n    def score(r, g):\n        return 1.0\n"
    _, fn = _script_function(tmp_path, monkeypatch, source)
    out = tmp_path / "runs"
    with pytest.raises(ValueError, match="is not defined at the top level of"):
        dapo.train(overrides=[*SMALL, f"run.out_dir={out}", "reward.workers=1"], reward_fn=fn)
    assert not out.exists()


# --- a reward function that changes the working directory ------------------------------------


def test_the_run_directory_is_absolute_from_the_start(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.out_dir=runs", "run.name=a"])
    assert rundir.plan_new_run(cfg).path == tmp_path / "runs" / "a"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.yaml").write_text("")
    assert rundir.existing_run_dir("old") == tmp_path / "old"


def test_a_reward_fn_that_changes_directory_keeps_the_run_in_one_place(
    tmp_path, monkeypatch
) -> None:
    """With reward.workers=0 the function runs in the trainer's process: its os.chdir sent
    checkpoints/ and model/ to another directory than config.yaml and metrics.jsonl."""
    reward = tmp_path / "rf_cd.py"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    reward.write_text(
        f"import os\ndef score(response, ground_truth):\n    os.chdir({str(elsewhere)!r})\n"
        "    return 1.0 if len(response.split()) % 2 == 0 else -1.0\n"
    )
    monkeypatch.chdir(tmp_path)
    overrides = [*SMALL, "train.steps=2", "arith.num_val=8", "run.threads=1"]
    overrides += ["run.progress=plain", "run.out_dir=runs", "run.name=cd"]
    assert main(["train", *overrides, "reward.function=rf_cd.py:score"]) == 0
    assert Path.cwd() == elsewhere  # the function did change it
    run = tmp_path / "runs" / "cd"
    names = {"config.yaml", "metrics.jsonl", "checkpoints", "model", "summary.json"}
    assert names <= set(os.listdir(run))
    assert os.listdir(elsewhere) == []
    assert "run:\n  out_dir: runs\n" in (run / "config.yaml").read_text()  # as given
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
