"""Tiny, seeded transformers MoE models of every supported family, for the tests."""

from __future__ import annotations

import torch
import transformers

from routing_replay.testing import seeded_moe

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attention_dropout=0.0,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

# DeepSeek-style routed experts: 16 in 4 groups (2 kept), top-4, one shared expert.
GROUPED = dict(
    n_routed_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    n_shared_experts=1,
    moe_intermediate_size=16,
)
# Multi-head latent attention (DeepSeek-V2/V3/V3.2, GLM-4-MoE-Lite) at tiny ranks.
MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)

# Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE) at tiny sizes.
GATED_DELTANET = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)

CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        head_dim=8,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2, head_dim=8
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        num_hidden_layers=3,
        first_k_dense_replace=1,
        **GROUPED,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        **MLA,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=16,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        head_dim=8,
    ),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **COMMON,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[2],
        norm_topk_prob=True,
        head_dim=8,
        **GATED_DELTANET,
    ),
    "flex_olmo": lambda: transformers.FlexOlmoConfig(
        **COMMON, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False
    ),
    "minimax": lambda: transformers.MiniMaxConfig(
        **COMMON,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_local_experts=6,
        num_experts_per_tok=2,
        head_dim=8,
    ),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4},
        num_hidden_layers=3,
        first_k_dense_replace=1,
        **GROUPED,
        topk_method="group_limited_greedy",
        routed_scaling_factor=2.5,
        **MLA,
        head_dim=8,
    ),
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **{**COMMON, "num_key_value_heads": 4},
        num_hidden_layers=3,
        first_k_dense_replace=1,
        **GROUPED,
        routed_scaling_factor=2.5,
        **MLA,
        head_dim=8,
        # DeepSeek Sparse Attention keeps every key at these lengths. With index_topk=4,
        # generate over a left-padded batch and a lone forward of a sample attended to other
        # keys, so they routed differently (the capture tests compare the two).
        index_topk=128,
        index_head_dim=16,
        index_n_heads=2,
    ),
    "deepseek_v4": lambda: transformers.DeepseekV4Config(
        **{**COMMON, "num_key_value_heads": 1},
        num_hidden_layers=3,
        mlp_layer_types=["hash_moe", "moe", "moe"],  # layer 0 routes by a token-id table
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=16,
        head_dim=16,
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=128,  # every key at these lengths, as for DeepSeek-V3.2
        sliding_window=16,
        hc_mult=2,
        num_nextn_predict_layers=0,
    ),
    "dots1": lambda: transformers.Dots1Config(
        **COMMON,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        **GROUPED,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        head_dim=8,
    ),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        **COMMON, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, head_dim=8
    ),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        **COMMON,
        num_hidden_layers=4,
        moe_num_experts=8,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_intermediate_size=16,
        moe_layer_start_index=1,
        moe_layer_end_index=3,
        moe_layer_interval=2,
        head_dim=8,
        tie_word_embeddings=False,  # tied, the tiny model greedily repeats its last token
    ),
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **{**COMMON, "num_key_value_heads": 4},
        num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        **GROUPED,
        routed_scaling_factor=1.8,
        **MLA,
    ),
    "exaone_moe": lambda: transformers.ExaoneMoeConfig(
        **COMMON,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        num_shared_experts=1,
        moe_intermediate_size=16,
        routed_scaling_factor=2.5,
        sliding_window=16,
    ),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
        **COMMON, num_hidden_layers=2, num_experts=8, moe_topk=2, head_dim=8
    ),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        **COMMON,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        head_dim=8,
        **GATED_DELTANET,
    ),
    "granitemoe": lambda: transformers.GraniteMoeConfig(
        **COMMON, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2
    ),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        **{k: v for k, v in COMMON.items() if k != "attention_dropout"},
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        routed_scaling_factor=1.5,
        tie_word_embeddings=False,
    ),
    "cohere2_moe": lambda: transformers.Cohere2MoeConfig(
        **COMMON,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        tie_word_embeddings=False,
    ),
    "cohere2_moe_sigmoid": lambda: transformers.Cohere2MoeConfig(
        **COMMON,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        tie_word_embeddings=False,
        expert_selection_fn="sigmoid",
    ),
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        **{**COMMON, "num_key_value_heads": 4},
        num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_local_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        n_shared_experts=1,
        moe_intermediate_size=16,
        routed_scaling_factor=2.0,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
    ),
    "jamba": lambda: transformers.JambaConfig(
        **COMMON,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=4,
        attn_layer_offset=2,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        use_mamba_kernels=False,  # the PyTorch path: no CUDA kernels here
        tie_word_embeddings=False,
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
}

FAMILIES = sorted(CONFIGS)
# Router weights, by where each family keeps them (HunYuan: a Linear `wg`; LFM2: feed_forward).


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised tiny causal LM of `family`, in eval mode, with spread-out routers."""
    return seeded_moe(CONFIGS[family](), seed, dtype)


# Vision-language MoE models: the text stack routes; images enter it as embeddings.
VL_TEXT = dict(
    COMMON,
    num_hidden_layers=3,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
)
VL_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=1,
    out_hidden_size=32,
)
IMAGE_TOKEN = 90  # one image of 4 x 4 patches is 4 of these after the 2 x 2 merge
VL_CONFIGS = {
    "qwen3_vl_moe": lambda: transformers.Qwen3VLMoeConfig(
        text_config=dict(
            VL_TEXT,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[1],
            head_dim=8,
        ),
        vision_config=dict(VL_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=IMAGE_TOKEN,
        video_token_id=91,
        vision_start_token_id=92,
    ),
    "glm4v_moe": lambda: transformers.Glm4vMoeConfig(
        text_config=dict(
            VL_TEXT,
            rope_parameters={**VL_TEXT["rope_parameters"], "partial_rotary_factor": 1.0},
            **GROUPED,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
        ),
        vision_config=dict(VL_VISION, image_size=16),
        image_token_id=IMAGE_TOKEN,
        video_token_id=91,
        image_start_token_id=92,
        image_end_token_id=93,
        video_start_token_id=94,
        video_end_token_id=95,
    ),
}


def tiny_vl_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny vision-language MoE model of `family`, in eval mode."""
    return seeded_moe(VL_CONFIGS[family](), seed, auto="AutoModelForImageTextToText")
