"""Budgets other than steps: ``train.max_gen_tokens`` and ``train.max_seconds`` end a run after
the step that spends them, with the final evaluation, and a resume carries the spending on."""

import json

import pytest
from test_end_to_end import SMALL

from dapo.cli import main
from dapo.config import load_config


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_token_budget_ends_the_run_and_a_resume_carries_it_on(tmp_path, cache_dir, capsys):
    common = [f"embedded.cache_dir={cache_dir}", f"run.out_dir={tmp_path}", "run.name=r"]
    common += [*SMALL, "train.steps=10", "eval.every=0"]
    assert main(["train", *common, "train.max_gen_tokens=1"]) == 0
    run = tmp_path / "r"
    first = lines(run)
    assert [m["step"] for m in first] == [0, 1]  # one step spends more than 1 token
    assert "val/accuracy" in first[1]  # and it is the last: evaluated
    t1 = first[1]["sampling/tokens_generated"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["gen_tokens"] == t1
    assert summary["limits"] == {"steps": 10, "max_gen_tokens": 1, "max_seconds": 0.0}
    assert json.loads((run / "val_problems.json").read_text())["step"] == 1
    assert f"after 1 steps ({t1:,.0f} tokens generated" in capsys.readouterr().out

    # A larger budget resumes from the last checkpoint; the tokens of step 1 still count, so
    # one more step (of about as many tokens) spends t1 + 1.
    budget = int(t1) + 1
    assert main(["train", "--resume", str(run), f"train.max_gen_tokens={budget}"]) == 0
    second = lines(run)
    assert [m["step"] for m in second] == [0, 1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["gen_tokens"] == t1 + second[2]["sampling/tokens_generated"]
    assert summary["limits"]["max_gen_tokens"] == budget


def test_a_seconds_budget_ends_the_run(tmp_path, cache_dir):
    args = [f"embedded.cache_dir={cache_dir}", f"run.out_dir={tmp_path}", "run.name=s"]
    assert main(["train", *args, *SMALL, "train.steps=10", "train.max_seconds=1e-6"]) == 0
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    step_s = lines(tmp_path / "s")[1]["perf/step_s"]
    assert summary["steps"] == 1 and summary["step_seconds"] == step_s


def test_budgets_are_checked():
    with pytest.raises(ValueError) as err:
        load_config(None, ["train.max_gen_tokens=-1", "train.max_seconds=-2"])
    assert "train.max_gen_tokens must be >= 0" in str(err.value)
    assert "train.max_seconds must be >= 0" in str(err.value)


def test_a_budget_changes_where_a_run_stops_not_its_course(tmp_path, cache_dir):
    from safetensors.torch import load_file

    common = [f"embedded.cache_dir={cache_dir}", f"run.out_dir={tmp_path}", *SMALL, "eval.every=0"]
    common.append("run.threads=1")  # bit for bit: a fixed thread count
    assert main(["train", *common, "run.name=steps", "train.steps=2"]) == 0
    by_steps = lines(tmp_path / "steps")
    tokens = int(by_steps[1]["sampling/tokens_generated"]) + 1  # spent during step 2
    argv = ["train", *common, "run.name=tokens", "train.steps=10", f"train.max_gen_tokens={tokens}"]
    assert main(argv) == 0
    by_tokens = lines(tmp_path / "tokens")

    def course(metrics):
        return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]

    assert course(by_tokens) == course(by_steps)
    a, b = (load_file(tmp_path / r / "model" / "model.safetensors") for r in ("steps", "tokens"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
