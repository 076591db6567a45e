"""One routes batch, in the refs' order, from the parts several stores returned: each row
copied once, straight to its place in the result (or the caller's `out`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from routing_replay.errors import LayoutMismatchError
from routing_replay.reader import stored_ids
from routing_replay.schema import (
    NUM_TOKENS,
    PROMPT_LEN,
    SAMPLE_ID,
    TOKEN_IDS,
    int32_values,
    layout_of,
    list_values,
    routes_batch,
)
from routing_replay.store import WireBatch
from routing_replay.store.read import batch_memory, starts

Part = tuple[list[int], "pa.RecordBatch | WireBatch"]  # (the refs' indices, their rows)


def assemble(count: int, parts: list[Part], out: Any = None) -> pa.RecordBatch:
    """`count` rows: part `(indices, rows)` holds the rows of refs `indices`, in that order.
    A wire batch is rebuilt in place; a batch read here is copied in by runs of rows."""
    layouts = {_layout(rows) for _, rows in parts}
    if len(layouts) > 1:
        raise LayoutMismatchError(
            "refs come from stores of different routing layouts (models): read them apart"
        )
    (layout,) = layouts
    ids: list[str] = [""] * count
    prompts: list[int | None] = [None] * count
    lengths = np.zeros(count, dtype=np.int64)
    has = np.zeros(count, dtype=bool)
    for indices, rows in parts:
        part_ids, part_lengths, part_prompts, part_has = _rows(rows)
        for i, sample_id, prompt in zip(indices, part_ids, part_prompts, strict=True):
            ids[i], prompts[i] = sample_id, prompt
        lengths[indices], has[indices] = part_lengths, part_has
    row_at, token_at = starts(lengths), starts(lengths * has)
    buf, values, token_buf, token_ids = batch_memory(layout, lengths, has, out)
    for indices, rows in parts:
        at, tok_at = row_at[indices], token_at[indices]
        if isinstance(rows, WireBatch):
            rows.place(values, at, token_ids, tok_at)
        else:
            _place_batch(rows, layout, values, at, token_ids, tok_at)
    return routes_batch(layout, ids, lengths, prompts, buf, (has, token_buf))


def _layout(rows: pa.RecordBatch | WireBatch) -> Any:
    return rows.request.layout if isinstance(rows, WireBatch) else layout_of(rows)


def _rows(rows: pa.RecordBatch | WireBatch) -> tuple[list[str], np.ndarray, list, np.ndarray]:
    """Sample ids, lengths, prompt lengths (None: none) and whether each has token ids."""
    if isinstance(rows, WireBatch):
        r = rows.request
        return r.sample_ids, r.num_tokens, r.prompt_lens, r.has_tokens
    prompts = [None if p < 0 else p for p in int32_values(rows.column(PROMPT_LEN)).tolist()]
    lengths = int32_values(rows.column(NUM_TOKENS)).astype(np.int64)
    return rows.column(SAMPLE_ID).to_pylist(), lengths, prompts, _has_tokens(rows)


def _has_tokens(batch: pa.RecordBatch) -> np.ndarray:
    """Whether each row has token ids (its list is valid; an emptied row's is empty, not null)."""
    tokens = batch.column(TOKEN_IDS)
    if tokens.null_count == 0:
        return np.ones(len(tokens), dtype=bool)
    bits = np.unpackbits(np.frombuffer(tokens.buffers()[0], np.uint8), bitorder="little")
    return bits[tokens.offset : tokens.offset + len(tokens)].astype(bool)


def _place_batch(
    batch: pa.RecordBatch,
    layout: Any,
    values: np.ndarray,
    row_at: np.ndarray,
    token_ids: np.ndarray,
    token_at: np.ndarray,
) -> None:
    """A batch read here, each row copied to `values[row_at[r]:]` (token ids likewise)."""
    src = stored_ids(batch, layout)
    lengths = int32_values(batch.column(NUM_TOKENS)).astype(np.int64)
    token_src, has = int32_values(list_values(batch.column(TOKEN_IDS))), _has_tokens(batch)
    for r, (a, n) in enumerate(zip(starts(lengths).tolist(), lengths.tolist(), strict=True)):
        values[row_at[r] : row_at[r] + n] = src[a : a + n]
    for r, a in zip(np.flatnonzero(has).tolist(), starts(lengths * has)[has].tolist(), strict=True):
        token_ids[token_at[r] : token_at[r] + lengths[r], 0] = token_src[a : a + lengths[r]]
