import subprocess
import sys
from pathlib import Path

import pytest

import dapo
from dapo.config import (
    MOVED_KEYS,
    AlgoConfig,
    Config,
    ModelConfig,
    RolloutConfig,
    apply_overrides,
    choices,
    load_config,
    parse_override,
    presets,
)


def test_defaults_are_the_papers():
    cfg = presets.paper(Config())
    assert cfg.to_dict() == Config().to_dict()  # the paper base is the dataclass defaults
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (0.2, 0.28)
    assert cfg.algo.loss_agg == "token-mean"
    assert cfg.algo.kl_coef == 0.0
    assert (cfg.rollout.max_new_tokens, cfg.algo.l_cache) == (20480, 4096)
    assert cfg.rollout.group_size == 16
    assert cfg.train.prompts_per_step == 512
    assert cfg.train.responses_per_minibatch == 512
    assert cfg.optim.lr == 1e-6 and cfg.optim.warmup_steps == 20
    assert (cfg.eval.num_samples, cfg.eval.temperature, cfg.eval.top_p) == (32, 1.0, 0.7)
    # 512 prompts x 16 responses in mini-batches of 512 responses: 16 updates per step.
    assert cfg.responses_per_step == 8192
    assert cfg.updates_per_step == 16


def test_grpo_preset_is_the_naive_baseline():
    cfg = presets.grpo(Config())
    assert cfg.algo.eps_high == cfg.algo.eps_low == 0.2
    assert cfg.algo.loss_agg == "seq-mean-token-mean"
    assert cfg.algo.kl_coef > 0
    assert not cfg.algo.overlong_shaping and not cfg.algo.overlong_filter
    assert not cfg.sampling.dynamic
    presets.dapo(cfg)
    assert cfg.algo.eps_high == 0.28 and cfg.sampling.dynamic and cfg.algo.kl_coef == 0


