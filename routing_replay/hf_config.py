"""How a transformers config names its routed layers, top-k and expert count.

Read by `RoutingLayout.from_hf_config`; one rule per family, each with the config attribute
it comes from.
"""

from __future__ import annotations

import math
from typing import Any

from routing_replay.errors import InvalidArgumentError

# `mlp_layer_types` entries of layers that route (DeepSeek-V4's hash layers pick experts by
# token id, but still pick them per token, and engines report them like any other).
MOE_MLP_TYPES = ("sparse", "moe", "hash_moe")


def layout_fields(config: Any, *, mtp: bool = False) -> tuple[int, int, int, tuple[int, ...]]:
    """(num_layers, top_k, num_experts, moe_layers) of a transformers MoE config's routed decoder.

    Reads every MoE config of transformers 5.25:

    * which config: a multimodal config's `text_config` (unless the top level is itself an
      MoE config); Qwen3-Omni's `thinker_config.text_config`: the thinker is the model
      users train (its talker's text config alone gives the talker's layout).
    * layers: `num_hidden_layers`; LongCat-Flash's `num_layers` (its `num_hidden_layers`
      counts two attention sublayers per decoder layer); JetMoE's `2 * num_hidden_layers`:
      each decoder layer routes twice, in its mixture-of-attention (the query and output
      projections are experts) and in its MLP, with the same top-k and expert count, so
      decoder layer i is routed layers 2i (attention) and 2i + 1 (MLP), every one MoE.
    * top-k and expert count: the first set of `_TOP_K` and of `_EXPERTS`, on the config or
      DBRX's `ffn_config`; plus LongCat-Flash's `zero_expert_num` (its zero-computation
      experts take the ids after the routed ones), and Zaya's skip expert: its router picks
      among `num_experts + 1` ids, id `num_experts` meaning "no expert" (the router then
      hands the experts id 0 with weight 0); routes record that choice, so the layout has
      `num_experts + 1` experts; Doge's `floor(sqrt(num_experts)) ** 2`: its block
      picks product-key experts `ix * num_keys + iy` of `num_keys = floor(sqrt(num_experts))`
      keys a half, so no id reaches past that (the same count for a square `num_experts`,
      as Doge's configs have). Values given per layer (a list, or
      transformers' `per_layer_config`) must agree over the MoE layers.
    * MoE layers, by the first rule that applies: `mlp_layer_types` entries in
      `MOE_MLP_TYPES`; Llama 4's `moe_layers`; Nemotron-H's 'moe' blocks in
      `layers_block_type` (legacy `hybrid_override_pattern` 'E'); `first_k_dense_replace`
      (+ `moe_layer_freq`); Jamba's `expert_layer_period/offset`; `num_dense_layers`;
      ERNIE's `moe_layer_interval/start/end`; `decoder_sparse_step` and `mlp_only_layers`
      (either alone too); else every layer (Mixtral, GPT-OSS, Gemma 4, the Qwen3-Omni
      talker, which ignores its `decoder_sparse_step` and `mlp_only_layers`).
    * looped layers (Inkling2-Loop, `loop_num_passes` P > 1: decoder layers
      `loop_layer_index_start` s to `loop_layer_index_end` e - 1 run P times a forward, and
      their routers pick experts on every pass): each pass of a looped layer is a layer of
      its own, numbered in execution order: layers 0..s-1, then pass 0 of layers s..e-1,
      pass 1 of them, ..., then layers e.., so `num_hidden_layers + (P - 1) * (e - s)`
      layers (`loop_layers(config)` lists each one's decoder layer and pass).
    * refused, saying why: `is_moe=False` (dense Doge), `enable_moe_block=False` (dense
      Gemma 4), a top-k or expert count that differs between layers (dots3's vision
      encoder).

    Multi-token prediction (`num_nextn_predict_layers`, alias `num_mtp_layers`): no
    transformers 5.25 model builds its MTP layers into the main model (generate(use_mtp=True)
    builds a separate one), so by default the layout has the decoder layers only: what
    replay on a transformers model needs. `mtp=True` appends the `mtp_layer_count(config)`
    MTP layers as layers `num_hidden_layers, ...` (engines number them so), for engines
    that report their routes. An MTP layer is MoE per `mtp_mlp_layer_types`, Nemotron-H's
    `mtp_layers_block_type`, else the family's rule over the MTP layers alone with no dense
    first layers, as transformers' `get_mtp_config` builds them (DeepSeek-V3 and GLM-4-MoE:
    MoE; ERNIE 4.5: dense), and MoE where the family lists `mlp_layer_types` only.
    """
    config = _routed_config(config)
    name = type(config).__name__
    k_name, top_k = _field(config, _TOP_K)
    e_name, experts = _field(config, _EXPERTS)
    if top_k is None or not experts:
        missing = "top-k" if experts else "expert count"
        raise InvalidArgumentError(
            f"{name} does not look like an MoE config: no {missing} attribute (experts: "
            f"{' / '.join(_EXPERTS)}; top-k: {' / '.join(_TOP_K)}); build "
            "RoutingLayout(num_layers, top_k, num_experts, moe_layers) by hand"
        )
    _refuse_unroutable(config, name)
    n = _num_layers(config, name)
    moe = _moe_layers(config, n, name)
    looped = loop_layers(config)
    if looped is not None:  # one layer per pass of a looped layer (see above)
        moe = [v for v, (i, _) in enumerate(looped) if i in set(moe)]
        n = len(looped)
    if not moe:
        raise InvalidArgumentError(
            f"{name} has no MoE layer among its {n} layers (every layer is dense by its "
            "config): there are no routes to record or replay"
        )
    top_k = _one_value(config, k_name, top_k, moe, n, "top-k")
    experts = _one_value(config, e_name, experts, moe, n, "expert count")
    experts += _get(config, "zero_expert_num") or 0  # LongCat-Flash
    if _get(config, "model_type") == "zaya":
        experts += 1  # its skip expert, id E
    if _get(config, "model_type") == "doge":  # product keys: ids below num_keys ** 2
        experts = math.floor(math.sqrt(experts)) ** 2
    total = n
    if mtp:
        count, mtp_moe = _mtp(config, name)
        moe += [n + i for i in mtp_moe]
        total += count
    return total, int(top_k), int(experts), tuple(moe)


