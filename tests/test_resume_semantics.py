"""What a resume accepts besides the run it continues: a step count below the checkpoint's
(refused), none left to train (the run ends there, its policy evaluated), changes that keep the
run going but not bit-identical (warned), a run directory named elsewhere (refused), and the
guide's table of the fields a resume may change."""

from __future__ import annotations

import copy
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import fake_checkpoint
from safetensors.torch import load_file

from dapo.config import RESUME_SAFE_FIELDS, apply_overrides, load_config
from dapo.config.loading import RESUME_INEXACT_FIELDS
from dapo.models.demo import TinyModelSpec, build_tokenizer, tiny_qwen2
from dapo.reward.tasks import arith
from dapo.run import checkpoint, launcher, run_files
from dapo.training import loop
from dapo.training import resume as resume_checks
from dapo.training.resume import check_resume

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "rollout.group_size=4",
    "rollout.max_new_tokens=12",
    "algo.l_cache=4",
    "train.steps=2",
    "train.prompts_per_step=2",
    "train.responses_per_minibatch=4",
    "train.save_every=1",
    "sampling.dynamic=false",
    "eval.num_samples=1",
    "reward.workers=0",
    "optim.lr=1e-2",  # so that one step changes what the policy answers
    "optim.warmup_steps=0",
    "run.threads=1",
]
"""Two steps of a few seconds on the tiny model, a checkpoint after each."""


