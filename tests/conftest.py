"""Shared fixtures (a tiny tokenizer, an untrained tiny Qwen2 policy, the session's cache of the
embedded demo model) and the order in which pytest-xdist's workers take the test files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dapo.models.demo import TinyModelSpec, build_tokenizer, tiny_qwen2

LONGEST_FIRST = (
    "test_scale_out.py",
    "test_env_runs.py",
    "test_rollout_ranks.py",
    "test_smollm2.py",
    "test_lora_ranks.py",
    "test_hostile_inputs.py",
    "test_compiled_layers.py",
    "test_ablate.py",
    "test_resume.py",
    "test_gpu_bench.py",
    "test_fsdp_forward.py",
    "test_export.py",
)
"""The longest test files, longest first (each 1.5 to 6 minutes of a worker under `-n 2`,
measured 2026-11-29). Under pytest-xdist's --dist loadfile a worker takes whole files in
collection order, so a long file collected last would leave the other worker idle at the
end; collected first, the short files fill in around them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.fixture(autouse=True)
def _few_threads():
    # Under pytest-xdist (`-n auto`: a worker per core) each worker computes on one thread.
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture
def fresh_traces():
    """The test traces from nothing: dynamo keeps a few traces per function and counts graph
    breaks for the whole process. Files that compile use it for every test (``pytestmark``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """One cache of the embedded demo model for the session (``embedded.cache_dir``), shared
    by pytest-xdist's workers: their base directories' parent. An entry is keyed by every
    setting that shapes the model and written by rename (:func:`dapo.models.demo.load_embedded`),
    and its warm-up gives the same bytes at any thread count, so sharing it changes no value:
    the runs that would each build the same model (21 s a time) load it instead."""
    root = tmp_path_factory.getbasetemp()
    path = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "demo-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture()
def tiny_model(tokenizer):
    spec = TinyModelSpec(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_positions=256,
    )
    return tiny_qwen2(tokenizer, spec, seed=0)


@pytest.fixture()
def eager_eos_model(tiny_model, tokenizer):
    """The tiny model with EOS made likely, so that responses finish at different steps."""
    with torch.no_grad():
        tiny_model.model.embed_tokens.weight[tokenizer.eos_token_id] *= 8
    return tiny_model


@pytest.fixture
def no_training(monkeypatch):
    """The policy "loads" at once and training raises ``helpers.Started`` at its first line."""
    from helpers import Started

    from dapo.models import policy
    from dapo.training import loop

    def refuse(*_a, **_k):
        raise Started

    monkeypatch.setattr(policy, "load_policy", lambda cfg, pairs, tokenizer, **_: (None, tokenizer))
    monkeypatch.setattr(loop, "fit", refuse)
