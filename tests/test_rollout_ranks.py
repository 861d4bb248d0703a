"""Ranks that only generate (``dist.rollout_ranks``): 2 gloo ranks, one trainer and one
generator, give the one-process run of the same schedule (bit for bit at k = 1, the samples
and decisions at k = 0, where the roles take turns), and 2 generators its samples; a
checkpoint resumes exactly, under torchrun or in one process, and after kill -9; a failed
draw ends the run as in one process; bad settings are refused before any model loads."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import TORCHRUN_DEMO, dapo_train
from safetensors.torch import load_file

from dapo.config import load_config
from dapo.dist import roles, weight_sync
from dapo.training import inputs, rollout_files
from dapo.training.sampling import SamplingResult
from dapo.training.sources import StepRollouts

TIMED = ("perf/",)


def _dapo(ranks: int, *args: str, out: Path, wait: bool = True):
    """:func:`dapo_train` with the embedded model's cache (``out / "cache"``)."""
    if "--resume" not in args:
        args = (*args, f"embedded.cache_dir={out / 'cache'}")
    return dapo_train(ranks, *args, out_dir=out, wait=wait)


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMED)} for m in rows]


def _same_run(a: Path, b: Path, *, exact: bool = True) -> None:
    """Every metric but the timings, and every weight, equal; not ``exact``: the same samples
    and decisions (every count), the rest to float rounding."""
    ra, rb = _rows(a), _rows(b)
    wa, wb = (load_file(r / "model" / "model.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys()
    if exact:
        assert ra == rb
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        return
    for x, y in zip(ra, rb, strict=True):
        assert (
            x.keys() - {"async/staleness_max", "async/staleness_mean"}
            == y.keys()
            - {
                "async/staleness_max",
                "async/staleness_mean",
            }
            or x.keys() <= y.keys()
        )
        for key in x.keys() & y.keys():
            if key.startswith(("sampling/", "rollout/", "val/")) or key == "train/tokens":
                assert x[key] == y[key], key
            else:
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key
    gap = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert gap <= 1e-6, gap


@pytest.fixture(scope="module")
def out(tmp_path_factory, demo_cache):
    """The one-process runs each torchrun run must equal: k = 0 (no generator) and k = 1 (a
    generator thread). The module's cache is the session's (a link to it)."""
    out = tmp_path_factory.mktemp("rollout-ranks")
    (out / "cache").symlink_to(demo_cache, target_is_directory=True)
    _dapo(0, *TORCHRUN_DEMO, "run.name=turns", out=out)
    _dapo(0, *TORCHRUN_DEMO, "train.async_staleness=1", "run.name=ahead", out=out)
    return out


def _ranks(out: Path, k: int) -> Path:
    """The torchrun run of 1 trainer and 1 generator at staleness ``k`` (made once)."""
    name = f"ranks-k{k}"
    if not (out / name / "summary.json").exists():
        args = [f"train.async_staleness={k}", "dist.rollout_ranks=1", f"run.name={name}"]
        printed = _dapo(2, *TORCHRUN_DEMO, *args, out=out)
        assert printed.count("step    3") == 1  # the trainer prints; the generator is silent
    return out / name


@pytest.mark.parametrize("k,same_as", [(0, "turns"), (1, "ahead")])
def test_a_generator_rank_trains_as_the_one_process_schedule(out, k, same_as):
    """k = 1: bit for bit the generator thread's run (both sample from a copy). k = 0: the
    samples and decisions of the run where the policy samples itself, and its losses and
    weights to float rounding (the two forward passes' sums are not ordered alike)."""
    run = _ranks(out, k)
    _same_run(out / same_as, run, exact=k == 1)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # Weights go to the generator after step t when step t + 1 + k < 3 samples from them;
    # the trainer's own copy is refreshed before an evaluation, not counted in the step.
    assert [r["perf/weight_sync_s"] > 0 for r in rows[1:]] == [True, k == 0, False]
    ckpt = run / "checkpoints" / "step_000003"
    assert json.loads((ckpt / "trainer.json").read_text())["world_size"] == 1  # one trainer


def test_two_generator_ranks_split_each_round_and_draw_the_same_samples(out):
    """1 trainer and 2 generators: each generator draws half of a round's prompts (a prompt's
    samples come from its own seed), and the first sends the whole groups. The samples and
    decisions are the one-process run's; the sampler's log-probs and what follows agree to
    float rounding (a generator decodes fewer rows at once)."""
    args = ["train.async_staleness=1", "dist.rollout_ranks=2", "run.name=two-generators"]
    _dapo(3, *TORCHRUN_DEMO, *args, out=out)
    _same_run(out / "ahead", out / "two-generators", exact=False)


@pytest.mark.parametrize("then", [2, 0], ids=["resumed-under-torchrun", "resumed-in-one-process"])
def test_a_checkpoint_with_rollouts_drawn_ahead_resumes_exactly(out, then):
    """The run's checkpoint of step 2 holds step 2's rollouts, drawn from update 1; resumed
    from it, the run ends as the uninterrupted one."""
    run = out / f"resume-{then}"
    shutil.copytree(_ranks(out, 1), run)
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    saved = json.loads((run / "checkpoints" / "step_000002" / "trainer.json").read_text())
    assert [(r["step"], r["version"]) for r in saved["ahead"]["rollouts"]] == [(2, 1)]
    extra = ["dist.rollout_ranks=1"] if then else ["dist.rollout_ranks=0"]
    printed = _dapo(then, "--resume", str(run), *extra, out=out)
    assert "resumed from" in printed
    _same_run(out / "ahead", run)


def test_kill_9_of_the_generator_stops_the_job_and_resume_continues_exactly(out):
    ranks = ["dist.rollout_ranks=1", "train.async_staleness=1"]
    proc = _dapo(
        2, *TORCHRUN_DEMO, *ranks, "train.steps=40", "run.name=killed", out=out, wait=False
    )
    latest = out / "killed" / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert latest.exists(), "no checkpoint within 2 minutes"
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    os.kill(int(children.stdout.split()[-1]), signal.SIGKILL)  # rank 1: the generator
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "Signal 9" in err or "SIGKILL" in err or "exitcode  : -9" in err
    name = latest.read_text().strip()
    step = int(name.removeprefix("step_"))
    assert 1 <= step <= 3, step
    saved = json.loads((latest.parent / name / "trainer.json").read_text())
    assert [r["step"] for r in saved["ahead"]["rollouts"]] == [step, step + 1]  # drawn ahead
    _dapo(2, "--resume", str(out / "killed"), "train.steps=3", *ranks, out=out)
    _same_run(out / "ahead", out / "killed")


# ----------------------------------------------------------------------------- in one process


def _cfg(*overrides: str):
    return load_config(None, ["arith.num_train=16", *overrides])


def test_bad_rollout_ranks_are_refused_naming_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"dist.rollout_ranks must be >= 0.*got -1"):
        _cfg("dist.rollout_ranks=-1")
    with pytest.raises(ValueError, match=r"rollout_ranks=2 leaves no trainer among 2 ranks.*1"):
        inputs.check_async(_cfg("dist.rollout_ranks=2"), world_size=2)
    # One process: dist.rollout_ranks=0 first, which a resume accepts (a changed
    # train.async_staleness it refuses, so naming only that sent a resumed run nowhere).
    for k in (0, 1):
        with pytest.raises(ValueError) as refused:
            inputs.check_async(
                _cfg("dist.rollout_ranks=1", f"train.async_staleness={k}"), world_size=1
            )
        assert str(refused.value) == (
            "dist.rollout_ranks=1 gives ranks of a torchrun job the role of generating; in one "
            "process set dist.rollout_ranks=0 (on --resume too): a generator thread then draws "
            "on the same schedule (train.async_staleness=k >= 1; at 0 each step draws in "
            "turn), or launch with torchrun --nproc-per-node N and N > dist.rollout_ranks"
        )
    with pytest.raises(ValueError, match=r"rollout.tp_size=2 with dist.rollout_ranks=1.*tp_size=1"):
        inputs.check_async(_cfg("dist.rollout_ranks=1", "rollout.tp_size=2"), world_size=4)
    with pytest.raises(ValueError, match=r"set dist.rollout_ranks=R"):
        inputs.check_async(_cfg("train.async_staleness=1"), world_size=2)
    inputs.check_async(_cfg("dist.rollout_ranks=1", "train.async_staleness=2"), world_size=2)
    # In a process of its own a generator may use any engine (no thread shares it).
    _cfg("dist.rollout_ranks=1", "train.async_staleness=1", "rollout.engine=hf")
    assert roles.Roles(world=5, generators=2).trainers == 3
    assert [roles.Roles(5, 2).generates(r) for r in range(5)] == [False] * 3 + [True] * 2


def test_buckets_cut_the_parameters_in_order_and_a_large_one_goes_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 100))
    cut = weight_sync.buckets(model, torch.float32, limit=100 * 4)
    names = [[n for n, _ in b] for b in cut]
    # 16 + 4 floats fit in 100; the 400-float weight goes alone; the bias after it.
    assert names == [["0.weight", "0.bias"], ["1.weight"], ["1.bias"]]
    # In bfloat16 at 1000 bytes: 32 + 8 + 800 fit, the 200-byte bias does not.
    halves = weight_sync.buckets(model, torch.bfloat16, limit=1000)
    assert [[n for n, _ in b] for b in halves] == [["0.weight", "0.bias", "1.weight"], ["1.bias"]]


