"""The demo's warm-started weights depend on the CPU kernels torch picks for the instruction
set (AVX2's and the plain kernels' differ by up to 0.02): a cache entry built with one set is
never read back under another, as with another torch or transformers."""

from __future__ import annotations

import torch

from dapo.models.demo import TinyModelSpec, WarmupSpec, load_embedded
from dapo.reward.tasks.arith import make_splits

SMALL_SPEC = TinyModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)


def _build(cache, monkeypatch, kernels: str) -> list[str]:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: kernels)
    lines: list[str] = []
    pairs = make_splits(4, 1, seed=0)[0]
    load_embedded(
        pairs, cache_dir=cache, spec=SMALL_SPEC, warmup=WarmupSpec(2, 2), log=lines.append
    )
    return lines


def test_each_kernel_set_gets_its_own_cache_entry(tmp_path, monkeypatch):
    first = _build(tmp_path, monkeypatch, "AVX2")
    assert first[0].startswith("building the embedded policy: 2 supervised warm-up steps on ")
    assert "this CPU's AVX2 kernels (cached at " in first[0]
    assert _build(tmp_path, monkeypatch, "AVX2") == []  # read back from the cache
    other = _build(tmp_path, monkeypatch, "DEFAULT")
    assert "this CPU's DEFAULT kernels" in other[0]  # built anew, not AVX2's weights
    assert len(list(tmp_path.glob("embedded-*"))) == 2
