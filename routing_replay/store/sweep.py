"""Finding and removing stale stores: `list_stores`, `sweep_stores`, and `StoreInfo`.

A store's owner is alive while it holds the owner lease (a kernel file lock, dropped when
it dies, in any pid namespace). A store is swept only when it is this user's, has mode
0600, and its owner lease is free; anything else is skipped and said so.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
import warnings
from dataclasses import dataclass

from routing_replay.errors import CorruptStoreError, RoutingReplayError
from routing_replay.layout import RoutingLayout
from routing_replay.store.calls import forget_frames
from routing_replay.store.files import open_file
from routing_replay.store.format import HEADER_DTYPE, OWNER_LEASE, VERSION
from routing_replay.store.ofd_locks import lease_held
from routing_replay.store.routing_store import RoutingStore, StoreStats
from routing_replay.store.segment import (
    SEGMENT_PREFIX,
    SHM_DIR,
    is_store_name,
    untrusted_reason,
)
from routing_replay.store.spill_dirs import remove_spill_dir_if_unused
from routing_replay.store.tables import header_info


@dataclass(frozen=True)
class StoreInfo:
    """One store segment found in the shared-memory directory, as `list_stores` sees it."""

    name: str
    path: str
    size_bytes: int
    owner_pid: int  # as the creator saw it, in its own pid namespace
    owner_alive: bool  # the creator holds the owner lease
    node_id: str
    layout: RoutingLayout | None  # None: not a complete store (half-made or foreign)
    age_s: float
    stats: StoreStats | None  # None when it could not be attached
    owner_uid: int = -1
    problem: str | None = None  # why it cannot be used or judged (another user's, ...)
    corrupt: bool = False  # this user's store, but its header or tables are broken
    inode: tuple[int, int] = (0, 0)  # (device, inode) of the file judged: sweep removes only it
    spill_dir: str = ""  # the store's own directory of spill files ("": it does not spill)


def _read_info(path: str) -> StoreInfo:
    name = os.path.basename(path)[len(SEGMENT_PREFIX) :]
    st = os.stat(path, follow_symlinks=False)
    age = time.time() - st.st_mtime
    base = {
        "name": name,
        "path": path,
        "size_bytes": st.st_size,
        "age_s": age,
        "inode": (st.st_dev, st.st_ino),
    }
    problem = untrusted_reason(st)
    if problem is None and not is_store_name(name):
        problem = "its name is not a store name: it is not opened"
    raw = b""
    if problem is None:
        # (a file object's exit runs no line of Python: a stop cannot land before the close)
        try:
            with open_file(path, os.O_RDONLY) as f:
                now = os.fstat(f.fileno())
                if (now.st_dev, now.st_ino) != base["inode"] or not stat.S_ISREG(now.st_mode):
                    problem = "it was replaced while it was read: not judged"
                else:
                    alive = lease_held(f.fileno(), OWNER_LEASE)
                    raw = os.pread(f.fileno(), HEADER_DTYPE.itemsize, 0)
        except FileNotFoundError:
            raise
        except OSError as e:
            problem = f"it cannot be read ({e.strerror or e}): not judged"
    if problem:
        # Not ours to judge, and sweep must not remove it.
        return StoreInfo(
            **base, owner_pid=0, owner_alive=True, node_id="", layout=None, stats=None,
            owner_uid=st.st_uid, problem=problem,
        )  # fmt: skip
    info = header_info(raw)
    if info is None:  # half-made (or not a store)
        return StoreInfo(
            **base, owner_pid=0, owner_alive=alive, node_id="", layout=None, stats=None,
            owner_uid=st.st_uid, problem="incomplete",
        )  # fmt: skip
    if info["version"] != VERSION:
        return StoreInfo(
            **base, owner_pid=info["owner_pid"], owner_alive=True, node_id=info["node_id"],
            layout=None, stats=None, owner_uid=st.st_uid,
            problem=f"format version {info['version']} (this routing_replay reads {VERSION}); "
            "remove it by hand once no process uses it",
        )  # fmt: skip
    stats, problem, store, corrupt = None, None, None, False
    try:
        store = RoutingStore.attach(name)
        stats = store.stats()
    except RoutingReplayError as e:
        problem, corrupt = str(e), isinstance(e, CorruptStoreError)
    except OSError as e:
        problem = f"not readable: {e}"
    except BaseException:  # (Ctrl-C): the handle goes now, not when the error is dropped
        if store is not None:
            with contextlib.suppress(BufferError, RoutingReplayError):
                store.close()
        raise
    if store is not None:
        try:  # after the error is gone: its frames may still view the segment
            store.close()
        except BaseException:  # (Ctrl-C inside it): the next close finishes it, now
            with contextlib.suppress(BufferError, RoutingReplayError):
                store.close()
            raise
    return StoreInfo(
        **base, owner_pid=info["owner_pid"], owner_alive=alive, node_id=info["node_id"],
        layout=info["layout"], stats=stats, owner_uid=st.st_uid, problem=problem,
        corrupt=corrupt, spill_dir=info["spill_dir"],
    )  # fmt: skip


def list_stores(prefix: str = "") -> list[StoreInfo]:
    """Routing stores in the shared-memory directory (names starting with `prefix`)."""
    paths = sorted(
        e.path
        for e in os.scandir(SHM_DIR)
        if e.name.startswith(SEGMENT_PREFIX + prefix) and not e.is_dir(follow_symlinks=False)
    )
    infos = []
    for path in paths:
        try:
            infos.append(_read_info(path))
        except FileNotFoundError:  # unlinked meanwhile
            continue
        except BaseException as e:  # (Ctrl-C): a kept error keeps no handle, no file open
            forget_frames(e)
            raise
    return infos


def is_stale(info: StoreInfo, min_age_s: float) -> bool:
    """Whether `sweep_stores` removes this store: ours, and its owner lease is free."""
    if info.owner_alive:
        return False
    if info.layout is not None or info.corrupt:
        return True
    return info.problem == "incomplete" and info.age_s >= min_age_s


def skipped(info: StoreInfo) -> bool:
    """Whether sweep cannot judge or may not remove this entry (another user's, ...)."""
    if info.problem is None or info.problem == "incomplete" or info.corrupt:
        return False
    return info.layout is None


def sweep_stores(
    dry_run: bool = False, min_age_s: float = 60.0, prefix: str = ""
) -> list[StoreInfo]:
    """Unlink this user's stores whose owner is dead (and half-made ones older than min_age_s).

    A store whose owner holds its lease is never touched, whatever its pid says; entries
    that are not this user's, or of another format version, are skipped with a warning.
    Processes that still map a swept store keep their mapping; the memory returns when the
    last of them closes.
    """
    infos = list_stores(prefix)
    for info in infos:
        if skipped(info):
            warnings.warn(f"routing-replay sweep skipped {info.path}: {info.problem}", stacklevel=2)
    stale = [info for info in infos if is_stale(info, min_age_s)]
    if not dry_run:
        stale = [info for info in stale if _unlink_judged(info)]
    return stale


def _unlink_judged(info: StoreInfo) -> bool:
    """Unlink `info.path` only if it is still the very file judged stale (same inode, this
    user's, owner lease still free): a store created again under the name meanwhile stays."""
    try:
        file = open_file(info.path, os.O_RDONLY)
    except OSError:
        return False  # gone (unlinked by another sweeper or its owner), or not ours
    with file:
        fd = file.fileno()
        st = os.fstat(fd)
        if (
            (st.st_dev, st.st_ino) != info.inode
            or not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or lease_held(fd, OWNER_LEASE)
        ):
            return False
        try:
            now = os.stat(info.path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != info.inode:
                return False
            os.unlink(info.path)
        except FileNotFoundError:
            return False
        if os.path.basename(info.spill_dir).startswith(f"rr_{info.name}-"):
            # Its spill files die with it, unless handles still attached read them: then a
            # later sweep of the spill directory removes them, once the last has closed.
            remove_spill_dir_if_unused(info.spill_dir)
        return True