# Top-k and expert-count attributes, first set wins (aliases resolve through attribute_map):
# `top_k_experts` is Gemma 4's and DiffusionGemma's, `moe_top_k` and `moe_num_experts` DBRX's
# (in its `ffn_config`).
_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k", "top_k_experts",
          "moe_top_k")  # fmt: skip
_EXPERTS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
# Nemotron-H's legacy pattern characters (NemotronHConfig._pattern_to_list).
_BLOCK_CHARS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# Text configs whose decoder layer is MoE whatever `decoder_sparse_step`/`mlp_only_layers` say:
# the Qwen3-Omni talker's layer replaces the MLP those would pick with its MoE block.
_EVERY_LAYER_MOE = frozenset({"qwen3_omni_moe_talker_text"})
_PER_LAYER = object()  # marks an attribute transformers keeps per layer (`per_layer_config`)


def mtp_layer_count(config: Any) -> int:
    """How many layers a config's multi-token prediction adds after the decoder layers (0: none).

    `num_nextn_predict_layers` (alias `num_mtp_layers`) of the config `from_hf_config` reads;
    Nemotron-H counts each MTP step's `mtp_layers_block_type` blocks, as its decoder layers are
    blocks. These are the layers `RoutingLayout.from_hf_config(config, mtp=True)` appends.
    """
    config = _routed_config(config)
    return _mtp(config, type(config).__name__)[0]


def loop_layers(config: Any) -> list[tuple[int, int]] | None:
    """(decoder layer, pass) of each layer of a looped model's layout, in execution order (see
    `layout_fields`); None where no layer runs twice."""
    config = _routed_config(config)
    passes = _get(config, "loop_num_passes")
    if passes is None or passes <= 1:
        return None
    start, end = _get(config, "loop_layer_index_start"), _get(config, "loop_layer_index_end")
    n = _get(config, "num_hidden_layers")
    return (
        [(i, 0) for i in range(start)]
        + [(i, p) for p in range(passes) for i in range(start, end)]
        + [(i, 0) for i in range(end, n)]
    )


