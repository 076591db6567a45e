"""The per-node routing store: paged, prefix-sharing, crash-safe, in one shm segment.

Segment layout (every region 64-byte aligned):

    header | page table [num_pages] | page buckets | slot table [max_samples] |
    sample buckets | page data [num_pages, page_tokens * L * K] (narrow dtype)

A sample is a chain of pages: each page records its parent (the page holding the
previous `page_tokens` tokens), the slot records the last page. When token ids are
given, full pages are keyed by (parent page, hash of their tokens) so that samples with
a common prefix (GRPO's n samples of one prompt, the turns of an episode) share those
pages; a page is only shared if its routes are byte-equal too, so sharing never changes
content. Each published sample holds one reference on every page of its chain.

Concurrency: metadata changes happen under `SegmentLock` (a flock the kernel drops if
the holder dies). Writers look up shareable pages under the lock and compare their routes
without it, reserve pages (owner = their pid and start time), fill them without the lock,
then publish under the lock, checking that the shared pages' generations did not change;
readers resolve pages and their generations under the lock, copy without it, and re-check
the generations. A holder killed while changing metadata leaves the `dirty` flag set, and
the next locker rebuilds every derived field (refcounts, buckets) from the published
slots; pages reserved by dead writers are freed (a pid reused by another process does not
keep them).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from routing_replay.errors import (
    ConcurrentReleaseError,
    DuplicateSampleError,
    InvalidRoutesError,
    LayoutMismatchError,
    RoutingReplayError,
    SampleNotFoundError,
    StoreFullError,
    StoreUnavailableError,
)
from routing_replay.layout import RoutingLayout
from routing_replay.schema import output_buffer, routes_batch
from routing_replay.shm import (
    SEGMENT_PREFIX,
    SHM_DIR,
    Segment,
    SegmentLock,
    pid_alive,
    this_process,
)

MAGIC = b"RRSTORE1"
VERSION = 2
ALIGN = 64
HEADER_BYTES = 4096
MAX_SAMPLE_ID_BYTES = 128
FORBIDDEN_ID_CHARS = "/\\\x00"
DEFAULT_PAGE_TOKENS = 128
DEFAULT_PUT_TIMEOUT_S = 30.0
CHECK_CHUNK_BYTES = 1 << 18  # put copies and checks ids in chunks that stay in L2
ATTACH_WAIT_S = 5.0
FREE, PUBLISHED = 0, 1
NO_PAGE = -1
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("dirty", "<u4"),
        ("page_tokens", "<i8"),
        ("num_pages", "<i8"),
        ("max_samples", "<i8"),
        ("page_buckets", "<i8"),
        ("sample_buckets", "<i8"),
        ("owner_pid", "<i8"),
        ("owner_start", "<u8"),  # the owner's start time: a reused pid is not the owner
        ("created", "<f8"),
        ("node_id", "S128"),
        ("layout", "S2048"),
    ]
)
PAGE_DTYPE = np.dtype(
    [
        ("refcount", "<i4"),  # published samples whose chain holds this page
        ("owner", "<i4"),  # pid of the writer filling it, 0 once published or free
        ("parent", "<i4"),  # page of the previous tokens, NO_PAGE for a first page
        ("next", "<i4"),  # next page in the same key bucket
        ("gen", "<u4"),  # bumped at every reservation: readers detect reuse
        ("owner_start", "<u4"),  # that writer's start time: a reused pid is not the writer
        ("key", "<u8"),  # hash of the page's token ids; 0 = not shareable
    ]
)
SLOT_DTYPE = np.dtype(
    [
        ("state", "<u4"),
        ("next", "<i4"),  # next slot in the same sample-id bucket
        ("num_tokens", "<i4"),
        ("prompt_len", "<i4"),  # -1 when unknown
        ("last_page", "<i4"),
        ("num_pages", "<i4"),
        ("sample_id", f"S{MAX_SAMPLE_ID_BYTES}"),
    ]
)

Part = Literal["all", "prompt", "completion"]


@dataclass(frozen=True)
class RoutingRef:
    """Small, picklable handle to one stored sample: what travels through the driver."""

    sample_id: str
    store: str
    node_id: str
    num_tokens: int
    prompt_len: int | None = None


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


def default_node_id() -> str:
    """This machine's id: host name plus boot id (Ray code passes Ray's node id instead)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}-{boot}"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 1).bit_length()


def _sample_id_bytes(sample_id: Any) -> bytes:
    if isinstance(sample_id, RoutingRef):
        sample_id = sample_id.sample_id
    if not isinstance(sample_id, str) or not sample_id:
        raise InvalidRoutesError(f"sample_id must be a non-empty str, got {sample_id!r}")
    raw = sample_id.encode()
    if (
        len(raw) > MAX_SAMPLE_ID_BYTES
        or not sample_id.isprintable()
        or any(c in sample_id for c in FORBIDDEN_ID_CHARS)
    ):
        raise InvalidRoutesError(
            f"sample_id {sample_id!r} must be printable, at most {MAX_SAMPLE_ID_BYTES} bytes "
            f"of UTF-8, and free of {FORBIDDEN_ID_CHARS!r} (ids name samples, never paths): "
            "use e.g. 'step12-prompt3-sample5'"
        )
    return raw