def _fit(cfg, start, run_dir: Path, data, *, resume: bool) -> tuple[dict, str]:
    """``fit`` on one thread (the runs compared are then equal to the bit); its summary and
    what it printed."""
    torch.set_num_threads(1)
    tokenizer, train, val = data
    out = io.StringIO()
    model = copy.deepcopy(start)
    summary = loop.fit(
        cfg, model, tokenizer, train, val, run_dir=run_dir, stream=out, resume=resume
    )
    return summary, out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of 2 steps: ``every`` evaluates after each step, ``ends`` (with the
    config.yaml a run directory has) only at the start and the end."""
    root = tmp_path_factory.mktemp("resume-semantics")
    tokenizer = build_tokenizer()
    spec = TinyModelSpec(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_positions=256,
    )
    start = tiny_qwen2(tokenizer, spec, seed=0)
    with torch.no_grad():  # EOS likely: responses of many lengths, which training changes
        start.model.embed_tokens.weight[tokenizer.eos_token_id] *= 8
    train, val, _ = arith.make_splits(40, 3, seed=0)
    data = (tokenizer, [p for p, _ in train], [p for p, _ in val])
    made = {}
    for name, every in (("every", 1), ("ends", 0)):
        where = [f"run.out_dir={root}", f"run.name={name}"]
        cfg = load_config(None, [*SMALL, f"eval.every={every}", *where])
        run_dir = root / name
        run_dir.mkdir()
        run_files.write_config(run_dir, cfg)
        _fit(cfg, start, run_dir, data, resume=False)
        made[name] = (cfg, run_dir)
    return made, start, data


def _lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith("perf/")} for x in lines]


def _stopped_after_step_1(runs, tmp_path: Path) -> Path:
    """A copy of ``ends`` as if stopped after step 1: its checkpoint is the latest, and the
    policy of step 1 was never evaluated."""
    made, _, _ = runs
    run_dir = tmp_path / "stopped"
    shutil.copytree(made["ends"][1], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000002")
    (run_dir / "checkpoints" / "latest").write_text("step_000001")
    for name in ("summary.json", "samples.jsonl", "val_problems.json"):
        (run_dir / name).unlink()
    shutil.rmtree(run_dir / "model")
    with open(run_dir / "metrics.jsonl", "rb+") as f:  # as the checkpoint of step 1 left it
        f.truncate(checkpoint.read_trainer_state(checkpoint.find_latest(run_dir))["metrics_bytes"])
    return run_dir


def _files(run_dir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- train.steps


def test_train_steps_below_the_checkpoint_step_is_refused_before_its_weights_load(
    runs, tmp_path, monkeypatch
):
    made, start, data = runs
    cfg, ends = made["ends"]
    run_dir = tmp_path / "run"
    shutil.copytree(ends, run_dir)
    before = _files(run_dir)

    def no_load(*_, **__):
        raise AssertionError("the checkpoint's weights were loaded")

    monkeypatch.setattr(loop.sharded_checkpoint, "load", no_load)
    with pytest.raises(ValueError) as err:
        _fit(apply_overrides(cfg, ["train.steps=1"]), start, run_dir, data, resume=True)
    assert str(err.value) == (
        f"--resume {run_dir}: train.steps=1 is below 2, the step of its checkpoint "
        "step_000002, and a run is never cut back. Give train.steps=2 to end the run there "
        "(its policy evaluated and exported), or more to go on; for a shorter run, start a "
        "new one under another run.name"
    )
    assert _files(run_dir) == before


def test_a_resume_with_no_step_left_ends_the_run_with_its_policy_evaluated(runs, tmp_path):
    """Stopped after step 1 and resumed with train.steps=1: the step-1 policy is evaluated (as
    a run evaluating after every step did), its records written, and a later resume to 2 steps
    goes on exactly as the uninterrupted run."""
    made, start, data = runs
    (cfg, ends), every = made["ends"], made["every"][1]
    run_dir = _stopped_after_step_1(runs, tmp_path)
    summary, out = _fit(apply_overrides(cfg, ["train.steps=1"]), start, run_dir, data, resume=True)
    assert "no step left after step 1: evaluating its policy to end the run" in out
    step_1 = _lines(every)[1]  # training metrics and the evaluation of step 1
    assert summary["steps"] == 1 and summary["limits"]["steps"] == 1
    assert summary["val/accuracy_end"] == step_1["val/accuracy"]
    start_figures = {k: v for k, v in _lines(every)[0].items() if k != "step"}
    assert start_figures != {k: v for k, v in step_1.items() if "val/" in k}  # another policy
    lines = _lines(run_dir)
    assert [x["step"] for x in lines] == [0, 1, 1]  # step 1 again, the figures added
    assert lines[2] == step_1 and lines[1] == {k: v for k, v in step_1.items() if "val/" not in k}
    problems = json.loads((run_dir / "val_problems.json").read_text())
    assert problems["step"] == 1
    assert sum(problems["accuracy"]) / len(problems["accuracy"]) == step_1["val/accuracy"]
    assert all(json.loads(x)["step"] == 1 for x in (run_dir / "samples.jsonl").open())
    assert (run_dir / "model" / "model.safetensors").is_file()

    summary, out = _fit(cfg, start, run_dir, data, resume=True)  # on to 2 steps
    assert "no step left" not in out and summary["steps"] == 2
    assert _lines(run_dir) == _lines(ends)
    a, b = (load_file(d / "model" / "model.safetensors") for d in (run_dir, ends))
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_budget_already_spent_ends_the_run_with_its_policy_evaluated(runs, tmp_path):
    made, start, data = runs
    cfg, every = made["ends"][0], made["every"][1]
    run_dir = _stopped_after_step_1(runs, tmp_path)
    spent = apply_overrides(cfg, ["train.max_gen_tokens=1"])
    summary, out = _fit(spent, start, run_dir, data, resume=True)
    assert "no step left after step 1" in out
    assert summary["steps"] == 1 and summary["limits"]["max_gen_tokens"] == 1
    assert summary["val/accuracy_end"] == _lines(every)[1]["val/accuracy"]
    assert _lines(run_dir)[-1] == _lines(every)[1]  # the figures of the step-1 policy
    assert json.loads((run_dir / "val_problems.json").read_text())["step"] == 1


def test_a_finished_run_resumed_with_no_step_left_is_not_evaluated_again(
    runs, tmp_path, monkeypatch
):
    made, start, data = runs
    cfg, ends = made["ends"]
    run_dir = tmp_path / "run"
    shutil.copytree(ends, run_dir)
    trainer = checkpoint.read_trainer_state(checkpoint.find_latest(run_dir))
    assert trainer["step"] == 2 and trainer["val_step"] == 2  # its last evaluation's step

    def no_evaluation(*_, **__):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(loop, "evaluate", no_evaluation)
    summary, out = _fit(cfg, start, run_dir, data, resume=True)
    assert "no step left" not in out
    assert summary == json.loads((ends / "summary.json").read_text()) | {
        "train_seconds": summary["train_seconds"]
    }
    assert (run_dir / "metrics.jsonl").read_bytes() == (ends / "metrics.jsonl").read_bytes()


# ----------------------------------------------------------------------------- other changes


def test_threads_or_tensor_parallel_changed_on_a_resume_are_warned_of(runs, tmp_path, capsys):
    made, start, data = runs
    cfg, ends = made["ends"]
    run_dir = tmp_path / "run"
    shutil.copytree(ends, run_dir)
    ckpt = checkpoint.find_latest(run_dir)
    check_resume(cfg, run_dir, ckpt)
    assert capsys.readouterr().err == ""
    check_resume(apply_overrides(cfg, ["rollout.tp_size=2"]), run_dir, ckpt)
    assert capsys.readouterr().err == (
        "dapo: warning: rollout.tp_size 1 -> 2 on this resume: the run goes on, but is no "
        "longer bit-identical to an uninterrupted one (the engine then splits its sums over "
        "another number of GPUs); resume with rollout.tp_size=1 for that\n"
    )
    check_resume(apply_overrides(cfg, ["run.deterministic=true"]), run_dir, ckpt)
    assert capsys.readouterr().err == (
        "dapo: warning: run.deterministic False -> True on this resume: the run goes on, but "
        "is no longer bit-identical to an uninterrupted one (a GPU's kernels then sum in "
        "another order); resume with run.deterministic=False for that\n"
    )
    _fit(apply_overrides(cfg, ["run.threads=2"]), start, run_dir, data, resume=True)
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert warned == [
        "dapo: warning: run.threads 1 -> 2 on this resume: the run goes on, but is no longer "
        "bit-identical to an uninterrupted one (CPU kernels then sum in another order); "
        "resume with run.threads=1 for that"
    ]


def test_a_run_directory_named_elsewhere_on_a_resume_is_refused(runs, tmp_path):
    made, start, data = runs
    cfg, ends = made["ends"]
    run_dir = tmp_path / "copy"
    shutil.copytree(ends, run_dir)
    ckpt = checkpoint.find_latest(run_dir)
    for overrides, named in (
        (["run.name=other"], "run.name='other' (saved: 'ends')"),
        ([f"run.out_dir={tmp_path}"], f"run.out_dir='{tmp_path}' (saved: '{ends.parent}')"),
    ):
        with pytest.raises(ValueError) as err:
            _fit(apply_overrides(cfg, overrides), start, run_dir, data, resume=True)
        assert str(err.value) == (
            f"--resume {run_dir}: {named} would name another run directory, but a resumed run "
            f"stays in the directory given to --resume, {run_dir}. Drop these overrides; to "
            "continue the run elsewhere, copy its directory there and resume the copy"
        )
    # The saved values (a copied run), or the directory resumed itself (as dapo ablate gives).
    check_resume(cfg, run_dir, ckpt)
    check_resume(apply_overrides(cfg, [f"run.out_dir={tmp_path}", "run.name=copy"]), run_dir, ckpt)


# ----------------------------------------------------------------------------- the docs


def _fields(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+\.[a-z_0-9]+)`", text))


def test_the_docs_list_exactly_the_fields_a_resume_may_change():
    guide = (ROOT / "docs" / "guides" / "resume-and-failures.md").read_text()
    section = guide.split("### Overrides on a resume", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(x for x in section.splitlines() if x.startswith("| `"))
    assert _fields(table) == RESUME_SAFE_FIELDS
    warned = next(x for x in section.split("\n- ") if "no longer bit-identical" in x)
    assert _fields(warned) == set(RESUME_INEXACT_FIELDS) <= RESUME_SAFE_FIELDS
    # troubleshooting.md's list: tests/test_docs.py


def test_a_failed_run_is_resumed_from_its_checkpoint_or_started_again(tmp_path, monkeypatch):
    """A run that fails before its first checkpoint has nothing to resume: the hint said to
    resume it, and that command then said there was no checkpoint."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    run.mkdir()
    assert resume_checks.retry_hint(run, "optim.lr=<lower>") == (
        "It stopped before its first checkpoint, so there is nothing to resume: start it again "
        "with the same command, optim.lr=<lower> and --overwrite"
    )
    fake_checkpoint(run)
    assert resume_checks.retry_hint(run, "optim.lr=<lower>") == (
        "The run directory is intact; resume from its last checkpoint with a changed config: "
        f"dapo train --resume {run} optim.lr=<lower> --force"
    )


def test_the_resume_command_is_the_launch_that_made_the_run(monkeypatch):
    """Under torchrun, "dapo train --resume RUN" started one process, which refuses a job's
    settings (dist.rollout_ranks): the hint names the launch again."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launcher.resume_command("runs/x") == "dapo train --resume runs/x"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert launcher.resume_command("runs/x") == (
        "torchrun --nproc-per-node 8 -m dapo train --resume runs/x"
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two nodes
    assert launcher.resume_command("runs/x") == (
        "the job's torchrun launch on every node, with -m dapo train --resume runs/x"
    )