def _get(obj: Any, name: str) -> Any:
    """`obj.name` (or `obj[name]` of a dict), None when unset."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _routed_config(config: Any) -> Any:
    """The config of the decoder whose layers route."""
    if config is None:
        raise InvalidArgumentError("from_hf_config got no config (None)")
    thinker = _get(config, "thinker_config")
    if thinker is not None:  # Qwen3-Omni: the thinker is trained; its text config routes
        config = thinker
    text = _get(config, "text_config")
    if text is not None and (
        _get(config, "num_hidden_layers") is None or _field(config, _EXPERTS)[1] is None
    ):
        config = text
    return config


def _field(config: Any, names: tuple[str, ...]) -> tuple[str | None, Any]:
    """(name, value) of the first of `names` set on the config or its DBRX `ffn_config`."""
    for source in (config, _get(config, "ffn_config")):
        if source is None:
            continue
        for name in names:
            try:
                value = _get(source, name)
            except RuntimeError:
                # transformers' AmbiguousGlobalPerLayerAttributeError: a per-layer attribute.
                if not getattr(source, "is_heterogeneous", False):
                    raise
                value = _PER_LAYER
            if value is not None:
                return name, value
    return None, None


def _one_value(config: Any, name: str, value: Any, moe: list[int], n: int, what: str) -> Any:
    """One value for every MoE layer, from a plain value, a per-layer list (HunYuan's older
    configs), or transformers' `per_layer_config` (dots3's vision encoder)."""
    if value is _PER_LAYER:
        values = [_get(config.per_layer_config[i], name) for i in moe]
    elif isinstance(value, (list, tuple)):
        values = [value[i] for i in moe] if len(value) == n else list(value)
    else:
        return value
    if len(set(values)) != 1:
        raise InvalidArgumentError(
            f"{type(config).__name__}: the {what} ({name}) differs between MoE layers "
            f"({values}): a RoutingLayout has one top-k and one expert count for all MoE layers, "
            "so this model's routes cannot be stored or replayed"
        )
    return values[0]


def _refuse_unroutable(config: Any, name: str) -> None:
    """Raise for an MoE-looking config whose model has no routes, or routes no layout holds."""
    for flag in ("is_moe", "enable_moe_block"):  # Doge, Gemma 4
        if _get(config, flag) is False:
            raise InvalidArgumentError(
                f"{name} has {flag}=False: its model builds dense MLPs, no layer routes, "
                f"though the config names experts; replay needs an MoE model ({flag}=True)"
            )


def _num_layers(config: Any, name: str) -> int:
    if _get(config, "model_type") == "jetmoe":
        # Two routers a decoder layer: its attention's (MoA) and its MLP's, layers 2i, 2i + 1.
        return 2 * _get(config, "num_hidden_layers")
    if _get(config, "model_type") == "longcat_flash" or _get(config, "zero_expert_num") is not None:
        layers = _get(config, "num_layers")  # num_hidden_layers = 2 * num_layers
        if layers is not None:
            return layers
    n = _get(config, "num_hidden_layers")
    if n is None:
        raise InvalidArgumentError(
            f"{name} has no num_hidden_layers (nor a text_config that has): pass the config of "
            "the MoE decoder, or build RoutingLayout(num_layers, top_k, num_experts, moe_layers) "
            "by hand"
        )
    return n


def _routed_entries(types: Any, field_name: str, n: int) -> list[int]:
    """Indices of the routed entries of a per-layer MLP-kind list."""
    unknown = sorted(set(types) - set(MOE_MLP_TYPES) - {"dense"})
    if unknown:
        raise InvalidArgumentError(
            f"{field_name} has {unknown}: neither dense nor one of the routed kinds "
            f"{list(MOE_MLP_TYPES)}; build RoutingLayout(..., moe_layers=...) by hand"
        )
    if len(types) != n:
        raise InvalidArgumentError(
            f"{field_name} has {len(types)} entries for {n} layers; fix the config"
        )
    return [i for i, t in enumerate(types) if t in MOE_MLP_TYPES]


def _block_types(config: Any, list_name: str, pattern_name: str) -> list[str] | None:
    """Nemotron-H's per-block kinds, where MLPs and MoEs are blocks of their own; else None."""
    blocks = _get(config, list_name)
    if blocks is None:
        pattern = _get(config, pattern_name)
        if isinstance(pattern, str):
            blocks = [_BLOCK_CHARS.get(c, c) for c in pattern]
    if blocks is None or not {"moe", "mlp"} & set(blocks):
        return None  # Jamba, Granite-MoE-Hybrid: block kinds of the mixer only
    return list(blocks)


