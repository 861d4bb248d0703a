"""dapo ablate refuses what would make its table wrong: an override that undoes the plan, a
run of another configuration or past the budget, and files it cannot read; it reads a run
only as far as its summary, and writes nothing through a link."""

from __future__ import annotations

import json
import math
import re

import pytest

from dapo import cli
from dapo.ablate import expand
from dapo.ablate.runs import job_config, job_state, launch, run_jobs, state
from dapo.ablate.table import read_result
from dapo.config import dump_yaml
from dapo.run import manifest
from dapo.run.nofollow import LinkRefused

LIMITS = {"steps": 6, "max_gen_tokens": 0, "max_seconds": 0.0}


@pytest.mark.parametrize(
    "plan, budget, override, named",
    [
        ("2x2", None, "train.seed=7", "train.seed"),
        ("successors", None, " train.seed = 7", "train.seed"),  # as load_config reads it
        ("eps-high", None, "algo.eps_high=0.3", "algo.eps_high"),
        ("2x2", None, "sampling.dynamic=false", "sampling.dynamic"),
        ("table1", None, "run.preset=dapo", "run.preset"),
        ("table1", None, "algo.loss_agg=seq-mean-token-mean", "algo.loss_agg"),
        ("successors", "tokens=5000", "train.steps=10", "--budget tokens=5000"),
        ("successors", "steps=10", "train.max_seconds=60", "--budget steps=10"),
    ],
)
def test_an_override_that_would_undo_the_plan_is_refused(plan, budget, override, named):
    with pytest.raises(ValueError, match=rf"--plan {plan}: the override .*{named}.*drop it"):
        expand(plan, seeds=2, budget=budget, extra=(override,))


def test_overrides_the_plan_leaves_alone_are_applied_to_every_run():
    jobs = expand("eps-high", seeds=2, extra=("optim.lr=1e-4", "train.steps=10"))
    assert all(j.overrides[-2:] == ("optim.lr=1e-4", "train.steps=10") for j in jobs)


def test_the_command_names_a_refused_override_and_starts_nothing(tmp_path, capsys):
    # --out under a file: a command that went on to start runs would fail making it.
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "abl"
    argv = ["ablate", "--plan", "2x2", "--seeds", "8", "--out", str(out), "train.seed=7"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dapo: error: dapo ablate --plan 2x2: the override 'train.seed=7'")


def finished(run_dir, job, *, steps=6, limits=LIMITS, config=None, **summary) -> None:
    """A run of ``job`` (its config.yaml, or ``config``'s) that finished after ``steps``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(config or job_config(job)))
    doc = {"steps": steps, "val/accuracy_end": 0.5, "limits": limits, **summary}
    (run_dir / "summary.json").write_text(json.dumps(doc))
    lines = [{"step": s, "sampling/tokens_generated": 10.0, "perf/step_s": 1.0} for s in range(7)]
    lines[0] = {"step": 0, "val/accuracy": 0.25}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def checkpoint_at(run_dir, step: int, gen_tokens: float = 0.0) -> None:
    """A checkpoint of ``step`` as finding the latest one reads it (trainer.json, manifest)."""
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    trainer = {"format_version": 2, "step": step, "sampler": {"epoch": 0, "pos": 0}}
    trainer.update(consecutive_skips=0, val_start={}, val_last={}, train_seconds=1.0)
    trainer.update(metrics_bytes=0, spent={"gen_tokens": gen_tokens, "step_seconds": 1.0})
    (ckpt / "trainer.json").write_text(json.dumps(trainer))
    manifest.write(ckpt, 2, step, None)
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name + "\n")


def test_a_finished_run_of_another_configuration_is_refused_not_counted(tmp_path):
    job = expand("successors", seeds=1, budget="steps=6")[0]
    run = tmp_path / job.name
    other = job_config(job)
    other.optim.lr, other.run.threads = 1e-5, 7  # threads: a resume may change them
    finished(run, job, config=other)
    checkpoint_at(run, 6)
    with pytest.raises(ValueError, match=rf"{re.escape(str(run))} was run with another") as got:
        job_state(job, tmp_path)
    assert "optim.lr: 1e-05 -> 0.0003" in str(got.value) and "run.threads" not in str(got.value)
    assert "another --out" in str(got.value) and f"remove {run}" in str(got.value)
    launched = []
    with pytest.raises(ValueError, match="another configuration"):  # before any run starts
        run_jobs([job], tmp_path, cores=1, launcher=lambda *a: launched.append(a) or 0)
    assert launched == []
    other.optim.lr = job_config(job).optim.lr
    finished(run, job, config=other)
    assert job_state(job, tmp_path) == "done"


def test_a_run_of_a_config_with_relative_paths_is_its_jobs_run(tmp_path, monkeypatch):
    """A run saves its relative paths absolute and eval.num_samples=0 as the data's count:
    the job's config, read again as written, is still that run's (the ablation once trained
    every run, then refused each as another configuration's)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "score.py").write_text("def score(response, ground_truth):\n    return 1.0\n")
    config = tmp_path / "run.yaml"
    config.write_text("reward:\n  function: score.py:score\neval:\n  num_samples: 0\n")
    job = expand("successors", seeds=1, budget="steps=6")[0]
    saved = job_config(job, config)
    saved.reward.function = f"{tmp_path / 'score.py'}:score"
    saved.eval.num_samples = 4
    finished(tmp_path / "out" / job.name, job, config=saved)
    assert job_state(job, tmp_path / "out", config) == "done"
    saved.eval.num_samples = 8  # a number given is compared as given
    finished(tmp_path / "out" / job.name, job, config=saved)
    config.write_text(config.read_text().replace("num_samples: 0", "num_samples: 4"))
    with pytest.raises(ValueError, match="eval.num_samples: 8 -> 4"):
        job_state(job, tmp_path / "out", config)


def test_a_run_past_the_budget_is_refused_not_counted_as_its_run(tmp_path):
    job = expand("successors", seeds=1, budget="steps=6")[0]
    run = tmp_path / "r"
    finished(run, job, gen_tokens=60.0)
    checkpoint_at(run, 6, gen_tokens=60.0)
    assert state(run, LIMITS) == "done"
    assert state(run, {**LIMITS, "steps": 8}) == "resume"
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(run))} has already gone past .*steps 6 > 3"
    ):
        state(run, {**LIMITS, "steps": 3})
    with pytest.raises(ValueError, match=r"max_gen_tokens 60 > 50.*another --out"):
        state(run, {"steps": 1_000_000, "max_gen_tokens": 50, "max_seconds": 0.0})
    # What resuming it at steps=3 used to leave: 6 steps under a summary of limits 3.
    finished(run, job, limits={**LIMITS, "steps": 3})
    with pytest.raises(ValueError, match="steps 6 > 3"):
        state(run, {**LIMITS, "steps": 3})
    # Extended to 10 and stopped at a checkpoint of step 8: the summary is still step 6's.
    finished(run, job)
    checkpoint_at(run, 8)
    assert state(run, LIMITS) == "done"
    assert state(run, {**LIMITS, "steps": 10}) == "resume"
    with pytest.raises(ValueError, match="steps 8 > 7"):
        state(run, {**LIMITS, "steps": 7})


