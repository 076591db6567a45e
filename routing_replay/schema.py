"""The Arrow form of routes: one row per sample, one fixed-size list of L*K ids per token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from routing_replay.errors import LayoutMismatchError
from routing_replay.layout import RoutingLayout

LAYOUT_METADATA_KEY = b"routing_replay.layout"
SAMPLE_ID, NUM_TOKENS, PROMPT_LEN, ROUTED_EXPERTS = (
    "sample_id",
    "num_tokens",
    "prompt_len",
    "routed_experts",
)


def routes_schema(layout: RoutingLayout) -> pa.Schema:
    """Schema of routes batches: ids stored narrow, the layout in the metadata."""
    token = pa.list_(pa.from_numpy_dtype(layout.dtype), layout.values_per_token)
    return pa.schema(
        [
            pa.field(SAMPLE_ID, pa.string(), nullable=False),
            pa.field(NUM_TOKENS, pa.int32(), nullable=False),
            pa.field(PROMPT_LEN, pa.int32()),
            pa.field(ROUTED_EXPERTS, pa.list_(token), nullable=False),
        ],
        metadata={LAYOUT_METADATA_KEY: layout.to_json().encode()},
    )


def routes_batch(
    layout: RoutingLayout,
    sample_ids: Sequence[str],
    num_tokens: np.ndarray,
    prompt_lens: Sequence[int | None],
    values: pa.Buffer,
) -> pa.RecordBatch:
    """Wrap a buffer of stored ids (samples back to back) as a routes batch, no copy."""
    schema = routes_schema(layout)
    token_type = schema.field(ROUTED_EXPERTS).type.value_type
    total = int(np.sum(num_tokens))
    flat = pa.Array.from_buffers(
        token_type.value_type, total * layout.values_per_token, [None, values]
    )
    tokens = pa.FixedSizeListArray.from_arrays(flat, layout.values_per_token)
    offsets = np.zeros(len(num_tokens) + 1, dtype=np.int32)
    np.cumsum(num_tokens, out=offsets[1:])
    routed = pa.ListArray.from_arrays(pa.array(offsets), tokens)
    columns = [
        pa.array(sample_ids, pa.string()),
        pa.array(np.asarray(num_tokens, dtype=np.int32)),
        pa.array(prompt_lens, pa.int32()),
        routed,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


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
