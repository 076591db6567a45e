"""NeMo-RL-style trainer batches: routes aligned with `input_ids`, then CP and SP slices.

A batch is a dict of tensors: `input_ids` `[B, S]` (right padded), `input_lengths` `[B]`,
and the samples' `RoutingRef`s (a list under `routing_refs`, None where a row has no
routes). `attach_routes` adds `routed_experts` `[B, S, L, K]` (signed ids, -1 missing),
`pack` turns the batch into `[1, sum_T]` with `cu_seqlens` the way NeMo-RL packs for
Megatron (each sequence padded to a multiple of 2 x CP (x TP with sequence parallelism)),
and the slicing functions cut ids and routes identically, as Megatron cuts `input_ids`:

- context parallel (`cp_slice`): the sequence in 2 x CP chunks, rank r keeps chunks r and
  2 x CP - 1 - r (`megatron.core.utils.get_batch_on_this_cp_rank`; per sequence for packed
  THD batches, as Transformer Engine's `thd_get_partitioned_indices`);
- sequence parallel (`sp_slice`): after the embedding, each tensor-parallel rank keeps a
  contiguous 1/TP of the (CP-local) sequence (`scatter_to_sequence_parallel_region`).

`read_rank_routes` gives a rank the same routes while reading only its tokens' ranges.

`fill_missing` gives rows without routes real ids for engines whose dispatch needs one per
row (Megatron's RouterReplay): distinct within a row, spread over every expert and so every
expert-parallel rank, never a column of expert 0 (verl #4986).

`replay_batch` replays a (micro-)batch's routes in a transformers model, with
`replay_tolerance`; with `metrics=StepMetrics()` the step's blocks are kept, and
`metrics.pop()` after the step's backward is the plain dict to log (`replay/rows_replayed`,
`replay/rows_missing`, `replay/native_agreement`, `replay/replace_rate`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from routing_replay import MISSING, RoutesTensor, RoutingRef, TokenShard, to_torch, with_layout
from routing_replay.errors import InvalidArgumentError, InvalidRoutesError
from routing_replay.integrations._reads import Fetch, check_row_tokens, fetch_checked, read_shard
from routing_replay.integrations._rows import fill_missing as fill_missing  # (public here too)
from routing_replay.integrations.replay_metrics import StepMetrics as StepMetrics  # (public)
from routing_replay.schema import layout_of

ROUTES_KEY = "routed_experts"
REFS_KEY = "routing_refs"


def attach_routes(
    batch: dict[str, Any],
    *,
    fetch: Fetch | None = None,
    refs_key: str = REFS_KEY,
    key: str = ROUTES_KEY,
) -> dict[str, Any]:
    """Fetch the batch's routes and add `batch[key]` `[B, S, L, K]` aligned with input_ids.

    Row b's routes fill positions `[0, input_lengths[b])` (right padding); padding and rows
    whose ref is None are -1 (missing: replay routes those natively). Every row's tokens
    are checked against those its routes were put with (`TokenMismatchError`). `fetch` turns refs
    into an Arrow routes batch (default: `routing_replay.ray.fetch_batch`, Ray-aware;
    `store.read` for one process). Returns the same dict.
    """
    input_ids, lengths = _ids_and_lengths(batch)
    B, S = input_ids.shape
    refs, rows = _refs_and_rows(batch, refs_key, lengths)
    table = fetch_checked([refs[b] for b in rows], fetch)
    layout = layout_of(table)
    mask = torch.zeros((len(rows), S), dtype=torch.bool)
    for i, b in enumerate(rows):
        mask[i, : int(lengths[b])] = True
    fetched = to_torch(table, attention_mask=mask, input_ids=input_ids[torch.tensor(rows)])
    out = torch.full((B, S, layout.num_moe_layers, layout.top_k), MISSING, dtype=fetched.dtype)
    out[torch.tensor(rows)] = fetched
    batch[key] = with_layout(out, layout)  # replay checks it against the model's routers
    return batch


def _refs_and_rows(
    batch: dict[str, Any], refs_key: str, lengths: torch.Tensor
) -> tuple[list[RoutingRef | None], list[int]]:
    """The batch's refs, and the rows that have one (each checked against its row's length)."""
    refs = list(batch[refs_key])
    if len(refs) != len(lengths):
        raise InvalidRoutesError(
            f"batch[{refs_key!r}] has {len(refs)} refs for {len(lengths)} rows"
        )
    check_row_tokens(refs, lengths.tolist())
    rows = [b for b, r in enumerate(refs) if r is not None]
    if not rows:
        raise InvalidRoutesError(f"no row of the batch has a ref in batch[{refs_key!r}]")
    return refs, rows


def _ids_and_lengths(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = batch["input_ids"]
    lengths = torch.as_tensor(batch["input_lengths"])
    if input_ids.ndim != 2 or lengths.shape != (input_ids.shape[0],):
        raise InvalidRoutesError(
            f"input_ids must be [B, S] and input_lengths [B], got {tuple(input_ids.shape)} and "
            f"{tuple(lengths.shape)}"
        )
    if (lengths < 0).any() or (lengths > input_ids.shape[1]).any():
        raise InvalidRoutesError(
            f"input_lengths must be in [0, {input_ids.shape[1]}], got {lengths.tolist()}"
        )
    return input_ids, lengths


def pack(
    batch: dict[str, Any],
    *,
    multiple: int = 1,
    pad_id: int = 0,
    key: str = ROUTES_KEY,
) -> dict[str, Any]:
    """Sequence packing `[B, S]` -> `[1, sum_T]`: each sequence padded to `multiple`.

    Returns a new dict: `input_ids` `[1, T]`, `position_ids` `[1, T]`, `cu_seqlens`
    (padded boundaries, int32 `[B + 1]`), `cu_seqlens_unpadded`, and `batch[key]` packed to
    `[1, T, L, K]` with padding positions missing. For Megatron with CP use
    `multiple = 2 * cp_size` (times `tp_size` with sequence parallelism), as NeMo-RL does.
    """
    input_ids, lengths = _ids_and_lengths(batch)
    if multiple < 1:
        raise InvalidArgumentError(f"multiple must be >= 1, got {multiple}")
    padded = (lengths + multiple - 1) // multiple * multiple
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(padded, 0)
    cu_unpadded = torch.zeros_like(cu)
    cu_unpadded[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    ids = torch.full((1, total), pad_id, dtype=input_ids.dtype)
    pos = torch.zeros((1, total), dtype=torch.long)
    routes = batch.get(key)
    out_routes = None
    if routes is not None:
        out_routes = torch.full((1, total, *routes.shape[2:]), MISSING, dtype=routes.dtype)
        if isinstance(routes, RoutesTensor) and routes.layout is not None:
            out_routes = with_layout(out_routes, routes.layout)
    for b, n in enumerate(lengths.tolist()):
        start = int(cu[b])
        ids[0, start : start + n] = input_ids[b, :n]
        pos[0, start : int(cu[b + 1])] = torch.arange(int(padded[b]))
        if out_routes is not None:
            out_routes[0, start : start + n] = routes[b, :n]
    packed = {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu}
    packed["cu_seqlens_unpadded"] = cu_unpadded
    if out_routes is not None:
        packed[key] = out_routes
    return packed


def cp_slice(
    x: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    seq_dim: int = 1,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This CP rank's part of `x` along `seq_dim`: chunks r and 2*CP-1-r of 2*CP (zigzag).

    Padded `[B, S, ...]`: the whole sequence dimension in 2*CP chunks (Megatron's
    `get_batch_on_this_cp_rank`). Packed (with `cu_seqlens`, padded boundaries): every
    sequence on its own, results concatenated (Transformer Engine's THD partitioning).
    """
    if not 0 <= cp_rank < cp_size:
        raise InvalidArgumentError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if cp_size == 1:
        return x
    if cu_seqlens is None:
        return _zigzag(x, cp_size, cp_rank, seq_dim)
    bounds = torch.as_tensor(cu_seqlens).tolist()
    if bounds[-1] != x.shape[seq_dim]:
        raise InvalidRoutesError(
            f"cu_seqlens ends at {bounds[-1]}, the tensor has {x.shape[seq_dim]} positions"
        )
    parts = [
        _zigzag(x.narrow(seq_dim, a, b - a), cp_size, cp_rank, seq_dim)
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(parts, dim=seq_dim)


def _zigzag(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int) -> torch.Tensor:
    S = x.shape[seq_dim]
    if S % (2 * cp_size):
        raise InvalidRoutesError(
            f"a sequence of {S} positions does not split into 2*cp_size = {2 * cp_size} "
            "equal chunks: pad sequences to a multiple of 2*cp_size (pack(multiple=...))"
        )
    chunks = x.unflatten(seq_dim, (2 * cp_size, S // (2 * cp_size)))
    index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=x.device)
    return chunks.index_select(seq_dim, index).flatten(seq_dim, seq_dim + 1)


def sp_slice(x: torch.Tensor, tp_size: int, tp_rank: int, *, seq_dim: int = 1) -> torch.Tensor:
    """This TP rank's contiguous 1/TP of the sequence (Megatron sequence parallelism)."""
    if not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    S = x.shape[seq_dim]
    if S % tp_size:
        raise InvalidRoutesError(
            f"{S} positions do not split over tp_size = {tp_size} ranks: pad to a multiple "
            "of tp_size (and of 2*cp_size*tp_size with context parallelism)"
        )
    return x.narrow(seq_dim, tp_rank * (S // tp_size), S // tp_size)


def routes_for_rank(
    batch: dict[str, Any],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
    key: str = ROUTES_KEY,
) -> torch.Tensor:
    """The routes this (CP, TP) rank's routers see: CP zigzag, then the SP scatter.

    `batch` is padded `[B, S, ...]` or packed (`cu_seqlens` present, `[1, T, ...]`).
    """
    cut = _rank_cut(batch.get("cu_seqlens"), cp_size, cp_rank, tp_size, tp_rank, sequence_parallel)
    return cut(batch[key])


def _rank_cut(
    cu: torch.Tensor | None,
    cp_size: int,
    cp_rank: int,
    tp_size: int,
    tp_rank: int,
    sequence_parallel: bool,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a (CP, TP) rank's routers see of a `[B, S, ...]` / packed `[1, T, ...]` tensor."""

    def cut(x: torch.Tensor) -> torch.Tensor:
        x = cp_slice(x, cp_size, cp_rank, cu_seqlens=cu)
        return sp_slice(x, tp_size, tp_rank) if sequence_parallel else x

    return cut


def read_rank_routes(
    batch: dict[str, Any],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
    pack_multiple: int | None = None,
    fetch: Fetch | None = None,
    refs_key: str = REFS_KEY,
) -> RoutesTensor:
    """The routes this (CP, TP) rank's routers see, reading only the tokens it holds.

    Equal to `routes_for_rank(attach_routes(batch), ...)` for the padded `[B, S]` batch, or
    with `pack_multiple` to `routes_for_rank(pack(attach_routes(batch), multiple=...), ...)`,
    but each sample's routes are read as the token ranges of this rank's CP chunks (and SP
    slice): about 1/(CP x TP) of them with sequence parallelism, 1/CP without. The rank's
    tokens are checked against the stored ones. `fetch(refs, ranges=...)` reads (default
    `routing_replay.ray.fetch_batch`; `store.read` in one process).
    """
    input_ids, lengths = _ids_and_lengths(batch)
    B, S = input_ids.shape
    refs, rows = _refs_and_rows(batch, refs_key, lengths)
    shard = TokenShard.padded([int(lengths[b]) for b in rows], S).map(
        lambda index: _rows_of(index, rows, B)
    )
    ids, cu = input_ids, None
    if pack_multiple is not None:
        packed_ids = pack(
            {"input_ids": input_ids, "input_lengths": lengths}, multiple=pack_multiple
        )
        ids, cu = packed_ids["input_ids"], packed_ids["cu_seqlens"]
        shard = shard.map(
            lambda index: pack(
                {"input_ids": index, "input_lengths": lengths},
                multiple=pack_multiple,
                pad_id=MISSING,
            )["input_ids"]
        )
    cut = _rank_cut(cu, cp_size, cp_rank, tp_size, tp_rank, sequence_parallel)
    return read_shard([refs[b] for b in rows], shard.map(cut), cut(ids), fetch)


def _rows_of(index: torch.Tensor, rows: list[int], num_rows: int) -> torch.Tensor:
    """`index` of the rows with refs as `[num_rows, S]`: the others all padding."""
    out = torch.full((num_rows, index.shape[1]), MISSING, dtype=index.dtype)
    out[torch.tensor(rows)] = index
    return out


def input_ids_for_rank(
    batch: dict[str, Any],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """This CP rank's `input_ids` (Megatron scatters SP after the embedding, not here)."""
    return cp_slice(batch["input_ids"], cp_size, cp_rank, cu_seqlens=batch.get("cu_seqlens"))


def replay_batch(
    model: torch.nn.Module,
    batch: dict[str, Any] | torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    replay_tolerance: float | None = None,
    metrics: StepMetrics | None = None,
    key: str = ROUTES_KEY,
) -> Any:
    """A `replay` block for a batch: use it as `with replay_batch(...):` around the forward
    *and* backward. Returns the `Replay` (its `.metrics()` is the block's own dict).

    `batch` is a dict holding routes under `key` (`attach_routes`, `pack`) or the routes
    tensor itself (`routes_for_rank`, `read_rank_routes`). The attention mask is
    `attention_mask`, else, for a padded `[B, S]` batch with `input_lengths`, its first
    `input_lengths[b]` positions per row; a packed batch needs none (its pads are missing
    rows). `replay_tolerance` (None: exact; r in (0, 1]: a recorded expert the trainer scores
    below r x its weakest own top-k expert is replaced by its own) goes to `replay`.
    `metrics` (a `StepMetrics`) keeps the block, read when the step is done: `metrics.pop()`
    sums the step's rows and weights its rates by rows replayed.
    """
    from routing_replay import replay

    routes = batch
    if isinstance(batch, dict):
        routes = batch[key]
        if attention_mask is None and "input_lengths" in batch and "cu_seqlens" not in batch:
            _, lengths = _ids_and_lengths(batch)
            width = routes.shape[1]
            attention_mask = (torch.arange(width) < lengths[:, None]).to(torch.long)
    block = replay(model, routes, attention_mask=attention_mask, tolerance=replay_tolerance)
    if metrics is not None:
        metrics.add(block)
    return block
