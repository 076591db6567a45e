"""Stopping a call at the Nth line of routing_replay code it runs, in this process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import routing_replay

PACKAGE = os.path.dirname(routing_replay.__file__)


def interrupted_at(
    stop: int,
    call: Callable[[], Any],
    error: type[BaseException] = KeyboardInterrupt,
    action: Callable[[], Any] | None = None,
    lines: list[str] | None = None,
) -> tuple[int, Any]:
    """Run `call`, raising `error` at its `stop`-th line event in package code (0: never),
    or with `action` running it there instead (a signal handler; `call`'s own errors then
    propagate). Returns the line events seen and what `call` returned (None if stopped).
    `lines`: a list each event's place is appended to (`file:line function`, the file
    relative to the package), up to the stop's own (`lines[-1]` at the stop)."""
    seen = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal seen
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "line":
            seen += 1
            if lines is not None:
                code = frame.f_code
                where = os.path.relpath(code.co_filename, PACKAGE)
                lines.append(f"{where}:{frame.f_lineno} {code.co_name}")
            if seen == stop:
                if action is None:
                    raise error
                action()
        return tracer

    result = None
    sys.settrace(tracer)
    try:
        result = call()
    except error:
        if action is not None:
            raise
    finally:
        sys.settrace(None)
    return seen, result


def forked_at(stop: int | Callable[[Any], bool], call: Callable[[], Any]) -> tuple[int | None, Any]:
    """Run `call`, forking at its `stop`-th line event in package code, or at the first
    whose frame `stop(frame)` accepts (as a signal handler or a hook that forks would).
    Returns (pid, outcome): pid None if `call` ended first, 0 in the child, the child's in
    the parent; outcome what `call` returned or raised (the child's errors too: it must
    reach its exit)."""
    seen, pid = 0, None

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal seen, pid
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "line":
            seen += 1
            if seen == stop if isinstance(stop, int) else stop(frame):
                sys.settrace(None)
                pid = os.fork()
                return None
        return tracer

    sys.settrace(tracer)
    try:
        outcome = call()
    except BaseException as e:
        outcome = e
    finally:
        sys.settrace(None)
    return pid, outcome
