"""The put protocol: one `PutTransaction` stores one sample, or many, whole or not at all.
(Over 400 lines by design: one transaction, its steps in the order they run.)

A put, top to bottom:

1. outside the lock, check and convert every sample (`_Sample`) and find which full pages
   of the batch's samples hold equal tokens and routes (`_batch_twins`): GRPO's n samples
   of a prompt share their prompt pages within one put;
2. lock, refuse ids already stored, find each sample's shareable published prefix
   (`PrefixIndex.candidates`), unlock;
3. compare those pages' routes without the lock: a frozen `SharePlan` per sample;
4. lock, extend plans whose first candidate differed (twins), lay out every chain (published
   pages, pages shared with an earlier sample of the batch, new pages), take this writer's
   lease and reserve the new pages, unlock;
5. copy and check the new rows into the reserved pages without the lock;
6. lock, check every plan is still valid and the pages still ours, publish every sample,
   then raise `next_serial` past their serials: the one commit point of the batch. Unlock.

A plan found invalid at 6 (a shared page was released meanwhile) starts the put over;
any error leaves nothing stored and gives the reserved pages back. Too few free pages at 4:
the put spills samples to disk (a store with `spill_dir`) or waits for releases, then tries
again, both within its timeout: it spills at least one sample whatever its timeout (unless
another thread of the handle is spilling: it waits for that one, at least 1 s), and starts
no spill once its timeout has passed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from routing_replay.errors import (
    CorruptStoreError,
    DuplicateSampleError,
    InvalidArgumentError,
    InvalidRoutesError,
    StoreFullError,
    StoreUnavailableError,
)
from routing_replay.store.calls import closed_error
from routing_replay.store.format import (
    CHECK_CHUNK_BYTES,
    MIN_LOCK_WAIT_S,
    NO_DIGEST,
    NO_MARK,
    NO_PAGE,
    TOKEN_DTYPE,
)
from routing_replay.store.lock import Hold
from routing_replay.store.pages import Reservation
from routing_replay.store.prefix import SharePlan, page_keys, runs, same_bytes
from routing_replay.store.refs import (
    PutRequest,
    RoutingRef,
    check_distinct,
    policy_spans,
    prompt_len_value,
    sample_id_bytes,
    timeout_seconds,
)
from routing_replay.store.repair import reclaim_dead
from routing_replay.store.samples import token_digests
from routing_replay.validate import host_array

if TYPE_CHECKING:
    from routing_replay.store.core import StoreCore, StoreStats


NO_PLAN = SharePlan()


@dataclass(slots=True)
class _Sample:
    """One sample of a put, checked and converted, with its chain once laid out."""

    raw_id: bytes
    rows: np.ndarray  # [T, L, K] MoE layers, the caller's integer dtype (ids checked at copy)
    tokens: np.ndarray | None  # int32 [T]
    keys: list[int]  # one per full page (none without token ids)
    keyed: np.ndarray  # rows of the full pages in the stored dtype: what sharing compares
    prompt_len: int
    digest: int
    versions: tuple[tuple[int, int], ...]
    num_pages: int
    # Laid out under the reserve lock: the sample's published plan, then its chain: the
    # `shared` pages (published ones, then pages of an earlier sample of the put, "local":
    # -2 - their index in the put's reservation), then `num_pages - first_new` new pages of
    # its own, reservation indices `local_base` on.
    plan: SharePlan = NO_PLAN
    equal: int = 0  # leading pages of the plan whose routes compared equal
    shared: list[int] | tuple[()] = ()
    local_base: int = 0

    @property
    def first_new(self) -> int:
        """Chain positions from here on are this sample's own new pages."""
        return len(self.shared)

    @property
    def num_tokens(self) -> int:
        return len(self.rows)


def sample_id_str(sample: _Sample) -> str:
    """A sample's id as text, for messages."""
    return sample.raw_id.decode()


def _local(index: int) -> int:
    """The chain entry of the put's `index`-th reserved page, before it has a page number."""
    return -2 - index


