"""Chat templates are untrusted code: render them in a forked child bounded in time and memory.

A chat template comes from a model directory (``chat_template.jinja``, ``tokenizer_config.json``)
and a model directory from elsewhere is untrusted input. transformers renders it in jinja2's
sandbox, which stops it from reaching Python's internals but bounds neither its loops nor its
allocations: ``{% for i in range(100000) %}{% for j in range(100000) %}`` hangs a run, and
``{% set s = 'a' * 2000000000 %}`` fills the machine's memory. So the prompts of a batch are
rendered in a child forked from this process (the same tokenizer object, hence the same
strings, with nothing to pickle or import), with an address-space limit of ``MEMORY_MB`` on
top of what it inherits and a deadline; a template that overruns either stops the run with an
error that names the model directory and the fix. The demo's own template, written in this
package, renders in-process, as does every template where ``fork`` does not exist or fails.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
import warnings
from collections.abc import Sequence
from typing import Any

from dapo.data.limits import limit_address_space

__all__ = [
    "BASE_DEADLINE_S",
    "DEMO_CHAT_TEMPLATE",
    "MEMORY_MB",
    "PER_CHAT_S",
    "TemplateRefused",
    "deadline_s",
    "read_reply",
    "render_chats",
]

DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:\n{% endif %}"
)
"""The embedded demo's template: this package's own code, rendered in-process."""

MEMORY_MB = 2048
"""Room a rendering child may map on top of what it inherits: a real template needs a few MiB
(the texts of a batch, a compiled template), so this stops only a runaway one."""

BASE_DEADLINE_S = 60.0
"""The deadline of a rendering child before its prompts: a fork and a template's compilation
take milliseconds, seconds on a loaded machine."""

PER_CHAT_S = 0.01
"""And for each prompt: a real template renders a conversation in well under a millisecond."""

EXTRA_CHARS = 16384
"""A template may render a conversation into at most twice its messages' characters and this
many more (a system line, a date, role markers take tens to hundreds): the text comes back
to be tokenized, which costs about 200 bytes a token, so a template's output is bounded
too, not only what it allocates while rendering."""

_STOPPING = (signal.SIGINT, signal.SIGTERM)


def deadline_s(conversations: int) -> float:
    """How long the child may take over ``conversations`` prompts."""
    return BASE_DEADLINE_S + PER_CHAT_S * conversations


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def render_chats(tokenizer: Any, conversations: Sequence[list[dict[str, str]]]) -> list[str]:
    """``tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)`` of every
    conversation ``c``, bounded (see the module). A template's own refusal is re-raised as
    :class:`TemplateRefused` with the conversation's index; overrunning the deadline or the
    memory is a ValueError naming the model directory."""
    if tokenizer.chat_template == DEMO_CHAT_TEMPLATE or not hasattr(os, "fork"):
        return _in_process(tokenizer, conversations)
    return _in_child(tokenizer, list(conversations))


def _in_process(tokenizer: Any, conversations: Sequence[list[dict[str, str]]]) -> list[str]:
    texts = []
    for i, messages in enumerate(conversations):
        try:
            texts.append(_rendered(tokenizer, messages))
        except Exception as exc:  # noqa: BLE001 - reported as the child's would be
            raise TemplateRefused(i, exc) from None
    return texts


class TemplateRefused(Exception):
    """The chat template raised on conversation ``index`` (Gemma's refuses a system message)."""

    def __init__(self, index: int, exc: BaseException | str, template_error: bool = False) -> None:
        super().__init__(exc if isinstance(exc, str) else _describe(exc))
        self.index = index
        self.template_error = template_error or _is_template_error(exc)


def _is_template_error(exc: BaseException | str) -> bool:
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    return isinstance(exc, TemplateError)


def _describe(exc: BaseException) -> str:
    """A template's own refusal in its words; anything else with its type."""
    return str(exc) if _is_template_error(exc) else f"{type(exc).__name__}: {exc}"


def most_chars(messages: list[dict[str, str]]) -> int:
    """The longest text a template may render ``messages`` into (see EXTRA_CHARS)."""
    return 2 * sum(len(str(m.get("content", ""))) for m in messages) + EXTRA_CHARS


def _rendered(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    text = _render(tokenizer, messages)
    if len(text) > most_chars(messages):
        given = (most_chars(messages) - EXTRA_CHARS) // 2
        raise OverflowError(
            f"it rendered {len(text):,} characters from {given:,} characters of messages, more "
            f"than a template may make of them (twice as many and {EXTRA_CHARS:,} more)"
        )
    return text


def _child(tokenizer: Any, conversations: list[list[dict[str, str]]], out: int) -> None:
    # Only this thread exists here; leave with os._exit so no parent state is flushed twice.
    # A Ctrl-C reaches the whole process group: the parent's handler is the parent's alone.
    for sig in _STOPPING:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)
    code = 0
    try:
        limit_address_space(MEMORY_MB)
        texts = []
        for i, messages in enumerate(conversations):
            try:
                texts.append(_rendered(tokenizer, messages))
            except MemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - the parent names it
                reply = {"refused": i, "error": _describe(exc)[:2000]}
                reply["template_error"] = _is_template_error(exc)
                break
        else:
            reply = {"texts": texts}
        data = json.dumps(reply).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
    except MemoryError:
        code = 3
    except BaseException:  # noqa: BLE001 - a pipe gone: the parent reports the exit
        code = 4
    os._exit(code)


def _in_child(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[str]:
    # tokenizers prints a warning in a forked child when its parent used parallelism and the
    # variable is unset; the child never encodes, so say parallelism is as it was.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    read, write = os.pipe()
    # Held back across the fork, so the child ignores them before any can reach it; the
    # parent's pending ones arrive as it unblocks.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        with warnings.catch_warnings():
            # Python 3.12 warns of fork in a threaded process: the child runs only this thread's
            # rendering and leaves by os._exit, touching no lock another thread could hold.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:  # no room to fork (strict overcommit): unbounded beats no run
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(read)
        os.close(write)
        return _in_process(tokenizer, conversations)
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(read)
        _child(tokenizer, conversations, write)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(write)
    # The reply's bound: every text at its longest, each character escaped (\uXXXX\uXXXX).
    most = 12 * sum(most_chars(m) for m in conversations) + 2**16
    data, overrun = b"", "deadline"  # what an interrupted wait leaves: the child is killed
    try:
        data, overrun = read_reply(read, time.monotonic() + deadline_s(len(conversations)), most)
    finally:
        os.close(read)
        if overrun:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return _reply(tokenizer, conversations, data, overrun, most, status)


def read_reply(fd: int, deadline: float, most: int) -> tuple[bytes, str]:
    """A rendering child's reply from pipe ``fd`` and ``""``; or ``b""`` and what it overran:
    ``"deadline"`` (the monotonic time) or ``"size"`` (over ``most`` bytes)."""
    chunks, got = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b"", "deadline"
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks), ""
        got += len(chunk)
        if got > most:  # the child checks each text: only a broken one sends more
            return b"", "size"
        chunks.append(chunk)


def _reply(
    tokenizer: Any, conversations: list, data: bytes, overrun: str, most: int, status: int
) -> list[str]:
    where = f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"
    fix = (
        "a template from a model directory is untrusted input, rendered in bounded time and "
        "memory; use the model's own tokenizer files, or set data.apply_chat_template=false to "
        "prompt with the messages raw"
    )
    if overrun == "deadline":
        limit = deadline_s(len(conversations))
        raise ValueError(
            f"{where} ran past {limit:.0f} s rendering {len(conversations)} prompt(s): {fix}"
        )
    if overrun:
        raise ValueError(
            f"{where} sent over {most:,} bytes for {len(conversations)} prompt(s), more than "
            f"their longest rendering: {fix}"
        )
    if not data:
        why = f"exit status {os.waitstatus_to_exitcode(status)}"
        if os.waitstatus_to_exitcode(status) == 3:
            why = f"it allocated past {MEMORY_MB} MiB"
        raise ValueError(f"{where} failed rendering {len(conversations)} prompt(s) ({why}): {fix}")
    reply = json.loads(data)
    if "refused" in reply:
        raise TemplateRefused(reply["refused"], reply["error"], reply["template_error"])
    return reply["texts"]
