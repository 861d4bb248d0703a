from pathlib import Path

import pytest

from dapo.config import load_config
from dapo.data.problems import PromptSampler
from dapo.data.prompts import PROMPT_PREFIX, PROMPT_SUFFIX, render_prompt
from dapo.reward.tasks import get_verifier
from dapo.reward.tasks.arith import make_splits, worked_solution


def test_worked_solution_is_graded_correct():
    text, answer = worked_solution([7, 3, 2, 5], ["+", "-", "+"])
    assert text == "7 + 3 = 10\n10 - 2 = 8\n8 + 5 = 13\nAnswer: 13"
    assert answer == 13
    direct, _ = worked_solution([7, 3, 2, 5], ["+", "-", "+"], style="direct")
    assert direct == "7 + 3 - 2 + 5 = 13\nAnswer: 13"
    assert get_verifier("arith")(text, "13").correct
    assert not get_verifier("arith")(text, "12").correct


def _contents(pairs):
    return {p.messages[0]["content"] for p, _ in pairs}


def test_splits_are_disjoint_deterministic_and_in_the_dapo_format():
    train, val, warmup = make_splits(500, 200, 300, seed=5)
    again, val_again, _ = make_splits(900, 200, seed=5)
    assert len(train) == 500 and len(val) == 200 and len(warmup) == 300
    assert [p.messages for p, _ in val] == [p.messages for p, _ in val_again]  # held-out fixed
    assert [p.messages for p, _ in train] == [p.messages for p, _ in again[:500]]
    # The warm-start never sees an RL or held-out problem, and RL never a held-out one.
    assert not _contents(train) & _contents(val)
    assert not _contents(warmup) & (_contents(train) | _contents(val))
    for p, solution in train[:50]:
        content = p.messages[0]["content"]
        assert content.startswith(PROMPT_PREFIX) and content.endswith(PROMPT_SUFFIX)
        assert get_verifier("arith")(solution, p.answer).correct


def test_tokenizer_round_trips_task_text(tokenizer):
    train, _, _ = make_splits(100, 10, seed=0, operators="+-", style="steps")
    for p, solution in train:
        text = render_prompt(tokenizer, p) + solution
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_sampler_epochs_are_permutations_and_resumable():
    train, _, _ = make_splits(10, 1, seed=0)
    problems = [p for p, _ in train]
    s = PromptSampler(problems, seed=3)
    first = s.next(10)
    assert sorted(p.uid for p in first) == sorted(p.uid for p in problems)
    s.next(4)
    state = s.state_dict()
    rest = s.next(9)
    s2 = PromptSampler(problems, seed=3)
    s2.load_state_dict(state)
    assert [p.uid for p in s2.next(9)] == [p.uid for p in rest]


def test_a_cursor_saved_over_other_problems_is_refused():
    """A resume after the train file changed: fewer problems made the cursor point past the
    list (IndexError after the model loaded); as many other problems silently drew other
    prompts than the run it continued."""
    import dataclasses

    train, _, _ = make_splits(10, 1, seed=0)
    problems = [p for p, _ in train]
    s = PromptSampler(problems, seed=3)
    s.next(15)
    state = s.state_dict()
    assert (state["epoch"], state["pos"], state["problems"]) == (1, 5, 10)
    with pytest.raises(ValueError, match="saved drawing from 10 training problems .* reads 4"):
        PromptSampler(problems[:4], seed=3).load_state_dict(state)
    edited = [*problems[:9], dataclasses.replace(problems[9], answer="another")]
    with pytest.raises(ValueError, match="data.train_file changed since"):
        PromptSampler(edited, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"position 11\) is not within the 10"):
        PromptSampler(problems, seed=3).load_state_dict({"epoch": 0, "pos": 11})
    old = {"epoch": 1, "pos": 5}  # a checkpoint from before the count and digest were saved
    s2 = PromptSampler(problems, seed=3)
    s2.load_state_dict(old)
    assert [p.uid for p in s2.next(3)] == [p.uid for p in s.next(3)]


