"""`RoutingStore`: the per-node shared-memory store of routes, a thin facade over its parts.

A put, top to bottom (`format` has the segment's layout):

1. lock, look the id up (`SampleIndex`) and the shareable prefix (`PrefixIndex`), unlock;
2. compare the prefix's routes without the lock: a frozen `SharePlan`;
3. lock, take this writer's lease (`Leases`) and reserve the other pages (`PageAllocator`),
   unlock;
4. copy and check the new rows into the reserved pages without the lock;
5. lock, check the plan is still valid and the pages still ours, publish (the slot's state
   is the commit point), unlock.

Readers find a sample's chain and generations under the lock, copy without it, and check
the generations again. Every change happens inside `CommitLock.held` (dirty flag, repair);
liveness of writers is a kernel lease, never a pid.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import os
import socket
import time
from collections.abc import Iterable, Sequence
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
    TokenMismatchError,
)
from routing_replay.layout import RoutingLayout
from routing_replay.schema import output_buffer, routes_batch
from routing_replay.shm import Segment
from routing_replay.store.format import (
    ATTACH_WAIT_S,
    CHECK_CHUNK_BYTES,
    DEFAULT_MAX_WRITERS,
    DEFAULT_PAGE_TOKENS,
    DEFAULT_PUT_TIMEOUT_S,
    FORBIDDEN_ID_CHARS,
    HEADER_DTYPE,
    LEASE_HELD,
    MAGIC,
    MAX_PAGE_TOKENS,
    MAX_SAMPLE_ID_BYTES,
    MAX_TABLE,
    MIN_LOCK_WAIT_S,
    NO_DIGEST,
    NO_PAGE,
    OWNER_LEASE,
    PAGE_DTYPE,
    TOKEN_DTYPE,
    VERSION,
    pow2_at_least,
    regions,
)
from routing_replay.store.leases import Leases
from routing_replay.store.lock import CommitLock, Hold
from routing_replay.store.pages import PageAllocator, Reservation
from routing_replay.store.prefix import PrefixIndex, SharePlan, page_keys, runs
from routing_replay.store.samples import SampleIndex, token_digest
from routing_replay.store.tables import Tables, view

Part = Literal["all", "prompt", "completion"]


@dataclass(frozen=True)
class RoutingRef:
    """Small, picklable handle to one stored sample: what travels through the driver.

    `store_uid` names the store's incarnation: a ref is never read from another store
    created later under the same name (0: not checked, for refs made by hand).
    `tokens_digest` is the digest of the token ids the routes were put with (0: put
    without them): a ref is never read for a sample put again under its id with other
    tokens, and trainers check their tokens against it. `policy_versions` says which
    policy version produced which tokens: `(first token, version)` per span, in token
    order (one span for a one-turn sample; a multi-turn episode may span versions);
    empty when put without a version.
    """

    sample_id: str
    store: str
    node_id: str
    num_tokens: int
    prompt_len: int | None = None
    store_uid: int = 0
    tokens_digest: int = NO_DIGEST
    policy_versions: tuple[tuple[int, int], ...] = ()

    @property
    def policy_version(self) -> int | None:
        """The oldest policy version among the sample's tokens (None: put without one)."""
        return min(v for _, v in self.policy_versions) if self.policy_versions else None


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


def sample_id_bytes(sample_id: Any) -> bytes:
    """The UTF-8 id of a sample id or ref, checked."""
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


def policy_spans(value: Any, num_tokens: int, sample_id: str) -> tuple[tuple[int, int], ...]:
    """`put`'s policy_version as `(first token, version)` spans: an int is one span from 0;
    a sequence of pairs must start at token 0, rise strictly and stay inside the sample."""
    if value is None:
        return ()
    pairs = [(0, value)] if isinstance(value, numbers.Integral) else list(value)

    def whole(x: Any) -> bool:
        return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) and x >= 0

    if not pairs or not all(
        isinstance(p, (tuple, list)) and len(p) == 2 and whole(p[0]) and whole(p[1]) for p in pairs
    ):
        raise InvalidRoutesError(
            f"policy_version for sample {sample_id!r} must be an int >= 0 or a sequence of "
            f"(first token, version) pairs of ints >= 0, got {value!r}"
        )
    spans = tuple((int(start), int(version)) for start, version in pairs)
    starts = [start for start, _ in spans]
    rising = all(b > a for a, b in itertools.pairwise(starts))
    if starts[0] != 0 or not rising or starts[-1] >= num_tokens:
        raise InvalidRoutesError(
            f"policy_version spans {list(spans)} of sample {sample_id!r} must start at token 0 "
            f"and rise strictly below its {num_tokens} tokens"
        )
    return spans


