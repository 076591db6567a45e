"""The read protocol: a `ReadPlan` locates samples under the lock, copies without it, checks.

1. lock: find each sample's slot (refs must name the put they were made by), its chain of
   pages, their generations, its fields; unlock;
2. copy the requested tokens' routes (and token ids) out of the pages, without the lock;
3. lock: every page is still at its generation and every slot still holds the same put,
   else `ConcurrentReleaseError` (the copy may be torn); unlock.

Readers pin nothing, so a killed reader leaks nothing; a release that races a read makes
the read fail, never return another sample's routes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from routing_replay.errors import (
    ConcurrentReleaseError,
    InvalidArgumentError,
    SampleReplacedError,
)
from routing_replay.schema import output_buffer, routes_batch
from routing_replay.store.format import NO_DIGEST, TOKEN_DTYPE
from routing_replay.store.prefix import runs
from routing_replay.store.refs import (
    Part,
    RoutingRef,
    as_list,
    check_part,
    check_store,
    resolve,
    sample_id_bytes,
    token_ranges,
)

if TYPE_CHECKING:
    from routing_replay.store.routing_store import RoutingStore


class ReadPlan:
    """Where a read's samples are: slots, serials, chains and generations, found under the lock."""

    def __init__(self, store: RoutingStore, sample_ids: Iterable[str | RoutingRef]) -> None:
        self.store = store
        refs = as_list(sample_ids)
        check_store(refs, store.name, store.store_uid)
        raw_ids = [sample_id_bytes(r) for r in refs]
        samples = store._samples
        self.chains: list[np.ndarray] = []
        self.gens: list[np.ndarray] = []
        self.num_tokens: list[int] = []
        self.prompt_lens: list[int] = []
        self.digests: list[int] = []
        self.serials: list[int] = []  # the put each slot held (`resolve` checked the refs')
        with store._lock.held("read.locate", store._deadline()):
            self.slots = resolve(samples, store.name, refs, raw_ids, "read")
            for s in self.slots:
                pages, gens, num_tokens, prompt_len = samples.chain(s)
                self.chains.append(pages)
                self.gens.append(gens)
                self.num_tokens.append(num_tokens)
                self.prompt_lens.append(prompt_len)
                self.digests.append(samples.digest(s))
                self.serials.append(samples.serial(s))
        self.ids = [r.decode() for r in raw_ids]
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

    def copy(self, pages_data: np.ndarray, i: int, span: range, out: np.ndarray) -> None:
        """Copy tokens `span` of sample `i` from `pages_data` (the routes or the token ids,
        `[num_pages, P * width]`) into `out` (`[len(span), width]`)."""
        P, flat = self.store.page_tokens, pages_data.reshape(-1)
        width = pages_data.shape[1] // P
        first, stop = span.start, span.stop
        lo_page, hi_page = first // P, -(-stop // P)
        for j, page, count in runs(self.chains[i][lo_page:hi_page].tolist()):
            t0 = max((lo_page + j) * P, first)
            t1 = min((lo_page + j + count) * P, stop)
            src = (page * P + t0 - (lo_page + j) * P) * width
            out[t0 - first : t1 - first] = flat[src : src + (t1 - t0) * width].reshape(-1, width)

    def check_unchanged(self) -> None:
        """Raise if a located sample was released (or its pages reused) since it was located."""
        if not self.chains:
            return
        store, t = self.store, self.store._t
        one = len(self.chains) == 1
        pages = self.chains[0] if one else np.concatenate(self.chains)
        with store._lock.held("read.check", store._deadline()):
            gens_now = t.p_gen[pages]
            # A released slot's serial is 0: one compare says "still the same put".
            serials_now = t.s_serial[self.slots].tolist()
        gens = self.gens[0] if one else np.concatenate(self.gens)
        if serials_now != self.serials or (gens_now != gens).any():
            raise ConcurrentReleaseError(
                f"a sample among {self.ids[:5]} was released (and its pages or id reused) while "
                "being read: release samples only after every reader is done with them"
            )

    def routes(self, part: Part) -> np.ndarray:
        """Sample 0's routes `[T, L, K]` (`layout.signed_dtype`, -1 missing), a copy."""
        layout = self.store.layout
        span = self.span(0, part)
        stored = np.empty((len(span), layout.values_per_token), dtype=layout.dtype)
        self.copy(self.store._t.data, 0, span, stored)
        self.check_unchanged()
        return layout.decode(stored.reshape(len(span), layout.num_moe_layers, layout.top_k))

    def pieces(self, i: int, part: Part, ranges: Any) -> list[range]:
        """The positions of sample `i` a read copies: `part`'s, or the `ranges` over them."""
        span = self.span(i, part)
        if ranges is None:
            return [span]
        pairs = token_ranges(ranges, len(span), self.ids[i])
        return [range(span.start + a, span.start + b) for a, b in pairs]

    def batch(
        self, part: Part, out: Any = None, ranges: Sequence[Any] | None = None
    ) -> pa.RecordBatch:
        """Every sample as one Arrow record batch, one copy (into `out` if given); with
        `ranges` (one entry per sample) only those tokens, and only the pages under them."""
        store, layout = self.store, self.store.layout
        if ranges is not None and len(ranges) != len(self.ids):
            raise InvalidArgumentError(
                f"ranges has {len(ranges)} entries for {len(self.ids)} samples: one per ref"
            )
        pieces = [
            self.pieces(i, part, None if ranges is None else ranges[i])
            for i in range(len(self.ids))
        ]
        lengths = np.array([sum(len(r) for r in p) for p in pieces], dtype=np.int64)
        has_tokens = np.array([d != NO_DIGEST for d in self.digests], dtype=bool)
        nbytes = int(lengths.sum()) * layout.bytes_per_token
        buf = pa.allocate_buffer(nbytes) if out is None else output_buffer(out, nbytes)
        values = np.frombuffer(buf, dtype=layout.dtype).reshape(-1, layout.values_per_token)
        token_buf = pa.allocate_buffer(int(lengths[has_tokens].sum()) * TOKEN_DTYPE.itemsize)
        tokens = np.frombuffer(token_buf, dtype=TOKEN_DTYPE).reshape(-1, 1)
        row = token_row = 0
        for i, with_tokens in enumerate(has_tokens.tolist()):
            for span in pieces[i]:
                self.copy(store._t.data, i, span, values[row:])
                if with_tokens:
                    self.copy(store._t.tokens, i, span, tokens[token_row:])
                    token_row += len(span)
                row += len(span)
        self.check_unchanged()
        # A row's prompt tokens come first (ranges rise): count those it holds.
        prompt = [
            None if p < 0 else sum(max(0, min(r.stop, p) - r.start) for r in pieces[i])
            for i, p in enumerate(self.prompt_lens)
        ]
        return routes_batch(layout, self.ids, lengths, prompt, buf, (has_tokens, token_buf))
