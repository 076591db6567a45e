"""Typed views of one mapped store segment, with the bounds every index is checked against.

Nothing read from shared memory is trusted: another process may have died half-way, or a
stray write may have flipped a byte. Header values are checked against the segment's size
before any view is made; indices read from the tables are checked by the objects that walk
them (`checked_index`, and bounded walks), and a break raises `CorruptStoreError`.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import numpy as np
import pyarrow as pa

from routing_replay.errors import CorruptStoreError, StoreUnavailableError
from routing_replay.layout import RoutingLayout
from routing_replay.store.files import open_file
from routing_replay.store.format import (
    FIRST_SERIAL,
    HEADER_DTYPE,
    LEASE_DTYPE,
    MAGIC,
    MAX_PAGE_TOKENS,
    MAX_TABLE,
    NO_PAGE,
    PAGE_DTYPE,
    SLOT_DTYPE,
    TOKEN_DTYPE,
    VERSION,
    regions,
)
from routing_replay.store.segment import segment_path

# What parsing a header's layout JSON and node id may raise (UnicodeDecodeError and
# JSONDecodeError are ValueErrors; Infinity in an int field overflows; deep nesting recurses).
UNREADABLE = (ValueError, KeyError, TypeError, OverflowError, RecursionError)


def view(buf: Any, dtype: Any, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """A numpy view of `buf` that holds a buffer export: the mapping cannot be closed under it.

    (`np.ndarray(buffer=...)` does not hold one, so closing the mmap would leave it
    dangling, and reading it would crash the process.)
    """
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)


def uid_on_node(name: str) -> int | None:
    """The incarnation (`store_uid`) of store `name` in this node's shared memory: None if
    there is no such segment, 0 if one is being created or cannot be read."""
    try:
        file = open_file(segment_path(name), os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    with file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return 0  # a FIFO or device planted under the name: not read
        try:
            raw = os.pread(file.fileno(), HEADER_DTYPE.itemsize, 0)
        except OSError:
            return 0
    if len(raw) < HEADER_DTYPE.itemsize or raw[:8] != MAGIC:
        return 0
    return int(np.frombuffer(raw, HEADER_DTYPE)[0]["store_uid"])


def lent_rows(tables: Tables, lent: memoryview) -> tuple[np.ndarray, np.ndarray]:
    """The stored ids `[pages * P, L * K]` and token ids `[pages * P, 1]` as views of `lent`,
    a memoryview of the segment made for one loan: once `lent.release()` succeeds, no view
    of them (nor any view made from one) is alive anywhere."""
    values = tables.layout.values_per_token
    rows = tables.num_pages * tables.page_tokens
    held = pa.py_buffer(lent)  # holds an export of `lent` (numpy's frombuffer would not)
    data = np.frombuffer(held, tables.layout.dtype, rows * values, tables.offsets["data"])
    tokens = np.frombuffer(held, TOKEN_DTYPE, rows, tables.offsets["tokens"])
    return data.reshape(rows, values), tokens.reshape(rows, 1)


def corrupt_error(store: str, what: str) -> CorruptStoreError:
    """The error for a store whose tables break an invariant: what broke, and what to do."""
    return CorruptStoreError(
        f"store {store!r} is corrupt ({what}): its routes cannot be trusted. Stop its "
        "writers, create a new store, and re-run the rollouts it held; the old segment is "
        "removed by its owner's store.unlink(), or by `routing-replay sweep` once its owner "
        "has exited"
    )


class Tables:
    """Header, page table, buckets, stacks, slots, leases, page tokens and data of a segment."""

    def __init__(self, name: str, buf: Any) -> None:
        self.name = name
        self.map(buf)

    def map(self, buf: Any) -> None:
        """Check the header against the segment and make every view (again, after a failed
        close).

        The checks read a copy of the header: a view made before a check fails would stay
        exported by the traceback, and the segment could not be closed (BufferError).
        """
        name = self.name
        if len(buf) < HEADER_DTYPE.itemsize or bytes(buf[:8]) != MAGIC:
            raise StoreUnavailableError(f"store {name!r} is not a routing store")
        hdr = np.frombuffer(bytes(buf[: HEADER_DTYPE.itemsize]), HEADER_DTYPE)[0]
        version = int(hdr["version"])
        if version != VERSION:
            raise StoreUnavailableError(
                f"store {name!r} has format version {version}, this routing_replay reads "
                f"{VERSION}: it was made by another version. Use that version, or remove it "
                "once no process uses it"
            )
        try:
            layout = RoutingLayout.from_json(hdr["layout"].item())
            node_id = hdr["node_id"].item().decode()
        except UNREADABLE as e:
            raise corrupt_error(name, f"header layout or node id unreadable: {e}") from None
        try:
            spill_dir = hdr["spill_dir"].item().decode()
        except UNREADABLE as e:
            raise corrupt_error(name, f"header spill dir unreadable: {e}") from None
        spill_budget = int(hdr["spill_budget"])
        if spill_budget < 0 or bool(spill_budget) != bool(spill_dir):
            raise corrupt_error(name, f"header spill budget {spill_budget} for dir {spill_dir!r}")
        sizes = {}
        for field, lo, hi in (
            ("page_tokens", 1, MAX_PAGE_TOKENS),
            ("num_pages", 1, MAX_TABLE),
            ("max_samples", 1, MAX_TABLE),
            ("page_buckets", 2, MAX_TABLE),
            ("sample_buckets", 2, MAX_TABLE),
            ("max_writers", 1, 1 << 20),
        ):
            value = int(hdr[field])
            if not lo <= value <= hi:
                raise corrupt_error(name, f"header {field}={value} outside [{lo}, {hi}]")
            sizes[field] = value
        offsets = regions(layout.bytes_per_token, **sizes)
        if offsets["end"] != len(buf):
            raise corrupt_error(
                name, f"segment is {len(buf)} bytes, its header describes {offsets['end']}"
            )
        self.layout, self.node_id = layout, node_id
        self.spill_dir, self.spill_budget = spill_dir, spill_budget
        self.hdr = view(buf, HEADER_DTYPE, (), 0)
        self.page_tokens = sizes["page_tokens"]
        self.num_pages = sizes["num_pages"]
        self.max_samples = sizes["max_samples"]
        self.max_writers = sizes["max_writers"]
        self.store_uid = int(hdr["store_uid"])
        self.pages = view(buf, PAGE_DTYPE, (self.num_pages,), offsets["pages"])
        self.page_heads = view(buf, "<i4", (sizes["page_buckets"],), offsets["page_heads"])
        self.free_pages = view(buf, "<i4", (self.num_pages,), offsets["free_pages"])
        self.slots = view(buf, SLOT_DTYPE, (self.max_samples,), offsets["slots"])
        self.sample_heads = view(buf, "<i4", (sizes["sample_buckets"],), offsets["sample_heads"])
        self.free_slots = view(buf, "<i4", (self.max_samples,), offsets["free_slots"])
        self.leases = view(buf, LEASE_DTYPE, (self.max_writers,), offsets["leases"])
        self.tokens = view(buf, TOKEN_DTYPE, (self.num_pages, self.page_tokens), offsets["tokens"])
        page_values = self.page_tokens * self.layout.values_per_token
        self.data = view(buf, self.layout.dtype, (self.num_pages, page_values), offsets["data"])
        self.offsets = {f: offsets[f] for f in ("data", "tokens")}  # (`lent_rows`)
        # One view per field, made once: field lookups are on every put's path.
        for field in PAGE_DTYPE.names:
            setattr(self, f"p_{field}", self.pages[field])
        for field in SLOT_DTYPE.names:
            setattr(self, f"s_{field}", self.slots[field])

    # -- typed field views (set in __init__) -------------------------------------------

    p_refcount: np.ndarray
    p_owner: np.ndarray
    p_parent: np.ndarray
    p_next: np.ndarray
    p_gen: np.ndarray
    p_owner_gen: np.ndarray
    p_key: np.ndarray
    s_state: np.ndarray
    s_next: np.ndarray
    s_num_tokens: np.ndarray
    s_prompt_len: np.ndarray
    s_last_page: np.ndarray
    s_num_pages: np.ndarray
    s_check: np.ndarray
    s_digest: np.ndarray
    s_serial: np.ndarray
    s_mark: np.ndarray
    s_sample_id: np.ndarray

    def corrupt(self, what: str) -> CorruptStoreError:
        """`corrupt_error` for this store."""
        return corrupt_error(self.name, what)

    def counter(self, field: str, hi: int) -> int:
        """A header counter, checked to lie in [0, hi]."""
        value = int(self.hdr[field])
        if not 0 <= value <= hi:
            raise self.corrupt(f"header {field}={value} outside [0, {hi}]")
        return value

    def add(self, field: str, delta: int) -> None:
        """Add to a header counter (under the lock, inside a write); it stays in [0, 2**62]."""
        value = int(self.hdr[field]) + delta
        if not 0 <= value <= 1 << 62:
            raise self.corrupt(
                f"header {field}={int(self.hdr[field])}, {delta:+d} leaves it negative or huge"
            )
        self.hdr[field] = value

    def timed(self, kind: str, ns: int) -> None:
        """Count one put or read (`kind`) of `ns` nanoseconds (under the lock); wraps at 2**64."""
        self.hdr[kind + "s"] = (int(self.hdr[kind + "s"]) + 1) % (1 << 64)
        self.hdr[kind + "_ns"] = (int(self.hdr[kind + "_ns"]) + max(ns, 0)) % (1 << 64)

    @property
    def dirty(self) -> bool:
        """Whether a locker died (or raised) half-way through changing the tables."""
        return bool(self.hdr["dirty"])

    def set_dirty(self, value: bool) -> None:
        """Mark the tables as being changed (True) or consistent (False)."""
        self.hdr["dirty"] = int(value)

    def mark_spill_garbage(self) -> None:
        """Note (under the lock) that spill files may be left that no slot names: the next
        spill after `CLEAN_EVERY_S` cleans. A counter, so that a clean clears only what it
        judged."""
        self.hdr["spill_garbage"] = int(self.hdr["spill_garbage"]) % 0xFFFFFFFF + 1

    def release_views(self) -> None:
        """Drop every view of the mapping, so that it can be closed."""
        for attr in [a for a in self.__dict__ if a.startswith(("p_", "s_"))] + [
            "hdr",
            "pages",
            "page_heads",
            "free_pages",
            "slots",
            "sample_heads",
            "free_slots",
            "leases",
            "tokens",
            "data",
        ]:
            self.__dict__.pop(attr, None)


def checked_index(tables: Tables, value: int, size: int, what: str) -> int:
    """`value` as an index into a table of `size`, or NO_PAGE; corrupt otherwise."""
    value = int(value)
    if value != NO_PAGE and not 0 <= value < size:
        raise tables.corrupt(f"{what} {value} outside [0, {size})")
    return value


def unlink_from_chain(
    tables: Tables, heads: np.ndarray, nexts: np.ndarray, bucket: int, item: int, what: str
) -> None:
    """Remove `item` from the chain `heads[bucket] -> nexts[...]` (a bounded walk; inside a
    write); `what` names the chain's items in a corruption error ("page", "slot")."""
    size = len(nexts)
    cur = checked_index(tables, heads[bucket], size, f"{what} bucket")
    prev = NO_PAGE
    for _ in range(size):
        if cur in (NO_PAGE, item):
            break
        prev, cur = cur, checked_index(tables, nexts[cur], size, f"{what} {cur}'s next")
    if cur == item:
        if prev == NO_PAGE:
            heads[bucket] = nexts[cur]
        else:
            nexts[prev] = nexts[cur]
    nexts[item] = NO_PAGE


def header_info(raw: bytes) -> dict[str, Any] | None:
    """Owner pid, node id and layout JSON of a segment's header bytes (None: not a store)."""
    if len(raw) < HEADER_DTYPE.itemsize or raw[:8] != MAGIC:
        return None
    hdr = np.frombuffer(raw[: HEADER_DTYPE.itemsize], HEADER_DTYPE)[0]
    info: dict[str, Any] = {"version": int(hdr["version"]), "owner_pid": int(hdr["owner_pid"])}
    try:
        info["node_id"] = hdr["node_id"].decode()
        info["layout"] = RoutingLayout.from_json(hdr["layout"])
        info["spill_dir"] = hdr["spill_dir"].decode() if "spill_dir" in hdr.dtype.names else ""
    except UNREADABLE:
        info["node_id"], info["layout"], info["spill_dir"] = "", None, ""
    return info


def initialise(buf: Any, offsets: dict[str, int], fields: dict[str, Any]) -> None:
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
    hdr["next_serial"] = FIRST_SERIAL
    hdr["magic"] = MAGIC  # attachers wait for it
