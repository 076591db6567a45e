"""The store's commit lock: a flock the kernel drops when its holder dies, a dirty flag, repair.

Every change to the shared tables happens inside `CommitLock.held(...)` after the caller
has called `Hold.write()`: that sets the segment's dirty flag, and a normal exit clears
it. A holder killed half-way leaves the flag set, and the next process to take the lock
rebuilds every derived table from the published samples before doing anything else. An
exception raised half-way (a bug, or an async exception such as KeyboardInterrupt) is
repaired at once, by the process that raised it, before the lock is dropped.

Waits are bounded: a process that holds the lock and is stopped (SIGSTOP, a debugger)
makes others raise `StoreBusyError` at their deadline, never hang.

Test hook: `interleave(hook)` calls `hook(point)` right before the lock is taken
(`"<op>:take"`) and right after it is dropped (`"<op>:drop"`), in the thread that takes it;
tests run other operations there, to enumerate interleavings deterministically.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from routing_replay.errors import StoreBusyError
from routing_replay.store.segment import Segment
from routing_replay.store.tables import Tables

_hook: Callable[[str], None] | None = None
SPIN_YIELDS = 20  # tries with a yield of the CPU before sleeping between tries
FIRST_SLEEP_S, LONGEST_SLEEP_S = 1e-4, 2e-3


@contextlib.contextmanager
def interleave(hook: Callable[[str], None]) -> Iterator[None]:
    """Test only: call `hook(point)` wherever any store takes or drops its lock."""
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous


class Hold:
    """One holding of a store's commit lock, as a context manager (`CommitLock.held`);
    `write()` before the first change to the tables. A plain object, not a generator: a put
    takes the lock three times, a read twice."""

    __slots__ = ("_deadline", "_fd", "_lock", "_point", "writing")

    def __init__(self, lock: CommitLock, point: str, deadline: float) -> None:
        self._lock, self._point, self._deadline = lock, point, deadline
        self._fd = -1
        self.writing = False

    def write(self) -> None:
        """Mark the tables dirty until this holding ends (idempotent)."""
        if not self.writing:
            self._lock._tables.set_dirty(True)
            self.writing = True

    def __enter__(self) -> Hold:
        lock = self._lock
        if _hook is not None:
            _hook(f"{self._point}:take")
        if lock._epoch != lock._segment.epoch:  # forked: the parent's thread lock may be held
            lock._thread_lock, lock._epoch = threading.Lock(), lock._segment.epoch
        if not lock._thread_lock.acquire(timeout=max(self._deadline - time.monotonic(), 0.0)):
            raise lock._busy(self._deadline)
        try:
            self._fd = lock._segment.lock_fd
            lock._take(self._fd, self._deadline)
            if lock._tables.dirty:
                lock._repair()  # sets the flag back once the tables are whole
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self.writing:
                if exc_type is not None:
                    self._lock._repair()  # half-made changes of ours: undone before we let go
                else:
                    self._lock._tables.set_dirty(False)
        finally:
            self._release()

    def _release(self) -> None:
        try:
            if self._fd >= 0:  # unlocking what this description does not hold is a no-op
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock._thread_lock.release()
            if _hook is not None:
                _hook(f"{self._point}:drop")


class CommitLock:
    """Exclusive cross-process lock of one store handle, with repair of what a dead holder left."""

    def __init__(self, segment: Segment, tables: Tables, repair: Callable[[], None]) -> None:
        self._segment = segment
        self._tables = tables
        self._repair = repair
        self._thread_lock = threading.Lock()
        self._epoch = segment.epoch

    def held(self, point: str, deadline: float) -> Hold:
        """`with lock.held(point, deadline) as hold:` holds the lock (waiting at most until
        `deadline`, time.monotonic), repairing first what a dead holder left."""
        return Hold(self, point, deadline)

    def _take(self, fd: int, deadline: float) -> None:
        tries, sleep = 0, FIRST_SLEEP_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            if time.monotonic() >= deadline:
                raise self._busy(deadline)
            tries += 1
            if tries <= SPIN_YIELDS:
                os.sched_yield()  # the holder is usually a few microseconds from done
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, LONGEST_SLEEP_S)

    def _busy(self, deadline: float) -> StoreBusyError:
        return StoreBusyError(
            f"store {self._tables.name!r}: its lock stayed held by another process past the "
            "timeout. A process that holds it may be stopped or hung (SIGSTOP, a debugger, "
            "a frozen container); find it with `fuser` on the segment and resume or kill it "
            "(a killed holder's lock is released and its changes repaired), or pass a longer "
            "timeout"
        )
