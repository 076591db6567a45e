"""The page allocator: reserve, unreserve, reclaim and free pages, O(1) per page.

Free pages sit on a stack in the segment (`free_pages[:hdr.free_pages]`, the next page to
hand out on top). A reservation pops pages, bumps their generation (every reader and
share plan sees the reuse) and tags them with the writer's lease; publishing clears the
tag. Pages freed together are pushed so that they come back in ascending order: a fresh
or freshly emptied store hands out runs of consecutive pages, which are copied in one go.

Ownership is checked, never assumed: a page is the caller's only while its owner field,
owner generation and page generation are all what the caller's reservation recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from routing_replay.store.format import NO_OWNER, NO_PAGE
from routing_replay.store.lock import Hold
from routing_replay.store.tables import Tables

EMPTY = np.empty(0, dtype=np.int64)


@dataclass
class Reservation:
    """The pages one put reserved, with the generation each got: filled before the segment
    records them, so that an exception at any point leaves nothing the put cannot undo."""

    pages: np.ndarray = field(default_factory=lambda: EMPTY)
    gens: np.ndarray = field(default_factory=lambda: EMPTY.astype(np.uint32))
    lease: tuple[int, int] = (NO_PAGE, 0)
    published: bool = False


class PageAllocator:
    """Free-page stack, generations, refcounts and reservation tags of one store."""

    def __init__(self, tables: Tables) -> None:
        self._t = tables

    def free_count(self) -> int:
        """Pages on the free stack."""
        return self._t.counter("free_pages", self._t.num_pages)

    def reserve(self, hold: Hold, count: int, lease: tuple[int, int], into: Reservation) -> bool:
        """Take `count` free pages for `lease` into `into`; False if there are not that many."""
        t = self._t
        top = self.free_count()
        if top < count:
            return False
        pages = t.free_pages[top - count : top][::-1].astype(np.int64)
        if count and (
            pages.min() < 0
            or pages.max() >= t.num_pages
            or t.p_refcount[pages].any()
            or t.p_owner[pages].any()
        ):
            raise t.corrupt(f"the free-page stack holds a page in use or out of range: {pages}")
        gens = t.p_gen[pages] + np.uint32(1)
        into.pages, into.gens, into.lease, into.published = pages, gens, lease, False
        hold.write()
        t.hdr["free_pages"] = top - count
        t.p_owner[pages] = lease[0] + 1
        t.p_owner_gen[pages] = lease[1]
        t.p_gen[pages] = gens
        t.p_key[pages] = 0
        t.p_parent[pages] = NO_PAGE
        t.add("pages_reserved", count)
        return True

    def still_mine(self, resv: Reservation) -> np.ndarray:
        """Mask of `resv`'s pages that are still reserved by it."""
        t, pages = self._t, resv.pages
        return (
            (t.p_owner[pages] == resv.lease[0] + 1)
            & (t.p_owner_gen[pages] == resv.lease[1])
            & (t.p_gen[pages] == resv.gens)
            & (t.p_refcount[pages] == 0)
        )

    def unreserve(self, hold: Hold, resv: Reservation) -> int:
        """Give back what is still `resv`'s (nothing after publish); returns how many."""
        if resv.published or not len(resv.pages):
            return 0
        mine = resv.pages[self.still_mine(resv)]
        resv.pages = EMPTY
        if len(mine):
            hold.write()
            self._untag_and_push(mine)
        return len(mine)

    def reclaim_lease(self, hold: Hold, index: int, gen: int | None = None) -> int:
        """Free every page reserved under writer lease `index` (its holder is dead), or
        only those of its generation `gen` (orphans of a live holder with no put running)."""
        t = self._t
        tagged = (t.p_owner == index + 1) & (t.p_refcount == 0)
        if gen is not None:
            tagged &= t.p_owner_gen == gen
        dead = np.flatnonzero(tagged)
        if len(dead):
            hold.write()
            self._untag_and_push(dead)
        return len(dead)

    def _untag_and_push(self, pages: np.ndarray) -> None:
        t = self._t
        t.p_owner[pages] = NO_OWNER
        t.add("pages_reserved", -len(pages))
        self.push(pages)

    def push(self, pages: np.ndarray) -> None:
        """Put unreferenced, untagged pages back on the free stack (inside a write)."""
        t = self._t
        top = self.free_count()
        if top + len(pages) > t.num_pages:
            raise t.corrupt("the free-page stack would hold more pages than the store has")
        t.p_key[pages] = 0
        t.free_pages[top : top + len(pages)] = np.sort(pages)[::-1]
        t.hdr["free_pages"] = top + len(pages)

    def reference(self, chain: np.ndarray) -> None:
        """One more published sample holds every page of `chain` (inside a write)."""
        self._t.p_refcount[chain] += 1

    def dereference(self, chain: np.ndarray) -> np.ndarray:
        """One sample fewer holds `chain`; returns the pages no sample holds any more."""
        t = self._t
        t.p_refcount[chain] -= 1
        left = t.p_refcount[chain]
        if (left < 0).any():
            raise t.corrupt(f"a page of a released sample had refcount 0: {chain[left < 0]}")
        freed = chain[left == 0]
        t.add("pages_used", -len(freed))
        return freed

    def publish(self, resv: Reservation) -> None:
        """Clear the reservation tags of published pages (inside a write)."""
        t = self._t
        t.p_owner[resv.pages] = NO_OWNER
        t.add("pages_reserved", -len(resv.pages))
        t.add("pages_used", len(resv.pages))
        resv.published = True

    def rebuild(self, referenced: np.ndarray, keep_reserved: np.ndarray) -> None:
        """Repair: refcounts from the published chains; reservations of live writers kept;
        every other page free, on the stack in ascending order."""
        t = self._t
        t.p_refcount[:] = referenced
        reserved = (referenced == 0) & keep_reserved
        t.p_owner[~reserved] = NO_OWNER
        free = np.flatnonzero((referenced == 0) & ~reserved)
        t.p_key[free] = 0
        t.free_pages[: len(free)] = free[::-1]
        t.hdr["free_pages"] = len(free)
        t.hdr["pages_used"] = int((referenced > 0).sum())
        t.hdr["pages_reserved"] = int(reserved.sum())
