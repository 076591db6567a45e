"""Routers of transformers MoE models: which classes replay knows, and where a model has them.
(Over 400 lines by design: one table, a row per router class, and its lookups.)

Every transformers 5.x MoE router returns `(router_logits, top_k_weights, top_k_index)` and its
MoE block hands the last two to the experts module. Replay recomputes `top_k_weights` from the
router's live first output at *given* expert ids with the family's own formula (`scores`), so
it can force the ids while the router keeps its gradient.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from routing_replay.errors import InvalidRoutesError, LayoutMismatchError, UnsupportedModelError
from routing_replay.hf_config import loop_layers
from routing_replay.layout import RoutingLayout
from routing_replay.model import outputs, scores
from routing_replay.model.scores import ScoreFunction

# Router class name -> score function: every token-choice top-k router class of transformers
# 5.25 whose forward returns (logits or probabilities, weights, ids), each read and tested.
_SCORES: dict[str, ScoreFunction] = {
    **dict.fromkeys(
        (
            "Qwen2MoeTopKRouter",
            "Qwen3MoeTopKRouter",
            "Qwen3NextTopKRouter",
            "Qwen3_5MoeTopKRouter",
            "Qwen3VLMoeTextTopKRouter",
            "Qwen3OmniMoeThinkerTextTopKRouter",
            "Qwen3OmniMoeTalkerTextTopKRouter",
            "Qwen3OmniMoeTextTopKRouter",
            "Qwen4ExpTextTopKRouter",
            "OlmoeTopKRouter",
            "FlexOlmoTopKRouter",
            "MixtralTopKRouter",
            "MiniMaxTopKRouter",
            "HunYuanMoEV1Gate",
            "MellumTopKRouter",
            "LaraMiniTopKRouter",
        ),
        scores.softmax_then_topk,
    ),
    "JambaTopKRouter": scores.softmax_at_ids,
    "ZayaRouter": scores.softmax_with_skip,
    "JetMoeTopKGating": scores.topk_then_softmax,
    "InklingTopkRouter": scores.logsigmoid_with_shared,
    **dict.fromkeys(
        (
            "DeepseekV2TopkRouter",
            "DeepseekOcr2TextTopkRouter",
            "UnlimitedOcrTextTopkRouter",
            "LongcatFlashTopkRouter",
        ),
        scores.softmax_scaled,
    ),
    "Ernie4_5_MoeTopKRouter": scores.softmax_clamped_renorm,
    "Ernie4_5_VLMoeMoeTopKRouter": scores.softmax_clamped_renorm,
    "Mistral4TopkRouter": scores.softmax_eps_renorm_scaled,
    "MistralLarge4TextTopkRouter": scores.softmax_eps_renorm_scaled,
    "Gemma4TextRouter": scores.probs_renorm_per_expert_scale,
    "DiffusionGemmaTextRouter": scores.probs_renorm_per_expert_scale,
    **dict.fromkeys(
        (
            "GptOssTopKRouter",
            "GraniteMoeTopKRouter",
            "GraniteMoeSWATopKRouter",
            "GraniteMoeHybridTopKRouter",
            "GraniteMoeSharedTopKRouter",
            "AriaTextTopKRouter",
        ),
        scores.topk_then_softmax,
    ),
    "OpenAIPrivacyFilterTopKRouter": scores.topk_then_softmax_over_k,
    "DogeCDMoE": scores.topk_then_softmax_flag_renorm,
    "Cohere2MoeTopKRouter": scores.topk_then_score,
    **dict.fromkeys(
        (
            "DeepseekV3TopkRouter",
            "DeepseekV32TopkRouter",
            "Glm4MoeTopkRouter",
            "Glm4MoeLiteTopkRouter",
            "Glm4vMoeTextTopkRouter",
            "Glm5NextTextTopkRouter",
            "GlmMoeDsaTopkRouter",
            "Dots1TopkRouter",
            "Dots3NoteTextTopkRouter",
            "ExaoneMoeTopkRouter",
            "KimiLinearTopkRouter",
            "AXK1TopkRouter",
            "AXK2TopkRouter",
            "BailingHybridTopkRouter",
            "HYV4TopkRouter",
            "HYV4VLTopkRouter",
            "MiMoV2FlashTopkRouter",
            "MiniCPM5MoeTopkRouter",
            "NemotronHTopkRouter",
            "SolarOpenTopkRouter",
        ),
        scores.sigmoid_with_bias,
    ),
    "BeamTopKRouter": scores.sigmoid_flag_renorm_eps,
    "AfmoeTokenChoiceRouter": scores.sigmoid_route_scale,
    "HYV3TopKRouter": scores.sigmoid_router_scale,
    "ErgoTopkRouter": scores.sigmoid_always_renorm_scaled,
    "MuseSparkTopkRouter": scores.sigmoid_renorm_eps15_scaled,
    "Lfm2MoeTopKRouter": scores.sigmoid_eps_renorm,
    **dict.fromkeys(
        ("MiniMaxM2TopKRouter", "MiniMaxM3VLTopKRouter", "Step3p7TopKRouter", "LagunaTopKRouter"),
        scores.sigmoid_renorm,
    ),
    **dict.fromkeys(
        ("Kolibri1TopKRouter", "Kolibri1_1TopKRouter", "FlintTopKRouter"),
        scores.sigmoid_flag_renorm,
    ),
    **dict.fromkeys(
        (
            "DeepseekV4TopKRouter",
            "DeepseekV4HashRouter",
            "Inkling2TopKRouter",
            "Inkling2LoopTopKRouter",
        ),
        scores.score_fn_renorm,
    ),
    "PhimoeTopKRouter": scores.sparsemixer_at_ids,
    "Llama4Router": scores.sigmoid_of_chosen,
    "DbrxFFN": scores.softmax_pnorm,
}
# How a router's output carries its choice, where it is not (scores, weights, ids, ...).
_OUTPUTS: dict[str, Any] = {
    "Llama4Router": outputs.SCATTER,
    "DbrxFFN": outputs.PAIR,
    "ZayaRouter": outputs.SKIP_EXPERT,
    "ErgoTopkRouter": outputs.INPUT_ROUNDED,
    "InklingTopkRouter": outputs.SHARED_GAMMAS,
    "JetMoeTopKGating": outputs.SORTED,
    "DogeCDMoE": outputs.PRODUCT_KEYS,
}
# Router classes a decoder layer has several of, each its own routed layer of the layout:
# decoder layer i's router under `layers.<i>.<part>` is layer `i * len(parts) + index(part)`
# (`RoutingLayout.from_hf_config` counts them so).
_SUBLAYERS: dict[str, tuple[str, ...]] = {"JetMoeTopKGating": ("self_attention.", "mlp.")}
# Router classes a decoder layer has several of, each routing its own tokens of the layer (a
# token goes through exactly one, so one route per token and layer still): the decoder's
# per-token type argument, and the routers' parts by type (ERNIE 4.5 VL: text tokens, type 0,
# by `text_moe.gate`; image and video tokens, nonzero, by `vision_moe.gate`).
_ROW_SPLITS: dict[str, tuple[str, tuple[str, str]]] = {
    "Ernie4_5_VLMoeMoeTopKRouter": ("moe_mm_token_type_ids", ("text_moe.", "vision_moe."))
}
# Router classes of models with two stacks that route different tokens (DiffusionGemma: its
# encoder the prompt, its decoder the canvas it denoises, once per step): each stack is
# replayed and captured as a model of its own, with routes of its own tokens.
_STACKS: dict[str, tuple[str, ...]] = {"DiffusionGemmaTextRouter": ("encoder", "decoder")}
# What a stack is called with: its tokens (a diffusion decoder's canvas: decoder_input_ids)
# and the mask of their padding. A canvas is denoised whole in each forward: never a
# continuation of the forward before it (the next block's first step starts where the
# last block ended, yet routes another canvas).
TOKEN_KWARGS = ("input_ids", "decoder_input_ids")
CANVAS_KWARG = "decoder_input_ids"
MASK_KWARGS = ("attention_mask", "decoder_attention_mask")
# The method that routes, where it is not the router module's forward: DBRX's MoE block
# picks its experts from its router's logits in a method of its own.
_METHODS: dict[str, str] = {"DbrxFFN": "route_tokens_to_experts"}

# Router classes of transformers 5.25 replay refuses, and why: their forward is not a
# token-choice top-k that a forced choice can replace.
REFUSED: dict[str, str] = {
    "NllbMoeTop2Router": "a capacity-limited top-2 router of an encoder-decoder model: it drops "
    "tokens per batch, so a token's experts are not its own choice",
    "SwitchTransformersTop1Router": "a capacity-limited top-1 router of an encoder-decoder "
    "model: it drops tokens per batch, so a token's experts are not its own choice",
    "Dots3NoteVisionTopKRouter": "the routers of dots3's vision encoder: they route image "
    "patches inside the vision tower, not the language model's tokens, which are what engines "
    "record (and a RoutingLayout holds one expert count, theirs differ per layer); replay the "
    "language model (its Dots3NoteTextTopkRouter routers replay)",
}

# Classes named like routers that are not MoE routers (gates of linear attention, of looped or
# residual layers, a vision density router): models keep them and replay leaves them alone.
NOT_ROUTERS: frozenset[str] = frozenset(
    (
        "BailingHybridForgetGate",
        "KimiLinearForgetGate",
        "Glm5NextTextForgetGate",
        "Inkling2LoopMessageGate",
        "ErgoResidualGate",
        "MuseSparkResidualGate",
        "GraniteDoclingDensityRouter",
        "DbrxRouter",  # logits only: its block, DbrxFFN, picks the experts
    )
)


def known_routers() -> list[str]:
    """The router classes replay forces, sorted."""
    return sorted(_SCORES)


def register_router(class_name: str, score: ScoreFunction) -> None:
    """Add a router class whose forward returns (logits, weights, ids), scored by `score`."""
    _SCORES[class_name] = score


@dataclass(frozen=True)
class RowSplit:
    """Which of its layer's tokens a router routes, where a layer has one router per token type:
    `part` 0 routes the tokens whose type (the decoder's `kwarg`, `[*batch]`) is 0, and every
    token when no type is given or none is nonzero; `part` 1 the tokens of nonzero type (ERNIE
    4.5 VL's MoE block splits its tokens so, the text router's first)."""

    kwarg: str
    part: int


def split_rows(types: Any) -> tuple[Tensor, Tensor] | None:
    """The flat rows (batch order) of type 0 and of nonzero type, or None where the first router
    routes every row (no types, or none nonzero: the MoE block then routes all by the first)."""
    if not isinstance(types, Tensor):
        return None
    nonzero_N = types.reshape(-1).bool()
    if not bool(nonzero_N.any()):  # the block's own test
        return None
    return (~nonzero_N).nonzero().squeeze(1), nonzero_N.nonzero().squeeze(1)


def rows_of(split: RowSplit | None, rows: tuple[Tensor, Tensor] | None) -> Tensor | None:
    """A router's rows of the batch given `split_rows`' answer (None: every row)."""
    if split is None or rows is None:
        if split is not None and split.part != 0:
            raise InvalidRoutesError(
                "a router of nonzero token types was called while the decoder was given no "
                f"nonzero {split.kwarg!r}: its rows are unknown"
            )
        return None
    return rows[split.part]


@dataclass(frozen=True)
class LoopPass:
    """Which pass a looped decoder layer runs, read where its call says it: Inkling2-Loop's
    looped layers call their attention (`sibling`) with `cache_offset`, 0 on pass 0 and
    `num_hidden_layers + (p - 1) * (end - start) - start` on pass p >= 1. Read again when
    gradient checkpointing recomputes the layer (the attention is called again, with the same
    argument), so a recompute replays its own pass whatever the order."""

    sibling: str  # the decoder layer's submodule whose call carries the pass
    num_layers: int
    start: int
    end: int

    def of(self, kwargs: dict) -> int:
        offset = kwargs.get("cache_offset") or 0
        if offset == 0:
            return 0
        return (offset - self.num_layers + self.start) // (self.end - self.start) + 1


# Routers of looped layers: where their pass is said (see LoopPass).
_LOOPED: dict[str, str] = {"Inkling2LoopTopKRouter": "self_attn"}


@dataclass(frozen=True)
class Router:
    """One MoE router of a model: its global layer index, module path, module and score function."""

    layer: int
    name: str
    module: nn.Module
    score: ScoreFunction
    output: Any = outputs.TRIPLE  # an output form of `outputs`: where the choice is
    method: str = "forward"  # the module's method that returns it
    rows: RowSplit | None = None  # its part of the layer's tokens, where it routes a part
    # A looped layer's router (one Router per pass, the same module): its pass, and where the
    # pass is read (the decoder layer's module whose call says it) and how.
    loop_pass: int | None = None
    pass_module: nn.Module | None = None
    loop: LoopPass | None = None


@dataclass(frozen=True)
class MoeModel:
    """A model's routing layout, its routers in layout order, and the module running the layers."""

    layout: RoutingLayout
    routers: tuple[Router, ...]  # one a MoE layer (where a layer splits its tokens: part 0's)
    decoder: nn.Module
    extra: tuple[Router, ...] = ()  # the other routers of layers that split their tokens

    @property
    def all_routers(self) -> tuple[Router, ...]:
        return (*self.routers, *self.extra)

    @property
    def row_kwarg(self) -> str | None:
        """The decoder's per-token type argument that splits a layer's tokens, if any."""
        return next((r.rows.kwarg for r in self.routers if r.rows is not None), None)

    def slot(self, router: Router) -> int:
        """The router's index among the MoE layers (the L of the routes)."""
        return self.layout.moe_layers.index(router.layer)

    def by_module(self) -> list[tuple[Router, tuple[int, ...]]]:
        """Each router module once (its first Router) with the MoE-layer index (the L of the
        routes) of each of its calls in a forward: one, or one per pass of a looped layer."""
        found: dict[int, tuple[Router, list[int]]] = {}
        for router in sorted(self.all_routers, key=lambda r: r.loop_pass or 0):
            entry = found.setdefault(id(router.module), (router, []))
            entry[1].append(self.slot(router))
        return [(router, tuple(slots)) for router, slots in found.values()]


_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")  # decoder layers (DBRX: blocks)


def find_routers(model: nn.Module) -> MoeModel:
    """Routers of every MoE layer of a transformers model; raise if one is unknown or missing."""
    config = getattr(model, "config", None)
    if config is None:  # a DistributedDataParallel-style wrapper
        config = getattr(getattr(model, "module", None), "config", None)
    modules = list(model.named_modules())
    for name, module in modules:
        why = REFUSED.get(type(module).__name__)
        if why is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: replay cannot force {name!r} ({type(module).__name__}): "
                f"{why}"
            )
    stacks = _stacks(modules)
    if len(stacks) > 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} routes two sets of tokens, one per stack "
            f"({', '.join(stacks)}): no token goes through both, so no routes shaped by one "
            "input fit the model. Replay (and capture) each stack as a model of its own, with "
            "routes of its own tokens: "
            + ", ".join(f"replay(model.{path}, routes_of_its_tokens)" for path in stacks)
        )
    try:
        layout = RoutingLayout.from_hf_config(config)
    except (ValueError, AttributeError) as err:
        raise UnsupportedModelError(f"{type(model).__name__} is not an MoE model: {err}") from err
    found: dict[int, Router] = {}
    extra: list[Router] = []
    looped = loop_layers(config)  # (decoder layer, pass) of each layout layer, if it loops
    for name, module in modules:
        score = _SCORES.get(type(module).__name__)
        if score is None:
            continue
        match = _LAYER.search(name)
        if match is None:
            raise UnsupportedModelError(
                f"router {name!r} is not inside a `layers.<i>` (or `blocks.<i>`) module list"
            )
        layer = int(match.group(1))
        kind = type(module).__name__
        parts = _SUBLAYERS.get(kind)
        if parts is not None:
            rest = name[match.end() :]
            which = [i for i, part in enumerate(parts) if rest.startswith(part)]
            if len(which) != 1:
                raise UnsupportedModelError(
                    f"router {name!r} is in none of its decoder layer's routed parts {parts}"
                )
            layer = layer * len(parts) + which[0]
        split = None
        if kind in _ROW_SPLITS:
            kwarg, parts = _ROW_SPLITS[kind]
            rest = name[match.end() :]
            which = [i for i, part in enumerate(parts) if part in rest]
            if len(which) != 1:
                raise UnsupportedModelError(
                    f"router {name!r} is in none of its decoder layer's token parts {parts}"
                )
            split = RowSplit(kwarg, which[0])
        output, method = _OUTPUTS.get(kind, outputs.TRIPLE), _METHODS.get(kind, "forward")
        router = Router(layer, name, module, score, output, method, split)
        if split is not None and split.part != 0:
            extra.append(router)
            continue
        for each in _passes(router, looped, model, name[: match.end()], config):
            if each.layer in found:
                raise UnsupportedModelError(
                    f"layer {each.layer} has two routers: {found[each.layer].name!r} and {name!r}"
                )
            found[each.layer] = each
    unknown = [i for i in layout.moe_layers if i not in found]
    if unknown:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no known router in MoE layer(s) {unknown} "
            f"({_describe_layer(model, unknown[0])}); replay knows {len(_SCORES)} router classes "
            "(routing_replay.model.adapters.known_routers()). "
            "Replay would silently route natively; register the router's score function with "
            "routing_replay.model.adapters.register_router(class_name, score) if its forward "
            "returns (logits, weights, ids)."
        )
    stray = sorted((set(found) | {r.layer for r in extra}) - set(layout.moe_layers))
    if stray:
        raise LayoutMismatchError(
            f"routers in layers {stray} are not MoE layers of the config's layout "
            f"{list(layout.moe_layers)}"
        )
    routers = tuple(found[i] for i in layout.moe_layers)
    prefix = routers[0].name[: _LAYER.search(routers[0].name).start()]
    decoder = model.get_submodule(prefix) if prefix else model
    return MoeModel(layout, routers, decoder, tuple(extra))


