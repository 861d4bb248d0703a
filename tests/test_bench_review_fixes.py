"""`benchmarks/cpu_roofline.py` counts the FLOPs its log-prob pass computes (each group's
prompt once, the head on response positions only), refuses rows that are not whole groups and
counts the decoded rows it got; `benchmarks/decode_check.py` claims no graph comparison on a
CPU, where no graphs run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import load_script
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from dapo.models.demo import build_tokenizer
from dapo.models.logprobs import response_logprobs


@pytest.fixture(scope="module")
def roofline():
    return load_script("benchmarks/cpu_roofline.py")


def tiny_llama(attention: str = "sdpa") -> LlamaForCausalLM:
    """A SmolLM2-like model (Llama, tied head) of hidden 32, 2 layers, 4 heads of 8."""
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=True,
        max_position_embeddings=128,
        attn_implementation=attention,
        eos_token_id=0,
        pad_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_training_flops_by_hand(roofline):
    # 16 rows in 2 groups of 8, prompt 3, response 2: decoder positions 2 x 3 + 16 x 2 = 38,
    # head positions 16 x 2 = 32; causal pairs 2 x 9/2 + 16 x (2 x 3 + 4/2) = 137.
    flops = roofline.training_flops(
        decoder_params=100, head_params=50, layers=2, width=4, rows=16, prompt=3, response=2
    )
    assert flops == 6 * 100 * 38 + 6 * 50 * 32 + 3 * 2 * 2 * 4 * 2 * 137 == 45552


def test_training_pass_counts_the_flops_the_pass_computes(roofline):
    """The forward's Linear and attention FLOPs as torch's counter sees them (eager attention:
    every query-key pair, masked ones too), x3 for forward + backward, the masked upper
    triangles (P^2/2 per prompt, R^2/2 per row) taken off by hand."""
    model = tiny_llama("eager").eval()
    rows, prompt, response, width, layers = 16, 6, 5, 32, 2
    prompts = torch.randint(0, 128, (rows // 8, prompt)).repeat_interleave(8, dim=0)
    responses = torch.randint(0, 128, (rows, response))
    ones = torch.ones_like
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        response_logprobs(model, prompts, ones(prompts), responses, ones(responses))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    masked = 2 * 2 * width * layers * (rows // 8 * prompt**2 / 2 + rows * response**2 / 2)
    expected = 3 * (counts["aten.mm"] + counts["aten.bmm"] - masked)
    args = SimpleNamespace(rows=rows, prompt=prompt, response=response)
    got = roofline.training_pass(model.train(), args)["gflop"] * 1e9
    # transformers 4 computes the rotary angles with a small bmm the counter sees too (1.7e-4
    # of the total here), which the script does not count.
    assert got == pytest.approx(expected, rel=1e-12 if transformers_5() else 3e-4)
    # The head, 128 x 32 weights, runs on the 80 response positions, not the 92 positions.
    assert roofline.head_params(model) == 128 * 32


@pytest.mark.parametrize("rows", ["12", "4", "0"])
def test_rows_that_are_not_whole_groups_are_refused(roofline, rows, capsys):
    with pytest.raises(SystemExit) as exit_info:
        roofline.parse_args(["--rows", rows])
    assert exit_info.value.code == 2
    assert f"--rows {rows}: must be a positive multiple of 8 (e.g. --rows 64)" in (
        capsys.readouterr().err
    )
    assert roofline.parse_args(["--rows", "16"]).rows == 16


def test_decoding_counts_the_rows_it_generated(roofline):
    tokenizer = build_tokenizer()
    model = tiny_llama().eval()
    out = roofline.decoding(model, tokenizer, SimpleNamespace(rows=16, response=3))
    assert out["rows"] == 16
    assert out["tokens_per_s"] * out["seconds"] == pytest.approx(16 * 3)


def test_decode_check_compares_no_graphs_on_a_cpu(capsys):
    script = load_script("benchmarks/decode_check.py")
    argv = ["--device", "cpu", "--prompts", "2", "--rows-per-prompt", "2", "--new-tokens", "4"]
    result = script.main(argv)
    assert result["static_vs_graphs_equal"] is None
    assert result["static_vs_graphs_note"] == "not compared: no CUDA graphs on cpu"
    assert "graphs" not in result and result["static"]["steps"] == 4
    printed = capsys.readouterr().out
    assert "static_vs_graphs_equal: None\n" in printed
    assert "static_vs_graphs_note: not compared: no CUDA graphs on cpu\n" in printed


def transformers_5() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5