class PutTransaction:
    """One put of one or more samples into a store: all of them are stored, or none."""

    def __init__(
        self,
        core: StoreCore,
        requests: Sequence[PutRequest],
        timeout: float | None,
        mark: int = NO_MARK,
    ) -> None:
        self.core = core
        self.mark = mark  # every slot's (`RoutingStore._put_marked`)
        self.timeout = core.put_timeout if timeout is None else timeout_seconds(timeout)
        if not requests:
            raise InvalidArgumentError("put_many needs at least one PutRequest")
        self.samples = [self._prepare(r) for r in requests]
        self._key()
        t = core.tables
        if len(self.samples) == 1:
            self._twin = [[0] * len(self.samples[0].keys)]
            pages = self.samples[0].num_pages
        else:
            check_distinct([s.raw_id for s in self.samples], "put_many")
            self._batch_twins()
            pages = sum(  # at most: pages no earlier sample of the put holds too
                sum(1 for i, twin in enumerate(self._twin[k]) if twin == k)
                + s.num_pages
                - len(s.keys)
                for k, s in enumerate(self.samples)
            )
        if pages > t.num_pages or len(self.samples) > t.max_samples:
            what = (
                f"sample {sample_id_str(self.samples[0])!r} has {self.samples[0].num_tokens} tokens"
                if len(self.samples) == 1
                else f"a put of {len(self.samples)} samples needs up to {pages} pages"
            )
            raise StoreFullError(
                f"{what}, but store {core.name!r} holds at most {core.capacity_tokens} "
                f"tokens ({t.num_pages} pages of {t.page_tokens}) and {t.max_samples} samples "
                "even when empty: create it with a larger capacity_tokens (and max_samples), "
                "or put fewer samples at once"
            )

    # -- 1. checked samples, and the pages they share among themselves ------------------

    def _prepare(self, request: PutRequest) -> _Sample:
        if not isinstance(request, PutRequest):
            raise InvalidArgumentError(
                f"put_many takes PutRequest objects, got {type(request).__name__}: "
                "PutRequest(sample_id, routes, prompt_len=, token_ids=, policy_version=)"
            )
        core, P = self.core, self.core.page_tokens
        sample_id = request.sample_id
        raw_id = sample_id_bytes(sample_id)
        rows = core.layout.select_moe(request.routes)  # ids are checked at the copy, in cache
        num_tokens = len(rows)
        if num_tokens == 0:
            raise InvalidRoutesError(f"sample {sample_id!r} has no routed tokens")
        prompt_len = prompt_len_value(request.prompt_len, num_tokens, sample_id)
        versions = policy_spans(request.policy_version, num_tokens, sample_id)
        tokens = None
        if request.token_ids is not None:
            tokens = _token_ids(request.token_ids, num_tokens, sample_id)
        full = num_tokens // P * P if tokens is not None else 0
        return _Sample(
            raw_id=raw_id,
            rows=rows,
            tokens=tokens,
            keys=[],  # (`_key`)
            keyed=core.as_stored(rows[:full]),
            prompt_len=prompt_len,
            digest=NO_DIGEST,  # (`_key`)
            versions=versions,
            num_pages=-(-num_tokens // P),
        )

    def _key(self) -> None:
        """The page keys and token digest of every sample with token ids, in one pass over
        the put: one key computation for all, a shared prompt hashed once."""
        P, given = self.core.page_tokens, [s for s in self.samples if s.tokens is not None]
        if not given:
            return
        full = [len(s.tokens) // P for s in given]
        if sum(full):
            pages = np.concatenate([s.tokens[: n * P] for s, n in zip(given, full, strict=True)])
            keys, at = page_keys(pages.reshape(-1, P)), 0
            for s, n in zip(given, full, strict=True):
                s.keys, at = keys[at : at + n], at + n
        digests = token_digests([s.tokens for s in given], [s.prompt_len for s in given])
        for s, digest in zip(given, digests, strict=True):
            s.digest = digest

    def _batch_twins(self) -> None:
        """For every full page of every sample, the earliest sample of the put whose tokens
        and routes are equal up to and including that page (itself if none): `_twin[k][i]`.

        Content only, compared once, outside any lock; `_lay_out` shares a page of the
        earlier sample only where the two chains also agree on the page before it. Once a
        page has a twin, the pages after it that the twin holds itself under the same keys
        (GRPO: the rest of a shared prompt) are compared in one run, page by page only if
        the run differs.
        """
        self._twin: list[list[int]] = []
        heads: dict[tuple[int, int], list[int]] = {}  # (twin of page i-1, key i) -> samples
        for k, s in enumerate(self.samples):
            twins: list[int] = []
            while len(twins) < len(s.keys):
                i = len(twins)
                group = heads.setdefault((twins[-1] if twins else -1, s.keys[i]), [])
                match = next((j for j in group if self._same_pages(j, k, i, i + 1)), k)
                twins.append(match)
                if match == k:  # then so is every later page's: no earlier sample's group
                    group.append(k)  # is under k (theirs are under earlier samples)
                    rest = s.keys[i + 1 :]
                    heads.update(((k, key), [k]) for key in rest)
                    twins += [k] * len(rest)
                    break
                # A later page that `match` holds itself under the same key heads its group
                # (no earlier sample has `match` as a twin), so page by page would compare
                # `match` first there too: one comparison of the run decides those pages.
                other, held = self.samples[match].keys, self._twin[match]
                end = i + 1
                while end < min(len(s.keys), len(other)) and (
                    other[end] == s.keys[end] and held[end] == match
                ):
                    end += 1
                if end > i + 1 and self._same_pages(match, k, i + 1, end):
                    twins += [match] * (end - i - 1)
            self._twin.append(twins)

    def _same_pages(self, j: int, k: int, first: int, end: int) -> bool:
        """Whether samples j and k hold equal tokens and routes on full pages first..end-1."""
        P = self.core.page_tokens
        a, b, span = self.samples[j], self.samples[k], slice(first * P, end * P)
        return same_bytes(a.tokens[span], b.tokens[span]) and same_bytes(
            a.keyed[span], b.keyed[span]
        )

    # -- 2-6. the protocol -----------------------------------------------------------

    def run(self) -> list[RoutingRef]:
        """Store every sample and return their refs, in order; on any error, store none."""
        core = self.core
        if not core.served():
            raise removed_error(core.name)
        self.started = time.monotonic_ns()
        deadline = time.monotonic() + self.timeout

        def lock_deadline() -> float:  # each wait for the lock: the timeout, at least 1 s
            return max(deadline, time.monotonic() + MIN_LOCK_WAIT_S)

        resv, wait, token = Reservation(), 0.001, object()
        samples = core.samples
        spilled = made = False  # whether this put has spilled; whether its last spill made room
        try:
            core.puts_running.add(token)
            while True:
                with core.lock.held("put.lookup", lock_deadline()):
                    self._refuse_duplicates()
                    plans = [core.prefix.candidates(s.keys) for s in self.samples]
                for s, plan in zip(self.samples, plans, strict=True):
                    s.plan, s.equal = plan, core.prefix.equal_prefix(plan, s.keyed, s.tokens)
                with core.lock.held("put.reserve", lock_deadline()) as hold:
                    count = self._lay_out()
                    slots = samples.free_count() >= len(self.samples)
                    ok = slots and self._reserve(hold, count, resv)
                if ok:
                    self._fill(resv.pages)
                    with core.lock.held("put.publish", lock_deadline()) as hold:
                        if samples.free_count() >= len(self.samples) and all(
                            core.prefix.valid(s.plan) for s in self.samples
                        ):
                            return self._publish(hold, resv)
                        # A shared page was released, or the slots taken: again.
                        core.pages.unreserve(hold, resv)
                    continue
                # Spilling counts against the put's timeout: it spills at least once (at least
                # one sample, whatever its timeout), and starts no spill past its deadline.
                if slots and core.spill.enabled and (not spilled or time.monotonic() < deadline):
                    spilled = True
                    made = core.spill.make_room(count, deadline, lock_deadline())
                    if made:
                        continue  # samples moved to disk: their pages are free
                if time.monotonic() >= deadline:
                    raise self._full_error(count, slots, spilling=made)  # (made: slots were free)
                if core.closing:
                    raise closed_error(core.name)
                time.sleep(wait)
                wait = min(wait * 2, 0.05)
        finally:
            try:
                if len(resv.pages) and not resv.published:
                    with core.lock.held("put.unreserve", core.deadline()) as hold:
                        core.pages.unreserve(hold, resv)
            finally:
                core.puts_running.discard(token)

    def _reserve(self, hold: Hold, count: int, resv: Reservation) -> bool:
        """Reserve `count` pages for this writer (under the lock), reclaiming what dead writers
        left if there are too few; False if there are still too few."""
        core = self.core
        lease = core.leases.take(hold, lambda i: core.pages.reclaim_lease(hold, i))
        return core.pages.reserve(hold, count, lease, resv) or (
            reclaim_dead(core, hold, 1) > 0 and core.pages.reserve(hold, count, lease, resv)
        )

    def _refuse_duplicates(self) -> None:
        """Raise if a sample id of the put is stored already (under the lock)."""
        for s in self.samples:
            if self.core.samples.find(s.raw_id) != NO_PAGE:
                raise DuplicateSampleError(
                    f"sample {s.raw_id.decode()!r} is already in store {self.core.name!r}: "
                    "release it first, or give every sample a unique id; nothing of this put "
                    "was stored"
                )

    def _lay_out(self) -> int:
        """Each sample's final plan and chain (under the reserve lock); returns how many pages
        to reserve. Chains hold published pages, then pages of an earlier sample of this put
        (same content, same page before), then the sample's own new pages."""
        core, count, chains = self.core, 0, []  # chains: each laid-out sample's `page(i)`s
        for k, s in enumerate(self.samples):
            if s.equal < len(s.plan):  # same tokens, other routes: an equal twin?
                s.plan = core.prefix.twins(s.plan.prefix(s.equal), s.keys, s.keyed, s.tokens)
            shared = list(s.plan.pages)
            for i in range(len(shared), len(s.keys) if k else 0):
                twin = self._twin[k][i]
                if twin == k or chains[twin][i] >= NO_PAGE:  # none, or a published page
                    break
                if i and chains[twin][i - 1] != shared[i - 1]:  # another page before it
                    break
                shared.append(chains[twin][i])
            s.shared, s.local_base = shared, count
            chains.append(shared + [_local(count + n) for n in range(s.num_pages - len(shared))])
            count += s.num_pages - len(shared)
        return count

    def _fill(self, reserved: np.ndarray) -> None:
        """Copy each sample's new rows (and token ids) into its reserved pages; check ids."""
        for s in self.samples:
            new = reserved[s.local_base : s.local_base + s.num_pages - s.first_new]
            fill_pages(self.core, new, s.rows, s.tokens, s.first_new * self.core.page_tokens)
            if s.rows.dtype != self.core.layout.dtype:
                # Rows byte-equal to shared pages were checked when those were filled,
                # unless a wider input wrapped onto them.
                self.core.layout.check_ids(s.rows[: s.first_new * self.core.page_tokens])

    def _publish(self, hold: Hold, resv: Reservation) -> list[RoutingRef]:
        """Commit every sample (under the lock; every plan was just found valid)."""
        core = self.core
        t, samples = core.tables, core.samples
        self._refuse_duplicates()  # put meanwhile by another writer
        if not core.served():  # removed while this put waited for room or the lock
            raise removed_error(core.name)
        if not core.pages.still_mine(resv).all():
            raise CorruptStoreError(
                f"store {core.name!r}: pages this writer reserved were given to another writer"
            )
        first = samples.next_serial()
        hold.write()
        refs, keyed = [], ([], [], [])  # (pages, parents, keys) of the new full pages
        for n, s in enumerate(self.samples):
            new = resv.pages[s.local_base : s.local_base + s.num_pages - s.first_new]
            shared = [resv.pages[-2 - p] if p < NO_PAGE else p for p in s.shared]
            chain = np.concatenate([np.array(shared, dtype=np.int64), new]) if shared else new
            if len(new):
                before = int(chain[s.first_new - 1]) if s.first_new else NO_PAGE
                parents = [before, *new[:-1].tolist()]
                t.p_parent[new] = parents
                full = len(s.keys) - s.first_new  # (the last page may be partial: no key)
                keyed[0].extend(new[:full].tolist())
                keyed[1].extend(parents[:full])
                keyed[2].extend(s.keys[s.first_new :])
            core.pages.reference(chain)
            serial = first + n
            samples.publish(
                samples.take_slot(hold),
                s.raw_id,
                serial,
                s.num_tokens,
                s.prompt_len,
                s.digest,
                chain,
                t.p_gen[chain],
                self.mark,
            )
            refs.append(
                RoutingRef(
                    s.raw_id.decode(),
                    core.name,
                    core.node_id,
                    s.num_tokens,
                    None if s.prompt_len < 0 else s.prompt_len,
                    t.store_uid,
                    s.digest,
                    s.versions,
                    serial,
                )
            )
        if keyed[0]:
            core.prefix.link_many(*keyed)
        core.pages.publish(resv)
        samples.commit(first + len(self.samples))  # the commit point of the whole put
        t.timed("put", time.monotonic_ns() - self.started)
        return refs

    def _full_error(self, needed_pages: int, slots: bool, spilling: bool) -> StoreFullError:
        """`spilling`: the put's last spill made room, but its timeout ran out first."""
        s = self.core.stats()
        what = (
            f"sample {sample_id_str(self.samples[0])!r}"
            if len(self.samples) == 1
            else f"a put of {len(self.samples)} samples"
        )
        if not slots:
            need = (
                f"it holds {s.samples} samples, its most (max_samples), and {what} needs "
                f"{len(self.samples)} more slot{'s' if len(self.samples) != 1 else ''}"
            )
        else:
            need = (
                f"{s.pages_used + s.pages_pending} of {s.pages_total} pages ({s.page_tokens} "
                f"tokens each, {s.capacity_tokens} tokens, {s.segment_bytes / 2**20:.1f} MiB) "
                f"are in use by {s.samples} samples; {what} needs {needed_pages} more "
                f"page{'s' if needed_pages != 1 else ''}"
            )
        return StoreFullError(
            f"store {self.core.name!r} is full: {need} and none were released within "
            f"{self.timeout:.1f}s; {self._spill_state(s, spilling)}nothing of it was stored. "
            "Release consumed samples with store.release(refs), or create the store with a larger "
            f"{'capacity_tokens (or spill_dir and spill_budget)' if slots else 'max_samples'}"
        )

    def _spill_state(self, s: StoreStats, spilling: bool) -> str:
        if not s.spill_budget:
            return ""
        spill = self.core.spill
        if spilling:
            return (
                f"spilling to {spill.dir} was still making room when the put's timeout ran "
                f"out ({s.samples_spilled} samples spilled, {s.spilled_bytes} of their "
                f"{s.spill_budget}-byte budget): a longer timeout lets it spill what it needs; "
            )
        if spill.was_busy():
            return (
                f"another thread of this process was still spilling to {spill.dir} when the "
                "put's wait for it ran out; "
            )
        if spill.error is not None:
            return (
                f"spilling to {spill.dir} failed ({spill.error.strerror or spill.error}: "
                f"{type(spill.error).__name__}, errno {spill.error.errno}); "
            )
        return (
            f"its spill files ({s.samples_spilled} samples) take {s.spilled_bytes} of their "
            f"{s.spill_budget}-byte budget, too full for more; "
        )


_MAX_TOKEN = np.iinfo(TOKEN_DTYPE).max


def _token_ids(token_ids: Any, num_tokens: int, sample_id: str) -> np.ndarray:
    """Checked token ids as stored (int32)."""
    tokens = host_array(token_ids, f"sample {sample_id!r}: token_ids")
    if tokens.ndim != 1 or len(tokens) != num_tokens or tokens.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"sample {sample_id!r}: token_ids must be a 1-D integer array with one id per "
            f"routes row ({num_tokens}), got shape {tokens.shape} and dtype {tokens.dtype}"
        )
    low = tokens.dtype.kind == "i"  # (a bound the dtype cannot pass is not scanned for)
    high = np.iinfo(tokens.dtype).max > _MAX_TOKEN
    if len(tokens) and ((low and tokens.min() < 0) or (high and tokens.max() > _MAX_TOKEN)):
        raise InvalidArgumentError(
            f"sample {sample_id!r}: token ids must be in [0, 2**31), got "
            f"[{tokens.min()}, {tokens.max()}]"
        )
    return np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)


