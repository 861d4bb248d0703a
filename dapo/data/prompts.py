"""The DAPO instruction template, and how a problem becomes the text a policy is prompted with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dapo.data.chat_render import TemplateRefused, render_chats
from dapo.data.problems import Problem

# The DAPO-Math-17k / AIME instruction, byte for byte as the official Parquet files have it.
PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n"
)
PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_prompt(problem: str) -> str:
    """Wrap a raw problem in the DAPO instruction template."""
    return PROMPT_PREFIX + problem + PROMPT_SUFFIX


def strip_template(content: str) -> str:
    """The raw problem inside a DAPO-templated message; ``content`` itself if it is not one."""
    if (
        content.startswith(PROMPT_PREFIX)
        and content.endswith(PROMPT_SUFFIX)
        and len(content) >= len(PROMPT_PREFIX) + len(PROMPT_SUFFIX)
    ):
        return content[len(PROMPT_PREFIX) : len(content) - len(PROMPT_SUFFIX)]
    return content


def render_prompt(
    tokenizer: Any,
    problem: Problem,
    *,
    chat_template: bool = True,
    system_prompt: str | None = None,
) -> str:
    """:func:`render_prompts` of one problem."""
    return render_prompts(
        tokenizer, [problem], chat_template=chat_template, system_prompt=system_prompt
    )[0]


def render_prompts(
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    chat_template: bool = True,
    system_prompt: str | None = None,
) -> list[str]:
    """Chat-format problems go through the tokenizer's chat template when it has one (and
    ``chat_template``), rendered in bounded time and memory (:mod:`dapo.data.chat_render`);
    otherwise the message contents, raw. ``system_prompt`` (when not None) is a system
    message put first, unless the problem has one of its own."""
    conversations = []
    for problem in problems:
        messages = list(problem.messages)
        if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
        conversations.append(messages)
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        return ["\n\n".join(m["content"] for m in messages) for messages in conversations]
    try:
        return render_chats(tokenizer, conversations)
    except TemplateRefused as exc:
        problem, messages = problems[exc.index], conversations[exc.index]
        if not exc.template_error:
            raise ValueError(
                f"problem {problem.uid}: the tokenizer's chat template failed on its messages: "
                f"{exc}; set data.apply_chat_template=false to prompt with the messages raw"
            ) from None
        raise ValueError(  # Gemma's refuses a system message, as a traceback
            f"problem {problem.uid}: the tokenizer's chat template refused its messages "
            f"({', '.join(m['role'] for m in messages)}): {exc}; set data.system_prompt=null "
            "when the template takes no system message, or data.apply_chat_template=false "
            "to prompt with the messages raw"
        ) from None
