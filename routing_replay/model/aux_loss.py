"""The load-balancing auxiliary loss under replay: count the experts that were replayed.

transformers' MoE models compute their aux loss (`output_router_logits=True`) with
`load_balancing_loss_func`: the Switch Transformer loss `E * sum_e f_e * P_e`, where `f_e`
is the fraction of top-k assignments that went to expert e and `P_e` the mean router
probability of e, over all MoE layers. It finds `f_e` by running top-k on the router logits
again, so under `replay` it counts the experts the router would have chosen, not the ones
the tokens were sent to. `load_balancing_loss` is the same loss with `f_e` counted from the
replayed ids; `P_e` still comes from the live logits, so the gradient reaches the routers
exactly as in transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from routing_replay.errors import InvalidRoutesError
from routing_replay.layout import MISSING
from routing_replay.validate import check_integer, check_rows


def load_balancing_loss(
    router_logits: Sequence[Tensor],
    routes: Tensor,
    *,
    num_experts: int,
    top_k: int,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """Switch-style load-balancing loss counting the replayed experts (transformers' formula).

    `router_logits`: the model output's `router_logits` (`output_router_logits=True`), one
    `[B * S, E]` tensor per MoE layer, from the forward that ran under `replay`. `routes`:
    the routes that forward replayed, `[B, S, L, K]` (or `[B * S, L, K]`), L the MoE layers
    in the order of `router_logits`, -1 missing. `num_experts`, `top_k`: the model's (for
    transformers, `config.num_experts` / `num_local_experts` and `num_experts_per_tok`).
    `attention_mask` `[B, S]`: as in transformers, padding rows count neither their experts
    nor their probabilities.

    A (token, layer) row with a -1 routed natively under replay, and counts the top-k of
    the softmax of its logits, as transformers does; with routes equal to the native top-k
    the result equals transformers' `load_balancing_loss_func` bitwise. The probabilities
    are the softmax of the live logits, so the loss is differentiable in the router weights
    (the counts, as in transformers, are not). Families whose transformers model has no
    aux loss (DeepSeek-V2/V3, GLM-4-MoE, ...; `aux_loss` is None) still get this Switch
    loss over their router logits, with a softmax whatever their router's score function.
    """
    logits = tuple(router_logits) if router_logits is not None else ()
    if not logits or not all(isinstance(t, Tensor) for t in logits):
        raise InvalidRoutesError(
            "router_logits must be the model output's router_logits, one tensor per MoE layer: "
            "run the forward with output_router_logits=True"
        )
    device = logits[0].device
    rows = logits[0].shape[0]
    if any(t.dim() != 2 or t.shape != (rows, num_experts) for t in logits):
        shapes = [tuple(t.shape) for t in logits]
        raise InvalidRoutesError(
            f"router_logits must each be [tokens, num_experts={num_experts}], got {shapes}: "
            "pass the model's num_experts and output.router_logits"
        )
    ids = _routes_rows(routes, rows, len(logits), top_k, num_experts).to(device)
    # Same arithmetic, in the same order, as transformers' load_balancing_loss_func.
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    total_rows = 0.0
    if attention_mask is not None:
        if attention_mask.numel() != rows:
            raise InvalidRoutesError(
                f"attention_mask has {attention_mask.numel()} positions for {rows} router "
                f"rows: pass the [B, S] mask of the forward ({tuple(attention_mask.shape)} given)"
            )
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for j, layer_logits in enumerate(logits):
        routing_weights = torch.nn.functional.softmax(layer_logits.to(device), dim=-1)
        _, native = torch.topk(routing_weights, top_k, dim=-1)
        forced = ids[:, j]
        missing = (forced == MISSING).any(dim=-1, keepdim=True)
        selected_experts = torch.where(missing, native, forced)
        if attention_mask is None:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.histc(
                selected_experts.reshape(-1).to(histc_dtype),
                bins=num_experts,
                min=0,
                max=num_experts,
            )
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
                num_experts, dtype=torch.float32, device=device
            ).scatter_add_(0, selected_experts.reshape(-1), flat_mask.repeat_interleave(top_k))
            router_prob_sum = router_prob_sum + (
                routing_weights.float() * flat_mask.unsqueeze(-1)
            ).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


def _routes_rows(routes: Tensor, rows: int, layers: int, top_k: int, num_experts: int) -> Tensor:
    """Routes as int64 `[rows, L, K]`, checked against the logits they are counted with."""
    routes = torch.as_tensor(routes)
    check_integer(routes)
    shape = tuple(routes.shape)
    if len(shape) < 3 or shape[-2:] != (layers, top_k) or routes[..., 0, 0].numel() != rows:
        raise InvalidRoutesError(
            f"routes must be [B, S, {layers} MoE layers, top_k={top_k}] over the {rows} rows of "
            f"router_logits (B * S), got {shape}: pass the routes the forward replayed, one "
            "layer per router_logits entry (DeepSeek-V4's hash-routed layers record no "
            "router logits: leave their columns out)"
        )
    ids = routes.reshape(rows, layers, top_k).long()
    check_rows(ids, num_experts, lambda row, j: f"row {row}, MoE layer {j}")
    return ids
