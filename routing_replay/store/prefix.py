"""The prefix index: published pages by (parent page, token key), and frozen share plans.

When token ids are given, every full page is keyed by a hash of its tokens and found
through its parent page, so samples with a common prefix (GRPO's n samples of a prompt,
the turns of an episode) share those pages. Sharing also needs the stored token ids and
the routes to be equal: a key only picks candidates.

A `SharePlan` is what a put decided to share: each page *with the generation it had when
its routes were compared*. Comparing happens without the lock, so the plan is checked
again under the lock at publish (`valid`): every page still at its recorded generation
and still published. A published page's routes only change after it is freed and
reserved again, which bumps its generation, so a valid plan shares exactly the routes
that were compared. Generations are recorded once, where the pages are compared, and
never re-read: that is what makes sharing a changed page impossible.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from routing_replay.store.format import NO_PAGE
from routing_replay.store.libc import same_memory
from routing_replay.store.tables import Tables, checked_index, unlink_from_chain

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SharePlan:
    """Pages a put will share, in chain order, each with the generation it was compared at."""

    pages: tuple[int, ...] = ()
    gens: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.pages)

    def prefix(self, n: int) -> SharePlan:
        """The first `n` pages of the plan, with their recorded generations."""
        return SharePlan(self.pages[:n], self.gens[:n])


@functools.cache
def _key_multipliers(page_tokens: int) -> np.ndarray:
    """Fixed odd 64-bit multipliers, one per token position (the same in every process)."""
    rng = np.random.default_rng([0x5EED, page_tokens])
    return rng.integers(1, 2**63, page_tokens, dtype=np.uint64) | np.uint64(1)


def page_keys(tokens_NP: np.ndarray) -> list[int]:
    """A 64-bit key per row of token ids `[N, P]` (never 0: 0 means "not shareable").

    A multiply-add hash with fixed odd multipliers, then a mixer, all vectorised: keys
    only pick candidates, sharing also needs equal tokens and routes, so a collision can
    cost a missed share but never changes what is read back.
    """
    mult_P = _key_multipliers(tokens_NP.shape[1])
    with np.errstate(over="ignore"):
        h_N = (tokens_NP.astype(np.uint64, copy=False) * mult_P).sum(axis=1, dtype=np.uint64)
        h_N ^= h_N >> np.uint64(31)
        h_N *= np.uint64(0xBF58476D1CE4E5B9)
        h_N ^= h_N >> np.uint64(29)
    return (h_N | np.uint64(1)).tolist()


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of the same dtype and size hold the same bytes."""
    if a.size != b.size or a.dtype != b.dtype:
        return False
    if a.flags.c_contiguous and b.flags.c_contiguous:
        return a.nbytes == 0 or same_memory(a.ctypes.data, b.ctypes.data, a.nbytes)
    return bool(np.array_equal(a.reshape(-1), b.reshape(-1)))


