"""Tolerance mode and replay's per-layer tallies.

Tolerance (`replay(..., tolerance=r)`, prime-rl's threshold): a recorded expert is kept only
where the trainer's own score for it is at least `r` times its weakest top-k score; the other
slots are refilled from the trainer's own top-k, best first, skipping experts kept. The
trainer's scores are the family's weights over every expert (`scores_over_all`): a common
renormalisation cancels in the ratio, and what only chooses (biases, group limits) is in the
trainer's own top-k, not in the scores.

Tallies, per MoE layer and summed over the block's forwards (device tensors, no host sync
until read): forced rows, forced rows whose recorded set equals the trainer's own top-k
set, and slots a tolerance refilled.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from routing_replay.model import scores
from routing_replay.model.scores import ScoreFunction

FORCED, AGREED, REPLACED = 0, 1, 2  # the entries of a layer's [3] tally


def scores_over_all(score: ScoreFunction, router: nn.Module, scores_TE: Tensor) -> Tensor:
    """The family's weights at every expert, `[T, E]` (PhiMoE's sparsemixer weighs two ids
    at a time: its softmax instead; Inkling normalises its weights with its shared experts':
    the sigmoid of its routed logits, the same ratios)."""
    if score is scores.sparsemixer_at_ids:
        return torch.softmax(scores_TE.float(), dim=-1)
    if score is scores.logsigmoid_with_shared:  # Inkling: exp(logsigmoid), over a common sum
        return torch.sigmoid(scores_TE.float())
    rows, experts = scores_TE.shape
    all_TE = torch.arange(experts, device=scores_TE.device).expand(rows, experts)
    return score(router, scores_TE, all_TE)


def tolerate(all_TE: Tensor, native_TK: Tensor, forced_TK: Tensor, ratio: float) -> Tensor:
    """Forced ids with the slots below `ratio` x the weakest native score refilled from the
    native ids (best first, none repeated); a bool `[T, K]` of the refilled slots too."""
    native_w_TK = all_TE.gather(1, native_TK)
    weakest_T1 = native_w_TK.amin(dim=1, keepdim=True)
    native_TK = native_TK.gather(1, native_w_TK.argsort(dim=1, descending=True))  # best first
    keep_TK = all_TE.gather(1, forced_TK) >= ratio * weakest_T1
    kept_TK = torch.where(keep_TK, forced_TK, -1)
    taken_TK = (native_TK[:, :, None] == kept_TK[:, None, :]).any(-1)  # native ids kept
    order_TK = torch.argsort(taken_TK.to(torch.int8), dim=1, stable=True)  # the rest first
    spare_TK = native_TK.gather(1, order_TK)  # in native order
    slot_TK = (torch.cumsum((~keep_TK).to(torch.int64), dim=1) - 1).clamp(min=0)
    return torch.where(keep_TK, forced_TK, spare_TK.gather(1, slot_TK)), ~keep_TK


def tally(
    tally_3: Tensor,
    forced_TK: Tensor,
    native_TK: Tensor,
    replaced_TK: Tensor | None,
    missing_T1: Tensor | None,
) -> None:
    """Add one router call's counts to its layer's `[3]` tally (in place: under compile, a
    graph input mutated)."""
    forced_T = torch.ones_like(forced_TK[:, 0], dtype=torch.bool)
    if missing_T1 is not None:
        forced_T = ~missing_T1[:, 0]
    same_T = (forced_TK.sort(dim=1).values == native_TK.sort(dim=1).values).all(dim=1)
    counts = [forced_T.sum(), (same_T & forced_T).sum()]
    if replaced_TK is None:
        counts.append(torch.zeros_like(counts[0]))
    else:
        counts.append((replaced_TK & forced_T[:, None]).sum())
    tally_3 += torch.stack(counts).to(tally_3.dtype)
