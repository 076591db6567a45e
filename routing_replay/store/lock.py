"""The store's commit lock: a flock the kernel drops when its holder dies, a dirty flag, repair.

Every change to the shared tables happens inside `CommitLock.held(...)` after the caller
has called `Hold.write()`: that sets the segment's dirty flag, and a normal exit clears
it. A holder killed half-way leaves the flag set, and the next process to take the lock
rebuilds every derived table from the published samples before doing anything else. An
exception raised half-way (a bug, or an async exception such as KeyboardInterrupt) is
repaired at once, by the process that raised it, before the lock is dropped.

An interruption can land anywhere, the lock's own bookkeeping included. So the threads of
a handle take it through a `Mutex` that knows its owner, and every public store call ends
with `settle()`: a holding that an interruption cut short is released there, by the
thread that was interrupted, before the error leaves the call; the dirty flag it may have
left makes the next holder repair. No live process holds the lock outside a store call.

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
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from routing_replay.errors import StoreBusyError
from routing_replay.store.calls import calls_running, closed_error
from routing_replay.store.segment import Segment, fork_epoch
from routing_replay.store.tables import Tables

_hook: Callable[[str], None] | None = None
_LOCKS: weakref.WeakSet[CommitLock] = weakref.WeakSet()  # every handle's lock in this process
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


class Mutex:
    """A lock for the threads of one process that knows which thread holds it, so that a
    holding an interruption cut short can be found and ended (`release_if_mine`). After a
    fork it starts free: the parent's threads are not in the child."""

    __slots__ = ("_epoch", "_lock")

    def __init__(self) -> None:
        self._lock, self._epoch = threading.RLock(), fork_epoch()

    def acquire(self, deadline: float, store: str) -> bool:
        """Take it by `deadline` (time.monotonic). If this thread holds it already, either a
        store call cut short left it so and is over (then it is ours again at once), or
        this is a store call made inside one that holds it (a signal handler, a finalizer):
        refused, never run inside the outer call's change."""
        if self._epoch != fork_epoch():
            self._lock, self._epoch = threading.RLock(), fork_epoch()
        if self._lock._is_owned():  # CPython's RLock, what threading.Condition uses
            if calls_running(sys._getframe(1)) > 1:
                raise StoreBusyError(
                    f"store {store!r} was called from inside another call of it on the same "
                    "thread (a signal handler, a finalizer or a trace hook that uses the "
                    "store): the inner call is refused. Call the store from the program's "
                    "own flow, or from another thread"
                )
            return True
        wait = min(max(deadline - time.monotonic(), 0.0), threading.TIMEOUT_MAX)
        return self._lock.acquire(timeout=wait)

    def release(self) -> None:
        self._lock.release()

    def owned(self) -> bool:
        """Whether this thread holds it."""
        return self._epoch == fork_epoch() and self._lock._is_owned()

    def release_if_mine(self) -> None:
        """Release it if this thread holds it."""
        if self.owned():
            with contextlib.suppress(RuntimeError):  # released meanwhile by the same thread
                self._lock.release()


class Hold:
    """One holding of a store's commit lock, as a context manager (`CommitLock.held`);
    `write()` before the first change to the tables. A plain object, not a generator: a put
    takes the lock three times, a read twice."""

    __slots__ = ("_deadline", "_lock", "_point", "writing")

    def __init__(self, lock: CommitLock, point: str, deadline: float) -> None:
        self._lock, self._point, self._deadline = lock, point, deadline
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
        if not lock._mutex.acquire(self._deadline, lock._tables.name):
            raise lock._busy(self._deadline)
        try:
            lock._take(self._deadline)
            if lock._tables.dirty:
                lock._repair()  # sets the flag back once the tables are whole
        except BaseException:
            lock.settle()
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
            self._lock.settle()
            if _hook is not None:
                _hook(f"{self._point}:drop")


class CommitLock:
    """Exclusive cross-process lock of one store handle, with repair of what a dead holder left."""

    def __init__(
        self,
        segment: Segment,
        tables: Tables,
        repair: Callable[[], None],
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._segment = segment
        self._tables = tables
        self._repair = repair
        self._closing = closing  # the handle is closing: a wait for the lock ends
        _LOCKS.add(self)
        self._mutex = Mutex()  # the threads of this process; the flock: other processes

    def held(self, point: str, deadline: float) -> Hold:
        """`with lock.held(point, deadline) as hold:` holds the lock (waiting at most until
        `deadline`, time.monotonic), repairing first what a dead holder left."""
        return Hold(self, point, deadline)

    def settle(self) -> None:
        """End this thread's holding, if it has one: the normal end of a holding, and, at the
        end of every store call, one an interruption cut short. The flock goes first, and
        the mutex only once it has: only the thread holding the mutex may touch the flock."""
        if self._mutex.owned():
            self._segment.unlock()  # interrupted: the mutex stays ours, the next settle ends it
            self._mutex.release_if_mine()

    def _take(self, deadline: float) -> None:
        fd = self._segment.lock_fd
        tries, sleep = 0, FIRST_SLEEP_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            if tries == 0 and self._held_by_this_thread_elsewhere():
                raise StoreBusyError(
                    f"store {self._tables.name!r} was called from inside another call of it on "
                    "the same thread, through another handle (a signal handler, a finalizer "
                    "or a trace hook that uses the store): that call holds the lock, so this "
                    "one is refused. Call the store from the program's own flow, or from "
                    "another thread"
                )
            if time.monotonic() >= deadline:
                raise self._busy(deadline)
            if self._closing():
                raise closed_error(self._tables.name)
            tries += 1
            if tries <= SPIN_YIELDS:
                os.sched_yield()  # the holder is usually a few microseconds from done
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, LONGEST_SLEEP_S)

    def _held_by_this_thread_elsewhere(self) -> bool:
        """Whether this thread holds this store's lock through another handle of this process
        (waiting for it would wait for ourselves)."""
        key = (self._tables.name, self._tables.store_uid)
        while True:
            try:
                locks = list(_LOCKS)
                break
            except RuntimeError:  # another thread made a handle meanwhile
                continue
        return any(
            lock is not self
            and (lock._tables.name, lock._tables.store_uid) == key
            and lock._mutex.owned()
            for lock in locks
        )

    def _busy(self, deadline: float) -> StoreBusyError:
        return StoreBusyError(
            f"store {self._tables.name!r}: its lock stayed held by another process past the "
            "timeout. A process that holds it may be stopped or hung (SIGSTOP, a debugger, "
            "a frozen container); find it with `fuser` on the segment and resume or kill it "
            "(a killed holder's lock is released and its changes repaired), or pass a longer "
            "timeout"
        )