def test_a_step_message_round_trips_its_rollouts_and_position():
    from dapo.data.batch import Episode
    from dapo.training.sampling import Group

    def episode(tokens: list[int], reward: float) -> Episode:
        ids = torch.tensor(tokens)
        return Episode(
            torch.tensor([1, 2]), ids, -torch.rand(len(tokens)), False, reward > 0, reward
        )

    kept = Group("p1", [episode([3, 4], 1.0), episode([5], -1.0)])
    dropped = Group("p2", [episode([6, 7, 8], -1.0), episode([9], -1.0)])
    result = SamplingResult([kept], 2, 2, 1, False, generated=[kept, dropped])
    drawn = StepRollouts(7, 6, result, {"gen_slots": 12.0}, 1.5, 0.25)
    message = rollout_files.encode(drawn, {"sampler": {"epoch": 0, "pos": 8}})
    back, extra = rollout_files.decode(message)
    assert extra == {"sampler": {"epoch": 0, "pos": 8}}
    assert (back.step, back.version, back.timers, back.seconds, back.idle) == (
        7,
        6,
        {"gen_slots": 12.0},
        1.5,
        0.25,
    )
    assert [g.uid for g in back.result.groups] == ["p1"]
    assert [g.uid for g in back.result.generated] == ["p1", "p2"]
    for a, b in zip(result.generated, back.result.generated, strict=True):
        for x, y in zip(a.episodes, b.episodes, strict=True):
            assert torch.equal(x.response_ids, y.response_ids)
            assert torch.equal(x.sampler_logprobs, y.sampler_logprobs)
            assert (x.reward, x.correct) == (y.reward, y.correct)