def test_a_system_prompt_goes_first_unless_the_problem_has_one(tokenizer):
    from dapo.data.problems import Problem

    user = {"role": "user", "content": "What is 2 + 2?"}
    plain = Problem("p", (user,), "4")
    assert render_prompt(tokenizer, plain) == "User: What is 2 + 2?\nAssistant:\n"
    assert render_prompt(tokenizer, plain, system_prompt="Be brief.") == (
        "System: Be brief.\nUser: What is 2 + 2?\nAssistant:\n"
    )
    assert render_prompt(tokenizer, plain, system_prompt="").startswith("System: \nUser:")
    own = Problem("q", ({"role": "system", "content": "Mine."}, user), "4")
    assert render_prompt(tokenizer, own, system_prompt="Be brief.").startswith("System: Mine.\n")
    raw = render_prompt(tokenizer, plain, chat_template=False, system_prompt="Be brief.")
    assert raw == "Be brief.\n\nWhat is 2 + 2?"


def test_the_long_recipe_gives_responses_of_every_length_up_to_past_l_max(tokenizer):
    # recipes/demo-long.yaml's claim: its warm-up solutions run from ~10 tokens to past L_max,
    # the one-line style always penalty-free, the step-by-step one punished or truncated at
    # 5 and 6 terms.
    cfg = load_config(Path(__file__).parent.parent / "recipes" / "demo-long.yaml")
    a, l_max = cfg.arith, cfg.rollout.max_new_tokens
    free = l_max - cfg.algo.l_cache
    _, _, warmup = make_splits(
        10, 10, 2000, seed=a.seed, min_terms=a.min_terms, max_terms=a.max_terms,
        operators=a.operators, style=a.solution,
    )  # fmt: skip
    lengths: dict[str, list[int]] = {"one line": [], "step by step": []}
    for _, solution in warmup:
        style = "step by step" if solution.count("\n") >= 2 else "one line"
        lengths[style].append(len(tokenizer(solution)["input_ids"]) + 1)  # and end-of-text
    assert min(lengths["one line"]) <= 12 and max(lengths["one line"]) <= free
    assert max(lengths["step by step"]) > l_max
    punished = sum(n > free for n in lengths["step by step"]) / len(lengths["step by step"])
    assert 0.2 < punished < 0.8


def test_chat_examples_show_the_tool_on_the_last_of_a_share():
    """``prompt: chat`` with ``tool_share``: the last ceil(shots x share) worked examples
    compute with the tool (an instruct model's warm-start); with no share, none does, and
    the examples and problems are those drawn without it."""
    plain, _, _ = make_splits(3, 1, seed=0, prompt="chat", shots=3, operators="*")
    tools, _, _ = make_splits(3, 1, seed=0, prompt="chat", shots=3, operators="*", tool_share=0.5)
    examples = [m["content"] for m in tools[0][0].messages[:-1] if m["role"] == "assistant"]
    assert [e.startswith("```python\nprint(") for e in examples] == [False, True, True]
    assert not any("```" in m["content"] for m in plain[0][0].messages)
    a, b = examples[-1], [m["content"] for m in plain[0][0].messages[:-1]][-1]
    assert a.rsplit("Answer: ", 1)[1] == b.rsplit("Answer: ", 1)[1]  # the same problem
    assert [p.messages[-1] for p, _ in tools] == [p.messages[-1] for p, _ in plain]
    assert get_verifier("arith")(a, a.rsplit("Answer: ", 1)[1]).correct


def test_the_warm_up_says_where_it_is(monkeypatch):
    """The tools recipe's 600 warm-up steps took minutes on a laptop without a line."""
    from dapo.models import demo

    tokenizer = demo.build_tokenizer()
    spec = demo.TinyModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    model = demo.tiny_qwen2(tokenizer, spec, seed=0)
    (problem, solution), *_ = make_splits(4, 1, seed=0)[0]
    examples = [(render_prompt(tokenizer, problem), solution)]
    lines: list[str] = []
    monkeypatch.setattr(demo, "PROGRESS_EVERY_S", 0.0)
    losses = demo.warm_start(model, tokenizer, examples, demo.WarmupSpec(3, 2), lines.append)
    assert [x.split(",")[0] for x in lines] == ["  warm-up step 1/3", "  warm-up step 2/3"]
    assert lines[0].split(",")[1] == f" loss {losses[0]:.3f}"
