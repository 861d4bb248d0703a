"""A resume reads the data files again: when they changed since the run started, the run it
would continue is not the one that was started, and the resume is refused before a model
loads (the training problems by the sampler's digest, the validation ones by the digest
each checkpoint records)."""

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import save_model
from test_hf_models import files, train_args  # noqa: F401 - its data fixture, used below

from dapo.cli import main
from dapo.data.files import load_problems
from dapo.run import checkpoint
from dapo.training.resume import val_set


@pytest.fixture()
def started(tmp_path: Path, files) -> tuple[Path, Path, Path]:  # noqa: F811
    """A run of one step over copies of the data files: (run, train file, val file)."""
    data = tmp_path / "data"
    data.mkdir()
    train, val = (Path(shutil.copy(f, data / f.name)) for f in files)
    save_model(tmp_path / "model", "qwen2")
    assert main(train_args(tmp_path, tmp_path / "model", (train, val), "train.steps=1")) == 0
    return tmp_path / "r", train, val


def test_a_checkpoint_records_the_validation_problems_it_was_evaluated_on(started):
    run, _, val = started
    trainer = json.loads((checkpoint.find_latest(run) / "trainer.json").read_text())
    problems = load_problems(str(val), question_key="q", answer_key="a", wrap_template=True)
    assert trainer["val_set"]["problems"] == 3  # 3 problems, 4 rows each
    assert trainer["val_set"] == val_set(problems.problems)


def test_a_changed_validation_file_is_refused_on_resume(started, capsys):
    """Its figures after the resume would have been over other problems than the step-0
    baseline and every figure before it, with nothing to say so."""
    run, _, val = started
    table = pq.read_table(val)
    pq.write_table(table.slice(0, 8), val)  # the last problem's 4 rows dropped
    assert main(["train", "--resume", str(run), "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "the run was evaluated on 3 validation problems" in err
    assert "and this resume reads 2 other ones" in err
    assert "data.val_file changed since, or a forced data.* or arith.* setting" in err
    assert "Resume with the file and settings the run started with" in err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]  # the run left as it was


def test_a_changed_training_file_is_refused_before_a_model_loads(started, capsys, monkeypatch):
    run, train, _ = started
    rows = train.read_text().splitlines()
    train.write_text("\n".join(rows[:-1]) + "\n")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    from dapo.models import policy

    monkeypatch.setattr(policy, "load_policy", no_model)
    assert main(["train", "--resume", str(run), "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "saved drawing from 48 training problems" in err
    assert "data.train_file changed since" in err
