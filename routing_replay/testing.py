"""The tiny seeded MoE model and tokenizer behind the demo, examples, benchmarks and tests.

One builder, so that every place that needs "a small real MoE model" gets the same one:
a transformers Qwen3-MoE from a tiny config (nothing is downloaded), its routers spread
by a seeded init so that the input, not the init, decides routing. Keyword arguments
change its shape (vLLM's CPU attention needs `head_dim=32`; benchmarks widen it).
"""

from __future__ import annotations

from typing import Any

import torch

# The demo model's shape: 4 MoE layers, top-4 of 32 experts, a 128-token vocabulary.
TINY_MOE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
ROUTER_INIT_STD = 0.5  # spread router weights: near-zero ones would route every token alike


def tiny_moe_config(**overrides: Any) -> Any:
    """A `transformers.Qwen3MoeConfig` of the tiny shape, with `overrides` applied."""
    import transformers

    return transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})


def tiny_moe(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """The tiny seeded Qwen3-MoE causal LM in eval mode (config: `tiny_moe_config(**overrides)`).

    Same `seed`, same weights, in every process: a rollout engine and a trainer built
    apart hold the same model (in their own dtype).
    """
    import transformers

    torch.manual_seed(seed)
    config = tiny_moe_config(**overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * ROUTER_INIT_STD)
    return model.to(dtype).eval()


def save_tiny_moe(path: str, seed: int = 0, **overrides: Any) -> str:
    """`tiny_moe(seed, **overrides)` saved with `save_pretrained` (what engines load); `path`."""
    tiny_moe(seed, **overrides).save_pretrained(path)
    return path


def tiny_tokenizer() -> Any:
    """A character-level tokenizer for `tiny_moe`: pad 0, eos 1, bos 2, printable ASCII 3-97."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab = {**specials, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # and back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
