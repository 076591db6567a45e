"""Spill directories: the root, its budget from the disk, each store's own directory, the
shared users lock its handles hold and the record of the /dev/shm its store lives in, so
that sweeps remove only directories no store uses."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
import zlib

from routing_replay.errors import InvalidArgumentError, StoreUnavailableError
from routing_replay.store import segment
from routing_replay.store.files import close_each, open_file, open_into
from routing_replay.store.format import ATTACH_WAIT_S, MAX_SPILL_DIR_BYTES
from routing_replay.store.segment import is_store_name
from routing_replay.store.tables import uid_on_node

SPILL_SUFFIX = ".spill"  # how a spill file's name (`spill.spill_name`) ends
_DIR_NAME = re.compile(r"^rr_(.+)-([0-9a-f]{16})$")
DIR_MODE, FILE_MODE = 0o700, 0o600  # a store's spill directory and files: this user's only
# In a store's directory: every open handle of the store holds a shared flock on it, which
# the kernel drops when the handle closes or its process dies (whatever its /dev/shm).
USERS_FILE = "owner.lock"
HALF_MADE_S = 60.0  # a store directory without its users file is being made for this long
TOMB_PREFIX = ".rr-removing-"  # a store directory being removed (no sweep or attach opens it)
BOOT_ID = "/proc/sys/kernel/random/boot_id"  # the host's boot (a reboot wipes every /dev/shm)


def store_spill_dir(spill_dir: str, name: str, store_uid: int) -> str:
    """The directory of one store incarnation's spill files, under the user's `spill_dir`."""
    return os.path.join(os.path.abspath(spill_dir), f"rr_{name}-{store_uid:016x}")


def spill_root_of(spill_dir: object) -> str:
    """`create`'s `spill_dir` as an absolute path; a clear error for what cannot be one."""
    try:
        path = os.fspath(spill_dir)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidArgumentError(
            f"spill_dir must be a non-empty path of a local directory, got {spill_dir!r}"
        )
    return os.path.abspath(path)


def budget_for(spill_dir: str, name: str, page_file_bytes: int, budget: int | None) -> int:
    """The budget of a new store's spill files (default: half the free space of `spill_dir`'s
    file system), after checking that the disk can hold one page's file at all (`budget`
    itself was checked with the store's other sizes)."""
    if len(store_spill_dir(spill_dir, name, 0).encode()) > MAX_SPILL_DIR_BYTES - 24:
        raise InvalidArgumentError(f"spill_dir {spill_dir!r} is too long: use a shorter path")
    try:
        if os.path.lexists(spill_dir) and not os.path.isdir(spill_dir):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), spill_dir)
        os.makedirs(spill_dir, exist_ok=True)
        if not os.path.isdir(spill_dir):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), spill_dir)
        st = os.statvfs(spill_dir)
    except OSError as e:
        raise StoreUnavailableError(
            f"spill_dir {spill_dir!r} cannot hold spill files: {e.strerror or e}: point "
            "spill_dir at a directory of a local disk this user can create and write"
        ) from None
    free = st.f_bavail * st.f_frsize
    if free < page_file_bytes:
        raise StoreUnavailableError(
            f"spill_dir {spill_dir!r} has {free} bytes free, less than one page's spill file "
            f"({page_file_bytes} bytes): free space on that disk, or point spill_dir at "
            "another local disk"
        )
    return free // 2 if budget is None else budget


def make_spill_dir(spill_dir: str, name: str, store_uid: int, users: list[int]) -> str:
    """Create a new store's own spill directory (private to this user) holding the users
    lock: a shared flock on `USERS_FILE` in it that every handle of the store holds, seen by
    every process of the host whatever its /dev/shm, and the store's home (`home_record`):
    `sweep_spill_dirs` judges by both.
    Returns the path; the lock's descriptor goes into `users`, for the new handle to adopt."""
    path = store_spill_dir(spill_dir, name, store_uid)  # ours alone: the store's uid names it
    try:
        home = home_record()  # (first: nothing made if it cannot be read)
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)  # whatever the umask
        # Locked under a name no sweep opens, then renamed: a sweep sees no users file (a
        # store being created) or a held one, never a free lock of a live store.
        new = os.path.join(path, USERS_FILE + ".new")
        with open_file(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE) as file:
            os.fchmod(file.fileno(), FILE_MODE)  # whatever the umask
            if os.write(file.fileno(), home) != HOME_BYTES:  # where the store lives
                raise OSError(errno.ENOSPC, "its users file could not be written whole", path)
        # Held read-only: a handle keeps no file of the disk open for writing (a remount
        # read-only would be refused).
        open_into(users, new, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(users[0], fcntl.LOCK_SH | fcntl.LOCK_NB)  # a new name: nobody holds it
        os.rename(new, os.path.join(path, USERS_FILE))
        return path
    except BaseException as e:
        close_each(users)
        for name_in_it in (USERS_FILE + ".new", USERS_FILE):  # all it can hold by now
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, name_in_it))
        with contextlib.suppress(OSError):
            os.rmdir(path)  # no descriptor needed: works out of them too (rmtree does not)
        if isinstance(e, OSError):
            raise StoreUnavailableError(
                f"cannot make store {name!r}'s spill directory in {spill_dir} ({e}): check "
                "the disk and this process's open file limit (ulimit -n); nothing was created"
            ) from e
        raise


