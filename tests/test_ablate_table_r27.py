"""Review r27: the ablation table refuses a metrics.jsonl cut before the step its summary.json
names (it printed an earlier step's figures), says how many seeds a difference pairs when a
run is missing, why a verdict is left out and which runs the table is without, and names a
val_problems.json whose uids are not text (a mix crashed the table)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dapo import cli
from dapo.ablate import expand
from dapo.ablate.plans import PLANS
from dapo.ablate.runs import job_config
from dapo.ablate.table import ablation_table, markdown, read_result
from dapo.config import dump_yaml

LIMITS = {"steps": 3, "max_gen_tokens": 0, "max_seconds": 0.0}


def finished(run_dir: Path, job, accuracy: float = 0.5, uids=("a", "b")) -> None:
    """A 3-step run of ``job`` as dapo leaves it: config.yaml, summary.json, metrics.jsonl (the
    step's entropy is 0.1 x its number) and val_problems.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(job_config(job)))
    summary = {"steps": 3, "val/accuracy_end": accuracy, "limits": LIMITS}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    lines = [{"step": 0, "val/accuracy": 0.25}]
    for step in (1, 2, 3):
        lines.append({"step": step, "sampling/tokens_generated": 100.0 * step,
                      "sampling/groups_kept": 1.0, "perf/step_s": 1.0,
                      "train/entropy": 0.1 * step, "rollout/truncated_frac": 0.0})  # fmt: skip
    lines[-1]["val/accuracy"] = accuracy
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    problems = {"step": 3, "uid": list(uids), "accuracy": [accuracy] * len(uids)}
    (run_dir / "val_problems.json").write_text(json.dumps(problems))


def cut(run_dir: Path, keep: int, tail: str = "") -> None:
    """metrics.jsonl cut to its first ``keep`` lines, and ``tail`` (no newline) after them."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:keep]) + tail)


# --- 1: a metrics.jsonl that stops before summary.json's last step -----------------------------


@pytest.mark.parametrize(
    "keep, tail, ends",
    [
        (2, "", "ends at step 1"),
        (0, "", "holds no step"),
        (3, '{"step": 3, "sampling/tok', "ends at step 2"),  # the last step's line half-written
    ],
)
def test_a_log_cut_before_the_summarys_last_step_is_named_with_the_fix(tmp_path, keep, tail, ends):
    job = expand("successors", seeds=1)[0]
    finished(tmp_path, job)
    assert read_result(tmp_path)["entropy"] == pytest.approx(0.3)  # step 3's, whole
    cut(tmp_path, keep, tail)
    want = (
        f"{tmp_path}/metrics.jsonl {ends} but {tmp_path}/summary.json says the run finished at "
        f"step 3: the log was cut or emptied since; remove {tmp_path} (ablate then runs it again)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        read_result(tmp_path)


def test_the_command_refuses_a_table_from_a_cut_log(tmp_path, capsys):
    out = tmp_path / "abl"
    jobs = expand("successors", seeds=1, budget="steps=3")
    for job in jobs:
        finished(out / job.name, job)
    cut(out / jobs[1].name, 2)  # nothing left to run: the command goes straight to the table
    argv = ["ablate", "--plan", "successors", "--seeds", "1", "--budget", "steps=3"]
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / jobs[1].name}/metrics.jsonl ends at step 1 but " in err
    assert not (out / "table.md").exists()


# --- 2: a difference over fewer seeds than its rows' -------------------------------------------


def two_by_two(accs: dict[int, dict[int, float]]) -> dict:
    """Results of the 2x2's rows (by index) at their seeds, as read_result gives them."""
    names = [r.name for r in PLANS["2x2"]()]
    return {names[i]: {s: {"accuracy": a, "gen_tokens": 100.0, "seconds": 10.0,
                           "tokens_per_kept_group": 50.0, "entropy": 0.5, "truncated": 0.0,
                           "curve": [(0, 0.0, 0.0, 0.0)]} for s, a in per_seed.items()}
            for i, per_seed in accs.items()}  # fmt: skip


def test_a_difference_over_fewer_seeds_says_so_and_why_a_verdict_is_left_out():
    # Both on (the row all are compared with) lost seed 0; off/off is 0.125 and 0.25, both on
    # 0.25 at seed 1: the accuracy columns differ by -6.2, the difference (seed 1) is 0.0.
    res = two_by_two({0: {0: 0.125, 1: 0.25}, 1: {0: 0.25, 1: 0.25}, 3: {1: 0.25}})
    table = ablation_table(PLANS["2x2"](), res, resamples=500)
    off_off, off_on, both = table
    assert off_off["paired_seeds"] == 1 and off_off["fewer_paired"] and "p" not in off_off
    assert "diff" not in both and "left_out" not in both  # compared with nothing
    text = markdown(table, missing=["clip-higher-on-dynamic-sampling-on-seed0"])
    assert (
        "| clip-higher off, dynamic sampling off | 2 | 18.8 [12.5, 25.0] "
        "| clip-higher on, dynamic sampling on | +0.0 (1 paired seed) |  |" in text
    )
    assert (
        "| clip-higher off, dynamic sampling off | clip-higher on, dynamic sampling on "
        "| each helps (Table 1) | +0.0 (1 paired seed) | - (1 paired seed) | - "
        "| not detectable at this scale |" in text
    )
    assert text.endswith(
        "\nNot in the table (not finished: failed, with its log <run>.log beside it, or not "
        "run): clip-higher-on-dynamic-sampling-on-seed0\n"
    )
    # Every seed paired: no label (one seed each, as --seeds 1 runs).
    res = two_by_two({0: {0: 0.125}, 3: {0: 0.25}})
    text = markdown(ablation_table(PLANS["2x2"](), res, resamples=500))
    assert (
        "| clip-higher on, dynamic sampling on | -12.5 |  |" in text
        and "paired" not in text.split("Verdicts")[0]
    )
    # The row compared with has no finished run, or none at a seed of this row's.
    for accs, why in [
        ({0: {0: 0.125}}, "no finished run of clip-higher on, dynamic sampling on"),
        ({0: {0: 0.125}, 3: {1: 0.25}}, "no seed finished in both"),
    ]:
        table = ablation_table(PLANS["2x2"](), two_by_two(accs), resamples=500)
        assert table[0]["left_out"] == why and "diff" not in table[0]
        assert (
            "| clip-higher off, dynamic sampling off | clip-higher on, dynamic sampling on "
            f"| each helps (Table 1) | - | - | - | left out: {why} |" in markdown(table)
        )


def test_the_commands_table_md_names_the_runs_it_is_without(tmp_path, capsys, monkeypatch):
    from dapo.ablate import runs as ablate_runs

    out = tmp_path / "abl"
    jobs = expand("successors", seeds=2, budget="steps=3")
    for job in jobs[1:]:
        finished(out / job.name, job)
    monkeypatch.setattr(ablate_runs, "launch", lambda *a: 1)  # the missing run fails again
    argv = ["ablate", "--plan", "successors", "--seeds", "2", "--budget", "steps=3"]
    assert cli.main([*argv, "--out", str(out)]) == 1
    assert "| DAPO | 1 | 50.0 |" in capsys.readouterr().out
    table = (out / "table.md").read_text()
    assert table.endswith(f"or not run): {jobs[0].name}\n")
    assert "| Dr. GRPO | 2 | 50.0 | DAPO | +0.0 (1 paired seed) |" in table


# --- 5: val_problems.json with a uid that is not text ------------------------------------------


def test_a_uid_that_is_not_text_is_named_not_a_crash(tmp_path, capsys):
    out = tmp_path / "abl"
    jobs = expand("successors", seeds=1, budget="steps=3")
    for job in jobs:
        finished(out / job.name, job, uids=(1, "b") if job is jobs[1] else ("a", "b"))
    path = out / jobs[1].name / "val_problems.json"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: a uid that is not text"):
        read_result(out / jobs[1].name)
    argv = ["ablate", "--plan", "successors", "--seeds", "1", "--budget", "steps=3"]
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: a uid that is not text or an accuracy that is not a number; remove it" in err