def test_a_result_is_read_as_far_as_its_summary_and_each_step_once(tmp_path):
    job = expand("successors", seeds=1)[0]
    finished(tmp_path, job, steps=4, gen_tokens=35.0, step_seconds=3.5)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    # Step 3 logged twice (the second is the one kept), and steps 5 and 6 of a later,
    # stopped extension.
    again = json.dumps({"step": 3, "sampling/tokens_generated": 5.0, "val/accuracy": 0.5})
    lines = lines[:4] + [again] + lines[4:]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = read_result(tmp_path)
    assert result["gen_tokens"] == 35.0 and result["seconds"] == 3.5  # the summary's
    assert result["curve"] == [(0, 0.25, 0.0, 0.0), (3, 0.5, 25.0, 2.0)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    del summary["gen_tokens"]  # a summary from before it was written: the lines' sum
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert read_result(tmp_path)["gen_tokens"] == 35.0


@pytest.mark.parametrize(
    "name, text, why",
    [
        ("summary.json", b'{"steps": 6, "lim', "summary.json is not readable JSON"),
        ("summary.json", b"[1]", "summary.json: not an object but list"),
        ("summary.json", b"\xff\xfe", "summary.json is not readable JSON"),
        ("summary.json", b'{"steps": "6"}', "summary.json: steps is '6'"),
        ("summary.json", b'{"steps": 6, "limits": [6]}', "summary.json: limits is"),
        ("summary.json", b'{"steps": 6}', "summary.json: no held-out accuracy at the end"),
        ("metrics.jsonl", b'{"step": 0}\nnot json\n', r"metrics.jsonl, line 2: not JSON"),
        ("metrics.jsonl", b'{"step": 0}\n[1]\n', r"metrics.jsonl, line 2: not a metrics line"),
        ("metrics.jsonl", None, "metrics.jsonl: cannot be read"),
        ("val_problems.json", b'{"step": 6, "uid": [1, 2], "accuracy": [1]}', "val_problems"),
        ("val_problems.json", b"{", "val_problems.json is not an object"),
    ],
)
def test_a_file_that_is_not_what_dapo_writes_is_named_with_the_fix(tmp_path, name, text, why):
    job = expand("successors", seeds=1)[0]
    finished(tmp_path, job)
    if text is None:
        (tmp_path / name).unlink()
    else:
        (tmp_path / name).write_bytes(text)
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path))}/{why}.*remove"):
        read_result(tmp_path)
    if name == "summary.json" and "accuracy" not in why:  # ablate reads it first to skip a run
        with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path))}/{why}.*remove"):
            state(tmp_path, LIMITS)


def test_a_half_written_last_line_and_null_metrics_are_read_as_missing(tmp_path):
    job = expand("successors", seeds=1)[0]
    finished(tmp_path, job)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        last = {"step": 6, "sampling/tokens_generated": 1.0, "rollout/truncated_frac": None}
        f.write(json.dumps(last) + "\n")
        f.write('{"step": 7, "sampling/tok')  # a run killed mid-write
    result = read_result(tmp_path)
    assert math.isnan(result["truncated"]) and math.isnan(result["entropy"])


def test_links_in_the_ablation_directory_are_refused_not_written_through(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    log = tmp_path / "run.log"
    log.symlink_to(victim)
    with pytest.raises(LinkRefused, match="run.log is a symbolic link"):
        launch(["true"], log)
    # Every run done already: the command goes straight to the table, whose file is a link.
    out = tmp_path / "abl"
    jobs = expand("successors", seeds=1, budget="steps=6")
    for job in jobs:
        finished(out / job.name, job)
    (out / "table.md").symlink_to(victim)
    argv = ["ablate", "--plan", "successors", "--seeds", "1", "--budget", "steps=6"]
    assert cli.main([*argv, "--out", str(out)]) == 2
    assert "table.md is a symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "keep me\n"