def _prompt_len(value: Any, num_tokens: int, sample_id: str) -> int:
    """prompt_len as stored: -1 for None, else an int in [0, num_tokens]."""
    if value is None:
        return -1
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidRoutesError(
            f"prompt_len must be an int (the number of prompt tokens) or None, got {value!r} "
            f"({type(value).__name__}) for sample {sample_id!r}"
        )
    if not 0 <= int(value) <= num_tokens:
        raise InvalidRoutesError(
            f"prompt_len={value} is outside [0, {num_tokens}] for sample {sample_id!r}"
        )
    return int(value)


def _as_list(sample_ids: Iterable[str | RoutingRef] | str | RoutingRef) -> list[Any]:
    if isinstance(sample_ids, (str, RoutingRef)):
        return [sample_ids]
    return list(sample_ids)


class RoutingStore:
    """Per-node shared-memory store of routes: `create` by the owner, `attach` by others."""

    # -- life cycle -------------------------------------------------------------------

    def __init__(self, segment: Segment, put_timeout: float) -> None:
        self._seg = segment
        self._t = Tables(segment.name, segment.mmap)
        self.put_timeout = put_timeout
        self.layout = self._t.layout
        self.node_id = self._t.node_id
        self.page_tokens = self._t.page_tokens
        self.capacity_tokens = self._t.num_pages * self.page_tokens
        self._lock = CommitLock(segment, self._t, self._repair)
        self._leases = Leases(segment, self._t)
        self._pages = PageAllocator(self._t)
        self._samples = SampleIndex(self._t)
        self._prefix = PrefixIndex(self._t)
        self._puts_running: list[None] = []  # one entry per put in flight (append/pop: atomic)

    @classmethod
    def create(
        cls,
        name: str,
        layout: RoutingLayout,
        capacity_tokens: int,
        *,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        max_samples: int | None = None,
        max_writers: int = DEFAULT_MAX_WRITERS,
        node_id: str | None = None,
        put_timeout: float = DEFAULT_PUT_TIMEOUT_S,
    ) -> RoutingStore:
        """Create and own the store `name` with room for `capacity_tokens` routed tokens."""
        for what, value, hi in (
            ("capacity_tokens", capacity_tokens, MAX_TABLE * MAX_PAGE_TOKENS),
            ("page_tokens", page_tokens, MAX_PAGE_TOKENS),
            ("max_writers", max_writers, 1 << 20),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or not 0 < value <= hi
            ):
                raise ValueError(f"{what} must be an int in [1, {hi}], got {value!r}")
        num_pages = -(-int(capacity_tokens) // page_tokens)
        max_samples = int(max_samples or num_pages + 64)
        if num_pages > MAX_TABLE or not 0 < max_samples <= MAX_TABLE:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} needs {num_pages} pages of {page_tokens} "
                f"tokens and max_samples={max_samples}; a store holds at most {MAX_TABLE} of "
                "each: lower capacity_tokens (or max_samples), or raise page_tokens"
            )
        layout_json = layout.to_json().encode()
        node = (node_id or default_node_id()).encode()
        if len(layout_json) > HEADER_DTYPE["layout"].itemsize or len(node) > 128:
            raise ValueError("layout or node_id too long for the store header")
        sizes = {
            "page_tokens": page_tokens,
            "num_pages": num_pages,
            "max_samples": max_samples,
            "page_buckets": pow2_at_least(num_pages),
            "sample_buckets": pow2_at_least(max_samples),
            "max_writers": int(max_writers),
        }
        offsets = regions(layout.bytes_per_token, **sizes)
        fields = {
            **sizes,
            "version": VERSION,
            "store_uid": int.from_bytes(os.urandom(8), "little") | 1,
            "owner_pid": os.getpid(),
            "created": time.time(),
            "node_id": node,
            "layout": layout_json,
        }
        seg = Segment.create(name, offsets["end"], OWNER_LEASE)
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
        """Attach to the store `name` created by another process on this node (same user)."""
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
        try:
            store = cls(seg, put_timeout)
        except BaseException:
            seg.close()
            raise
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
    def store_uid(self) -> int:
        """Random id of this store's incarnation (refs carry it)."""
        return self._t.store_uid

    @property
    def is_owner(self) -> bool:
        """Whether this handle created the store (and so unlinks it)."""
        return self._seg.owner

    def close(self) -> None:
        """Unmap the store in this process; stored samples stay for other processes."""
        if self._seg.fd < 0:
            return
        self._t.release_views()
        try:
            self._seg.close()
        except BufferError:
            self._t.map(self._seg.mmap)  # still open, still usable
            raise BufferError(
                f"store {self.name!r} cannot be closed: numpy arrays that view its shared "
                "memory are still alive (get/read return copies; views come from store "
                "internals). Drop them, then close again"
            ) from None

    def owner_alive(self) -> bool:
        """Whether the process that created this store still holds its owner lease."""
        return self._leases.owner_alive()

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

    def _deadline(self, timeout: float | None = None) -> float:
        """Lock deadline of an operation: its timeout, but never under MIN_LOCK_WAIT_S."""
        wait = self.put_timeout if timeout is None else timeout
        return time.monotonic() + max(wait, MIN_LOCK_WAIT_S)

    # -- repair -----------------------------------------------------------------------

    def _repair(self) -> None:
        """Rebuild every derived table from the published samples (under the lock).

        Ground truth: published slots (each checked against its checksum), page parents,
        generations and reservation tags, and the kernel's leases. Derived: refcounts,
        buckets, free stacks, counters. Pages reserved by live writers stay theirs.
        """
        t = self._t
        published = self._samples.published()
        chains = [self._samples.chain(int(s))[0] for s in published]
        flat = np.concatenate(chains) if chains else np.empty(0, dtype=np.int64)
        referenced = np.bincount(flat, minlength=t.num_pages)
        owners = t.p_owner
        keep = np.zeros(t.num_pages, dtype=bool)
        for owner in np.unique(owners[(owners > 0) & (referenced == 0)]).tolist():
            i = owner - 1
            if i < t.max_writers and t.leases["state"][i] == LEASE_HELD and self._leases.alive(i):
                keep |= (owners == owner) & (t.p_owner_gen == t.leases["gen"][i])
        self._pages.rebuild(referenced, keep)
        self._prefix.rebuild(referenced)
        self._samples.rebuild(published, chains)
        for i in self._leases.dead_holders():
            self._leases.mark_free(i)
        t.set_dirty(False)

    def _reclaim_dead(self, hold: Hold, puts_of_caller: int) -> int:
        """Free pages reserved by writers whose lease the kernel dropped, and this handle's
        orphans (under the lock).

        Orphans are pages of this handle's lease that a put cut short by an async exception
        inside its own clean-up (a second KeyboardInterrupt) could not give back. They are
        freed only while no other put of this handle is in flight (`puts_of_caller`: 1
        from inside a put that holds no pages, 0 from `reclaim`); the count of puts in
        flight can only err high, which skips the clean-up, never frees a live put's pages.
        """
        freed = 0
        for i in self._leases.dead_holders():
            hold.write()
            freed += self._pages.reclaim_lease(hold, i)
            self._leases.mark_free(i)
        mine = self._leases.mine()
        if mine is not None and len(self._puts_running) == puts_of_caller:
            freed += self._pages.reclaim_lease(hold, *mine)
        return freed

    def reclaim(self) -> int:
        """Free pages reserved by writers that died mid-put (and this handle's orphans);
        returns how many were freed."""
        with self._lock.held("reclaim", self._deadline()) as hold:
            return self._reclaim_dead(hold, 0)

    # -- writing ----------------------------------------------------------------------

    def put(
        self,
        sample_id: str,
        routes: Any,
        *,
        prompt_len: int | None = None,
        token_ids: Any = None,
        policy_version: int | Sequence[tuple[int, int]] | None = None,
        timeout: float | None = None,
    ) -> RoutingRef:
        """Store one sample's `[T, L, K]` routes (-1 = missing) and return its reference.

        `token_ids` (`[T]`, the tokens the routes were recorded for) are stored with the
        routes: they let samples with a common prefix share pages, and trainers check
        their batch against them (`to_torch(..., input_ids=)`). Waits up to `timeout`
        (default `put_timeout`) for room, and for the lock, then raises `StoreFullError`
        (or `StoreBusyError`); on any error nothing is stored. `policy_version` (the
        version of the policy that generated the sample, or `(first token, version)` spans
        for an episode whose turns came from several) rides on the ref, for staleness
        filters (`routing_replay.dataset.split_stale`).
        """
        raw_id = sample_id_bytes(sample_id)
        checked = self.layout.select_moe(routes)  # ids are checked after the copy, in cache
        num_tokens = len(checked)
        if num_tokens == 0:
            raise InvalidRoutesError(f"sample {sample_id!r} has no routed tokens")
        prompt = _prompt_len(prompt_len, num_tokens, sample_id)
        versions = policy_spans(policy_version, num_tokens, sample_id)
        P = self.page_tokens
        tokens = None if token_ids is None else self._tokens(token_ids, num_tokens, sample_id)
        keys = [] if tokens is None else self._page_keys(tokens)
        digest = NO_DIGEST if tokens is None else token_digest(tokens)
        num_pages = -(-num_tokens // P)
        if num_pages > self._t.num_pages:
            raise StoreFullError(
                f"sample {sample_id!r} has {num_tokens} tokens but store {self.name!r} holds "
                f"at most {self.capacity_tokens}: create it with a larger capacity_tokens"
            )
        if not self._seg.is_current():
            raise StoreUnavailableError(
                f"store {self.name!r} was removed (swept) or re-created since this process "
                "attached it: attach again (or call node_store again) and put there"
            )
        timeout = self.put_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        lock_deadline = max(deadline, time.monotonic() + MIN_LOCK_WAIT_S)
        keyed = self._as_stored(checked[: len(keys) * P]) if keys else checked[:0]
        keyed_tokens = tokens[: len(keys) * P] if keys else np.empty(0, TOKEN_DTYPE)
        resv, wait = Reservation(), 0.001
        self._puts_running.append(None)
        try:
            while True:
                with self._lock.held("put.lookup", lock_deadline):
                    self._refuse_duplicate(raw_id)
                    plan = self._prefix.candidates(keys)
                equal = self._prefix.equal_prefix(plan, keyed, keyed_tokens)
                with self._lock.held("put.reserve", lock_deadline) as hold:
                    if equal < len(plan):  # same tokens, other routes: an equal twin?
                        plan = self._prefix.twins(plan.prefix(equal), keys, keyed, keyed_tokens)
                    lease = self._leases.take(hold, lambda i: self._pages.reclaim_lease(hold, i))
                    count = num_pages - len(plan)
                    ok = self._pages.reserve(hold, count, lease, resv) or (
                        self._reclaim_dead(hold, 1) > 0
                        and self._pages.reserve(hold, count, lease, resv)
                    )
                if ok:
                    # Ids are checked before publishing: nothing bad is ever seen. New rows
                    # are checked as they are copied; rows byte-equal to shared pages were
                    # checked when those were put, unless a wider input wrapped onto them.
                    self._fill(resv.pages, checked, tokens, len(plan) * P)
                    if checked.dtype != self.layout.dtype:
                        self.layout.check_ids(checked[: len(plan) * P])
                    with self._lock.held("put.publish", lock_deadline) as hold:
                        if self._prefix.valid(plan):
                            ref = self._publish(
                                hold, raw_id, plan, resv, keys, num_tokens, prompt, digest
                            )
                            return dataclasses.replace(ref, policy_versions=versions)
                        self._pages.unreserve(hold, resv)  # a shared page was released: again
                    continue
                if time.monotonic() >= deadline:
                    raise self._full_error(sample_id, num_tokens, timeout)
                time.sleep(wait)
                wait = min(wait * 2, 0.05)
        finally:
            try:
                if len(resv.pages) and not resv.published:
                    with self._lock.held("put.unreserve", self._deadline()) as hold:
                        self._pages.unreserve(hold, resv)
            finally:
                self._puts_running.pop()

    def _refuse_duplicate(self, raw_id: bytes) -> None:
        if self._samples.find(raw_id) != NO_PAGE:
            raise DuplicateSampleError(
                f"sample {raw_id.decode()!r} is already in store {self.name!r}: release it "
                "first, or give every sample a unique id"
            )

    def _tokens(self, token_ids: Any, num_tokens: int, sample_id: str) -> np.ndarray:
        """Checked token ids as stored (int32)."""
        if hasattr(token_ids, "detach"):  # a torch tensor, maybe on a device
            token_ids = token_ids.detach().cpu().numpy()
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1 or len(tokens) != num_tokens or tokens.dtype.kind not in "iu":
            raise InvalidRoutesError(
                f"sample {sample_id!r}: token_ids must be a 1-D integer array with one id per "
                f"routes row ({num_tokens}), got shape {tokens.shape} and dtype {tokens.dtype}"
            )
        if len(tokens) and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
            raise InvalidRoutesError(
                f"sample {sample_id!r}: token ids must be in [0, 2**31), got "
                f"[{tokens.min()}, {tokens.max()}]"
            )
        return np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)

    def _page_keys(self, tokens: np.ndarray) -> list[int]:
        P = self.page_tokens
        full = len(tokens) // P * P
        return page_keys(tokens[:full].reshape(-1, P)) if full else []

    def _as_stored(self, rows: np.ndarray) -> np.ndarray:
        """Rows in the stored dtype: the rows themselves when narrow, else a converted copy."""
        if rows.dtype == self.layout.dtype:
            return rows
        return self.layout.convert(rows, np.empty(rows.shape, dtype=self.layout.dtype))

    def _fill(
        self, new: np.ndarray, checked: np.ndarray, tokens: np.ndarray | None, first_row: int
    ) -> None:
        """Copy rows `first_row:` (and their tokens) into reserved pages and range-check
        their ids chunk by chunk, right after each copy while it is in cache.

        Repeated ids within a top-k are not scanned for here: that scan costs 10-17x the
        copy in numpy (benchmarks/store.py), and is done exactly where routes come from an
        engine (`integrations`) and where they are used (`replay`, the Megatron feed)."""
        P, shape = self.page_tokens, checked.shape[1:]
        data = self._t.data
        flat = data.reshape(-1)
        page_values = data.shape[1]
        step = max(1, CHECK_CHUNK_BYTES // max(1, checked[:1].nbytes))
        page_tokens = self._t.tokens.reshape(-1)
        try:
            for i, first, count in runs(new.tolist()):
                rows = checked[first_row + i * P : first_row + (i + count) * P]
                if tokens is not None:
                    page_tokens[first * P : first * P + len(rows)] = tokens[
                        first_row + i * P : first_row + i * P + len(rows)
                    ]
                start = first * page_values
                out = flat[start : start + len(rows) * page_values // P].reshape(len(rows), *shape)
                for a in range(0, len(rows), step):
                    self.layout.convert(rows[a : a + step], out[a : a + step])
                    self.layout.check_ids(rows[a : a + step])
        except InvalidRoutesError:
            self.layout.check_ids(checked)  # the same error, positions in the whole sample
            raise

    def _publish(
        self,
        hold: Hold,
        raw_id: bytes,
        plan: SharePlan,
        resv: Reservation,
        keys: list[int],
        num_tokens: int,
        prompt_len: int,
        digest: int,
    ) -> RoutingRef:
        """Commit a sample (under the lock; the plan was just found valid)."""
        t = self._t
        self._refuse_duplicate(raw_id)  # put concurrently by another writer
        if not self._pages.still_mine(resv).all():
            raise t.corrupt("pages this writer reserved were given to another writer")
        slot = self._samples.take_slot(hold)
        hold.write()
        new = resv.pages
        chain = np.concatenate([np.asarray(plan.pages, dtype=np.int64), new])
        if len(new):
            t.p_parent[new] = [plan.pages[-1] if plan.pages else NO_PAGE, *new[:-1].tolist()]
        for i in range(len(plan), len(keys)):
            self._prefix.link(int(chain[i]), int(t.p_parent[chain[i]]), keys[i])
        self._pages.reference(chain)
        self._samples.publish(slot, raw_id, num_tokens, prompt_len, digest, chain, t.p_gen[chain])
        self._pages.publish(resv)
        prompt = None if prompt_len < 0 else prompt_len
        return RoutingRef(
            raw_id.decode(), self.name, self.node_id, num_tokens, prompt, t.store_uid, digest
        )

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
        refs = _as_list(sample_ids)
        self._check_refs(refs)
        raw_ids = [sample_id_bytes(s) for s in refs]
        with self._lock.held("release", self._deadline()) as hold:
            found = [self._samples.find(r) for r in raw_ids]
            self._raise_unknown(raw_ids, found, "release")
            chains = [self._samples.chain(s)[0] for s in found]
            hold.write()
            for raw_id, slot, chain in zip(raw_ids, found, chains, strict=True):
                self._samples.remove(slot, raw_id, len(chain))
                freed = self._pages.dereference(chain)
                for p in freed.tolist():
                    self._prefix.unlink(p)
                self._pages.push(freed)

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

    def _check_refs(self, refs: list[Any]) -> None:
        for r in refs:
            if not isinstance(r, RoutingRef):
                continue
            if r.store != self.name:
                raise SampleNotFoundError(
                    f"ref {r.sample_id!r} belongs to store {r.store!r} (node {r.node_id}), "
                    f"not {self.name!r}: read it from that store"
                )
            if r.store_uid and r.store_uid != self._t.store_uid:
                raise StoreUnavailableError(
                    f"ref {r.sample_id!r} was put in an earlier store named {self.name!r}, "
                    "which was removed and created again since: its routes are gone; "
                    "re-run the rollout"
                )

    def _locate(
        self, sample_ids: Iterable[str | RoutingRef]
    ) -> tuple[list[str], list[np.ndarray], list[tuple[int, int, int]], np.ndarray]:
        """Ids, chains, (num_tokens, prompt_len, digest) and page generations of samples."""
        refs = _as_list(sample_ids)
        self._check_refs(refs)
        raw_ids = [sample_id_bytes(r) for r in refs]
        chains, meta, gens = [], [], []
        with self._lock.held("read.locate", self._deadline()):
            found = [self._samples.find(r) for r in raw_ids]
            if NO_PAGE in found:  # reading an id twice is fine; unknown ones are not
                self._raise_unknown(raw_ids, found, "read")
            for s in found:
                pages, page_gens, num_tokens, prompt_len = self._samples.chain(s)
                chains.append(pages)
                gens.append(page_gens)
                meta.append((num_tokens, prompt_len, self._samples.digest(s)))
        for ref, (num_tokens, _, digest) in zip(refs, meta, strict=True):
            if isinstance(ref, RoutingRef) and (
                ref.num_tokens != num_tokens or ref.tokens_digest not in (NO_DIGEST, digest)
            ):
                raise TokenMismatchError(
                    f"ref {ref.sample_id!r} ({ref.num_tokens} tokens) does not describe the "
                    f"sample stored under that id now ({num_tokens} tokens, other token ids): "
                    "the sample was released and put again with other tokens. Refs must not "
                    "outlive their release; give every rollout sample a unique id"
                )
        all_gens = np.concatenate(gens) if gens else np.empty(0, dtype=np.uint32)
        return [r.decode() for r in raw_ids], chains, meta, all_gens

    def _check_unchanged(self, ids: list[str], chains: list[np.ndarray], gens: np.ndarray) -> None:
        if not chains:
            return
        with self._lock.held("read.check", self._deadline()):
            now = self._t.p_gen[np.concatenate(chains)]
        if not np.array_equal(now, gens):
            raise ConcurrentReleaseError(
                f"a sample among {ids[:5]} was released and its pages reused while being "
                "read: release samples only after every reader is done with them"
            )

    def _copy_out(
        self, pages_data: np.ndarray, chain: np.ndarray, first: int, stop: int, out: np.ndarray
    ) -> None:
        """Copy tokens [first, stop) of a chain from `pages_data` (the routes or the token
        ids, `[num_pages, P * width]`) into `out` (`[stop - first, width]`)."""
        P, flat = self.page_tokens, pages_data.reshape(-1)
        width = pages_data.shape[1] // P
        lo_page, hi_page = first // P, -(-stop // P)
        for i, page, count in runs(chain[lo_page:hi_page].tolist()):
            t0 = max((lo_page + i) * P, first)
            t1 = min((lo_page + i + count) * P, stop)
            src = (page * P + t0 - (lo_page + i) * P) * width
            out[t0 - first : t1 - first] = flat[src : src + (t1 - t0) * width].reshape(-1, width)

    def _span(
        self, sample_id: str, num_tokens: int, prompt_len: int, _digest: int, part: Part
    ) -> range:
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
        span = self._span(ids[0], *meta[0], part)
        stored = np.empty((len(span), self.layout.values_per_token), dtype=self.layout.dtype)
        self._copy_out(self._t.data, chains[0], span.start, span.stop, stored)
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
        spans = [self._span(i, *m, part) for i, m in zip(ids, meta, strict=True)]
        lengths = np.array([len(s) for s in spans], dtype=np.int64)
        has_tokens = np.array([digest != NO_DIGEST for *_, digest in meta], dtype=bool)
        vpt = self.layout.values_per_token
        nbytes = int(lengths.sum()) * self.layout.bytes_per_token
        buf = pa.allocate_buffer(nbytes) if out is None else output_buffer(out, nbytes)
        values = np.frombuffer(buf, dtype=self.layout.dtype).reshape(-1, vpt)
        token_buf = pa.allocate_buffer(int(lengths[has_tokens].sum()) * TOKEN_DTYPE.itemsize)
        tokens = np.frombuffer(token_buf, dtype=TOKEN_DTYPE).reshape(-1, 1)
        row = token_row = 0
        for chain, span, with_tokens in zip(chains, spans, has_tokens.tolist(), strict=True):
            self._copy_out(self._t.data, chain, span.start, span.stop, values[row:])
            if with_tokens:
                self._copy_out(self._t.tokens, chain, span.start, span.stop, tokens[token_row:])
                token_row += len(span)
            row += len(span)
        self._check_unchanged(ids, chains, gens)
        prompt = [None if p < 0 else p for _, p, _ in meta]
        return routes_batch(self.layout, ids, lengths, prompt, buf, (has_tokens, token_buf))

    def __contains__(self, sample_id: object) -> bool:
        raw_id = sample_id_bytes(sample_id)
        with self._lock.held("contains", self._deadline()):
            return self._samples.find(raw_id) != NO_PAGE

    def __len__(self) -> int:
        return self._t.counter("samples", self._t.max_samples)

    def verify(self) -> None:
        """Check every invariant of the shared tables; raise CorruptStoreError on the first break.

        Every published sample passes its checksum and is findable by id; refcounts equal
        the references of published chains; a page is referenced, reserved by a writer
        (a dead one's until reclaimed), or on the free stack (exactly once); shareable pages
        are findable in their bucket and free pages carry no key; free slots are on the
        free-slot stack; the header counters agree. For tests and for `routing-replay ls --verify`.
        """
        t = self._t
        with self._lock.held("verify", self._deadline()):
            published = self._samples.published()
            chains = []
            for s in published.tolist():
                chains.append(self._samples.chain(s)[0])
                if self._samples.find(self._samples.sample_id(s)) != s:
                    raise t.corrupt(f"slot {s} is not findable by its sample id")
            flat = np.concatenate(chains) if chains else np.empty(0, dtype=np.int64)
            referenced = np.bincount(flat, minlength=t.num_pages)
            if not np.array_equal(referenced, t.p_refcount):
                bad = np.flatnonzero(referenced != t.p_refcount)[:5].tolist()
                raise t.corrupt(f"refcounts disagree with the chains at pages {bad}")
            reserved = t.p_owner != 0
            if (reserved & (referenced > 0)).any():
                raise t.corrupt("a page is both published and reserved")
            owners = np.unique(t.p_owner[reserved])
            if len(owners) and not (owners[0] > 0 and owners[-1] <= t.max_writers):
                raise t.corrupt(f"pages are reserved by writer leases {owners.tolist()}")
            top = t.counter("free_pages", t.num_pages)
            expected = np.flatnonzero((referenced == 0) & ~reserved)
            if not np.array_equal(np.sort(t.free_pages[:top]), expected):
                raise t.corrupt("the free-page stack is not exactly the free pages")
            for p in np.flatnonzero((t.p_key != 0) & (referenced > 0)).tolist():
                if not self._prefix.findable(p):
                    raise t.corrupt(f"shareable page {p} is not in its bucket")
            if (t.p_key[referenced == 0] != 0).any():
                raise t.corrupt("a free page still carries a sharing key")
            top = t.counter("free_slots", t.max_samples)
            if not np.array_equal(np.sort(t.free_slots[:top]), np.flatnonzero(t.s_state == 0)):
                raise t.corrupt("the free-slot stack is not exactly the free slots")
            counters = {
                "samples": len(published),
                "tokens": int(t.s_num_tokens[published].astype(np.int64).sum()),
                "pages_used": int((referenced > 0).sum()),
                "pages_reserved": int(reserved.sum()),
                "pages_referenced": len(flat),
            }
            for field, value in counters.items():
                if int(t.hdr[field]) != value:
                    raise t.corrupt(f"header {field}={int(t.hdr[field])}, the tables say {value}")

    def stats(self) -> StoreStats:
        """Capacity, use and prefix-sharing savings (from the header's counters)."""
        t = self._t
        with self._lock.held("stats", self._deadline()):
            used = t.counter("pages_used", t.num_pages)
            pending = t.counter("pages_reserved", t.num_pages)
            referenced = t.counter("pages_referenced", MAX_TABLE * t.max_samples)
            tokens = t.counter("tokens", referenced * t.page_tokens)
            samples = t.counter("samples", t.max_samples)
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
            segment_bytes=self._seg.size,
        )


def _initialise(buf: Any, offsets: dict[str, int], fields: dict[str, Any]) -> None:
    """Write a new segment's header and empty tables; the magic goes last."""
    hdr = view(buf, HEADER_DTYPE, (), 0)
    for key, value in fields.items():
        hdr[key] = value
    num_pages, max_samples = fields["num_pages"], fields["max_samples"]
    for region, count in (("page_heads", "page_buckets"), ("sample_heads", "sample_buckets")):
        view(buf, "<i4", (fields[count],), offsets[region])[:] = NO_PAGE
    pages = view(buf, PAGE_DTYPE, (num_pages,), offsets["pages"])
    pages["parent"] = NO_PAGE
    pages["next"] = NO_PAGE
    view(buf, "<i4", (num_pages,), offsets["free_pages"])[:] = np.arange(num_pages)[::-1]
    hdr["free_pages"] = num_pages
    view(buf, "<i4", (max_samples,), offsets["free_slots"])[:] = np.arange(max_samples)[::-1]
    hdr["free_slots"] = max_samples
    hdr["magic"] = MAGIC  # attachers wait for it
