"""The read protocol: a `ReadPlan` locates samples under the lock, copies without it, checks.
(Over 400 lines by design: one protocol and the forms its copies take, here and on the wire.)

1. lock: find each sample's slot (refs must name the put they were made by), its chain of
   pages, their generations, its fields; unlock;
2. copy the requested tokens' routes (and token ids) out of the pages, without the lock;
3. lock: every page is still at its generation and every slot still holds the same put,
   else `ConcurrentReleaseError` (the copy may be torn); unlock.

A spilled sample (`spill`) is copied from its file instead, read after step 1; one spilled
between steps 1 and 3 (same put, its pages taken) is read again (`read_settled`).

Readers pin nothing, so a killed reader leaks nothing; a release that races a read makes
the read fail, never return another sample's routes.

A read is planned as copies (row, where in the rows, which stored token, how many): run
here against the segment (`batch`), or, for a reader on another node, run against the
stored tokens it needs, each once, as `ship` (`ray.put`) copies them out of the segment
(`wire`: pages samples share travel once).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

from routing_replay.errors import (
    ConcurrentReleaseError,
    CorruptStoreError,
    InvalidArgumentError,
    SampleReplacedError,
    StoreUnavailableError,
)
from routing_replay.layout import RoutingLayout
from routing_replay.schema import output_buffer, routes_batch
from routing_replay.store.calls import forget_frames
from routing_replay.store.format import NO_DIGEST, NOT_SPILLED, TOKEN_DTYPE
from routing_replay.store.prefix import runs
from routing_replay.store.refs import (
    Part,
    RoutingRef,
    as_list,
    check_part,
    check_store,
    ranges_per_ref,
    resolve,
    sample_id_bytes,
    token_ranges,
)
from routing_replay.store.spill import SpillFile
from routing_replay.store.tables import lent_rows

if TYPE_CHECKING:
    from routing_replay.store.core import StoreCore


class ReadPlan:
    """Where a read's samples are: slots, serials, chains and generations, found under the lock."""

    def __init__(
        self, core: StoreCore, sample_ids: Iterable[str | RoutingRef], started: int | None = None
    ) -> None:
        self.core = core
        self.started = time.monotonic_ns() if started is None else started  # a retry's first
        refs = as_list(sample_ids)
        check_store(refs, core.name, core.store_uid, core.node_id)
        raw_ids = [sample_id_bytes(r) for r in refs]
        samples = core.samples
        self.chains: list[np.ndarray] = []
        self.gens: list[np.ndarray] = []
        self.num_tokens: list[int] = []
        self.prompt_lens: list[int] = []
        self.digests: list[int] = []
        self.serials: list[int] = []  # the put each slot held (`resolve` checked the refs')
        spills: list[int] = []
        with core.lock.held("read.locate", core.deadline()):
            self.slots = resolve(samples, core.name, refs, raw_ids, "read")
            for s in self.slots:
                pages, gens, num_tokens, prompt_len = samples.chain(s)
                self.chains.append(pages)
                self.gens.append(gens)
                self.num_tokens.append(num_tokens)
                self.prompt_lens.append(prompt_len)
                self.digests.append(samples.digest(s))
                self.serials.append(samples.serial(s))
                spills.append(samples.spill(s))
            samples.mark_read(self.slots)
        self.ids = [r.decode() for r in raw_ids]
        self.files: dict[int, SpillFile] = {}  # sample -> its spill file
        for i, code in enumerate(spills):
            if code != NOT_SPILLED:
                self.files[i] = self._open(i, code)
        for ref, n, digest in zip(refs, self.num_tokens, self.digests, strict=True):
            if isinstance(ref, RoutingRef) and (
                ref.num_tokens != n or ref.tokens_digest not in (NO_DIGEST, digest)
            ):
                raise SampleReplacedError(
                    f"ref {ref.sample_id!r} ({ref.num_tokens} tokens) does not describe the "
                    f"sample stored under that id now ({n} tokens, other token ids): the "
                    "sample was released and put again. Refs must not outlive their release; "
                    "give every rollout sample a unique id"
                )

    def _open(self, i: int, code: int) -> SpillFile:
        """Map sample `i`'s spill file; if it is gone, the sample was released (or the disk
        was cleaned under the store)."""
        path = self.core.spill.path(self.serials[i], code)
        try:
            return SpillFile(self.core, path, self.serials[i], self.digests[i], self.num_tokens[i])
        except FileNotFoundError:
            self.check_unchanged(failed=True)
            raise CorruptStoreError(
                f"spill file {path} of sample {self.ids[i]!r} is missing: something removed "
                "files from the store's spill directory. Release the sample and regenerate it"
            ) from None
        except OSError as e:  # EMFILE, EIO, ELOOP (a link in its place), ...: not readable now
            self.check_unchanged(failed=True)
            raise StoreUnavailableError(
                f"spill file {path} of sample {self.ids[i]!r} cannot be read: {e.strerror or e} "
                f"(errno {e.errno}). The store is whole; fix the cause (too many open files: "
                "raise `ulimit -n`; a failing or changed disk) and read again"
            ) from None

    def span(self, i: int, part: Part) -> range:
        """The token positions of sample `i` that `part` names."""
        n, prompt_len = self.num_tokens[i], self.prompt_lens[i]
        if check_part(part) == "all":
            return range(0, n)
        if prompt_len < 0:
            raise InvalidArgumentError(
                f"sample {self.ids[i]!r} was put without prompt_len: only part='all' is available"
            )
        return range(0, prompt_len) if part == "prompt" else range(prompt_len, n)

    def copies(self, pieces: list[list[range]]) -> np.ndarray:
        """The copies that read `pieces[i]` of every sample `i`, rows back to back: int64
        `[n, 4]` of (row, first token in the rows, first stored token, count); stored token
        `page * P + offset` (one copy per run of consecutive pages)."""
        P, out, dst = self.core.page_tokens, [], 0
        bases = self._file_bases()
        for i, spans in enumerate(pieces):
            for span in spans:
                first, stop = span.start, span.stop
                if i in bases:  # one run in the sample's file
                    if stop > first:
                        out.append((i, dst, bases[i] + first, stop - first))
                    dst += len(span)
                    continue
                lo_page, hi_page = first // P, -(-stop // P)
                for j, page, count in runs(self.chains[i][lo_page:hi_page].tolist()):
                    t0 = max((lo_page + j) * P, first)
                    t1 = min((lo_page + j + count) * P, stop)
                    out.append((i, dst + t0 - first, page * P + t0 - (lo_page + j) * P, t1 - t0))
                dst += len(span)
        return np.array(out, dtype=np.int64).reshape(-1, 4)

    def check_unchanged(self, failed: bool = False) -> None:
        """Raise if a located sample was released (or its pages reused) since it was located;
        else count the read (not when it `failed` for another reason)."""
        if not self.chains:
            return
        core, t = self.core, self.core.tables
        one = len(self.chains) == 1
        pages = self.chains[0] if one else np.concatenate(self.chains)
        gens = self.gens[0] if one else np.concatenate(self.gens)
        with core.lock.held("read.check", core.deadline()):
            # A released slot's serial is 0: one compare says "still the same put".
            released = t.s_serial[self.slots].tolist() != self.serials
            moved = bool((t.p_gen[pages] != gens).any())
            if not (released or moved or failed):  # a read that returns: counted once
                t.timed("read", time.monotonic_ns() - self.started)
        if released:
            raise ConcurrentReleaseError(
                f"a sample among {self.ids[:5]} was released (and its pages or id reused) while "
                "being read: release samples only after every reader is done with them"
            )
        if moved:  # same puts, other pages: one was spilled meanwhile
            raise SpilledMeanwhile

    def routes(self, part: Part) -> np.ndarray:
        """Sample 0's routes `[T, L, K]` (`layout.signed_dtype`, -1 missing), a copy."""
        layout = self.core.layout
        span = self.span(0, part)
        stored = np.empty((len(span), layout.values_per_token), dtype=layout.dtype)
        run_copies(self._stored_routes(), stored, self.copies([[span]]))
        self.check_unchanged()
        return layout.decode(stored.reshape(len(span), layout.num_moe_layers, layout.top_k))

    def _stored_routes(self) -> np.ndarray | Rows:
        """Every stored token's ids, `[num_pages * P, L * K]` (a view of the segment), then
        the spilled samples' (at `_file_bases`)."""
        rows = self.core.tables.data.reshape(-1, self.core.layout.values_per_token)
        return self._stored(rows, "routes")

    def _stored_tokens(self) -> np.ndarray | Rows:
        """`_stored_routes`' token ids, `[*, 1]`."""
        return self._stored(self.core.tables.tokens.reshape(-1, 1), "tokens")

    def _stored(self, segment: np.ndarray, field: str) -> np.ndarray | Rows:
        """`segment`, or with spilled samples the segment then each file's `field` rows."""
        if not self.files:
            return segment
        bases = self._file_bases()
        files = [(bases[i], getattr(f, field), f.check) for i, f in self.files.items()]
        return Rows(segment, files)

    def _file_bases(self) -> dict[int, int]:
        """Sample -> where its file's rows start in `_stored_routes`: after the segment's, one
        row apart (a copy or a union of copies never spans two sources)."""
        at, bases = len(self.core.tables.tokens.reshape(-1)) + 1, {}
        for i in self.files:
            bases[i] = at
            at += self.num_tokens[i] + 1
        return bases

    def pieces(self, i: int, part: Part, ranges: Any) -> list[range]:
        """The positions of sample `i` a read copies: `part`'s, or the `ranges` over them."""
        span = self.span(i, part)
        if ranges is None:
            return [span]
        pairs = token_ranges(ranges, len(span), self.ids[i])
        return [range(span.start + a, span.start + b) for a, b in pairs]

    def _request(self, part: Part, ranges: Sequence[Any] | None) -> Request:
        ranges = ranges_per_ref(ranges, len(self.ids))
        pieces = [
            self.pieces(i, part, None if ranges is None else ranges[i])
            for i in range(len(self.ids))
        ]
        # A row's prompt tokens come first (ranges rise): count those it holds.
        prompt = [
            None if p < 0 else sum(max(0, min(r.stop, p) - r.start) for r in pieces[i])
            for i, p in enumerate(self.prompt_lens)
        ]
        return Request(
            layout=self.core.layout,
            sample_ids=self.ids,
            num_tokens=np.array([sum(len(r) for r in p) for p in pieces], dtype=np.int64),
            prompt_lens=prompt,
            has_tokens=np.array([d != NO_DIGEST for d in self.digests], dtype=bool),
            copies=self.copies(pieces),
        )

    def batch(
        self, part: Part, out: Any = None, ranges: Sequence[Any] | None = None
    ) -> pa.RecordBatch:
        """Every sample as one Arrow record batch, one copy (into `out` if given); with
        `ranges` (one entry per sample) only those tokens, and only the pages under them."""
        request = self._request(part, ranges)
        batch = request.build(self._stored_routes(), self._stored_tokens(), out)
        self.check_unchanged()
        return batch

    def wire(
        self,
        part: Part,
        ranges: Sequence[Any] | None = None,
        ship: Callable[[WireBatch], Any] | None = None,
    ) -> Any:
        """The read as it crosses the network: every stored token the rows need once (pages
        that samples share, a GRPO group's prompt, travel once), and how to rebuild them.
        `ship` gets it as views of the stored rows while they are still valid and must copy
        them (Ray's `ray.put` does, straight into the buffer that ships); its return is
        returned. Default: the views gathered into one array each."""
        request = self._request(part, ranges)
        src = request.copies[:, 2]
        first, last = _union(src, src + request.copies[:, 3])
        spans = list(zip(first.tolist(), last.tolist(), strict=True))
        # `ship` gets views of a memoryview lent for this call: if any view of it (or one
        # made from one, or an Arrow array over one) outlives `ship`, its release fails.
        lent = memoryview(self.core.segment.mmap)
        data, token_rows = lent_rows(self.core.tables, lent)
        routes, tokens = self._stored(data, "routes"), self._stored(token_rows, "tokens")
        at = np.concatenate([[0], np.cumsum(last - first)])
        k = np.searchsorted(first, src, side="right") - 1
        copies = request.copies.copy()
        copies[:, 2] = at[k] + src - first[k]  # the same tokens, at their place in the runs
        views = WireBatch(
            request._replace(copies=copies),
            [_read_only(routes[a:b]) for a, b in spans],
            [_read_only(tokens[a:b]) for a, b in spans] if request.has_tokens.any() else [],
        )
        try:
            shipped = (ship or WireBatch.gathered)(views)
        except BaseException as e:  # `ship`'s ended frames (of chained errors too) hold the
            forget_frames(e, every=True)  # views: cleared, so that the error can be kept
            raise
        finally:
            del views, routes, tokens, data, token_rows  # no view of the loan outlives it...
        try:
            lent.release()
        except BufferError:  # ... unless `ship` kept one (returned, wrapped, queued, derived)
            raise InvalidArgumentError(
                "read_wire: `ship` kept views of the store's shared memory (returned, wrapped, "
                "queued or made from them), which a release and a later put may overwrite: it "
                "must copy them before it returns (ray.put does, WireBatch.gathered does)"
            ) from None
        self.check_unchanged()
        return shipped


