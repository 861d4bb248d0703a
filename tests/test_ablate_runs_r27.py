"""Review r27: one dapo ablate at a time on an --out (a second one deleted and reran the first's
finished runs), each job's state read again as it starts, the user's run.threads honoured and
run.name / run.out_dir refused, a failed run exits 1; dapo report names a path that is not
there and an ablation's directory, and marks a run whose metrics.jsonl is empty or ends
before its summary.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo import cli
from dapo.ablate import expand
from dapo.ablate import runs as ablate_runs
from dapo.ablate.runs import ablation_lock, job_config, run_jobs
from dapo.config import dump_yaml, load_config

ROOT = Path(__file__).resolve().parents[1]
LIMITS = {"steps": 2, "max_gen_tokens": 0, "max_seconds": 0.0}


def finished(run_dir: Path, job, steps: int = 2) -> None:
    """A run of ``job`` that finished after ``steps`` (its config.yaml and summary.json)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(job_config(job)))
    summary = {"steps": steps, "val/accuracy_end": 0.5, "limits": LIMITS}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def hold_lock(out: Path) -> subprocess.Popen:
    """Another process holding ``out``'s ablation lock, as a running dapo ablate does."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from pathlib import Path;"
         "from dapo.ablate.runs import ablation_lock;"
         f"ablation_lock(Path({str(out)!r})).acquire(); print('held', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


# --- A: one ablation at a time -------------------------------------------------------------------


def test_a_second_ablation_on_an_out_in_use_is_refused_and_deletes_nothing(
    tmp_path, capsys, monkeypatch
):
    out = tmp_path / "r4"
    jobs = expand("2x2", seeds=1, budget="steps=2")
    finished(out / jobs[0].name, jobs[0])
    stopped = out / jobs[1].name  # a run the second ablation would start over (--overwrite)
    stopped.mkdir()
    (stopped / "config.yaml").write_text(dump_yaml(job_config(jobs[1])))
    launched = []
    monkeypatch.setattr(ablate_runs, "launch", lambda *a: launched.append(a) or 0)
    holder = hold_lock(out)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert ".dapo-ablate-lock" in before
    try:
        argv = ["ablate", "--plan", "2x2", "--seeds", "1", "--budget", "steps=2"]
        assert cli.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"dapo: error: ablation directory {out} is in use by process {holder.pid} on host "
        )
        assert err.rstrip().endswith(
            "another dapo ablate runs there, and a second would start its runs over. Wait for "
            "it to end (or stop it), then run this command again to continue the ablation; or "
            "give another --out"
        )
    finally:
        holder.kill()
        holder.wait()
    assert launched == []
    after = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert after == before  # nothing deleted, no log, no table written
    assert (out / jobs[0].name / "summary.json").is_file()
    ablation_lock(out).acquire().release()  # the holder's death released it


def test_the_ablation_holds_its_lock_until_its_table_is_written(tmp_path, monkeypatch):
    out = tmp_path / "abl"
    seen = []

    def launcher(cmd, log):
        with pytest.raises(ValueError, match=f"ablation directory {out} is in use by process "):
            ablation_lock(out).acquire()
        seen.append(log.name)
        return 0

    monkeypatch.setattr(ablate_runs, "launch", launcher)
    argv = ["ablate", "--plan", "2x2", "--seeds", "1", "--budget", "steps=2", "--out", str(out)]
    assert cli.main(argv) == 0
    assert len(seen) == 4 and (out / "table.md").is_file()
    ablation_lock(out).acquire().release()  # free once the command returned


def test_a_job_is_read_again_just_before_it_starts(tmp_path):
    """A run finished meanwhile (a resume by hand) is not started over; one that became
    another configuration's is refused, named, and counted as failed."""
    jobs = expand("2x2", seeds=1, budget="steps=2")
    launched, out = [], []

    def launcher(cmd, log):
        name = next(a for a in cmd if a.startswith("run.name=")).split("=", 1)[1]
        launched.append(name)
        if name == jobs[0].name:
            finished(tmp_path / jobs[1].name, jobs[1])
            other = job_config(jobs[2])
            other.optim.lr = 1e-5
            (tmp_path / jobs[2].name).mkdir()
            (tmp_path / jobs[2].name / "config.yaml").write_text(dump_yaml(other))
            (tmp_path / jobs[2].name / "summary.json").write_text(json.dumps({"steps": 1}))
        return 0

    class Stream:
        def write(self, text: str) -> None:
            out.append(text)

        def flush(self) -> None:
            pass

    failed = run_jobs(jobs, tmp_path, cores=1, launcher=launcher, stream=Stream())
    assert launched == [jobs[0].name, jobs[3].name]
    assert failed == [jobs[2].name]
    lines = "".join(out).splitlines()
    assert f"ablate: {jobs[1].name} done already (finished since this ablation began)" in lines
    refused = next(x for x in lines if x.startswith(f"ablate: {jobs[2].name} REFUSED: "))
    assert refused.endswith(f"{tmp_path / jobs[2].name} was run with another configuration "
                            "than this job's (saved -> wanted):")  # fmt: skip


