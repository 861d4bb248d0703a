"""Shared fixtures: a tiny tokenizer and an untrained tiny Qwen2 policy, built in-process."""

from __future__ import annotations

import os

import pytest
import torch

from dapo.models.demo import TinyModelSpec, build_tokenizer, tiny_qwen2


@pytest.fixture(autouse=True)
def _few_threads():
    # Under pytest-xdist (`-n auto`: a worker per core) each worker computes on one thread.
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


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
