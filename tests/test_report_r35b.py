"""Review r35b (dapo report and dapo ablate's table): a figure that the runs' files do not
say must not be shown as if they did."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dapo.ablate.plans import Row
from dapo.ablate.runs import read_summary
from dapo.ablate.table import ablation_table, markdown, to_target
from dapo.report.page import render_html
from dapo.report.runs import read_run


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_summary_with_a_non_finite_figure_is_named_as_damaged(tmp_path, bad):
    # NaN passed the check, and the table stopped with "b contains NaN or infinity".
    summary = {"steps": 1, "limits": {}, "val/accuracy_end": bad}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError) as caught:
        read_summary(tmp_path)
    assert str(caught.value).startswith(
        f"{tmp_path / 'summary.json'}: val/accuracy_end is '{bad}', not a number: it is "
        "damaged, or was not written by dapo; remove "
    )


def test_the_cost_to_a_target_counts_evaluations_after_training_began():
    # Step 0 is the untrained policy: a run that ended below the target "reached" it at 0.
    below = {"curve": [(0, 0.30, 0.0, 0.0), (1, 0.12, 50.0, 0.5)]}
    later = {"curve": [(0, 0.20, 0.0, 0.0), (1, 0.10, 100.0, 1.0), (2, 0.25, 200.0, 2.0)]}
    assert to_target([below, later], 0.2) == {
        "reached": 1, "runs": 2, "steps": 2, "gen_tokens": 200.0, "seconds": 2.0,
    }  # fmt: skip
    result = to_target([below], 0.2)
    assert (result["reached"], math.isnan(result["steps"])) == (0, True)


def test_an_end_accuracy_from_before_a_null_last_evaluation_is_marked(tmp_path):
    lines = [
        {"step": 0, "val/accuracy": 0.25},
        {"step": 1, "val/accuracy": 0.5, "rollout/accuracy": 0.4},
        {"step": 2, "val/accuracy": None, "rollout/accuracy": 0.6},  # no problem graded
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    page = render_html([read_run(tmp_path)], [])
    assert (
        '<td class="num">0.250</td><td class="num"><span class="warn">0.500 (step 1; step ' in page
    )
    assert "2's is null)</span></td>" in page
    lines[2]["val/accuracy"] = 0.75
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert '<td class="num">0.250</td><td class="num">0.750</td>' in render_html(
        [read_run(tmp_path)], []
    )


def result(accuracy: float, problems: dict | None = None, entropy: float = 0.5) -> dict:
    run = {"accuracy": accuracy, "gen_tokens": 100.0, "seconds": 10.0, "entropy": entropy,
           "tokens_per_kept_group": 50.0, "truncated": 0.1,
           "curve": [(0, 0.0, 0.0, 0.0), (10, accuracy, 100.0, 10.0)]}  # fmt: skip
    if problems is not None:
        run["problems"] = problems
    return run


def test_each_interval_over_seeds_alone_says_so_where_a_table_mixes_them():
    # Row b's runs lost val_problems.json: its interval and its difference are over seeds
    # alone, narrower than a's over seeds x problems, and only the header hinted at it.
    rows = [Row("a", ()), Row("b", (), compare_to="a")]
    problems = [{"p1": 0.0, "p2": 0.5, "p3": 1.0}, {"p1": 0.5, "p2": 0.5, "p3": 0.5}]
    a = {0: result(0.5, problems[0]), 1: result(0.5, problems[1])}
    b = {0: result(0.4), 1: result(0.6)}
    table = ablation_table(rows, {"a": a, "b": b}, resamples=500)
    assert [(r["interval"], r.get("diff_interval")) for r in table] == [
        ("seeds x problems", None), ("seeds", "seeds"),
    ]  # fmt: skip
    text = markdown(table)
    assert "held-out accuracy [95% over seeds x problems; (seeds): over seeds alone]" in text
    row_a, row_b = [x for x in text.splitlines() if x.startswith(("| a |", "| b |"))][:2]
    assert "(seeds)" not in row_a and row_b.count(" (seeds) |") == 2
    same = markdown(ablation_table(rows, {"a": b, "b": b}, resamples=500))
    same_rows = [x for x in same.splitlines() if x.startswith(("| a |", "| b |"))][:2]
    assert "[95% over seeds]" in same and "(seeds)" not in "".join(same_rows)


def test_a_column_one_seed_did_not_log_is_the_others_mean_and_says_so():
    # A null last-step entropy (a step that trained no token) made the row's cell "nan".
    rows = [Row("a", ())]
    table = ablation_table(rows, {"a": {0: result(0.5), 1: result(0.5, entropy=math.nan)}})
    assert (table[0]["entropy"], table[0]["entropy_seeds"]) == (0.5, 1)
    line = next(x for x in markdown(table).splitlines() if x.startswith("| a |"))
    assert line.endswith("| 100 | 10 | 50 | 0.500 (1 of 2 seeds) | 0.100 |")
    none = ablation_table(rows, {"a": {0: result(0.5, entropy=math.nan)}})
    assert markdown(none).splitlines()[2].endswith("| 50 | nan (0 of 1 seeds) | 0.100 |")


def _seed_run(tmp_path, name: str, seed: int, lr: float, rows: dict[int, float]):
    from dapo.report.runs import Run

    config = {"optim": {"lr": lr}, "train": {"seed": seed}, "run": {"name": name}}
    lines = [{"step": s, "train/entropy": v} for s, v in rows.items()]
    return Run(name=name, path=tmp_path / name, config=config, rows=lines)


def test_runs_named_as_seeds_but_configured_apart_are_not_averaged(tmp_path, capsys):
    # r35b's first finding: x-seed0 (lr 1e-6) and x-seed1 (lr 1e-5) were one configuration's
    # mean and band in the mechanisms figure; only the config table showed they differ.
    from dapo.report.mechanisms import across_seeds, configurations, mixed_seeds

    runs = [
        _seed_run(tmp_path, "x-seed0", 0, 1e-6, {1: 0.9, 2: 0.8}),
        _seed_run(tmp_path, "x-seed1", 1, 1e-5, {1: 0.5, 2: 0.4}),
        _seed_run(tmp_path, "x-seed2", 2, 1e-6, {1: 0.7, 2: 0.6}),
        _seed_run(tmp_path, "y-seed0", 0, 1e-6, {1: 0.3}),
        _seed_run(tmp_path, "y-seed1", 1, 1e-6, {1: 0.1}),  # differs in the seed alone
    ]
    groups = configurations(runs)
    assert {label: [r.name for r in members] for label, members in groups.items()} == {
        "x [x-seed0, x-seed2]": ["x-seed0", "x-seed2"],
        "x [x-seed1]": ["x-seed1"],
        "y": ["y-seed0", "y-seed1"],
    }
    assert across_seeds(groups["x [x-seed0, x-seed2]"], "train/entropy") == (
        [1.0, 2.0], [pytest.approx(0.8), pytest.approx(0.7)], [0.7, 0.6], [0.9, 0.8]
    )  # fmt: skip
    assert across_seeds(groups["y"], "train/entropy")[1] == [pytest.approx(0.2)]
    assert mixed_seeds(runs) == [
        "the runs named x-seed<N> are not seeds of one configuration: their configs differ in "
        "optim.lr; the mechanisms figure draws each config apart, not averaged (give one "
        "configuration's seeds to average them)"
    ]
    page = render_html(runs, [])
    assert "not seeds of one configuration" not in page  # said beside the figure, when drawn


def test_the_report_command_and_page_say_which_seeds_differ(tmp_path, capsys):
    import argparse

    import yaml

    from dapo.cli.report import add_parser

    for name, seed, lr in [("x-seed0", 0, 1e-6), ("x-seed1", 1, 1e-5)]:
        run = tmp_path / name
        run.mkdir()
        config = {"optim": {"lr": lr}, "train": {"seed": seed}, "run": {"name": name}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        rows = [{"step": s, "train/entropy": 0.5 + 0.1 * s + seed} for s in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["report", str(tmp_path / "x-seed0"), str(tmp_path / "x-seed1")])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    warning = (
        "the runs named x-seed<N> are not seeds of one configuration: their configs differ in "
        "optim.lr; the mechanisms figure draws each config apart"
    )
    assert err.startswith("dapo: warning: " + warning)
    page = (tmp_path / "x-seed0" / "report" / "report.html").read_text()
    shown = warning.replace("<N>", "&lt;N&gt;")
    assert f'<p class="warn">{shown}' in page
    assert page.index('alt="mechanisms"') < page.index(shown)


def test_each_step_s_last_line_is_computed_once_and_again_after_the_rows_change():
    """A report asked for each run's last line per step some 40 times, each a pass over every
    line and a sort: 12 of the 20 s a 200 MB metrics.jsonl took."""
    from dapo.report.runs import Run, last_rows

    run = Run("r", Path("r"), rows=[{"step": 2, "a": 1.0}, {"step": 1, "a": 2.0}])
    first = last_rows(run)
    assert first == {1.0: {"step": 1, "a": 2.0}, 2.0: {"step": 2, "a": 1.0}}
    assert list(first) == [1.0, 2.0] and last_rows(run) is first
    run.rows.append({"step": 2, "a": 3.0})  # a resumed step logged again: the later line stands
    assert last_rows(run) == {1.0: {"step": 1, "a": 2.0}, 2.0: {"step": 2, "a": 3.0}}
    run.rows = [{"step": 5}]
    assert last_rows(run) == {5.0: {"step": 5}}
