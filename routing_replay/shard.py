"""`TokenShard`: which sample token each position of a rank's input holds, so a rank reads
only the token ranges it trains.

A parallel trainer cuts every sample's tokens before its model sees them: packing (each
sequence padded to a multiple), context parallelism (Megatron's zigzag), sequence
parallelism (a contiguous 1/TP, Ulysses' pad-and-slice), micro-batches. A `TokenShard`
starts as the batch's layout (`padded` `[B, S]` or `packed` `[1, T]`), each position
holding the index of its token in the samples back to back (`MISSING`, -1, on
padding: the value routes pad with too, so a slicing function treats both alike), and goes
through *the same slicing functions* the trainer applies to `input_ids` (`map`). What is
left says which tokens the rank holds: `ranges()` for `fetch_batch(refs, ranges=...)` /
`RoutingStore.read(refs, ranges=...)`, and `place(batch)` puts the routes read that way
where the rank's model sees those tokens, -1 on padding.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import torch

from routing_replay.errors import InvalidArgumentError, InvalidRoutesError
from routing_replay.layout import MISSING
from routing_replay.reader import check_tokens, to_torch
from routing_replay.routes import RoutesTensor, with_layout
from routing_replay.schema import NUM_TOKENS, SAMPLE_ID, int32_values


class TokenShard:
    """The token indices `index` (int64, any shape, -1 padding) of a rank's input over
    samples of `lengths` tokens; token `t` of sample `s` is `sum(lengths[:s]) + t`."""

    def __init__(self, index: torch.Tensor, lengths: Sequence[int]) -> None:
        self.lengths = [int(n) for n in lengths]
        if any(n < 0 for n in self.lengths):
            raise InvalidArgumentError(f"sample lengths must be >= 0, got {self.lengths}")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        self.index = torch.as_tensor(index, dtype=torch.int64)
        self._multiple: int | None = None  # a `packed` shard's pad multiple
        total = int(self.offsets[-1])
        bad = (self.index < MISSING) | (self.index >= total)
        if bad.any():
            raise InvalidArgumentError(
                f"a token index {int(self.index[bad][0])} is outside the {total} tokens of "
                f"the samples ({MISSING} marks padding): pad with {MISSING} when slicing a shard"
            )
        # The tokens the shard holds, rising: the order a ranged read returns them in; and
        # the sample each belongs to.
        self._held = torch.unique(self.index[self.index != MISSING]).numpy()
        self._held_sample = np.searchsorted(self.offsets, self._held, side="right") - 1

    @classmethod
    def padded(cls, lengths: Sequence[int], seq_len: int | None = None) -> TokenShard:
        """A right-padded `[B, S]` batch: row b holds sample b's tokens, then padding."""
        lengths = [int(n) for n in lengths]
        S = max(lengths, default=0) if seq_len is None else int(seq_len)
        if any(n > S for n in lengths):
            raise InvalidArgumentError(f"sample lengths {lengths} exceed seq_len = {S}")
        starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
        pos = torch.arange(S)
        index = torch.where(
            pos < torch.tensor(lengths).unsqueeze(1),
            torch.as_tensor(starts).unsqueeze(1) + pos,
            MISSING,
        )
        return cls(index.reshape(len(lengths), S), lengths)

    @classmethod
    def packed(cls, lengths: Sequence[int], multiple: int = 1) -> TokenShard:
        """A packed `[1, T]` batch: each sample's tokens, padded to a multiple of `multiple`
        (NeMo-RL's and Megatron's THD packing; `cu_seqlens()` gives the padded bounds)."""
        if multiple < 1:
            raise InvalidArgumentError(f"multiple must be >= 1, got {multiple}")
        parts, start = [], 0
        for n in (int(n) for n in lengths):
            padded = -(-n // multiple) * multiple
            parts += [torch.arange(start, start + n), torch.full((padded - n,), MISSING)]
            start += n
        index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        shard = cls(index.unsqueeze(0), lengths)
        shard._multiple = multiple
        return shard

    def cu_seqlens(self) -> torch.Tensor:
        """The padded sequence bounds of a `packed` shard (int32 `[B + 1]`)."""
        multiple = self._multiple
        if multiple is None:
            raise InvalidArgumentError("cu_seqlens() is for shards made by TokenShard.packed")
        padded = [-(-n // multiple) * multiple for n in self.lengths]
        return torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenShard:
        """The shard after `fn`, the slicing the trainer applies to `input_ids` (a CP split,
        an SP scatter, a pad: pad with `MISSING`)."""
        return TokenShard(fn(self.index), self.lengths)

    def ranges(self) -> list[list[tuple[int, int]]]:
        """Per sample, the `(start, stop)` runs of its tokens the shard holds (`[(0, 0)]`
        for none): one entry per ref for `ranges=`."""
        held = self._held
        out: list[list[tuple[int, int]]] = [[] for _ in self.lengths]
        if len(held):
            sample = self._held_sample
            breaks = np.flatnonzero((np.diff(held) != 1) | (np.diff(sample) != 0)) + 1
            firsts = np.concatenate([[0], breaks])
            lasts = np.concatenate([breaks, [len(held)]]) - 1
            for a, b in zip(firsts.tolist(), lasts.tolist(), strict=True):
                s = int(sample[a])
                base = int(self.offsets[s])
                out[s].append((int(held[a]) - base, int(held[b]) - base + 1))
        return [r or [(0, 0)] for r in out]

    def num_tokens(self) -> list[int]:
        """How many of each sample's tokens the shard holds (a ranged read's row lengths)."""
        return np.bincount(self._held_sample, minlength=len(self.lengths)).tolist()

    def place(
        self, batch: pa.RecordBatch | pa.Table, input_ids: torch.Tensor | None = None
    ) -> RoutesTensor:
        """The routes of `batch` (read with `ranges()`, one row per sample, in order) where
        the shard holds their tokens: `[*index.shape, L, K]`, -1 on padding, a
        `RoutesTensor`. With `input_ids` (the rank's ids, the shard's shape) every held
        token is checked against the ids the routes were put with."""
        counts = int32_values(batch.column(NUM_TOKENS)).tolist()
        if counts != self.num_tokens():
            ids = batch.column(SAMPLE_ID).to_pylist()
            raise InvalidRoutesError(
                f"the batch's rows hold {counts} tokens of samples {ids[:5]}, the shard "
                f"{self.num_tokens()}: read the shard's refs, in order, with ranges=shard.ranges()"
            )
        nonpad = self.index != MISSING
        where = torch.from_numpy(np.searchsorted(self._held, self.index[nonpad].numpy()))
        expected = None
        if input_ids is not None:
            ids = torch.as_tensor(input_ids).cpu()
            if ids.shape != self.index.shape:
                raise InvalidRoutesError(
                    f"input_ids {tuple(ids.shape)} must have the shard's shape "
                    f"{tuple(self.index.shape)}: slice them as the shard was sliced"
                )
            expected = np.zeros(len(self._held), dtype=np.int64)
            expected[where.numpy()] = ids[nonpad].numpy()
            positions = self._held - self.offsets[self._held_sample]
            check_tokens(batch, expected, np.zeros(len(self.lengths)), None, positions)
        flat = to_torch(batch)
        layout = flat.layout
        flat = flat.as_subclass(torch.Tensor)
        out = flat.new_full((*self.index.shape, *flat.shape[1:]), MISSING)
        # Copy run by run (positions and held tokens both consecutive): no gathered temporary.
        at = np.flatnonzero(nonpad.reshape(-1).numpy())
        src = where.numpy()
        breaks = np.flatnonzero((np.diff(at) != 1) | (np.diff(src) != 1)) + 1
        out_flat = out.view(-1, *flat.shape[1:])
        bounds = np.r_[0, breaks, len(at)].tolist() if len(at) else []
        for a, b in itertools.pairwise(bounds):
            out_flat[at[a] : at[a] + b - a] = flat[src[a] : src[a] + b - a]
        return with_layout(out, layout)
