"""`dapo bench`: phases that add up to the step, and a fixed-length mode that does equal work."""

import json

import pytest

from dapo.cli import main
from dapo.training.bench import summarize_steps


def test_summary_takes_medians_and_shares():
    steps = [
        {"perf/step_s": 2.0, "perf/generate_s": 1.0, "perf/train_s": 0.5, "perf/other_s": 0.5},
        {"perf/step_s": 4.0, "perf/generate_s": 3.0, "perf/train_s": 0.5, "perf/other_s": 0.5},
        {"perf/step_s": 3.0, "perf/generate_s": 2.0, "perf/train_s": 0.5, "perf/other_s": 0.5},
    ]
    out = summarize_steps(steps)
    assert out["steps"] == 3 and out["step_s"] == 3.0
    assert out["phases"]["generate"] == {"s": 2.0, "share": pytest.approx(2 / 3)}
    assert out["phases"]["reward"] == {"s": 0.0, "share": 0.0}


def test_summary_of_steps_drawn_ahead_adds_the_trainers_wait_and_the_staleness():
    steps = [
        {"perf/step_s": 2.0, "perf/trainer_idle_s": 0.5, "perf/generate_s": 1.5,
         "async/staleness_mean": 0.0},
        {"perf/step_s": 4.0, "perf/trainer_idle_s": 1.0, "perf/generate_s": 3.0,
         "async/staleness_mean": 1.0},
        {"perf/step_s": 3.0, "perf/trainer_idle_s": 2.0, "perf/generate_s": 2.5,
         "async/staleness_mean": 1.0},
    ]  # fmt: skip
    out = summarize_steps(steps)
    assert list(out["phases"])[0] == "trainer_idle"
    assert out["phases"]["trainer_idle"] == {"s": 1.0, "share": pytest.approx(1 / 3)}
    assert out["phases"]["generate"] == {"s": 2.5, "share": pytest.approx(2.5 / 3)}
    assert out["staleness_mean"] == 1.0
    assert "staleness_mean" not in summarize_steps([{"perf/step_s": 1.0}])


TINY = [
    "embedded.sft_steps=5",
    "embedded.hidden=32",
    "arith.num_warmup=64",
    "rollout.group_size=4",
    "rollout.max_new_tokens=12",
    "algo.l_cache=4",
    "train.prompts_per_step=2",
    "train.responses_per_minibatch=8",
    "reward.workers=0",
]