@functools.cache
def _key_multipliers(page_tokens: int) -> np.ndarray:
    """Fixed odd 64-bit multipliers, one per token position (the same in every process)."""
    rng = np.random.default_rng([0x5EED, page_tokens])
    return rng.integers(1, 2**63, page_tokens, dtype=np.uint64) | np.uint64(1)


def _page_keys_of(tokens_NP: np.ndarray) -> list[int]:
    """A 64-bit key per row of token ids `[N, P]` (never 0: 0 means "not shareable").

    A multiply-add hash with fixed odd multipliers, then a mixer, all vectorised: keys
    only pick candidates, sharing also needs byte-equal routes, so a collision can cost a
    missed share but never changes what is read back.
    """
    mult_P = _key_multipliers(tokens_NP.shape[1])
    with np.errstate(over="ignore"):
        h_N = (tokens_NP.astype(np.uint64, copy=False) * mult_P).sum(axis=1, dtype=np.uint64)
        h_N ^= h_N >> np.uint64(31)
        h_N *= np.uint64(0xBF58476D1CE4E5B9)
        h_N ^= h_N >> np.uint64(29)
    return (h_N | np.uint64(1)).tolist()


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of the same dtype and size hold the same bytes."""
    if a.size != b.size:
        return False
    if a.flags.c_contiguous and b.flags.c_contiguous and a.nbytes % 8 == 0:
        a, b = a.reshape(-1).view(np.uint64), b.reshape(-1).view(np.uint64)  # 8x fewer elements
    return bool(np.array_equal(a.reshape(-1), b.reshape(-1)))


def _runs(pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(index in `pages`, first page, count) for each run of consecutive page numbers."""
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            yield start, pages[start], i - start
            start = i


