"""`RoutingStore`: the per-node shared-memory store of routes, a small facade over its parts.
(Over 400 lines by design: the public handle, every method with its documentation, in one
place; the logic is in the modules below.)

Life cycle (create, attach, close, unlink) lives here; the protocols live in their own
modules and work on the handle's `StoreCore`: `put` (`PutTransaction`: one or many samples,
all or none), `read` (`ReadPlan`), `spill`, `repair`, `verify`. Every change happens inside
`CommitLock.held` (dirty flag, repair); liveness of writers is a kernel lease, never a pid.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from routing_replay.errors import (
    InvalidArgumentError,
    LayoutMismatchError,
    RoutingReplayError,
    StoreBusyError,
    StoreUnavailableError,
)
from routing_replay.layout import RoutingLayout
from routing_replay.store.calls import (
    forget_frames,
    fork_bound,
    inside_call,
    others_in_flight,
    store_call,
)
from routing_replay.store.core import StoreCore, StoreStats
from routing_replay.store.files import close_each
from routing_replay.store.format import (
    ATTACH_WAIT_S,
    DEFAULT_MAX_WRITERS,
    DEFAULT_PAGE_TOKENS,
    DEFAULT_PUT_TIMEOUT_S,
    HEADER_DTYPE,
    MAGIC,
    MAX_PAGE_TOKENS,
    MAX_TABLE,
    NO_PAGE,
    NO_SERIAL,
    OWNER_LEASE,
    VERSION,
    pow2_at_least,
    regions,
)
from routing_replay.store.put import PutTransaction
from routing_replay.store.read import WireBatch, read_settled
from routing_replay.store.refs import (
    Part,
    PutRequest,
    RoutingRef,
    as_list,
    check_distinct,
    check_store,
    resolve,
    sample_id_bytes,
    timeout_seconds,
)
from routing_replay.store.repair import reclaim_dead
from routing_replay.store.segment import Segment
from routing_replay.store.spill import page_file_bytes, spill_slots
from routing_replay.store.spill_dirs import (
    budget_for,
    make_spill_dir,
    remove_spill_dir,
    spill_root_of,
    sweep_spill_dirs,
)
from routing_replay.store.tables import initialise, uid_on_node
from routing_replay.store.verify import verify


def check_sizes(
    capacity_tokens: Any,
    page_tokens: Any,
    max_samples: Any = None,
    spill_budget: Any = None,
    max_writers: Any = DEFAULT_MAX_WRITERS,
    spill_dir: Any = None,
) -> tuple[int, int, int | None, int | None, int]:
    """Refuse sizes no store can have (what `create` takes; None: the default); returns them
    as Python ints (numpy integers would wrap in the header's arithmetic)."""
    sizes = []
    for what, value, hi in (
        ("capacity_tokens", capacity_tokens, MAX_TABLE * MAX_PAGE_TOKENS),
        ("page_tokens", page_tokens, MAX_PAGE_TOKENS),
        ("max_samples", max_samples, MAX_TABLE),
        ("spill_budget", spill_budget, 1 << 62),
        ("max_writers", max_writers, 1 << 20),
    ):
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or not 0 < value <= hi
        ):
            raise InvalidArgumentError(f"{what} must be an int in [1, {hi}], got {value!r}")
        sizes.append(None if value is None else int(value))
    capacity, page, samples, budget, writers = sizes
    num_pages = -(-capacity // page)
    if num_pages > MAX_TABLE:
        raise InvalidArgumentError(
            f"capacity_tokens={capacity} needs {num_pages} pages of {page} tokens; a store "
            f"holds at most {MAX_TABLE}: lower capacity_tokens, or raise page_tokens"
        )
    if budget is not None and spill_dir is None:
        raise InvalidArgumentError(
            f"spill_budget={budget} without a spill_dir: give the spill directory too, or "
            "leave spill_budget out"
        )
    return capacity, page, samples, budget, writers  # type: ignore[return-value]


def default_node_id() -> str:
    """This machine's id: host name plus boot id (Ray code passes Ray's node id instead)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}-{boot}"


class RoutingStore:
    """Per-node shared-memory store of routes: `create` by the owner, `attach` by others."""

    # -- life cycle -------------------------------------------------------------------

    def __init__(self, segment: Segment, put_timeout: float, users: list[int]) -> None:
        # `users`: the caller's list of the spill directory's lock (adopted, or taken into
        # it): if the making stops, the caller closes what the list and segment hold.
        self._core = StoreCore(segment, timeout_seconds(put_timeout, "put_timeout"), users)

    @property
    def layout(self) -> RoutingLayout:
        return self._core.layout

    @property
    def node_id(self) -> str:
        return self._core.node_id

    @property
    def page_tokens(self) -> int:
        return self._core.page_tokens

    @property
    def capacity_tokens(self) -> int:
        return self._core.capacity_tokens

    @property
    def put_timeout(self) -> float:
        """How long a put waits for room, spilling included (and every call for the lock, at
        least 1 s), in seconds."""
        return self._core.put_timeout

    @put_timeout.setter
    def put_timeout(self, seconds: float) -> None:
        self._core.put_timeout = timeout_seconds(seconds, "put_timeout")

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
        spill_dir: str | os.PathLike | None = None,
        spill_budget: int | None = None,
    ) -> RoutingStore:
        """Create and own the store `name` with room for `capacity_tokens` routed tokens.

        `spill_dir` (a local disk): when a put finds the store full, it moves samples, unread
        first, oldest put first, into files there instead of waiting (`store.spill`), up to
        `spill_budget` bytes (default: half the disk's free space); reads of spilled samples
        read their files. The store's files live in a directory of their own, removed with it.
        """
        timeout_seconds(put_timeout, "put_timeout")
        if not isinstance(layout, RoutingLayout):
            raise InvalidArgumentError(
                f"layout must be a RoutingLayout (e.g. RoutingLayout.from_hf_config(config)), "
                f"got {type(layout).__name__}"
            )
        if node_id is not None and not isinstance(node_id, str):
            raise InvalidArgumentError(f"node_id must be a str or None, got {node_id!r}")
        capacity_tokens, page_tokens, max_samples, spill_budget, max_writers = check_sizes(
            capacity_tokens, page_tokens, max_samples, spill_budget, max_writers, spill_dir
        )
        num_pages = -(-capacity_tokens // page_tokens)
        uid = int.from_bytes(os.urandom(8), "little") | 1
        spill_root, budget = "", 0
        if spill_dir is not None:
            spill_root = spill_root_of(spill_dir)
            page_file = page_file_bytes(layout, page_tokens)
            budget = budget_for(spill_root, name, page_file, spill_budget)
            sweep_spill_dirs(spill_root, dead_owners=False)  # left by a wiped /dev/shm
        slots = num_pages + 64 + spill_slots(layout, page_tokens, num_pages, budget)
        max_samples = max_samples or min(slots, MAX_TABLE)
        layout_json = layout.to_json().encode()
        node = (node_id or default_node_id()).encode()
        if len(layout_json) > HEADER_DTYPE["layout"].itemsize or len(node) > 128:
            raise InvalidArgumentError("layout or node_id too long for the store header")
        sizes = {
            "page_tokens": page_tokens,
            "num_pages": num_pages,
            "max_samples": max_samples,
            "page_buckets": pow2_at_least(num_pages),
            "sample_buckets": pow2_at_least(max_samples),
            "max_writers": max_writers,
        }
        offsets = regions(layout.bytes_per_token, **sizes)
        fields = {
            **sizes,
            "version": VERSION,
            "store_uid": uid,
            "spill_budget": budget,
            "owner_pid": os.getpid(),
            "created": time.time(),
            "node_id": node,
            "layout": layout_json,
        }
        seg = None
        spill_path, users = "", []  # the dir's users lock: the new handle adopts it
        try:
            seg = Segment.create(name, offsets["end"], OWNER_LEASE)
            if spill_root:  # after the segment: a directory whose store is gone is an orphan
                spill_path = make_spill_dir(spill_root, name, uid, users)
            initialise(seg.mmap, offsets, {**fields, "spill_dir": spill_path.encode()})
            return cls(seg, put_timeout, users)
        except BaseException as e:
            forget_frames(e)  # views of the half-made handle in the error: the mapping goes
            close_each(users)  # made or not, its lock on the directory goes
            if seg is not None:
                seg.discard()  # nothing half-made stays behind, no descriptor stays open
            remove_spill_dir(spill_path)
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
        seg, users = None, []  # what a stop at any line below gives back
        try:
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
                seg.abandon()
                if magic.strip(b"\x00") or time.monotonic() > deadline:
                    raise StoreUnavailableError(
                        f"{seg.path} is not a routing store (or not initialised): unlink it"
                    )
                time.sleep(0.01)
            store = cls(seg, put_timeout, users)
            if layout is not None and layout != store.layout:
                raise LayoutMismatchError(
                    f"store {name!r} holds routes for {store.layout}, not {layout}: attach "
                    "without a layout to use the store's, or use a store of this model"
                )
            return store
        except BaseException as e:
            forget_frames(e)  # views of the half-made handle in the error: the mapping goes
            store = None  # (and this frame's, which the error keeps)
            close_each(users)
            if seg is not None:
                seg.abandon()  # whatever views a traceback holds: no BufferError here
            raise

    @property
    def name(self) -> str:
        """The store's name (its segment is /dev/shm/rr_<name>)."""
        return self._core.segment.name

    @property
    def store_uid(self) -> int:
        """Random id of this store's incarnation (refs carry it)."""
        return self._core.tables.store_uid

    @property
    def spill_dir(self) -> str:
        """This store's own directory of spill files under the `spill_dir` it was created
        with ("": it does not spill)."""
        return self._core.spill.dir

    @property
    def is_owner(self) -> bool:
        """Whether this handle created the store (and so unlinks it)."""
        return self._core.segment.owner

    def close(self, timeout: float | None = None) -> None:
        """Unmap the store in this process; stored samples stay for other processes. Calls of
        other threads on this handle end first: a waiting one at once, a working one within
        `timeout` (default the put timeout), else StoreBusyError and the handle stays open."""
        core = self._core
        if inside_call(self, sys._getframe(1)):
            raise StoreBusyError(
                f"store {self.name!r}: close() inside a call of this handle on the same thread "
                "(a signal handler interrupting it?): the call would lose its memory under it. "
                "Close once the call returned (e.g. set a flag in the handler)"
            )
        with core.close_mutex:  # threads closing one handle at once: one after the other
            if core.segment.fd < 0:  # closed, or a close stopped after unmapping: finish it
                core.segment.close()
                core.spill.close()
                return
            wait = core.put_timeout if timeout is None else timeout_seconds(timeout, "timeout")
            deadline, failed = time.monotonic() + wait, None
            try:  # a close that ends before the unmap (StoreBusyError, Ctrl-C) leaves it usable
                core.closing = True  # calls starting now refuse; waiting ones end; working finish
                while others_in_flight(core.calls):
                    if time.monotonic() >= deadline:
                        raise StoreBusyError(
                            f"store {self.name!r} cannot be closed: another thread's call on this "
                            "handle is still running past the put timeout. Close it once that "
                            "call returned"
                        )
                    time.sleep(0.001)
                core.tables.release_views()
                core.segment.close()
            except BaseException as e:
                if core.segment.fd >= 0 and not core.segment.mmap.closed:
                    core.tables.map(core.segment.mmap)  # (its views again, if they went)
                    core.closing = False
                    if isinstance(e, BufferError):
                        raise BufferError(
                            f"store {self.name!r} cannot be closed: numpy arrays that view its "
                            "shared memory are still alive (get/read return copies; views come "
                            "from store internals, or an error a read_wire `ship` raised with one "
                            "in it). Drop them, then close again"
                        ) from None
                    raise
                if not isinstance(e, OSError):
                    raise  # (stopped past the unmap: the next close finishes it)
                failed = e  # EIO from a close: Linux has freed that descriptor all the same
            try:
                core.spill.close()
            except OSError as e:
                failed = failed or e
            if failed is not None:
                raise StoreUnavailableError(
                    f"store {self.name!r}: closing its files failed ({failed.strerror or failed}); "
                    "they are closed and nothing stored is lost, but check the device"
                ) from None

    def owner_alive(self) -> bool:
        """Whether the process that created this store still holds its owner lease."""
        return self._core.leases.owner_alive()

    def is_current(self) -> bool:
        """Whether this mapping is still the store at its name (not swept or recreated)."""
        return self._core.segment.is_current()

    def is_served(self) -> bool:
        """Whether the store is still in use: current, or removed from /dev/shm by anything
        but its owner (a wipe) while its owner holds it (and serves its samples). False for a
        closed handle. Puts into a store not served are refused."""
        return self._core.served()

    def unlink(self) -> None:
        """Remove the segment and its spill files (owner only); processes that mapped it keep
        their view of the segment."""
        if not self._core.segment.owner:
            raise RoutingReplayError(
                f"only the process that created store {self.name!r} unlinks it; call close()"
            )
        self._remove()

    def _remove(self) -> None:
        """The owner removes the store: marked first, under the lock, so that no put commits
        after (a put checks the mark under the lock at its commit)."""
        core, token = self._core, object()
        try:
            while True:  # counted as in flight, so that a close of another thread waits
                core.calls[token] = threading.current_thread()
                if not core.closing:
                    self._mark_removed()
                    break
                del core.calls[token]
                if core.segment.fd < 0 or core.segment.mmap.closed:  # closed (or a close
                    break  # stopped past its unmap): no put of this handle commits
                time.sleep(0.001)  # another thread's close: it ends or gives up
            core.segment.unlink()
            remove_spill_dir(core.spill.dir)
        finally:
            core.calls.pop(token, None)

    def _mark_removed(self) -> None:
        """Mark the store removed in its header (this handle is open and counted)."""
        core = self._core
        if inside_call(self, sys._getframe(2)):
            core.tables.hdr["unlinked"] = 1  # (a signal handler inside this handle's call,
            # which holds the lock or takes it later: its commit check sees the mark)
            return
        try:
            with core.lock.held("unlink", core.deadline(0)):
                core.tables.hdr["unlinked"] = 1
        except (RoutingReplayError, OSError):  # wedged or corrupt: marked all the same
            core.tables.hdr["unlinked"] = 1

    def __enter__(self) -> RoutingStore:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """The owner's block ends: the segment and its spill files go whatever happened; then
        the mapping closes (a failure to close never hides the block's own error)."""
        try:
            if self._core.segment.owner:
                self._remove()
        finally:
            try:
                self.close()
            except (BufferError, StoreBusyError):
                if exc_type is None:
                    raise

    def __reduce__(self) -> Any:
        """Refused (pickle, copy, Ray task arguments): a handle is this process's mapping."""
        raise InvalidArgumentError(
            f"a RoutingStore handle (store {self.name!r}) cannot be pickled or copied: it is "
            "this process's mapping of the store. Pass the store's name (and refs) and call "
            f"RoutingStore.attach({self.name!r}) on the other side"
        )

    def __repr__(self) -> str:
        return f"RoutingStore({self.name!r}, {self.layout}, capacity_tokens={self.capacity_tokens})"

    # -- repair -----------------------------------------------------------------------

    @store_call
    def reclaim(self) -> int:
        """Free pages reserved by writers that died mid-put (and this handle's orphans), and
        spill files no sample holds; returns how many pages were freed."""
        with self._core.lock.held("reclaim", self._core.deadline()) as hold:
            freed = reclaim_dead(self._core, hold, 0)
        self._core.spill.clean()
        return freed

    # -- writing ----------------------------------------------------------------------

    @store_call
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
        (default `put_timeout`) for room, and for the lock (at least 1 s), then raises
        `StoreFullError` (or `StoreBusyError`); on any error nothing is stored. A spilling
        store's put spills within the same `timeout`: at least one sample whatever the
        timeout (or it waits, at least 1 s, for another thread's spill), none once it has
        passed (what it spilled stays spilled). `policy_version` (the
        version of the policy that generated the sample, or `(first token, version)` spans
        for an episode whose turns came from several) rides on the ref, for staleness
        filters (`routing_replay.ray.split_stale`).
        """
        request = PutRequest(sample_id, routes, prompt_len, token_ids, policy_version)
        return PutTransaction(self._core, [request], timeout).run()[0]

    @store_call
    def put_many(
        self, requests: Iterable[PutRequest], *, timeout: float | None = None
    ) -> list[RoutingRef]:
        """Store several samples at once, all or none; their refs, in order.

        What puts a request's n completions, a rollout step's samples, or any group that
        must not be half-stored: one commit point for all of them, so an error (a full
        store, a duplicate id, a bad sample, a killed writer) leaves none stored. Samples of
        the put that share a prefix (GRPO's n samples of a prompt, with `token_ids`) store
        its full pages once. Waits for room, and spills, as `put` does, within `timeout`.
        """
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
            raise InvalidArgumentError(
                f"put_many takes a list of PutRequest objects, got {type(requests).__name__}"
            )
        return PutTransaction(self._core, list(requests), timeout).run()

    # -- releasing --------------------------------------------------------------------

    @store_call
    def release(self, sample_ids: Iterable[str | RoutingRef]) -> None:
        """Drop samples, all or none; pages no other sample shares become free.

        Ids and refs are resolved first: an unknown id, or a ref whose sample was released
        and put again since (`SampleReplacedError`), raises before anything is released.
        """
        refs = as_list(sample_ids)
        check_store(refs, self.name, self.store_uid, self.node_id)
        raw_ids = [sample_id_bytes(s) for s in refs]
        check_distinct(raw_ids, "release")
        core, files = self._core, []
        with core.lock.held("release", core.deadline()) as hold:
            found = resolve(core.samples, self.name, refs, raw_ids, "release")
            chains = [core.samples.chain(s)[0] for s in found]
            hold.write()
            core.samples.release(found)  # the commit point: then all go, even if cut short
            for raw_id, slot, chain in zip(raw_ids, found, chains, strict=True):
                files.append(core.spill.forget(slot))
                core.samples.remove(slot, raw_id, len(chain))
                freed = core.pages.dereference(chain)
                for p in freed.tolist():
                    core.prefix.unlink(p)
                core.pages.push(freed)
            core.samples.released()
        for path in files:
            if path is not None:  # after the commit: a stop here, or a disk that refuses (a
                with contextlib.suppress(OSError):  # read-only remount), leaves it to `clean`
                    os.unlink(path)

    # -- reading ----------------------------------------------------------------------

    @store_call
    def get(self, sample_id: str | RoutingRef, part: Part = "all") -> np.ndarray:
        """One sample's routes `[T, L, K]` (`layout.signed_dtype`, -1 missing), a copy."""
        return read_settled(self._core, [sample_id], lambda plan: plan.routes(part))

    @store_call
    def read(
        self,
        sample_ids: Iterable[str | RoutingRef],
        part: Part = "all",
        out: Any = None,
        *,
        ranges: Sequence[Any] | None = None,
    ) -> pa.RecordBatch:
        """Samples as one Arrow record batch (schema in `routing_replay.schema`), one copy.

        `ranges`: one entry per sample, a `(start, stop)` pair or a list of pairs (rising,
        apart) over the positions `part` selects; row i then holds exactly those tokens'
        routes and token ids, in order (`num_tokens` their count, `prompt_len` the prompt
        tokens among them; `(s, s)` gives an empty row), and only the pages under them are
        copied: a context-parallel rank reads its chunks, not the sample.
        `out`: optional writable, contiguous memory (a numpy array, a CPU torch tensor,
        pinned or not, a bytearray) of at least `sum_T * layout.bytes_per_token` bytes to
        copy into instead of a new buffer: a trainer that reuses it every step skips the
        page faults of fresh memory. The batch (and `to_torch` of it) are views of `out`:
        do not overwrite it while they are in use.
        """
        return read_settled(self._core, sample_ids, lambda plan: plan.batch(part, out, ranges))

    @store_call
    def read_wire(
        self,
        sample_ids: Iterable[str | RoutingRef],
        part: Part = "all",
        *,
        ranges: Sequence[Any] | None = None,
        ship: Callable[[WireBatch], Any] | None = None,
    ) -> Any:
        """`read` in the form to send to another node: the stored tokens its rows need, each
        once (samples that share pages share them), and the copies that rebuild the rows
        there; `.batch()` is then what `read` returns here, `.nbytes` what travels. With
        `ship` (e.g. `ray.put`), that function copies the stored runs where they travel
        from, while the read is valid, and its result is returned."""
        return read_settled(self._core, sample_ids, lambda plan: plan.wire(part, ranges, ship))

    @store_call
    def _put_marked(self, request: PutRequest, mark: int) -> RoutingRef:
        """`put` of one request whose slot carries `mark` (`Episode`: after a stop, `_put_of`
        tells whether its put committed, whoever else put that id meanwhile)."""
        return PutTransaction(self._core, [request], None, mark).run()[0]

    @store_call
    def _put_of(self, sample_id: str) -> tuple[int, int] | None:
        """(put serial, mark) of the sample stored under `sample_id`, None if none; its slot
        checked first (CorruptStoreError)."""
        raw_id, samples = sample_id_bytes(sample_id), self._core.samples
        with self._core.lock.held("serial", self._core.deadline()):
            slot = samples.find(raw_id)
            if slot == NO_PAGE:
                return None
            samples.chain(slot)
            return samples.serial(slot), samples.mark(slot)

    @store_call
    def __contains__(self, sample_id: object) -> bool:
        """Whether the id is stored (for a ref: whether the very put it names is, here)."""
        raw_id = sample_id_bytes(sample_id)
        ref = sample_id if isinstance(sample_id, RoutingRef) else None
        if ref is not None and (ref.store, ref.node_id) != (self.name, self.node_id):
            return False  # another store's put
        if ref is not None and ref.store_uid not in (0, self.store_uid):
            if uid_on_node(self.name) == ref.store_uid:
                check_store([sample_id], self.name, self.store_uid, self.node_id)  # raises: stale
            return False  # another store's put, or an earlier store's of this name
        with self._core.lock.held("contains", self._core.deadline()):
            slot = self._core.samples.find(raw_id)
            if slot == NO_PAGE:
                return False
            serial = getattr(sample_id, "serial", NO_SERIAL)
            return serial in (NO_SERIAL, self._core.samples.serial(slot))

    @store_call
    def __len__(self) -> int:
        return self._core.tables.counter("samples", self._core.tables.max_samples)

    @store_call
    def verify(self) -> None:
        """Check every invariant of the shared tables (`routing_replay.store.verify`); raise
        CorruptStoreError on the first break. For tests and `routing-replay ls --verify`."""
        verify(self._core)

    @store_call
    def stats(self) -> StoreStats:
        """Capacity, use and prefix-sharing savings (from the header's counters)."""
        return self._core.stats()


fork_bound(RoutingStore.create)  # (a child forked inside one would remove the store)
