"""`routes_collate_fn(layout)`: a routes dataset's batches as packed torch tensors, for
`Dataset.iter_torch_batches` (variable-length lists do not go through Ray's default
collate): `[sum_T, L, K]` routes plus `cu_seqlens`, sample ids and token ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from routing_replay.errors import LayoutMismatchError
from routing_replay.layout import RoutingLayout
from routing_replay.reader import cu_seqlens, to_torch
from routing_replay.schema import (
    LAYOUT_METADATA_KEY,
    SAMPLE_ID,
    TOKEN_IDS,
    int32_values,
    layout_of,
    list_values,
    routes_schema,
)


class _RoutesCollate:
    """Arrow batch -> {"routes": [sum_T, L, K], "cu_seqlens": [B+1], "num_tokens",
    "sample_ids", "token_ids": [sum_T] (None when a sample was put without them)}."""

    def __init__(self, layout: RoutingLayout | None) -> None:
        self.layout = layout

    def __call__(self, batch: pa.Table | dict[str, np.ndarray]) -> dict[str, Any]:
        table = _as_table(batch, self.layout)
        out: dict[str, Any] = {
            "routes": to_torch(table),
            "cu_seqlens": cu_seqlens(table),
            "num_tokens": torch.from_numpy(
                int32_values(table.column("num_tokens")).astype(np.int64)
            ),
            "sample_ids": table.column(SAMPLE_ID).to_pylist(),
            "token_ids": _packed_tokens(table),
        }
        return out


def _packed_tokens(table: pa.Table) -> torch.Tensor | None:
    """The batch's token ids back to back (`[sum_T]`, int32), or None if any sample lacks them."""
    if TOKEN_IDS not in table.schema.names or table.column(TOKEN_IDS).null_count:
        return None
    column = pa.chunked_array(table.column(TOKEN_IDS)).combine_chunks()
    return torch.from_numpy(int32_values(list_values(column)).copy())


def _as_table(batch: pa.Table | dict[str, np.ndarray], layout: RoutingLayout | None) -> pa.Table:
    """A batch from Ray Data as a routes table carrying the layout metadata."""
    if isinstance(batch, dict):  # a numpy batch: rows of object arrays; slow but correct
        if layout is None:
            raise LayoutMismatchError("routes_collate_fn needs the layout for numpy batches")
        rows = [
            {
                "sample_id": str(batch["sample_id"][i]),
                "num_tokens": int(batch["num_tokens"][i]),
                "prompt_len": None
                if batch["prompt_len"][i] is None
                else int(batch["prompt_len"][i]),
                "routed_experts": [list(t) for t in batch["routed_experts"][i]],
                "token_ids": None
                if batch.get("token_ids") is None or batch["token_ids"][i] is None
                else [int(t) for t in batch["token_ids"][i]],
            }
            for i in range(len(batch["sample_id"]))
        ]
        return pa.Table.from_pylist(rows, schema=routes_schema(layout))
    meta = batch.schema.metadata or {}
    if LAYOUT_METADATA_KEY in meta:
        if layout is not None and layout_of(batch) != layout:
            raise LayoutMismatchError(
                f"batch holds routes for {layout_of(batch)}, the collate fn expects {layout}"
            )
        return batch
    if layout is None:
        raise LayoutMismatchError(
            "this batch lost its layout metadata on the way through Ray Data: pass the "
            "layout to routes_collate_fn(layout)"
        )
    return batch.replace_schema_metadata({**meta, LAYOUT_METADATA_KEY: layout.to_json().encode()})


def routes_collate_fn(layout: RoutingLayout | None = None) -> Callable[[Any], dict[str, Any]]:
    """Collate fn for `Dataset.iter_torch_batches`: packed `[sum_T, L, K]` routes + cu_seqlens."""
    from ray.data.collate_fn import ArrowBatchCollateFn

    class RoutesCollateFn(_RoutesCollate, ArrowBatchCollateFn):
        """Ray Data reads it as an Arrow-batch collate fn (no default numpy conversion)."""

    return RoutesCollateFn(layout)
