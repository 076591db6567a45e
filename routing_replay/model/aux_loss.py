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
    the result equals transformers' `load_balancing_loss_func` bitwise. Doge's product-key
    logits (`[2, tokens, num_keys]` per layer) get Doge's own formula. The probabilities
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
    if all(t.dim() == 3 and t.shape[0] == 2 for t in logits):  # Doge's product keys
        return _product_keys_loss(logits, routes, num_experts, top_k, attention_mask)
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


def _product_keys_loss(
    logits: tuple[Tensor, ...],
    routes: Tensor,
    num_experts: int,
    top_k: int,
    attention_mask: Tensor | None,
) -> Tensor:
    """Doge's aux loss (its modeling module's `load_balancing_loss_func`, same arithmetic in
    the same order), counting the replayed experts. Each layer's logits are `[2, rows,
    num_keys]`, the two key halves: expert `x * num_keys + y` scores `logits[0][x] +
    logits[1][y]`; `P_e` is the softmax over those `num_keys ** 2` scores."""
    num_keys, rows = logits[0].shape[-1], logits[0].shape[1]
    if any(t.shape != logits[0].shape for t in logits) or num_keys * num_keys != num_experts:
        shapes = [tuple(t.shape) for t in logits]
        raise InvalidRoutesError(
            f"product-key router_logits must each be [2, tokens, num_keys] with num_keys ** 2 "
            f"= num_experts={num_experts}, got {shapes}: pass the layout's num_experts "
            "(Doge: floor(sqrt(config.num_experts)) ** 2)"
        )
    device, dtype = logits[0].device, logits[0].dtype
    ids = _routes_rows(routes, rows, len(logits), top_k, num_experts).to(device)
    experts_per_layer, weights_per_layer = [], []
    for j, layer_logits in enumerate(logits):
        (scores_x, scores_y), (keys_x, keys_y) = layer_logits.to(device).topk(num_keys, dim=-1)
        scores_RE = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)
        experts_RE = (keys_x.unsqueeze(-1) * num_keys + keys_y.unsqueeze(-2)).flatten(-2)
        _, at_RK = scores_RE.topk(top_k, dim=-1)
        forced_RK = ids[:, j]
        missing = (forced_RK == MISSING).any(dim=-1, keepdim=True)
        experts_per_layer.append(torch.where(missing, experts_RE.gather(-1, at_RK), forced_RK))
        probs_RE = torch.nn.functional.softmax(scores_RE, dim=-1)
        weights_per_layer.append(torch.zeros_like(scores_RE).scatter(-1, experts_RE, probs_RE))
    selected = torch.cat(experts_per_layer, dim=0).reshape(-1)  # (layer, row, k)
    weights = torch.cat(weights_per_layer, dim=0)  # [layers * rows, E]
    counts = torch.zeros(num_experts, dtype=dtype, device=device)
    if attention_mask is None:
        ones = torch.ones_like(selected, dtype=dtype, device=device)
        tokens_per_expert = counts.scatter_add_(0, selected, ones) / selected.shape[0]
        router_prob_per_expert = torch.mean(weights, dim=0)
    else:
        if attention_mask.numel() != rows:
            raise InvalidRoutesError(
                f"attention_mask has {attention_mask.numel()} positions for {rows} router "
                f"rows: pass the [B, S] mask of the forward ({tuple(attention_mask.shape)} given)"
            )
        mask = attention_mask.reshape(1, rows, 1).to(device)
        per_id = mask.expand(len(logits), rows, top_k).reshape(-1)
        kept = selected[per_id.bool()]
        ones = torch.ones_like(kept, dtype=dtype, device=device)
        tokens_per_expert = counts.scatter_add_(0, kept, ones) / torch.sum(per_id)
        per_prob = mask.expand(len(logits), rows, num_experts).reshape(-1, num_experts)
        router_prob_per_expert = torch.sum(weights * per_prob, dim=0) / torch.sum(per_prob, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert) * num_experts


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
