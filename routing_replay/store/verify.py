"""`verify`: every invariant of a store's shared tables, checked at once (tests, `ls --verify`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from routing_replay.store.format import (
    FIRST_SERIAL,
    FREE,
    NO_PAGE,
    NO_SERIAL,
    NOT_SPILLED,
    PUBLISHED,
)
from routing_replay.store.segment import untrusted_reason
from routing_replay.store.spill import file_bytes, spill_files, spill_name
from routing_replay.store.spill_dirs import FILE_MODE

if TYPE_CHECKING:
    from routing_replay.store.core import StoreCore


def verify(core: StoreCore) -> None:
    """Check every invariant of `store`'s tables; raise CorruptStoreError on the first break.

    Every published sample passes its checksum, is findable by id, and holds a committed
    serial, each once; refcounts equal the references of published chains; a page is
    referenced, reserved by a writer (a dead one's until reclaimed), or on the free stack
    (exactly once); shareable pages are findable in their bucket and free pages carry no
    key; free slots are on the free-slot stack; a spilled sample holds no pages and its
    file is there, whole; a spill file no sample needs is marked for cleaning; the header
    counters agree.

    The spill directory is listed, and its files' sizes read, before taking the lock (a
    store call waits for none of that); under it, only what the listing and the tables
    disagree on is looked at again: a spilled sample's file the listing missed or saw with
    another size (a spill that committed meanwhile), a file no sample names (a release
    that removed it meanwhile). A file a slot names is never removed or rewritten while the
    slot names it, so one the listing saw whole is there under the lock.
    """
    t, samples, prefix = core.tables, core.samples, core.prefix
    names = spill_files(core.spill.dir) if core.spill.enabled else []
    sizes = {name: _size(os.path.join(core.spill.dir, name)) for name, _ in names}
    with core.lock.held("verify", core.deadline()):
        published = samples.published()
        chains = []
        for s in published.tolist():
            chains.append(samples.chain(s)[0])
            if samples.find(samples.sample_id(s)) != s:
                raise t.corrupt(f"slot {s} is not findable by its sample id")
        serials = t.s_serial[published]
        next_serial = samples.next_serial()
        if len(serials) and (serials.min() < FIRST_SERIAL or serials.max() >= next_serial):
            raise t.corrupt(f"a published serial lies outside [{FIRST_SERIAL}, {next_serial})")
        if len(np.unique(serials)) != len(serials):
            raise t.corrupt("two published samples hold the same put serial")
        if int(t.hdr["releasing"]) or not np.isin(t.s_state, (FREE, PUBLISHED)).all():
            raise t.corrupt("a release was left half-done outside its lock holding")
        if (t.s_serial[t.s_state != PUBLISHED] != NO_SERIAL).any():
            raise t.corrupt("a free slot still holds a put serial")
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
            if not prefix.findable(p):
                raise t.corrupt(f"shareable page {p} is not in its bucket")
        if (t.p_key[referenced == 0] != 0).any():
            raise t.corrupt("a free page still carries a sharing key")
        top = t.counter("free_slots", t.max_samples)
        if not np.array_equal(np.sort(t.free_slots[:top]), np.flatnonzero(t.s_state == 0)):
            raise t.corrupt("the free-slot stack is not exactly the free slots")
        spilled = published[t.s_spill[published] != NOT_SPILLED]
        spilled_bytes = 0
        for s in spilled.tolist():
            name = spill_name(int(t.s_serial[s]), int(t.s_spill[s]))
            path = os.path.join(core.spill.dir, name)
            size = file_bytes(
                core.layout, t.page_tokens, int(t.s_num_tokens[s]), int(t.s_digest[s])
            )
            if t.s_num_pages[s] != 0 or t.s_last_page[s] != NO_PAGE:
                raise t.corrupt(f"spilled slot {s} still names pages")
            if sizes.get(name) != size and _size(path) != size:  # listed otherwise: again
                raise t.corrupt(
                    f"spilled slot {s}: {path} is missing, not a regular file of this user with "
                    f"mode 0600, or not {size} bytes"
                )
            spilled_bytes += size
        if (t.s_spill[t.s_state != PUBLISHED] != NOT_SPILLED).any():
            raise t.corrupt("a free slot still names a spill file")
        if core.spill.enabled and not int(t.hdr["spill_garbage"]):
            stray = [  # of the listing, those still there (not removed by a release since)
                name
                for name in core.spill.unneeded(names, leased=True)
                if os.path.lexists(os.path.join(core.spill.dir, name))
            ]
            if stray:
                raise t.corrupt(f"spill files no sample needs, and none marked to clean: {stray}")
        counters = {
            "spilled": len(spilled),
            "spilled_bytes": spilled_bytes,
            "samples": len(published),
            "tokens": int(t.s_num_tokens[published].astype(np.int64).sum()),
            "pages_used": int((referenced > 0).sum()),
            "pages_reserved": int(reserved.sum()),
            "pages_referenced": len(flat),
        }
        for field, value in counters.items():
            if int(t.hdr[field]) != value:
                raise t.corrupt(f"header {field}={int(t.hdr[field])}, the tables say {value}")


def _size(path: str) -> int | None:
    """The size of the spill file at `path`; None if there is none that reads would take (a
    regular file, not a link, this user's, mode 0600)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return None if untrusted_reason(st, FILE_MODE) else st.st_size
