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
    """One holding of the commit lock; `write()` before the first change to the tables."""

    __slots__ = ("_tables", "writing")

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self.writing = False

    def write(self) -> None:
        """Mark the tables dirty until this holding ends (idempotent)."""
        if not self.writing:
            self._tables.set_dirty(True)
            self.writing = True


class CommitLock:
    """Exclusive cross-process lock of one store handle, with repair of what a dead holder left."""

    def __init__(self, segment: Segment, tables: Tables, repair: Callable[[], None]) -> None:
        self._segment = segment
        self._tables = tables
        self._repair = repair
        self._thread_lock = threading.Lock()
        self._epoch = segment.epoch

    @contextlib.contextmanager
    def held(self, point: str, deadline: float) -> Iterator[Hold]:
        """Hold the lock (waiting at most until `deadline`, time.monotonic); repair first."""
        if _hook is not None:
            _hook(f"{point}:take")
        if self._epoch != self._segment.epoch:  # forked: the parent's thread lock may be held
            self._thread_lock, self._epoch = threading.Lock(), self._segment.epoch
        if not self._thread_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise self._busy(deadline)
        try:
            fd = self._segment.lock_fd
            try:  # unlocking what this description does not hold is a no-op: no window
                self._take(fd, deadline)
                hold = Hold(self._tables)
                if self._tables.dirty:
                    self._repair()  # sets the flag back once the tables are whole
                try:
                    yield hold
                except BaseException:
                    if hold.writing:
                        self._repair()  # half-made changes of ours: undone before we let go
                    raise
                if hold.writing:
                    self._tables.set_dirty(False)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()
            if _hook is not None:
                _hook(f"{point}:drop")

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
