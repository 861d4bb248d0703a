"""float16 weights: AdamW's state underflows float16 (its eps, 1e-8, is 0 there), so one
update of float16 weights turns them to NaN. The config refuses model.param_dtype=float16
(LoRA's float32 adapters aside) and names the combination that trains; and whatever the
dtype, an update that leaves non-finite weights stops the run right after it, before the
rollout samples from them."""

import copy
import json
import os

import pytest
import torch
from helpers import setup_run

from dapo.config import config_warnings, load_config
from dapo.data.batch import Episode
from dapo.data.problems import Problem
from dapo.run import checkpoint
from dapo.training import loop, update
from dapo.training import state as trainer

FP16 = ["model.param_dtype=float16", "model.compute_dtype=float16"]
RECOMPUTE = "train.recompute_old_logprobs=true"


def test_float16_weights_are_refused_naming_the_field_and_the_fix():
    with pytest.raises(ValueError) as err:
        load_config(None, [*FP16, RECOMPUTE])
    assert str(err.value) == (
        "invalid config:\n  model.param_dtype=float16: AdamW would step float16 weights, "
        "whose state underflows (its eps, 1e-8, is 0 in float16), so the first update turns "
        "the weights to NaN or inf; set model.param_dtype=float32 model.compute_dtype=float16 "
        "(float16 compute on float32 weights, with a loss scaler)"
    )
    # With float32 compute: the one refusal, not a second line saying compute in float16.
    with pytest.raises(ValueError) as err:
        load_config(None, ["model.param_dtype=float16", RECOMPUTE])
    assert str(err.value).startswith("invalid config:\n  model.param_dtype=float16: AdamW")
    assert str(err.value).count("\n") == 1
    assert "set model.compute_dtype=float16" not in str(err.value)


def test_the_fix_lora_over_float16_and_bfloat16_weights_are_accepted():
    fixed = load_config(None, ["model.compute_dtype=float16", RECOMPUTE])
    assert (fixed.model.param_dtype, fixed.model.compute_dtype) == ("float32", "float16")
    assert config_warnings(fixed) == []
    lora = load_config(None, [*FP16, RECOMPUTE, "model.lora.rank=4"])  # float32 adapters
    assert config_warnings(lora) == []
    bf16 = load_config(
        None, ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16", RECOMPUTE]
    )
    (warning,) = config_warnings(bf16)
    assert warning.startswith("model.param_dtype=bfloat16: AdamW steps bfloat16 weights")
    # The mismatch of a narrow weight dtype and another compute dtype is still refused.
    with pytest.raises(ValueError, match="set model.compute_dtype=bfloat16"):
        load_config(None, ["model.param_dtype=bfloat16", "model.compute_dtype=float16", RECOMPUTE])


def _episodes(n: int) -> list[Episode]:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        out.append(
            Episode(
                prompt_ids=torch.randint(5, 60, (4,), generator=g),
                response_ids=torch.randint(5, 60, (3 + i,), generator=g),
                sampler_logprobs=-torch.rand(3 + i, generator=g),
                truncated=False,
                correct=i % 2 == 0,
                reward=1.0,
                advantage=(-1.0) ** i,
            )
        )
    return out


def _state(model, tokenizer, *overrides):
    cfg = load_config(None, ["train.responses_per_minibatch=2", RECOMPUTE, *overrides])
    state = trainer.build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    state.sampler_logprobs_checked = True  # made-up sampler log-probs: skip the check
    return state


def _count_training_forwards(model) -> dict[str, int]:
    calls = {"n": 0}

    def hook(module, _args, _output):
        calls["n"] += torch.is_grad_enabled()  # the update's passes (in eval mode too)

    model.get_decoder().register_forward_hook(hook)  # the head may be chunked, not the model
    return calls


def test_float16_compute_on_float32_weights_trains(tiny_model, tokenizer):
    before = copy.deepcopy(tiny_model)
    state = _state(tiny_model, tokenizer, "model.compute_dtype=float16")
    assert state.scaler is not None  # the loss scaler the refusal's fix relies on
    out = update.update(state, _episodes(4), lr=1e-3)
    assert out["train/updates"] + out["train/scaler_overflows"] == 2.0
    assert out["train/updates"] >= 1.0
    params = dict(tiny_model.named_parameters())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params.values())
    changed = [n for n, p in before.named_parameters() if not torch.equal(p, params[n])]
    assert len(changed) == len(params)