class RoutingStore:
    """Per-node shared-memory store of routes: `create` by the owner, `attach` by others."""

    # -- life cycle -------------------------------------------------------------------

    def __init__(self, segment: Segment, put_timeout: float) -> None:
        self._seg = segment
        self._lock = SegmentLock(segment.fd)
        self.put_timeout = put_timeout
        buf = segment.mmap
        self._hdr = np.ndarray((), HEADER_DTYPE, buffer=buf, offset=0)
        self.layout = RoutingLayout.from_json(self._hdr["layout"].item())
        self.node_id = self._hdr["node_id"].item().decode()
        self.page_tokens = int(self._hdr["page_tokens"])
        self.capacity_tokens = int(self._hdr["num_pages"]) * self.page_tokens
        num_pages = int(self._hdr["num_pages"])
        max_samples = int(self._hdr["max_samples"])
        offsets = self._offsets(
            self.layout, self.page_tokens, num_pages, max_samples,
            int(self._hdr["page_buckets"]), int(self._hdr["sample_buckets"]),
        )  # fmt: skip
        if offsets["end"] != segment.size:
            raise StoreUnavailableError(
                f"store {segment.name!r} is {segment.size} bytes, its header says "
                f"{offsets['end']}: the segment is corrupt or from another version; unlink it"
            )
        self._pages = np.ndarray((num_pages,), PAGE_DTYPE, buf, offsets["pages"])
        self._page_heads = np.ndarray(
            (int(self._hdr["page_buckets"]),), "<i4", buf, offsets["page_heads"]
        )
        self._slots = np.ndarray((max_samples,), SLOT_DTYPE, buf, offsets["slots"])
        self._sample_heads = np.ndarray(
            (int(self._hdr["sample_buckets"]),), "<i4", buf, offsets["sample_heads"]
        )
        page_values = self.page_tokens * self.layout.values_per_token
        self._data = np.ndarray((num_pages, page_values), self.layout.dtype, buf, offsets["data"])
        # One view per field, made once: field lookups are on every put's path.
        for field in PAGE_DTYPE.names:
            setattr(self, f"_p_{field}", self._pages[field])
        for field in SLOT_DTYPE.names:
            setattr(self, f"_s_{field}", self._slots[field])
        # refcount and owner side by side as one int64 per page: 0 = free (one comparison).
        self._p_taken = np.ndarray(
            (num_pages,), "<i8", buf, offsets["pages"], (PAGE_DTYPE.itemsize,)
        )
        self._page_hint = self._slot_hint = 0  # where this process looks first (a guess)

    @staticmethod
    def _offsets(
        layout: RoutingLayout,
        page_tokens: int,
        num_pages: int,
        max_samples: int,
        page_buckets: int,
        sample_buckets: int,
    ) -> dict[str, int]:
        sizes = [
            ("pages", num_pages * PAGE_DTYPE.itemsize),
            ("page_heads", page_buckets * 4),
            ("slots", max_samples * SLOT_DTYPE.itemsize),
            ("sample_heads", sample_buckets * 4),
            ("data", num_pages * page_tokens * layout.bytes_per_token),
        ]
        offsets, pos = {}, HEADER_BYTES
        for name, size in sizes:
            offsets[name] = pos
            pos = _aligned(pos + size)
        offsets["end"] = pos
        return offsets

    @classmethod
    def create(
        cls,
        name: str,
        layout: RoutingLayout,
        capacity_tokens: int,
        *,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        max_samples: int | None = None,
        node_id: str | None = None,
        put_timeout: float = DEFAULT_PUT_TIMEOUT_S,
    ) -> RoutingStore:
        """Create and own the store `name` with room for `capacity_tokens` routed tokens."""
        if capacity_tokens <= 0 or page_tokens <= 0:
            raise ValueError("capacity_tokens and page_tokens must be positive")
        num_pages = -(-int(capacity_tokens) // page_tokens)
        max_samples = int(max_samples or num_pages + 64)
        page_buckets = _pow2_at_least(num_pages)
        sample_buckets = _pow2_at_least(max_samples)
        layout_json = layout.to_json().encode()
        node = (node_id or default_node_id()).encode()
        if len(layout_json) > HEADER_DTYPE["layout"].itemsize or len(node) > 128:
            raise ValueError("layout or node_id too long for the store header")
        offsets = cls._offsets(
            layout, page_tokens, num_pages, max_samples, page_buckets, sample_buckets
        )
        fields = {
            "version": VERSION,
            "page_tokens": page_tokens,
            "num_pages": num_pages,
            "max_samples": max_samples,
            "page_buckets": page_buckets,
            "sample_buckets": sample_buckets,
            "owner_pid": this_process()[0],
            "owner_start": this_process()[1],
            "created": time.time(),
            "node_id": node,
            "layout": layout_json,
        }
        seg = Segment.create(name, offsets["end"])
        try:
            _initialise(seg.mmap, offsets, fields)
            return cls(seg, put_timeout)
        except BaseException:
            seg.unlink()  # nothing half-made stays behind
            raise

    @classmethod
    def attach(
        cls,
        name: str,
        layout: RoutingLayout | None = None,
        *,
        put_timeout: float = DEFAULT_PUT_TIMEOUT_S,
    ) -> RoutingStore:
        """Attach to the store `name` created by another process on this node."""
        deadline = time.monotonic() + ATTACH_WAIT_S
        while True:
            try:
                seg = Segment.attach(name)
            except StoreUnavailableError as e:
                if "still being created" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
                continue
            magic = bytes(seg.mmap[:8])
            if magic == MAGIC:
                break
            seg.close()
            if magic.strip(b"\x00") or time.monotonic() > deadline:
                raise StoreUnavailableError(
                    f"{seg.path} is not a routing store (or not initialised): unlink it"
                )
            time.sleep(0.01)
        store = cls(seg, put_timeout)
        if layout is not None and layout != store.layout:
            store.close()
            raise LayoutMismatchError(
                f"store {name!r} holds routes for {store.layout}, not {layout}: attach "
                "without a layout to use the store's, or use a store of this model"
            )
        return store

    @property
    def name(self) -> str:
        """The store's name (its segment is /dev/shm/rr_<name>)."""
        return self._seg.name

    @property
    def is_owner(self) -> bool:
        """Whether this handle created the store (and so unlinks it)."""
        return self._seg.owner

    def close(self) -> None:
        """Unmap the store in this process; stored samples stay for other processes."""
        for attr in [a for a in self.__dict__ if a.startswith(("_p_", "_s_"))] + [
            "_hdr",
            "_pages",
            "_page_heads",
            "_slots",
            "_sample_heads",
            "_data",
        ]:
            self.__dict__.pop(attr, None)
        self._lock.close()
        self._seg.close()

    def owner_alive(self) -> bool:
        """Whether the process that created this store still runs (pid and start time)."""
        return pid_alive(int(self._hdr["owner_pid"]), int(self._hdr["owner_start"]))

    def is_current(self) -> bool:
        """Whether this mapping is still the store at its name (not swept or recreated)."""
        return self._seg.is_current()

    def unlink(self) -> None:
        """Remove the segment (owner only); processes that mapped it keep their view."""
        if not self._seg.owner:
            raise RoutingReplayError(
                f"only the process that created store {self.name!r} unlinks it; call close()"
            )
        self._seg.unlink()

    def __enter__(self) -> RoutingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        owner = self._seg.owner
        self.close()
        if owner:
            self._seg.unlink()

    def __repr__(self) -> str:
        return f"RoutingStore({self.name!r}, {self.layout}, capacity_tokens={self.capacity_tokens})"

    # -- locking and repair -----------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, mutate: bool = False) -> Iterator[None]:
        with self._lock.held():
            if self._hdr["dirty"]:
                self._repair()
            if not mutate:
                yield
                return
            self._hdr["dirty"] = 1
            try:
                yield
            except RoutingReplayError:
                # Raised by validation before anything changed: nothing to repair.
                self._hdr["dirty"] = 0
                raise
            # Any other exception (or a kill) leaves the flag set: the next locker repairs.
            self._hdr["dirty"] = 0

    def _repair(self) -> None:
        """Rebuild refcounts and buckets from the published slots (a locker died mid-change)."""
        pages = self._pages
        refcount = np.zeros(len(pages), dtype=np.int64)
        self._sample_heads[:] = NO_PAGE
        for s in np.flatnonzero(self._s_state == PUBLISHED):
            refcount[self._chain(int(s))] += 1
            self._link_sample(int(s), bytes(self._s_sample_id[s]))
        self._p_refcount[:] = refcount
        self._reclaim_dead_writers()
        self._page_heads[:] = NO_PAGE
        for p in np.flatnonzero((refcount > 0) & (self._p_key != 0)):
            self._link_page(int(p))
        self._p_key[refcount == 0] = 0
        self._hdr["dirty"] = 0

    # -- buckets ----------------------------------------------------------------------

    def _sample_bucket(self, raw_id: bytes) -> int:
        return zlib.crc32(raw_id) % len(self._sample_heads)

    def _link_sample(self, slot: int, raw_id: bytes) -> None:
        b = self._sample_bucket(raw_id)
        self._s_next[slot] = self._sample_heads[b]
        self._sample_heads[b] = slot

    def _find_slot(self, raw_id: bytes) -> int:
        s = int(self._sample_heads[self._sample_bucket(raw_id)])
        while s != NO_PAGE:
            if self._s_state[s] == PUBLISHED and bytes(self._s_sample_id[s]) == raw_id:
                return s
            s = int(self._s_next[s])
        return NO_PAGE

    def _unlink_from(self, heads: np.ndarray, nexts: np.ndarray, bucket: int, item: int) -> None:
        cur, prev = int(heads[bucket]), NO_PAGE
        while cur != NO_PAGE and cur != item:
            prev, cur = cur, int(nexts[cur])
        if cur == NO_PAGE:
            return
        if prev == NO_PAGE:
            heads[bucket] = nexts[cur]
        else:
            nexts[prev] = nexts[cur]
        nexts[cur] = NO_PAGE

    def _page_bucket(self, parent: int, key: int) -> int:
        return ((key ^ ((parent + 2) * _GOLDEN)) & _MASK64) % len(self._page_heads)

    def _link_page(self, page: int) -> None:
        b = self._page_bucket(int(self._p_parent[page]), int(self._p_key[page]))
        self._p_next[page] = self._page_heads[b]
        self._page_heads[b] = page

    def _find_page(self, parent: int, key: int, data: np.ndarray | None = None) -> int:
        """A published page with this parent and token key (and routes equal to `data`)."""
        p = int(self._page_heads[self._page_bucket(parent, key)])
        while p != NO_PAGE:
            if (
                self._p_key[p] == key
                and self._p_parent[p] == parent
                and self._p_refcount[p] > 0
                and (data is None or _same_bytes(self._data[p], data))
            ):
                return p
            p = int(self._p_next[p])
        return NO_PAGE

    # -- pages ------------------------------------------------------------------------

    def _chain(self, slot: int) -> np.ndarray:
        """Pages of a published sample, first to last."""
        n = int(self._s_num_pages[slot])
        chain = np.empty(n, dtype=np.int64)
        p, parent = int(self._s_last_page[slot]), self._p_parent
        for i in range(n - 1, -1, -1):
            chain[i] = p
            p = int(parent[p])
        return chain

    def _reserve(self, count: int) -> np.ndarray | None:
        """Claim `count` free pages for this process, or None if there are not enough."""
        hint = self._page_hint  # after this process's last pages: usually free, in one run
        if hint + count <= len(self._pages) and not self._p_taken[hint : hint + count].any():
            got = np.arange(hint, hint + count)
        else:
            free = np.flatnonzero(self._p_taken == 0)
            if len(free) < count and self._reclaim_dead_writers():
                free = np.flatnonzero(self._p_taken == 0)
            if len(free) < count:
                return None
            got = free[:count]
        self._page_hint = int(got[-1]) + 1 if count else hint
        self._p_owner[got], self._p_owner_start[got] = this_process()
        self._p_gen[got] += 1
        self._p_key[got] = 0
        self._p_parent[got] = NO_PAGE
        return got

    def _reclaim_dead_writers(self) -> int:
        """Free pages reserved by writers that no longer run (by pid and start time)."""
        reserved = np.flatnonzero(self._p_owner != 0)
        writers = self._pages[["owner", "owner_start"]][reserved]
        freed = 0
        for pid, start in np.unique(writers).tolist():
            if not pid_alive(pid, start):
                dead = reserved[(writers["owner"] == pid) & (writers["owner_start"] == start)]
                self._p_owner[dead] = 0
                freed += len(dead)
        return freed

    def reclaim(self) -> int:
        """Free pages reserved by writers that died mid-put; returns how many were freed."""
        with self._locked(mutate=True):
            return self._reclaim_dead_writers()

    def _unreserve(self, got: np.ndarray) -> None:
        with self._locked(mutate=True):
            pid, start = this_process()
            mine = got[(self._p_owner[got] == pid) & (self._p_owner_start[got] == start)]
            self._p_owner[mine] = 0

    # -- writing ----------------------------------------------------------------------

    def put(
        self,
        sample_id: str,
        routes: Any,
        *,
        prompt_len: int | None = None,
        token_ids: Any = None,
        timeout: float | None = None,
    ) -> RoutingRef:
        """Store one sample's `[T, L, K]` routes (-1 = missing) and return its reference."""
        raw_id = _sample_id_bytes(sample_id)
        checked = self.layout.select_moe(routes)  # ids are checked after the copy, in cache
        num_tokens = len(checked)
        if num_tokens == 0:
            raise InvalidRoutesError(f"sample {sample_id!r} has no routed tokens")
        if prompt_len is not None and not 0 <= prompt_len <= num_tokens:
            raise InvalidRoutesError(
                f"prompt_len={prompt_len} is outside [0, {num_tokens}] for sample {sample_id!r}"
            )
        P = self.page_tokens
        keys = self._page_keys(token_ids, num_tokens) if token_ids is not None else []
        num_pages = -(-num_tokens // P)
        if num_pages > len(self._pages):
            raise StoreFullError(
                f"sample {sample_id!r} has {num_tokens} tokens but store {self.name!r} holds "
                f"at most {self.capacity_tokens}: create it with a larger capacity_tokens"
            )
        timeout = self.put_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        wait = 0.001
        while True:
            with self._locked():
                if self._find_slot(raw_id) != NO_PAGE:
                    raise DuplicateSampleError(
                        f"sample {sample_id!r} is already in store {self.name!r}: release it "
                        "first, or give every sample a unique id"
                    )
                candidates = self._key_chain(keys)
                gens = self._p_gen[candidates].copy()
            # Routes are compared without the lock (readers go on meanwhile): a page
            # released and reused since has a new generation, which _publish checks.
            equal = self._equal_prefix(candidates, checked)
            hits, hit_gens = candidates[:equal], gens[:equal]
            with self._locked(mutate=True):
                if equal < len(candidates):  # same tokens, other routes: an equal twin?
                    hits = self._twins(hits, keys, checked)
                    hit_gens = self._p_gen[hits].copy()
                new = self._reserve(num_pages - len(hits))
            if new is not None:
                try:
                    # Ids are checked before publishing: nothing bad is ever seen. New rows
                    # are checked as they are copied; rows byte-equal to shared pages were
                    # checked when those were put, unless a wider input wrapped onto them.
                    self._fill(new, checked, len(hits) * P)
                    if checked.dtype != self.layout.dtype:
                        self.layout.check_ids(checked[: len(hits) * P])
                    ref = self._publish(raw_id, hits, hit_gens, new, keys, num_tokens, prompt_len)
                except BaseException:
                    self._unreserve(new)
                    raise
                if ref is not None:
                    return ref
                continue  # a shared page was released meanwhile: match again
            if time.monotonic() >= deadline:
                raise self._full_error(sample_id, num_tokens, timeout)
            time.sleep(wait)
            wait = min(wait * 2, 0.05)

    def _page_keys(self, token_ids: Any, num_tokens: int) -> list[int]:
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1 or len(tokens) != num_tokens or tokens.dtype.kind not in "iu":
            raise InvalidRoutesError(
                f"token_ids must be a 1-D integer array with one id per routes row "
                f"({num_tokens}), got shape {tokens.shape} and dtype {tokens.dtype}"
            )
        P = self.page_tokens
        full = num_tokens // P * P
        return _page_keys_of(tokens[:full].astype(np.int64).reshape(-1, P)) if full else []

    def _key_chain(self, keys: list[int]) -> list[int]:
        """Published pages that chain the sample's leading page keys (under the lock)."""
        pages: list[int] = []
        for key in keys:
            page = self._find_page(pages[-1] if pages else NO_PAGE, key)
            if page == NO_PAGE:
                break
            pages.append(page)
        return pages

    def _equal_prefix(self, pages: list[int], checked: np.ndarray) -> int:
        """How many leading `pages` hold routes byte-equal to the sample's rows: one
        comparison per run of consecutive pages, page by page only inside a run that differs."""
        P = self.page_tokens
        for i, first, count in _runs(pages):
            rows = self._as_stored(checked[i * P : (i + count) * P])
            if not _same_bytes(self._data[first : first + count], rows):
                differs = (
                    j
                    for j in range(count)
                    if not _same_bytes(self._data[first + j], rows[j * P : (j + 1) * P])
                )
                return i + next(differs, 0)  # 0: the run changed under us, share none of it
        return len(pages)

    def _twins(self, hits: list[int], keys: list[int], checked: np.ndarray) -> list[int]:
        """Extend `hits` page by page with published pages of equal keys and equal routes
        (under the lock): the slow path, when a key's first page was routed differently."""
        P, hits = self.page_tokens, list(hits)
        for i in range(len(hits), len(keys)):
            rows = self._as_stored(checked[i * P : (i + 1) * P])
            page = self._find_page(hits[-1] if hits else NO_PAGE, keys[i], rows)
            if page == NO_PAGE:
                break
            hits.append(page)
        return hits

    def _as_stored(self, rows: np.ndarray) -> np.ndarray:
        """Rows in the stored dtype: the rows themselves when narrow, else a converted copy."""
        if rows.dtype == self.layout.dtype:
            return rows
        return self.layout.convert(rows, np.empty(rows.shape, dtype=self.layout.dtype))

    def _fill(self, new: np.ndarray, checked: np.ndarray, first_row: int) -> None:
        """Copy rows `first_row:` into reserved pages and check their ids, chunk by chunk:
        each chunk is checked right after its copy, while it is still in cache."""
        P, shape = self.page_tokens, checked.shape[1:]
        flat = self._data.reshape(-1)
        page_values = self._data.shape[1]
        step = max(1, CHECK_CHUNK_BYTES // max(1, checked[:1].nbytes))
        for i, first, count in _runs(new.tolist()):
            rows = checked[first_row + i * P : first_row + (i + count) * P]
            start = first * page_values
            out = flat[start : start + len(rows) * page_values // P].reshape(len(rows), *shape)
            for a in range(0, len(rows), step):
                self.layout.convert(rows[a : a + step], out[a : a + step])
                try:
                    self.layout.check_ids(rows[a : a + step])
                except InvalidRoutesError:
                    self.layout.check_ids(checked)  # the same error, positions in the sample
                    raise

    def _publish(
        self,
        raw_id: bytes,
        hits: list[int],
        hit_gens: np.ndarray,
        new: np.ndarray,
        keys: list[int],
        num_tokens: int,
        prompt_len: int | None,
    ) -> RoutingRef | None:
        with self._locked(mutate=True):
            if hits and not (
                np.array_equal(self._p_gen[hits], hit_gens) and (self._p_refcount[hits] > 0).all()
            ):
                self._p_owner[new] = 0
                return None
            if self._find_slot(raw_id) != NO_PAGE:
                raise DuplicateSampleError(
                    f"sample {raw_id.decode()!r} was put concurrently by another writer"
                )
            slot = self._slot_hint  # the slot after this process's last one: usually free
            if slot >= len(self._slots) or self._s_state[slot] != FREE:
                slot = int(np.argmin(self._s_state))  # the first FREE (0) slot, if any
            if self._s_state[slot] != FREE:
                raise StoreFullError(
                    f"store {self.name!r} holds its maximum of {len(self._slots)} samples: release "
                    "consumed samples, or create it with a larger max_samples"
                )
            chain = [*hits, *new.tolist()]
            if len(new):
                self._p_parent[new] = [hits[-1] if hits else NO_PAGE, *new[:-1].tolist()]
            for i in range(len(hits), len(keys)):
                self._p_key[chain[i]] = keys[i]
                self._link_page(chain[i])
            self._p_refcount[chain] += 1
            self._p_owner[new] = 0
            self._s_num_tokens[slot] = num_tokens
            self._s_prompt_len[slot] = -1 if prompt_len is None else prompt_len
            self._s_last_page[slot] = chain[-1]
            self._s_num_pages[slot] = len(chain)
            self._s_sample_id[slot] = raw_id
            self._link_sample(slot, raw_id)
            self._s_state[slot] = PUBLISHED  # the commit point
            self._slot_hint = slot + 1
        return RoutingRef(raw_id.decode(), self.name, self.node_id, num_tokens, prompt_len)

    def _full_error(self, sample_id: str, num_tokens: int, timeout: float) -> StoreFullError:
        s = self.stats()
        return StoreFullError(
            f"store {self.name!r} is full: {s.pages_used + s.pages_pending} of "
            f"{s.pages_total} pages ({self.page_tokens} tokens each, {s.capacity_tokens} "
            f"tokens, {s.segment_bytes / 2**20:.1f} MiB) are in use by {s.samples} samples; "
            f"sample {sample_id!r} needs {-(-num_tokens // self.page_tokens)} pages and none "
            f"were released within {timeout:.1f}s. Release consumed samples with "
            "store.release(ids), or create the store with a larger capacity_tokens"
        )

    # -- releasing --------------------------------------------------------------------

    def release(self, sample_ids: Iterable[str | RoutingRef]) -> None:
        """Drop samples; pages no other sample shares become free. Unknown ids raise first."""
        raw_ids = [_sample_id_bytes(s) for s in _as_list(sample_ids)]
        with self._locked(mutate=True):
            found = [self._find_slot(r) for r in raw_ids]
            self._raise_unknown(raw_ids, found, "release")
            for raw_id, slot in zip(raw_ids, found, strict=True):
                chain = self._chain(slot)
                self._s_state[slot] = FREE
                self._unlink_from(
                    self._sample_heads, self._s_next, self._sample_bucket(raw_id), slot
                )
                self._p_refcount[chain] -= 1
                for p in chain[self._p_refcount[chain] == 0].tolist():
                    if self._p_key[p]:
                        bucket = self._page_bucket(int(self._p_parent[p]), int(self._p_key[p]))
                        self._unlink_from(self._page_heads, self._p_next, bucket, p)
                        self._p_key[p] = 0

    def _raise_unknown(self, raw_ids: list[bytes], found: list[int], action: str) -> None:
        missing = [r.decode() for r, s in zip(raw_ids, found, strict=True) if s == NO_PAGE]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise SampleNotFoundError(
                f"cannot {action} {shown}{more}: not in store {self.name!r} (never put, already "
                "released, or put on another node's store); nothing was changed"
            )
        if len(set(raw_ids)) != len(raw_ids):
            raise InvalidRoutesError(f"sample ids passed to {action} contain duplicates")

    # -- reading ----------------------------------------------------------------------

    def _locate(
        self, sample_ids: Iterable[str | RoutingRef]
    ) -> tuple[list[str], list[np.ndarray], np.ndarray, np.ndarray]:
        refs = _as_list(sample_ids)
        for r in refs:
            if isinstance(r, RoutingRef) and r.store != self.name:
                raise SampleNotFoundError(
                    f"ref {r.sample_id!r} belongs to store {r.store!r} (node {r.node_id}), "
                    f"not {self.name!r}: read it from that store"
                )
        raw_ids = [_sample_id_bytes(r) for r in refs]
        with self._locked():
            found = [self._find_slot(r) for r in raw_ids]
            if NO_PAGE in found:  # reading an id twice is fine; unknown ones are not
                self._raise_unknown(raw_ids, found, "read")
            chains = [self._chain(s) for s in found]
            meta = self._slots[["num_tokens", "prompt_len"]][found].copy()
            gens = self._p_gen[np.concatenate(chains)] if chains else np.empty(0)
        return [r.decode() for r in raw_ids], chains, meta, gens

    def _check_unchanged(self, ids: list[str], chains: list[np.ndarray], gens: np.ndarray) -> None:
        if not chains:
            return
        with self._locked():
            now = self._p_gen[np.concatenate(chains)]
        if not np.array_equal(now, gens):
            raise ConcurrentReleaseError(
                f"a sample among {ids[:5]} was released and its pages reused while being "
                "read: release samples only after every reader is done with them"
            )

    def _copy_out(self, chain: np.ndarray, first: int, stop: int, out: np.ndarray) -> None:
        """Copy tokens [first, stop) of a chain into `out` ([stop-first, L*K])."""
        P, page_values = self.page_tokens, self._data.shape[1]
        flat = self._data.reshape(-1)
        lo_page, hi_page = first // P, -(-stop // P)
        pages = chain[lo_page:hi_page].tolist()
        vpt = self.layout.values_per_token
        for i, page, count in _runs(pages):
            t0 = max((lo_page + i) * P, first)
            t1 = min((lo_page + i + count) * P, stop)
            src = page * page_values + (t0 - (lo_page + i) * P) * vpt
            out[t0 - first : t1 - first] = flat[src : src + (t1 - t0) * vpt].reshape(-1, vpt)

    def _span(self, sample_id: str, num_tokens: int, prompt_len: int, part: Part) -> range:
        if part == "all":
            return range(0, num_tokens)
        if part not in ("prompt", "completion"):
            raise ValueError(f"part must be 'all', 'prompt' or 'completion', got {part!r}")
        if prompt_len < 0:
            raise InvalidRoutesError(
                f"sample {sample_id!r} was put without prompt_len: only part='all' is available"
            )
        return range(0, prompt_len) if part == "prompt" else range(prompt_len, num_tokens)

    def get(self, sample_id: str | RoutingRef, part: Part = "all") -> np.ndarray:
        """One sample's routes `[T, L, K]` (`layout.signed_dtype`, -1 missing), a copy."""
        ids, chains, meta, gens = self._locate([sample_id])
        span = self._span(ids[0], int(meta["num_tokens"][0]), int(meta["prompt_len"][0]), part)
        stored = np.empty((len(span), self.layout.values_per_token), dtype=self.layout.dtype)
        self._copy_out(chains[0], span.start, span.stop, stored)
        self._check_unchanged(ids, chains, gens)
        L, K = self.layout.num_moe_layers, self.layout.top_k
        return self.layout.decode(stored.reshape(len(span), L, K))

    def read(
        self, sample_ids: Iterable[str | RoutingRef], part: Part = "all", out: Any = None
    ) -> pa.RecordBatch:
        """Samples as one Arrow record batch (schema in `routing_replay.schema`), one copy.

        `out`: optional writable, contiguous memory (a numpy array, a CPU torch tensor,
        pinned or not, a bytearray) of at least `sum_T * layout.bytes_per_token` bytes to
        copy into instead of a new buffer: a trainer that reuses it every step skips the
        page faults of fresh memory. The batch (and `to_torch` of it) are views of `out`:
        do not overwrite it while they are in use.
        """
        ids, chains, meta, gens = self._locate(sample_ids)
        spans = [
            self._span(i, int(n), int(p), part)
            for i, n, p in zip(ids, meta["num_tokens"], meta["prompt_len"], strict=True)
        ]
        lengths = np.array([len(s) for s in spans], dtype=np.int64)
        vpt = self.layout.values_per_token
        nbytes = int(lengths.sum()) * self.layout.bytes_per_token
        buf = pa.allocate_buffer(nbytes) if out is None else output_buffer(out, nbytes)
        values = np.frombuffer(buf, dtype=self.layout.dtype).reshape(-1, vpt)
        row = 0
        for chain, span in zip(chains, spans, strict=True):
            self._copy_out(chain, span.start, span.stop, values[row : row + len(span)])
            row += len(span)
        self._check_unchanged(ids, chains, gens)
        prompt = [None if p < 0 else int(p) for p in meta["prompt_len"]]
        return routes_batch(self.layout, ids, lengths, prompt, buf)

    def __contains__(self, sample_id: object) -> bool:
        raw_id = _sample_id_bytes(sample_id)
        with self._locked():
            return self._find_slot(raw_id) != NO_PAGE

    def __len__(self) -> int:
        return int((self._s_state == PUBLISHED).sum())

    def verify(self) -> None:
        """Check every invariant of the shared tables; raise RoutingReplayError on the first break.

        Refcounts equal the references of published chains; a page is referenced, reserved
        by a live writer, or free; shareable pages are findable in their bucket; every
        published sample is findable by id. For tests and for `routing-replay ls --verify`.
        """
        with self._locked():
            published = np.flatnonzero(self._s_state == PUBLISHED)
            expected = np.zeros(len(self._pages), dtype=np.int64)
            for s in published.tolist():
                chain = self._chain(s)
                if len(chain) != -(-int(self._s_num_tokens[s]) // self.page_tokens):
                    raise RoutingReplayError(f"slot {s}: chain of {len(chain)} pages is wrong")
                expected[chain] += 1
                if self._find_slot(bytes(self._s_sample_id[s])) != s:
                    raise RoutingReplayError(f"slot {s} is not findable by its sample id")
            if not np.array_equal(expected, self._p_refcount):
                bad = np.flatnonzero(expected != self._p_refcount)[:5].tolist()
                raise RoutingReplayError(f"refcounts disagree with the chains at pages {bad}")
            both = (self._p_refcount > 0) & (self._p_owner != 0)
            if both.any():
                raise RoutingReplayError(
                    f"pages {np.flatnonzero(both)[:5]} are both published and reserved"
                )
            for p in np.flatnonzero((self._p_key != 0) & (self._p_refcount > 0)).tolist():
                parent, key = int(self._p_parent[p]), int(self._p_key[p])
                if self._find_page(parent, key, self._data[p]) == NO_PAGE:
                    raise RoutingReplayError(f"shareable page {p} is not in its bucket")
            if (self._p_key[self._p_refcount == 0] != 0).any():
                raise RoutingReplayError("a free page still carries a sharing key")

    def stats(self) -> StoreStats:
        """Capacity, use and prefix-sharing savings."""
        with self._locked():
            pages = self._pages
            published = self._s_state == PUBLISHED
            used = int((self._p_refcount > 0).sum())
            pending = int(((self._p_owner != 0) & (self._p_refcount == 0)).sum())
            referenced = int(self._s_num_pages[published].sum())
            tokens = int(self._s_num_tokens[published].sum())
            samples = int(published.sum())
        page_bytes = self.page_tokens * self.layout.bytes_per_token
        return StoreStats(
            capacity_tokens=self.capacity_tokens,
            page_tokens=self.page_tokens,
            pages_total=len(pages),
            pages_used=used,
            pages_pending=pending,
            samples=samples,
            tokens_stored=tokens,
            bytes_used=used * page_bytes,
            bytes_unshared=referenced * page_bytes,
            dedup_saved_bytes=(referenced - used) * page_bytes,
            segment_bytes=self._seg.size,
        )


def _initialise(buf: Any, offsets: dict[str, int], fields: dict[str, Any]) -> None:
    """Write a new segment's header and empty tables; the magic goes last."""
    hdr = np.ndarray((), HEADER_DTYPE, buffer=buf, offset=0)
    for key, value in fields.items():
        hdr[key] = value
    for region, count in (("page_heads", "page_buckets"), ("sample_heads", "sample_buckets")):
        np.ndarray((fields[count],), "<i4", buf, offsets[region])[:] = NO_PAGE
    pages = np.ndarray((fields["num_pages"],), PAGE_DTYPE, buf, offsets["pages"])
    pages["parent"] = NO_PAGE
    pages["next"] = NO_PAGE
    hdr["magic"] = MAGIC  # attachers wait for it


def _as_list(sample_ids: Iterable[str | RoutingRef] | str | RoutingRef) -> list[Any]:
    if isinstance(sample_ids, (str, RoutingRef)):
        return [sample_ids]
    return list(sample_ids)


@dataclass(frozen=True)
class StoreInfo:
    """One store segment found in the shared-memory directory, as `list_stores` sees it."""

    name: str
    path: str
    size_bytes: int
    owner_pid: int
    owner_alive: bool
    node_id: str
    layout: RoutingLayout | None  # None: not a complete store (half-made or foreign)
    age_s: float
    stats: StoreStats | None  # None when it could not be attached (other user, half-made)


def _read_info(path: str) -> StoreInfo:
    name = os.path.basename(path)[len(SEGMENT_PREFIX) :]
    st = os.stat(path)
    age = time.time() - st.st_mtime
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        return StoreInfo(name, path, st.st_size, 0, True, "", None, age, None)
    try:
        raw = os.pread(fd, HEADER_DTYPE.itemsize, 0)
    finally:
        os.close(fd)
    if len(raw) < HEADER_DTYPE.itemsize or raw[:8] != MAGIC:
        return StoreInfo(name, path, st.st_size, 0, False, "", None, age, None)
    hdr = np.frombuffer(raw, HEADER_DTYPE)[0]
    pid, start = int(hdr["owner_pid"]), int(hdr["owner_start"])
    stats = None
    with contextlib.suppress(RoutingReplayError, OSError, ValueError):
        store = RoutingStore.attach(name)
        stats = store.stats()
        store.close()
    return StoreInfo(
        name=name,
        path=path,
        size_bytes=st.st_size,
        owner_pid=pid,
        owner_alive=pid_alive(pid, start),
        node_id=hdr["node_id"].decode(),
        layout=RoutingLayout.from_json(hdr["layout"]),
        age_s=age,
        stats=stats,
    )


def list_stores(prefix: str = "") -> list[StoreInfo]:
    """Routing stores in the shared-memory directory (names starting with `prefix`)."""
    paths = sorted(
        e.path
        for e in os.scandir(SHM_DIR)
        if e.name.startswith(SEGMENT_PREFIX + prefix) and e.is_file()
    )
    infos = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):  # unlinked meanwhile
            infos.append(_read_info(path))
    return infos


def sweep_stores(
    dry_run: bool = False, min_age_s: float = 60.0, prefix: str = ""
) -> list[StoreInfo]:
    """Unlink stores whose owner process is dead (and half-made ones older than min_age_s).

    A store whose owner lives is never touched. Processes that still map a swept store
    keep their mapping; the memory returns when the last of them closes.
    """
    stale = [
        info
        for info in list_stores(prefix)
        if (info.layout is not None and not info.owner_alive)
        or (info.layout is None and not info.owner_alive and info.age_s >= min_age_s)
    ]
    if not dry_run:
        for info in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(info.path)
    return stale