class _Done:
    """A broadcast that has finished (what ``async_op=True`` returns)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def test_weights_are_sent_from_host_memory_and_load_into_a_generator_copy(monkeypatch):
    """Every tensor trainer rank 0 broadcasts is in host memory (the sync group is gloo: no
    transfer holds a kernel on a GPU); the buckets a generator receives fill its copy with the
    trainer's weights in its dtype, and -1 then says stop, its buckets following unread."""
    sent: list[torch.Tensor] = []

    def send(tensor, src, group=None, async_op=False):
        sent.append(tensor.clone())
        return _Done()

    monkeypatch.setattr(weight_sync.torch_dist, "broadcast", send)
    trainer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 100))
    sender = weight_sync.Sender(torch.bfloat16, torch.device("cpu"))
    sender.send(trainer, 3)
    sender.stop(trainer)
    sender.finish()
    assert [t.device.type for t in sent] == ["cpu"] * 4  # version, bucket; stop, bucket
    assert [t.dtype for t in sent] == [torch.long, torch.bfloat16] * 2
    assert sent[2].item() == weight_sync.STOP and not sent[3].any()
    generator = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 100))
    generator = generator.to(torch.bfloat16).requires_grad_(False)
    for p in generator.parameters():
        p.zero_()
    queue = iter(sent)

    def receive(tensor, src, group=None, async_op=False):
        tensor.copy_(next(queue))
        return _Done()

    monkeypatch.setattr(weight_sync.torch_dist, "broadcast", receive)
    receiver = weight_sync.Receiver(generator, torch.device("cpu"))
    assert receiver.take() == 3
    for mine, theirs in zip(generator.parameters(), trainer.parameters(), strict=True):
        assert torch.equal(mine, theirs.detach().to(torch.bfloat16))
    assert receiver.take() == weight_sync.STOP
    assert next(queue, None) is None  # every message was posted for, in full


