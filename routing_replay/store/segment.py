"""POSIX shared-memory segments: trusted creation and attachment, and the file locks on them.

A segment is a file under /dev/shm (what `shm_open` creates on Linux), opened directly
with `os.open`: Python's `multiprocessing.shared_memory` registers every segment it
*attaches* with the resource tracker, which unlinks it when that process exits (3.11),
and a Ray worker's tracker dies with the worker. Opening the file ourselves means no
tracker ever owns a segment: only `Segment.unlink` (called by the creator) removes it.

Every handle has two descriptions of the file: one mapped (the data), and one for locks
(`Segment.lock_fd`), never mapped. Kernel file locks belong to an open file description
and last until its last reference goes, and a mapping is a reference: locks on the mapped
description would outlive a dead holder as long as a forked child still maps the file.
In a forked child the lock description is closed at once and a new one opened on first
use: a child never holds, or keeps alive, its parent's locks (`_after_fork_in_child`).

Two kinds of lock, independent on Linux: `flock` on the whole file is the store's commit
lock; open-file-description (OFD) byte-range locks at offsets past any data are leases,
one byte per holder, that the kernel drops when the holder dies, whatever its pid
namespace (containers that share /dev/shm but not pids see each other's leases).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pwd
import re
import stat
import sys
import warnings
import weakref

from routing_replay.errors import InvalidArgumentError, StoreUnavailableError
from routing_replay.store.calls import running_at_fork
from routing_replay.store.files import close_each, open_into
from routing_replay.store.ofd_locks import lease_try

# Where segments live: POSIX shared memory on Linux. ROUTING_REPLAY_SHM_DIR points the
# stores of every process that sets it at another tmpfs (for a /dev/shm that is too small).
SHM_DIR = os.environ.get("ROUTING_REPLAY_SHM_DIR", "/dev/shm")
SEGMENT_PREFIX = "rr_"
SEGMENT_MODE = 0o600  # owner-only: another user cannot open, let alone map, a store
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
# Map every page up front: one pass at create/attach instead of a page fault on the
# first touch of each 4 KiB during puts and reads.
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

_fork_epoch = 0  # bumped in every forked child: handles notice they were inherited
FORKED_INSIDE_EXIT = 70  # a child forked inside a store call exits with this status


def fork_epoch() -> int:
    """How many forks separate this process from the one that imported routing_replay."""
    return _fork_epoch


def is_store_name(name: str) -> bool:
    """Whether `name` may name a store (its segment is SEGMENT_PREFIX + name)."""
    return isinstance(name, str) and bool(NAME_PATTERN.fullmatch(name)) and name[0] != "."


def segment_path(name: str) -> str:
    """Path of a store's segment file."""
    if not is_store_name(name):
        raise InvalidArgumentError(
            f"store name {name!r} is invalid: use 1-200 characters from [A-Za-z0-9_.-] "
            "(include the job and node, e.g. 'grpo-run7.node3')"
        )
    return os.path.join(SHM_DIR, SEGMENT_PREFIX + name)


def shm_free_bytes() -> int:
    """Bytes still free in /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def user_name(uid: int) -> str:
    """`name (uid N)` for messages."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def untrusted_reason(st: os.stat_result, mode: int = SEGMENT_MODE) -> str | None:
    """Why a segment (or spill) file must not be used by this process, or None if it may be."""
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for is_kind, k in _KINDS if is_kind(st.st_mode)), "a device file")
        return f"is {kind} of {user_name(st.st_uid)}, not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to {user_name(st.st_uid)}, not to you ({user_name(os.geteuid())})"
    if stat.S_IMODE(st.st_mode) != mode:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not {mode:04o}"
    return None


# -- segments -----------------------------------------------------------------------------


