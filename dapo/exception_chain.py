"""Finding an exception of a given kind among those an exception was raised from or while
handling: a library may put its own error in front of the one that says what happened (a
stop inside torch's vmap, torch's safe loader refusing a pickle inside transformers)."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def found_in_chain(exc: BaseException | None, kind: type[E]) -> E | None:
    """``exc`` when it is a ``kind``, else the first ``kind`` among the exceptions it was
    raised from (``__cause__``) or while handling (``__context__``), at any depth; None when
    there is none. A chain that loops back on itself is walked once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        todo += [e.__context__, e.__cause__]  # the cause, popped first, is looked at first
    return None