def _busy_generator_rank(rank: int, port: int, busy_s: float, out: str) -> None:
    """Rank 0 trains and sends weights (version 1); rank 1 generates for ``busy_s`` before
    it needs them. Rank 0 records how long its broadcast took to finish."""
    from dapo import dist

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    dist.init_from_env(timeout_s=30.0, wait_timeout_s=60.0)
    try:
        roles.split(1, wait_timeout_s=60.0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
        if rank == 0:
            sender = weight_sync.Sender(torch.float32, torch.device("cpu"))
            t0 = time.perf_counter()
            sender.send(model, 1)
            sender.finish()  # done when the generator has received, not when it takes
            Path(out).write_text(f"{time.perf_counter() - t0:.3f}")
            sender.stop(model)
            sender.finish()
        else:
            copy = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
            copy.requires_grad_(False)
            receiver = weight_sync.Receiver(copy, torch.device("cpu"))
            time.sleep(busy_s)  # drawing a step with the weights it has
            assert receiver.take() == 1
            pairs = zip(copy.parameters(), model.parameters(), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
            assert receiver.take() == weight_sync.STOP
    finally:
        roles.forget()
        dist.shutdown()


def test_the_trainers_broadcast_is_done_while_the_generator_is_still_drawing(tmp_path):
    """The generator posts its receives of the next weights as soon as it has taken the last
    ones, so trainer rank 0's broadcast ends at once, not when the generator next needs the
    weights (4 s later here): nothing of it waits on rank 0 meanwhile (issue 44, item 3)."""
    from helpers import spawn_ranks

    seconds = tmp_path / "seconds"
    spawn_ranks(_busy_generator_rank, 4.0, str(seconds))
    assert float(seconds.read_text()) < 2.0


def _late_rollouts_rank(rank: int, port: int, delay_s: float) -> None:
    """Rank 1 generates and sends its rollouts ``delay_s`` late; rank 0 trains and waits."""
    from dapo import dist

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    # dist.timeout_s also bounds the two processes' rendezvous: 4 s, so that a loaded machine
    # starting the second one late does not time out before the test begins.
    dist.init_from_env(timeout_s=4.0, wait_timeout_s=60.0)
    try:
        got = roles.split(1, wait_timeout_s=60.0)
        assert got is not None and got.generates(1)
        if rank == 1:
            time.sleep(delay_s)  # a round of generation, longer than dist.timeout_s
            pending: list = []
            roles.send_bytes(torch.arange(5, dtype=torch.uint8), 0, pending)
            roles.wait_sent(pending)
        else:
            assert roles.recv_bytes(1).tolist() == [0, 1, 2, 3, 4]
    finally:
        roles.forget()
        dist.shutdown()


def test_a_trainer_waits_for_rollouts_longer_than_the_collective_timeout():
    """The rollouts of a step reach the trainers after a whole round of generation: the
    trainer's receive waits up to dist.wait_timeout_s, not dist.timeout_s (4 s here, while
    the generator takes 7 s)."""
    from helpers import spawn_ranks

    spawn_ranks(_late_rollouts_rank, 7.0)


def test_a_failing_run_stops_its_source_without_waiting_on_the_generators():
    """On an exception the loop closes its source with failed=True: the trainers then wait
    for nothing from the generators (no rollouts drained, no broadcast finished): their exit
    makes torchrun stop the job. An object with none of the source's parts stands in: any
    wait would touch one and raise. Generators that sent a failed draw wait for the stop,
    which a run failing on that draw sends them (ended well, they add no error)."""
    from types import SimpleNamespace

    from dapo.training.generator_ranks import GeneratorRanks

    GeneratorRanks.close(SimpleNamespace(failure=None), failed=True)
    with pytest.raises(AttributeError):
        GeneratorRanks.close(SimpleNamespace(failure=None))  # a run that ends well stops them
    stopped = []
    failed = SimpleNamespace(failure={"type": "DynamicSamplingExhausted"})
    failed._stop, failed._catch_up = lambda: stopped.append("stop"), lambda: None
    failed.sender = SimpleNamespace(finish=lambda: stopped.append("finish"))
    GeneratorRanks.close(failed, failed=True)
    assert stopped == ["stop", "finish"]


@pytest.mark.parametrize("signals", [1, 2], ids=["stopped-after-a-save", "step-aborted"])
def test_a_stop_signal_closes_the_source_as_a_run_that_ends(
    signals, tmp_path, tiny_model, tokenizer, monkeypatch
):
    """A first SIGTERM: the step ends, the checkpoint is saved on every rank, and the run stops
    as cleanly as after its last step: the source is closed with failed=False (generator
    ranks are sent the stop and drained; closed as failing, they waited for weights until
    torchrun killed them), and so is the engine under torchrun. A second signal aborts the
    step, nothing saved: a failure, closed as one."""
    from helpers import setup_run

    from dapo import dist
    from dapo.run.interrupt import RunStopped
    from dapo.training import loop
    from dapo.training.sources import InTurn

    closed = []

    class Recorded(InTurn):
        def close(self, *, failed: bool = False) -> None:
            closed.append(("source", failed))

    real_step = loop.train_step

    def step(state, source):
        if state.step == 1:
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGTERM)
        return real_step(state, source)

    monkeypatch.setattr(loop, "rollout_source", lambda state, **kw: Recorded())
    monkeypatch.setattr(loop, "train_step", step)
    monkeypatch.setattr(loop, "close_engine", lambda e, failed: closed.append(("engine", failed)))
    monkeypatch.setattr(dist, "launched", lambda: True)
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, "train.save_every=0")
    with pytest.raises(RunStopped, match="stopped by SIGTERM" if signals == 1 else "twice"):
        loop.fit(cfg, tiny_model, tokenizer, train, val, run_dir=run_dir, stream=io.StringIO())
    assert closed == [("source", signals == 2), ("engine", signals == 2)]


