"""Environments as a review found them wanting: a pause answered to an end of message at
L_max asked the engine for 0 tokens; a megabyte observation was tokenized whole before it
was cut; an Observation of the wrong types, messages() that is no list of messages, and a
constructor that raises failed deep inside, naming neither the environment nor the row."""

from __future__ import annotations

import pytest
from test_env import PROBLEM, FixedTurns, Says

from dapo.env import Environment, History, Observation, load_environment
from dapo.rollout.episodes import CHARS_PER_TOKEN, CUT_MARKER, EpisodeRunner, with_turn_ends


class Quiet(Environment):
    """Answers every turn with nothing: a pause (as math_tool answers a bare fence)."""

    turn_ends = ("=",)

    def step(self, history: History) -> Observation:
        return Observation()


class Asks(FixedTurns):
    """:class:`FixedTurns` that refuses a call for no tokens, as dapo's engines do."""

    def generate(self, prompts, *, group_size, max_new_tokens, **kwargs):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return super().generate(
            prompts, group_size=group_size, max_new_tokens=max_new_tokens, **kwargs
        )


def test_a_pause_after_an_end_of_message_at_l_max_ends_the_episode(tokenizer):
    env = Quiet()
    stops = with_turn_ends([tokenizer.eos_token_id], tokenizer, env)
    turn = [*tokenizer(" 2 + 3", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    engine = Asks(turn, stops, tokenizer.pad_token_id)
    runner = EpisodeRunner(engine, tokenizer, env, max_turns=3)
    ro = runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=len(turn), seed=[1])
    (sample,) = ro.samples()
    assert sample.response_ids.tolist() == turn
    assert not bool(ro.truncated_B[0])  # the message ended within L_max
    assert engine.seeds == [1]  # one call: no second one for 0 tokens


class Counting:
    """A tokenizer that records the length of every text it is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_huge_observation_is_cut_before_it_is_tokenized(tokenizer):
    counting = Counting(tokenizer)
    runner = EpisodeRunner(Asks([1], [2], 0), counting, Environment(), max_observation_tokens=16)
    text = " 1" * 2_000_000  # 4 MB of tool output
    ids = runner.observation_ids(text)
    marker = tokenizer(CUT_MARKER, add_special_tokens=False)["input_ids"]
    head = tokenizer(" 1" * 64, add_special_tokens=False)["input_ids"]
    assert ids == head[: 16 - len(marker)] + marker
    assert max(counting.lengths) == 16 * CHARS_PER_TOKEN  # not 4 MB
    # Short observations are as before: whole, no marker.
    assert (
        runner.observation_ids(" 1 2") == tokenizer(" 1 2", add_special_tokens=False)["input_ids"]
    )


class Wrong(Says):
    """Answers with an Observation whose field ``name`` is ``value``."""

    def __init__(self, name: str, value) -> None:
        super().__init__()
        self.name, self.value = name, value

    def step(self, history: History) -> Observation:
        return Observation(**{"text": " 5 ?", self.name: self.value})


@pytest.mark.parametrize(
    "name,value,says",
    [
        ("text", 12345, "Observation.text is int '12345', not str"),
        ("text", b"5", "Observation.text is bytes \"b'5'\", not str"),
        ("seconds", None, "Observation.seconds is NoneType, not a number of seconds"),
        ("tool_call", "yes", "Observation.tool_call is str 'yes', not bool"),
    ],
)
def test_an_observation_of_the_wrong_types_names_the_environment_and_row(
    tokenizer, name, value, says
):
    env = Wrong(name, value)
    stops = with_turn_ends([tokenizer.eos_token_id], tokenizer, env)
    turn = tokenizer(" 2 + 3 =", add_special_tokens=False)["input_ids"]
    runner = EpisodeRunner(FixedTurns(turn, stops, tokenizer.pad_token_id), tokenizer, env)
    with pytest.raises(TypeError) as err:
        runner.generate([PROBLEM], ["x"], group_size=1, max_new_tokens=50, seed=[1])
    assert str(err.value) == f"env.class: Wrong.step on row p0: {says}"


class Messages(Environment):
    def __init__(self, messages) -> None:
        self.given = messages

    def messages(self, problem):
        if isinstance(self.given, Exception):
            raise self.given
        return self.given


def test_messages_that_are_no_list_of_messages_name_the_environment_and_row(tokenizer):
    runner = EpisodeRunner(FixedTurns([1], [2], 0), tokenizer, Messages("Compute 2 + 3."))
    with pytest.raises(TypeError) as err:
        runner.staged(PROBLEM)
    assert str(err.value) == (
        "env.class: Messages.messages on row p0 returned str 'Compute 2 + 3.'; return a "
        'non-empty list of messages, each {"role": str, "content": str}'
    )
    runner = EpisodeRunner(FixedTurns([1], [2], 0), tokenizer, Messages(ValueError("bad")))
    with pytest.raises(RuntimeError, match=r"Messages.messages on row p0 raised ValueError: bad"):
        runner.staged(PROBLEM)
    fine = [{"role": "user", "content": "2 + 3?"}]
    runner = EpisodeRunner(FixedTurns([1], [2], 0), tokenizer, Messages(fine))
    assert runner.staged(PROBLEM).messages == tuple(fine)


def test_a_constructor_that_raises_is_named_with_the_setting(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(
        "from dapo.env import Environment\n\n"
        "class Picky(Environment):\n"
        "    def __init__(self, settings):\n"
        "        raise RuntimeError('unknown option 8')\n"
    )
    with pytest.raises(ValueError) as err:
        load_environment(f"{path}:Picky", settings=None)
    assert str(err.value) == (
        f"env.class='{path}:Picky': constructing Picky raised RuntimeError: unknown option 8"
    )
