"""Real loading paths: Hugging Face model directories (Qwen2 and Llama, saved here with
save_pretrained), data files in both formats, --dry-run of the recipes, and their errors."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ARCHS, save_model
from transformers import AutoModelForCausalLM

from dapo.cli import main
from dapo.data.prompts import PROMPT_PREFIX, dapo_prompt
from dapo.models.demo import build_tokenizer
from dapo.reward.tasks import arith

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A flat JSONL training file and a DAPO-format val Parquet with 3 problems x 4 rows."""
    root = tmp_path_factory.mktemp("data")
    train, val, _ = arith.make_splits(48, 3, seed=0)
    raw = lambda p: p.messages[0]["content"][len(PROMPT_PREFIX) :].split("\n\n")[0]  # noqa: E731
    with (root / "train.jsonl").open("w") as f:
        for p, _ in train:
            f.write(json.dumps({"q": raw(p), "a": p.answer}) + "\n")
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": dapo_prompt(raw(p))}],
            "ability": "MATH",
            "reward_model": {"ground_truth": p.answer, "style": "rule"},
            "extra_info": {"index": i},
        }
        for i, (p, _) in enumerate(val)
        for _ in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), root / "val.parquet")
    return root / "train.jsonl", root / "val.parquet"


def train_args(tmp_path, model_dir, files, *extra):
    train, val = files
    return [
        "train",
        f"model.path={model_dir}",
        f"data.train_file={train}",
        f"data.val_file={val}",
        "data.question_key=q",
        "data.answer_key=a",
        "data.wrap_template=true",
        "rollout.group_size=4",
        "rollout.max_new_tokens=16",
        "algo.l_cache=4",
        "train.steps=2",
        "train.prompts_per_step=2",
        "sampling.dynamic=false",
        "train.responses_per_minibatch=8",
        "eval.num_samples=0",
        "eval.every=0",
        "reward.workers=0",
        f"run.out_dir={tmp_path}",
        "run.name=r",
        *extra,
    ]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_two_steps_from_a_saved_model_directory(tmp_path, files, arch):
    model_dir = save_model(tmp_path / arch, arch)
    assert main(train_args(tmp_path, model_dir, files)) == 0
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    # The val file's 4 repeats of each of 3 problems became k = 4 samples of 3 problems.
    assert lines[0]["val/num_problems"] == 3.0 and lines[0]["val/num_samples"] == 4.0
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "r" / "model")
    assert type(saved) is ARCHS[arch][1]
    assert (tmp_path / "r" / "checkpoints" / "step_000002").is_dir()


def test_a_saved_demo_tokenizer_loads_as_itself(tmp_path):
    """AutoTokenizer would load it as the model family's class (Qwen2Tokenizer) and tokenize
    differently; the run must see the tokenizer that was saved."""
    from dapo.config import load_config
    from dapo.models.policy import load_tokenizer

    model_dir = save_model(tmp_path / "m", "qwen2")
    tok = load_tokenizer(load_config(None, [f"model.path={model_dir}"]))
    text = "User: 3 + 4\nAssistant:\n"
    assert tok(text)["input_ids"] == build_tokenizer()(text)["input_ids"]
    assert tok.padding_side == "left" and tok.pad_token == "<|pad|>"


def test_prompts_beyond_the_context_are_refused(tmp_path, files, capsys):
    model_dir = save_model(tmp_path / "m", "llama", context=64)
    assert main(train_args(tmp_path, model_dir, files)) == 2
    err = capsys.readouterr().err
    assert "exceed the model's context of 64 tokens" in err
    # Every templated prompt fills the 64 alone: no smaller rollout.max_new_tokens is offered.
    assert "Set data.on_long_prompt=skip to drop them" in err
    assert "48 prompt(s) fill the context alone, and no rollout.max_new_tokens" in err


def test_model_directory_errors(tmp_path, files, capsys):
    no_tok = save_model(tmp_path / "no-tokenizer", "qwen2", tokenizer=False)
    assert main(train_args(tmp_path, no_tok, files)) == 2
    assert "no usable tokenizer there" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(train_args(tmp_path, tmp_path / "empty", files)) == 2
    assert "is not a Hugging Face model directory (no config.json)" in capsys.readouterr().err
    assert main(train_args(tmp_path, tmp_path / "absent", files)) == 2
    assert f"model.path={tmp_path / 'absent'} (no such directory) is not" in capsys.readouterr().err
    assert main(train_args(tmp_path, "../absent", files)) == 2
    err = capsys.readouterr().err
    assert f"model.path=../absent (no such directory in {Path.cwd()}) is not a Hugging" in err


def test_file_data_needs_a_real_model_and_both_files(tmp_path, files, capsys):
    assert main(["train", f"data.train_file={files[0]}", f"data.val_file={files[1]}"]) == 2
    assert "data.train_file needs a real model" in capsys.readouterr().err
    assert main(["train", "model.path=x", f"data.train_file={files[0]}"]) == 2
    assert "data.train_file and data.val_file go together" in capsys.readouterr().err