def _moe_layers(config: Any, n: int, name: str, first_dense: int | None = None) -> list[int]:
    """The MoE layers among `n` by the family's rule (see `from_hf_config`)."""
    layer_types = _get(config, "mlp_layer_types")
    if layer_types is not None:
        return _routed_entries(layer_types, "mlp_layer_types", n)
    listed = _get(config, "moe_layers")
    if isinstance(listed, (list, tuple)):
        return sorted(int(i) for i in listed)  # Llama 4 (interleave_moe_layer_step applied)
    step = _get(config, "interleave_moe_layer_step")
    if step:  # a Llama 4 config without moe_layers
        return list(range(step - 1, n, step))
    blocks = _block_types(config, "layers_block_type", "hybrid_override_pattern")
    if blocks is not None:  # Nemotron-H
        if len(blocks) != n:
            raise InvalidArgumentError(
                f"{name} lists {len(blocks)} block kinds for {n} layers; fix the config"
            )
        return [i for i, t in enumerate(blocks) if t == "moe"]
    first = _get(config, "first_k_dense_replace")
    if first is not None:
        first = first if first_dense is None else first_dense
        # DeepSeek-V2/V3, GLM-4-MoE, Kimi-K2: dense first layers, then MoE every `freq`.
        freq = _get(config, "moe_layer_freq") or 1
        return [i for i in range(n) if i >= first and i % freq == 0]
    period = _get(config, "expert_layer_period")
    if period is not None:  # Jamba: every `period`-th layer from `offset` routes.
        return [i for i in range(n) if i % period == _get(config, "expert_layer_offset")]
    dense = _get(config, "num_dense_layers")
    if dense is not None:
        return list(range(dense, n))  # LFM2-MoE, AFMoE: dense first layers
    interval = _get(config, "moe_layer_interval")
    if interval is not None:
        # ERNIE 4.5: every `interval`-th layer (1-based) from start to end, inclusive.
        lo, hi = _get(config, "moe_layer_start_index"), _get(config, "moe_layer_end_index")
        return [i for i in range(n) if (i + 1) % interval == 0 and lo <= i <= hi]
    sparse_step, only = _get(config, "decoder_sparse_step"), _get(config, "mlp_only_layers")
    if (sparse_step or only) and _get(config, "model_type") not in _EVERY_LAYER_MOE:
        # Qwen2/3-MoE, Qwen3-Next, Flint; Kolibri 1.1 lists `mlp_only_layers` alone.
        dense_layers = set(only or ())
        return [i for i in range(n) if i not in dense_layers and (i + 1) % (sparse_step or 1) == 0]
    return list(range(n))  # Mixtral, OLMoE, GPT-OSS: every layer routes.


def _mtp(config: Any, name: str) -> tuple[int, list[int]]:
    """(layers multi-token prediction adds, which of them are MoE), indices from 0."""
    steps = _get(config, "num_nextn_predict_layers") or _get(config, "num_mtp_layers") or 0
    if not steps:
        return 0, []
    blocks = _block_types(config, "mtp_layers_block_type", "mtp_hybrid_override_pattern")
    if blocks is not None:  # Nemotron-H: each step is a run of blocks, numbered on
        blocks = blocks * steps
        return len(blocks), [i for i, t in enumerate(blocks) if t == "moe"]
    types = _get(config, "mtp_mlp_layer_types")
    if types is not None:
        return steps, _routed_entries(types, "mtp_mlp_layer_types", steps)
    if _get(config, "mlp_layer_types") is not None:
        return steps, list(range(steps))  # Bailing-Hybrid, DeepSeek-V4: MoE MTP layers
    return steps, _moe_layers(config, steps, name, first_dense=0)