@pytest.mark.parametrize(
    "generators,signalled",
    [(1, b"RANK=0"), (1, b"RANK=1"), (0, b"RANK=1")],
    ids=["the-trainer", "the-generator", "another-trainer"],
)
def test_a_stop_signal_to_one_rank_stops_the_job_after_a_save(
    demo_cache, tmp_path, generators, signalled
):
    """SIGTERM to one rank after the first checkpoint: every trainer finishes the step, saves,
    and stops the generator, which ends without an error within seconds. Not stopped, the
    generator waited for weights until the trainer's exit broke its connection (an error
    on the generator rank) or torchrun killed it. A trainer the signal did not reach failed
    with a TypeError (it named the stop by its own signal: none); a generator's signal was
    swallowed, and the run trained on to its last step."""
    k = generators  # two trainers take turns with generation (k = 0)
    args = [f"dist.rollout_ranks={generators}", f"train.async_staleness={k}", "train.steps=40"]
    args += ["run.name=stopped", f"embedded.cache_dir={demo_cache}"]
    proc = dapo_train(2, *TORCHRUN_DEMO, *args, out_dir=tmp_path, wait=False)
    latest = tmp_path / "stopped" / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not latest.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert latest.exists(), "no checkpoint within 4 minutes"
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    ranks = {}
    for pid in children.stdout.split():
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[next(v for v in env if v.startswith(b"RANK="))] = int(pid)
    t0 = time.monotonic()
    os.kill(ranks[signalled], signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - t0
    assert "stopped by SIGTERM after step" in err, err[-3000:]
    # torchrun reports the clean stop as a failure: its exit code 1, the ranks' 143 in its
    # ChildFailedError report (docs/guides/resume-and-failures.md#exit-codes says so).
    assert proc.returncode == 1 and "ChildFailedError" in err, (proc.returncode, err[-3000:])
    relayed = "SIGTERM reached a generator rank: the trainers finish this step" in err
    assert relayed == (generators and signalled == b"RANK=1"), err[-3000:]
    # A trainer names torchrun's grace period (a generator's own stderr says nothing)
    graced = "torchrun kills the ranks 30 s after it passes a signal on" in err
    assert graced == (not relayed), err[-3000:]
    # One process would refuse this job's dist.rollout_ranks: the hint is the launch again.
    hint = f"Resume with: torchrun --nproc-per-node 2 -m dapo train --resume {tmp_path / 'stopped'}"
    assert hint in err, err[-3000:]
    assert "of 2 failed" not in err, err[-3000:]  # the generator ended well; no rank failed
    assert "forcefully exiting" not in err, err[-3000:]  # torchrun's SIGKILL after 30 s
    assert seconds < 25, seconds


FAILING = ["sampling.on_max_rounds=error", "sampling.max_rounds=3", "train.steps=4"]
"""Dynamic sampling gives up on a step after the first checkpoints: step 3 (from 0: 2) at
k = 0, step 4 at k = 1, the same in one process and on a generator rank."""


def _failing_run(ranks: int, out: Path, name: str, *args: str) -> tuple[str, list, str]:
    """A run of ``FAILING`` ended by its draw's error: standard error, each checkpoint with
    the steps it holds drawn ahead, and the error's line. ``args`` name the model's cache."""
    args = (*TORCHRUN_DEMO, *FAILING, *args, f"run.name={name}")
    proc = dapo_train(ranks, *args, "dist.wait_timeout_s=300", out_dir=out, wait=False)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
        proc.kill()
        pytest.fail("the job was still running 120 s after it started")
    assert proc.returncode == 1, err[-3000:]
    saved = []
    for ckpt in sorted((out / name / "checkpoints").glob("step_*")):
        info = json.loads((ckpt / "trainer.json").read_text())
        saved.append((ckpt.name, [r["step"] for r in info.get("ahead", {}).get("rollouts", [])]))
    line = next(x for x in err.splitlines() if x.startswith("dapo: error: "))
    return err, saved, line


@pytest.mark.parametrize("k", [0, 1])
def test_a_failed_draw_on_a_generator_rank_ends_the_run_as_in_one_process(demo_cache, tmp_path, k):
    """Dynamic sampling giving up on a generator rank: the trainer saves the checkpoints of
    the steps before (with the steps drawn ahead up to the failed one), then stops on the
    same error and resume hint as the one-process run (drawing in turn at k = 0, a generator
    thread at k = 1), and the generator ends without an error of its own. The generator
    rank exited on the error, the trainer failed on gloo's "Connection closed by peer" and
    saved nothing after it (at k = 0 a step trained and logged was not saved)."""
    out, same = tmp_path, [f"train.async_staleness={k}", f"embedded.cache_dir={demo_cache}"]
    _, one_saved, one_line = _failing_run(0, out, "one", *same)
    err, saved, line = _failing_run(2, out, "ranks", *same, "dist.rollout_ranks=1")
    # Each save holds the steps drawn ahead of it (at k = 0 the generator rank's next step,
    # drawn as the trainer saves; drawn in turn, none), up to the failed one.
    if k == 0:  # step 3 failed
        assert saved == [("step_000001", [1]), ("step_000002", [])]
    else:  # step 4 failed
        assert saved == [("step_000001", [1, 2]), ("step_000002", [2]), ("step_000003", [])]
    assert [name for name, _ in one_saved] == [name for name, _ in saved]
    assert k == 0 or one_saved == saved  # the generator thread's, step for step
    kept, _, hint = line.partition(" The run directory is intact; ")
    assert kept.startswith("dapo: error: dynamic sampling kept ") and kept in one_line
    resume = f"torchrun --nproc-per-node 2 -m dapo train --resume {out / 'ranks'}"
    assert hint == (
        f"resume from its last checkpoint with a changed config: {resume} "
        "sampling.max_rounds=<more> --force"
    )
    assert "dapo: rank 0 of 2 failed:" in err and "rank 1 of 2 failed" not in err, err[-3000:]
    assert "Connection closed by peer" not in err, err[-3000:]
    assert "forcefully exiting" not in err, err[-3000:]  # torchrun's SIGKILL


def test_a_rank_leaving_at_once_removes_the_vllm_engines_directory(tmp_path):
    """os._exit runs no finalizer: the engine's directory (its config and LoRA adapters)
    stayed in /tmp, one per failed rank."""
    from dapo import cli
    from dapo.rollout import vllm_process

    engine_dir = tmp_path / "dapo-vllm-x"
    (engine_dir / "adapter-1").mkdir(parents=True)
    (engine_dir / "config.json").write_text("{}")
    vllm_process.TEMPORARY_DIRS.add(str(engine_dir))
    cli.before_exit()
    assert not engine_dir.exists() and str(engine_dir) not in vllm_process.TEMPORARY_DIRS
