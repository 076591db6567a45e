"""The Arrow form of routes: one row per sample, one fixed-size list of L*K ids per token.

A row also carries the token ids the routes were recorded for (null when they were put
without them), so a trainer can check its batch against them (`to_torch(input_ids=)`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from routing_replay.errors import InvalidArgumentError, LayoutMismatchError
from routing_replay.layout import RoutingLayout

LAYOUT_METADATA_KEY = b"routing_replay.layout"
SAMPLE_ID, NUM_TOKENS, PROMPT_LEN, ROUTED_EXPERTS, TOKEN_IDS = (
    "sample_id",
    "num_tokens",
    "prompt_len",
    "routed_experts",
    "token_ids",
)


@functools.cache
def routes_schema(layout: RoutingLayout) -> pa.Schema:
    """Schema of routes batches: ids stored narrow, the layout in the metadata."""
    token = pa.list_(pa.from_numpy_dtype(layout.dtype), layout.values_per_token)
    return pa.schema(
        [
            pa.field(SAMPLE_ID, pa.string(), nullable=False),
            pa.field(NUM_TOKENS, pa.int32(), nullable=False),
            pa.field(PROMPT_LEN, pa.int32()),
            pa.field(ROUTED_EXPERTS, pa.list_(token), nullable=False),
            pa.field(TOKEN_IDS, pa.list_(pa.int32())),
        ],
        metadata={LAYOUT_METADATA_KEY: layout.to_json().encode()},
    )


def routes_batch(
    layout: RoutingLayout,
    sample_ids: Sequence[str],
    num_tokens: np.ndarray,
    prompt_lens: Sequence[int | None],
    values: pa.Buffer,
    token_ids: tuple[np.ndarray, pa.Buffer] | None = None,
) -> pa.RecordBatch:
    """Wrap a buffer of stored ids (samples back to back) as a routes batch, no copy.

    `token_ids`: (which samples have them, their int32 ids back to back), or None: none.
    """
    schema = routes_schema(layout)
    token_type = schema.field(ROUTED_EXPERTS).type.value_type
    total = int(np.sum(num_tokens))
    flat = pa.Array.from_buffers(
        token_type.value_type, total * layout.values_per_token, [None, values]
    )
    tokens = pa.FixedSizeListArray.from_arrays(flat, layout.values_per_token)
    offsets = np.zeros(len(num_tokens) + 1, dtype=np.int32)
    np.cumsum(num_tokens, out=offsets[1:])
    routed = pa.ListArray.from_arrays(_int32_array(offsets), tokens)
    columns = [
        _string_array(sample_ids),
        _int32_array(np.asarray(num_tokens, dtype=np.int32)),
        _int32_array(np.array([-1 if p is None else p for p in prompt_lens], dtype=np.int32)),
        routed,
        _token_ids_array(num_tokens, token_ids),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _token_ids_array(
    num_tokens: np.ndarray, token_ids: tuple[np.ndarray, pa.Buffer] | None
) -> pa.Array:
    """list<int32> of each sample's token ids; null (and empty) for samples without."""
    has = np.zeros(len(num_tokens), dtype=bool) if token_ids is None else token_ids[0]
    data = pa.py_buffer(b"") if token_ids is None else token_ids[1]
    offsets = np.zeros(len(num_tokens) + 1, dtype=np.int32)
    np.cumsum(np.where(has, num_tokens, 0), out=offsets[1:])
    validity = None if has.all() else pa.py_buffer(np.packbits(has, bitorder="little"))
    values = pa.Array.from_buffers(pa.int32(), int(offsets[-1]), [None, data])
    return pa.Array.from_buffers(
        pa.list_(pa.int32()),
        len(num_tokens),
        [validity, pa.py_buffer(offsets)],
        children=[values],
    )


def output_buffer(out: Any, nbytes: int) -> pa.Buffer:
    """The first `nbytes` of caller-provided memory as a writable Arrow buffer (no copy)."""
    try:
        arr = np.asarray(out)
        viewed = arr is out or arr.base is not None  # not a copy numpy made (a list, bytes)
    except (TypeError, ValueError, RuntimeError) as e:  # a GPU or meta tensor
        arr, viewed = None, f" ({e})"
    if arr is None or viewed is not True or arr.dtype.hasobject:
        why = viewed if isinstance(viewed, str) else ""
        raise InvalidArgumentError(
            f"out must be host memory numpy can view (a CPU tensor, an array, a bytearray), "
            f"got {type(out).__name__}{why}: read into host memory, then copy to the device"
        )
    if not (arr.flags.c_contiguous and arr.flags.writeable) or arr.nbytes < nbytes:
        raise InvalidArgumentError(
            f"out must be writable, C-contiguous memory of at least {nbytes} bytes (the "
            f"batch's tokens x layout.bytes_per_token), got {type(out).__name__} of "
            f"{arr.nbytes} bytes (contiguous={arr.flags.c_contiguous}, "
            f"writable={arr.flags.writeable}): allocate e.g. "
            f"torch.empty({nbytes}, dtype=torch.uint8, pin_memory=True) once and reuse it"
        )
    return pa.py_buffer(arr.reshape(-1).view(np.uint8)[:nbytes])


# Arrays are built from buffers: `pa.array` imports pandas on first use (0.2-0.5 s in a
# fresh trainer process), which a record batch of ids and ints does not need.


def _int32_array(values: np.ndarray) -> pa.Array:
    """int32 Arrow array from numpy, negative entries as nulls (counts are never negative)."""
    values = np.ascontiguousarray(values, dtype=np.int32)
    missing = values < 0
    validity = None
    if missing.any():
        validity = pa.py_buffer(np.packbits(~missing, bitorder="little"))
    return pa.Array.from_buffers(pa.int32(), len(values), [validity, pa.py_buffer(values)])


def _string_array(strings: Sequence[str]) -> pa.Array:
    """UTF-8 Arrow string array from Python strings."""
    encoded = [x.encode() for x in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = pa.py_buffer(b"".join(encoded))
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets), data])


def layout_of(data: pa.RecordBatch | pa.Table | pa.Schema) -> RoutingLayout:
    """The routing layout recorded in a routes batch, table or schema."""
    schema = data if isinstance(data, pa.Schema) else data.schema
    meta = schema.metadata or {}
    if LAYOUT_METADATA_KEY not in meta:
        raise LayoutMismatchError(
            "this Arrow data carries no routing layout metadata: it was not made by "
            "RoutingStore.read (or its schema metadata was dropped on the way)"
        )
    return RoutingLayout.from_json(meta[LAYOUT_METADATA_KEY])


# Reading columns back: numpy views of the buffers. `Array.to_numpy` imports pandas and
# `flatten` pyarrow.compute on first use (0.2 s in a fresh trainer process); neither is needed.


def int32_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of a non-null int32 column (`num_tokens`, a list's values), as numpy."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts = [
        np.frombuffer(c.buffers()[1], np.int32, count=len(c), offset=c.offset * 4)
        for c in chunks
        if len(c)
    ]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)


def list_values(array: pa.ListArray) -> pa.Array:
    """The child values of a list array's rows (its slice of them, not the whole child)."""
    offsets = np.frombuffer(
        array.buffers()[1], np.int32, count=len(array) + 1, offset=array.offset * 4
    )
    return array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))


def routes_values(chunk: pa.ListArray) -> pa.Array:
    """The stored ids of a routes chunk's rows, back to back (`[sum_T * L * K]`)."""
    tokens = list_values(chunk)
    width = tokens.type.list_size
    return tokens.values.slice(tokens.offset * width, len(tokens) * width)