def use_spill_dir(path: str, users: list[int]) -> None:
    """Take a handle's shared lock on its store's directory into the empty list `users`
    (left empty if the directory is gone: its spilled samples then read as missing; any other
    failure is a `StoreUnavailableError`). A sweep
    probing the lock holds it exclusively for an instant: waited for, up to ATTACH_WAIT_S."""
    try:  # one try, no nested one: a stop at any line of it closes what it opened
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        open_into(users, os.path.join(path, USERS_FILE), flags)
        if not stat.S_ISREG(os.fstat(users[0]).st_mode):  # a FIFO planted there
            raise PermissionError(errno.EPERM, "its users lock is not a regular file", path)
        deadline = time.monotonic() + ATTACH_WAIT_S
        while not _shared_lock(users[0]):
            if time.monotonic() >= deadline:
                raise BlockingIOError("held by a sweep past the wait")
            time.sleep(0.001)
        if not _same_file(users[0], os.path.join(path, USERS_FILE)):
            raise FileNotFoundError("a sweep took the directory away meanwhile")
    except BaseException as e:
        close_each(users)
        if isinstance(e, FileNotFoundError):
            return  # the directory is gone: nothing to hold
        if isinstance(e, OSError):  # out of descriptors, a sweep holding it, not ours, ...
            raise StoreUnavailableError(
                f"cannot hold the spill directory {path} of this store ({e}): without its lock "
                "a sweep could remove it under this handle. Raise `ulimit -n` if out of "
                "descriptors, check the directory's owner, or retry; nothing was attached"
            ) from None
        raise


def _shared_lock(fd: int) -> bool:
    """Take a shared flock on `fd` without waiting; whether it was free of exclusive ones."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def check_dir(path: str) -> None:
    """Refuse a spill directory that is not this user's own, mode 0700 (an OSError: the
    store cannot spill there)."""
    st = os.lstat(path)
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.geteuid()
        or stat.S_IMODE(st.st_mode) != DIR_MODE
    ):
        raise PermissionError(
            errno.EPERM,
            f"not this user's own directory with mode {DIR_MODE:04o}; not used",
            path,
        )


def sweep_spill_dirs(
    spill_dir: str | os.PathLike, *, dead_owners: bool = True, dry_run: bool = False
) -> list[str]:
    """Remove the store directories under `spill_dir` whose store is gone: no handle holds
    its users lock (every process that had the store open closed it or died) and
    - its store lived in this /dev/shm, which holds no segment of it any more (wiped, or
      unlinked); one still there keeps its files, to be attached again or swept with its
      segment (`sweep_stores`);
    - or its store lived in a /dev/shm gone with a reboot;
    - or, with `dead_owners` (the default), its store lives in another /dev/shm of this boot
      (another pod's or container's, whose segments this process cannot see): its owners
      closed or died. `create` sweeps with `dead_owners=False`, so a store closed without
      `unlink()` in one pod keeps its files against another pod's creates.
    A directory whose home record cannot be read (damaged) is judged as one of another
    /dev/shm that this one does not name. Only this user's own (mode 0700) directories are
    judged. Returns the paths removed (with `dry_run`: that would be)."""
    root = spill_root_of(spill_dir)
    try:
        entries, here = list(os.scandir(root)), home_record()
    except OSError:
        return []  # nothing to judge, or where this process is cannot be told now
    removed = []
    for entry in entries:
        if entry.name.startswith(TOMB_PREFIX):  # a sweep stopped while removing it
            with contextlib.suppress(OSError):
                check_dir(entry.path)
                if not dry_run:
                    remove_spill_dir(entry.path)
            continue
        m = _DIR_NAME.match(entry.name)
        if m is None or not is_store_name(m.group(1)):
            continue
        try:
            check_dir(entry.path)
        except OSError:
            continue  # not ours to judge
        if _kept(entry.path, here, m.group(1), int(m.group(2), 16), dead_owners):
            continue
        if _unused(entry.path) if dry_run else remove_spill_dir_if_unused(entry.path):
            removed.append(entry.path)
    return removed


def remove_spill_dir_if_unused(path: str) -> bool:
    """Remove a store directory if no handle holds its users lock; whether it did. Renamed
    away (to a name neither sweeps nor attaches open) while the lock is held exclusively, so
    a handle arriving meanwhile finds no directory rather than losing it under its feet."""
    lock = os.path.join(path, USERS_FILE)
    try:
        file = open_file(lock, os.O_RDONLY)
    except FileNotFoundError:  # being created, for a minute; else half made and left
        return _half_made(path) and _bury(path)
    except OSError:
        return False  # something we cannot judge: left alone
    with file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return False  # not ours to judge
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a handle holds it (BlockingIOError), or it cannot be judged
        return _same_file(file.fileno(), lock) and _bury(path)


def _half_made(path: str) -> bool:
    """Whether a store directory without its users file is one whose making stopped: over a
    minute old and holding no spill file. One that holds spill files lost its users file to
    something else (a cleaner of old files) and may be a live store's: left alone."""
    try:
        if time.time() - os.lstat(path).st_mtime <= HALF_MADE_S:
            return False
        return not any(n.endswith(SPILL_SUFFIX) for n in os.listdir(path))
    except OSError:
        return False