class SpilledMeanwhile(Exception):
    """A located sample was spilled before the read checked it (same put): read it again."""


def read_settled(
    core: StoreCore, sample_ids: Iterable[str | RoutingRef], read: Callable[[ReadPlan], Any]
) -> Any:
    """`read(ReadPlan(...))`, again while a sample was spilled under it: each sample spills
    at most once, so this ends."""
    refs, started = as_list(sample_ids), time.monotonic_ns()
    for _ in range(len(refs) + 1):
        try:
            return read(ReadPlan(core, refs, started))
        except SpilledMeanwhile:
            continue
    return read(ReadPlan(core, refs, started))


class Rows:
    """Stored rows from several sources at one index space: the segment's from 0, then each
    spill file's from its base (`ReadPlan._file_bases`); `rows[a:b]` is a view of the one
    source holding them (a file's chunks checked on first use)."""

    def __init__(self, segment: np.ndarray, files: list[tuple[int, np.ndarray, Any]]) -> None:
        self._parts = [(0, segment, None), *files]
        self._starts = [base for base, _, _ in self._parts]
        end = files[-1][0] + len(files[-1][1]) if files else len(segment)
        self.shape, self.dtype = (end, segment.shape[1]), segment.dtype

    def __getitem__(self, index: slice) -> np.ndarray:
        base, rows, check = self._parts[bisect.bisect_right(self._starts, index.start) - 1]
        a, b = index.start - base, index.stop - base
        if b > len(rows):
            raise IndexError(f"rows {index.start}:{index.stop} span two sources")
        if check is not None:
            check(a, b)
        return rows[a:b]


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals `[starts, ends)`: sorted, disjoint (first, last) arrays
    (overlapping and touching intervals merged)."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    new = np.r_[True, starts[1:] > np.maximum.accumulate(ends)[:-1]]
    return starts[new], np.maximum.reduceat(ends, np.flatnonzero(new))


