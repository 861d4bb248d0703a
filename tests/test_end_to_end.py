"""A short real run through the command line: warm-up, rollouts, updates, evaluation, saving."""

import json
import logging
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo.cli import main
from dapo.run.metric_docs import metric_pattern

SMALL = [
    "embedded.sft_steps=30",
    "rollout.group_size=4",
    "train.steps=2",
    "train.prompts_per_step=4",
    "sampling.prompts_per_round=8",
    "sampling.on_max_rounds=train",
    "train.responses_per_minibatch=16",
    "train.tokens_per_microbatch=700",
    "arith.num_train=200",
    "arith.num_val=8",
    "eval.num_samples=2",
    "eval.every=1",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("preset", ["dapo", "grpo"])
def test_train_end_to_end(tmp_path, cache_dir, preset, capsys):
    args = [
        "train",
        "--preset",
        preset,
        f"embedded.cache_dir={cache_dir}",
        f"run.out_dir={tmp_path}",
        "run.name=r",
        *SMALL,
    ]
    assert main(args) == 0
    run = tmp_path / "r"
    out = capsys.readouterr().out
    assert "4 prompts/step x 4 responses/prompt = 16 responses/step" in out
    assert "held-out accuracy:" in out

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    for key in (
        "val/accuracy",
        "rollout/accuracy",
        "rollout/reward_mean",
        "train/entropy",
        "rollout/response_len_mean",
        "rollout/response_len_max",
        "clip/high_frac",
        "clip/low_frac",
        "train/token_prob_mean",
        "sampling/rounds",
        "sampling/prompts_drawn",
        "sampling/groups_kept",
        "sampling/tokens_generated",
        "perf/gen_tokens_per_s",
        "perf/step_s",
        "rollout/truncated_frac",
    ):
        assert key in lines[1] or key in lines[2], key
    assert 0.0 <= lines[2]["val/accuracy"] <= 1.0
    assert ("train/kl" in lines[1]) == (preset == "grpo")
    # Every name the run logged is documented (docs/reference/metrics.md is made from these).
    undocumented = {k for x in lines for k in x if k != "step" and metric_pattern(k) is None}
    assert not undocumented, f"add to dapo/run/metric_docs.py: {sorted(undocumented)}"
    assert lines[1]["sampling/groups_kept"] <= 4

    # TensorBoard has the same scalars under the same names.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tensorboard"))
    tb.Reload()
    assert {"val/accuracy", "rollout/accuracy", "train/entropy"} <= set(tb.Tags()["scalars"])
    assert [e.step for e in tb.Scalars("val/accuracy")] == [0, 1, 2]

    # A few responses of the final evaluation, for dapo report.
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {x["kind"] for x in samples} <= {"correct", "wrong", "reflective"}
    assert all(x["step"] == 2 and isinstance(x["response"], str) for x in samples)

    summary = json.loads((run / "summary.json").read_text())
    assert summary["val/accuracy_end"] == lines[2]["val/accuracy"]
    # Each held-out problem's accuracy at the end: their mean is val/accuracy.
    per_problem = json.loads((run / "val_problems.json").read_text())
    assert per_problem["step"] == 2 and len(per_problem["uid"]) == len(set(per_problem["uid"]))
    assert len(per_problem["accuracy"]) == lines[2]["val/num_problems"]
    mean = sum(per_problem["accuracy"]) / len(per_problem["accuracy"])
    assert mean == pytest.approx(summary["val/accuracy_end"], abs=1e-12)
    assert "preset: " + preset in (run / "config.yaml").read_text()

    trained = AutoModelForCausalLM.from_pretrained(run / "model")
    start = AutoModelForCausalLM.from_pretrained(next(cache_dir.glob("embedded-*")))
    changed = [
        not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters(), strict=True)
    ]
    assert sum(changed) > len(changed) // 2  # the RL updates reached most tensors


def test_refuses_to_overwrite_a_run(tmp_path, cache_dir, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("{}\n")
    code = main(
        ["train", f"run.out_dir={tmp_path}", "run.name=r", f"embedded.cache_dir={cache_dir}"]
    )
    assert code == 2
    assert "already holds a run" in capsys.readouterr().err


def test_config_error_exits_2_naming_the_field(capsys):
    assert main(["train", "optim.lr=-1"]) == 2
    assert "optim.lr must be > 0" in capsys.readouterr().err


class _Records(logging.Handler):
    """Every record transformers logs, whatever its handlers and their streams."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_no_deprecated_transformers_api_with_either_engine(tmp_path, cache_dir, engine, capfd):
    # transformers renamed past_key_values to cache (5.2x) and will remove the old name: a run
    # that warns today breaks at that upgrade. Every warning of the run is recorded.
    import warnings

    # transformers logs each deprecation once per process: forget what earlier tests logged.
    logging.Logger.warning_once.cache_clear()
    args = ["train", f"embedded.cache_dir={cache_dir}", f"run.out_dir={tmp_path}", "run.name=r"]
    args += [*SMALL, "train.steps=1", f"rollout.engine={engine}"]
    args += ["train.recompute_old_logprobs=true"] if engine == "hf" else []
    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(args) == 0
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not [m for m in records.messages if "deprecated" in m]
    deprecations = [
        str(w.message)
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
    ]
    assert deprecations == []
    # transformers' logger says "... are deprecated. Use ..." on the stderr it found at import.
    printed = capfd.readouterr()
    assert not re.search(r"(is|are) deprecated", printed.out + printed.err)


def test_a_pass_without_a_cache_asks_for_no_deprecated_name():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo.models.logprobs import returned_cache

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    decoder = Qwen2ForCausalLM(config).get_decoder()
    ids = torch.arange(5).unsqueeze(0)
    logger, records = logging.getLogger("transformers"), _Records()
    logging.Logger.warning_once.cache_clear()  # logged once per process: forget earlier tests
    logger.addHandler(records)
    try:
        assert returned_cache(decoder(input_ids=ids, use_cache=False)) is None
        assert returned_cache(decoder(input_ids=ids, use_cache=True)) is not None
    finally:
        logger.removeHandler(records)
    assert not [m for m in records.messages if "deprecated" in m]
