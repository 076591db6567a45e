"""Who runs a forward: a block owns the forwards run in its own extent.

Entering a `capture` or `replay` block marks the caller's context (`contextvars`): the
block owns the forwards its thread runs under that mark, the code inside the `with` and
the asyncio tasks started there (`gather`, `wait_for`, `create_task` and `asyncio.run`
copy the context). Forwards of other threads and of unrelated tasks are not its own. A
forward carrying the mark in another thread (`asyncio.to_thread`) left the block's thread:
blocks refuse it, as its hooks could interleave with the thread's own forwards.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from typing import NamedTuple

_MARKS: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar(
    "routing_replay_blocks", default=()
)
_NEXT = itertools.count(1)  # (next() on it is atomic: marks are unique across threads)


class Owner(NamedTuple):
    """A block's owner: the thread that entered it and the mark it put on its context."""

    thread: int
    mark: int


class Running(NamedTuple):
    """Who runs now: this thread and the marks its context carries."""

    thread: int
    marks: tuple[int, ...]


def mark() -> Owner:
    """A new owner: this thread, and a new mark on this context."""
    owner = Owner(threading.get_ident(), next(_NEXT))
    _MARKS.set((*_MARKS.get(), owner.mark))
    return owner


def unmark(owner: Owner | None) -> None:
    """Take `owner`'s mark off this context (nothing if it has none: another context)."""
    marks = _MARKS.get()
    if owner is not None and owner.mark in marks:
        _MARKS.set(tuple(m for m in marks if m != owner.mark))


def current_owner() -> Running:
    return Running(threading.get_ident(), _MARKS.get())


def owns(block: Owner | None, now: Running) -> bool:
    """Whether a block owned by `block` owns a forward run by `now`."""
    return block is not None and block.thread == now.thread and block.mark in now.marks


def escaped(block: Owner | None, now: Running) -> bool:
    """Whether `now` runs inside `block`'s extent but in another thread (`to_thread`)."""
    return block is not None and block.mark in now.marks and block.thread != now.thread
