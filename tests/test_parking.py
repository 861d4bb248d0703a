"""Episodes continued from the native engine's KV cache (dapo.rollout.parking): a parked row's
cache is the one a forward pass over its tokens computes, a continuation prefills only the
tokens added since, and the episodes equal those recomputed from scratch."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from test_env import PROBLEM, Hints

from dapo.env import History, Observation
from dapo.models.logprobs import prompt_pass, returned_cache
from dapo.rollout import make_engine, native
from dapo.rollout.episodes import EpisodeRunner, with_turn_ends
from dapo.rollout.parking import Parked, matched, prefix_cache

PATHS = ("eager", "static", "eager, finished rows kept")


class HintsToEos(Hints):
    """:class:`Hints` until the model's EOS, which ends the episode (:class:`Hints` goes on
    after it: a row with no parked cache, continued from scratch)."""

    def step(self, history: History) -> Observation:
        return Observation(done=True) if history.finished else super().step(history)


def _engine(model, tokenizer, path: str, monkeypatch, *, cached: bool = True, env=None):
    env = env or Hints()
    stops = with_turn_ends([tokenizer.eos_token_id], tokenizer, env)
    engine = make_engine("dapo", model, tokenizer, stops)
    if path == "static":  # the CUDA-graph path's loop, run eagerly on the CPU
        engine.static_path, engine.compile_step = (lambda: True), False
    if path == "eager, finished rows kept":
        monkeypatch.setattr(native, "decode", functools.partial(native.decode, drop_finished=False))
    engine.continues_from_cache = cached
    return engine, env


def _episodes(
    model, tokenizer, path: str, monkeypatch, *, cached: bool = True, widths=None, env=None
):
    engine, env = _engine(model, tokenizer, path, monkeypatch, cached=cached, env=env)
    if widths is not None:  # every forward's input width, in call order
        model.register_forward_pre_hook(
            lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
        )
    runner = EpisodeRunner(engine, tokenizer, env, max_turns=6)
    problems = [PROBLEM, dataclasses.replace(PROBLEM, uid="p1")]
    return runner.generate(
        problems, ["What is 2 + 3?\n"] * 2, group_size=3, max_new_tokens=40, seed=[5, 6]
    )


@pytest.mark.parametrize("path", PATHS)
def test_continued_episodes_equal_episodes_computed_again(tiny_model, tokenizer, path, monkeypatch):
    cached = _episodes(tiny_model, tokenizer, path, monkeypatch).samples()
    again = _episodes(tiny_model, tokenizer, path, monkeypatch, cached=False).samples()
    assert sum(s.trace.turns > 1 for s in cached) >= 3  # continuations are exercised
    for x, y in zip(cached, again, strict=True):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.env_mask.tolist() == y.env_mask.tolist() and x.trace == y.trace
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_a_continuation_prefills_only_the_tokens_added_since(tiny_model, tokenizer, monkeypatch):
    widths: list[int] = []
    env = HintsToEos()
    ro = _episodes(tiny_model, tokenizer, "eager", monkeypatch, widths=widths, env=env)
    added = 1 + len(tokenizer(Hints().step(None).text, add_special_tokens=False)["input_ids"])
    prefills = [w for w in widths if w > 1]
    # The first prefill is the prompts'; each later one the turn-end token and the hint.
    assert len(prefills) == max(s.trace.turns for s in ro.samples()) >= 3
    assert prefills[1:] == [added] * (len(prefills) - 1)
    again: list[int] = []
    _episodes(tiny_model, tokenizer, "eager", monkeypatch, cached=False, widths=again, env=env)
    assert all(w > 20 for w in [w for w in again if w > 1][1:])  # the whole episode again


@pytest.mark.parametrize("path", PATHS)
def test_a_parked_cache_is_what_a_forward_pass_over_its_tokens_computes(
    tiny_model, tokenizer, path, monkeypatch
):
    engine, env = _engine(tiny_model, tokenizer, path, monkeypatch)
    stops = sorted(with_turn_ends([], tokenizer, env))
    prompts = ["What is 2 + 3?\n", "Say 4 + 4"]
    out = engine.generate(prompts, group_size=4, max_new_tokens=30, seed=[3, 4], park_at=stops)
    samples = out.samples()
    ends = [s.response_ids[-1].item() in stops and not s.truncated for s in samples]
    assert sum(ends) >= 4 and ends.count(False) >= 1
    for s, parked, ended in zip(samples, out.parked, ends, strict=True):
        if not ended:
            assert parked is None
            continue
        tokens = s.prompt_ids.tolist() + s.response_ids[:-1].tolist()
        assert parked.tokens == tuple(tokens)
        with torch.no_grad():
            fresh = returned_cache(tiny_model(input_ids=torch.tensor([tokens]), use_cache=True))
        assert len(fresh.layers) == len(parked.keys) == len(parked.values)
        for i, layer in enumerate(fresh.layers):
            torch.testing.assert_close(parked.keys[i], layer.keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(parked.values[i], layer.values[0], atol=1e-5, rtol=0)


def _parked(tokens: list[int], fill: float) -> Parked:
    keys = torch.arange(len(tokens), dtype=torch.float32)[None, :, None] + fill
    return Parked(tuple(tokens), [keys.clone()], [-keys])


def test_parked_keys_take_the_columns_of_their_tokens_in_the_left_padded_contexts():
    """Contexts of 5 and 3 tokens (width 5) over parked caches of 3 and 1 tokens: the
    prefill must feed 2 tokens of each, so the cache holds 3 columns: row 0's three parked
    positions, and row 1's one parked position after two columns of padding."""
    contexts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    parked = [_parked([1, 2, 3], 10.0), _parked([7], 20.0)]
    cache, new = prefix_cache(parked, contexts, width=5)
    assert new == 2 and cache.get_seq_length() == 3
    keys = cache.layers[0].keys[:, 0, :, 0]
    assert keys.tolist() == [[10.0, 11.0, 12.0], [0.0, 0.0, 20.0]]
    assert parked[0].keys == parked[1].values == []  # taken: a parked cache serves once
    assert cache.layers[0].values[:, 0, :, 0].tolist() == [[-10.0, -11.0, -12.0], [0.0, 0.0, -20.0]]
    # A row whose context does not begin with its parked tokens is computed whole.
    assert matched(_parked([1, 9], 0.0), [1, 2, 3]) == 0
    assert matched(_parked([1, 2, 3], 0.0), [1, 2, 3]) == 2  # the last token is fed
    cache, new = prefix_cache([_parked([1, 9], 0.0), _parked([7], 0.0)], contexts, width=5)
    assert cache is None and new == 5