# --- B: run.threads honoured, run.name and run.out_dir refused ----------------------------------


def test_the_users_run_threads_is_each_runs(tmp_path, capsys):
    jobs = expand("2x2", seeds=1, budget="steps=2", extra=("run.threads=1",))
    launched = []
    run_jobs(jobs[:1], tmp_path, cores=4, launcher=lambda cmd, log: launched.append(cmd) or 0)
    (cmd,) = launched
    overrides = cmd[cmd.index("--overwrite") + 1 :]
    assert load_config(None, overrides).run.threads == 1
    assert [a for a in overrides if a.startswith("run.threads=")] == ["run.threads=1"] * 2
    assert "(1 at a time, 1 thread(s) each (run.threads)) in" in capsys.readouterr().out
    jobs = expand("2x2", seeds=1, budget="steps=2")  # none given: the cores split
    launched.clear()
    run_jobs(jobs[:1], tmp_path / "b", cores=4, launcher=lambda c, log: launched.append(c) or 0)
    assert launched[0][-1] == "run.threads=4"
    assert "(1 at a time, 4 thread(s) each) in" in capsys.readouterr().out


@pytest.mark.parametrize("override", ["run.name=mine", "run.out_dir=/tmp/elsewhere"])
def test_run_name_and_out_dir_are_refused_pointing_at_out(override):
    with pytest.raises(ValueError) as got:
        expand("2x2", seeds=1, extra=(override,))
    assert str(got.value) == (
        f"dapo ablate --plan 2x2: the override {override!r}: dapo ablate names each run "
        "<configuration>-seed<N> and puts it in the ablation's directory; drop it, and give "
        "--out DIR for where the runs go"
    )


