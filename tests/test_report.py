"""dapo.report: reading run directories, config differences, and the HTML/PNG report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from dapo.cli.report import add_parser
from dapo.report import (
    FIGURES,
    Run,
    config_differences,
    make_report,
    read_run,
)
from dapo.report.mechanisms import across_seeds, configurations, write_mechanisms

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _config(eps_high: float = 0.28, name: str = "") -> dict:
    return {
        "model": {"path": "embedded", "dtype": "float32"},
        "algo": {"eps_low": 0.2, "eps_high": eps_high, "loss_agg": "token-mean"},
        "sampling": {"dynamic": True, "max_rounds": 10},
        "run": {"out_dir": f"/somewhere/{name}", "name": name, "preset": "dapo"},
    }


def _val(step: int) -> dict:
    acc = 0.2 + 0.02 * step
    return {"val/accuracy": acc, "val/accuracy_low": acc - 0.05, "val/accuracy_high": acc + 0.05}


def _write_run(
    root: Path, name: str, config: dict, steps: int = 10, truncated: bool = False
) -> Path:
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    lines = [json.dumps({"step": 0, **_val(0)})]
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "rollout/response_len_mean": 15.0 + 0.1 * step,
            "rollout/response_len_max": 28.0,
            "rollout/reward_mean": -0.6 + 0.05 * step,
            "rollout/accuracy": 0.2 + 0.025 * step,
            "train/entropy": 0.7 - 0.01 * step,
            "train/token_prob_mean": 0.71 + 0.002 * step,
            "clip/low_frac": 0.04,
            "clip/high_frac": 0.005 + 0.001 * step,
            "clip/high_prob_mean": 0.2,
            "sampling/rounds": 1.0 + step % 2,
            "sampling/groups_kept": 32.0,
            "sampling/prompts_drawn": 40.0 * (1 + step % 2),
            "sampling/kept_frac": 32.0 / (40.0 * (1 + step % 2)),
            "sampling/tokens_per_kept_group": 300.0 + step,
            "perf/step_s": 3.5,
            # A null value is what a metric that could not be computed logs; it must be skipped.
            "train/kl": None,
        }
        if step % 5 == 0:
            row.update(_val(step))
        lines.append(json.dumps(row))
    text = "\n".join(lines) + "\n"
    if truncated:
        # What a crash mid-write leaves: the start of a JSON object and no newline.
        text += '{"step": 11, "rollout/accura'
    (run / "metrics.jsonl").write_text(text, encoding="utf-8")
    summary = {"steps": steps, "val/accuracy_start": 0.2, "val/accuracy_end": 0.4}
    (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    if not truncated:  # a finished run has its final evaluation's samples
        sample = {"step": steps, "kind": "reflective", "uid": "p3", "ground_truth": "7"}
        sample.update(answer="8", correct=False, response="Wait, <check> 3 + 4\nAnswer: 8")
        (run / "samples.jsonl").write_text(json.dumps(sample) + "\n", encoding="utf-8")
    return run


@pytest.fixture()
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    a = _write_run(tmp_path, "run-a", _config(0.28, "run-a"))
    b = _write_run(tmp_path, "run-b", _config(0.2, "run-b"), truncated=True)
    return a, b


def test_read_run_counts_truncated_line(two_runs: tuple[Path, Path]) -> None:
    a, b = two_runs
    run_a, run_b = read_run(a), read_run(b)
    assert (run_a.name, run_a.skipped, len(run_a.rows)) == ("run-a", 0, 11)
    assert (run_b.name, run_b.skipped, len(run_b.rows)) == ("run-b", 1, 11)
    assert run_b.config["algo"]["eps_high"] == 0.2
    assert run_b.summary["val/accuracy_end"] == 0.4
    assert run_b.samples == []


def test_read_run_skips_garbage_and_missing_config(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(
        b'{"step": 0, "val/accuracy": 0.1}\n\xff\xfe garbage\n[1, 2]\n\n{"step": 1}\n'
    )
    got = read_run(run)
    assert got.config == {}
    assert got.summary == {}
    assert got.skipped == 2
    assert [r["step"] for r in got.rows] == [0, 1]


def test_read_run_without_metrics_names_path(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with pytest.raises(ValueError, match="not-a-run"):
        read_run(empty)


def test_config_differences_exact(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    runs = [read_run(p) for p in two_runs]
    # run.name and run.out_dir differ too, but always do: they are left out.
    assert config_differences(runs) == [("algo.eps_high", [0.28, 0.2])]

    cfg = _config(0.28, "run-c")
    cfg["algo"]["kl_coef"] = 0.001
    cfg["sampling"]["dynamic"] = False
    c = read_run(_write_run(tmp_path, "run-c", cfg))
    assert config_differences([runs[0], c]) == [
        ("algo.kl_coef", [None, 0.001]),
        ("sampling.dynamic", [True, False]),
    ]
    assert config_differences([runs[0]]) == []


def test_make_report_writes_self_contained_html(two_runs: tuple[Path, Path], tmp_path: Path):
    out = tmp_path / "report"
    html_path = make_report(list(two_runs), out)
    assert html_path == out / "report.html"
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 10_000, name
    html = html_path.read_text(encoding="utf-8")
    assert "run-a" in html and "run-b" in html
    assert html.count("data:image/png;base64,") == len(FIGURES)
    assert "algo.eps_high" in html
    assert "1 line skipped" in html
    assert "0 lines skipped" in html
    assert "http://" not in html and "https://" not in html
    assert "0.400" in html  # end accuracy from summary.json
    # Sample responses, escaped: a response is model output, never markup.
    assert "Sample responses" in html and "Wait, &lt;check&gt; 3 + 4" in html
    assert "8 / 7 (wrong)" in html


def test_make_report_survives_missing_metrics(tmp_path: Path) -> None:
    # An older or crashed run: only the step-0 evaluation, no low/high, no summary.
    run = tmp_path / "stub"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "val/accuracy": 0.18}\n', encoding="utf-8")
    html = make_report([run], tmp_path / "out").read_text(encoding="utf-8")
    assert "single run" in html
    assert html.count("data:image/png;base64,") == len(FIGURES)


def test_cli_report_default_out(two_runs: tuple[Path, Path], capsys) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", str(two_runs[0]), str(two_runs[1])])
    assert args.func(args) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1] == str(two_runs[0] / "report" / "report.html")
    assert all(Path(p).is_file() for p in printed)
    assert len(printed) == len(FIGURES) + 1


def test_a_run_saved_before_keys_moved_differs_only_where_it_differs(tmp_path: Path) -> None:
    old = _config(0.28, "old")
    old["data"] = {"num_train": 200, "max_terms": 5}
    old["model"]["sft_steps"] = 100
    new = _config(0.28, "new")
    new["arith"] = {"num_train": 200, "max_terms": 3}
    new["embedded"] = {"sft_steps": 100}
    runs = [read_run(_write_run(tmp_path, "old", old)), read_run(_write_run(tmp_path, "new", new))]
    assert config_differences(runs) == [("arith.max_terms", [5, 3])]


def test_mechanisms_group_runs_by_configuration_and_band_over_seeds(tmp_path):
    def run(name: str, entropy: dict[int, float]) -> Run:
        rows = [{"step": s, "train/entropy": v} for s, v in entropy.items()]
        return Run(name=name, path=tmp_path / name, rows=rows)

    runs = [
        run("clip-higher-seed0", {1: 0.9, 2: 0.8, 3: 0.7}),
        run("naive-grpo-seed0", {1: 0.9, 2: 0.5}),
        run("clip-higher-seed1", {1: 0.7, 2: 0.6}),  # stopped a step earlier
        run("naive-grpo-seed1", {1: 0.8, 2: 0.4}),
        run("single", {1: 0.3}),
    ]
    groups = configurations(runs)
    assert list(groups) == ["clip-higher", "naive-grpo", "single"]
    assert [r.name for r in groups["clip-higher"]] == ["clip-higher-seed0", "clip-higher-seed1"]
    # Steps logged by two or more seeds only: step 3 has one seed of two.
    steps, mean, low, high = across_seeds(groups["clip-higher"], "train/entropy")
    assert steps == [1.0, 2.0]
    assert mean == pytest.approx([0.8, 0.7]) and low == [0.7, 0.6] and high == [0.9, 0.8]
    assert across_seeds(groups["single"], "train/entropy") == ([1.0], [0.3], [0.3], [0.3])
    assert across_seeds(groups["single"], "sampling/all_correct_frac") == ([], [], [], [])
    path = write_mechanisms(runs, tmp_path / "mechanisms.png")
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_a_run_with_a_tool_shows_its_tool_call_rate_beside_accuracy(tmp_path: Path) -> None:
    run = _write_run(tmp_path, "tools", _config(name="tools"))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "val/accuracy" in row:  # steps 0, 5, 10: 0.25, 0.6, 0.95
            row["val/tool_call_frac"] = 0.25 + 0.07 * row["step"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = _write_run(tmp_path, "plain", _config(name="plain"))
    html = make_report([run, plain], tmp_path / "report").read_text(encoding="utf-8")
    assert "<th>tool-call rate start</th><th>tool-call rate end</th>" in html
    assert '<td class="num">0.250</td><td class="num">0.950</td>' in html
    assert '<td class="num">—</td><td class="num">—</td></tr>' in html  # the run without one


def test_links_in_the_report_directory_are_refused_not_written_through(tmp_path: Path) -> None:
    from dapo.run.nofollow import LinkRefused

    run = _write_run(tmp_path, "from-elsewhere", _config(name="from-elsewhere"))
    victim, elsewhere = tmp_path / "victim.txt", tmp_path / "elsewhere"
    victim.write_text("keep me\n")
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere)  # the whole report/ a link: refused at once
    with pytest.raises(LinkRefused, match="report is a symbolic link"):
        make_report([run], run / "report")
    assert list(elsewhere.iterdir()) == []
    (run / "report").unlink()
    (run / "report").mkdir()
    for name in ("report.html", FIGURES[0]):  # a page or a figure in a link's place
        (run / "report" / name).unlink(missing_ok=True)  # the figures drawn before the page
        (run / "report" / name).symlink_to(victim)
        with pytest.raises(LinkRefused, match=f"{name} is a symbolic link"):
            make_report([run], run / "report")
        assert victim.read_text() == "keep me\n"
        (run / "report" / name).unlink()


def test_hostile_lines_are_skipped_not_raised(tmp_path: Path) -> None:
    from dapo.report.runs import is_number, series

    run = tmp_path / "hostile"
    run.mkdir()
    lines = [
        '{"step": 1, "val/accuracy": 0.5}',
        '{"step": 2, "x": 1' + "0" * 5000 + "}",  # too long for int(): ValueError
        "[" * 100_000 + "]" * 100_000,  # deeper than the parser recurses
        '{"step": 1' + "0" * 400 + ', "val/accuracy": 0.7}',  # a step beyond a float
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text("[" * 100_000)
    good = {"response": "ok", "step": 1}
    (run / "samples.jsonl").write_text("[" * 100_000 + "\n" + json.dumps(good) + "\n")
    got = read_run(run)
    assert got.skipped == 2 and len(got.rows) == 2
    assert series(got, "val/accuracy") == ([1.0], [0.5]) and got.last_step == 1
    assert got.summary == {} and got.samples == [good]
    assert not is_number(10**400) and is_number(10**300) and not is_number(True)


def test_a_config_with_aliases_or_deep_nesting_is_refused_naming_it(tmp_path: Path) -> None:
    laughs = ["a0: &a0 {x: 1}"]
    for i in range(1, 4):  # 10^3 keys from 300 bytes; 9 levels would be 10^9
        refs = ", ".join(f"k{j}: *a{i - 1}" for j in range(10))
        laughs.append(f"a{i}: &a{i} {{{refs}}}")
    for text, why in (("\n".join(laughs), "aliases"), ("[" * 100_000, "recursion")):
        run = _write_run(tmp_path, f"bad-{why}", {})
        (run / "config.yaml").write_text(text + "\n")
        with pytest.raises(ValueError, match=rf"bad-{why}/config.yaml: not a readable config.*"):
            read_run(run)
    (run / "config.yaml").write_text("a: &a {x: 1}\nb: {y: 2}\n")  # an anchor alone is harmless
    assert read_run(run).config == {"a": {"x": 1}, "b": {"y": 2}}


def test_runs_named_alike_are_told_apart_and_never_seeds_of_each_other(tmp_path: Path) -> None:
    from dapo.report import read_runs

    a, b = (tmp_path / side for side in ("A", "B"))
    a.mkdir()
    b.mkdir()
    one, other = _write_run(a, "dapo", _config()), _write_run(b, "dapo", _config())
    runs = read_runs([one, other, tmp_path / "A" / ".." / "A" / "dapo"])  # the first one again
    assert [r.name for r in runs] == ["A/dapo", "B/dapo"]
    groups = configurations(runs)
    assert {name: len(members) for name, members in groups.items()} == {"A/dapo": 1, "B/dapo": 1}
    # Runs of one name in two ablations' directories (perhaps of other settings, other seed
    # counts) are two configurations, never one's seeds, and are labelled apart.
    seeds = [_write_run(a, "cfg-seed0", _config()), _write_run(b, "cfg-seed1", _config())]
    seeds.append(_write_run(a, "cfg-seed1", _config()))
    runs = read_runs(seeds)
    groups = configurations(runs)
    assert {name: [r.path for r in members] for name, members in groups.items()} == {
        "A/cfg": [seeds[0], seeds[2]],
        "B/cfg": [seeds[1]],
    }
