"""Multi-turn episodes (dapo.env, dapo.rollout.episodes): the Python tool, the runner's
bounds, and training on episodes whose observations are context, never trained."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY_DEMO
from test_code_task import NAMES, hostile
from test_sandbox import FAST, MARGIN_S, Trap

from dapo.cli import main
from dapo.config import load_config
from dapo.data.batch import Episode, Trace, collate
from dapo.data.problems import Problem
from dapo.env import Environment, History, MathTool, Observation, load_environment
from dapo.env.base import model_text_of
from dapo.env.python_tool import python_blocks
from dapo.eval.metrics import record_metrics
from dapo.models.logprobs import batch_logprobs
from dapo.reward import sandbox
from dapo.reward.tasks import Score
from dapo.rollout import Rollout, make_engine
from dapo.rollout.episodes import (
    CUT_MARKER,
    PAUSES_PER_TURN,
    EpisodeRunner,
    environment_score,
    with_turn_ends,
)
from dapo.training.old_logprobs import fill_logprobs
from dapo.training.rounds import shape_group
from dapo.training.state import build_state
from dapo.training.update import accumulate_gradients

PROBLEM = Problem("p0", ({"role": "user", "content": "Compute 2 + 3."},), "5", "arith")
needs_sandbox = pytest.mark.skipif(
    not sandbox.available_modes(), reason="no sandbox mode works on this machine"
)


def _history(text: str, *, finished: bool = False) -> History:
    return History(PROBLEM, text, text, 1, finished)


# The Python tool ---------------------------------------------------------------------------


def test_python_blocks_finds_closed_blocks_and_a_call_at_the_end():
    text = "Let me compute.\n```python\nx = 6 * 7\n```\n"
    assert python_blocks(text) == (["x = 6 * 7"], True)
    # Two blocks, the second closing the text: both found, a call.
    two = text + "```output\n\n```\nNow:\n```python\nprint(x)\n```"
    assert python_blocks(two) == (["x = 6 * 7", "print(x)"], True)
    # A block still open, another language, text after the fence: no call.
    assert python_blocks("```python\nprint(1)\n") == ([], False)
    assert python_blocks("```text\nhello\n```") == ([], False)
    assert python_blocks("```python\nprint(1)\n```\nAnswer: 1") == (["print(1)"], False)
    # An opening fence alone (the model continues writing the block).
    assert python_blocks("Let me see: ```") == ([], False)
    # A fence inside a line of code is no closing fence: a closing fence is a line of its own.
    literal = '```python\nfence = "```"\nprint(len(fence))\n```'
    assert python_blocks(literal) == (['fence = "```"\nprint(len(fence))'], True)
    assert python_blocks('```python\nfence = "```') == ([], False)
    assert python_blocks("```python\nprint(1)\n  ```  \n") == (["print(1)"], True)
    # A fence after code that leaves no string open closes the block: small models write it.
    assert python_blocks("```python\nprint(37 * 48)```") == (["print(37 * 48)"], True)
    assert python_blocks("```python\nprint(1)  # it's```") == (["print(1)  # it's"], True)
    assert python_blocks("```python\nprint(len('```')) ```") == (["print(len('```'))"], True)


def test_a_turn_after_an_observation_that_ends_its_line_starts_a_line():
    """The model saw its second turn start on a fresh line (the observation ended one): in
    the model's text it does too. Glued to the first block's closing fence, that fence no
    longer closed a block, and the second call ran both blocks and the prose between them."""
    segments = [
        ("```python\nprint(6 * 7)\n```", False),
        ("\n```output\n42\n```\n", True),
        ("Answer: 42\n```python\nprint(42 * 1)\n```", False),
    ]
    text = model_text_of(segments)
    assert text == "```python\nprint(6 * 7)\n```\nAnswer: 42\n```python\nprint(42 * 1)\n```"
    assert python_blocks(text) == (["print(6 * 7)", "print(42 * 1)"], True)
    # An observation that leaves its line open, or a turn that ended one: nothing added.
    assert model_text_of([(" 2 =", False), (" 5 ?", True), (" 3", False)]) == " 2 = 3"
    assert model_text_of([("a\n", False), ("b\n", True), ("c", False)]) == "a\nc"


def test_turn_ends_that_match_no_token_are_refused(tokenizer):
    class Typo(Environment):
        turn_ends = ("<<call>>",)

    with pytest.raises(ValueError, match=r"turn_ends \['<<call>>'\] match no token"):
        with_turn_ends([tokenizer.eos_token_id], tokenizer, Typo())

    class OneOfTwo(Environment):  # "?" ends turns; the typo was dropped without a word
        turn_ends = ("?", "<<call>>")

    assert tokenizer.convert_tokens_to_string(tokenizer.tokenize("?")).strip() == "?"
    with pytest.raises(ValueError, match=r"turn_ends \['<<call>>'\] match no token"):
        with_turn_ends([tokenizer.eos_token_id], tokenizer, OneOfTwo())


@needs_sandbox
def test_the_tool_runs_a_call_keeps_state_by_replay_and_reports_errors():
    tool = MathTool()
    first = tool.step(_history("```python\nx = 123 * 456\nprint(x)\n```"))
    assert first.text == "\n```output\n56088\n```\n"
    assert (first.tool_call, first.error, first.done) == (True, False, False)
    # The second call sees x (the first block is replayed, its output discarded).
    text = "```python\nx = 123 * 456\nprint(x)\n```\nthen\n```python\nprint(x + 1)\n```\n"
    assert tool.step(_history(text)).text == "\n```output\n56089\n```\n"
    failed = tool.step(_history("```python\nprint(1 / 0)\n```"))
    assert failed.error and "ZeroDivisionError: division by zero" in failed.text
    # No call: the model goes on with nothing added; the end of its message ends the episode.
    assert tool.step(_history("I think ```")) == Observation()
    assert tool.step(_history("Answer: 5", finished=True)).done


@needs_sandbox
def test_the_tool_stops_hostile_code_at_its_deadline_and_limits():
    tool = MathTool(load_config(None, ["env.tool_wall_s=1.0"]).env)
    loop = tool.step(_history("```python\nwhile True:\n    pass\n```"))
    assert loop.error and "ran past 1 s" in loop.text and loop.seconds < 5
    flood = tool.step(_history("```python\nprint('x' * 10**6)\n```"))
    assert flood.tool_call and len(flood.text) < 2100  # cut to MAX_OUTPUT_CHARS
    escape = tool.step(_history("```python\nimport os\nos.system('touch /tmp/dapo-escape')\n```"))
    assert escape.error and "PermissionError" in escape.text
    assert not Path("/tmp/dapo-escape").exists()
    memory = tool.step(_history("```python\nx = [0] * 10**9\n```"))
    assert memory.error and "MemoryError" in memory.text


@needs_sandbox
def test_environments_load_by_name_and_from_a_file(tmp_path):
    assert load_environment("") is None
    assert isinstance(load_environment("math_tool"), MathTool)
    path = tmp_path / "envs.py"
    path.write_text(
        "from dapo.env import Environment, Observation\n"
        "class Echo(Environment):\n"
        "    turn_ends = ('=',)\n"
        "    def step(self, history):\n"
        "        return Observation(text=' 5', done=history.turns > 1)\n"
        "not_an_env = 3\n"
    )
    assert type(load_environment(f"{path}:Echo")).__name__ == "Echo"
    with pytest.raises(ValueError, match=r"env.class=.*is a int; give env.class as a built-in"):
        load_environment(f"{path}:not_an_env")
    with pytest.raises(ValueError, match=r"env.class=.*has no 'Missing'"):
        load_environment(f"{path}:Missing")


# The runner, on an engine that writes a fixed turn ----------------------------------------


class FixedTurns:
    """An engine whose every turn is ``turn`` (cut at max_new_tokens, truncated then)."""

    exact_logprobs = True

    def __init__(self, turn: list[int], stops: list[int], pad: int) -> None:
        self.turn, self.stop_token_ids, self.pad = turn, tuple(stops), pad
        self.contexts: list[list[int]] = []
        self.seeds: list[int] = []

    def generate(self, prompts, *, group_size, max_new_tokens, seed=0, **_):
        rows = len(prompts) * group_size
        self.seeds += [seed] if isinstance(seed, int) else list(seed)
        ids = self.turn[:max_new_tokens]
        stopped = ids[-1] in self.stop_token_ids
        if not isinstance(prompts[0], str):
            self.contexts += [list(p) for p in prompts]
        prompt = torch.tensor([[7, 8]] * rows)
        return Rollout(
            prompt_ids_BP=prompt,
            prompt_mask_BP=torch.ones_like(prompt),
            response_ids_BT=torch.tensor([ids] * rows),
            response_mask_BT=torch.ones((rows, len(ids)), dtype=torch.bool),
            logprobs_BT=torch.full((rows, len(ids)), -0.5),
            lengths_B=torch.full((rows,), len(ids)),
            truncated_B=torch.full((rows,), not stopped),
            texts=[""] * rows,
            slots=rows * len(ids),
        )


class Says(Environment):
    """Ends a turn at "=", answers ``text`` to every turn."""

    turn_ends = ("=",)

    def __init__(self, text: str = " 5 ?") -> None:
        self.text = text

    def step(self, history: History) -> Observation:
        if history.finished:
            return Observation(done=True)
        return Observation(self.text, tool_call=True)


def _runner(tokenizer, turn: str, env: Environment, **bounds) -> tuple[EpisodeRunner, list]:
    stops = with_turn_ends([tokenizer.eos_token_id], tokenizer, env)
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    engine = FixedTurns(ids, stops, tokenizer.pad_token_id)
    return EpisodeRunner(engine, tokenizer, env, **bounds), ids


def test_turns_and_observations_alternate_within_max_turns(tokenizer):
    runner, turn = _runner(tokenizer, " 2 + 3 =", Says(), max_turns=3)
    ro = runner.generate([PROBLEM], ["x"], group_size=2, max_new_tokens=100, seed=[1])
    obs = tokenizer(" 5 ?", add_special_tokens=False)["input_ids"]
    (a, b) = ro.samples()
    assert a.response_ids.tolist() == turn + obs + turn + obs + turn
    assert a.env_mask.tolist() == [False] * 4 + [True] * 2 + [False] * 4 + [True] * 2 + [False] * 4
    assert a.logprobs.tolist() == [-0.5] * 4 + [0.0] * 2 + [-0.5] * 4 + [0.0] * 2 + [-0.5] * 4
    assert (
        a.trace
        == b.trace
        == Trace(turns=3, env_tokens=4, tool_calls=2, transcript=" 2 + 3 = 5 ? 2 + 3 = 5 ? 2 + 3 =")
    )
    assert a.text == " 2 + 3 = 2 + 3 = 2 + 3 ="  # the model's text alone: what is graded
    assert not a.truncated  # max_turns ends the episode, not L_max
    # Each later turn continues from the row's own tokens so far, prompt first.
    assert runner.engine.contexts[:2] == [[7, 8, *turn, *obs]] * 2


def test_an_episode_stops_at_l_max_counting_the_observations(tokenizer):
    runner, turn = _runner(tokenizer, " 2 + 3 =", Says(), max_turns=8)
    ro = runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=9, seed=[1])
    (a,) = ro.samples()
    # 4 model tokens, 2 observation tokens, then 3 of the next turn's 4: truncated at 9.
    assert len(a.response_ids) == 9 and a.truncated
    assert a.env_mask.tolist() == [False] * 4 + [True] * 2 + [False] * 3
    # An observation that fills what is left ends the episode, truncated.
    runner, _ = _runner(tokenizer, " 2 + 3 =", Says(" 5 5 5 5 5"), max_turns=8)
    (b,) = runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=7, seed=[1]).samples()
    assert b.env_mask.tolist() == [False] * 4 + [True] * 3 and b.truncated


def test_a_turn_end_at_l_max_runs_no_tool(tokenizer):
    """The model's turn fills L_max and ends at a turn end: there is no room for an answer,
    so the tool does not run (it ran, took its time and counted as a call)."""
    runner, turn = _runner(tokenizer, " 2 + 3 =", Says(), max_turns=8)
    (a,) = runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=4, seed=[1]).samples()
    assert a.response_ids.tolist() == turn and a.truncated
    assert a.trace == Trace(turns=1, env_tokens=0, tool_calls=0, transcript=" 2 + 3 =")


class Hangs(Environment):
    """Its step never returns on row "slow" (a regex that backtracks on the model's text), and
    raises on row "bad"."""

    turn_ends = ("=",)

    def step(self, history: History) -> Observation:
        if history.problem.uid == "bad":
            raise KeyError("boom")
        if history.problem.uid == "slow":
            time.sleep(30)
        return Observation(" 5 ?")


def test_a_step_past_its_deadline_or_raising_stops_the_run_naming_the_row(tokenizer):
    runner, _ = _runner(tokenizer, " 2 + 3 =", Hangs(), max_turns=3, step_timeout_s=0.5)
    slow = dataclasses.replace(PROBLEM, uid="slow")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"Hangs.step ran past env.step_timeout_s=0.5 s"):
        runner.generate([PROBLEM, slow], ["x", "y"], group_size=2, max_new_tokens=50, seed=[1, 2])
    assert time.monotonic() - started < 5  # the thread is left behind, a daemon
    bad = dataclasses.replace(PROBLEM, uid="bad")
    with pytest.raises(RuntimeError, match=r"Hangs.step raised on row bad \(turn 1\): KeyError"):
        runner.generate([PROBLEM, bad], ["x", "y"], group_size=2, max_new_tokens=50, seed=[1, 2])
    with pytest.raises(ValueError, match="env.step_timeout_s=2 must be above env.tool_wall_s=3"):
        load_config(None, ["env.step_timeout_s=2", "env.tool_wall_s=3"])


class PausesThenSays(Environment):
    """Answers nothing to every other stop (as the Python tool answers an opening fence),
    and `` 5 ?`` to the others."""

    turn_ends = ("=",)

    def step(self, history: History) -> Observation:
        if history.finished:
            return Observation(done=True)
        if history.model_text.count("=") % 2:
            return Observation()
        return Observation(" 5 ?", tool_call=True)


def test_a_stop_answered_with_nothing_is_a_pause_not_a_turn(tokenizer):
    """A python block's opening fence stops the model and the tool answers nothing: that cost
    a turn, so each block took two of env.max_turns."""
    runner, turn = _runner(tokenizer, " 2 + 3 =", PausesThenSays(), max_turns=2)
    (a,) = runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=100, seed=[1]).samples()
    obs = tokenizer(" 5 ?", add_special_tokens=False)["input_ids"]
    assert a.response_ids.tolist() == turn + turn + obs + turn
    assert (a.trace.turns, a.trace.tool_calls, a.truncated) == (2, 1, False)
    # Each draw has a seed of its own: the rest of a paused turn does not repeat its draws.
    assert len(set(runner.engine.seeds)) == len(runner.engine.seeds) == 3


def test_pauses_are_bounded(tokenizer):
    """A model that stops at fence after fence would cost a generate call per stop up to
    L_max: an episode pauses at most PAUSES_PER_TURN x max_turns times."""

    class Silent(Says):
        def step(self, history: History) -> Observation:
            return Observation(done=history.finished)

    runner, turn = _runner(tokenizer, " 2 + 3 =", Silent(), max_turns=2)
    (a,) = runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=1000, seed=[1]).samples()
    draws = PAUSES_PER_TURN * 2 + 1
    assert a.response_ids.tolist() == turn * draws and not a.truncated
    assert a.trace.turns == 1 and len(runner.engine.seeds) == draws


def test_a_long_observation_is_cut_with_a_marker(tokenizer):
    runner, _ = _runner(tokenizer, " 2 =", Says(" 1" * 50), max_observation_tokens=12)
    marker = tokenizer(CUT_MARKER, add_special_tokens=False)["input_ids"]
    ids = runner.observation_ids(" 1" * 50)
    assert len(ids) == 12 and ids[-len(marker) :] == marker
    assert (
        runner.observation_ids(" 1 1") == tokenizer(" 1 1", add_special_tokens=False)["input_ids"]
    )


def test_the_engine_must_stop_at_the_turn_ends(tokenizer):
    env = Says()
    engine = FixedTurns([5], [tokenizer.eos_token_id], tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="with_turn_ends"):
        EpisodeRunner(engine, tokenizer, env)


class Ends(Environment):
    """Ends every episode at its first turn with ``reward``."""

    turn_ends = ("=",)

    def __init__(self, reward: object) -> None:
        self.reward = reward

    def step(self, history: History) -> Observation:
        return Observation(done=True, reward=self.reward)


@pytest.mark.parametrize(("reward", "score"), [(None, -1.0), (2.5, 2.5), (-1000, -1000.0)])
def test_an_episodes_reward_takes_the_verifiers_place(tokenizer, reward, score):
    runner, _ = _runner(tokenizer, " 2 + 3 =", Ends(reward), max_abs=1000)
    (a,) = runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=20, seed=[1]).samples()
    verified = Score(score=-1.0, correct=False, pred="4")
    assert a.trace.reward == reward
    assert environment_score(a.trace, verified) == Score(score, score > 0, "4")


def test_a_numpy_or_torch_reward_is_kept_as_a_float_that_saves(tokenizer):
    """A numpy or torch scalar passed the reward's check but stayed in the trace, and the JSON
    of the rollouts an async run saves or sends raised (TypeError: float32)."""
    import json

    import numpy as np

    for reward in (np.float32(0.5), torch.tensor(0.5)):
        runner, _ = _runner(tokenizer, " 2 + 3 =", Ends(reward), max_abs=1000)
        (a,) = runner.generate(
            [PROBLEM], ["x"], group_size=1, max_new_tokens=20, seed=[1]
        ).samples()
        assert type(a.trace.reward) is float and a.trace.reward == 0.5
        assert json.loads(json.dumps(dataclasses.asdict(a.trace)))["reward"] == 0.5


def test_an_observation_that_spells_a_special_token_gives_plain_text(tokenizer):
    """A tool printing the EOS token's text (or <|im_end|>) made the real special token: an end
    or a chat turn the model never wrote, hidden from the transcript."""
    eos = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
    runner, _ = _runner(tokenizer, " 2 + 3 =", Says(f" {eos} 5"))
    ids = runner.observation_ids(f" {eos} 5")
    assert tokenizer.eos_token_id not in ids and ids[-1] == tokenizer(" 5")["input_ids"][-1]
    assert tokenizer.eos_token_id in tokenizer(f" {eos} 5", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, 1000.5, "high", [1.0]])
def test_a_reward_that_would_poison_the_advantages_stops_the_run_naming_the_row(tokenizer, reward):
    # A verifier's NaN or 1e200 is a fault; an environment's reward replaces the verifier's,
    # so it meets the same bound (one NaN makes its group's advantages NaN, 1e200 zeroes them).
    runner, _ = _runner(tokenizer, " 2 + 3 =", Ends(reward), max_abs=1000)
    with pytest.raises(
        ValueError,
        match=r"Ends.step ended row p0 \(turn 1\) with reward .*"
        r"within reward.max_abs=1000 .*scale it, or raise reward.max_abs",
    ):
        runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=20, seed=[1])


# Episodes on a real model: log-probs, seeds, the loss -------------------------------------


class Hints(Environment):
    """Ends a turn at any of several common pieces and answers a fixed hint: a random tiny
    model writes them often, so its episodes have several turns."""

    turn_ends = ("+", "=", "?", ".", ":")

    def step(self, history: History) -> Observation:
        return Observation(" 4 +", tool_call=True)


def _episodes(model, tokenizer, problems, seeds, **bounds) -> Rollout:
    env = Hints()
    stops = with_turn_ends([tokenizer.eos_token_id], tokenizer, env)
    runner = EpisodeRunner(make_engine("dapo", model, tokenizer, stops), tokenizer, env, **bounds)
    prompts = ["What is 2 + 3?\n"] * len(problems)
    return runner.generate(problems, prompts, group_size=3, max_new_tokens=40, seed=seeds)


def test_a_problems_episodes_do_not_depend_on_the_rows_beside_them(tiny_model, tokenizer):
    other = dataclasses.replace(PROBLEM, uid="p1")
    both = _episodes(tiny_model, tokenizer, [PROBLEM, other], [11, 12], max_turns=6).samples()
    alone = _episodes(tiny_model, tokenizer, [PROBLEM], [11], max_turns=6).samples()
    assert sum(s.trace.turns > 1 for s in both) >= 3  # the test exercises continuations
    for x, y in zip(alone, both[:3], strict=True):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        # Padded beside other prompts, the sums round differently: the same to float noise.
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def _as_episodes(ro: Rollout) -> list[Episode]:
    out = []
    for s in ro.samples():
        out.append(
            Episode(
                s.prompt_ids, s.response_ids, s.logprobs, s.truncated, True, 1.0,
                env_mask=s.env_mask, trace=s.trace,
            )
        )  # fmt: skip
    return out


def test_sampler_logprobs_of_model_tokens_match_a_forward_pass(tiny_model, tokenizer):
    episodes = _as_episodes(_episodes(tiny_model, tokenizer, [PROBLEM], [5], max_turns=6))
    assert sum(e.env_tokens for e in episodes) > 0
    cfg = load_config(None, ["train.tokens_per_microbatch=4096"])
    state = build_state(cfg, tiny_model, tokenizer, [PROBLEM])
    fill_logprobs(tiny_model, episodes, "old_logprobs", state, list(range(len(episodes))))
    for e in episodes:
        model = e.model_mask()
        torch.testing.assert_close(
            e.old_logprobs[model], e.sampler_logprobs[model], atol=2e-5, rtol=0
        )
        assert (e.sampler_logprobs[e.env_mask] == 0).all()


def test_observation_tokens_get_no_gradient_and_no_share_of_the_divisor(tiny_model, tokenizer):
    """The gradient of episodes with observations equals the gradient of the same tokens
    with the observations masked out of the loss by hand: -(1/N) sum A grad log pi over the
    model's tokens, N their count, at pi = pi_old."""
    episodes = _as_episodes(_episodes(tiny_model, tokenizer, [PROBLEM], [5], max_turns=6))
    for i, e in enumerate(episodes):
        e.advantage = [1.0, -0.5, 0.25][i]
    cfg = load_config(None, ["train.tokens_per_microbatch=4096"])
    state = build_state(cfg, tiny_model, tokenizer, [PROBLEM])
    fill_logprobs(tiny_model, episodes, "old_logprobs", state, list(range(len(episodes))))
    num_tokens = sum(e.num_loss_tokens for e in episodes)
    assert num_tokens == sum(e.length - e.env_tokens for e in episodes)
    tiny_model.zero_grad(set_to_none=True)
    accumulate_gradients(state, episodes, list(range(3)), num_tokens=num_tokens, num_seqs=3).read()
    got = [p.grad.clone() for p in tiny_model.parameters()]

    tiny_model.zero_grad(set_to_none=True)
    plain = [dataclasses.replace(e, env_mask=None, trace=None) for e in episodes]
    b = collate(plain, pad_id=tokenizer.pad_token_id)
    hand_BT = b.response_mask_BT.clone()
    for row, e in enumerate(episodes):
        hand_BT[row, : e.length] &= ~e.env_mask
    logp_BT, _ = batch_logprobs(tiny_model, b)
    (-(b.advantages_B[:, None] * logp_BT * hand_BT).sum() / hand_BT.sum()).backward()
    for a, h in zip(got, (p.grad for p in tiny_model.parameters()), strict=True):
        torch.testing.assert_close(a, h, rtol=1e-4, atol=1e-7)


def test_overlong_shaping_counts_the_models_tokens_and_a_truncated_episode_is_past_l_max():
    cfg = load_config(None, ["rollout.max_new_tokens=20", "algo.l_cache=4"])
    g = torch.Generator().manual_seed(0)

    def episode(model: int, env: int, truncated: bool = False) -> Episode:
        mask = torch.tensor([False] * model + [True] * env)
        ids = torch.randint(5, 60, (model + env,), generator=g)
        return Episode(
            torch.tensor([1, 2]), ids, torch.zeros(model + env), truncated, True, 1.0,
            env_mask=mask, trace=Trace(turns=2, env_tokens=env),
        )  # fmt: skip

    # 14 model tokens and 6 of the environment's reach L_max = 20; the soft punishment
    # counts 14 (free up to 16). 18 model tokens: -1/4 per token past 16. Truncated at L_max
    # with 8 of the model's: past L_max, -1 as a truncated response (it scored +1: free).
    eps = [episode(14, 6), episode(18, 2), episode(8, 12, truncated=True)]
    shape_group(eps, cfg.algo, l_max=20)
    assert [e.reward for e in eps] == [1.0, 0.5, 0.0]
    b = collate(eps, pad_id=0)
    assert b.loss_mask_BT.sum(dim=1).tolist() == [14, 18, 8]
    assert b.response_mask_BT.sum(dim=1).tolist() == [20, 20, 20]
    assert [e.num_loss_tokens for e in eps] == [14, 18, 8]


# The command line ------------------------------------------------------------------------


def test_a_bad_env_class_stops_the_run_before_the_model_loads(tmp_path, capsys):
    args = [*TINY_DEMO, "train.steps=1", f"run.out_dir={tmp_path}", "run.name=r"]
    assert main(["train", *args, f"env.class={tmp_path}/absent.py:Tool"]) == 2
    err = capsys.readouterr().err
    assert "env.class=" in err and "absent.py" in err and "give env.class as" in err
    assert not (tmp_path / "r").exists()


def test_a_resume_refuses_an_environment_that_came_with_the_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "r"
    args = [*TINY_DEMO, "train.steps=1", f"run.out_dir={tmp_path}", "run.name=r"]
    assert main(["train", *args]) == 0
    planted = run_dir / "planted.py"
    planted.write_text("from dapo.env import Environment\nclass E(Environment):\n    pass\n")
    capsys.readouterr()
    code = main(["train", "--resume", str(run_dir), f"env.class={planted}:E", "--force"])
    assert code == 2
    assert "env.class=" in capsys.readouterr().err


@pytest.fixture
def trap(tmp_path, monkeypatch):
    trap = Trap(tmp_path, monkeypatch)
    yield trap
    trap.close()


@needs_sandbox
@pytest.mark.parametrize("name", NAMES)
def test_hostile_tool_calls_end_in_the_sandbox_as_observations(name, trap):
    """The code task's hostile programs, called as the tool: each comes back as an
    observation within its deadline (an error where the sandbox stopped it), and nothing
    escapes."""
    response, _ = hostile(trap)[name]
    tool = MathTool(load_config(None, [f"env.tool_wall_s={FAST.wall_s}"]).env)
    start = time.monotonic()
    answer = tool.step(_history(response.removesuffix("\nIt adds.")))  # ends at the fence
    assert time.monotonic() - start < FAST.wall_s + MARGIN_S
    assert answer.tool_call and not answer.done and answer.text.startswith("\n```output\n")
    assert len(answer.text) < 2100
    if name not in ("exit 0 before the tests", "daemon"):  # these two exit normally
        assert answer.error, answer
    assert trap.escaped() == []


TOOL_USER = """
import time
from dapo.data.problems import Problem
from dapo.env import History, MathTool
if __name__ == "__main__":
    tool = MathTool()
    history = History(Problem("u", (), ""), "```python\\nprint(6 * 7)\\n```", "", 1, False)
    print(tool.step(history).text.strip(), flush=True)
    time.sleep(300)
"""


@needs_sandbox
def test_a_trainer_killed_with_9_leaves_no_tool_helper_behind(tmp_path):
    """The tool's helper processes end with the process that made them: none keeps its
    stdout open (a test harness, a shell pipe would wait for it forever)."""
    script = tmp_path / "tool_user.py"
    script.write_text(TOOL_USER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=env,
    )  # fmt: skip
    lines = [proc.stdout.readline() for _ in range(3)]
    assert "42\n" in lines
    proc.kill()
    proc.wait()
    reader = threading.Thread(target=proc.stdout.read, daemon=True)
    reader.start()
    reader.join(timeout=10)  # EOF: every holder of the pipe is gone
    assert not reader.is_alive(), "a helper of the tool outlived the killed process"


def test_an_evaluation_record_of_episodes_counts_its_tool_calls():
    record = {
        "correct": [True, False, True],
        "answers": ["6", "5", "6"],
        "lengths": [9, 4, 9],
        "truncated": [False, False, False],
        "responses": ["```python\nprint(2 * 3)\n```Answer: 6", "Answer: 5", "Answer: 6"],
        "tool_calls": [1, 0, 2],
    }
    assert record_metrics(record, ks=[1, 3])["tool_call_frac"] == pytest.approx(2 / 3)
    del record["tool_calls"]  # single-turn samples: no such figure
    assert "tool_call_frac" not in record_metrics(record, ks=[1, 3])


def test_a_checkpoints_episodes_keep_their_masks_and_a_mismatch_is_refused():
    from dapo.run.checkpoint import CheckpointError
    from dapo.training.rollout_files import rollouts_from_files, rollouts_to_files
    from dapo.training.sampling import Group, SamplingResult
    from dapo.training.sources import StepRollouts

    mask = torch.tensor([False, False, True, True, False])
    episode = Episode(
        torch.tensor([1, 2]), torch.tensor([5, 6, 7, 8, 9]), torch.zeros(5), False, True, 1.0,
        env_mask=mask, trace=Trace(turns=2, env_tokens=2, tool_calls=1, transcript="x"),
    )  # fmt: skip
    group = Group("g", [episode])
    drawn = StepRollouts(0, 0, SamplingResult([group], rounds=1, generated=[group]), {}, 0.0, 0.0)
    meta, tensors = rollouts_to_files([drawn])
    (back,) = rollouts_from_files(meta, tensors, "file").pop().result.generated
    assert back.episodes[0].env_mask.tolist() == mask.tolist()
    assert back.episodes[0].trace == episode.trace
    meta[0]["groups"][0]["episodes"][0]["trace"]["env_tokens"] = 0  # the count, tampered with
    with pytest.raises(CheckpointError, match="does not match"):
        rollouts_from_files(meta, tensors, "file")


def test_a_tampered_rollouts_file_is_refused_never_a_wrong_rollout():
    """Each of these was restored as it was: observations trained without their trace, one
    episode's log-probs shifted against its tokens, a NaN reward, a "no" for correct, and a
    group kept twice."""
    import copy

    from dapo.run.checkpoint import CheckpointError
    from dapo.training.rollout_files import rollouts_from_files, rollouts_to_files
    from dapo.training.sampling import Group, SamplingResult
    from dapo.training.sources import StepRollouts

    mask = torch.tensor([False, False, True, True, False])
    trace = Trace(turns=2, env_tokens=2, tool_calls=1, transcript="x")
    first = Episode(
        torch.tensor([1, 2]), torch.tensor([5, 6, 7, 8, 9]), torch.zeros(5), False, True, 1.0,
        env_mask=mask, trace=trace,
    )  # fmt: skip
    second = Episode(
        torch.tensor([1, 2]), torch.tensor([5, 6, 7]), -torch.ones(3), False, False, -1.0
    )
    group = Group("g", [first, second])
    drawn = StepRollouts(0, 0, SamplingResult([group], rounds=1, generated=[group]), {}, 0.0, 0.0)
    meta, tensors = rollouts_to_files([drawn])

    def tampered(edit_meta=None, edit_tensors=None):
        m, t = copy.deepcopy(meta), {k: v.clone() for k, v in tensors.items()}
        if edit_meta:
            edit_meta(m[0])
        if edit_tensors:
            edit_tensors(t)
        with pytest.raises(CheckpointError, match="does not match"):
            rollouts_from_files(m, t, "file")

    episodes = lambda m: m["groups"][0]["episodes"]  # noqa: E731
    tampered(lambda m: episodes(m)[0].pop("trace"))  # the mask would be dropped
    tampered(edit_tensors=lambda t: t["sampler_logprobs_lengths"].copy_(torch.tensor([4, 4])))
    tampered(edit_tensors=lambda t: t.update(response_ids=t["response_ids"].float()))
    tampered(lambda m: episodes(m)[1].update(reward=float("nan")))
    tampered(lambda m: episodes(m)[1].update(correct="no"))
    tampered(lambda m: m.update(kept=[0, 0]))
    tampered(lambda m: m.update(kept=[-1]))
    (back,) = rollouts_from_files(meta, tensors, "file")  # the file as written: as it was
    assert back.result.generated[0].episodes[1].sampler_logprobs.tolist() == [-1.0] * 3
