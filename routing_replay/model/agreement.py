"""Agreement between recorded and native routes: the paper's routing-mismatch measure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routing_replay.errors import InvalidRoutesError
from routing_replay.layout import MISSING, RoutingLayout


@dataclass(frozen=True)
class Agreement:
    """How often two routings of the same tokens chose the same top-k expert sets."""

    router_agreement: float  # fraction of (token, layer) decisions with the same top-k set
    token_disagreement: float  # fraction of tokens with at least one disagreeing layer
    per_layer: np.ndarray  # [L] fraction of decisions agreeing, per MoE layer (nan: none)
    expert_overlap: float  # mean |recorded ∩ native| / K over decisions
    num_decisions: int  # (token, layer) pairs compared: neither side missing
    num_tokens: int  # tokens with at least one compared layer
    layers: tuple[int, ...]  # global layer index of each per_layer entry

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "router_agreement": self.router_agreement,
            "token_disagreement": self.token_disagreement,
            "per_layer": [None if np.isnan(x) else float(x) for x in self.per_layer],
            "expert_overlap": self.expert_overlap,
            "num_decisions": self.num_decisions,
            "num_tokens": self.num_tokens,
            "layers": list(self.layers),
        }


def routing_agreement(recorded: Any, native: Any, layout: RoutingLayout | None = None) -> Agreement:
    """Compare two routings ([..., L, K] or lists of [T, L, K]) as top-k sets; skip -1 rows.

    With `layout`, per-layer results are labelled with global layer indices (else 0..L-1).
    """
    rec, nat = _as_array(recorded), _as_array(native)
    if rec.shape != nat.shape or rec.ndim < 3:
        raise InvalidRoutesError(
            f"routes to compare must have equal shapes [..., L, K] ([T, L, K], padded "
            f"[B, S, L, K]), got {list(rec.shape)} and {list(nat.shape)}"
        )
    rec_TLK, nat_TLK = rec.reshape(-1, *rec.shape[-2:]), nat.reshape(-1, *nat.shape[-2:])
    compared_TL = ~((rec_TLK == MISSING).any(-1) | (nat_TLK == MISSING).any(-1))
    rec_TLK, nat_TLK = np.sort(rec_TLK, axis=-1), np.sort(nat_TLK, axis=-1)
    same_TL = (rec_TLK == nat_TLK).all(-1) & compared_TL
    # |A ∩ B| for sets of distinct ids: count of ids of A found in B.
    overlap_TL = (rec_TLK[..., :, None] == nat_TLK[..., None, :]).any(-1).sum(-1)
    decisions = int(compared_TL.sum())
    tokens_T = compared_TL.any(-1)
    num_tokens = int(tokens_T.sum())
    per_layer_counts = compared_TL.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = same_TL.sum(0) / per_layer_counts
    disagree_T = (compared_TL & ~same_TL).any(-1)
    k = rec_TLK.shape[-1]
    layers = tuple(range(rec_TLK.shape[1])) if layout is None else layout.moe_layers
    if len(layers) != rec_TLK.shape[1]:
        raise InvalidRoutesError(
            f"routes have {rec_TLK.shape[1]} layers but the layout has {len(layers)} MoE layers"
        )
    return Agreement(
        router_agreement=_ratio(int(same_TL.sum()), decisions),
        token_disagreement=_ratio(int(disagree_T.sum()), num_tokens),
        per_layer=per_layer.astype(np.float64),
        expert_overlap=_ratio(int(overlap_TL[compared_TL].sum()), decisions * k),
        num_decisions=decisions,
        num_tokens=num_tokens,
        layers=tuple(layers),
    )


def _ratio(num: int, den: int) -> float:
    return num / den if den else float("nan")


def _as_array(routes: Any) -> np.ndarray:
    if isinstance(routes, Sequence) and not isinstance(routes, np.ndarray):
        parts = [_as_array(r) for r in routes]
        return np.concatenate(parts) if parts else np.zeros((0, 0, 0), np.int64)
    if hasattr(routes, "detach"):  # torch tensor, without importing torch
        routes = routes.detach().cpu().numpy()
    arr = np.asarray(routes)
    if arr.dtype.kind != "i":
        raise InvalidRoutesError(
            f"routes must hold signed integer ids with -1 for missing, got dtype {arr.dtype} "
            "(decode stored routes with layout.decode first)"
        )
    return arr.astype(np.int64, copy=False)
