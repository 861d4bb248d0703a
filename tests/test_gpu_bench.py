"""`benchmarks/gpu.py --tiny`: the GPU benchmark's code, run on the CPU at tiny sizes, so that
it still works the day a GPU is lent. Its figures are checked where they have a known value
(FLOPs, token counts, the one-rank FSDP step against one process) and for sense elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# The tiny Qwen2 (hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads,
# vocabulary 512, tied), by hand: per layer q, k, v, o projections 64 x (64 + 32 + 32) +
# 64 x 64, their biases 64 + 32 + 32, the MLP 3 x 64 x 128, two norms 2 x 64.
LAYER_PARAMS = 64 * 128 + 64 * 64 + 128 + 3 * 64 * 128 + 2 * 64
PARAMS = 2 * LAYER_PARAMS + 512 * 64 + 64


def run_tiny(*args: str) -> tuple[dict, str]:
    """The JSON figures and the stdout of a tiny run (one thread: the machine is shared).

    The time limit only catches a hang: a compiled run takes about a minute alone on 2 cores
    and over two beside the other test worker (CI on 2026-12-01 stopped one at 120 s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--tiny", "--json", "--threads", "1", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]), done.stdout


@pytest.fixture(scope="module")
def tiny_run() -> tuple[dict, str]:
    """Every section of one tiny run, the length mix on bf16 weights too."""
    return run_tiny("--bf16-weights")


def test_the_run_names_its_machine_and_prints_a_line_per_section(tiny_run):
    result, stdout = tiny_run
    assert result["device_type"] == "cpu" and result["tiny"] is True
    assert result["torch"] and result["transformers"] and len(result["date"]) == 10
    assert result["threads"] == 1 and result["compute_dtype"] == "float32"
    assert result["matmul"]["dtype"] == "float32" and result["matmul"]["tflops"] > 0
    assert list(result["shapes"]) == ["tiny-qwen2"]
    for line in ("matmul peak:", "  train:", "  decode:", "  head at 16384 tokens:", "  fsdp"):
        assert line in stdout


def test_training_step_figures(tiny_run):
    shape = tiny_run[0]["shapes"]["tiny-qwen2"]
    train = shape["train"]
    assert shape["params"] == PARAMS == 107_072
    # 4 rows of 16 + 48 tokens: 6 x layers x layer params per position, the head over the
    # 48 response positions, causal attention 6 x layers x 64 x 64^2 per row.
    flops = 4 * (6 * 2 * LAYER_PARAMS * 64 + 6 * 512 * 64 * 48 + 6 * 2 * 64 * 64**2)
    assert train["flops_per_step"] == flops == 164_364_288
    assert train["tokens_per_s"] == pytest.approx(4 * 64 / train["step_s"])
    assert train["peak_mib"] is None and train["reserved_peak_mib"] is None  # CUDA's alone
    assert train["tokens_per_s"] > 0 and 0 < train["mfu"] < 1
    assert train["mfu"] == pytest.approx(
        train["tflops"] / tiny_run[0]["matmul"]["tflops"], rel=1e-9
    )
    # The plan holds at least float32 weights, gradients and two AdamW moments.
    assert train["plan_training_peak_mib"] >= 16 * PARAMS / 2**20
    assert train["plan_activations_mib"] > 0
    assert train["peak_mib"] is None  # measured on CUDA only
    assert train["loss_first_step"] != 0 and train["grad_norm_first_step"] > 0


def test_the_length_mix_trains_padded_then_packed(tiny_run):
    """8 rows of the realistic mix (benchmarks/length_mix.py, scaled to the tiny sizes): the
    same real tokens both ways; padded computes more positions than real tokens, packed none
    more; MFU on the real tokens' FLOPs. ``--bf16-weights``: packed once more on the model
    cast to bf16 (and back to float32 for the sections after it, which still run)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from length_mix import draw

    lengths = draw(8, prompt_mean=16.0, l_max=48)
    padded, packed, bf16 = tiny_run[0]["shapes"]["tiny-qwen2"]["mix"]
    assert (padded["packing"], packed["packing"], bf16["packing"]) == (False, True, True)
    weights = [run["weights"] for run in (padded, packed, bf16)]
    assert weights == ["float32", "float32", "bfloat16"]
    assert padded["real_tokens"] == packed["real_tokens"] == sum(p + t for p, t in lengths)
    assert padded["positions_per_real_token"] > 1.0 == packed["positions_per_real_token"]
    assert bf16["positions_per_real_token"] == 1.0 and bf16["step_s"] > 0
    assert ", bf16 weights, no autocast): " in tiny_run[1]
    flops = sum(
        6 * 2 * LAYER_PARAMS * (p + t) + 6 * 512 * 64 * t + 6 * 2 * 64 * (p + t) ** 2
        for p, t in lengths
    )
    peak = tiny_run[0]["matmul"]["tflops"]
    for run in (padded, packed):
        assert run["mfu_real"] == pytest.approx(flops / run["step_s"] / 1e12 / peak, rel=1e-9)


def test_decoding_draws_every_token_it_was_asked_for(tiny_run):
    decode = tiny_run[0]["shapes"]["tiny-qwen2"]["decode"]
    assert decode["rows"] == 8 and decode["prompt_tokens"] == 16 and decode["new_tokens"] == 32
    assert decode["tokens"] == 8 * 32  # EOS ignored: no row stops early
    assert decode["tokens_per_s"] == pytest.approx(8 * 32 / decode["seconds"])
    # K and V of 2 layers x 2 KV heads x 16 dims, float32, 8 rows of 16 + 32 tokens.
    assert decode["plan_kv_cache_mib"] == round(2 * 2 * 32 * 4 * 48 * 8 / 2**20, 1)


def test_decoding_against_its_bandwidth_bound(tiny_run):
    result = tiny_run[0]
    runs = result["shapes"]["tiny-qwen2"]["decode_runs"]
    assert [r["rows"] for r in runs] == [8, 32]  # 2 and 8 prompts x 4; eager on CUDA only
    assert all(r["path"] == "eager" for r in runs)  # a CPU decodes eagerly
    bandwidth = result["copy_bandwidth_gb_s"] * 1e9
    assert bandwidth > 0
    for r in runs:
        # The bytes of a step: float32 decoder layers and head (hidden 64, vocabulary 512),
        # and K and V of 2 layers x 2 heads x 16 dims at the mean length 16 + 31 / 2.
        weights = 4 * (2 * LAYER_PARAMS + 512 * 64)
        cache = 2 * 2 * 32 * 4 * r["rows"] * (16 + 31 / 2)
        assert r["bytes_per_step"] == int(weights + cache)
        assert r["bound_tokens_per_s"] == pytest.approx(r["rows"] * bandwidth / (weights + cache))
        assert r["decode_bound_frac"] == pytest.approx(r["tokens_per_s"] / r["bound_tokens_per_s"])
        assert r["step_ms"] == pytest.approx(1000 * r["seconds"] / 32)


def test_chunked_head_is_the_full_logits_in_less_memory(tiny_run):
    head = tiny_run[0]["shapes"]["tiny-qwen2"]["head"]
    assert head["tokens"] == 16384 and head["chunk_tokens"] == 512
    assert head["max_logprob_gap"] < 1e-4
    assert head["full_logits_mib"] == 16384 * 512 * 4 / 2**20 == 32.0
    if sys.platform == "linux":  # the resident high-water mark is read from /proc
        # Autograd keeps the logits and more; the chunked head a few [512, 512] chunks and
        # the gradient of the hidden states (4 MiB).
        assert head["full_mib"] >= head["full_logits_mib"]
        assert head["chunked_mib"] < head["full_mib"] / 4


def test_one_rank_fsdp_step_matches_one_process(tiny_run):
    sharded = tiny_run[0]["shapes"]["tiny-qwen2"]["fsdp"]
    train = tiny_run[0]["shapes"]["tiny-qwen2"]["train"]
    assert sharded["backend"] == "gloo" and sharded["sharded"] is True
    assert sharded["loss_one_process"] == train["loss_first_step"]
    assert sharded["loss_gap"] <= 1e-5
    assert sharded["loss"] == pytest.approx(train["loss_first_step"], abs=1e-5)
    assert sharded["grad_norm"] == pytest.approx(train["grad_norm_first_step"], rel=1e-5)
    assert sharded["step_s"] > 0 and sharded["first_step_s"] > 0


def test_sections_and_the_step_profile():
    """``--sections mix --profile --compile --microbatch-tokens 256``: the length-mix section
    alone, padded and packed with eager then compiled layers (the same positions), in
    micro-batches of 256 tokens (the tiny default: 128), each kind of step profiled once
    more; the kinds add up to the busy time, and the matrix products are found."""
    args = ("--sections", "mix", "--profile", "--compile", "--microbatch-tokens", "256")
    result, stdout = run_tiny(*args)
    shape = result["shapes"]["tiny-qwen2"]
    assert set(shape) == {"params", "sizes", "mix"}
    kinds = [(r["packing"], r["compiled"], r["attention"]) for r in shape["mix"]]
    assert kinds == [
        (False, False, "sdpa"),
        (True, False, "sdpa per response"),
        (False, True, "sdpa"),
        (True, True, "sdpa per response"),
    ]
    positions = [r["positions_per_real_token"] for r in shape["mix"]]
    assert positions[:2] == positions[2:] and positions[1] == 1.0 < positions[0]
    assert stdout.count(", compiled layers): ") == 2
    assert (
        {r["microbatch_tokens"] for r in shape["mix"]}
        == {256}
        == {shape["sizes"]["microbatch_tokens"]}
    )
    assert stdout.count(" real tokens, micro-batches of 256: ") == 4
    for run in shape["mix"]:
        p = run["profile"]
        assert p["measures"] == "operators' own CPU time" and 0 < p["busy_s"]
        assert sum(p["by_kind"].values()) == pytest.approx(p["busy_s"])
        assert p["by_kind"]["matmul"] > 0 and p["by_kind"]["optimizer"] > 0
        assert p["top"][0]["s"] >= p["top"][-1]["s"] and len(p["top"]) == 8
    assert stdout.count("  profile, ") == 4


def test_the_decoding_profile():
    """``--sections decode --profile``: each timed decoding run once more under the profiler,
    its figures per step: the kinds add up to the busy time, and the draw's softmax and
    running sum and the matrix products are found."""
    result, stdout = run_tiny("--sections", "decode", "--profile")
    runs = result["shapes"]["tiny-qwen2"]["decode_runs"]
    assert [r["rows"] for r in runs] == [8, 32]
    for run in runs:
        p = run["profile"]
        assert p["measures"] == "operators' own CPU time" and 0 < p["busy_s"] <= p["wall_s"]
        assert sum(p["by_kind"].values()) == pytest.approx(p["busy_s"])
        assert p["by_kind"]["softmax/scan"] > 0 and p["by_kind"]["matmul"] > 0
        assert len(p["top"]) == 12 and p["calls"] > 0
    assert stdout.count("  profile, decode, ") == 2
    assert ", per step of 8: " in stdout


def test_the_decoding_runs_of_a_shape():
    """On CUDA the default path at both row counts, then at the first the uncompiled graphs,
    the eager loop and (``--variants``) two settings of the compiled graphs; on a CPU the
    default path alone (the engine decodes eagerly there)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu

    cuda = gpu.decode_plans(gpu.REAL, torch.device("cuda"), variants=True)
    rows = [
        (p["count"], p["new_tokens"], p["cuda_graphs"], p["compile_step"], p.get("width_step"))
        for p in cuda
    ]
    assert rows == [
        (4, 1024, True, True, None),
        (16, 1024, True, True, None),
        (4, 1024, True, False, None),
        (4, 128, False, False, None),
        (4, 1024, True, True, 128),
        (4, 1024, True, True, None),
    ]
    assert cuda[-1]["compile_mode"] == "max-autotune-no-cudagraphs"
    assert len(gpu.decode_plans(gpu.REAL, torch.device("cuda"), variants=False)) == 4
    cpu = gpu.decode_plans(gpu.TINY, torch.device("cpu"), variants=True)
    assert [(p["count"], p["cuda_graphs"], p["compile_step"]) for p in cpu] == [
        (2, True, True),
        (8, True, True),
    ]


def test_a_failed_variant_is_reported_not_raised(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu

    def broken():
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    assert gpu.guarded(broken, "max-autotune-no-cudagraphs") == {
        "variant": "max-autotune-no-cudagraphs",
        "error": "RuntimeError: operation not permitted when stream is capturing",
    }
    assert "decode variant (max-autotune-no-cudagraphs) failed" in capsys.readouterr().out
    assert gpu.guarded(lambda: {"rows": 64}, "x") == {"rows": 64}
    with pytest.raises(SystemExit):
        gpu.parse_args(["--microbatch-tokens", "0"])
    assert "--microbatch-tokens must be at least 1, got 0" in capsys.readouterr().err
    assert [gpu.is_variant(p) for p in gpu.decode_plans(gpu.REAL, torch.device("cuda"), True)] == [
        False,
        False,
        False,
        False,
        True,
        True,
    ]


def test_a_failed_length_mix_kind_costs_only_itself(monkeypatch, capsys):
    """A kind of the length mix that fails (an error line and entry), and each profile that
    fails, leave the other kinds their figures; each kind starts from the model as it was: a
    padded kind after a packed one attends through SDPA, as a run with packing off does, and
    the section ends on float32 weights. (The measurement is stood in: what is checked here is
    the section's handling of a failure, not a figure.)"""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu

    tok = gpu.build_tokenizer()
    model = gpu.build_model(gpu.TINY_FIELDS, tok, torch.device("cpu"))
    seen = []

    def measured_updates(state, episodes, steps):
        seen.append((state.cfg.train.packing, model.config._attn_implementation))
        if state.cfg.train.packing and not state.cfg.train.compile:
            raise RuntimeError("CUDA out of memory\nmore")
        return {"slots": 12, "real": 10}, 2.0, None

    def profile_call(work, device):
        raise RuntimeError("profiler fault")

    monkeypatch.setattr(gpu, "measured_updates", measured_updates)
    monkeypatch.setattr(gpu.step_profile, "profile_call", profile_call)
    shape = gpu.ModelShape.from_hf_config(gpu.TINY_FIELDS)
    args = (shape, model, tok, gpu.TINY, torch.device("cpu"), "float32", 1, 1.0)
    runs = gpu.mix_section(*args, profile=True, compile=True, bf16_weights=True)
    assert seen == [
        (False, "sdpa"),
        (True, "dapo_packed"),
        (False, "sdpa"),
        (True, "dapo_packed"),
        (True, "dapo_packed"),
        (True, "dapo_packed"),
    ]
    error = "RuntimeError: CUDA out of memory"
    assert runs[1] == {"variant": "packed", "error": error}
    assert runs[4] == {"variant": "packed, bf16 weights", "error": error}
    for run, label in zip(
        [runs[0], runs[2], runs[3], runs[5]],
        ["padded", "padded, compiled", "packed, compiled", "packed, compiled, bf16 weights"],
        strict=True,
    ):
        assert run["step_s"] == 2.0 and run["positions_per_real_token"] == 1.2
        assert run["profile"] == {"variant": label, "error": "RuntimeError: profiler fault"}
    out = capsys.readouterr().out
    assert f"  length mix (packed) failed: {error}" in out
    assert "  profile (padded, compiled) failed: RuntimeError: profiler fault" in out
    assert model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert all("forward" not in vars(layer) for layer in gpu.fsdp.decoder_layers(model))


def test_kinds_of_work_by_name():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_profile import kind_of

    assert kind_of("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NTN") == "matmul"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention"
    assert kind_of("aten::_foreach_addcdiv_") == "optimizer"
    assert kind_of("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>") == (
        "copy/cast"
    )
    assert kind_of("void at::native::vectorized_elementwise_kernel<CUDAFunctor_add<float>>") == (
        "other"
    )
    assert kind_of("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, double>") == (
        "softmax/scan"
    )
    assert kind_of("void at_cuda_detail::cub::DeviceScanKernel<...>") == "softmax/scan"
    assert kind_of("aten::searchsorted") == "softmax/scan"