def _bury(path: str) -> bool:
    """Rename a store directory to a tomb and remove it; whether it was ours to remove."""
    tomb = os.path.join(os.path.dirname(path), f"{TOMB_PREFIX}{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(path, tomb)
    except OSError:
        return False  # gone meanwhile (another sweep), or not removable
    remove_spill_dir(tomb)
    return True


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _unused(path: str) -> bool:
    """Whether no handle of its store holds a store directory's users lock (a directory
    without the file, of a store being created, counts as used for a minute)."""
    try:
        file = open_file(os.path.join(path, USERS_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return _half_made(path)
    except OSError:
        return False  # something we cannot judge: left alone
    with file:  # (closing drops the lock if we took it)
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return False
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: a handle holds it
            return False
    return True


def home_record() -> bytes:
    """Where this process's stores live, as a store directory records it: the host's boot
    ("-" where the host has no boot id to read), and the device and inode of its /dev/shm
    (another pod's is another tmpfs, or another directory of one bound there), with a
    CRC-32. An OSError if either cannot be read now (out of descriptors, say)."""
    try:
        with open(BOOT_ID, "rb") as f:
            boot = f.read(37).decode("ascii", "replace").strip()
    except (FileNotFoundError, PermissionError):
        boot = ""
    if not _BOOT.fullmatch(boot):
        boot = UNKNOWN_BOOT
    st = os.stat(segment.SHM_DIR)
    text = f"{boot:<36} {st.st_dev:016x} {st.st_ino:016x}"
    return f"{text} {zlib.crc32(text.encode()):08x}\n".encode()


_BOOT = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
UNKNOWN_BOOT = "-"
HOME_BYTES = 36 + 1 + 16 + 1 + 16 + 1 + 8 + 1  # the record's length


def _home_of(path: str) -> bytes | None:
    """A store directory's home record (`home_record`): b"" if it has no users file (being
    made, or half made), None if its record cannot be read or fails its check (a flipped
    bit, a directory made before records)."""
    try:
        with open_file(os.path.join(path, USERS_FILE), os.O_RDONLY) as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                return None
            raw = os.pread(file.fileno(), HOME_BYTES + 1, 0)
    except FileNotFoundError:
        return b""
    except OSError:
        return None
    text, _, crc = raw[:-1].rpartition(b" ")
    good = len(raw) == HOME_BYTES and raw.endswith(b"\n")
    return raw if good and crc == b"%08x" % zlib.crc32(text) else None


def _kept(path: str, here: bytes, name: str, store_uid: int, dead_owners: bool) -> bool:
    """Whether a sweep from `here` (`home_record`) keeps a store directory whatever its lock
    says (`sweep_spill_dirs`)."""
    if _named_here(name, store_uid):
        return True  # its store is in this /dev/shm, whatever its record says
    home = _home_of(path)
    if home == b"":
        return False  # no users file: judged by its age (`remove_spill_dir_if_unused`)
    if home == here:
        return False  # its store lived in this /dev/shm, which no longer has it
    boots, unknown = (home[:36], here[:36]) if home else (), UNKNOWN_BOOT.encode().ljust(36)
    if boots and boots[0] != boots[1] and unknown not in boots:
        return False  # another boot: its /dev/shm is gone
    # Another /dev/shm of this boot (or a record or boot that cannot be read): left to
    # sweeps asked for dead owners.
    return not dead_owners


def _named_here(name: str, store_uid: int) -> bool:
    """Whether this node's shared memory holds store `name` of incarnation `store_uid` (or a
    store of that name still being created, or one it cannot read: left alone)."""
    return uid_on_node(name) in (0, store_uid)


def remove_spill_dir(path: str) -> None:
    """Remove a store's whole spill directory ("": the store does not spill). It is flat:
    its entries are unlinked by name, with no descriptor to lose to a Ctrl-C (shutil.rmtree
    holds one, and closes it twice if interrupted between its close and its bookkeeping);
    the users lock last, so that a removal stopped half-way leaves a directory a sweep
    judges unused and removes (without it, one holding spill files is left alone)."""
    if not path:
        return
    with contextlib.suppress(OSError):
        names = sorted(os.listdir(path), key=lambda n: n == USERS_FILE)
        for name in names:
            entry = os.path.join(path, name)
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(entry).st_mode):
                    os.rmdir(entry)  # (an empty one: a planted one is not ours to empty)
                else:
                    os.unlink(entry)  # a file, or a link (never followed)
        os.rmdir(path)
