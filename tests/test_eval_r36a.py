"""Review r36a (the numbers dapo eval reports): a compared file that repeats a uid."""

from __future__ import annotations

import json

from dapo.cli import main


def test_compare_refuses_a_file_that_repeats_a_uid(tmp_path, capsys):
    # Two evaluations' problems.jsonl joined to pool samples: B's table stood for the second
    # copy alone, its first 20 records dropped without a word or a count.
    def line(uid: str, value: float) -> str:
        return json.dumps({"uid": uid, "ground_truth": "7", "metrics": {"avg@k": value}}) + "\n"

    a = tmp_path / "a.jsonl"
    a.write_text("".join(line(f"p{i}", 0.25) for i in range(3)))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(line(f"p{i}", 0.25) for i in range(3)) + line("p1", 1.0))
    assert main(["eval", "--compare", str(a), str(b), "--resamples", "50"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        f"--compare: {b} line 4 repeats uid 'p1' of line 2: one record per problem, as dapo "
        "eval writes them (for more samples per problem, evaluate once with a larger --k)"
    ) in captured.err
    assert "Traceback" not in captured.err
    b.write_text("".join(line(f"p{i}", 0.25) for i in range(3)))
    assert main(["eval", "--compare", str(a), str(b), "--resamples", "50"]) == 0
    assert "3 problems in both" in capsys.readouterr().out


def test_a_stop_that_breaks_torchs_vmap_still_stops_with_the_resume_hint(monkeypatch, capsys):
    # On transformers 4.56 (the floor) SIGTERM raised inside the vmap that builds the causal
    # mask; functorch's clean-up then failed with an internal assert in the stop's place, and
    # dapo eval ended with that traceback and exit status 1 instead of 143 and its hint.
    import signal

    import dapo.api.evaluation
    from dapo.cli.eval import Stopped

    def broken_by_the_stop(request):
        try:
            raise Stopped(signal.SIGTERM)
        except Stopped:
            raise RuntimeError("!dynamicLayerStack.empty() INTERNAL ASSERT FAILED") from None

    monkeypatch.setattr(dapo.api.evaluation, "run", broken_by_the_stop)
    assert main(["eval", "embedded", "--data", "arith"]) == 143
    assert capsys.readouterr().err.startswith(
        "dapo: evaluation stopped by SIGTERM; the problems it finished are kept"
    )

    def a_fault(request):
        raise RuntimeError("a fault of its own")

    monkeypatch.setattr(dapo.api.evaluation, "run", a_fault)
    try:
        main(["eval", "embedded", "--data", "arith"])
    except RuntimeError as exc:
        assert str(exc) == "a fault of its own"
    else:
        raise AssertionError("a fault was taken for a stop")


def test_eval_with_a_runs_config_grades_with_the_runs_own_reward_function(tmp_path, capsys):
    # Review r37a: --config's reward.function was dropped for the built-in verifier, silently
    # (avg@k 0.062 for a run whose function scored 1.000), though --config "grades as the run
    # does". The command's own flags still win.
    from helpers import save_model

    model = save_model(tmp_path / "m", "qwen2")
    fn = tmp_path / "always.py"
    fn.write_text("def score(response, ground_truth):\n    return {'score': 1.0, 'pred': 'x'}\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"reward:\n  function: {fn}:score\n")
    base = ["eval", str(model), "--data", "arith", "--k", "2", "--max-new-tokens", "4"]
    base += ["--num-problems", "3", "--resamples", "50", "--config", str(config)]
    assert main([*base, "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metrics"]["avg@k"]["mean"] == 1.0
    assert summary["protocol"]["reward_function"] == f"{fn}:score"
    assert main([*base, "--reward-mode", "dapo", "--out", str(tmp_path / "flag")]) == 0
    summary = json.loads((tmp_path / "flag" / "summary.json").read_text())
    assert "reward_function" not in summary["protocol"]
    assert summary["protocol"]["reward_mode"] == "dapo"
    assert summary["metrics"]["avg@k"]["mean"] < 1.0  # 4 random tokens solve no sum