def runs(pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(index in `pages`, first page, count) for each run of consecutive page numbers."""
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            yield start, pages[start], i - start
            start = i


class PrefixIndex:
    """Key buckets over the published, shareable pages of one store."""

    def __init__(self, tables: Tables) -> None:
        self._t = tables

    def _bucket(self, parent: int, key: int) -> int:
        return ((key ^ ((parent + 2) * _GOLDEN)) & _MASK64) % len(self._t.page_heads)

    def _walk(self, parent: int, key: int) -> Iterator[int]:
        """Published pages keyed (parent, key), bucket order (bounded; under the lock)."""
        t = self._t
        p = checked_index(t, t.page_heads[self._bucket(parent, key)], t.num_pages, "page bucket")
        for _ in range(t.num_pages + 1):  # every page in one chain, then its end
            if p == NO_PAGE:
                return
            if t.p_key[p] == key and t.p_parent[p] == parent and t.p_refcount[p] > 0:
                yield p
            p = checked_index(t, t.p_next[p], t.num_pages, f"page {p}'s next")
        raise t.corrupt("a page bucket chain loops")

    def candidates(self, keys: Sequence[int]) -> SharePlan:
        """The first published page of each successive key, generations as of now (under
        the lock): what to compare without it."""
        pages: list[int] = []
        for key in keys:
            page = next(self._walk(pages[-1] if pages else NO_PAGE, key), NO_PAGE)
            if page == NO_PAGE:
                break
            pages.append(page)
        return SharePlan(tuple(pages), tuple(self._t.p_gen[pages].tolist()))

    def _same(self, first: int, count: int, rows: np.ndarray, tokens: np.ndarray) -> bool:
        """Whether pages [first, first + count) hold exactly these tokens and routes."""
        t = self._t
        return same_bytes(t.tokens[first : first + count], tokens) and same_bytes(
            t.data[first : first + count], rows
        )

    def equal_prefix(self, plan: SharePlan, rows: np.ndarray, tokens: np.ndarray) -> int:
        """How many leading pages of `plan` hold tokens equal to `tokens` (int32) and routes
        byte-equal to `rows` (stored dtype, `[T, L, K]`): one comparison per run of
        consecutive pages. Needs no lock: a page that changes meanwhile has a new
        generation, and `valid` refuses the plan."""
        P = self._t.page_tokens
        for i, first, count in runs(plan.pages):
            span = slice(i * P, (i + count) * P)
            if not self._same(first, count, rows[span], tokens[span]):
                differs = (
                    j
                    for j in range(count)
                    if not self._same(
                        first + j,
                        1,
                        rows[(i + j) * P : (i + j + 1) * P],
                        tokens[(i + j) * P : (i + j + 1) * P],
                    )
                )
                return i + next(differs, 0)  # 0: the run changed under us, share none of it
        return len(plan)

    def twins(
        self, plan: SharePlan, keys: Sequence[int], rows: np.ndarray, tokens: np.ndarray
    ) -> SharePlan:
        """Extend `plan` page by page with published pages of equal keys, tokens and routes,
        compared now (under the lock): the slow path, when a key's first page was routed
        differently. Pages of `plan` keep the generations they were compared at."""
        t, P = self._t, self._t.page_tokens
        if not self.valid(plan):
            return SharePlan()  # changed since its compare: start over from nothing
        pages, gens = list(plan.pages), list(plan.gens)
        for i in range(len(pages), len(keys)):
            span = slice(i * P, (i + 1) * P)
            parent = pages[-1] if pages else NO_PAGE
            page = next(
                (
                    p
                    for p in self._walk(parent, keys[i])
                    if self._same(p, 1, rows[span], tokens[span])
                ),
                NO_PAGE,
            )
            if page == NO_PAGE:
                break
            pages.append(page)
            gens.append(int(t.p_gen[page]))
        return SharePlan(tuple(pages), tuple(gens))

    def valid(self, plan: SharePlan) -> bool:
        """Whether every page of `plan` is still published at its recorded generation."""
        if not plan.pages:
            return True
        t, pages = self._t, list(plan.pages)
        return bool(
            np.array_equal(t.p_gen[pages], np.asarray(plan.gens, dtype=np.uint32))
            and (t.p_refcount[pages] > 0).all()
        )

    def link(self, page: int, parent: int, key: int) -> None:
        """Make a newly published page findable by (parent, key) (inside a write)."""
        t = self._t
        t.p_key[page] = key
        b = self._bucket(parent, key)
        t.p_next[page] = t.page_heads[b]
        t.page_heads[b] = page

    def link_many(self, pages: list[int], parents: list[int], keys: list[int]) -> None:
        """`link` for several new pages (inside a write): one vectorised pass, the buckets
        computed as `_bucket` does, unless two of them fall in one bucket."""
        t = self._t
        keys_N = np.array(keys, dtype=np.uint64)
        with np.errstate(over="ignore"):  # (the product wraps, as `& _MASK64` cuts it)
            mixed_N = (np.array(parents, dtype=np.int64) + 2).astype(np.uint64)
            mixed_N *= np.uint64(_GOLDEN)
        buckets_N = ((keys_N ^ mixed_N) % np.uint64(len(t.page_heads))).astype(np.int64)
        if len(np.unique(buckets_N)) < len(buckets_N):
            for page, parent, key in zip(pages, parents, keys, strict=True):
                self.link(page, parent, key)
            return
        t.p_key[pages] = keys_N
        t.p_next[pages] = t.page_heads[buckets_N]
        t.page_heads[buckets_N] = pages

    def unlink(self, page: int) -> None:
        """Remove a page that no sample holds any more from its bucket (inside a write)."""
        t = self._t
        key = int(t.p_key[page])
        if not key:
            return
        b = self._bucket(int(t.p_parent[page]), key)
        unlink_from_chain(t, t.page_heads, t.p_next, b, page, "page")
        t.p_key[page] = 0

    def findable(self, page: int) -> bool:
        """Whether a published keyed page is in its bucket (for verify)."""
        t = self._t
        return page in self._walk(int(t.p_parent[page]), int(t.p_key[page]))

    def rebuild(self, referenced: np.ndarray) -> None:
        """Repair: buckets of the published keyed pages; keys of unreferenced pages dropped."""
        t = self._t
        t.page_heads[:] = NO_PAGE
        t.p_key[referenced == 0] = 0
        for p in np.flatnonzero((referenced > 0) & (t.p_key != 0)).tolist():
            b = self._bucket(int(t.p_parent[p]), int(t.p_key[p]))
            t.p_next[p] = t.page_heads[b]
            t.page_heads[b] = p