def run_copies(src: np.ndarray, dst: np.ndarray, copies: np.ndarray) -> None:
    """`dst[d : d + n] = src[s : s + n]` for each copy (row, d, s, n)."""
    for _, d, s, n in copies.tolist():
        dst[d : d + n] = src[s : s + n]


class Request(NamedTuple):
    """What a read returns, before the copy: its rows and the copies that fill them."""

    layout: RoutingLayout
    sample_ids: list[str]
    num_tokens: np.ndarray  # int64, per row
    prompt_lens: list[int | None]
    has_tokens: np.ndarray  # bool, per row: whether the sample was put with token ids
    copies: np.ndarray  # int64 [n, 4]: (row, first token in the rows, first source token, n)

    def build(
        self, routes: Any, tokens: Any, out: Any = None, missing: np.ndarray | None = None
    ) -> pa.RecordBatch:
        """The Arrow batch, copied out of `routes` `[*, L * K]` and `tokens` `[*, 1]` (the
        copies' sources), into `out` if given (`missing`: as in `place`)."""
        layout, lengths, has = self.layout, self.num_tokens, self.has_tokens
        buf, values, token_buf, token_ids = batch_memory(layout, lengths, has, out)
        row_at, token_at = starts(lengths), starts(lengths * has)
        self.place(routes, tokens, values, row_at, token_ids, token_at, missing)
        return routes_batch(
            layout, self.sample_ids, lengths, self.prompt_lens, buf, (has, token_buf)
        )

    def place(
        self,
        routes: np.ndarray,
        tokens: np.ndarray,
        values: np.ndarray,
        row_at: np.ndarray,
        token_ids: np.ndarray,
        token_at: np.ndarray,
        missing: np.ndarray | None = None,
    ) -> None:
        """Copy each row `r` to `values[row_at[r]:]`, and its token ids (rows that have them)
        to `token_ids[token_at[r]:]`: rows placed anywhere in a larger batch, in one pass.
        `missing` (`[m, 2]` source token, column; sorted): values whose marker the source
        does not hold (narrowed to one byte on the wire), restored in `values`."""
        copies, rows = self.copies.copy(), self.copies[:, 0]
        within = copies[:, 1] - starts(self.num_tokens)[rows]  # the copy's place in its row
        copies[:, 1] = row_at[rows] + within
        run_copies(routes, values, copies)
        if missing is not None and len(missing):
            restore_missing(values, copies, missing, self.layout.missing)
        has = self.has_tokens[rows]
        if has.any():
            copies[:, 1] = token_at[rows] + within
            run_copies(tokens, token_ids, copies[has])


