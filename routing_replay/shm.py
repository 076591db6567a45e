"""POSIX shared-memory segments and the cross-process lock that guards them.

A segment is a file under /dev/shm (what `shm_open` creates on Linux), opened directly
with `os.open`: Python's `multiprocessing.shared_memory` registers every segment it
*attaches* with the resource tracker, which unlinks it when that process exits (3.11),
and a Ray worker's tracker dies with the worker. Opening the file ourselves means no
tracker ever owns a segment: only `Segment.unlink` (called by the creator) removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import threading
import weakref
from collections.abc import Iterator

from routing_replay.errors import StoreUnavailableError

# Where segments live: POSIX shared memory on Linux. ROUTING_REPLAY_SHM_DIR points the
# stores of every process that sets it at another tmpfs (for a /dev/shm that is too small).
SHM_DIR = os.environ.get("ROUTING_REPLAY_SHM_DIR", "/dev/shm")
SEGMENT_PREFIX = "rr_"
SEGMENT_MODE = 0o600  # owner-only: another user cannot open, let alone map, a store
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
# Map every page up front: one pass at create/attach instead of a page fault on the
# first touch of each 4 KiB during puts and reads.
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def segment_path(name: str) -> str:
    """Path of a store's segment file."""
    if not NAME_PATTERN.match(name) or name.startswith("."):
        raise ValueError(
            f"store name {name!r} is invalid: use 1-200 characters from [A-Za-z0-9_.-] "
            "(include the job and node, e.g. 'grpo-run7.node3')"
        )
    return os.path.join(SHM_DIR, SEGMENT_PREFIX + name)


def shm_free_bytes() -> int:
    """Bytes still free in /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat after the command name, or None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def process_start(pid: int) -> int:
    """Start time of a process in clock ticks since boot, low 32 bits (tells a pid from its reuse).

    32 bits are 497 days of uptime at 100 ticks/s; a reused pid also has to start at the
    same tick modulo that to be mistaken for the first process. 0 if there is no such pid.
    """
    fields = _proc_stat(pid)
    return int(fields[19]) & 0xFFFFFFFF if fields else 0


_THIS_PROCESS: tuple[int, int] | None = None


def this_process() -> tuple[int, int]:
    """(pid, start time) of this process, as pages and headers record it; new after fork."""
    global _THIS_PROCESS
    if _THIS_PROCESS is None:
        _THIS_PROCESS = (os.getpid(), process_start(os.getpid()))
    return _THIS_PROCESS


def pid_alive(pid: int, start: int = 0) -> bool:
    """Whether a process exists, is not a zombie, and (if `start` is given) is that process."""
    try:
        fields = _proc_stat(pid)
    except PermissionError:
        return True
    if fields is None or fields[0] in (b"Z", b"X"):  # a killed, unreaped child is dead
        return False
    return not start or int(fields[19]) & 0xFFFFFFFF == start & 0xFFFFFFFF


class Segment:
    """One mapped shared-memory file: create (owner) or attach (anyone on the node)."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.path = segment_path(name)
        self.fd = fd
        self.mmap = mm
        self._creator = os.getpid() if owner else 0

    @property
    def owner(self) -> bool:
        """Whether this process created the segment (a forked child of the creator is not)."""
        return self._creator == os.getpid()

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create, size and map a new segment; fails cleanly if it exists or cannot fit."""
        path = segment_path(name)
        free = shm_free_bytes()
        if size > free:
            raise StoreUnavailableError(
                f"{SHM_DIR} has {free / 2**20:.1f} MiB free but store {name!r} needs "
                f"{size / 2**20:.1f} MiB: lower capacity_tokens, release other stores, or give "
                "the container more shared memory (docker run --shm-size=16g; Ray's object "
                "store lives there too)"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, SEGMENT_MODE)
        except FileExistsError:
            raise StoreUnavailableError(
                f"a store named {name!r} already exists ({path}): attach to it with "
                "RoutingStore.attach, or if its owner is dead remove it with "
                "routing_replay.sweep_stores() or `routing-replay sweep`"
            ) from None
        try:
            os.fchmod(fd, SEGMENT_MODE)
            # Commit the memory now: a full tmpfs fails here with ENOSPC instead of
            # killing a writer with SIGBUS half-way through a put later.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise StoreUnavailableError(
                f"could not allocate {size / 2**20:.1f} MiB in {SHM_DIR} for store {name!r} "
                f"({e.strerror}): lower capacity_tokens or give the container more shared "
                "memory (docker run --shm-size=...)"
            ) from e
        return cls(name, fd, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment created by another process on this node."""
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise StoreUnavailableError(
                f"no routing store named {name!r} on this node ({path} does not exist): "
                "create it first with RoutingStore.create, or check the job and node in the "
                "name"
            ) from None
        except PermissionError:
            raise StoreUnavailableError(
                f"store {name!r} ({path}) belongs to another user: stores are owner-only; "
                "attach as the user that created it"
            ) from None
        size = os.fstat(fd).st_size
        if size == 0:
            os.close(fd)
            raise StoreUnavailableError(f"store {name!r} is still being created; retry")
        return cls(name, fd, mmap.mmap(fd, size, flags=MAP_FLAGS), owner=False)

    @property
    def size(self) -> int:
        """Mapped bytes."""
        return len(self.mmap)

    def is_current(self) -> bool:
        """Whether the file at the segment's path is still this mapping (not unlinked/replaced)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except (FileNotFoundError, OSError):
            return False

    def close(self) -> None:
        """Unmap and close; every numpy view of the mapping must be dropped first."""
        if self.fd < 0:
            return
        self.mmap.close()  # BufferError if a view still exists: never hand out views
        os.close(self.fd)
        self.fd = -1

    def unlink(self) -> None:
        """Remove the segment file; mappings stay valid until closed."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SegmentLock:
    """Exclusive cross-process lock: `flock` on the segment fd, plus a thread lock.

    The kernel drops a flock when its holder dies (SIGKILL included), so a killed
    process never leaves the store locked; the store's dirty flag repairs what it was
    doing. A flock belongs to the open file description, which a forked child shares with
    its parent: in the child the lock re-opens the file (see `_after_fork_in_child`).
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._own_fd = -1  # the fd this lock opened itself (in a forked child)
        self._thread_lock = threading.Lock()
        _LOCKS.add(self)

    def _reopen(self) -> None:
        """Take a file description of this process's own, and a fresh thread lock."""
        fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR)  # same file, new description
        if self._own_fd >= 0:
            os.close(self._own_fd)  # inherited from the parent: its flock stays the parent's
        self._fd = self._own_fd = fd
        self._thread_lock = threading.Lock()  # the parent's may have been held at fork

    def close(self) -> None:
        """Close the fd this lock opened itself, if any (the segment closes its own)."""
        if self._own_fd >= 0:
            os.close(self._own_fd)
            self._own_fd = -1
        _LOCKS.discard(self)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the duration of the block."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


_LOCKS: weakref.WeakSet[SegmentLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child (one thread): a new process identity, and every live lock its own
    file description."""
    global _THIS_PROCESS
    _THIS_PROCESS = None
    for lock in list(_LOCKS):
        with contextlib.suppress(OSError):  # a closed segment: its lock is never used again
            lock._reopen()


os.register_at_fork(after_in_child=_after_fork_in_child)
