"""A model directory's chat template is untrusted code: rendered in bounded time and memory,
with the same strings as transformers' own rendering."""

from __future__ import annotations

import os
import resource
import time

import pytest
from transformers import AutoTokenizer

from dapo.data import chat_render
from dapo.data.problems import Problem
from dapo.data.prompts import render_prompts
from dapo.models.demo import build_tokenizer

CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BOMB = "{% set s = 'a' * 2000000000 %}{{ s | length }}"

PROBLEMS = [
    Problem(f"p{i}", ({"role": "user", "content": f"What is {i} + 1?"},), str(i + 1))
    for i in range(3)
]


def _model_dir(tmp_path, template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "model")
    return AutoTokenizer.from_pretrained(tmp_path / "model")


def test_a_template_renders_in_a_child_as_transformers_renders_it(tmp_path):
    tok = _model_dir(tmp_path, CHATML)
    texts = render_prompts(tok, PROBLEMS, system_prompt="Be brief.")
    assert texts[1] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    messages = [[{"role": "system", "content": "Be brief."}, dict(p.messages[0])] for p in PROBLEMS]
    assert texts == [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages
    ]


def test_a_template_that_loops_is_stopped_at_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_render, "BASE_DEADLINE_S", 1.0)
    tok = _model_dir(tmp_path, LOOP)
    start = time.monotonic()
    with pytest.raises(ValueError) as caught:
        render_prompts(tok, PROBLEMS)
    assert time.monotonic() - start < 10
    assert str(caught.value).startswith(
        f"the chat template of {tmp_path / 'model'} ran past 1 s rendering 3 prompt(s): "
        "a template from a model directory is untrusted input"
    )
    assert "data.apply_chat_template=false" in str(caught.value)


def test_a_template_that_allocates_without_bound_is_stopped_in_its_child(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_render, "MEMORY_MB", 256)
    tok = _model_dir(tmp_path, BOMB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"failed rendering 3 prompt\(s\) \(it allocated past 256"):
        render_prompts(tok, PROBLEMS)
    # the 2 GB string was the child's: this process grew by no more than the test's noise
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024


def test_a_template_that_refuses_or_fails_names_the_problem(tmp_path):
    refusing = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(ValueError) as caught:
        render_prompts(_model_dir(tmp_path / "a", refusing), PROBLEMS[1:], system_prompt="x")
    assert str(caught.value) == (
        "problem p1: the tokenizer's chat template refused its messages (system, user): "
        "System role not supported; set data.system_prompt=null when the template takes no "
        "system message, or data.apply_chat_template=false to prompt with the messages raw"
    )
    failing = "{% if messages[0]['content'] == 'What is 2 + 1?' %}{{ 1 / 0 }}{% endif %}x"
    with pytest.raises(ValueError) as caught:
        render_prompts(_model_dir(tmp_path / "b", failing), PROBLEMS)
    assert str(caught.value) == (
        "problem p2: the tokenizer's chat template failed on its messages: ZeroDivisionError: "
        "division by zero; set data.apply_chat_template=false to prompt with the messages raw"
    )


def test_the_demo_template_renders_in_process(monkeypatch):
    def no_fork():
        raise AssertionError("the demo's own template forked")

    monkeypatch.setattr(chat_render.os, "fork", no_fork)
    assert render_prompts(build_tokenizer(), PROBLEMS[:1]) == ["User: What is 0 + 1?\nAssistant:\n"]


def test_a_template_whose_text_is_too_long_is_refused_before_it_is_tokenized(tmp_path):
    # What the child may allocate is bounded, but the text comes back to be tokenized
    # (about 200 bytes a token): "{{ '1 ' * 5000 }}" a prompt made 200 MB to tokenize.
    padded = "{{ '1 ' * 10000 }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError) as caught:
        render_prompts(_model_dir(tmp_path, padded), PROBLEMS)
    assert str(caught.value) == (
        "problem p0: the tokenizer's chat template failed on its messages: OverflowError: it "
        "rendered 20,014 characters from 14 characters of messages, more than a template may "
        "make of them (twice as many and 16,384 more); set data.apply_chat_template=false to "
        "prompt with the messages raw"
    )
    # a long system line is a template's right: 2 x 14 + 16,384 characters at most
    fits = "{{ '1' * 16398 }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert len(render_prompts(_model_dir(tmp_path / "b", fits), PROBLEMS[:1])[0]) == 16412


CTRL_C = """
import os, signal, sys, threading, time
from transformers import AutoTokenizer
from dapo.data import chat_render
from dapo.data.problems import Problem
from dapo.data.prompts import render_prompts

signal.signal(signal.SIGINT, lambda *_: os.write(1, f"handled in {os.getpid()}\\n".encode()))
chat_render.BASE_DEADLINE_S = 2.0
tok = AutoTokenizer.from_pretrained(sys.argv[1])
threading.Timer(0.5, os.killpg, (os.getpgid(0), signal.SIGINT)).start()
try:
    render_prompts(tok, [Problem("p", ({"role": "user", "content": "hi"},), "1")])
except ValueError as exc:
    print("refused:", str(exc)[:40], flush=True)
print("parent", os.getpid(), flush=True)
"""


def test_ctrl_c_while_a_template_renders_is_handled_by_the_parent_alone(tmp_path):
    # A terminal's Ctrl-C signals the whole process group: the forked child ran dapo's
    # handler too ("SIGINT received: finishing this step..." printed twice).
    import subprocess
    import sys

    _model_dir(tmp_path, LOOP)
    out = subprocess.run(
        [sys.executable, "-c", CTRL_C, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    ).stdout.splitlines()
    parent = out[-1].split()[1]
    assert out == [
        f"handled in {parent}",
        "refused: " + f"the chat template of {tmp_path / 'model'}"[:40],
        f"parent {parent}",
    ]


def test_a_reply_over_its_bound_is_told_apart_from_one_past_its_deadline():
    # A child that checks each text never sends more than the bound; one that does is
    # broken, not slow, and the parent's message must not blame the deadline.
    for sent, most, expected in (
        (b"x" * 100, 50, (b"", "size")),
        (b"x" * 100, 200, (b"x" * 100, "")),
    ):
        read, write = os.pipe()
        os.write(write, sent)
        os.close(write)
        try:
            assert chat_render.read_reply(read, time.monotonic() + 5, most) == expected
        finally:
            os.close(read)
    read, write = os.pipe()
    try:  # nothing written and the write end open: the deadline passes
        assert chat_render.read_reply(read, time.monotonic() + 0.05, 10) == (b"", "deadline")
    finally:
        os.close(read)
        os.close(write)
