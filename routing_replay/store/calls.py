"""The boundary of every public store call: what an interruption or an error leaves behind.

`store_call` wraps each public method of `RoutingStore`. Around the method it

- counts the call as in flight on the handle, so that `close` never unmaps (and frees the
  descriptors of) a handle another thread is using;
- at the end, settles this thread's holdings of the handle's locks: an interruption can cut
  a holding short anywhere, even in the code that ends it;
- on an error, clears the locals of the package's finished frames the error carries: they
  may view the segment, and a view would keep the store from closing.

A store call made while another runs on the same thread (a signal handler, a finalizer or a
trace hook calling the store) settles nothing: it is nested (`calls_running`), and one that
needs a lock the outer call holds is refused (`Mutex.acquire`) instead of running inside
the outer call's change.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from routing_replay.errors import StoreUnavailableError

if TYPE_CHECKING:
    from routing_replay.store.routing_store import RoutingStore

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def store_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a public `RoutingStore` method (see the module's docstring)."""

    @functools.wraps(method)
    def call(self: RoutingStore, *args: Any, **kwargs: Any) -> Any:
        core = self._core
        nested = calls_running(sys._getframe(1)) > 0
        token = object()
        try:
            core.calls[token] = threading.current_thread()
            if core.closing:
                raise closed_error(
                    core.name, closed=core.segment.fd < 0 or core.segment.mmap.closed
                )
            return method(self, *args, **kwargs)
        except BaseException as e:
            forget_frames(e)
            raise
        finally:
            core.calls.pop(token, None)
            if not nested:
                core.lock.settle()
                core.spill.settle()

    _CALLS.add(call.__code__)
    return call


_CALLS: set[Any] = set()  # the code of `store_call`'s wrapper
_FORK_BOUND: set[Any] = set()  # more calls a child forked inside them must not go on with


def fork_bound(*functions: Any) -> None:
    """Count `functions` (besides every store call) among the calls whose parent owns them
    across a fork: a child forked inside one ends (`running_at_fork`)."""
    _FORK_BOUND.update(getattr(f, "__func__", f).__code__ for f in functions)


def running_at_fork(frame: Any) -> str | None:
    """The name of a store call (or fork-bound call) running at `frame` or below it, the
    innermost; None if none. A fork there copies a call that is its parent's."""
    for f, _ in traceback.walk_stack(frame):
        if f.f_code in _CALLS or f.f_code in _FORK_BOUND:
            inner = f.f_locals.get("method") if f.f_code in _CALLS else None
            return getattr(inner, "__qualname__", f.f_code.co_qualname)
    return None


def calls_running(frame: Any) -> int:
    """How many store calls are running at `frame` and below it, on this thread's stack (one
    line however deep the stack: the same code runs the same lines everywhere)."""
    return sum(map(_CALLS.__contains__, map(_CODE, map(_FRAME, traceback.walk_stack(frame)))))


_CODE, _FRAME = operator.attrgetter("f_code"), operator.itemgetter(0)


def others_in_flight(calls: dict[object, threading.Thread]) -> bool:
    """Whether a thread other than this one (and alive) is inside a call of a handle.
    Threads as objects: after a fork a new thread may get the ident of one that is gone."""
    me, alive = threading.current_thread(), set(threading.enumerate())
    return any(thread is not me and thread in alive for thread in list(calls.values()))


def forget_frames(error: BaseException, every: bool = False) -> None:
    """Clear the locals of routing_replay's frames (`every`: of all frames) that `error` and
    the errors chained to it carry: the frames are done, and their locals may view the
    segment. Frames still running, the caller's among them, are left as they are."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            mine = every or code.co_filename.startswith(_PACKAGE)
            if mine and not code.co_flags & _RESUMABLE:  # (clearing one would close it)
                with contextlib.suppress(RuntimeError):  # a frame still running
                    tb.tb_frame.clear()
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]


# Generators, coroutines and async generators: their frames are left (a suspended one
# would be closed by frame.clear(), a side effect on the caller's code).
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def inside_call(handle: object, frame: Any, calls: Any = None) -> bool:
    """Whether `frame` or one below it on its thread's stack runs a method of `handle` whose
    code is in `calls` (default: the store calls; a signal handler interrupting one, say)."""
    calls = _CALLS if calls is None else calls
    while frame is not None:
        if frame.f_code in calls and frame.f_locals.get("self") is handle:
            return True
        frame = frame.f_back
    return False


def closed_error(name: str, closed: bool = False) -> StoreUnavailableError:
    """A call of a handle that is closed, or that another thread is closing."""
    if closed:
        return StoreUnavailableError(
            f"store {name!r}: this handle is closed. Attach again (RoutingStore.attach) to go "
            "on using the store"
        )
    return StoreUnavailableError(
        f"store {name!r}: this handle is being closed (close() or an owner's `with` block "
        "ended in another thread of this process). Attach again to go on using the store; "
        "if that close gave up (StoreBusyError), this handle is still open: call again"
    )