def test_no_arguments_gives_the_demo():
    cfg = load_config()
    assert cfg.run.base == "demo" and cfg.run.preset == "dapo"
    assert cfg.model.path == "embedded"
    assert cfg.to_dict() == presets.demo(Config()).to_dict()


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("base: demo\npreset: grpo\noptim:\n  lr: 3.0e-4\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["optim.lr=1e-5", "algo.overlong_filter=true", "run.name=x"])
    assert cfg.run.preset == "grpo" and cfg.run.base == "demo"
    assert cfg.optim.lr == 1e-5  # command line beats the file
    assert cfg.train.steps == 7
    assert cfg.algo.overlong_filter is True
    assert cfg.run.name == "x"


def test_yaml_file_starts_from_paper_by_default(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 3\n")
    cfg = load_config(path)
    assert cfg.run.base == "paper" and cfg.train.prompts_per_step == 512


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; optim has"),
        ("optimizer.lr=1", "sections are"),
        (
            "optim.lrr=1",
            "optim has beta1, beta2, grad_clip, lr, warmup_steps, weight_decay. Did "
            "you mean optim.lr?",
        ),
        ("trian.steps=3", "arith, code. Did you mean train?"),
        (
            "model.lora.rnak=8",
            "model.lora has alpha, dropout, merged_sampling, rank, target_modules. Did you "
            "mean model.lora.rank?",
        ),
        ("optim.lr=fast", "optim.lr: expected float"),
        ("train.steps=1.5", "train.steps: expected int"),
        ("algo.dynamic=true", "unknown config key 'algo.dynamic'"),
        ("algo.eps_high=0.1", "algo.eps_high must be >= algo.eps_low"),
        (
            "algo.loss_agg=mean",
            "algo.loss_agg must be one of ('token-mean', 'seq-mean-token-mean', "
            "'seq-mean-token-sum-norm')",
        ),
        ("sampling.on_max_rounds=skip", "sampling.on_max_rounds must be one of ('error', 'train')"),
        ("rollout.group_size=1", "rollout.group_size must be >= 2"),
        ("algo.l_cache=100", "algo.l_cache must be in (0, rollout.max_new_tokens=28]"),
        ("noequals", "is not of the form section.field=value"),
        ("run.preset=ppo", "unknown preset 'ppo'"),
        ("embedded.sft_steps=0", "embedded.sft_steps must be >= 1"),
        ("embedded.hidden=30", "embedded.hidden must be a multiple of 8 (>= 8), got 30"),
        ("arith.solution=essay", "arith.solution must be one of ('direct', 'steps', 'mixed')"),
        ("data.task=gsm8k", "data.task must be 'arith'"),
        ("arith.num_val=0", "arith.num_train and arith.num_val must be >= 1"),
        # A key of an earlier release is read at its new place, so its errors name that place.
        ("model.sft_steps=0", "embedded.sft_steps must be >= 1"),
        ("model.dtype=float64", "model.compute_dtype must be one of ('float32', 'bfloat16', "),
        ("model.param_dtype=fp8", "model.param_dtype must be one of ('float32', 'bfloat16', "),
        (
            "model.param_dtype=bfloat16",  # autocast cannot compute wider than the weights
            "model.compute_dtype=float32 with model.param_dtype=bfloat16",
        ),
        ("reward.mode=sympy", "reward.mode must be empty (by data_source) or one of"),
        ("rollout.engine=sglang", "rollout.engine must be one of ('dapo', 'hf', 'vllm')"),
        ("algo.rollout_correction=tis", "algo.rollout_correction must be one of ('auto', 'none'"),
        ("algo.rollout_correction_threshold=1", "algo.rollout_correction_threshold must be > 1"),
        ("vllm.gpu_memory_utilization=0", "vllm.gpu_memory_utilization must be in (0, 1]"),
        ("algo.clip_ratio_c=0.5", "algo.clip_ratio_c must be 0 (off) or > 1, got 0.5"),
        ("optim.beta2=1", "optim.beta1 and optim.beta2 must be in [0, 1)"),
        ("rollout.temperature=.inf", "rollout.temperature must be a finite number >= 1e-05"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_config(path)
    path.write_text("lr: 1e-5\n")
    with pytest.raises(ValueError, match="top-level key 'lr' must be a section"):
        load_config(path)
    with pytest.raises(ValueError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_override_values_are_typed():
    assert parse_override("optim.lr=1e-5") == ("optim.lr", 1e-5)
    assert parse_override("train.steps=3") == ("train.steps", 3)
    assert parse_override("algo.overlong_filter=false") == ("algo.overlong_filter", False)
    assert parse_override("run.name=my-run") == ("run.name", "my-run")
    cfg = load_config(None, ["optim.lr=1"])  # an int is a fine float
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 1.0
    assert isinstance(Config().optim.lr, float)


def test_a_text_field_keeps_the_text_written(tmp_path):
    # YAML reads 0612 as an octal 394, 12:30 as 750, 2e91830 as infinity and 1.10 as 1.1: a
    # run named 0612 ran in runs/394, and a pinned revision became "inf".
    for text in ("0612", "12:30", "1.10", "1e3", "true", "2026-11-29"):
        assert load_config(None, [f"run.name={text}"]).run.name == text
    assert load_config(None, ["model.revision=2e91830"]).model.revision == "2e91830"
    assert dapo.load_config(None, {"run.name": "1.10"}).run.name == "1.10"  # the API's mapping
    assert load_config(None, ["run.name='0612'"]).run.name == "0612"  # quoted: YAML's string
    assert load_config(None, ["optim.lr=1e-5"]).optim.lr == 1e-5
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1e-6\n")  # YAML 1.1's string: a float field's number
    assert load_config(path).optim.lr == 1e-6


def test_text_after_a_hash_a_dash_or_a_colon_is_kept_and_integers_are_decimal():
    # YAML cut "You are helpful. #1 rule" at the comment, read "# Instructions" as null, "-"
    # (subtraction only) as a list and "Format: x" as a mapping; 010 was an octal 8, 1:30 90.
    prompts = ("You are helpful. #1 rule: be brief", "# Instructions", "Format: end with it")
    for text in prompts:
        assert load_config(None, [f"data.system_prompt={text}"]).data.system_prompt == text
    assert load_config(None, ["model.path=/ckpt/run #3/model"]).model.path == "/ckpt/run #3/model"
    assert load_config(None, ["arith.operators=-"]).arith.operators == "-"
    assert load_config(None, ["data.system_prompt=null"]).data.system_prompt is None
    assert load_config(None, ["data.system_prompt='a # b'"]).data.system_prompt == "a # b"
    assert load_config(None, ["train.steps=010"]).train.steps == 10
    assert load_config(None, ["train.steps=1_000"]).train.steps == 1000
    for text in ("1:30", "0x10"):
        with pytest.raises(ValueError, match=f"train.steps: write a decimal integer, got '{text}'"):
            load_config(None, [f"train.steps={text}"])
    # Floats too: max_seconds=1:30 (meant as 1 h 30) was 90 s, 010 an octal 8, 0x10 was 16.
    assert load_config(None, ["reward.timeout_s=010"]).reward.timeout_s == 10.0
    assert load_config(None, ["optim.lr='3e-4'", "train.max_seconds=1_000"]).optim.lr == 3e-4
    for text in ("1:30", "0x10"):
        with pytest.raises(ValueError, match=f"max_seconds: write a decimal number, got '{text}'"):
            load_config(None, [f"train.max_seconds={text}"])


def test_a_number_that_is_not_finite_is_refused_wherever_it_comes_from(tmp_path):
    # NaN passed every "x < 0" check and then made the loss NaN (eps_high=nan: the policy
    # loss of a test batch was nan where 0.28 gives 0.1844).
    with pytest.raises(ValueError) as err:
        load_config(None, ["algo.eps_high=nan", "optim.lr=inf", "model.lora.alpha=-inf"])
    for line in ("algo.eps_high must be a finite number, got nan",
                 "optim.lr must be a finite number, got inf",
                 "model.lora.alpha must be a finite number, got -inf"):  # fmt: skip
        assert line in str(err.value)
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  kl_coef: .nan\n")
    with pytest.raises(ValueError, match="algo.kl_coef must be a finite number, got nan"):
        load_config(path)
    cfg = load_config(None, [])
    cfg.optim.weight_decay = float("nan")  # set in code, then validated
    with pytest.raises(ValueError, match="optim.weight_decay must be a finite number"):
        dapo.config.validate(cfg)
    with pytest.raises(ValueError, match="algo.adv_eps must be >= 0, got -1.0"):
        load_config(None, ["algo.adv_eps=-1"])


def test_rounds_that_can_never_keep_n_groups_are_refused():
    # Each round keeps at most one group per prompt: 2 rounds of 10 can never keep 32, and
    # with on_max_rounds=error every step stopped, after generating its rounds.
    rounds = ["train.prompts_per_step=32", "sampling.oversample=false", "sampling.max_rounds=2"]
    with pytest.raises(ValueError, match="keep at most 20 groups, fewer than train.prompts_per"):
        load_config(None, [*rounds, "sampling.prompts_per_round=10"])
    load_config(None, [*rounds, "sampling.prompts_per_round=16"])  # 32: enough when all mix
    load_config(None, [*rounds, "sampling.prompts_per_round=10", "sampling.on_max_rounds=train"])
    load_config(None, [*rounds, "sampling.prompts_per_round=10", "sampling.max_rounds=0"])


def test_every_bad_value_is_reported_at_once_wrong_types_included(tmp_path):
    """The help promises every bad value at once: a wrong type stopped at the first one."""
    overrides = ["optim.lr=abc", "train.steps=x", "sampling.max_rounds=-1"]
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    assert str(err.value) == (
        "invalid config:\n  optim.lr: expected float, got 'abc' (str)\n  train.steps: "
        "expected int, got 'x' (str)\n  sampling.max_rounds must be >= 0 (0 = unbounded)"
    )
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: fast\n")
    with pytest.raises(ValueError, match="optim.lr: expected float, got 'fast'.*\n  train.steps"):
        load_config(path, ["train.steps=x"])
    with pytest.raises(ValueError, match="^optim.lr: expected float, got 'abc' \\(str\\)$"):
        apply_overrides(load_config(None, []), ["optim.lr=abc"])  # one alone: its own words
    # A check naming a field left unset judged its default (eps_high 0.28 < 0.3): left out.
    with pytest.raises(ValueError, match="^algo.eps_high: expected float, got 'x' \\(str\\)$"):
        load_config(None, ["algo.eps_high=x", "algo.eps_low=0.3"])


def test_the_plan_counts_the_whole_groups_a_call_of_rows_per_generate_holds():
    """A group's responses are generated together: 4 rows a call with G = 8 held 8, twice
    what the memory plan counted (such a value is one group a call, as runs made with it
    resume)."""
    from dapo.training.gpu_memory import rows_per_rank

    for limit, rows in ((4, 8), (8, 8), (12, 8), (20, 16), (0, 8 * 16)):
        cfg = load_config(None, ["rollout.group_size=8", f"rollout.rows_per_generate={limit}"])
        cfg.train.prompts_per_step = 16
        cfg.sampling.dynamic = False
        assert rows_per_rank(cfg, world_size=1) == rows, limit


def test_preset_comes_from_the_most_specific_source(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: grpo\nbase: demo\n")
    # an override beats the file, and the preset's fields follow the name
    cfg = load_config(path, ["run.preset=dapo"])
    assert cfg.run.preset == "dapo" and cfg.algo.loss_agg == "token-mean"
    # the flag beats both, and a flag beside a file that names a preset is no error
    cfg = load_config(path, ["run.preset=dapo"], preset="grpo", base="demo")
    assert cfg.run.preset == "grpo" and cfg.algo.kl_coef > 0 and not cfg.sampling.dynamic
    # the run section of a file works like the top-level key
    path.write_text("run:\n  preset: grpo\n  base: demo\n  name: x\n")
    cfg = load_config(path)
    assert cfg.run.preset == "grpo" and cfg.algo.loss_agg == "seq-mean-token-mean"
    assert cfg.run.base == "demo" and cfg.run.name == "x"


# ----------------------------------------------------------------------------- moved keys

ROOT = Path(__file__).resolve().parents[1]
OLD_CONFIG = Path(__file__).parent / "data" / "config-0.1-demo.yaml"
"""A run's config.yaml as dapo 0.1 saved it: arith and embedded-model fields in data/model."""


def test_a_config_saved_by_the_previous_release_loads_to_the_same_run():
    cfg = load_config(OLD_CONFIG)
    expected = load_config(
        None, ["run.threads=1", "train.steps=20", "run.name=demo20", "run.progress=plain"]
    )
    assert cfg.to_dict() == expected.to_dict()
    assert (cfg.embedded.sft_steps, cfg.embedded.hidden, cfg.arith.max_terms) == (200, 128, 5)


def test_moved_keys_are_noticed_in_one_line_once_per_process():
    code = f"from dapo.config import load_config; load_config({str(OLD_CONFIG)!r}); " * 2
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("dapo: notice: config keys read at their new place: ")
    assert "data.num_train -> arith.num_train" in done.stderr
    assert "model.embedded_hidden -> embedded.hidden" in done.stderr


def test_old_keys_work_on_the_command_line_too():
    cfg = load_config(None, ["data.max_terms=3", "model.sft_steps=7"])
    assert cfg.arith.max_terms == 3 and cfg.embedded.sft_steps == 7
    # The names an early issue gave the logging switches (they are the run section's).
    cfg = load_config(None, ["logging.tensorboard=false", "logging.wandb_project=p"])
    assert (cfg.run.tensorboard, cfg.run.wandb_project) == (False, "p")
    assert load_config(None, ["logging.wandb=true"]).run.wandb is True
    assert set(MOVED_KEYS.values()) <= {
        f"{section}.{name}" for section, fields in Config().to_dict().items() for name in fields
    }


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    cfg = load_config(recipe)
    assert cfg.run.preset == "dapo" and cfg.algo.eps_high == 0.28
    # The GPU recipes keep the paper's G; the CPU ones trade it for minutes.
    cpu_g8 = "smollm2" in recipe.name or "tools" in recipe.name
    assert cfg.rollout.group_size == (16 if cfg.run.base == "paper" else 8 if cpu_g8 else 16)


def test_the_config_loads_without_torch():
    code = (
        "import sys; from dapo.config import load_config; load_config(None, ['optim.lr=1e-5']); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_every_choice_is_declared_once_on_its_field():
    from dapo import algo
    from dapo.models.policy import DTYPES
    from dapo.rollout import ENGINES

    assert choices(AlgoConfig, "loss_agg") == algo.AGG_MODES
    assert choices(AlgoConfig, "rollout_correction") == ("auto", *algo.CORRECTION_MODES)
    assert choices(AlgoConfig, "adv_norm") == algo.ADV_NORMS
    assert choices(AlgoConfig, "ratio_level") == algo.RATIO_LEVELS
    assert choices(AlgoConfig, "loss_fn") == algo.LOSS_FNS
    assert choices(RolloutConfig, "engine") == tuple(ENGINES)
    assert choices(ModelConfig, "param_dtype") == tuple(DTYPES)
    assert choices(ModelConfig, "compute_dtype") == tuple(DTYPES)


def test_a_run_saved_by_the_previous_release_is_recognised(tmp_path):
    from dapo.config import dump_yaml, saved_before_keys_moved

    assert saved_before_keys_moved(OLD_CONFIG)
    new = tmp_path / "config.yaml"
    new.write_text(dump_yaml(load_config(OLD_CONFIG)))
    assert not saved_before_keys_moved(new)


@pytest.mark.parametrize(
    ("preset", "fields"),
    [
        (
            "dapo",
            dict(adv_norm="group", ratio_level="token", loss_fn="clip", loss_agg="token-mean"),
        ),
        ("dr_grpo", dict(adv_norm="none", loss_agg="seq-mean-token-sum-norm", eps_high=0.28)),
        (
            "gspo",
            dict(
                ratio_level="sequence", eps_low=3e-4, eps_high=4e-4, loss_agg="seq-mean-token-mean"
            ),
        ),
        ("cispo", dict(loss_fn="cispo", eps_low=1.0, eps_high=0.28, loss_agg="token-mean")),
    ],
)
def test_successor_presets_are_dapo_with_their_one_change(preset, fields):
    cfg = load_config(None, [f"run.preset={preset}"])
    assert {k: getattr(cfg.algo, k) for k in fields} == fields
    assert cfg.sampling.dynamic and cfg.algo.overlong_shaping and cfg.algo.kl_coef == 0
    assert cfg.run.preset == preset


def test_cispo_allows_eps_low_above_eps_high_but_not_dual_clip():
    load_config(None, ["run.preset=cispo"])
    with pytest.raises(ValueError, match="algo.eps_high must be >= algo.eps_low"):
        load_config(None, ["algo.eps_low=0.5", "algo.eps_high=0.3"])
    with pytest.raises(ValueError, match="does not apply to algo.loss_fn=cispo"):
        load_config(None, ["run.preset=cispo", "algo.clip_ratio_c=3"])


def test_every_config_field_is_described_with_its_docstring_and_presets():
    from dapo.config.describe import describe, field_docs, type_name

    fields = describe()
    assert len({f.key for f in fields}) == len(fields) >= 100
    assert [f.key for f in fields if not f.doc] == []  # the reference page shows each one
    by_key = {f.key: f for f in fields}
    eps_high = by_key["algo.eps_high"]
    assert (eps_high.type, eps_high.default) == ("float", 0.28)
    assert eps_high.doc == field_docs(AlgoConfig)["eps_high"]
    # The value each preset gives it where that differs from the paper's default.
    assert eps_high.presets == {"grpo": 0.2, "gspo": 4e-4}
    assert by_key["rollout.max_new_tokens"].presets == {"demo": 28}
    assert by_key["algo.kl_coef"].presets == {"grpo": 0.001}
    assert by_key["rollout.engine"].type == '"dapo" | "hf" | "vllm"'
    assert type_name(list[int]) == "list[int]" and type_name(str | None) == "str | None"


def test_overrides_of_a_given_config_follow_renamed_keys_and_leave_it_unchanged():
    from dapo.config import apply_overrides

    cfg = load_config(None, [])
    changed = apply_overrides(cfg, ["data.num_val=9", "optim.lr=2e-6"])  # data.num_val: moved
    assert (changed.arith.num_val, changed.optim.lr) == (9, 2e-6)
    assert (cfg.arith.num_val, cfg.optim.lr) == (load_config(None, []).arith.num_val, 3e-4)
    with pytest.raises(ValueError, match="optim.lr must be > 0"):
        apply_overrides(cfg, ["optim.lr=-1"])


def test_a_preset_asked_for_over_a_recipe_sets_its_switches_over_the_files():
    """The 1.5B recipe writes eps_high 0.28: under run.preset=grpo (dapo ablate's naive GRPO
    row) it stayed, so the GRPO row had Clip-Higher and "+ clip-higher" changed nothing."""
    recipe = ROOT / "recipes" / "dapo-qwen2.5-math-1.5b.yaml"
    grpo = load_config(recipe, ["run.preset=grpo"])
    assert (grpo.algo.eps_low, grpo.algo.eps_high, grpo.algo.kl_coef) == (0.2, 0.2, 0.001)
    assert (grpo.algo.loss_agg, grpo.sampling.dynamic) == ("seq-mean-token-mean", False)
    # The file's other fields stay, and the command line's overrides still win, in any order.
    assert (grpo.algo.clip_ratio_c, grpo.algo.l_cache, grpo.optim.lr) == (10.0, 512, 1e-6)
    assert load_config(recipe, ["algo.eps_high=0.3", "run.preset=grpo"]).algo.eps_high == 0.3
    assert load_config(recipe, preset="gspo").algo.eps_high == 4e-4
    # The file's own preset, asked for again, leaves the file's fields as written.
    assert load_config(recipe, ["run.preset=dapo"]) == load_config(recipe)


@pytest.mark.parametrize("before", ["cispo", "gspo", "dr_grpo"])
def test_grpo_over_a_saved_config_of_another_algorithm_is_grpo(tmp_path, before):
    """A run's config.yaml lists every field: --preset grpo over one of a cispo run kept
    loss_fn cispo and eps 1.0 / 1.0 under the label grpo."""
    saved = tmp_path / "config.yaml"
    from dapo.config import dump_yaml

    saved.write_text(dump_yaml(load_config(None, preset=before)))
    algo = load_config(saved, preset="grpo").algo
    plain = load_config(None, preset="grpo").algo
    assert algo == plain
    assert (algo.loss_fn, algo.ratio_level, algo.adv_norm) == ("clip", "token", "group")
    assert (algo.eps_low, algo.eps_high, algo.loss_agg) == (0.2, 0.2, "seq-mean-token-mean")


def test_the_ablation_chain_on_a_recipe_adds_one_technique_a_row():
    from dapo.ablate.plans import table1

    recipe = ROOT / "recipes" / "dapo-qwen2.5-math-1.5b.yaml"
    rows = [load_config(recipe, list(r.overrides)).algo for r in table1()]
    assert [a.eps_high for a in rows] == [0.2, 0.2, 0.28, 0.28, 0.28, 0.28]
    assert [a.overlong_filter for a in rows] == [False, True, True, False, False, False]
    assert [a.kl_coef for a in rows] == [0.001] * 5 + [0.0]
