"""Spill: samples moved out of shared memory into files on local disk when the store is full.

A store created with `spill_dir` spills instead of stalling: a put that finds too few free
pages moves published samples, unread ones first, oldest put first, into one file each in
the store's own directory, then takes their pages. Reads of a spilled sample map its file
(same rows, same Arrow, the slot's checks plus a CRC-32 per page of the file); a release
removes it. The files hold at most `spill_budget` bytes; a put finding both full raises
`StoreFullError` as before.

A spill, in the putting process:

1. lock: take this handle's writer lease, pick victims (their chains checked); unlock;
2. without the lock: write each victim's rows and token ids to `spill_name(serial, code)`
   (`code` names this writer's lease: files of a dead writer are known as such);
3. lock: for each victim still the same put, still in memory and within the budget, set its
   slot's `spill` field (the commit point, `SampleIndex.spilled`) and drop its pages; the
   other files are removed. Unlock.

A file is complete before its slot names it, so a killed spiller leaves at most files no
slot names, removed by `clean` (when a dead writer's lease is reclaimed, by `reclaim`, and
with the directory at the owner's unlink).
Nothing is fsynced: a spill file matters only while the segment lives, and both are lost
together in a power cut, while a killed process loses nothing the page cache holds.
A reader that located a sample in memory and copied it while it was spilled (its pages
taken by a put) sees the pages' generations change and reads again (`ReadPlan`).
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from routing_replay.errors import CorruptStoreError, InvalidArgumentError
from routing_replay.store.format import (
    LEASE_HELD,
    NO_DIGEST,
    NOT_SPILLED,
    PUBLISHED,
    READ,
    TOKEN_DTYPE,
    aligned,
)
from routing_replay.store.lock import Hold
from routing_replay.store.prefix import runs

if TYPE_CHECKING:
    from routing_replay.layout import RoutingLayout
    from routing_replay.store.routing_store import RoutingStore

SPILL_MAGIC = b"RRSPILL1"
SPILL_SUFFIX = ".spill"
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


def spill_name(serial: int, code: int) -> str:
    """The file name of put `serial` spilled by writer `code`."""
    return f"{serial:016x}-{code:016x}{SPILL_SUFFIX}"


def writer_code(lease: tuple[int, int]) -> int:
    """A spill code naming a writer lease (index, generation); never NOT_SPILLED."""
    return ((lease[0] + 1) << 32) | lease[1]


def store_spill_dir(spill_dir: str, name: str, store_uid: int) -> str:
    """The directory of one store incarnation's spill files, under the user's `spill_dir`."""
    return os.path.join(os.path.abspath(spill_dir), f"rr_{name}-{store_uid:016x}")


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
    """One spilled sample's file, mapped read-only: its header checked against the slot it
    was named by, each chunk's CRC-32 checked the first time a read copies from it."""

    def __init__(self, store: RoutingStore, path: str, serial: int, digest: int, num_tokens: int):
        layout, P = store.layout, store.page_tokens
        self.path, self._P = path, P
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)  # FileNotFoundError: gone
        try:
            size = os.fstat(fd).st_size
            where = regions(num_tokens, digest != NO_DIGEST, P, layout.bytes_per_token)
            if size != where["end"]:
                raise self._corrupt(f"{size} bytes, {where['end']} expected")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        head = np.frombuffer(self._map, SPILL_HEADER, 1)[0]
        want = (SPILL_MAGIC, store.store_uid, serial, digest, num_tokens, P)
        got = tuple(
            head[f].item()
            for f in ("magic", "store_uid", "serial", "digest", "num_tokens", "chunk_tokens")
        )
        if (
            got != want
            or head["values_per_token"] != layout.values_per_token
            or head["dtype"].decode() != layout.dtype.str
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
        """Check the CRCs of the chunks holding rows [a, b) (each once per mapping)."""
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
    """The spill side of one store handle: make room, write and commit spills, clean up."""

    def __init__(self, store: RoutingStore) -> None:
        self.store = store
        self.dir, self.budget = store._t.spill_dir, store._t.spill_budget

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def path(self, serial: int, code: int) -> str:
        return os.path.join(self.dir, spill_name(serial, code))

    # -- the protocol ---------------------------------------------------------------------

    def make_room(self, pages: int, deadline: float) -> bool:
        """Spill until `pages` pages are free (or some were freed); False if nothing could be
        spilled (nothing in memory, or the budget is spent)."""
        store = self.store
        with store._lock.held("spill.pick", deadline) as hold:
            lease = store._leases.take(hold, lambda i: store._pages.reclaim_lease(hold, i))
            victims = self._pick(pages - store._pages.free_count())
        if not victims:
            return False
        code, done = writer_code(lease), set()
        try:
            for v in victims:
                self._write(v, code)
            with store._lock.held("spill.commit", deadline) as hold:
                done = self._commit(hold, victims, code)
        finally:
            for v in victims:
                if v.slot not in done:
                    _unlink(self.path(v.serial, code))
        return bool(done)

    def _pick(self, pages: int) -> list[Victim]:
        """In-memory samples to spill, unread first, oldest put first, until `pages` would be
        free and within the budget (under the lock)."""
        store, t = self.store, self.store._t
        if pages <= 0:
            return []
        room = self.budget - t.counter("spilled_bytes", 1 << 62)
        slots = np.flatnonzero((t.s_state == PUBLISHED) & (t.s_spill == NOT_SPILLED))
        order = np.lexsort((t.s_serial[slots], t.s_flags[slots] & READ))
        left: dict[int, int] = {}  # page -> samples still holding it, once the picks are gone
        victims, freed = [], 0
        for slot in slots[order].tolist():
            chain, gens, num_tokens, _ = store._samples.chain(slot)
            digest = store._samples.digest(slot)
            nbytes = file_bytes(store.layout, store.page_tokens, num_tokens, digest)
            if nbytes > room:
                continue
            room -= nbytes
            victims.append(
                Victim(slot, store._samples.serial(slot), chain, gens, num_tokens, digest, nbytes)
            )
            for p in chain.tolist():
                left[p] = left.get(p, int(t.p_refcount[p])) - 1
                freed += left[p] == 0
            if freed >= pages:
                break
        return victims

    def _write(self, v: Victim, code: int) -> None:
        """Copy a victim's rows and token ids out of its pages into its file (no lock: pages of
        a published sample never change, and the commit checks it is still published)."""
        store, t, P = self.store, self.store._t, self.store.page_tokens
        has = v.digest != NO_DIGEST
        where = regions(v.num_tokens, has, P, store.layout.bytes_per_token)
        routes = t.data.reshape(-1, store.layout.values_per_token)
        tokens = t.tokens.reshape(-1)
        head = np.zeros(1, SPILL_HEADER)
        head[0] = (
            SPILL_MAGIC,
            store.store_uid,
            v.serial,
            v.digest,
            v.num_tokens,
            P,
            store.layout.values_per_token,
            store.layout.dtype.str.encode(),
            has,
        )
        crcs = np.empty(len(v.pages), dtype="<u4")
        for i, page in enumerate(v.pages.tolist()):
            n = min(P, v.num_tokens - i * P)
            crc = zlib.crc32(tokens[page * P : page * P + n]) if has else 0
            crcs[i] = zlib.crc32(routes[page * P : page * P + n], crc)
        fd = os.open(
            self.path(v.serial, code), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        try:
            os.ftruncate(fd, where["end"])
            os.pwrite(fd, head.tobytes(), 0)
            os.pwrite(fd, crcs.tobytes(), where["crcs"])
            sections = [("tokens", tokens.reshape(-1, 1))] if has else []
            for what, rows in [*sections, ("routes", routes)]:
                os.lseek(fd, where[what], os.SEEK_SET)
                for i, first, count in runs(v.pages.tolist()):
                    n = min(count * P, v.num_tokens - i * P)
                    _write_all(fd, memoryview(rows[first * P : first * P + n]).cast("B"))
        finally:
            os.close(fd)

    def _commit(self, hold: Hold, victims: list[Victim], code: int) -> set[int]:
        """Make every victim still the same put, in memory and within the budget a spilled
        sample (under the lock); returns their slots."""
        store, t, samples = self.store, self.store._t, self.store._samples
        done = set()
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
            samples.spilled(v.slot, code)  # the commit point
            freed = store._pages.dereference(pages)
            for p in freed.tolist():
                store._prefix.unlink(p)
            store._pages.push(freed)
            t.add("pages_referenced", -len(pages))
            t.add("spilled", 1)
            t.add("spilled_bytes", v.nbytes)
            done.add(v.slot)
        return done

    # -- files of released samples, dead spillers, the whole directory ------------------------

    def forget(self, slot: int) -> str | None:
        """A spilled slot being released: its counters dropped (inside a write); the path to
        remove once the release committed (None: not spilled)."""
        samples, t = self.store._samples, self.store._t
        code = samples.spill(slot)
        if code == NOT_SPILLED:
            return None
        size = file_bytes(
            self.store.layout,
            self.store.page_tokens,
            int(t.s_num_tokens[slot]),
            samples.digest(slot),
        )
        t.add("spilled", -1)
        t.add("spilled_bytes", -size)
        return self.path(samples.serial(slot), code)

    def rebuild(self) -> None:
        """Repair: the spill counters from the published slots."""
        t, store = self.store._t, self.store
        spilled = np.flatnonzero((t.s_state == PUBLISHED) & (t.s_spill != NOT_SPILLED))
        t.hdr["spilled"] = len(spilled)
        t.hdr["spilled_bytes"] = sum(
            file_bytes(store.layout, store.page_tokens, int(t.s_num_tokens[s]), int(t.s_digest[s]))
            for s in spilled.tolist()
        )

    def clean(self) -> int:
        """Remove spill files no slot names whose writer is dead or whose sample is gone (under
        the lock: slots cannot change meanwhile); returns how many."""
        if not self.enabled:
            return 0
        t = self.store._t
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return 0
        published = t.s_state == PUBLISHED
        by_serial = dict(
            zip(t.s_serial[published].tolist(), np.flatnonzero(published).tolist(), strict=True)
        )
        removed = 0
        for name in names:
            m = _NAME.match(name)
            if m is None:
                continue  # not ours: left alone
            serial, code = int(m.group(1), 16), int(m.group(2), 16)
            slot = by_serial.get(serial)
            if slot is not None and int(t.s_spill[slot]) == code:
                continue  # the sample's file
            if (
                slot is not None
                and int(t.s_spill[slot]) == NOT_SPILLED
                and self._writer_alive(code)
            ):
                continue  # a spill in progress
            removed += _unlink(os.path.join(self.dir, name))
        return removed

    def _writer_alive(self, code: int) -> bool:
        index, gen = (code >> 32) - 1, code & 0xFFFFFFFF
        t, leases = self.store._t, self.store._leases
        return (
            0 <= index < t.max_writers
            and t.leases["state"][index] == LEASE_HELD
            and int(t.leases["gen"][index]) == gen
            and leases.alive(index)
        )


def make_spill_dir(
    spill_dir: str, name: str, store_uid: int, budget: int | None
) -> tuple[str, int]:
    """Create a new store's own spill directory (private to this user); its path and budget
    (default: half the free space of its file system)."""
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0
    ):
        raise InvalidArgumentError(
            f"spill_budget must be a positive number of bytes, got {budget!r}"
        )
    path = store_spill_dir(spill_dir, name, store_uid)
    if len(path.encode()) > 1000:
        raise InvalidArgumentError(f"spill_dir {spill_dir!r} is too long: use a shorter path")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkdir(path, 0o700)
    if budget is None:
        st = os.statvfs(path)
        budget = st.f_bavail * st.f_frsize // 2
    return path, budget


def remove_spill_dir(path: str) -> None:
    """Remove a store's whole spill directory ("": the store does not spill)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0