def fill_pages(
    core: StoreCore,
    new: np.ndarray,
    rows: np.ndarray,
    tokens: np.ndarray | None,
    first_row: int,
) -> None:
    """Copy rows `first_row:` (and their tokens) into the pages `new` and range-check their
    ids chunk by chunk, right after each copy while it is in cache.

    Repeated ids within a top-k are not scanned for here: that scan costs 10-17x the copy
    in numpy (benchmarks/core.py), and is done exactly where routes come from an engine
    (`integrations`) and where they are used (`replay`, the Megatron feed)."""
    layout, t = core.layout, core.tables
    P, shape = core.page_tokens, rows.shape[1:]
    flat = t.data.reshape(-1)
    page_values = t.data.shape[1]
    step = max(1, CHECK_CHUNK_BYTES // max(1, rows[:1].nbytes))
    page_tokens = t.tokens.reshape(-1)
    try:
        for i, first, count in runs(new.tolist()):
            part = rows[first_row + i * P : first_row + (i + count) * P]
            if tokens is not None:
                page_tokens[first * P : first * P + len(part)] = tokens[
                    first_row + i * P : first_row + i * P + len(part)
                ]
            start = first * page_values
            out = flat[start : start + len(part) * page_values // P].reshape(len(part), *shape)
            for a in range(0, len(part), step):
                layout.convert(part[a : a + step], out[a : a + step])
                layout.check_ids(part[a : a + step])
    except InvalidRoutesError:
        layout.check_ids(rows)  # the same error, positions in the whole sample
        raise


def removed_error(name: str) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"store {name!r} was removed (by its owner, or swept) or re-created since this process "
        "attached it: nothing was put; attach again (or call node_store again) and put there"
    )
