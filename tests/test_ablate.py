"""dapo ablate: the plans expand to exactly the spec's configurations, finished runs are
skipped and stopped ones resumed, and the table's statistics are the right ones."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dapo import cli
from dapo.ablate import PLANS, expand
from dapo.ablate.plans import interaction_2x2
from dapo.ablate.runs import job_config, job_limits, run_jobs, state
from dapo.ablate.table import ablation_table, contrast, contrast_line, markdown, to_target
from dapo.config import dump_yaml, load_config
from dapo.eval.intervals import (
    bootstrap_ci,
    crossed_bootstrap_ci,
    holm_adjusted,
    paired_bootstrap_ci,
    paired_permutation_pvalue,
)


def algorithm(overrides) -> dict:
    """The algo and sampling sections a row's overrides give."""
    cfg = load_config(None, list(overrides)).to_dict()
    return {f"{s}.{k}": v for s in ("algo", "sampling") for k, v in cfg[s].items()}


def changed(a: dict, b: dict) -> set[str]:
    return {k for k in a if a[k] != b[k]}


def test_table1_is_the_cumulative_chain_from_naive_grpo_to_dapo():
    rows = PLANS["table1"]()
    configs = [algorithm(r.overrides) for r in rows]
    assert configs[0] == algorithm(["run.preset=grpo"])
    assert configs[-1] == algorithm(["run.preset=dapo"])
    steps = [changed(a, b) for a, b in zip(configs, configs[1:], strict=False)]
    assert steps == [
        {"algo.overlong_filter"},
        {"algo.eps_high"},
        {"algo.overlong_filter", "algo.overlong_shaping"},
        {"algo.loss_agg"},
        {"sampling.dynamic", "algo.kl_coef"},
    ]
    assert [r.name for r in rows] == [
        "naive GRPO",
        "+ overlong filtering",
        "+ clip-higher",
        "+ soft overlong punishment",
        "+ token-level loss",
        "+ dynamic sampling (= DAPO)",
    ]
    assert [r.compare_to for r in rows] == [None] + [r.name for r in rows[:-1]]


def test_the_sweeps_and_the_successors():
    dapo = algorithm(["run.preset=dapo"])
    eps = [algorithm(r.overrides) for r in PLANS["eps-high"]()]
    assert [c["algo.eps_high"] for c in eps] == [0.20, 0.24, 0.28, 0.32, 0.36]
    assert all(changed(c, dapo) <= {"algo.eps_high"} for c in eps)
    compared = [r.compare_to for r in PLANS["eps-high"]()]
    assert compared == ["eps_high=0.28"] * 2 + [None] + ["eps_high=0.28"] * 2
    grid = {
        (c["algo.eps_high"], c["sampling.dynamic"]): changed(c, dapo)
        for c in (algorithm(r.overrides) for r in PLANS["2x2"]())
    }
    assert grid == {
        (0.2, False): {"algo.eps_high", "sampling.dynamic"},
        (0.2, True): {"algo.eps_high"},
        (0.28, False): {"sampling.dynamic"},
        (0.28, True): set(),
    }
    succ = {r.name: algorithm(r.overrides) for r in PLANS["successors"]()}
    assert list(succ) == ["DAPO", "Dr. GRPO", "GSPO", "CISPO"]
    for name, preset in [("Dr. GRPO", "dr_grpo"), ("GSPO", "gspo"), ("CISPO", "cispo")]:
        assert succ[name] == algorithm([f"run.preset={preset}"])


def test_expand_gives_every_row_at_every_seed_with_the_budget_and_overrides_last():
    jobs = expand("successors", seeds=3, budget="steps=40", extra=("optim.lr=1e-4",))
    assert len(jobs) == 12 and len({j.name for j in jobs}) == 12
    assert jobs[1].overrides == (
        "run.preset=dapo",
        "train.steps=40",
        "train.seed=1",
        "optim.lr=1e-4",
    )
    # Token and seconds budgets: the budget ends a run, not the step count.
    tokens = expand("successors", seeds=1, budget="tokens=5000")[0].overrides
    assert tokens[1:3] == ("train.max_gen_tokens=5000", "train.steps=1000000")
    seconds = expand("successors", seeds=1, budget="seconds=90")[0].overrides
    assert seconds[1:3] == ("train.max_seconds=90.0", "train.steps=1000000")
    for bad in ("tokens=0", "tokens=1e4", "seconds=0", "seconds=inf", "seconds=x", "flops=1"):
        with pytest.raises(ValueError, match="steps=N, tokens=N"):
            expand("table1", seeds=1, budget=bad)
    with pytest.raises(ValueError, match="choose one of table1, eps-high, 2x2, successors"):
        expand("table2", seeds=1)