def test_a_bad_row_is_named_before_any_model_loads(tmp_path, files, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "1 + 1", "a": "2"}\n{"q": "2 + 2", "a": ""}\n')
    model_dir = save_model(tmp_path / "m", "qwen2")
    args = train_args(tmp_path, model_dir, (bad, files[1]))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "row 1" in err and "a" in err


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_dry_runs_on_a_tiny_model(tmp_path, files, recipe, capsys):
    from dapo.config import load_config
    from dapo.config.loading import read_hardware
    from dapo.memory_plan import recipe_context

    args = ["train", "--config", str(ROOT / "recipes" / recipe), "--dry-run"]
    tp = load_config(ROOT / "recipes" / recipe).rollout.tp_size
    if tp > 1:  # planned for its cards: a dry run at their world size
        args += ["--world-size", str(read_hardware(ROOT / "recipes" / recipe)["gpus"])]
    if recipe != "demo.yaml":
        # The recipe's own paths point at downloads; a tiny model with the real model's
        # context (32768 where the plan knows none: the 7B and 32B bases hold more), heads
        # that its tensor-parallel size divides, and the fixture files stand in for them,
        # the train file with one prompt of 1,211 tokens, as DAPO-Math-17k has a few over
        # 1,024: a recipe whose context cannot hold it beside L_max must drop it.
        # (The embedded model's recipes train on its task, not on a file: theirs alone.)
        cfg = load_config(ROOT / "recipes" / recipe)
        context = recipe_context(cfg) or 32768
        model_dir = save_model(tmp_path / "m", "qwen2", context=context, heads=max(2, tp))
        train = tmp_path / "train.jsonl"
        long = {"q": "Compute " + " + ".join(["7"] * 600) + ".", "a": "4200"}
        rows = [long] if cfg.model.path != "embedded" else []
        train.write_text(files[0].read_text() + "".join(json.dumps(r) + "\n" for r in rows))
        args += [
            f"model.path={model_dir}",
            f"data.train_file={train}",
            f"data.val_file={files[1]}",
            "data.format=auto",
            "data.question_key=q",
            "data.answer_key=a",
        ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dry run: config, tokenizer and data are valid" in out
    assert "tokens per step: at most" in out
    assert not any(tmp_path.glob("runs*"))
    if recipe.startswith("dapo-qwen2.5-math-1.5b"):  # context 4096, L_max 3072
        assert "1 problem(s) dropped (data.on_long_prompt=skip)" in out
        assert "(over 1024 prompt tokens; longest: row 48, 1211 tokens); 48 kept" in out
    else:
        assert "dropped (data.on_long_prompt=skip)" not in out


@pytest.mark.skipif(not (SHARED / "aime-2024").is_dir(), reason="../shared/data is absent")
def test_the_32b_recipe_dry_runs_on_the_real_files(tmp_path, capsys):
    model_dir = save_model(tmp_path / "m", "qwen2", context=32768, heads=8)
    args = [
        "train",
        "--config",
        str(ROOT / "recipes" / "dapo-qwen2.5-32b.yaml"),
        "--dry-run",
        "--world-size",
        "64",
        f"model.path={model_dir}",
        f"data.train_file={SHARED / 'dapo-math-17k' / 'dapo_math_17k.parquet'}",
        f"data.val_file={SHARED / 'aime-2024' / 'aime-2024.parquet'}",
        # This copy has the template stripped and 11 repeats whose answers disagree.
        "data.wrap_template=true",
        "data.on_bad_row=skip",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "17917 rows" in out and "11 bad rows skipped" in out
    assert "val 30 problems x 32 samples" in out


def test_a_tensor_parallel_size_the_run_cannot_split_is_refused_before_loading(tmp_path, capsys):
    model_dir = save_model(tmp_path / "m", "qwen2", heads=2)  # 2 heads, 1 key-value head
    base = ["train", "--dry-run", f"model.path={model_dir}", "rollout.tp_size=2"]
    assert main(base) == 2
    assert "launch with torchrun --nproc-per-node N (N a multiple of 2" in capsys.readouterr().err
    assert main([*base, "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "rollout.tp_size=2 does not divide the model's key-value heads" in err
    assert "rollout.tp_size=2 splits the native engine's copy or vLLM's" in (
        main([*base, "--world-size", "4", "rollout.engine=hf"]) == 2 and capsys.readouterr().err
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_policy_puts_the_model_on_the_device_in_the_dtype(tmp_path, dtype):
    import torch

    from dapo.config import load_config
    from dapo.models.policy import load_policy

    model_dir = save_model(tmp_path / "m", "llama")
    cfg = load_config(None, [f"model.path={model_dir}", "model.device=cpu"])
    cfg.model.param_dtype = dtype
    model, tok = load_policy(cfg)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert tok.padding_side == "left" and tok.pad_token is not None


def test_a_tokenizer_with_ids_the_model_cannot_embed_is_refused(tmp_path):
    """Tokens added to the tokenizer without resizing the model: the first such id in a
    prompt was an IndexError inside the embedding; the load names both sizes and the fix."""
    from dapo.config import load_config
    from dapo.models.policy import load_policy, load_tokenizer

    model_dir = save_model(tmp_path / "m", "qwen2")
    cfg = load_config(None, [f"model.path={model_dir}", "model.device=cpu"])
    tok = load_tokenizer(cfg)
    rows = len(tok)
    tok.add_tokens(["<extra_1>", "<extra_2>"])
    tok.save_pretrained(model_dir)
    with pytest.raises(ValueError) as err:
        load_policy(cfg)
    message = str(err.value)
    assert f"the tokenizer has {rows + 2:,} tokens but the model embeds only {rows:,}" in message
    assert "resize_token_embeddings(len(tokenizer))" in message and str(model_dir) in message
    model, _ = load_policy(cfg, tokenizer=build_tokenizer())  # the model's own: loads
    assert model.get_input_embeddings().num_embeddings == rows
