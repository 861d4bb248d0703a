"""TensorBoard event files hold every metric of metrics.jsonl, under the same names, and a resume
hides what the crashed run logged after its checkpoint, as metrics.jsonl does."""

import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dapo.run.metrics import MetricsLogger


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_every_metric_becomes_a_scalar_with_the_same_name(tmp_path):
    log = MetricsLogger(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tb")
    log.log(0, {"val/accuracy": 0.25})
    log.log(1, {"rollout/accuracy": 0.5, "sampling/rounds": 2.0, "train/loss": float("nan")})
    log.log(2, {"rollout/accuracy": 0.75, "sampling/rounds": 1.0, "train/loss": -0.125})
    log.close()
    scalars = _scalars(tmp_path / "tb")
    assert scalars["val/accuracy"] == [(0, 0.25)]
    assert scalars["rollout/accuracy"] == [(1, 0.5), (2, 0.75)]
    assert scalars["sampling/rounds"] == [(1, 2.0), (2, 1.0)]
    assert scalars["train/loss"] == [(2, -0.125)]  # NaN is null in the JSON and absent here


def test_a_resume_purges_steps_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tb")
    for step in range(1, 5):
        log.log(step, {"rollout/accuracy": step / 10})
    log.close()
    # The run resumes from a checkpoint of step 2: steps 3 and 4 are done again. A resume is
    # a later process: TensorBoard reads event files in name order, and a name is whole
    # seconds, host, pid and a count per process, which in one process and one second sorts
    # ...pid.10 before ...pid.9 (seen under pytest-xdist, whose workers run many tests).
    time.sleep(1.0)
    log = MetricsLogger(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tb")
    log.purge_step = 3
    for step in (3, 4):
        log.log(step, {"rollout/accuracy": 1.0 + step / 10})
    log.close()
    values = _scalars(tmp_path / "tb")["rollout/accuracy"]
    assert [s for s, _ in values] == [1, 2, 3, 4]
    assert [round(v, 6) for _, v in values] == [0.1, 0.2, 1.3, 1.4]
