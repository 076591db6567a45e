"""Spill: samples moved out of shared memory into files on local disk when the store is full.
(One module over 400 lines by design: one protocol, pick, write, commit, clean, whose
order repair relies on, read top to bottom in one place.)

A store created with `spill_dir` spills instead of stalling: a put that finds too few free
pages moves published samples, unread ones first, oldest put first, into one file each in
the store's own directory, then takes their pages. Reads of a spilled sample read its file
into memory (not mapped: see `SpillFile`; same rows, same Arrow, the slot's checks plus a
CRC-32 per page of the file); a release removes it. The files hold at most `spill_budget`
bytes; a put finding both full raises `StoreFullError` as before.

A spill, in the putting process, one at a time per handle (the threads of a process share
a handle, its writer lease and so its file names):

1. lock: take this handle's writer lease, pick victims (their chains checked); unlock;
2. without the lock: write each victim's rows and token ids to `spill_name(serial, code)`
   (`code` names this writer's lease: files of a dead writer are known as such). A disk
   error (full, failing, removed, not ours) stops here: the store cannot spill, the put
   waits for releases and names the error if its time runs out. Past the put's deadline no
   victim is written after the first (the put then starts no other spill);
3. lock: for each victim still the same put, still in memory and within the budget,
   `mark_spilled` (the spill field: the commit point; the checksum; the chain fields, the
   order `Spiller.finish` completes from after a stop) and drop its pages. Unlock;
4. however 2 and 3 ended, lock: remove the files of this attempt that no slot names.

A file is complete before its slot names it, and only files no slot names are removed, so
a stop anywhere loses no sample; what a killed spiller left is removed by `clean` (when a
dead writer's lease is reclaimed, by `reclaim`, and with the directory at the owner's
unlink), and directories whose store is gone by `sweep_spill_dirs`.
Nothing is fsynced: a spill file matters only while the segment lives, and both are lost
together in a power cut, while a killed process loses nothing the page cache holds.
A reader that located a sample in memory and copied it while it was spilled (its pages
taken by a put) sees the pages' generations change and reads again (`ReadPlan`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from routing_replay.errors import CorruptStoreError
from routing_replay.store.files import close_each, open_file
from routing_replay.store.format import (
    LEASE_HELD,
    MIN_LOCK_WAIT_S,
    NO_DIGEST,
    NO_PAGE,
    NOT_SPILLED,
    PAGE_DTYPE,
    PUBLISHED,
    READ,
    SLOT_DTYPE,
    TOKEN_DTYPE,
    aligned,
)
from routing_replay.store.lock import Hold, Mutex
from routing_replay.store.prefix import runs
from routing_replay.store.samples import EMPTY, checksum
from routing_replay.store.segment import fork_epoch, untrusted_reason
from routing_replay.store.spill_dirs import FILE_MODE, SPILL_SUFFIX, check_dir, use_spill_dir
from routing_replay.store.tables import Tables

if TYPE_CHECKING:
    from routing_replay.layout import RoutingLayout
    from routing_replay.store.core import StoreCore

SPILL_MAGIC = b"RRSPILL1"
SPILL_HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("store_uid", "<u8"),
        ("serial", "<u8"),
        ("digest", "<u8"),
        ("num_tokens", "<i8"),
        ("chunk_tokens", "<i4"),  # one CRC per chunk: the store's page
        ("values_per_token", "<i4"),
        ("dtype", "S4"),
        ("has_tokens", "<u4"),
    ]
)
_NAME = re.compile(r"^([0-9a-f]{16})-([0-9a-f]{16})\.spill$")
CLEAN_EVERY_S = 5.0  # a handle looks for files left behind at most this often


def spill_name(serial: int, code: int) -> str:
    """The file name of put `serial` spilled by writer `code`."""
    return f"{serial:016x}-{code:016x}{SPILL_SUFFIX}"


def writer_code(lease: tuple[int, int]) -> int:
    """A spill code naming a writer lease (index, generation); never NOT_SPILLED."""
    return ((lease[0] + 1) << 32) | lease[1]


def regions(num_tokens: int, has_tokens: bool, chunk_tokens: int, bytes_per_token: int):
    """Offsets of a spill file's CRCs, token ids and routes, and its size (`end`)."""
    crcs = aligned(SPILL_HEADER.itemsize)
    tokens = aligned(crcs + 4 * -(-num_tokens // chunk_tokens))
    routes = aligned(tokens + (TOKEN_DTYPE.itemsize * num_tokens if has_tokens else 0))
    return {
        "crcs": crcs,
        "tokens": tokens,
        "routes": routes,
        "end": routes + num_tokens * bytes_per_token,
    }


def file_bytes(layout: RoutingLayout, page_tokens: int, num_tokens: int, digest: int) -> int:
    """The size of a sample's spill file (what counts against the budget)."""
    return regions(num_tokens, digest != NO_DIGEST, page_tokens, layout.bytes_per_token)["end"]


def page_file_bytes(layout: RoutingLayout, page_tokens: int) -> int:
    """The spill file of a one-page sample with token ids: the smallest a budget is sized by."""
    return file_bytes(layout, page_tokens, page_tokens, 1)


def spill_slots(layout: RoutingLayout, page_tokens: int, num_pages: int, budget: int) -> int:
    """Sample slots a spilling store adds for its files: one per page-sized file the budget
    holds, their tables at most as large as the pages' (a slot is ~190 bytes of /dev/shm)."""
    if not budget:
        return 0
    page_bytes = PAGE_DTYPE.itemsize + page_tokens * (layout.bytes_per_token + TOKEN_DTYPE.itemsize)
    slot_bytes = SLOT_DTYPE.itemsize + 12  # the slot, its free-stack entry, its buckets
    return min(budget // page_file_bytes(layout, page_tokens), num_pages * page_bytes // slot_bytes)


def spill_files(path: str) -> list[tuple[str, re.Match]]:
    """The spill files in a store's directory `path`: each name, parsed ([] if it cannot be
    listed: removed, or not ours)."""
    try:
        return [(n, m) for n in os.listdir(path) if (m := _NAME.match(n))]
    except OSError:
        return []


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]


@dataclass(frozen=True)
class Victim:
    """A sample picked to spill: its slot, put, chain (checked under the pick lock) and file."""

    slot: int
    serial: int
    pages: np.ndarray
    gens: np.ndarray
    num_tokens: int
    digest: int
    nbytes: int


class SpillFile:
    """One spilled sample's file, read into memory (not mapped: a file truncated or a disk
    failing under a mapping kills the reader with SIGBUS; a read raises): its header checked
    against the slot it was named by, each chunk's CRC-32 checked the first time a read
    copies from it."""

    def __init__(self, core: StoreCore, path: str, serial: int, digest: int, num_tokens: int):
        layout, P = core.layout, core.page_tokens
        self.path, self._P = path, P
        core.spill.hold_dir()
        try:  # FileNotFoundError: gone
            file = open_file(path, os.O_RDONLY)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._corrupt("a symbolic link is in its place") from None
            if e.errno == errno.EISDIR:
                raise self._corrupt("a directory is in its place") from None
            raise
        with file:
            fd = file.fileno()
            st = os.fstat(fd)
            reason = untrusted_reason(st, FILE_MODE)
            if reason:
                raise self._corrupt(f"it {reason}")
            size = st.st_size
            where = regions(num_tokens, digest != NO_DIGEST, P, layout.bytes_per_token)
            if size != where["end"]:
                raise self._corrupt(f"{size} bytes, {where['end']} expected")
            self._map = bytearray(size)
            view, got = memoryview(self._map), 0
            while got < size:  # (one call reads at most 2 GiB)
                n = os.preadv(fd, [view[got:]], got)
                if n == 0:  # truncated since the fstat
                    raise self._corrupt(f"{got} bytes read, {size} expected")
                got += n
        head = np.frombuffer(self._map, SPILL_HEADER, 1)[0]
        want = (SPILL_MAGIC, core.store_uid, serial, digest, num_tokens, P)
        got = tuple(
            head[f].item()
            for f in ("magic", "store_uid", "serial", "digest", "num_tokens", "chunk_tokens")
        )
        if (
            got != want
            or head["values_per_token"] != layout.values_per_token
            or bytes(head["dtype"]) != layout.dtype.str.encode()
        ):
            raise self._corrupt(f"header {got} is not put #{serial} of this store")
        n_chunks = -(-num_tokens // P)
        self._crcs = np.frombuffer(self._map, "<u4", n_chunks, where["crcs"])
        self.routes = np.frombuffer(
            self._map, layout.dtype, num_tokens * layout.values_per_token, where["routes"]
        ).reshape(num_tokens, layout.values_per_token)
        # Without token ids: zeros, one per row (as a segment's unused token slots read), so
        # that token rows index like route rows; no read returns them.
        self._has_tokens = digest != NO_DIGEST
        self.tokens = (
            np.frombuffer(self._map, TOKEN_DTYPE, num_tokens, where["tokens"]).reshape(-1, 1)
            if self._has_tokens
            else np.broadcast_to(np.zeros((1, 1), TOKEN_DTYPE), (num_tokens, 1))
        )
        self._checked = np.zeros(n_chunks, dtype=bool)

    def check(self, a: int, b: int) -> None:
        """Check the CRCs of the chunks holding rows [a, b) (each once per read of the file)."""
        P = self._P
        for c in range(a // P, -(-b // P)):
            if self._checked[c]:
                continue
            crc = zlib.crc32(self.tokens[c * P : (c + 1) * P]) if self._has_tokens else 0
            if zlib.crc32(self.routes[c * P : (c + 1) * P], crc) != int(self._crcs[c]):
                raise self._corrupt(
                    f"rows {c * P}-{min((c + 1) * P, len(self.routes))} fail their CRC"
                )
            self._checked[c] = True

    def _corrupt(self, what: str) -> CorruptStoreError:
        return CorruptStoreError(
            f"spill file {self.path} is damaged ({what}): the sample's routes cannot be "
            "trusted. Release the sample and regenerate it; check the spill disk"
        )


class Spiller:
    """The spill side of one store handle: make room, write and commit spills, clean up.

    One spill at a time per handle (`_mutex`): the threads of a process share a handle and
    its writer lease, so two of them would otherwise pick the same victim and write the
    same file. A thread that waits for another's spill then finds the room it made.
    """

    def __init__(self, core: StoreCore, users: list[int]) -> None:
        # `users`: the handle's shared lock on the directory, its creator's (adopted) or
        # taken here, in the caller's list: whatever stops the handle's making, the caller
        # closes it; once made, close() does (one `pop` each: closed once).
        self._to_close = users
        self._finalizer = weakref.finalize(self, close_each, users)  # (dropped unclosed)
        self._finalizer.atexit = False
        self._epoch, self._dir_lock = fork_epoch(), threading.Lock()
        _SPILLERS.add(self)
        self.core = core
        self.dir, self.budget = core.tables.spill_dir, core.tables.spill_budget
        self._mutex = Mutex()
        self._waited = threading.local()  # .busy: this thread's last make_room found one running
        self.error: OSError | None = None  # why the last spill could not write, if it failed
        self._cleaned = -CLEAN_EVERY_S  # when this handle last cleaned (time.monotonic)
        if not users and self.enabled:
            use_spill_dir(self.dir, users)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def hold_dir(self) -> None:
        """Before a use of the directory: in a forked child, its own shared lock on it first
        (the parent's went at the fork: a child that never uses the store keeps no directory
        of a dead parent's from its sweep)."""
        if self._epoch != fork_epoch() and self.enabled:
            with self._dir_lock:
                if self._epoch != fork_epoch():
                    if not self._to_close:
                        use_spill_dir(self.dir, self._to_close)
                    self._epoch = fork_epoch()

    def _forget_parents_lock(self) -> None:
        """In a forked child (one thread): close the directory lock shared with the parent."""
        self._dir_lock = threading.Lock()
        close_each(self._to_close)

    def path(self, serial: int, code: int) -> str:
        return os.path.join(self.dir, spill_name(serial, code))

    # -- the protocol ---------------------------------------------------------------------

    def make_room(self, pages: int, deadline: float, lock_deadline: float) -> bool:
        """Make `pages` pages free by spilling; True if they are free now or a spill freed
        some (try again), False if nothing could be spilled: nothing in memory, the budget
        spent, the disk failed (`self.error`), or another thread of this handle was spilling
        past `lock_deadline`. Writing stops at `deadline` (the put's) after the first victim;
        the lock and the handle's spill are waited for until `lock_deadline`."""
        self.hold_dir()
        self._waited.busy = not self._mutex.acquire(lock_deadline, self.core.name)
        if self._waited.busy:
            return False  # another thread of this handle spills, past our deadline
        lock_deadline = max(lock_deadline, time.monotonic() + MIN_LOCK_WAIT_S)  # its own wait
        try:
            due = time.monotonic() - self._cleaned >= CLEAN_EVERY_S
            if due and self.core.tables.hdr["spill_garbage"]:
                self.clean(lock_deadline)
            return self._spill(pages, deadline, lock_deadline)
        finally:
            self._mutex.release_if_mine()

    def was_busy(self) -> bool:
        """Whether this thread's last `make_room` gave up waiting for another thread's spill."""
        return getattr(self._waited, "busy", False)

    def close(self) -> None:
        """The handle closes: its shared lock on the directory goes with it."""
        close_each(self._to_close)  # (also what a close stopped here left)
        self._finalizer.detach()  # (nothing left for it: no code runs at collection)

    def settle(self) -> None:
        """At the end of a store call: release the spill mutex if an interruption left this
        thread holding it."""
        self._mutex.release_if_mine()

    def _spill(self, pages: int, deadline: float, lock_deadline: float) -> bool:
        core = self.core
        with core.lock.held("spill.pick", lock_deadline) as hold:
            needed = pages - core.pages.free_count()
            if needed <= 0:
                return True  # another writer's spill or release made the room
            lease = core.leases.take(hold, lambda i: core.pages.reclaim_lease(hold, i))
            victims = self._pick(needed)
            if victims:  # files about to be written: a stop before their commit leaves them
                core.tables.mark_spill_garbage()
        if not victims:
            return False
        code, written, done = writer_code(lease), [], -1
        try:
            try:
                for v in victims:
                    if written and time.monotonic() >= deadline:
                        break
                    self._write(v, code)
                    written.append(v)
                self.error = None
            except OSError as e:  # a full, failing or removed disk: cannot spill now
                # A copy without the traceback: its frames view the segment.
                self.error = OSError(e.errno, e.strerror, e.filename)
            if not written:
                return False
            # What was written is committed even if writing took the lock's wait (timeout=0).
            commit_by = max(lock_deadline, time.monotonic() + MIN_LOCK_WAIT_S)
            with core.lock.held("spill.commit", commit_by) as hold:
                done = self._commit(hold, written, code)
            return done > 0
        finally:
            if done < len(victims):  # also when interrupted: `_discard` asks the slots
                self._discard(victims, code, lock_deadline)

    def _pick(self, pages: int) -> list[Victim]:
        """In-memory samples to spill, unread first, oldest put first, until `pages` would be
        free and within the budget (under the lock)."""
        core, t = self.core, self.core.tables
        room = self.budget - t.counter("spilled_bytes", 1 << 62)
        slots = np.flatnonzero((t.s_state == PUBLISHED) & (t.s_spill == NOT_SPILLED))
        order = np.lexsort((t.s_serial[slots], t.s_flags[slots] & READ))
        left: dict[int, int] = {}  # page -> samples still holding it, once the picks are gone
        victims, freed = [], 0
        for slot in slots[order].tolist():
            chain, gens, num_tokens, _ = core.samples.chain(slot)
            digest = core.samples.digest(slot)
            nbytes = file_bytes(core.layout, core.page_tokens, num_tokens, digest)
            if nbytes > room:
                continue
            room -= nbytes
            victims.append(
                Victim(slot, core.samples.serial(slot), chain, gens, num_tokens, digest, nbytes)
            )
            for p in chain.tolist():
                left[p] = left.get(p, int(t.p_refcount[p])) - 1
                freed += left[p] == 0
            if freed >= pages:
                break
        return victims

    def _write(self, v: Victim, code: int) -> None:
        """Copy a victim's rows and token ids out of its pages into its file (no lock: pages of
        a published sample never change, and the commit checks it is still published). A
        file of that name is what an earlier, interrupted spill of this handle left: no slot
        names it (the victim is in memory), so it is overwritten."""
        core, t, P = self.core, self.core.tables, self.core.page_tokens
        has = v.digest != NO_DIGEST
        where = regions(v.num_tokens, has, P, core.layout.bytes_per_token)
        routes = t.data.reshape(-1, core.layout.values_per_token)
        tokens = t.tokens.reshape(-1)
        head = np.zeros(1, SPILL_HEADER)
        head[0] = (
            SPILL_MAGIC,
            core.store_uid,
            v.serial,
            v.digest,
            v.num_tokens,
            P,
            core.layout.values_per_token,
            core.layout.dtype.str.encode(),
            has,
        )
        crcs = np.empty(len(v.pages), dtype="<u4")
        for i, page in enumerate(v.pages.tolist()):
            n = min(P, v.num_tokens - i * P)
            crc = zlib.crc32(tokens[page * P : page * P + n]) if has else 0
            crcs[i] = zlib.crc32(routes[page * P : page * P + n], crc)
        check_dir(self.dir)
        with open_file(self.path(v.serial, code), os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as file:
            fd = file.fileno()
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO with a reader, a device
                raise PermissionError(errno.EPERM, "not a regular file", file.name)
            os.fchmod(fd, FILE_MODE)  # whatever the umask: reads refuse any other mode
            os.ftruncate(fd, where["end"])
            os.pwrite(fd, head.tobytes(), 0)
            os.pwrite(fd, crcs.tobytes(), where["crcs"])
            sections = [("tokens", tokens.reshape(-1, 1))] if has else []
            for what, rows in [*sections, ("routes", routes)]:
                os.lseek(fd, where[what], os.SEEK_SET)
                for i, first, count in runs(v.pages.tolist()):
                    n = min(count * P, v.num_tokens - i * P)
                    _write_all(fd, memoryview(rows[first * P : first * P + n]).cast("B"))

    def _commit(self, hold: Hold, victims: list[Victim], code: int) -> int:
        """Make every victim still the same put, in memory and within the budget a spilled
        sample (under the lock); returns how many."""
        core, t, samples = self.core, self.core.tables, self.core.samples
        done = 0
        for v in victims:
            if (
                t.s_state[v.slot] != PUBLISHED
                or samples.serial(v.slot) != v.serial
                or samples.spill(v.slot) != NOT_SPILLED
                or t.counter("spilled_bytes", 1 << 62) + v.nbytes > self.budget
            ):
                continue
            pages, gens, _, _ = samples.chain(v.slot)
            if not (np.array_equal(pages, v.pages) and np.array_equal(gens, v.gens)):
                raise t.corrupt(f"slot {v.slot}: its chain changed while it was published")
            hold.write()
            mark_spilled(t, v.slot, code)  # the commit point, then what repair can finish
            freed = core.pages.dereference(pages)
            for p in freed.tolist():
                core.prefix.unlink(p)
            core.pages.push(freed)
            t.add("pages_referenced", -len(pages))
            t.add("spilled", 1)
            t.add("spilled_bytes", v.nbytes)
            done += 1
        return done

    def _discard(self, victims: list[Victim], code: int, deadline: float) -> None:
        """Remove the files of this attempt that no slot names (under the lock, which first
        finishes a commit an interruption cut short: what is committed is known there)."""
        t = self.core.tables
        with self.core.lock.held("spill.discard", max(deadline, time.monotonic() + 1)):
            doomed = [
                self.path(v.serial, code)
                for v in victims
                if not (
                    t.s_state[v.slot] == PUBLISHED
                    and int(t.s_serial[v.slot]) == v.serial
                    and int(t.s_spill[v.slot]) == code
                )
            ]
        for path in doomed:  # no slot can name them any more: this handle spills no other
            _unlink(path)

    # -- files of released samples, dead spillers, the whole directory ------------------------

    def forget(self, slot: int) -> str | None:
        """A spilled slot being released: its counters dropped (inside a write); the path to
        remove once the release committed (None: not spilled)."""
        samples, t = self.core.samples, self.core.tables
        code = samples.spill(slot)
        if code == NOT_SPILLED:
            return None
        size = file_bytes(
            self.core.layout,
            self.core.page_tokens,
            int(t.s_num_tokens[slot]),
            samples.digest(slot),
        )
        t.add("spilled", -1)
        t.add("spilled_bytes", -size)
        t.mark_spill_garbage()  # until the releaser has removed the file
        return self.path(samples.serial(slot), code)

    def finish(self) -> int:
        """Repair: complete the spills a holding cut short after their commit point (the spill
        field set); returns how many were torn. Safe to stop and run again at any point.

        `mark_spilled` writes the spill field, the checksum, then the chain fields: a slot
        whose checksum is not yet the spilled one still has the chain it was published with
        (its pages are not reused before the holding ends), checked as put before finishing.
        """
        t, samples, torn = self.core.tables, self.core.samples, 0
        for slot in np.flatnonzero((t.s_state == PUBLISHED) & (t.s_spill != NOT_SPILLED)).tolist():
            try:
                samples.chain(slot)  # the spilled checksum: only chain fields may be left
            except CorruptStoreError:
                samples.chain_in_memory(slot)  # else the published one, over an intact chain
                torn += 1
            mark_spilled(t, slot, int(t.s_spill[slot]))
        return torn

    def rebuild(self) -> None:
        """Repair: the spill counters from the published slots."""
        t, core = self.core.tables, self.core
        spilled = np.flatnonzero((t.s_state == PUBLISHED) & (t.s_spill != NOT_SPILLED))
        t.hdr["spilled"] = len(spilled)
        t.hdr["spilled_bytes"] = sum(
            file_bytes(core.layout, core.page_tokens, int(t.s_num_tokens[s]), int(t.s_digest[s]))
            for s in spilled.tolist()
        )

    def clean(self, deadline: float | None = None) -> int:
        """Remove spill files no slot names whose writer is dead or whose sample is gone;
        returns how many. The directory is listed and the files removed outside the lock:
        a file judged so under it can never be named again."""
        self._cleaned = time.monotonic()
        if not self.enabled:
            return 0
        self.hold_dir()
        names = spill_files(self.dir)
        if not names:
            return 0  # none, or no directory (removed): nothing of ours to clean
        t = self.core.tables
        deadline = self.core.deadline() if deadline is None else deadline
        with self.core.lock.held("spill.clean", deadline):
            seen = int(t.hdr["spill_garbage"])  # cleared below once what is judged here is gone
            doomed, writing = self._judge(names, leased=False)
        removed = sum(_unlink(os.path.join(self.dir, name)) for name in doomed)
        # A file kept for a spill in progress keeps the mark: its sample may be released
        # before that spill's commit, which then removes the file.
        if removed == len(doomed) and seen and not writing:
            with self.core.lock.held("spill.clean", deadline):
                if int(t.hdr["spill_garbage"]) == seen:  # no file was orphaned since
                    t.hdr["spill_garbage"] = 0
        return removed

    def unneeded(
        self, names: list[tuple[str, re.Match]] | None = None, *, leased: bool = False
    ) -> list[str]:
        """Under the lock: the spill files (of `names`, else of the directory) that no slot
        names and no live writer is spilling (`leased`: nor a writer whose lease the table
        still holds, dead or not: reclaiming that lease marks its files for cleaning)."""
        return self._judge(spill_files(self.dir) if names is None else names, leased)[0]

    def _judge(self, names: list[tuple[str, re.Match]], leased: bool) -> tuple[list[str], int]:
        """`unneeded`'s files, and how many others were kept as spills in progress."""
        t = self.core.tables
        published = t.s_state == PUBLISHED
        by_serial = dict(
            zip(t.s_serial[published].tolist(), np.flatnonzero(published).tolist(), strict=True)
        )
        doomed, writing = [], 0
        for name, m in names:
            serial, code = int(m.group(1), 16), int(m.group(2), 16)
            slot = by_serial.get(serial)
            if slot is not None and int(t.s_spill[slot]) == code:
                continue  # the sample's file
            in_progress = self._writer_alive(code) or (leased and self._writer_leased(code))
            # A spill in progress: its victim still in memory; for `verify` (`leased`) any
            # file of a live or leased writer, whose victim may have been released since the
            # writer picked it (the spill then removes the file, or a reclaim of its lease).
            if in_progress and (leased or (slot is not None and t.s_spill[slot] == NOT_SPILLED)):
                writing += 1
                continue
            doomed.append(name)
        return doomed, writing

    def _writer_alive(self, code: int) -> bool:
        return self._writer_leased(code) and self.core.leases.alive((code >> 32) - 1)

    def _writer_leased(self, code: int) -> bool:
        index, gen = (code >> 32) - 1, code & 0xFFFFFFFF
        t = self.core.tables
        return (
            0 <= index < t.max_writers
            and t.leases["state"][index] == LEASE_HELD
            and int(t.leases["gen"][index]) == gen
        )


def mark_spilled(t: Tables, slot: int, code: int) -> None:
    """Record that a published slot's routes are in spill file `code` (inside a write), in the
    order `Spiller.finish` relies on: the spill field (the commit point), the spilled
    checksum, then the chain fields. The caller then drops the slot's pages."""
    t.s_spill[slot] = code
    t.s_check[slot] = checksum(
        bytes(t.s_sample_id[slot]),
        int(t.s_serial[slot]),
        int(t.s_num_tokens[slot]),
        int(t.s_prompt_len[slot]),
        int(t.s_digest[slot]),
        EMPTY,
        EMPTY.astype(np.uint32),
        int(t.s_mark[slot]),
        code,
    )
    t.s_num_pages[slot] = 0
    t.s_last_page[slot] = NO_PAGE


def _unlink(path: str) -> int:
    """Remove a file no slot names; 0 if it is gone, or cannot go now (a read-only or
    failing disk): `clean` tries again later."""
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0


_SPILLERS: weakref.WeakSet[Spiller] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for spiller in list(_SPILLERS):
        spiller._forget_parents_lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
