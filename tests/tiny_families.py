"""A tiny, seeded model of any transformers MoE model type, built from its own config class.

`tests/moe_models.py` writes one config per family by hand; this builds the others generically:
the config class's defaults with every size field it has shrunk (hidden 64, 3 layers, the
first dense where the family has dense layers, 8 experts, top-2, 2 expert groups of which 1
is kept), per-layer lists cut to 3 entries, and the few fields a family needs besides.
Routers get spread weights and random selection biases and per-expert scales (Zaya: a
skip expert's bias that lets it be picked), so that
ties never decide routing and a formula that dropped a bias or a scale would show.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import numpy as np
import torch
import transformers
from transformers import CONFIG_MAPPING, PreTrainedModel
from transformers.models.auto import modeling_auto

from routing_replay.model.adapters import known_routers
from routing_replay.validate import MISSING

LAYERS, EXPERTS, TOP_K = 3, 8, 2

SIZES = {  # applied where the config class has the field
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "dense_intermediate_size": 64,
    "first_dense_intermediate_size": 64,
    "mlp_only_intermediate_size": 64,
    "prefix_dense_intermediate_size": 64,
    "share_expert_dim": 32,
    "expert_ffn_hidden_size": 32,
    "moe_hidden_size": 32,
    "shared_experts_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "router_hidden_size": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_head_dim": 16,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "mamba_d_head": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "sliding_window": 16,
    "attention_chunk_size": 16,
    "kv_channels": 16,
    "num_experts_per_tok": TOP_K,
    "top_k_experts": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "num_experts_per_token": TOP_K,
    "experts_per_token": TOP_K,
    "num_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "num_expert_group": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_dropout": 0.0,
    # Routing settings away from their neutral defaults: a formula that drops one shows.
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_routed_scaling_factor": 1.5,
    "route_scale": 1.7,
    "router_scaling_factor": 2.0,
}
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}

# What some families need besides the shrunk sizes.
EXTRA: dict[str, dict] = {
    "gemma4_text": {
        "enable_moe_block": True,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 256,
    },
    "glm4v_moe_text": {"rope_parameters": {**MROPE, "partial_rotary_factor": 0.5}},
    "hy_v4_vl_text": {"rope_parameters": MROPE},
    "kolibri1_1": {"index_num_heads": 2},
    "ernie4_5_vl_moe_text": {
        "moe_intermediate_size": [32, 32],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 500000.0,
            "mrope_section": [3, 3, 2],
        },
    },
    "glm5_next_text": {"num_key_value_heads": 4, "qk_rope_head_dim": 0},
    "granitemoehybrid": {
        "mamba_d_head": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    },
    "qwen4_exp_text": {
        "layer_types": ["linear_attention", "linear_attention", "indexed_attention"],
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 32},
    # PhiMoE masks experts whose logit is 2 x this (relative) below the top one: at the
    # default 0.01 only the top expert is left in a tiny model, and its router gets no gradient.
    "phimoe": {"router_jitter_noise": 0.3},
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "max_seq_len": 64,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K},
    },
    # Inkling: two shared experts, their gammas normalised with the chosen experts' weights.
    "inkling_text": {"n_shared_experts": 2},
    # Inkling2-Loop: layers 1 and 2 of 4 run 3 times a forward (8 layout layers, one a pass).
    "inkling2_loop_text": {
        "num_hidden_layers": 4,
        "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        "loop_num_passes": 3,
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 3,
        "n_layers_per_attn_res_block": 1,
    },
    # Doge: MoE (a dense MLP by default), 16 experts: 4 product keys a half.
    "doge": {"is_moe": True, "num_experts": 16},
    # Zaya routes to one expert (its config refuses more).
    "zaya": {"num_experts_per_tok": 1},
    # LongCat: 2 zero-computation experts (ids 8 and 9, whose output is the input).
    "longcat_flash": {"head_dim": 8, "zero_expert_num": 2},
    **{
        t: {"num_key_value_heads": 4}
        for t in ("axk2", "glm_moe_dsa", "mistral_large4_text", "dots3_note_text")
    },
}


# Routers whose logits come out of an MLP of their own (Zaya): every matrix of it is spread,
# or the logits are near 0 and the choice is the balancing biases'.
SPREAD_ALL = {"ZayaRouter"}

# Families whose classes leave their experts' weights uninitialised (torch.empty) when built
# from a config alone.
UNINITIALISED = {"qwen3_omni_moe_talker_text"}


def router_weight(module) -> torch.nn.Parameter:
    """The weight a router's logits come from: its first matrix, or Doge's MoE block's
    `router_gate` (its first matrix is its shared expert's)."""
    gate = getattr(module, "router_gate", None)
    if gate is not None:
        return gate.weight
    return next(p for p in module.parameters() if p.dim() == 2)


def tiny_config(model_type: str):
    """The model type's config class with every size field shrunk (see the module docstring)."""
    cls = CONFIG_MAPPING[model_type]
    names = {f.name for f in dataclasses.fields(cls)}
    default = cls()
    kwargs = {k: v for k, v in SIZES.items() if k in names}
    layers = getattr(default, "num_hidden_layers", None)
    for name in ("num_hidden_layers", "num_layers", "n_layers"):
        if name in names:
            kwargs[name] = LAYERS
    for name in sorted(names):  # per-layer lists: cut to LAYERS entries
        try:
            value = getattr(default, name, None)
        except RuntimeError:  # a per-layer attribute with differing values
            value = None
        if name == "mlp_layer_types" and value is None:
            kwargs[name] = ["dense"] + ["sparse"] * (LAYERS - 1)
        elif isinstance(value, list) and layers and len(value) == layers and name not in kwargs:
            if name == "mlp_layer_types":
                sparse = [t for t in dict.fromkeys(value) if t != "dense"]
                first = ["dense"] if "dense" in value else sparse[:1]
                kwargs[name] = first + [sparse[i % len(sparse)] for i in range(LAYERS - 1)]
            elif name in ("layer_types", "layers_block_type"):
                kinds = list(dict.fromkeys(value))
                kwargs[name] = [kinds[i % len(kinds)] for i in range(LAYERS)]
            else:
                kwargs[name] = value[:LAYERS]
    if "first_k_dense_replace" in names:
        kwargs["first_k_dense_replace"] = 1
    if "mlp_only_layers" in names:
        kwargs["mlp_only_layers"] = [0]
    for name in ("num_dense_layers", "num_dense_blocks"):
        if name in names:
            kwargs[name] = 1
    if "moe_layer_start_index" in names:
        kwargs.update(moe_layer_start_index=1, moe_layer_end_index=LAYERS - 1)
    kwargs.update(EXTRA.get(model_type, {}))
    return cls(**kwargs)


def model_class(config) -> type:
    """The causal LM class of the config's type, else its base model class, else the module's
    model class typed with this config (text stacks of multimodal models)."""
    for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"):
        name = getattr(modeling_auto, table).get(config.model_type)
        if name:
            return getattr(transformers, name)
    module = importlib.import_module(
        type(config).__module__.replace(".configuration_", ".modeling_")
    )
    found = [
        c
        for c in vars(module).values()
        if inspect.isclass(c)
        and issubclass(c, PreTrainedModel)
        and c.__module__ == module.__name__
        and getattr(c, "config_class", None) is type(config)
        and not c.__name__.endswith("PreTrainedModel")
    ]
    found.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), len(c.__name__)))
    return found[0]