class Segment:
    """One mapped shared-memory file: create (owner) or attach (same user, mode 0600)."""

    def __init__(
        self, name: str, fd: int, lock_fd: int, mm: mmap.mmap, owner: bool, fds: list[int]
    ) -> None:
        self.name = name
        self.path = segment_path(name)
        self.fd = fd  # the mapped description: fstat, reopening; never locked
        self._lock_fd = lock_fd
        self.epoch = _fork_epoch
        self.mmap = mm
        self._creator = os.getpid() if owner else 0
        # What close() closes, once: the list create/attach filled as they opened, so that
        # their clean-up after a stop here and this finalizer never both close a number.
        self._to_close = fds
        st = os.fstat(fd)
        self._inode = (st.st_dev, st.st_ino)  # the file this mapping is, for unlink()
        _SEGMENTS.add(self)
        # A handle dropped unclosed gives back its descriptors, so its leases (kernel locks
        # on them) with them, as a file does; at exit the process's end gives them back.
        self._finalizer = weakref.finalize(self, _dropped, name, self._to_close)
        self._finalizer.atexit = False

    @property
    def owner(self) -> bool:
        """Whether this process created the segment (a forked child of the creator is not)."""
        return self._creator == os.getpid()

    @property
    def lock_fd(self) -> int:
        """This process's own description of the file for locks (new after a fork)."""
        if self._lock_fd < 0:
            if self.fd < 0:
                raise StoreUnavailableError(f"store {self.name!r} is closed in this process")
            self._lock_fd = _reopen(self._to_close, self.fd)  # closed with the handle
        return self._lock_fd

    def unlock(self) -> None:
        """Drop the commit lock (flock) if this process's lock description holds it."""
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)  # a no-op when not held

    @classmethod
    def create(cls, name: str, size: int, owner_lease: int) -> Segment:
        """Create, size and map a new segment, holding its owner lease from the start."""
        path = segment_path(name)
        free = shm_free_bytes()
        if size > free:
            raise StoreUnavailableError(
                f"{SHM_DIR} has {free / 2**20:.1f} MiB free but store {name!r} needs "
                f"{size / 2**20:.1f} MiB: lower capacity_tokens (or max_samples), release other "
                "stores, or give the container more shared memory (docker run --shm-size=16g; "
                "Ray's object store lives there too)"
            )
        fds: list[int] = []  # every descriptor opened, put there by the open itself
        mm = None
        try:  # whatever stops it (an OSError, Ctrl-C), nothing it made stays
            fd = open_into(fds, path, OPEN_FLAGS | os.O_CREAT | os.O_EXCL, SEGMENT_MODE)
            os.fchmod(fd, SEGMENT_MODE)
            lock_fd = _reopen(fds, fd)
            lease_try(lock_fd, owner_lease)  # a new file: nobody else can hold it
            # Commit the memory now: a full tmpfs fails here with ENOSPC instead of
            # killing a writer with SIGBUS half-way through a put later.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
            return cls(name, fd, lock_fd, mm, owner=True, fds=fds)
        except BaseException as e:
            if not fds:  # not ours: the name was taken, or nothing was made
                if isinstance(e, FileExistsError):
                    raise StoreUnavailableError(_exists_message(name, path)) from None
            else:
                _discard(path, mm, fds)
            if isinstance(e, OSError) and not isinstance(e, StoreUnavailableError):
                raise StoreUnavailableError(
                    f"could not allocate {size / 2**20:.1f} MiB in {SHM_DIR} for store "
                    f"{name!r} ({e.strerror}): lower capacity_tokens (or max_samples) or give the "
                    "container more shared memory (docker run --shm-size=...)"
                ) from e
            raise

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment of this user's, created by another process on this node.

        The file must be a regular file (no symbolic link is followed), owned by this
        process's effective user, with mode 0600: anything else may have been planted by
        another user and is refused.
        """
        path = segment_path(name)
        fds: list[int] = []  # as in create
        mm = None
        try:  # one try: a stop at any line of it closes what it opened
            fd = open_into(fds, path, OPEN_FLAGS)
            st = os.fstat(fd)
            reason = untrusted_reason(st)
            if reason:
                raise StoreUnavailableError(_refusal(path, reason))
            if st.st_size == 0:
                raise StoreUnavailableError(f"store {name!r} is still being created; retry")
            lock_fd = _reopen(fds, fd)
            mm = mmap.mmap(fd, st.st_size, flags=MAP_FLAGS)
            return cls(name, fd, lock_fd, mm, owner=False, fds=fds)
        except BaseException as e:
            _release(mm, fds)
            if not fds and isinstance(e, FileNotFoundError):
                raise StoreUnavailableError(
                    f"no routing store named {name!r} on this node ({path} does not exist): "
                    "create it first with RoutingStore.create, or check the job and node in "
                    "the name"
                ) from None
            if not fds and isinstance(e, OSError):  # another user's, a link, a socket, ...
                raise StoreUnavailableError(_unopenable(name, path, e)) from None
            if isinstance(e, OSError) and not isinstance(e, StoreUnavailableError):
                raise StoreUnavailableError(  # reopening or mapping it: descriptors, memory
                    f"cannot attach store {name!r} ({type(e).__name__}: {e}): raise `ulimit -n` "
                    "if out of file descriptors, or free memory; nothing was attached"
                ) from None
            raise

    @property
    def size(self) -> int:
        """Mapped bytes."""
        return len(self.mmap)

    def is_current(self) -> bool:
        """Whether the file at the segment's path is still this mapping (not unlinked/replaced)."""
        try:
            now, mine = os.stat(self.path, follow_symlinks=False), os.fstat(self.fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def close(self) -> None:
        """Unmap and close; every numpy view of the mapping must be dropped first. A close
        stopped half-way is finished by the next; no descriptor is closed twice (its number
        may by then name another handle's file), whichever threads close at once."""
        if self.fd >= 0:
            self.mmap.close()  # BufferError if a view still exists: never hand out views
            self.fd = self._lock_fd = -1
            _SEGMENTS.discard(self)
        close_each(self._to_close)  # (also what a close stopped here left): leases, lock go
        self._finalizer.detach()  # (nothing left for it: no code runs at collection)

    def unlink(self) -> None:
        """Remove the segment file, if the path still names it (not a store made under the
        name since a wipe removed this one); mappings stay valid until closed."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def discard(self) -> None:
        """Remove a segment whose creation failed, and give back what it holds now."""
        self.unlink()
        self.abandon()

    def abandon(self) -> None:
        """Give back a segment whose handle was never made (stopped half-way): descriptors
        and leases now, the mapping too unless a view of it is still alive (then with the
        last view: a traceback may hold one)."""
        self.fd = self._lock_fd = -1
        _SEGMENTS.discard(self)
        close_each(self._to_close)
        self._finalizer.detach()
        with contextlib.suppress(BufferError):
            self.mmap.close()

    def _forget_parents_locks(self) -> None:
        """In a forked child: close the lock description shared with the parent."""
        if self._lock_fd >= 0:
            with contextlib.suppress(ValueError):
                self._to_close.remove(self._lock_fd)
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # the parent's locks stay the parent's
        self._lock_fd = -1
        self.epoch = _fork_epoch


def _dropped(name: str, fds: list[int]) -> None:
    """A segment garbage-collected unclosed: close what it still holds, and say so."""
    if fds:
        close_each(fds)
        warnings.warn(
            f"store {name!r}: a handle was garbage-collected without close(); its writer "
            "lease went with it. Close handles (or use `with`)",
            ResourceWarning,
            stacklevel=2,
        )


def _discard(path: str, mm: mmap.mmap | None, fds: list[int]) -> None:
    """Unlink a half-made segment, close its descriptors, unmap it if no view is alive."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _release(mm, fds)


def _release(mm: mmap.mmap | None, fds: list[int]) -> None:
    """Close the descriptors of a segment never handed out (each once: a half-made
    `Segment`'s finalizer shares the list); unmap it if no view is alive."""
    while fds:
        with contextlib.suppress(OSError):
            close_each(fds)
    if mm is not None:
        with contextlib.suppress(BufferError):
            mm.close()


def _reopen(fds: list[int], fd: int) -> int:
    """A new open file description of the same file as `fd` (same inode, never a path race),
    into `fds`."""
    return open_into(fds, f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def _refusal(path: str, reason: str) -> str:
    return (
        f"{path} {reason}: a store is attached only if it is yours with mode 0600, so this "
        "file is not used. If another user's job has this name, pick another store name "
        f"(include your job); if it is a leftover, its owner (or root) removes it: rm {path}"
    )


def _unopenable(name: str, path: str, error: OSError) -> str:
    """Why `path` could not be opened, naming its owner (nothing is followed or used)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return _refusal(path, f"cannot be opened ({error.strerror})")
    if isinstance(error, PermissionError) and st.st_uid != os.geteuid():
        return (
            f"store {name!r} ({path}) belongs to another user, {user_name(st.st_uid)}: "
            "stores are owner-only; attach as the user that created it"
        )
    return _refusal(path, untrusted_reason(st) or f"cannot be opened ({error.strerror})")


def _exists_message(name: str, path: str) -> str:
    try:
        reason = untrusted_reason(os.stat(path, follow_symlinks=False))
    except OSError:
        reason = None
    if reason:
        return (
            f"store name {name!r} is taken: {path} {reason}. It is not used; pick another "
            f"store name (include your job), or have its owner (or root) remove it: rm {path}"
        )
    return (
        f"a store named {name!r} already exists ({path}): attach to it with "
        "RoutingStore.attach, or if its owner is dead remove it with "
        "routing_replay.store.sweep_stores() or `routing-replay sweep`"
    )


_SEGMENTS: weakref.WeakSet[Segment] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child: segments drop the parent's lock description. A child forked inside
    a store call (by a signal handler or a hook) ends: it would change the parent's store."""
    global _fork_epoch
    _fork_epoch += 1
    for segment in list(_SEGMENTS):
        segment._forget_parents_locks()
    inside = running_at_fork(sys._getframe())  # (the forking thread: the only one left)
    if inside:
        os.write(2, f"routing_replay: process {os.getpid()} was forked inside {inside}: it "
            f"exits ({FORKED_INSIDE_EXIT}); fork outside store calls\n".encode())  # fmt: skip
        os._exit(FORKED_INSIDE_EXIT)


os.register_at_fork(after_in_child=_after_fork_in_child)
