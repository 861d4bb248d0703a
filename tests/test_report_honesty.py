"""dapo report says what it draws: the mean over seeds only where every seed counts, one run
per (colour, line style) however many, panels that keep their height under a long legend,
lines that break where a step logged null, and a runs table read from the metrics drawn."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest

from dapo.report import make_report, read_runs
from dapo.report.figures import FIGURES, accuracy_figure, grid_figure, write_figures
from dapo.report.mechanisms import (
    UNEQUAL_CAPTION,
    across_seeds,
    configurations,
    mechanisms_figure,
    past_common,
    seeds_label,
)
from dapo.report.runs import line_series
from dapo.report.style import run_colours, run_styles


def _run(root: Path, name: str, rows: list[dict], summary: dict | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def _flat(level: float, last: int) -> list[dict]:
    return [{"step": s, "train/entropy": level} for s in range(1, last + 1)]


def _entropy_axes(fig):
    return next(ax for ax in fig.axes if ax.get_title() == "entropy")


def test_the_mean_over_seeds_stops_where_the_shortest_seed_stopped(tmp_path: Path) -> None:
    # Flat seeds (as a tokens=N budget stops them at different steps): the mean is flat too.
    dirs = [
        _run(tmp_path, f"cfg-seed{i}", _flat(level, last))
        for i, (level, last) in enumerate([(0.030, 20), (0.050, 30), (0.060, 30)])
    ]
    members = configurations(read_runs(dirs))["cfg"]
    steps, mean, low, high = across_seeds(members, "train/entropy")
    assert steps == [float(s) for s in range(1, 21)]  # it went on to 30 over 2 of 3 seeds
    assert mean == [(0.030 + 0.050 + 0.060) / 3] * 20
    assert (set(low), set(high)) == ({0.030}, {0.060})
    tails = [(s[0], s[-1], set(v)) for s, v in past_common(members, "train/entropy")]
    assert tails == [(20.0, 30.0, {0.050}), (20.0, 30.0, {0.060})]
    assert seeds_label("cfg", members) == "cfg (3 seeds to step 20, then fewer)"

    fig = mechanisms_figure(members)
    ax = _entropy_axes(fig)
    drawn = {line.get_label(): line for line in ax.get_lines()}
    mean_line = drawn["cfg (3 seeds to step 20, then fewer)"]
    assert list(mean_line.get_xdata()) == steps and set(mean_line.get_ydata()) == {mean[0]}
    thin = [line for line in ax.get_lines() if line is not mean_line]
    assert sorted(set(line.get_ydata()) for line in thin) == [{0.050}, {0.060}]
    assert all(line.get_linewidth() < mean_line.get_linewidth() for line in thin)
    assert fig.get_suptitle() == UNEQUAL_CAPTION
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["cfg (3 seeds to step 20, then fewer)"]


def test_seeds_of_one_length_keep_the_plain_label_and_caption(tmp_path: Path) -> None:
    dirs = [_run(tmp_path, f"cfg-seed{i}", _flat(0.1 * (i + 1), 5)) for i in range(2)]
    members = configurations(read_runs(dirs))["cfg"]
    assert seeds_label("cfg", members) == "cfg (2 seeds)"
    assert past_common(members, "train/entropy") == []
    fig = mechanisms_figure(members)
    assert fig.get_suptitle() == "mean over seeds; band: lowest to highest seed"


def test_a_step_a_run_logged_twice_is_one_seed_its_last_line(tmp_path: Path) -> None:
    # A resume at a checkpoint its evaluation had not reached logs that step again.
    twice = [*_flat(0.7, 2), {"step": 3, "train/entropy": 0.9}, {"step": 3, "train/entropy": 0.5}]
    dirs = [_run(tmp_path, "cfg-seed0", twice), _run(tmp_path, "cfg-seed1", _flat(0.3, 3))]
    members = configurations(read_runs(dirs))["cfg"]
    steps, mean, low, high = across_seeds(members, "train/entropy")
    assert steps == [1.0, 2.0, 3.0]
    assert mean == [(0.7 + 0.3) / 2, (0.7 + 0.3) / 2, (0.5 + 0.3) / 2]  # not (0.9 + 0.5) / 2
    assert (low[2], high[2]) == (0.3, 0.5)
    assert seeds_label("cfg", members) == "cfg (2 seeds)"
    # Stopped a step earlier, the other seed's step 3 (twice) is a single seed's: drawn thin.
    (tmp_path / "cfg-seed1" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _flat(0.3, 2))
    )
    members = configurations(read_runs(dirs))["cfg"]
    assert across_seeds(members, "train/entropy")[0] == [1.0, 2.0]
    assert past_common(members, "train/entropy") == [([2.0, 3.0], [0.7, 0.5])]


def test_a_null_in_one_seed_breaks_the_mean_instead_of_averaging_fewer(tmp_path: Path) -> None:
    rows = _flat(0.2, 4)
    rows[2]["train/entropy"] = None  # step 3 trained no token
    dirs = [_run(tmp_path, "cfg-seed0", rows), _run(tmp_path, "cfg-seed1", _flat(0.4, 4))]
    steps, mean, low, high = across_seeds(configurations(read_runs(dirs))["cfg"], "train/entropy")
    assert steps == [1.0, 2.0, 3.0, 4.0]
    assert mean[:2] == [0.30000000000000004] * 2 and math.isnan(mean[2]) and mean[3] == mean[0]
    assert math.isnan(low[2]) and math.isnan(high[2])


def test_a_configuration_of_one_step_is_drawn_as_a_marker(tmp_path: Path) -> None:
    dirs = [_run(tmp_path, f"one-seed{i}", [{"step": 1, "train/entropy": 0.5}]) for i in (0, 1)]
    ax = _entropy_axes(mechanisms_figure(read_runs(dirs)))
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1.0] and line.get_marker() == "o"


def test_48_runs_have_48_looks_and_the_first_20_are_unchanged() -> None:
    looks = run_styles(48)
    assert len({(tuple(colour), str(style)) for colour, style in looks}) == 48
    assert [style for _, style in looks[:20]] == ["-"] * 20
    assert {style for _, style in looks[20:40]} == {"-."}
    assert [colour for colour, _ in looks] == run_colours(48)
    # No run's style is a panel's own: dashed is a response length's max, dotted a tool rate.
    assert not {"--", ":"} & {str(style) for _, style in run_styles(200)}
    assert len({(tuple(c), str(s)) for c, s in run_styles(200)}) == 200
    assert run_styles(10) == [(c, "-") for c in run_colours(10)]


def _runs(root: Path, n: int) -> list:
    dirs = []
    for i in range(n):
        rows = [{"step": 0, "val/accuracy": 0.5}]
        rows += [
            {"step": s, "rollout/accuracy": 0.1 * s, "clip/low_frac": 0.01, "train/entropy": 0.3}
            for s in range(1, 6)
        ]
        dirs.append(_run(root, f"run{i:02d}-seed0", rows))
    return read_runs(dirs)


def _panel_inches(fig) -> list[float]:
    height = fig.get_figheight()
    return [round(ax.get_position().height * height, 6) for ax in fig.axes if ax.get_visible()]


def _legend_clear_of_panels(fig) -> bool:
    renderer = fig.canvas.get_renderer()
    bottom = min(legend.get_window_extent(renderer).y0 for legend in fig.legends)
    tops = [ax.get_tightbbox(renderer).y1 for ax in fig.axes if ax.get_visible()]
    return bottom >= max(tops)


def test_a_long_legend_grows_the_figure_not_the_panels(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    few, many = _runs(tmp_path / "few", 6), _runs(tmp_path / "many", 48)
    clipping = [("lower clip active", "fraction of tokens", [("clip/low_frac", "-")])] * 3
    # As few as the legends' rows the figures are made for: 2 runs for the accuracy and grid
    # figures (one more row on the accuracy figure is the line kinds), 4-6 configurations for
    # the mechanisms (1-3 have one row and a little more room).
    for make, small_runs in (
        (accuracy_figure, few[:2]),
        (lambda r: grid_figure(r, clipping, (1, 3)), few[:2]),
        (mechanisms_figure, few),
    ):
        small, large = make(small_runs), make(many)
        assert _panel_inches(large) == pytest.approx(_panel_inches(small), abs=0.02)
        assert large.get_figheight() > small.get_figheight()
        assert _legend_clear_of_panels(large), make
        plt.close(small)
        plt.close(large)
    # 2 runs: the figure as it always was.
    fig = accuracy_figure(few[:2])
    assert (fig.get_figwidth(), fig.get_figheight()) == (8, 4.8)
    plt.close(fig)


def test_48_runs_draw_every_figure_without_a_warning(tmp_path: Path) -> None:
    runs = _runs(tmp_path / "runs", 48)
    out = tmp_path / "report"
    out.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = write_figures(runs, out)
    assert [p.name for p in paths] == list(FIGURES)
    assert [str(w.message) for w in caught] == []  # was "Tight layout not applied" at 48 runs


def test_a_line_breaks_where_a_step_logged_null(tmp_path: Path) -> None:
    rows = [{"step": 0, "val/accuracy": 0.2}]
    for step in range(1, 9):
        rows.append({"step": step, "train/entropy": 0.1 * step, "train/skipped_updates": 0.0})
    for step in (3, 4, 5, 6):  # no token trained: update() logs null
        rows[step]["train/entropy"] = None
    rows[3]["train/skipped_updates"] = 1.0
    rows[8]["train/skipped_updates"] = 2.0
    rows[8]["train/entropy"] = None  # and step 8: step 7 stands alone between two breaks
    run_dir = _run(tmp_path, "gappy", rows)
    (run,) = read_runs([run_dir])
    steps, values = line_series(run, "train/entropy")
    assert steps == [float(s) for s in range(1, 9)]  # step 0 has no train/entropy: not a break
    expected = [0.1, 0.2, None, None, None, None, 0.1 * 7, None]
    assert [v if v == v else None for v in values] == expected
    fig = grid_figure([run], [("entropy", "nats / token", [("train/entropy", "-")])], (1, 1))
    (line,) = fig.axes[0].get_lines()
    drawn = [v if v == v else None for v in line.get_ydata()]
    assert drawn == expected
    assert line.get_marker() == "o" and line.get_markevery() == [6]  # the lone step 7
    html = make_report([run_dir], tmp_path / "report").read_text(encoding="utf-8")
    row = '<tr><td>gappy</td><td class="num"><span class="warn">3</span></td>'
    assert row + '<td><span class="warn">3-6, 8 (train/entropy)</span></td></tr>' in html


def test_the_runs_table_reads_start_end_and_steps_from_the_metrics(tmp_path: Path) -> None:
    # Finished at 16, extended with --resume train.steps=24 and stopped after step 21.
    vals = {0: 0.1631, 5: 0.166, 15: 0.2363, 16: 0.2275, 20: 0.2227}
    rows = [{"step": s, **({"val/accuracy": vals[s]} if s in vals else {})} for s in range(22)]
    rows.insert(20, {"step": 20, "val/accuracy": 0.9})  # step 20 logged twice: the last counts
    summary = {"steps": 16, "val/accuracy_start": 0.1631, "val/accuracy_end": 0.2275}
    extended = _run(tmp_path, "extended", rows, summary)
    running = _run(tmp_path, "running", rows[:6])  # no summary.json yet
    finished = _run(tmp_path, "finished", rows[:17], summary)
    html = make_report([extended, running, finished], tmp_path / "report").read_text("utf-8")
    cells = '<td class="num">{}</td><td>{} read, 0 lines skipped</td>'
    cells += '<td class="num">{}</td><td class="num">{}</td></tr>'
    assert cells.format("logged to step 21, last finished at 16", 23, "0.163", "0.223") in html
    not_finished = "logged to step 5, not finished (no summary.json)"
    assert cells.format(not_finished, 6, "0.163", "0.166") in html
    assert cells.format("16", 17, "0.163", "0.228") in html


def test_a_step_with_no_up_clipped_token_logs_null_not_zero(tmp_path: Path) -> None:
    from dapo.run.metrics import MetricsLogger
    from dapo.training.update import update_metrics

    sums = {"tokens": 40.0, "updates": 1.0, "loss": 0.5, "clip_high": 0.0}
    none_clipped = update_metrics(sums | {"num_clip_high": 0.0}, 1, lr=1e-6, with_kl=False)
    assert math.isnan(none_clipped["clip/high_prob_mean"])
    assert none_clipped["clip/high_frac"] == 0.0  # a share of 40 tokens: 0 is a figure
    some = sums | {"clip_high": 3.0, "num_clip_high": 3.0, "clip_high_prob_sum": 0.25 + 0.5 + 0.9}
    clipped = update_metrics(some, 1, lr=1e-6, with_kl=False)
    assert clipped["clip/high_prob_mean"] == (0.25 + 0.5 + 0.9) / 3
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    logger.log(1, none_clipped)
    logger.log(2, clipped)
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["clip/high_prob_mean"] for x in lines] == [None, (0.25 + 0.5 + 0.9) / 3]