def test_bench_draws_ahead_in_a_generator_thread_as_training_does(tmp_path, capsys):
    # train.async_staleness=1 was benched in turn: no generator thread, no overlap, no word.
    # Step t samples the weights after step max(0, t - 1): staleness 0, 1, 1 (median 1).
    args = ["bench", "--steps", "3", "--warmup", "0", "--fixed-length"]
    args += [f"embedded.cache_dir={tmp_path}", *TINY, "train.async_staleness=1", "train.steps=2"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["async_staleness"] == 1 and result["staleness_mean"] == 1.0
    assert result["steps"] == 3  # past train.steps=2: the thread draws the steps timed
    assert "trainer_idle" in result["phases"] and result["tokens_generated"] == 2 * 4 * 12


def test_bench_refuses_generator_ranks_it_cannot_start(tmp_path, capsys):
    assert main(["bench", f"embedded.cache_dir={tmp_path}", "dist.rollout_ranks=1"]) == 2
    err = capsys.readouterr().err
    assert "dist.rollout_ranks=1: dapo bench runs one process" in err
    assert "dist.rollout_ranks=0" in err


def test_fixed_length_bench_runs_every_response_to_the_limit(tmp_path, capsys):
    args = [
        "bench",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--fixed-length",
        f"embedded.cache_dir={tmp_path}",
        "embedded.sft_steps=5",
        "embedded.hidden=32",
        "arith.num_warmup=64",
        "rollout.group_size=4",
        "rollout.max_new_tokens=12",
        "algo.l_cache=4",
        "train.prompts_per_step=2",
        "train.responses_per_minibatch=8",
        "reward.workers=0",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["response_len_mean"] == 12.0 and result["tokens_generated"] == 2 * 4 * 12
    assert result["gen_padding_frac"] == 0.0  # no response stops early
    shares = sum(p["share"] for p in result["phases"].values())
    assert shares == pytest.approx(1.0)  # one step: the phases add up to it exactly
    assert result["peak_rss_mib"] > 0 and result["fixed_length"] is True


def _stub_run(monkeypatch, device, events: list) -> None:
    """Stubs for ``bench_steps``' run (no model, no data, no GPU): each step appends "step"
    to ``events`` and takes 1 s."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from dapo.training import bench
    from dapo.training.inputs import RunData

    state = SimpleNamespace(device=device, pool=None)
    data = RunData(train=[], val=[])
    monkeypatch.setattr(bench.inputs, "load_run_data", lambda cfg: data)
    monkeypatch.setattr(bench.policy, "load_tokenizer", lambda cfg: None)
    monkeypatch.setattr(bench.inputs, "check_context", lambda cfg, data, tokenizer: {})
    monkeypatch.setattr(bench.policy, "load_policy", lambda *args, log: (None, None))
    monkeypatch.setattr(
        bench, "build_state", lambda cfg, *args: setattr(state, "cfg", cfg) or state
    )
    monkeypatch.setattr(bench, "reward_pool", lambda cfg: nullcontext())
    monkeypatch.setattr(
        bench, "train_step", lambda s, source=None: events.append("step") or {"perf/step_s": 1}
    )


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_cuda_peak_covers_the_timed_steps_alone(monkeypatch, device):
    # Stubs for the run (no model, no GPU): what matters is when the peak is reset.
    import torch

    from dapo.config import load_config
    from dapo.training import bench

    events = []
    _stub_run(monkeypatch, torch.device(device), events)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**20)
    out = bench.bench_steps(load_config(None, []), steps=2, warmup=2, log=lambda m: None)
    if device == "cuda":  # model load and warm-up steps left out
        assert events == ["step", "step", "reset", "step", "step"]
        assert out["peak_cuda_mib"] == 3 and "timed steps" in out["peak_cuda_covers"]
    else:  # the CPU path as it was: the process's peak RSS alone
        assert events == ["step"] * 4
        assert "peak_cuda_mib" not in out and out["peak_rss_mib"] > 0


@pytest.mark.parametrize("threads", [0, 1])
def test_bench_sets_the_threads_before_each_step_as_training_does(monkeypatch, threads):
    # run.threads=0 follows the free cores before every step (the loop's governor); a fixed
    # count is set once. The bench kept torch's default under run.threads=0.

    import torch

    from dapo.config import load_config
    from dapo.training import bench

    events = []
    counts = iter([2, 1, 1, 2])

    class Governor:
        def __init__(self, most: int | None = None) -> None:
            events.append(f"most {most}")  # beside no generator thread: no cap

        def adjust(self) -> int:
            n = next(counts)
            torch.set_num_threads(n)
            events.append(f"threads {n}")
            return n

    monkeypatch.setattr(bench, "ThreadGovernor", Governor)
    _stub_run(monkeypatch, torch.device("cpu"), events)
    before = torch.get_num_threads()
    try:
        cfg = load_config(None, [f"run.threads={threads}"])
        out = bench.bench_steps(cfg, steps=3, warmup=1, log=lambda m: None)
    finally:
        torch.set_num_threads(before)
    if threads == 0:
        assert events == [
            "most None",
            "threads 2",
            "step",
            "threads 1",
            "step",
            "threads 1",
            "step",
        ] + [
            "threads 2",
            "step",
        ]
        assert out["threads"] == 1  # the median over the timed steps: 1, 1, 2
    else:
        assert events == ["step"] * 4 and out["threads"] == 1