def test_a_run_is_done_for_the_budget_its_summary_records(tmp_path):
    job = expand("successors", seeds=1, budget="tokens=5000")[0]
    assert job_limits(job) == {"max_gen_tokens": 5000, "steps": 1_000_000, "max_seconds": 0.0}
    run = tmp_path / "r"
    run.mkdir()
    limits = {"steps": 1_000_000, "max_gen_tokens": 5000, "max_seconds": 0.0}
    (run / "summary.json").write_text(json.dumps({"steps": 7, "limits": limits}))
    assert state(run, job_limits(job)) == "done"  # stopped at step 7 by its token budget
    assert state(run, {"max_gen_tokens": 9000}) == "new"  # no checkpoint to go on from
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step_000007\n")
    assert state(run, {"max_gen_tokens": 9000}) == "resume"  # a larger budget goes on
    # A summary from before budgets were recorded: its steps count.
    (run / "summary.json").write_text(json.dumps({"steps": 7}))
    assert state(run, {"steps": 7}) == state(run, {"steps": 7, "max_seconds": 9}) == "done"
    assert state(run, {"steps": 8}) == state(run, job_limits(job)) == "resume"


def save_config(run_dir, job, recipe=None) -> None:
    """The config.yaml ``dapo train`` writes for ``job``'s run (on the YAML ``recipe``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(job_config(job, recipe)))


def test_finished_runs_are_skipped_and_stopped_ones_resumed(tmp_path):
    jobs = expand("successors", seeds=1, budget="steps=2")
    done, stopped, finished_shorter = (tmp_path / j.name for j in jobs[:3])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  steps: 9\n")  # the budget's steps=2 overrides it
    for d, job in zip((done, stopped, finished_shorter), jobs, strict=False):
        save_config(d, job, recipe)
    (done / "summary.json").write_text(json.dumps({"steps": 2}))
    (finished_shorter / "summary.json").write_text(json.dumps({"steps": 1}))
    (stopped / "checkpoints").mkdir(parents=True)
    (stopped / "checkpoints" / "latest").write_text("step_000001\n")
    launched = []

    def launcher(cmd, log):
        launched.append(cmd)
        return 3 if "run.preset=cispo" in cmd else 0

    failed = run_jobs(jobs, tmp_path, parallel=1, cores=2, config=recipe, launcher=launcher)
    assert failed == [jobs[3].name]
    names = [next(a for a in c if a.startswith("run.name=")) for c in launched]
    assert names == [f"run.name={j.name}" for j in jobs[1:]]  # the finished one is skipped
    resume = launched[0]
    assert resume[resume.index("--resume") + 1] == str(stopped)
    assert "--overwrite" in launched[1] and "--overwrite" in launched[2]
    assert all("run.threads=2" in c and c[c.index("--config") + 1] == str(recipe) for c in launched)


def test_a_recipe_edited_since_a_run_finished_runs_it_on(tmp_path):
    """With no --budget, how long a job goes on is the recipe's train.steps: a run finished
    at 2 steps is done for a recipe of 2 and resumed when the recipe says 3."""
    job = expand("successors", seeds=1)[0]
    recipe, run = tmp_path / "recipe.yaml", tmp_path / "runs" / job.name
    recipe.write_text("train:\n  steps: 2\n")
    save_config(run, job, recipe)
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    limits = {"steps": 2, "max_gen_tokens": 0, "max_seconds": 0.0}
    (run / "summary.json").write_text(json.dumps({"steps": 2, "limits": limits}))
    recipe.write_text("train:\n  steps: 2\n")
    assert job_limits(job, recipe) == limits and state(run, job_limits(job, recipe)) == "done"
    recipe.write_text("train:\n  steps: 3\n")
    assert state(run, job_limits(job, recipe)) == "resume"
    launched = []

    def launcher(cmd, log):
        launched.append(cmd)
        return 0

    assert run_jobs([job], run.parent, cores=1, config=recipe, launcher=launcher) == []
    assert launched and launched[0][launched[0].index("--resume") + 1] == str(run)


def results(**per_row):
    return {row: {s: {"accuracy": a, "gen_tokens": 100.0 * (s + 1), "seconds": 10.0,
                      "tokens_per_kept_group": 50.0, "entropy": 0.5, "truncated": 0.1,
                      "curve": [(0, 0.0, 0.0, 0.0), (10, a, 100.0 * (s + 1), 10.0)]}
                  for s, a in enumerate(accs)} for row, accs in per_row.items()}  # fmt: skip


def test_table_statistics_on_synthetic_results():
    rows = PLANS["successors"]()
    a, b = [0.10, 0.20, 0.30], [0.30, 0.30, 0.50]
    table = ablation_table(rows, results(**{"DAPO": a, "GSPO": b, "CISPO": [0.4]}), resamples=2000)
    dapo, gspo, cispo = table  # Dr. GRPO has no results: left out
    assert dapo["accuracy"] == bootstrap_ci(a, resamples=2000) and "diff" not in dapo
    assert gspo["accuracy"].mean == pytest.approx(sum(b) / 3)
    assert gspo["diff"] == paired_bootstrap_ci(a, b, resamples=2000)
    assert gspo["diff"].mean == pytest.approx(0.5 / 3)
    assert gspo["p"] == paired_permutation_pvalue(a, b, resamples=2000)
    assert gspo["gen_tokens"] == 200.0  # mean over seeds of 100, 200, 300
    # One seed: the point itself, paired with DAPO's seed 0, and no p-value.
    assert (cispo["accuracy"].low, cispo["accuracy"].high) == (0.4, 0.4)
    assert cispo["diff"].mean == pytest.approx(0.3) and "p" not in cispo
    text = markdown(table)
    assert (
        "| GSPO | 3 | 36.7 [" in text
        and "| DAPO | +16.7 [" in text
        and "| CISPO | 1 | 40.0 |" in text
        and "95% over seeds]" in text
    )
    # The target is DAPO's mean (0.2): DAPO seeds 1 and 2 reach it at step 10, with 200 and
    # 300 tokens; every GSPO seed does.
    assert dapo["target"] == pytest.approx(0.2)
    assert dapo["to_target"] == {"reached": 2, "runs": 3, "steps": 10.0, "gen_tokens": 250.0,
                                 "seconds": 10.0}  # fmt: skip
    assert "To reach held-out accuracy 20.0" in text and "| DAPO | 2/3 | 10 | 250 | 10 |" in text


def test_holm_adjusts_by_rank_keeps_the_order_and_caps_at_one():
    # Sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (the
    # running maximum keeps the order of the raw p-values).
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjusted([0.5, 0.6]) == [1.0, 1.0]
    assert holm_adjusted([0.2]) == [0.2] and holm_adjusted([]) == []


def test_verdicts_need_holm_corrected_evidence_over_seeds():
    rows = PLANS["table1"]()
    base = [0.20, 0.22, 0.18, 0.25, 0.21, 0.19, 0.23, 0.20]
    gains = [0.05, 0.04, 0.06, 0.03, 0.05, 0.07, 0.02, 0.04]
    better = [a + d for a, d in zip(base, gains, strict=True)]
    worse = [a - 0.03 for a in better]
    noise = [0.02, -0.01, 0.03, -0.02, 0.01, -0.03, 0.02, -0.01]
    mixed = [a + d for a, d in zip(worse, noise, strict=True)]
    res = results(**{rows[0].name: base, rows[1].name: better, rows[2].name: worse,
                     rows[3].name: mixed})  # fmt: skip
    table = ablation_table(rows, res, resamples=4000)
    _, filtering, clip, soft = table
    # 8 seeds of one sign: p = 2/256 exactly (every sign pattern counted).
    assert filtering["p"] == clip["p"] == 2 / 256
    assert [r["p_holm"] for r in table[1:]] == holm_adjusted([r["p"] for r in table[1:]])
    assert filtering["p_holm"] < 0.05 and clip["p_holm"] < 0.05 and soft["p_holm"] >= 0.05
    assert filtering["verdict"] == "reproduced"  # the paper's +6, here +4.5
    assert clip["verdict"] == "opposite"  # the paper's +2, here -3.0
    assert soft["verdict"] == "not detectable at this scale"
    assert "verdict" not in table[0]
    text = markdown(table)
    assert "Verdicts (Holm-Bonferroni over the table's 3 p-values; family-wise alpha 0.05)" in text
    assert "| + overlong filtering | naive GRPO | +6 (30 to 36) | +4.5 [" in text
    assert text.rstrip().endswith("| not detectable at this scale |")
    # Three seeds cannot reach p < 0.25: nothing is detectable, whatever the sizes.
    table = ablation_table(rows, results(**{k: v[:3] for k, v in res_acc(res).items()}))
    assert {r["verdict"] for r in table[1:]} == {"not detectable at this scale"}
    # A pair the paper makes no claim about: "differs" on the same evidence.
    eps = PLANS["eps-high"]()
    table = ablation_table(eps, results(**{eps[2].name: base, eps[3].name: better}))
    assert table[1]["verdict"] == "differs" and "| no claim |" in markdown(table)


def res_acc(res: dict) -> dict[str, list[float]]:
    return {row: [runs[s]["accuracy"] for s in sorted(runs)] for row, runs in res.items()}


def test_time_to_target_takes_each_runs_first_evaluation_at_or_above_it():
    runs = [
        {"curve": [(0, 0.1, 0, 0), (5, 0.3, 500, 20), (10, 0.25, 1000, 40), (15, 0.4, 1500, 60)]},
        {"curve": [(0, 0.1, 0, 0), (5, 0.2, 400, 10), (10, 0.35, 900, 30)]},
        {"curve": [(0, 0.1, 0, 0), (5, 0.2, 400, 10)]},
    ]
    assert to_target(runs, 0.3) == {
        "reached": 2, "runs": 3, "steps": 7.5, "gen_tokens": 700.0, "seconds": 25.0,
    }  # fmt: skip
    assert to_target(runs, 0.1)["steps"] == 5.0  # step 0's is the untrained policy's
    missed = to_target(runs, 0.9)
    assert missed["reached"] == 0 and missed["steps"] != missed["steps"]  # NaN


def test_intervals_are_over_seeds_and_problems_when_runs_kept_them():
    rows = PLANS["successors"]()
    res = results(**{"DAPO": [0.5, 0.25], "GSPO": [0.75, 0.5]})
    per_problem = {
        "DAPO": [[1.0, 0.5, 0.0, 0.5], [0.5, 0.0, 0.0, 0.5]],
        "GSPO": [[1.0, 1.0, 0.5, 0.5], [1.0, 0.5, 0.0, 0.5]],
    }
    for row, matrix in per_problem.items():
        for seed, accs in enumerate(matrix):
            res[row][seed]["problems"] = {f"p{i}": a for i, a in enumerate(accs)}
    dapo, gspo = ablation_table(rows, res, resamples=3000)
    assert dapo["interval"] == "seeds x problems"
    assert dapo["accuracy"] == crossed_bootstrap_ci(per_problem["DAPO"], resamples=3000)
    diff = (np.array(per_problem["GSPO"]) - np.array(per_problem["DAPO"])).tolist()
    assert gspo["diff"] == crossed_bootstrap_ci(diff, resamples=3000)
    assert gspo["diff"].mean == pytest.approx(0.25)
    assert gspo["p"] == paired_permutation_pvalue([0.5, 0.25], [0.75, 0.5], resamples=3000)
    assert "95% over seeds x problems]" in markdown([dapo, gspo])
    # A run without its problems (or with other problems): over seeds only.
    del res["GSPO"][1]["problems"]
    dapo, gspo = ablation_table(rows, res, resamples=3000)
    assert gspo["interval"] == "seeds" and dapo["interval"] == "seeds x problems"
    assert gspo["diff"] == paired_bootstrap_ci([0.5, 0.25], [0.75, 0.5], resamples=3000)


def test_the_command_runs_resumes_and_prints_the_table(tmp_path, capsys):
    small = [
        "embedded.sft_steps=20", "embedded.hidden=32", "arith.num_train=40", "arith.num_val=4",
        "arith.num_warmup=32", "rollout.group_size=4", "train.prompts_per_step=2",
        "sampling.prompts_per_round=4", "sampling.on_max_rounds=train",
        "train.responses_per_minibatch=8", "eval.num_samples=1", "reward.workers=0",
        f"embedded.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    # A token budget of 1: each run stops after its first step, and is then done.
    argv = ["ablate", "--plan", "successors", "--seeds", "1", "--budget", "tokens=1"]
    argv += ["--out", str(tmp_path / "abl"), *small]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "4 runs, 0 done already, 4 to run" in out
    for name in ("DAPO", "Dr. GRPO", "GSPO", "CISPO"):
        assert f"| {name} | 1 | " in out
    assert json.loads((tmp_path / "abl" / "table.json").read_text())[1]["compare_to"] == "DAPO"
    assert (tmp_path / "abl" / "report" / "report.html").is_file()
    assert json.loads((tmp_path / "abl" / "dapo-seed0" / "summary.json").read_text())["steps"] == 1
    assert cli.main(argv) == 0
    assert "4 runs, 4 done already, 0 to run" in capsys.readouterr().out


def test_the_2x2_interaction_is_both_on_minus_each_alone_plus_neither():
    weights = interaction_2x2()
    names = [r.name for r in PLANS["2x2"]()]  # off/off, off/on, on/off, on/on
    assert weights == {names[3]: 1.0, names[2]: -1.0, names[1]: -1.0, names[0]: 1.0}
    # Per seed: 0.30 - 0.26 - 0.25 + 0.24 = 0.03, and 0.40 - 0.30 - 0.31 + 0.26 = 0.05.
    accs = ([0.24, 0.26], [0.25, 0.31], [0.26, 0.30], [0.30, 0.40])
    res = results(**dict(zip(names, accs, strict=True)))
    got = contrast(res, weights, resamples=2000)
    assert got["value"].mean == pytest.approx(0.04) and got["interval"] == "seeds"
    assert (got["value"].low, got["value"].high) == pytest.approx((0.03, 0.05))
    assert got["p"] == paired_permutation_pvalue([0, 0], [0.03, 0.05], resamples=2000)
    assert "= +4.0 [+3.0, +5.0] points (95% over seeds, 2 seeds, p (seeds) " in contrast_line(
        "interaction", weights, got
    )
    # With each run's problems: the same contrast, problem by problem.
    for row in names:
        for run in res[row].values():
            run["problems"] = {"a": run["accuracy"] - 0.1, "b": run["accuracy"] + 0.1}
    got = contrast(res, weights, resamples=2000)
    assert got["interval"] == "seeds x problems" and got["value"].mean == pytest.approx(0.04)
    del res[names[0]][1]
    assert contrast(res, weights)["seeds"] == 1  # only seed 0 has all four rows
    del res[names[0]][0]
    assert contrast(res, weights) is None


def test_a_runs_seconds_are_its_steps_as_the_budget_and_the_target_count_them(tmp_path):
    # 4 steps of 10 s, and 60 s of evaluations: the table said 100, its budget and its cost to
    # the target 40.
    from dapo.ablate.table import read_result

    lines = [{"step": 0, "val/accuracy": 0.2}]
    for step in range(1, 5):
        kept = {"sampling/tokens_per_kept_group": 25.0, "sampling/groups_kept": 4.0}
        lines.append(
            {"step": step, "sampling/tokens_generated": 100.0, "perf/step_s": 10.0, **kept}
        )
    lines[-1]["val/accuracy"] = 0.5
    lines[-1]["train/entropy"] = None  # a step that trained no token logs null
    lines[2]["sampling/tokens_per_kept_group"] = None  # a step that kept no group, as well
    lines[2]["sampling/groups_kept"] = 0.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    summary = {"steps": 4, "val/accuracy_end": 0.5, "train_seconds": 100.0, "step_seconds": 40.0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    result = read_result(tmp_path)
    assert result["seconds"] == 40.0 and result["curve"][-1] == (4, 0.5, 400.0, 40.0)
    assert math.isnan(result["entropy"])  # not a TypeError when the table prints it
    assert result["tokens_per_kept_group"] == 400.0 / 12  # the kept-none step's tokens count
    del summary["step_seconds"]  # a summary from before it was written: the steps' own sum
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert read_result(tmp_path)["seconds"] == 40.0
