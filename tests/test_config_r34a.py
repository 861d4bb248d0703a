"""Review r34a (configuration and command lines): settings that passed every check and then
failed mid-run, after the run directory was made, and command-line values read otherwise
than the same values in a config file."""

from __future__ import annotations

import pytest

from dapo import dist
from dapo.api.eval_inputs import EvalRequest, check_sampling
from dapo.cli import main
from dapo.config import load_config


def refused(*overrides: str) -> list[str]:
    with pytest.raises(ValueError) as caught:
        load_config(None, list(overrides))
    return str(caught.value).splitlines()


def test_a_demo_hidden_size_that_is_no_multiple_of_8_is_refused():
    # 12: heads of size 3, which the rotary embedding cannot halve (a traceback mid-warm-up).
    for hidden in (4, 12, 20):
        assert refused(f"embedded.hidden={hidden}") == [
            "invalid config:",
            f"  embedded.hidden must be a multiple of 8 (>= 8), got {hidden}",
        ]
    assert load_config(None, ["embedded.hidden=8"]).embedded.hidden == 8


def test_values_past_what_the_run_can_use_are_refused_at_once():
    errors = refused(
        "train.seed=18446744073709551616",
        "reward.timeout_s=1e300",
        "reward.batch_timeout_s=1e300",
        "reward.memory_mb=99999999999999999999",
        "rollout.temperature=1e-300",
        "eval.temperature=1e-6",
    )
    assert errors == [
        "invalid config:",
        "  rollout.temperature must be a finite number >= 1e-05, got 1e-300",
        "  train.seed must be an integer in [0, 2**63), got 18446744073709551616",
        "  eval.temperature must be a finite number >= 1e-05, got 1e-06",
        "  reward.timeout_s must be in (0, 86400.0] seconds",
        "  reward.memory_mb must be in [0, 16777216] (0 = no limit)",
        "  reward.batch_timeout_s must be in [0, 86400.0] seconds (0 = no limit)",
    ]
    assert refused("train.seed=-1")[1] == "  train.seed must be an integer in [0, 2**63), got -1"
    cfg = load_config(None, ["train.seed=9223372036854775807", "rollout.temperature=1e-5"])
    assert (cfg.train.seed, cfg.rollout.temperature) == (2**63 - 1, 1e-5)
    with pytest.raises(ValueError, match=r"^--temperature must be a finite number >= 1e-05, got"):
        check_sampling(EvalRequest(model="m", data="d", temperature=1e-300))


def test_dapo_ablate_checks_the_run_before_it_makes_its_directory(tmp_path, capsys):
    out = tmp_path / "ab"
    cmd = ["ablate", "--plan", "eps-high", "--out", str(out), "--seeds", "1"]
    code = main([*cmd, "--budget", "steps=1", "model.device=cuda"])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err == (
        "dapo: error: model.device=cuda but no CUDA device is visible; use model.device=cpu\n"
    )


def test_a_number_past_pythons_digit_limit_is_text_where_text_is_wanted():
    digits = "9" * 5000
    assert load_config(None, [f"data.system_prompt={digits}"]).data.system_prompt == digits
    (error,) = refused(f"train.steps={digits}")
    assert error.startswith("train.steps: expected int, got '99999")


def test_lists_and_mappings_on_the_command_line_read_numbers_as_a_file_does():
    assert refused("rollout.stop_token_ids=[010, 0x10]") == [
        "rollout.stop_token_ids[0]: YAML reads 010 as octal, 8: write the number in decimal"
    ]
    assert refused("model.lora={rank: 010}") == [
        "model.lora.rank: YAML reads 010 as octal, 8: write the number in decimal"
    ]
    assert refused("model.lora={rank: 8, rank: 4}") == [
        "model.lora.rank is written twice in '{rank: 8, rank: 4}'; write it once"
    ]
    cfg = load_config(
        None,
        ["rollout.stop_token_ids=[10, 16]", "model.lora.target_modules=[q_proj, 010]"],
    )
    assert cfg.rollout.stop_token_ids == [10, 16]
    assert cfg.model.lora.target_modules == ["q_proj", "010"]
    assert load_config(None, ["model.lora={rank: 8, alpha: 1e1}"]).model.lora.rank == 8


def test_the_ranks_a_dry_run_plans_for_are_a_count(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (dist.planned_ranks(None), dist.planned_ranks(4)) == (1, 4)
    for bad in (-3, 0):
        with pytest.raises(ValueError, match=f"^--world-size is '{bad}': the ranks to plan"):
            dist.planned_ranks(bad)
    for bad in ("0", "abc", ""):
        monkeypatch.setenv("WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=f"^the environment's WORLD_SIZE is '{bad}': "):
            dist.planned_ranks(None)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert dist.planned_ranks(None) == 8
