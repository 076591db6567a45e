"""Who runs a forward: a block owns the forwards run in its own extent.

Entering a `capture` or `replay` block marks the caller's context (`contextvars`): the
block owns the forwards its thread runs under that mark, the code inside the `with` and
the asyncio tasks started there (`gather`, `wait_for`, `create_task` and `asyncio.run`
copy the context). Forwards of other threads and of unrelated tasks are not its own. A
forward carrying the mark in another thread (`asyncio.to_thread`) left the block's thread:
blocks refuse it, as its hooks could interleave with the thread's own forwards. Compiled
code tells threads apart by a thread-local object (`this_thread`), which Dynamo guards.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import sys
import threading
import weakref
from typing import NamedTuple

from routing_replay.compat.torch import break_graph, run_eagerly

_MARKS: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar(
    "routing_replay_blocks", default=()
)
_NEXT = itertools.count(1)  # (next() on it is atomic: marks are unique across threads)
# Per thread, one object for good: compiled code compares it with its block's (Dynamo
# guards a thread-local per calling thread, and cannot trace `threading.get_ident`).
_THREAD = threading.local()
# Notes a thread keeps per model: a `KeyboardInterrupt` skips a forward's end (torch runs
# `always_call` hooks for an `Exception` only), leaving its note; no forward nests this deep.
_MAX_NOTES = 32


class Owner(NamedTuple):
    """A block's owner: the thread that entered it and the mark it put on its context."""

    thread: object  # the thread's object (`this_thread`)
    mark: int
    in_task: bool  # entered inside an asyncio task: compiled code checks the task eagerly


class Running(NamedTuple):
    """Who runs now: this thread (`this_thread`) and the marks its context carries."""

    thread: object
    marks: tuple[int, ...]


def mark() -> Owner:
    """A new owner: this thread, and a new mark on this context."""
    owner = Owner(this_thread(), next(_NEXT), _in_task())
    _MARKS.set((*_MARKS.get(), owner.mark))
    return owner


def _in_task() -> bool:
    asyncio = sys.modules.get("asyncio")  # (never imported: no task runs)
    try:
        return asyncio is not None and asyncio.current_task() is not None
    except RuntimeError:  # no running event loop in this thread
        return False


def this_thread() -> object:
    """This thread's object: what compiled code can tell threads apart by (`_THREAD`)."""
    me = getattr(_THREAD, "me", None)
    if me is None:
        me = _THREAD.me = object()
    return me


def in_block_thread(block: Owner | None) -> bool:
    """Whether this is the thread that entered `block` (traceable: Dynamo guards this
    thread's object per thread, no graph break)."""
    return block is not None and getattr(_THREAD, "me", None) is block.thread


def admit(key: object, epoch: int) -> list:
    """Note a forward of `key`'s model starting in this thread: [whether it is its active
    block's (set by the caller once checked), the model's epoch then]. Notes stack per
    thread (a forward may run inside another's hooks); each end takes its own off (`leave`,
    also on an error), so the forward's start (the decoder's pre-hook, eager) tells its end."""
    found = getattr(_THREAD, "admitted", None)
    if found is None:  # (weakly: a model's notes go with its state)
        found = _THREAD.admitted = weakref.WeakKeyDictionary()
    note = [False, epoch]
    notes = found.setdefault(key, [])
    if len(notes) >= _MAX_NOTES:  # the oldest: left by interrupted forwards, not live ones
        del notes[0]
    notes.append(note)
    return note


def admitted(key: object) -> list | None:
    """The note of this thread's innermost running forward of `key`'s model, if any."""
    notes = getattr(_THREAD, "admitted", {}).get(key)
    return notes[-1] if notes else None


def leave(key: object) -> None:
    """Take this thread's innermost note of `key`'s model off (its forward ended)."""
    notes = getattr(_THREAD, "admitted", {}).get(key)
    if notes:
        notes.pop()


def unmark(owner: Owner | None) -> None:
    """Take `owner`'s mark off this context (nothing if it has none: another context)."""
    marks = _MARKS.get()
    if owner is not None and owner.mark in marks:
        _MARKS.set(tuple(m for m in marks if m != owner.mark))


def current_owner() -> Running:
    return Running(this_thread(), _MARKS.get())


def owns(block: Owner | None, now: Running) -> bool:
    """Whether a block owned by `block` owns a forward run by `now`."""
    return block is not None and block.thread is now.thread and block.mark in now.marks


def escaped(block: Owner | None, now: Running) -> bool:
    """Whether `now` runs inside `block`'s extent but in another thread (`to_thread`)."""
    return block is not None and block.mark in now.marks and block.thread is not now.thread


def owns_compiled(block: Owner | None, compiled_only: str) -> bool:
    """`owns`, from code Dynamo traces: the thread by its object (guarded per thread, no
    graph break); for a block entered inside an asyncio task, also the task, eagerly (a
    graph break; under `fullgraph=True` an error saying `compiled_only`)."""
    if not in_block_thread(block):
        return False
    if not block.in_task:
        return True
    break_graph(compiled_only)
    return run_eagerly(functools.partial(_owns_now, block))


def _owns_now(block: Owner) -> bool:
    return owns(block, current_owner())
