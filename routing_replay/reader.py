"""From Arrow routes batches to torch tensors: packed `[sum_T, L, K]` or padded `[B, S, L, K]`.

What `to_torch` returns is a `RoutesTensor`: it carries the batch's layout, and `replay`
checks it against the model's routers.

Copies: `RoutingStore.read` gathers a batch's pages out of shared memory into one Arrow
buffer, or into memory the caller reuses (`out=`) (the one copy of a local read; needed
because a sample's pages are not contiguous, and a view would outlive the mapping). Arrow
-> numpy -> torch is zero-copy for a batch in this process's own memory, also for a table
of batches read into consecutive slices of one buffer (other multi-batch tables are
concatenated, one copy): the packed tensor *is* the Arrow buffer, reinterpreted as
`layout.signed_dtype` (int8 up to 128 experts: the stored marker 255 reads as -1). A batch
in memory this process does not own (read-only Arrow buffers: Ray's object store, an IPC
file) is copied (1-2 bytes a token), so writing to the tensor never changes what other
readers see. Padding is a copy, into the padded tensor; a layout whose ids need a wider
signed type (129-255 experts) widens in that pass.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import torch

from routing_replay.errors import InvalidRoutesError, TokenMismatchError
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.routes import RoutesTensor, with_layout
from routing_replay.schema import (
    NUM_TOKENS,
    ROUTED_EXPERTS,
    SAMPLE_ID,
    TOKEN_IDS,
    int32_values,
    layout_of,
    list_values,
    routes_values,
)


def stored_ids(batch: pa.RecordBatch | pa.Table, layout: RoutingLayout) -> np.ndarray:
    """The narrow ids of every token of a batch, `[sum_T, L*K]`, without copying."""
    column = batch.column(ROUTED_EXPERTS)
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    flat = [routes_values(chunk) for chunk in chunks if len(chunk)]
    if len(flat) <= 1:
        ids = _values(flat[0], layout.dtype) if flat else np.empty(0, layout.dtype)
    else:
        ids = _adjacent_values(flat, layout.dtype)
        if ids is None:
            ids = np.concatenate([_values(f, layout.dtype) for f in flat])
    return ids.reshape(-1, layout.values_per_token)


def _values(array: pa.Array, dtype: np.dtype) -> np.ndarray:
    """A primitive Arrow array's values as numpy, writable when its buffer is."""
    buf = array.buffers()[1]
    return np.frombuffer(buf, dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _adjacent_values(arrays: list[pa.Array], dtype: np.dtype) -> np.ndarray | None:
    """The values of primitive arrays that lie back to back in memory (batches read into
    consecutive slices of one `out` buffer) as one numpy view; None if they do not."""
    starts = [a.buffers()[1].address + a.offset * dtype.itemsize for a in arrays]
    ends = [start + len(a) * dtype.itemsize for start, a in zip(starts, arrays, strict=True)]
    if starts[1:] != ends[:-1]:
        return None
    # The view keeps every chunk's buffer alive, so all the memory it spans stays valid.
    span = pa.foreign_buffer(starts[0], ends[-1] - starts[0], base=[a.buffers() for a in arrays])
    return np.frombuffer(span, dtype)


def cu_seqlens(batch: pa.RecordBatch | pa.Table) -> torch.Tensor:
    """Cumulative token counts `[B + 1]` (int32) of a routes batch, for packed sequences."""
    lengths = int32_values(batch.column(NUM_TOKENS))
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return torch.from_numpy(out)


def to_torch(
    batch: pa.RecordBatch | pa.Table,
    attention_mask: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> RoutesTensor:
    """Routes of a batch, -1 where missing: packed `[sum_T, L, K]`, or padded `[B, S, L, K]`,
    as a `RoutesTensor` that carries the batch's layout to `replay`.

    The dtype is `layout.signed_dtype` (torch.int8 up to 128 experts, int16 beyond): ids
    are small, and replay widens them on the device. Without `attention_mask` the samples
    are packed back to back (see `cu_seqlens`), with no copy when the batch is in this
    process's memory (the tensor shares its buffer), copied when it is not (a batch from
    Ray's object store); for replay on a packed `[1, sum_T]` batch, `unsqueeze(0)` it.
    With the `[B, S]` mask of a padded batch (left or right padding), sample b's routes
    fill row b's unmasked positions, which must be one contiguous run of exactly
    `num_tokens[b]` positions.

    With `input_ids` (`[B, S]` padded, `[sum_T]` or `[1, sum_T]` packed), every token is
    compared with the token ids the routes were put with: `TokenMismatchError` names the
    sample and the first differing position.
    """
    layout = layout_of(batch)
    L, K = layout.num_moe_layers, layout.top_k
    stored = stored_ids(batch, layout)
    lengths = int32_values(batch.column(NUM_TOKENS))
    if attention_mask is None:
        if input_ids is not None:
            trained = torch.as_tensor(input_ids).cpu()
            total = int(lengths.sum())
            if tuple(trained.shape) not in ((total,), (1, total)):
                raise InvalidRoutesError(
                    f"packed input_ids must be [sum_T={total}] or [1, sum_T], got "
                    f"{tuple(trained.shape)}"
                )
            check_tokens(batch, trained.reshape(-1).numpy(), np.zeros(len(lengths)), None)
        packed = layout.decode(stored.reshape(-1, L, K))
        if packed.flags.writeable:
            return with_layout(torch.from_numpy(packed), layout)
        if not _own_memory(batch):  # Ray's object store, a file: never alias it
            return with_layout(torch.from_numpy(packed.copy()), layout)
        with warnings.catch_warnings():
            # Back-to-back batches of one `out` buffer, viewed as one span: numpy calls the
            # span read-only, but it is this process's writable memory, aliased by nothing.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return with_layout(torch.from_numpy(packed), layout)
    mask = torch.as_tensor(attention_mask).bool().cpu()
    if mask.ndim != 2 or mask.shape[0] != len(lengths):
        raise InvalidRoutesError(
            f"attention_mask must be [batch={len(lengths)}, seq_len], got {tuple(mask.shape)}"
        )
    counts = mask.sum(1).numpy()
    starts = mask.int().argmax(1).numpy() if mask.shape[1] else np.zeros(len(mask), np.int64)
    for b, (n, start) in enumerate(zip(lengths, starts, strict=True)):
        if counts[b] != n or not bool(mask[b, start : start + n].all()):
            raise InvalidRoutesError(
                f"row {b} of attention_mask has {int(counts[b])} tokens but sample {b} has "
                f"{int(n)} routed tokens, or its tokens are not one contiguous run: routes "
                "must cover exactly the tokens the trainer forwards, in order"
            )
    if input_ids is not None:
        trained = torch.as_tensor(input_ids).cpu()
        if tuple(trained.shape) != tuple(mask.shape):
            raise InvalidRoutesError(
                f"input_ids {tuple(trained.shape)} and attention_mask {tuple(mask.shape)} "
                "must have the same [B, S] shape"
            )
        columns = np.concatenate(
            [np.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
        )
        rows = np.repeat(np.arange(len(lengths)), lengths)
        check_tokens(batch, trained.numpy()[rows, columns], starts, mask.shape[1])
    B, S = mask.shape
    out_np = np.full((B, S, L, K), MISSING, dtype=layout.signed_dtype)
    row = 0
    for b, (n, start) in enumerate(zip(lengths.tolist(), starts.tolist(), strict=True)):
        layout.decode(stored[row : row + n].reshape(n, L, K), out=out_np[b, start : start + n])
        row += n
    return with_layout(torch.from_numpy(out_np), layout)


def _own_memory(batch: pa.RecordBatch | pa.Table) -> bool:
    """Whether every routes buffer of the batch is writable memory of this process (a read
    of this process, or the `out` it was read into): Arrow says "mutable"."""
    column = batch.column(ROUTED_EXPERTS)
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    return all(routes_values(c).buffers()[1].is_mutable for c in chunks if len(c))


def check_tokens(
    batch: pa.RecordBatch | pa.Table,
    trained_T: np.ndarray,
    starts: np.ndarray,
    width: int | None,
    positions: np.ndarray | None = None,
) -> None:
    """Compare the tokens a trainer forwards, the batch's samples back to back (`[sum_T]`),
    with the token ids the routes were put with; raise `TokenMismatchError` on the first
    difference. `starts[b]`: where sample b begins in its row (`width`: the row length;
    None for a packed batch; `positions`: each token's position in its sample, for rows
    that hold token ranges)."""
    names = batch.schema.names
    column = batch.column(TOKEN_IDS) if TOKEN_IDS in names else None
    sample_ids = batch.column(SAMPLE_ID).to_pylist()
    lengths = int32_values(batch.column(NUM_TOKENS)).astype(np.int64)
    if column is None or column.null_count:
        b = 0 if column is None else int(np.flatnonzero(column.is_null().to_numpy(False))[0])
        raise InvalidRoutesError(
            f"sample {sample_ids[b]!r} was put without token_ids, so its tokens cannot be "
            "checked: pass token_ids= to store.put (the engine adapters do), or call without "
            "input_ids to skip the check"
        )
    recorded_T = int32_values(list_values(pa.chunked_array(column).combine_chunks()))
    differs = np.flatnonzero(recorded_T != trained_T)
    if not len(differs):
        return
    first = int(differs[0])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    b = int(np.searchsorted(offsets, first, side="right") - 1)
    pos = first - int(offsets[b])
    if positions is not None:
        where = f"position {int(positions[first])} (token {first} of the ranged batch)"
    elif width is not None:
        where = f"position {pos} (column {int(starts[b]) + pos} of row {b})"
    else:
        where = f"position {pos} (token {first} of the packed batch)"
    in_sample = int(np.sum((differs >= offsets[b]) & (differs < offsets[b + 1])))
    raise TokenMismatchError(
        f"sample {sample_ids[b]!r}: the trainer's token at {where} is {int(trained_T[first])} "
        f"but the routes were recorded for token {int(recorded_T[first])} ({in_sample} of its "
        f"{int(lengths[b])} tokens differ, {len(differs)} in the batch): the training batch "
        "does not hold the rollout's tokens (text re-tokenised, e.g. a chat template applied "
        "again, or rows reordered). Train on the token ids the rollout returned"
    )
