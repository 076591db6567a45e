"""Routers of transformers MoE models, and one adapter per score function.

Every transformers 5.x MoE router returns `(router_logits, top_k_weights, top_k_index)` and its
MoE block hands the last two to the experts module. An adapter recomputes `top_k_weights` from
the live logits at *given* expert ids with the family's own formula, so replay can force the ids
while the router keeps its gradient.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from routing_replay.errors import LayoutMismatchError, UnsupportedModelError
from routing_replay.layout import RoutingLayout

# weights_TK = score(router, logits_TE, ids_TK): the family's weights at the given ids.
ScoreFunction = Callable[[nn.Module, Tensor, Tensor], Tensor]


def softmax_at_ids(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Jamba (and the start of the softmax families): float softmax over all experts at the ids."""
    return torch.softmax(logits_TE, dim=-1, dtype=torch.float).gather(1, ids_TK)


def softmax_then_topk(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Qwen2/3/3.5-MoE, Qwen3-Next, (Flex)OLMoE, Mixtral, MiniMax, HunYuan: float softmax at ids."""
    if hasattr(router, "norm_topk_prob"):  # Qwen2/3-MoE, Qwen3-Next, OLMoE, FlexOlmo
        weights_TK = softmax_at_ids(router, logits_TE, ids_TK)
        renorm = router.norm_topk_prob
    else:  # Mixtral, MiniMax, Qwen3.5, HunYuan: no flag, always renormalise (same ops)
        weights_TK = torch.softmax(logits_TE.float(), dim=-1).gather(1, ids_TK)
        renorm = True
    if renorm:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK


def softmax_scaled(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """DeepSeek-V2: float32 softmax over all experts at the ids, times the scaling factor.

    Greedy or group-limited, the group limit only chooses: no renormalisation.
    """
    return softmax_at_ids(router, logits_TE, ids_TK) * router.routed_scaling_factor


def softmax_clamped_renorm(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """ERNIE 4.5: float softmax at the ids, over their sum clamped at `norm_min`.

    The expert bias (`moe_statics`) only chooses experts.
    """
    weights_TK = softmax_at_ids(router, logits_TE, ids_TK)
    return weights_TK / torch.clamp(weights_TK.sum(dim=-1, keepdim=True), min=router.norm_min)


def topk_then_softmax(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """GPT-OSS, Granite MoE: softmax over the chosen experts' logits only."""
    return torch.softmax(logits_TE.gather(1, ids_TK), dim=1, dtype=logits_TE.dtype)


def topk_then_score(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Cohere2-MoE: float softmax, or sigmoid (renormalised if asked), of the chosen logits."""
    top_TK = logits_TE.gather(1, ids_TK)
    if router.expert_selection_fn == "softmax":
        return torch.softmax(top_TK, dim=1, dtype=torch.float)
    weights_TK = torch.sigmoid(top_TK)
    if router.norm_topk_prob:
        weights_TK = weights_TK / torch.sum(weights_TK, dim=-1, keepdim=True)
    return weights_TK


def sigmoid_with_bias(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """DeepSeek-V3(.2), GLM-4-MoE(-Lite), GLM-4.5V, dots1, EXAONE: sigmoid at the ids, scaled.

    The correction bias and the group limit only choose experts; they never enter the weights.
    """
    weights_TK = logits_TE.sigmoid().gather(1, ids_TK)
    if router.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * router.routed_scaling_factor


def sigmoid_eps_renorm(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """LFM2-MoE: sigmoid scores at the ids (the expert bias only chooses), over their sum
    (+1e-6) if `norm_topk_prob`, times the scaling factor."""
    weights_TK = logits_TE.sigmoid().gather(1, ids_TK)
    if router.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-6)
    return weights_TK * router.routed_scaling_factor


def score_fn_renorm(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """DeepSeek-V4 (learned and hash routers): the router's `score_fn` at the ids, over their
    sum (+1e-20), times the scaling factor (the bias, or the hash table, only chooses)."""
    weights_TK = router.score_fn(logits_TE).gather(1, ids_TK)
    weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * router.routed_scaling_factor


def sigmoid_renorm(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """MiniMax-M2: float sigmoid scores at the ids over their sum (the bias only chooses)."""
    weights_TK = logits_TE.float().sigmoid().gather(1, ids_TK)
    return weights_TK / weights_TK.sum(dim=-1, keepdim=True)


# Router class name -> score function. Only classes whose forward was read and tested are here.
_SCORES: dict[str, ScoreFunction] = {
    "Qwen3MoeTopKRouter": softmax_then_topk,
    "Qwen3NextTopKRouter": softmax_then_topk,
    "Qwen2MoeTopKRouter": softmax_then_topk,
    "OlmoeTopKRouter": softmax_then_topk,
    "FlexOlmoTopKRouter": softmax_then_topk,
    "MixtralTopKRouter": softmax_then_topk,
    "MiniMaxTopKRouter": softmax_then_topk,
    "Qwen3_5MoeTopKRouter": softmax_then_topk,
    "Qwen3VLMoeTextTopKRouter": softmax_then_topk,
    "HunYuanMoEV1Gate": softmax_then_topk,
    "JambaTopKRouter": softmax_at_ids,
    "DeepseekV2TopkRouter": softmax_scaled,
    "Ernie4_5_MoeTopKRouter": softmax_clamped_renorm,
    "GptOssTopKRouter": topk_then_softmax,
    "GraniteMoeTopKRouter": topk_then_softmax,
    "Cohere2MoeTopKRouter": topk_then_score,
    "DeepseekV3TopkRouter": sigmoid_with_bias,
    "DeepseekV32TopkRouter": sigmoid_with_bias,
    "Glm4MoeTopkRouter": sigmoid_with_bias,
    "Dots1TopkRouter": sigmoid_with_bias,
    "Glm4MoeLiteTopkRouter": sigmoid_with_bias,
    "Glm4vMoeTextTopkRouter": sigmoid_with_bias,
    "ExaoneMoeTopkRouter": sigmoid_with_bias,
    "KimiLinearTopkRouter": sigmoid_with_bias,
    "Lfm2MoeTopKRouter": sigmoid_eps_renorm,
    "MiniMaxM2TopKRouter": sigmoid_renorm,
    "DeepseekV4TopKRouter": score_fn_renorm,
    "DeepseekV4HashRouter": score_fn_renorm,
}


def register_router(class_name: str, score: ScoreFunction) -> None:
    """Add a router class whose forward returns (logits, weights, ids), scored by `score`."""
    _SCORES[class_name] = score


@dataclass(frozen=True)
class Router:
    """One MoE router of a model: its global layer index, module path, module and score function."""

    layer: int
    name: str
    module: nn.Module
    score: ScoreFunction


@dataclass(frozen=True)
class MoeModel:
    """A model's routing layout, its routers in layout order, and the module running the layers."""

    layout: RoutingLayout
    routers: tuple[Router, ...]
    decoder: nn.Module


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: nn.Module) -> MoeModel:
    """Routers of every MoE layer of a transformers model; raise if one is unknown or missing."""
    config = getattr(model, "config", None)
    if config is None:  # a DistributedDataParallel-style wrapper
        config = getattr(getattr(model, "module", None), "config", None)
    try:
        layout = RoutingLayout.from_hf_config(config)
    except (ValueError, AttributeError) as err:
        raise UnsupportedModelError(f"{type(model).__name__} is not an MoE model: {err}") from err
    found: dict[int, Router] = {}
    for name, module in model.named_modules():
        score = _SCORES.get(type(module).__name__)
        if score is None:
            continue
        match = _LAYER.search(name)
        if match is None:
            raise UnsupportedModelError(f"router {name!r} is not inside a `layers.<i>` module list")
        layer = int(match.group(1))
        if layer in found:
            raise UnsupportedModelError(
                f"layer {layer} has two routers: {found[layer].name!r} and {name!r}"
            )
        found[layer] = Router(layer, name, module, score)
    unknown = [i for i in layout.moe_layers if i not in found]
    if unknown:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no known router in MoE layer(s) {unknown} "
            f"({_describe_layer(model, unknown[0])}). Known router classes: {sorted(_SCORES)}. "
            "Replay would silently route natively; register the router's score function with "
            "routing_replay.register_router(class_name, score) if its forward returns "
            "(logits, weights, ids)."
        )
    extra = sorted(set(found) - set(layout.moe_layers))
    if extra:
        raise LayoutMismatchError(
            f"routers in layers {extra} are not MoE layers of the config's layout "
            f"{list(layout.moe_layers)}"
        )
    routers = tuple(found[i] for i in layout.moe_layers)
    prefix = routers[0].name[: _LAYER.search(routers[0].name).start()]
    decoder = model.get_submodule(prefix) if prefix else model
    return MoeModel(layout, routers, decoder)


def _describe_layer(model: nn.Module, layer: int) -> str:
    """The MLP-side modules of one decoder layer, two levels deep, for error messages."""
    pattern = re.compile(rf"(?:^|\.)layers\.{layer}\.[^.]+(\.[^.]+)?$")
    parts = [
        f"{name}: {type(module).__name__}"
        for name, module in model.named_modules()
        if pattern.search(name) and not re.search(r"attn|attention|norm", name)
    ]
    return ", ".join(parts) or f"no module named layers.{layer}"
