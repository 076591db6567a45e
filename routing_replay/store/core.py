"""`StoreCore`: the parts of one mapped store that every protocol works on.

`RoutingStore` is the facade a user holds. The protocols (`put`, `read`, `spill`, `repair`,
`verify`) take the core and use only what it holds: the segment and its tables, the commit
lock, the writer leases, the page allocator, the sample index, the prefix index and the
spill tier, plus the layout and the handle's put timeout.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from routing_replay.store.format import MAX_TABLE, MIN_LOCK_WAIT_S
from routing_replay.store.leases import Leases
from routing_replay.store.lock import CommitLock
from routing_replay.store.pages import PageAllocator
from routing_replay.store.prefix import PrefixIndex
from routing_replay.store.repair import repair
from routing_replay.store.samples import SampleIndex
from routing_replay.store.segment import Segment
from routing_replay.store.spill import Spiller
from routing_replay.store.tables import Tables


@dataclass(frozen=True)
class StoreStats:
    """Capacity and use of a store, in tokens and bytes."""

    capacity_tokens: int
    page_tokens: int
    pages_total: int
    pages_used: int
    pages_pending: int  # reserved by writers that have not published (or died)
    samples: int
    tokens_stored: int  # sum of the samples' token counts
    bytes_used: int  # page bytes actually held by published samples
    bytes_unshared: int  # page bytes the same samples would take without sharing
    dedup_saved_bytes: int
    segment_bytes: int
    samples_spilled: int = 0  # samples whose routes are in spill files (among `samples`)
    spilled_bytes: int = 0  # the size of those files
    spill_budget: int = 0  # the most they may take; 0: the store does not spill
    puts: int = 0  # puts (put or put_many calls) of every process since the store was made
    put_seconds: float = 0.0  # their time, from the call to its commit
    reads: int = 0  # reads (get, read, the wire form) of every process
    read_seconds: float = 0.0  # their time, from locating the samples to checking the copy


class StoreCore:
    """One handle's view of a mapped store: its tables and the objects that change them."""

    def __init__(self, segment: Segment, put_timeout: float, users: list[int]) -> None:
        self.segment = segment
        self.tables = Tables(segment.name, segment.mmap)
        self.name = segment.name
        self.layout = self.tables.layout
        self.node_id = self.tables.node_id
        self.store_uid = self.tables.store_uid
        self.page_tokens = self.tables.page_tokens
        self.capacity_tokens = self.tables.num_pages * self.page_tokens
        self.put_timeout = put_timeout
        # What the handle owns refers back to it weakly: a handle dropped, or cut short while
        # made, goes at once (no cycle), and with it the views that keep its mapping.
        me = weakref.proxy(self)
        self.lock = CommitLock(segment, self.tables, lambda: repair(me), lambda: me.closing)
        self.leases = Leases(segment, self.tables)
        self.pages = PageAllocator(self.tables)
        self.samples = SampleIndex(self.tables)
        self.prefix = PrefixIndex(self.tables)
        self.puts_running: set[object] = set()  # a token per put in flight (add/discard: atomic)
        self.calls: dict[object, threading.Thread] = {}  # store calls in flight: their threads
        self.closing = False  # set by close(): calls starting then refuse
        self.close_mutex = threading.RLock()  # one close() at a time; the next finds it closed
        self.spill = Spiller(me, users)  # last: it takes the spill directory's lock

    def served(self) -> bool:
        """Whether the store is still in use: the file at its name (its owner's handle may be
        closed: a store outlives it until swept), or a segment removed from /dev/shm by
        something else than its owner (a wipe) while the owner holds it. False on a closed
        handle."""
        if self.segment.fd < 0:
            return False
        if self.segment.is_current():
            return True
        return not self.tables.hdr["unlinked"] and self.leases.owner_alive()

    def deadline(self, timeout: float | None = None) -> float:
        """Lock deadline of an operation: its timeout, but never under MIN_LOCK_WAIT_S."""
        wait = self.put_timeout if timeout is None else timeout
        return time.monotonic() + max(wait, MIN_LOCK_WAIT_S)

    def as_stored(self, rows: np.ndarray) -> np.ndarray:
        """Rows in the stored dtype: the rows themselves when narrow, else a converted copy."""
        if rows.dtype == self.layout.dtype:
            return rows
        return self.layout.convert(rows, np.empty(rows.shape, dtype=self.layout.dtype))

    def stats(self) -> StoreStats:
        """Capacity, use and prefix-sharing savings (from the header's counters)."""
        t = self.tables
        with self.lock.held("stats", self.deadline()):
            used = t.counter("pages_used", t.num_pages)
            pending = t.counter("pages_reserved", t.num_pages)
            referenced = t.counter("pages_referenced", MAX_TABLE * t.max_samples)
            samples = t.counter("samples", t.max_samples)
            spilled = t.counter("spilled", samples)
            spilled_bytes = t.counter("spilled_bytes", 1 << 62)
            in_files = spilled_bytes // self.layout.bytes_per_token
            tokens = t.counter("tokens", referenced * t.page_tokens + in_files)
            timings = [int(t.hdr[f]) for f in ("puts", "put_ns", "reads", "read_ns")]
        page_bytes = self.page_tokens * self.layout.bytes_per_token
        return StoreStats(
            capacity_tokens=self.capacity_tokens,
            page_tokens=self.page_tokens,
            pages_total=t.num_pages,
            pages_used=used,
            pages_pending=pending,
            samples=samples,
            tokens_stored=tokens,
            bytes_used=used * page_bytes,
            bytes_unshared=referenced * page_bytes,
            dedup_saved_bytes=(referenced - used) * page_bytes,
            segment_bytes=self.segment.size,
            samples_spilled=spilled,
            spilled_bytes=spilled_bytes,
            spill_budget=self.spill.budget,
            puts=timings[0],
            put_seconds=timings[1] / 1e9,
            reads=timings[2],
            read_seconds=timings[3] / 1e9,
        )
