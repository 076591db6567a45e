"""Writer leases: which writers are alive, decided by the kernel, never by a pid.

A writer (a store handle that puts) holds one lease: an OFD byte-range lock at
`WRITER_LEASE + i` on its handle's lock description, plus record i of the lease table
(generation, informational pid). Pages it reserves carry `i + 1` and the record's
generation. The kernel drops the lock when the holder dies, SIGKILL included, so "is
writer i alive" is "does another description hold byte i" (`lease_held`), which holds
across pid namespaces: containers that share /dev/shm but not pids never take a live
writer for a dead one, and a reused pid never keeps a dead writer alive.

All lease changes happen under the commit lock.
"""

from __future__ import annotations

import os
import time

from routing_replay.errors import StoreUnavailableError
from routing_replay.store.format import LEASE_FREE, LEASE_HELD, NO_PAGE, OWNER_LEASE, WRITER_LEASE
from routing_replay.store.lock import Hold
from routing_replay.store.ofd_locks import lease_held, lease_try
from routing_replay.store.segment import Segment
from routing_replay.store.tables import Tables


class Leases:
    """The lease table of one store, and this handle's own lease in it."""

    def __init__(self, segment: Segment, tables: Tables) -> None:
        self._segment = segment
        self._tables = tables
        self._mine: tuple[int, int] | None = None  # (index, generation)
        self._epoch = segment.epoch

    def mine(self) -> tuple[int, int] | None:
        """This handle's lease, if it holds one (a forked child holds none of its parent's)."""
        if self._epoch != self._segment.epoch:
            self._mine, self._epoch = None, self._segment.epoch
        return self._mine

    def take(self, hold: Hold, reclaim_pages: callable) -> tuple[int, int]:
        """This handle's lease, taking a free one first if needed (under the lock).

        A record whose kernel lock is free belonged to a dead writer: its pages are
        reclaimed (`reclaim_pages(index)`) before the lease is handed out again.
        """
        mine = self.mine()
        if mine is not None:
            return mine
        fd, n = self._segment.lock_fd, len(self._tables.leases)  # no view kept: close works
        start = os.getpid() % n  # spread first tries: fewer locked bytes to step over
        for j in range(n):
            i = (start + j) % n
            if not lease_try(fd, WRITER_LEASE + i):
                continue  # a live writer's
            hold.write()
            reclaim_pages(i)  # whatever a dead holder of lease i left reserved
            if self._tables.leases["state"][i] == LEASE_HELD:  # and any spill file it wrote
                self._tables.mark_spill_garbage()
            gen = (int(self._tables.leases["gen"][i]) + 1) & 0xFFFFFFFF
            self._tables.leases[i] = (LEASE_HELD, gen, os.getpid(), 0, time.time())
            self._mine = (i, gen)
            return self._mine
        raise StoreUnavailableError(
            f"store {self._tables.name!r}: all {n} writer leases are held by live processes; "
            "close store handles that no longer put, or create the store with a larger "
            "max_writers"
        )

    def alive(self, index: int) -> bool:
        """Whether writer lease `index` is held by a live process (this handle included)."""
        mine = self.mine()
        if mine is not None and mine[0] == index:
            return True
        return lease_held(self._segment.lock_fd, WRITER_LEASE + index)

    def dead_holders(self) -> list[int]:
        """Lease records marked held whose holder has died (under the lock)."""
        held = (self._tables.leases["state"] == LEASE_HELD).nonzero()[0]
        return [int(i) for i in held if not self.alive(int(i))]

    def mark_free(self, index: int) -> None:
        """Record that lease `index` has no holder (under the lock, inside a write)."""
        self._tables.leases["state"][index] = LEASE_FREE
        self._tables.leases["pid"][index] = 0

    def owner_alive(self) -> bool:
        """Whether the store's creator still holds the owner lease."""
        if self._segment.owner:
            return True
        return lease_held(self._segment.lock_fd, OWNER_LEASE)

    def owner_index(self, owner_field: int) -> int:
        """Lease index named by a page's owner field (NO_PAGE for none)."""
        return owner_field - 1 if owner_field > 0 else NO_PAGE