def tiny_family_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny model of `model_type` in eval mode, its routers spread (see the docstring)."""
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = model_class(config)(config)
    gen = torch.Generator().manual_seed(seed + 1)
    known = set(known_routers())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if model_type in UNINITIALISED and ".experts." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        for module in model.modules():
            if type(module).__name__ in SPREAD_ALL:
                for weight in (p for p in module.parameters() if p.dim() == 2):
                    weight.copy_(torch.randn(weight.shape, generator=gen) * 0.5)
            elif type(module).__name__ in known:
                weight = router_weight(module)
                weight.copy_(torch.randn(weight.shape, generator=gen) * 0.5)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
            elif name.endswith(("per_expert_scale", "gate.global_scale")):  # Inkling: the latter
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
            elif name.endswith("balancing_biases"):  # Zaya's; the last is its skip expert's
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
                tensor[-1] += 0.2  # from -1 (never picked) to picked now and then
    return model.to(dtype).eval()


def random_routes(layout, seed: int, missing: float, batch: int = 2, seq: int = 8):
    """`[batch, seq, L, K]` routes: a uniformly random top-k set of distinct ids per row, and
    a fraction `missing` of the rows -1."""
    rng = np.random.default_rng(seed)
    keys = rng.random((batch * seq, layout.num_moe_layers, layout.num_experts))
    ids = np.argsort(keys, axis=-1)[..., : layout.top_k]
    ids[rng.random((batch * seq, layout.num_moe_layers)) < missing] = MISSING
    return torch.from_numpy(ids.reshape(batch, seq, layout.num_moe_layers, layout.top_k))
