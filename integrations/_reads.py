"""The trainer side's reads, shared by the batch integrations (NeMo-RL-style, verl).

`fetch_checked` reads refs (default `routing_replay.ray.fetch_batch`) and checks that what
came back is those samples in that order; `read_shard` reads only the tokens a rank holds
and puts them where its model sees them; `check_row_tokens` ties each row to its ref by its
token count. Each check and its wording live here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import torch

from routing_replay import RoutesTensor, RoutingRef, TokenShard
from routing_replay.errors import InvalidRoutesError
from routing_replay.schema import NUM_TOKENS, SAMPLE_ID

Fetch = Callable[..., pa.RecordBatch]  # fetch(refs) or fetch(refs, ranges=...)


def fetch_checked(
    refs: Sequence[RoutingRef], fetch: Fetch | None = None, **kwargs: Any
) -> pa.RecordBatch | pa.Table:
    """`fetch(refs, **kwargs)`, refused unless it returned exactly those samples in order
    (and, reading whole samples, each with its ref's token count)."""
    if fetch is None:
        from routing_replay.ray import fetch_batch as fetch
    table = fetch(list(refs), **kwargs)
    got = table.column(SAMPLE_ID).to_pylist()
    want = [r.sample_id for r in refs]
    if got != want:
        raise InvalidRoutesError(f"fetch returned samples {got}, asked for {want} in that order")
    if kwargs.get("ranges") is None:  # whole samples: each its ref's token count
        counts = table.column(NUM_TOKENS).to_pylist()
        if counts != [r.num_tokens for r in refs]:
            raise InvalidRoutesError(f"fetched token counts {counts} differ from the refs'")
    return table


def read_shard(
    refs: Sequence[RoutingRef],
    shard: TokenShard,
    local_ids: torch.Tensor,
    fetch: Fetch | None = None,
) -> RoutesTensor:
    """The routes of the tokens `shard` holds (already cut as the rank's model input), read
    as their ranges only and placed as the rank sees them, checked against `local_ids`."""
    table = fetch_checked(refs, fetch, ranges=shard.ranges())
    return shard.place(table, input_ids=local_ids)


def check_row_tokens(refs: Sequence[RoutingRef | None], lengths: Sequence[int]) -> None:
    """Each row's ref covers exactly the row's tokens (None: a row without routes)."""
    for b, (ref, n) in enumerate(zip(refs, lengths, strict=True)):
        if ref is not None and ref.num_tokens != int(n):
            raise InvalidRoutesError(
                f"row {b}: sample {ref.sample_id!r} has {ref.num_tokens} routed tokens but the "
                f"row holds {int(n)}: routes cover exactly the tokens the trainer forwards "
                "(prompt + completion), so the ref is not this row's (rows reordered without "
                "their refs?); rebuild the batch from the rollout"
            )
