"""Tiny transformers configs and models of MoE families, for layout tests.

`tiny(name, **fields)` builds the config class `transformers.<name>` with small sizes (hidden
64, 4 heads, vocab 256, experts 8, top-2) applied to the fields that class has, then `fields`.
`routers(model, class_name)` lists `(layer index, module name)` of a model's router modules.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import transformers

SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "mlp_only_intermediate_size": 64,
    "expert_ffn_hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "sliding_window": 16,
    "attention_chunk_size": 16,
    "mamba_head_dim": 16,
    "mamba_num_heads": 8,
    "ssm_state_size": 8,
    "n_groups": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "top_k_experts": 2,
    "moe_topk": 2,
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "n_shared_experts": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny(name: str, **fields: Any) -> Any:
    """A small `transformers.<name>` config: SMALL where the class has the field, then fields."""
    cls = getattr(transformers, name)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in SMALL.items() if k in known}, **fields})


def build(model_class: str, config: Any) -> torch.nn.Module:
    """`transformers.<model_class>(config)` with fixed initial weights."""
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config)


_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")


def routers(model: torch.nn.Module, class_name: str) -> list[tuple[int, str]]:
    """(layer index, module name) of every `class_name` module, in module order."""
    return [
        (int(_LAYER.search(name).group(1)), name)
        for name, module in model.named_modules()
        if type(module).__name__ == class_name
    ]
