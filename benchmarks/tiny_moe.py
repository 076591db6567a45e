"""The tiny MoE models the benchmarks roll out and train: Qwen3-MoE and DeepSeek-V3 (and,
for the overhead benchmark, Gemma 4, Nemotron-H and Llama 4).

Random init, seeded; wide enough (64 experts, hidden 256) that bfloat16 and float32
routers really disagree sometimes, as they do at scale.
"""

from __future__ import annotations

import torch
import transformers

from routing_replay.testing import seeded_moe, tiny_moe_config

VOCAB = 512


def qwen3_moe_config() -> transformers.PretrainedConfig:
    """Qwen3-MoE: softmax then top-8 of 64 experts, renormalised, 4 MoE layers."""
    return tiny_moe_config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=64,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        max_position_embeddings=512,
    )


def deepseek_v3_config() -> transformers.PretrainedConfig:
    """DeepSeek-V3: sigmoid + bias, top-8 of 64 experts in 8 groups (4 kept), first layer dense."""
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_hidden_layers=5,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=64,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=64,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def gemma4_config() -> transformers.PretrainedConfig:
    """Gemma 4: its router's softmax, renormalised, x per-expert scales; top-8 of 64, 4 layers."""
    return transformers.Gemma4TextConfig(
        **COMMON,
        num_hidden_layers=4,
        enable_moe_block=True,
        num_experts=64,
        top_k_experts=8,
        moe_intermediate_size=64,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
        sliding_window=64,
        global_head_dim=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )


def nemotron_h_config() -> transformers.PretrainedConfig:
    """Nemotron-H: Mamba, attention and MoE blocks (3 MoE: sigmoid + bias, top-8 of 64)."""
    return transformers.NemotronHConfig(
        **{k: v for k, v in COMMON.items() if k != "intermediate_size"},
        num_hidden_layers=6,
        layers_block_type=["mamba", "moe", "attention", "moe", "mamba", "moe"],
        n_routed_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=64,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=64,
        n_group=1,
        topk_group=1,
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


def llama4_config() -> transformers.PretrainedConfig:
    """Llama 4: a [T, E] score matrix, top-1 of 16 experts (every expert runs every token)."""
    return transformers.Llama4TextConfig(
        **COMMON,
        num_hidden_layers=4,
        num_local_experts=16,
        num_experts_per_tok=1,
        intermediate_size_mlp=512,
        attention_chunk_size=64,
    )


MODELS = {"qwen3_moe": qwen3_moe_config, "deepseek_v3": deepseek_v3_config}
# Families new in issue 32, for the overhead benchmark (`--models`).
MORE_MODELS = {"gemma4": gemma4_config, "nemotron_h": nemotron_h_config, "llama4": llama4_config}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The float32 model `name`, randomly initialised from `seed` (routers as transformers
    initialises them, a small trained-looking load-balancing bias), in eval mode."""
    return seeded_moe({**MODELS, **MORE_MODELS}[name](), seed, router_std=None, bias_std=0.01)