def test_the_prefix_gives_the_logits_of_a_whole_prefill(tiny_model):
    ids = torch.tensor([[0, 0, 5, 9, 12, 7], [4, 8, 15, 16, 23, 42]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        whole = tiny_model(input_ids=ids, attention_mask=mask, position_ids=positions)
        past = tiny_model(
            input_ids=ids[:, :4], attention_mask=mask[:, :4], position_ids=positions[:, :4],
            use_cache=True,
        )  # fmt: skip
        rest = prompt_pass(tiny_model, ids, mask, prefix=returned_cache(past))
    torch.testing.assert_close(rest.logits[:, -1], whole.logits[:, -1], atol=1e-5, rtol=0)


def test_the_episodes_benchmark_draws_the_same_episodes_both_ways():
    """``benchmarks/episodes.py`` on the embedded demo: both ways sample the same tokens and
    the parked caches prefill fewer positions (the demo's figures are noise, not checked)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/episodes.py", "--rows", "8", "--new-tokens", "48"]
        + ["--reps", "1", "--threads", "1", "--json"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rows_that_differ"] == 0 and summary["turns_per_episode"] > 1.2
    assert summary["parked_prefill_positions"] < summary["again_prefill_positions"]


def test_a_compiler_error_after_the_prefill_decodes_the_same_episodes(
    tiny_model, tokenizer, monkeypatch
):
    """The CUDA-graph path falls back to the uncompiled step on a compiler error: a call that
    failed after its prefill (which appended to the prefix cache) and after parking rows
    leaves neither behind, and the episodes are those of a path that never failed."""
    real = native.static_decode
    failures = []

    def fails_when_compiling(*args, compile=None, **kwargs):
        if compile is None or kwargs["prefix"] is None:  # the first turn: compiled, say
            return real(*args, **kwargs)
        real(*args, **kwargs)  # prefill, decoding and parking done, then the compiler fails
        failures.append(kwargs["prefix"].get_seq_length())
        raise torch._dynamo.exc.TorchDynamoException("no backend here")

    expected = _episodes(tiny_model, tokenizer, "static", monkeypatch).samples()
    monkeypatch.setattr(native, "static_decode", fails_when_compiling)
    engine, env = _engine(tiny_model, tokenizer, "static", monkeypatch)
    engine.compile_step = True
    runner = EpisodeRunner(engine, tokenizer, env, max_turns=6)
    problems = [PROBLEM, dataclasses.replace(PROBLEM, uid="p1")]
    with pytest.warns(UserWarning, match="torch.compile failed"):
        got = runner.generate(
            problems, ["What is 2 + 3?\n"] * 2, group_size=3, max_new_tokens=40, seed=[5, 6]
        ).samples()
    assert len(failures) == 1 and not engine.compile_step
    for x, y in zip(got, expected, strict=True):
        assert x.response_ids.tolist() == y.response_ids.tolist() and x.trace == y.trace
