"""A call of the Python API leaves the calling process as it found it: a notebook's next run
started capped at the thread count the last one ended at, deterministic where it asked for
nothing, its random draws re-seeded, and with a loading bar printed at every checkpoint."""

import os
import random

import numpy as np
import pytest
import torch
from helpers import SMALL
from transformers.utils import logging as hf_logging

import dapo
from dapo.api.process_state import WORKSPACE, kept_process_state


def test_a_run_leaves_threads_kernels_generator_and_bars_as_they_were(tmp_path, monkeypatch):
    monkeypatch.delenv(WORKSPACE, raising=False)
    hf_logging.enable_progress_bar()
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    expected = torch.rand(3)  # the caller's next draws, had no run come between
    torch.manual_seed(1234)
    overrides = [*SMALL, "train.steps=1", f"run.out_dir={tmp_path}", "run.name=r"]
    overrides += ["run.threads=1", "run.deterministic=true"]
    dapo.train(overrides=overrides, quiet=True)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
    assert WORKSPACE not in os.environ
    assert hf_logging.is_progress_bar_enabled()


def test_the_state_is_put_back_when_the_call_fails(monkeypatch):
    monkeypatch.setenv(WORKSPACE, ":16:8")
    threads = torch.get_num_threads()
    hf_logging.enable_progress_bar()
    with pytest.raises(RuntimeError, match="the run failed"), kept_process_state():
        assert not hf_logging.is_progress_bar_enabled()  # silenced during the call
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        os.environ[WORKSPACE] = ":4096:8"
        raise RuntimeError("the run failed")
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
    assert os.environ[WORKSPACE] == ":16:8"
    assert hf_logging.is_progress_bar_enabled()


def test_an_evaluation_leaves_threads_and_generator_as_they_were(tmp_path):
    threads = torch.get_num_threads()
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    settings = dict(max_new_tokens=8, num_problems=2, out=tmp_path / "e", threads=1)
    dapo.evaluate("embedded", "arith", k=2, **settings)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


def test_a_resume_leaves_pythons_and_numpys_generators_as_they_were(tmp_path):
    """A resume sets every generator to its checkpoint's: the caller's random and numpy
    draws went on from the checkpoint's state."""
    overrides = [*SMALL, "train.steps=1", f"run.out_dir={tmp_path}", "run.name=r"]
    dapo.train(overrides=overrides, quiet=True)
    random.seed(5)
    np.random.seed(5)
    expected = (random.random(), float(np.random.rand()))
    random.seed(5)
    np.random.seed(5)
    dapo.train(overrides=["train.steps=2"], resume=tmp_path / "r", quiet=True)
    assert (random.random(), float(np.random.rand())) == expected


def test_the_gpus_generators_are_put_back_once_cuda_is_in_use(monkeypatch):
    """torch.manual_seed(train.seed) seeds every GPU's generator too."""
    states = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
    put_back = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", put_back.append)
    with kept_process_state():
        pass
    assert put_back == [states]