def restore_missing(
    values: np.ndarray, copies: np.ndarray, missing: np.ndarray, marker: int
) -> None:
    """Write `marker` where each copy put a source value listed in `missing` (column -1: the
    whole row)."""
    src, col = missing[:, 0], missing[:, 1]
    first = np.searchsorted(src, copies[:, 2])
    last = np.searchsorted(src, copies[:, 2] + copies[:, 3])
    for c in np.flatnonzero(last > first).tolist():
        _, d, s, _ = copies[c].tolist()
        lo, hi = int(first[c]), int(last[c])
        at, cols = d + src[lo:hi] - s, col[lo:hi]
        whole = cols < 0
        values[at[whole]] = marker
        values[at[~whole], cols[~whole]] = marker


def batch_memory(
    layout: RoutingLayout, lengths: np.ndarray, has: np.ndarray, out: Any = None
) -> tuple[pa.Buffer, np.ndarray, pa.Buffer, np.ndarray]:
    """Memory for rows of `lengths` tokens (in `out` if given) and for the token ids of the
    rows that `has` them (the others take no room): buffers and their numpy views
    `[*, L * K]` and `[*, 1]`."""
    nbytes = int(lengths.sum()) * layout.bytes_per_token
    buf = pa.allocate_buffer(nbytes) if out is None else output_buffer(out, nbytes)
    values = np.frombuffer(buf, dtype=layout.dtype).reshape(-1, layout.values_per_token)
    token_buf = pa.allocate_buffer(int(lengths[has].sum()) * TOKEN_DTYPE.itemsize)
    return buf, values, token_buf, np.frombuffer(token_buf, dtype=TOKEN_DTYPE).reshape(-1, 1)


def starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of rows of `lengths` starts when they lie back to back."""
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


NARROW_CHUNK = 1 << 20  # ids narrowed (and searched for the missing marker) at a time


class WireBatch(NamedTuple):
    """A read shipped to another node: the stored tokens it needs, each once, in runs, and
    the copies that rebuild its rows there (`batch()`). What crosses is `nbytes`."""

    request: Request  # copies' sources index the runs back to back
    routes: list[np.ndarray]  # runs of [n, L * K] stored ids of the distinct tokens read
    tokens: list[np.ndarray]  # the same runs' token ids [n, 1] (none when no sample has any)
    # With `routes` narrowed to one byte (`narrowed()`): int64 [m, 2] (token in the runs,
    # column) of the values that are the missing marker, which one byte cannot hold.
    missing: np.ndarray | None = None

    @property
    def num_stored(self) -> int:
        """Distinct stored tokens shipped."""
        return sum(len(r) for r in self.routes)

    @property
    def nbytes(self) -> int:
        arrays = [*self.routes, *self.tokens, self.request.copies]
        return sum(a.nbytes for a in arrays) + (0 if self.missing is None else self.missing.nbytes)

    def gathered(self) -> WireBatch:
        """The runs copied into one array each (no view of the source left)."""
        routes, tokens = (_joined(runs) for runs in (self.routes, self.tokens))
        return self._replace(routes=routes, tokens=tokens)

    def narrowed(self, take: Callable[[int], np.ndarray] | None = None) -> WireBatch:
        """The route runs copied with ids in one byte where the layout stores two only for
        its missing marker (256 experts: DeepSeek-V3's family), the marker's places listed
        apart (a whole row once): about half the route bytes cross. Otherwise (or if the
        list would cost more than it saves) itself: views still, which `ship` copies.
        `take(n)` gives the n bytes the ids are narrowed into (a store actor's reused
        `Scratch`, valid until its `ray.put` copied them); default fresh ones."""
        layout = self.request.layout
        if self.missing is not None or layout.dtype.itemsize != 2 or layout.num_experts > 256:
            return self
        size = sum(run.size for run in self.routes)
        into = take(size) if take is not None else np.frombuffer(pa.allocate_buffer(size), np.uint8)
        low, found, at, V = [], [], 0, layout.values_per_token
        for run in self.routes:
            narrow = into[at * V : (at + len(run)) * V].reshape(run.shape)
            flat = _narrow(run, layout.missing, narrow)
            if len(flat):
                rows, cols = np.divmod(flat, V)
                whole = np.flatnonzero(np.bincount(rows, minlength=len(run)) == V)
                part = ~np.isin(rows, whole)
                marks = np.concatenate(
                    [
                        np.stack([whole, np.full(len(whole), -1)], axis=1),
                        np.stack([rows[part], cols[part]], axis=1),
                    ]
                )
                marks = marks[np.argsort(marks[:, 0], kind="stable")]
                marks[:, 0] += at
                found.append(marks)
            low.append(narrow)
            at += len(run)
        missing = np.concatenate(found) if found else np.empty((0, 2), dtype=np.int64)
        if missing.nbytes >= sum(r.nbytes for r in low):
            return self  # (most ids missing: nothing to gain)
        return self._replace(routes=low, missing=missing)

    def batch(self, out: Any = None) -> pa.RecordBatch:
        """The rows as one Arrow batch in this process's memory (or `out`), one copy."""
        return self.request.build(_runs(self.routes), _runs(self.tokens), out, self.missing)

    def place(
        self, values: np.ndarray, row_at: np.ndarray, token_ids: np.ndarray, token_at: np.ndarray
    ) -> None:
        """The rows copied into a larger batch's `values` and `token_ids` (`Request.place`)."""
        self.request.place(
            _runs(self.routes),
            _runs(self.tokens),
            values,
            row_at,
            token_ids,
            token_at,
            self.missing,
        )


def _read_only(view: np.ndarray) -> np.ndarray:
    view.flags.writeable = False  # (a `ship` that writes into the store fails loudly)
    return view


def _narrow(run: np.ndarray, marker: int, narrow: np.ndarray) -> np.ndarray:
    """`run` (ids below 256, or the two-byte `marker`) copied into `narrow` with each id in
    one byte (the marker's low byte where it was); returns the flat indices of its marker
    values. Chunk by chunk: no temporary the size of the read, whose fresh pages cost more
    than the copy; a chunk's markers are looked for only if its largest value is one."""
    rows = max(1, NARROW_CHUNK // max(1, run.shape[1]))
    hits = np.empty((min(rows, len(run)), run.shape[1]), dtype=bool)
    found = []
    for a in range(0, len(run), rows):
        chunk, hit = run[a : a + rows], hits[: len(run[a : a + rows])]
        np.copyto(narrow[a : a + rows], chunk, casting="unsafe")
        if chunk.size and chunk.max() > 255:
            np.equal(chunk, marker, out=hit)
            found.append(np.flatnonzero(hit) + a * run.shape[1])
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def _joined(runs: list[np.ndarray]) -> list[np.ndarray]:
    return [np.concatenate(runs)] if len(runs) > 1 else [np.array(r) for r in runs]


def _runs(runs: list[np.ndarray]) -> np.ndarray | Rows:
    """Runs back to back as one index space (a copy never spans two runs)."""
    if len(runs) == 1:
        return runs[0]
    if not runs:
        return np.empty((0, 1), dtype=TOKEN_DTYPE)
    starts = np.cumsum([0, *(len(r) for r in runs[:-1])]).tolist()
    return Rows(runs[0], [(at, r, None) for at, r in zip(starts[1:], runs[1:], strict=True)])
