"""A run and ``dapo eval`` refuse (or skip) the rows ``dapo data check`` lists for a ground
truth its task cannot grade, by the task that grades the row: ``reward.mode``'s for every
row, else the row's ``data_source``'s; none under ``reward.function``, which may take any
text. Before, such a row was loaded and every response to it graded wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo.api.eval_inputs import EvalRequest, problems_of
from dapo.config import load_config
from dapo.data.files import DataError
from dapo.data.tools import check_file
from dapo.training.inputs import load_run_data

GOOD = json.dumps({"entry_point": "f", "tests": "assert f(1) == 1\n"})
NOT_JSON = 'not JSON: expected {"entry_point": NAME, "tests": CODE}'


def _rows(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    """``rows`` of (data_source, prompt, ground truth) as a dapo-format JSON Lines file."""
    lines = [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": prompt}],
            "reward_model": {"ground_truth": truth, "style": "rule"},
            "extra_info": {"index": str(i)},
        }
        for i, (source, prompt, truth) in enumerate(rows)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def files(tmp_path) -> tuple[Path, Path]:
    """(a train file whose row 1 is a code row with a ground truth that is not JSON, a val
    file of math rows)."""
    train = _rows(
        tmp_path / "train.jsonl",
        [("code", "Write f.", GOOD), ("code", "Write g.", "forty-two"), ("math_dapo", "1+1?", "2")],
    )
    return train, _rows(tmp_path / "val.jsonl", [("math_dapo", "2+2?", "4")])


def _load(train: Path, val: Path, *overrides: str):
    files = [f"data.train_file={train}", f"data.val_file={val}", f"model.path={train.parent}"]
    return load_run_data(load_config(None, [*files, *overrides]))


def test_a_run_refuses_the_row_check_lists_naming_file_row_and_field(files):
    train, val = files
    assert [str(b) for b in check_file(train).bad_rows] == [
        f"row 1, field reward_model.ground_truth: {NOT_JSON}"
    ]
    with pytest.raises(DataError) as refused:
        _load(train, val)
    assert str(refused.value).startswith(
        f"{train}: row 1, field 'reward_model.ground_truth': {NOT_JSON}; fix it, or "
    )
    data = _load(train, val, "data.on_bad_row=skip")
    assert [(p.messages[-1]["content"], p.answer) for p in data.train] == [
        ("Write f.", GOOD),
        ("1+1?", "2"),
    ]


def test_the_task_that_grades_the_row_gives_the_rule(files, tmp_path):
    train, val = files
    # reward.mode grades every row by its task: dapo's takes any text, code's refuses "2".
    by_dapo = _load(train, val, "reward.mode=dapo")
    assert [p.answer for p in by_dapo.train] == [GOOD, "forty-two", "2"]
    with pytest.raises(DataError, match=rf"{val}: row 0, field 'reward_model.ground_truth': a"):
        _load(val, val, "reward.mode=code")
    # A reward function of the user's grades every row: any ground truth is its to read.
    score = tmp_path / "score.py"
    score.write_text("def score(response, ground_truth):\n    return 0.0\n")
    own = _load(train, val, f"reward.function={score}:score")
    assert [p.answer for p in own.train] == [GOOD, "forty-two", "2"]


def test_dapo_eval_refuses_the_row_before_the_model_loads(files, tmp_path):
    train, val = files
    model = str(tmp_path / "no-model")
    with pytest.raises(DataError, match=r"row 1, field 'reward_model.ground_truth': not JSON"):
        problems_of(EvalRequest(model=model, data=str(train)))
    with pytest.raises(DataError, match=rf"{val}: row 0, field 'reward_model.ground_truth'"):
        problems_of(EvalRequest(model=model, data=str(val), reward_mode="code"))