def _stacks(modules: list[tuple[str, nn.Module]]) -> list[str]:
    """The paths of the stacks holding routers of a two-stack model (`_STACKS`), in order."""
    found: dict[str, None] = {}
    for name, module in modules:
        parts = name.split(".")
        names = _STACKS.get(type(module).__name__, ())
        at = [i for i, part in enumerate(parts) if part in names]
        if at:
            found[".".join(parts[: at[0] + 1])] = None
    return list(found)


def input_tokens(args: tuple, kwargs: dict) -> Any:
    """What a stack's forward was given as its tokens (`TOKEN_KWARGS`, else its first argument)."""
    for name in TOKEN_KWARGS:
        if name in kwargs:
            return kwargs[name]
    return args[0] if args else None


def is_canvas(kwargs: dict) -> bool:
    """Whether a stack's forward was given a canvas to denoise (`CANVAS_KWARG`) as its tokens."""
    return CANVAS_KWARG in kwargs and "input_ids" not in kwargs


def input_mask(kwargs: dict) -> Any:
    """The padding mask a stack's forward was given (`MASK_KWARGS`), if any."""
    return next((kwargs[name] for name in MASK_KWARGS if name in kwargs), None)


def _passes(
    router: Router, looped: Any, model: nn.Module, layer_path: str, config: Any
) -> list[Router]:
    """The router as its layout layers see it: itself, or one Router per pass where its decoder
    layer loops (layers numbered by `hf_config.loop_layers`)."""
    if looped is None:
        return [router]
    index = {step: v for v, step in enumerate(looped)}
    passes = [p for i, p in looped if i == router.layer]
    if len(passes) == 1:
        return [replace(router, layer=index[router.layer, 0])]
    sibling = _LOOPED.get(type(router.module).__name__)
    if sibling is None:
        raise UnsupportedModelError(
            f"router {router.name!r} is in a looped layer but replay does not know how its "
            "layer says which pass it runs"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    loop = LoopPass(
        sibling, text.num_hidden_layers, text.loop_layer_index_start, text.loop_layer_index_end
    )
    return [
        replace(
            router,
            layer=index[router.layer, p],
            loop_pass=p,
            pass_module=model.get_submodule(layer_path + sibling),
            loop=loop,
        )
        for p in passes
    ]


def _describe_layer(model: nn.Module, layer: int) -> str:
    """The MLP-side modules of one decoder layer, two levels deep, for error messages."""
    pattern = re.compile(rf"(?:^|\.)layers\.{layer}\.[^.]+(\.[^.]+)?$")
    parts = [
        f"{name}: {type(module).__name__}"
        for name, module in model.named_modules()
        if pattern.search(name) and not re.search(r"attn|attention|norm", name)
    ]
    return ", ".join(parts) or f"no module named layers.{layer}"