FP16_FIX = (
    "AdamW's state in model.param_dtype=float16 underflows; set model.param_dtype=float32 "
    "model.compute_dtype=float16 (float32 weights and state, float16 compute with a loss scaler)."
)


def _float16_state(model, tokenizer, *overrides):
    """A state over float16 weights, as model.param_dtype=float16 made one before it was
    refused: the config's dtypes set past its checks."""
    state = _state(model.half(), tokenizer, *overrides)
    state.cfg.model.param_dtype = state.cfg.model.compute_dtype = "float16"
    return state


def test_an_update_that_breaks_float16_weights_stops_the_step(tiny_model, tokenizer):
    state = _float16_state(tiny_model, tokenizer)
    calls = _count_training_forwards(tiny_model)
    with pytest.raises(update.NonFiniteError) as err:
        update.update(state, _episodes(4), lr=1e-5)
    assert str(err.value) == (
        "step 1: an optimizer update left weights that are NaN or inf (its loss and gradient "
        "norm were finite), so training stopped before generating from them. The failed "
        f"update was not saved. {FP16_FIX}"
    )
    # The first mini-batch's update broke the weights; the second's loss was NaN (skipped).
    assert calls["n"] == 2 and state.consecutive_skips == 1
    assert not update.trained_weights_finite(state.optimizer)


def test_the_skip_limit_names_broken_weights_as_the_cause(tiny_model, tokenizer):
    state = _float16_state(tiny_model, tokenizer, "train.max_consecutive_skips=1")
    with pytest.raises(update.NonFiniteError) as err:
        update.update(state, _episodes(4), lr=1e-5)
    msg = str(err.value)
    assert msg.startswith("step 1: an optimizer update left weights that are NaN or inf")
    assert msg.endswith(FP16_FIX) and "updates in a row" not in msg


def test_an_update_that_breaks_float32_weights_stops_too(tiny_model, tokenizer):
    state = _state(tiny_model, tokenizer)
    with pytest.raises(update.NonFiniteError) as err:
        update.update(state, _episodes(2), lr=float("inf"))  # a step of infinite size
    assert str(err.value).endswith(
        "Try a lower optim.lr or optim.grad_clip > 0, and check the data and the model."
    )
    assert update.trained_weights_finite(state.optimizer) is False


def test_finite_weights_pass_the_check_and_an_empty_shard_is_skipped(tiny_model):
    opt = torch.optim.AdamW([*tiny_model.parameters(), torch.nn.Parameter(torch.empty(0))])
    assert update.trained_weights_finite(opt) is True
    with torch.no_grad():
        tiny_model.lm_head.weight[3, 1] = float("-inf")
    assert update.trained_weights_finite(opt) is False
    with torch.no_grad():
        tiny_model.lm_head.weight[3, 1] = float("nan")
    assert update.trained_weights_finite(opt) is False


def test_a_run_whose_update_breaks_the_weights_stops_at_that_step(tmp_path, tiny_model, tokenizer):
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, RECOMPUTE)
    cfg.model.param_dtype = cfg.model.compute_dtype = "float16"  # past the config's refusal
    with pytest.raises(update.NonFiniteError) as err:
        loop.fit(
            cfg,
            tiny_model.half(),
            tokenizer,
            train,
            val,
            run_dir=run_dir,
            stream=open(os.devnull, "w"),
        )
    msg = str(err.value)
    assert msg.startswith("step 1: an optimizer update left weights that are NaN or inf")
    # Stopped in step 1's update: no checkpoint of the broken weights, the log ends at step 0,
    # so there is nothing to resume (it once printed a resume command that found none).
    assert msg.endswith("start it again with the same command, optim.lr=<lower> and --overwrite")
    assert checkpoint.find_latest(run_dir) is None
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0]


def test_one_adamw_step_turns_float16_weights_with_small_gradients_to_nan():
    """What the refusal (and docs/guides/precision-and-memory.md) says: a 1e-5 gradient's
    second moment and AdamW's eps of 1e-8 are both 0 in float16."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000, generator=g).half())
    p.grad = (torch.randn(1000, generator=g) * 1e-5).half()
    torch.optim.AdamW([p], lr=1e-6, weight_decay=0.0).step()
    assert int((~torch.isfinite(p)).sum()) == 1000
