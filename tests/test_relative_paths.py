"""Relative paths in a run's config: a run started in one directory resumes from any other,
because its config.yaml names the model, the data and the code it read by absolute path."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import save_model
from test_hf_models import files, train_args  # noqa: F401 - its data fixture, used below

from dapo.cli import main
from dapo.config import load_config
from dapo.config.local_paths import absolute_paths
from dapo.run.rundir import plan_new_run

REWARD = "def score(response, ground_truth):\n    return float(ground_truth in response)\n"


@pytest.fixture()
def project(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A project directory holding a model, the two data files and a reward function."""
    project = tmp_path / "project"
    save_model(project / "models" / "tiny", "qwen2")
    (project / "data").mkdir()
    for f in request.getfixturevalue("files"):
        shutil.copy(f, project / "data" / f.name)
    (project / "reward.py").write_text(REWARD)
    return project


def _relative(tmp_path: Path) -> list[str]:
    """The run's settings, every path relative to the project directory."""
    names = ["data/train.jsonl", "data/val.parquet"]
    args = train_args(tmp_path, Path("models/tiny"), names, "train.steps=1")
    return [*args, "reward.function=reward.py:score"]


def test_a_run_started_with_relative_paths_resumes_from_another_directory(
    tmp_path, project, monkeypatch
):
    monkeypatch.chdir(project)
    assert main(_relative(tmp_path)) == 0
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["model"]["path"] == str(project / "models" / "tiny")
    assert saved["data"]["train_file"] == str(project / "data" / "train.jsonl")
    assert saved["data"]["val_file"] == str(project / "data" / "val.parquet")
    assert saved["reward"]["function"] == f"{project / 'reward.py'}:score"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # "models/tiny" here would be read as a Hub id
    assert main(["train", "--resume", str(tmp_path / "r"), "train.steps=2"]) == 0
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]


def test_the_same_relative_settings_resume_as_the_saved_absolute_ones(
    tmp_path, project, capsys, monkeypatch
):
    monkeypatch.chdir(project)
    args = _relative(tmp_path)
    assert main(args) == 0
    # The run's own settings given again, as written, from where it started: no difference.
    assert main(["train", "--resume", str(tmp_path / "r"), *args[1:], "train.steps=2"]) == 0
    monkeypatch.chdir(tmp_path)  # from elsewhere they name other (missing) files: refused
    assert main(["train", "--resume", str(tmp_path / "r"), *args[1:], "train.steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"model.path: '{project / 'models' / 'tiny'}' -> 'models/tiny'" in err


def test_absolute_paths_settles_only_local_paths_that_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Local").mkdir(parents=True)
    (tmp_path / "t.jsonl").write_text("")
    (tmp_path / "env.py").write_text("")
    cfg = load_config(
        None,
        [
            "model.path=Qwen/Local",
            "data.train_file=t.jsonl",
            "data.val_file=missing.jsonl",
            "env.class=env.py:Tools",
            "reward.function=package.module:score",
        ],
    )
    settled = absolute_paths(cfg)
    assert settled.model.path == str(tmp_path / "Qwen" / "Local")
    assert settled.data.train_file == str(tmp_path / "t.jsonl")
    assert settled.data.val_file == "missing.jsonl"  # named as given in its own error
    assert settled.env.class_ == f"{tmp_path / 'env.py'}:Tools"
    assert settled.reward.function == "package.module:score"  # a module, not a file
    assert cfg.model.path == "Qwen/Local"  # a copy: the config given is left as it is
    hub = load_config(None, ["model.path=Qwen/Qwen2.5-0.5B", "env.class=math_tool"])
    assert absolute_paths(hub) == hub
    assert absolute_paths(load_config(None)) == load_config(None)  # embedded, no files


@pytest.mark.parametrize("spec", ["reward.py:score", "./reward.py:score"])
def test_a_reward_file_is_settled_like_the_run_settles_it(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = load_config(None, [f"reward.function={spec}"])
    assert absolute_paths(cfg).reward.function == f"{tmp_path / 'reward.py'}:score"


def test_a_home_directory_is_expanded_in_every_path_a_run_reads_or_writes(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "t.jsonl").write_text("")
    (home / "m").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        None,
        [
            "data.train_file=~/data/t.jsonl",
            "data.val_file=~/data/t.jsonl",
            "model.path=~/m",
            "run.out_dir=~/runs",
        ],
    )
    settled = absolute_paths(cfg)
    assert settled.data.train_file == str(home / "data" / "t.jsonl")
    assert settled.model.path == str(home / "m")
    cfg.run.name = "r"
    assert plan_new_run(cfg).path == home / "runs" / "r"  # not ./~/runs/r
    assert not (tmp_path / "~").exists()


def test_eval_num_samples_zero_on_resume_keeps_the_number_the_run_settled(tmp_path):
    """0 means "the val file's copies of each problem", which the run turned into a number
    when it started; given again on a resume it is that number, not what the file holds now
    (a val file cut from 4 copies to 2 made the resumed run compare avg@4 with avg@2)."""
    from dapo.api.run_config import resolve_config
    from dapo.config import dump_yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(load_config(None, ["eval.num_samples=4"])))
    cfg, _ = resolve_config(None, ["eval.num_samples=0"], resume=run)
    assert cfg.eval.num_samples == 4
    cfg, _ = resolve_config(None, [], resume=run)
    assert cfg.eval.num_samples == 4
