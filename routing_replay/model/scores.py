"""The weights a router family gives its experts, at given expert ids.

`weights_TK = score(router, out_TE, ids_TK)`: `out_TE` is the router's first output (its logits,
or Gemma 4's probabilities), `ids_TK` the forced ids. Each function is the family's own formula
read from its transformers forward, ops in the same order and dtypes, so that replaying a
router's own choice gives back its own weights bit for bit and its gradient stays live. What
only *chooses* experts (a correction bias, a group limit, a hash table) never enters them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from routing_replay.compat.transformers import phimoe_multiplier

ScoreFunction = Callable[[nn.Module, Tensor, Tensor], Tensor]


# -- softmax over every expert, at the ids --------------------------------------------------


def softmax_at_ids(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Jamba: float softmax over all experts at the ids."""
    return torch.softmax(logits_TE, dim=-1, dtype=torch.float).gather(1, ids_TK)


def softmax_with_skip(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Zaya: softmax in the logits' dtype over the E experts and the skip expert (id E), at the
    ids (its balancing biases only choose). A skip's weight is 0: the output form
    (`outputs.SkipExpert`) masks it, as the router does after this."""
    return torch.softmax(logits_TE, dim=-1).gather(1, ids_TK)


def softmax_then_topk(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """The Qwen MoE family, OLMoE, Mixtral, MiniMax, HunYuan, Mellum, Lara: float softmax at
    the ids, renormalised over them (by the router's `norm_topk_prob`, or always without one)."""
    if hasattr(router, "norm_topk_prob"):
        weights_TK = softmax_at_ids(router, logits_TE, ids_TK)
        renorm = router.norm_topk_prob
    else:  # no flag: always renormalise (same ops as those routers)
        weights_TK = torch.softmax(logits_TE.float(), dim=-1).gather(1, ids_TK)
        renorm = True
    if renorm:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK


def softmax_scaled(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """DeepSeek-V2, DeepSeek-OCR 2, LongCat-Flash: float softmax at the ids times the routed
    scaling factor; no renormalisation (the group limit only chooses)."""
    return softmax_at_ids(router, logits_TE, ids_TK) * router.routed_scaling_factor


def softmax_clamped_renorm(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """ERNIE 4.5 (and VL): float softmax at the ids over their sum clamped at `norm_min` (the
    `moe_statics` bias only chooses)."""
    weights_TK = softmax_at_ids(router, logits_TE, ids_TK)
    return weights_TK / torch.clamp(weights_TK.sum(dim=-1, keepdim=True), min=router.norm_min)


def softmax_eps_renorm_scaled(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Mistral 4 and Mistral Large 4: softmax in the logits' dtype at the ids, over their sum
    (+1e-20; by `norm_topk_prob`, always without one), times the routed scaling factor."""
    weights_TK = logits_TE.softmax(-1).gather(1, ids_TK)
    if getattr(router, "norm_topk_prob", True):
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * router.routed_scaling_factor


def probs_renorm_per_expert_scale(router: nn.Module, probs_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Gemma 4: the router returns the softmax itself; at the ids, over their sum, times the
    learned `per_expert_scale` of each chosen expert."""
    weights_TK = probs_TE.gather(1, ids_TK)
    weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK * router.per_expert_scale[ids_TK]


# -- softmax over the chosen experts' logits only -------------------------------------------


def topk_then_softmax(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """GPT-OSS, Granite MoE (all four), Aria: softmax over the chosen logits only."""
    return torch.softmax(logits_TE.gather(1, ids_TK), dim=1, dtype=logits_TE.dtype)


def topk_then_softmax_over_k(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """OpenAI privacy filter: softmax over the chosen logits, divided by top-k."""
    return topk_then_softmax(router, logits_TE, ids_TK) / router.top_k


def topk_then_softmax_flag_renorm(router: nn.Module, scores_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Doge: softmax (no dtype given, as its block calls it) over the chosen scores, here its
    product-key sums (`outputs.ProductKeys`), over their sum by `norm_topk_prob`."""
    weights_TK = F.softmax(scores_TE.gather(1, ids_TK), dim=-1)
    if router.norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK


def topk_then_score(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Cohere2-MoE: float softmax, or sigmoid (renormalised if asked), of the chosen logits."""
    top_TK = logits_TE.gather(1, ids_TK)
    if router.expert_selection_fn == "softmax":
        return torch.softmax(top_TK, dim=1, dtype=torch.float)
    weights_TK = torch.sigmoid(top_TK)
    if router.norm_topk_prob:
        weights_TK = weights_TK / torch.sum(weights_TK, dim=-1, keepdim=True)
    return weights_TK


# -- an elementwise score (sigmoid, or the router's `score_fn`) at the ids ------------------


@dataclass(frozen=True)
class ScoreAtIds:
    """Scores at the ids, renormalised over them and scaled: the DeepSeek-V3 formula and its
    variants. `renorm`: always (True), never (False), or the router's flag of that name;
    `eps` added to the sum; `scale`: the router's attribute multiplying the weights, or None;
    `score`: "sigmoid" or "score_fn" (the router's own); `upcast`: scored in float32."""

    renorm: bool | str = "norm_topk_prob"
    eps: float = 1e-20
    scale: str | None = "routed_scaling_factor"
    score: str = "sigmoid"
    upcast: bool = False

    def __call__(self, router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
        if self.upcast:
            logits_TE = logits_TE.float()
        scores_TE = logits_TE.sigmoid() if self.score == "sigmoid" else router.score_fn(logits_TE)
        weights_TK = scores_TE.gather(1, ids_TK)
        if self.renorm if isinstance(self.renorm, bool) else getattr(router, self.renorm):
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + self.eps)
        if self.scale is not None:
            weights_TK = weights_TK * getattr(router, self.scale)
        return weights_TK


# DeepSeek-V3(.2), GLM-4-MoE(-Lite), GLM-4.5V, GLM-5, dots1/dots3, EXAONE, Kimi, A.X K1/K2,
# Bailing hybrid, HY-V4, MiMo-V2-Flash, MiniCPM5-MoE, Nemotron-H, Solar-Open.
sigmoid_with_bias = ScoreAtIds()
# Beam: its MoE block scales the experts' sum, not the weights.
sigmoid_flag_renorm_eps = ScoreAtIds(scale=None)
# AFMoE, HY-V3 (and dots3's vision router), Ergo, Muse Spark: always renormalised.
sigmoid_route_scale = ScoreAtIds(renorm=True, scale="route_scale")
sigmoid_router_scale = ScoreAtIds(renorm=True, scale="router_scaling_factor")
sigmoid_always_renorm_scaled = ScoreAtIds(renorm=True)
sigmoid_renorm_eps15_scaled = ScoreAtIds(renorm=True, eps=1e-15)
# LFM2-MoE: +1e-6.
sigmoid_eps_renorm = ScoreAtIds(eps=1e-6)
# MiniMax-M2 (and M3-VL), Step 3.7, Laguna: float sigmoid, always renormalised, no scale.
sigmoid_renorm = ScoreAtIds(renorm=True, eps=0.0, scale=None, upcast=True)
# Kolibri 1 / 1.1, Flint: renormalised (no eps) by the flag, no scale.
sigmoid_flag_renorm = ScoreAtIds(eps=0.0, scale=None)
# DeepSeek-V4 (learned and hash routers), Inkling 2: the router's `score_fn`.
score_fn_renorm = ScoreAtIds(renorm=True, score="score_fn")


# -- one-offs -------------------------------------------------------------------------------


def sigmoid_of_chosen(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Llama 4: float sigmoid of the chosen logits (its block scatters them over the experts)."""
    return torch.sigmoid(logits_TE.gather(1, ids_TK).float())


def sparsemixer_at_ids(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """PhiMoE (top-2): the first id's weight is the softmax of the logits masked beyond the
    router's jitter threshold of their maximum; the second's, the same with the first id
    removed. In training, as its router does, each goes through PhiMoE's Heun estimator (its
    forward scales a weight by 1/3 unless the id is the masked softmax's top or a 1-in-4 draw
    passes; its backward gives the routers their gradient)."""
    eps2 = 2 * router.router_jitter_noise
    weights = []
    rest_TE = logits_TE
    for k in range(2):
        id_T1 = ids_TK[:, k : k + 1]
        top_T1 = rest_TE.max(dim=-1, keepdim=True).values
        far_TE = ((top_T1 - logits_TE) / logits_TE.abs().clamp(min=top_T1)) > eps2
        gates_TE = torch.softmax(rest_TE.masked_fill(far_TE, float("-inf")), dim=-1)
        weight_T1 = gates_TE.gather(dim=-1, index=id_T1)
        if router.training:
            best_T1 = gates_TE.max(dim=-1, keepdim=True).indices
            one_T1 = torch.logical_or(id_T1 == best_T1, torch.rand_like(weight_T1) > 0.75)
            one_T1 = torch.add(0.3333, one_T1, alpha=0.6667).type_as(gates_TE)
            estimator = phimoe_multiplier(router)
            weight_T1 = estimator.apply(logits_TE, weight_T1, id_T1, gates_TE, one_T1)
        weights.append(weight_T1)
        rest_TE = torch.scatter(logits_TE, -1, id_T1, float("-inf"))
    return torch.cat(weights, dim=-1)


def logsigmoid_with_shared(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Inkling: `logits_TE` is the router's whole float32 logits, the E routed experts' then its
    S shared experts'; the chosen logits and the shared ones go through log-sigmoid, normalised
    together (logsumexp over the K + S), times `route_scale` and the learned `global_scale`.
    Returns `[T, K + S]`: the K weights, then the shared experts' gammas (`outputs.SharedGammas`
    splits them; the correction bias only chooses)."""
    experts = router.num_experts
    chosen_TK = torch.cat([logits_TE[:, :experts].gather(-1, ids_TK), logits_TE[:, experts:]], -1)
    log_probs_TK = F.logsigmoid(chosen_TK)
    weights_TK = torch.exp(log_probs_TK - torch.logsumexp(log_probs_TK, dim=-1, keepdim=True))
    return weights_TK * router.route_scale * router.global_scale.float()


def softmax_pnorm(block: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """DBRX: softmax in the logits' dtype at the ids, over their p-norm (p =
    `moe_normalize_expert_weights`; none: not normalised)."""
    weights_TK = torch.softmax(logits_TE, dim=1, dtype=logits_TE.dtype).gather(1, ids_TK)
    p = block.moe_normalize_expert_weights
    if p is not None:
        weights_TK = weights_TK / torch.norm(weights_TK, p=p, dim=-1, keepdim=True)
    return weights_TK