def test_the_help_says_so(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ablate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "or of run.name and run.out_dir (ablate names each run and puts it under --out)" in text
    assert "Each run gets run.threads = the cores split between the --parallel runs, or the " \
        "run.threads given." in text  # fmt: skip
    assert "a second on the same --out is refused, naming the process that runs it" in text
    assert "the command exits 1 naming it" in text


# --- C: a failed run exits 1 ---------------------------------------------------------------------


def test_a_failed_run_exits_1_not_2(tmp_path, capsys, monkeypatch):
    out = tmp_path / "abl"
    monkeypatch.setattr(ablate_runs, "launch", lambda cmd, log: 3)
    argv = ["ablate", "--plan", "2x2", "--seeds", "1", "--budget", "steps=2", "--out", str(out)]
    assert cli.main(argv) == 1
    names = ", ".join(j.name for j in expand("2x2", seeds=1, budget="steps=2"))
    assert capsys.readouterr().err == (f"dapo: error: 4 run(s) failed: {names} (logs in {out})\n")
    assert (out / "table.md").is_file()
    from dapo.cli import EXIT_STATUS

    assert "dapo ablate: a run of the ablation failed (named, its log beside it)" in " ".join(
        EXIT_STATUS.split()
    )


# --- D: dapo report on what is not a run directory, or a run that logged nothing --------------


def run_dir(path: Path, rows: list[dict], summary: dict | None = None) -> Path:
    """A run directory as dapo report reads it: metrics.jsonl (and summary.json)."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def report_error(capsys, *argv: str) -> str:
    assert cli.main(["report", *argv]) == 2
    return capsys.readouterr().err


def test_report_names_a_path_that_is_not_there(tmp_path, capsys):
    gone = tmp_path / "nope"
    assert report_error(capsys, str(gone)) == (
        f"dapo: error: {gone}: does not exist; give run directories (each holding metrics.jsonl)\n"
    )
    assert not gone.exists()  # no report/ made under it


def test_report_of_an_ablations_directory_points_at_its_runs(tmp_path, capsys):
    abl = tmp_path / "abl"
    run_dir(abl / "clip-higher-on-seed0", [{"step": 0, "val/accuracy": 0.25}])
    (abl / "clip-higher-on-seed0.log").write_text("")
    expected = (
        f"dapo: error: {abl}: an ablation's directory (dapo ablate), not a run directory: give "
        f"the run directories inside it, as in dapo report {abl}/*-seed*/"
    )
    assert report_error(capsys, str(abl)) == expected + "\n"
    (abl / "report").mkdir()
    (abl / "report" / "report.html").write_text("")
    (abl / "table.md").write_text("")
    written = f"; the report of all its runs is {abl}/report/report.html\n"
    assert report_error(capsys, str(abl), "--out", str(tmp_path / "r")) == expected + written
    runs = tmp_path / "runs"  # dapo train's run.out_dir: runs by other names
    for name in ("a", "b", "c", "d"):
        run_dir(runs / name, [{"step": 0}])
    assert report_error(capsys, str(runs)) == (
        f"dapo: error: {runs}: a directory of 4 run(s), not a run directory: give the run "
        f"directories inside it, as in dapo report {runs}/a {runs}/b {runs}/c ...\n"
    )


def test_report_of_runs_that_logged_no_step_is_refused(tmp_path, capsys):
    empty = run_dir(tmp_path / "empty", [])
    assert report_error(capsys, str(empty)) == (
        f"dapo: error: nothing to plot: {empty}/metrics.jsonl holds no step (a run that has not "
        "logged its first step yet, or whose metrics.jsonl was emptied); give a run that logged "
        "a step\n"
    )
    assert not (empty / "report").exists()


# --- E: metrics.jsonl that ends before summary.json ---------------------------------------------

CELLS = '<td class="num">{}</td><td>{} read, 0 lines skipped</td>'
CELLS += '<td class="num">{}</td><td class="num">{}</td></tr>'


def warn(text: str) -> str:
    return f'<span class="warn">{text}</span>'


def test_a_run_whose_metrics_end_before_its_summary_is_marked(tmp_path):
    """A finished 3-step run whose metrics.jsonl was cut after step 1 (head -2): the steps
    cell says so, and the end accuracy is summary.json's (marked), not step 1's; without
    one in summary.json, it is labelled with its step."""
    from dapo.report import make_report

    rows = [{"step": 0, "val/accuracy": 0.25}, {"step": 1, "val/accuracy": 0.15625}]
    summary = {"steps": 3, "val/accuracy_start": 0.25, "val/accuracy_end": 0.21875}
    cut = run_dir(tmp_path / "cut", rows, summary)
    bare = run_dir(tmp_path / "bare", rows, {"steps": 3})
    emptied = run_dir(tmp_path / "emptied", [], summary)
    running = run_dir(tmp_path / "running", [])
    whole = run_dir(tmp_path / "whole", [*rows, {"step": 3, "val/accuracy": 0.5}], summary)
    html = make_report([cut, bare, emptied, running, whole], tmp_path / "rep").read_text()
    short = warn("3 (summary.json), but metrics.jsonl ends at step 1")
    assert CELLS.format(short, 2, "0.250", warn("0.219 (summary.json)")) in html
    assert CELLS.format(short, 2, "0.250", warn("0.156 (step 1)")) in html
    no_step = warn("3 (summary.json), but metrics.jsonl holds no step")
    summary_start = warn("0.250 (summary.json)")
    assert CELLS.format(no_step, 0, summary_start, warn("0.219 (summary.json)")) in html
    nothing = warn("nothing logged (metrics.jsonl holds no step), not finished (no summary.json)")
    assert CELLS.format(nothing, 0, "—", "—") in html
    assert CELLS.format("3", 3, "0.250", "0.500") in html  # as before: metrics.jsonl's end
