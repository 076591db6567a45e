"""The tiny seeded MoE models and tokenizer behind the demo, examples, benchmarks and tests.

One builder, so that every place that needs "a small real MoE model" gets the same one:
`seeded_moe` builds any transformers MoE config (nothing is downloaded) with its routers
spread by a seeded init, so that the input, not the init, decides routing; `tiny_moe` is
the demo's Qwen3-MoE, whose shape keyword arguments change (vLLM's CPU attention needs
`head_dim=32`; benchmarks widen it). The toy GRPO pieces the Ray examples share
(`start_ray`, `make_prompts`, `group_advantages`, `right_padded`, `grpo_loss`) live
here too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
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
ROUTER_STD = 0.5  # spread router weights: near-zero ones would route every token alike
BIAS_STD = 0.1  # DeepSeek-style selection bias, as a trained load balancer leaves it
# Router weights of the transformers MoE families (module paths end so).
ROUTER_WEIGHTS = (
    "mlp.gate.weight",
    "mlp.router.weight",
    "mlp.gate.wg.weight",
    "feed_forward.gate.weight",
    "block_sparse_moe.router.weight",
    "feed_forward.router.weight",
)


def tiny_moe_config(**overrides: Any) -> Any:
    """A `transformers.Qwen3MoeConfig` of the tiny shape, with `overrides` applied."""
    import transformers

    return transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})


def seeded_moe(
    config: Any,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    router_std: float | None = ROUTER_STD,
    bias_std: float = BIAS_STD,
    auto: str = "AutoModelForCausalLM",
) -> Any:
    """A randomly initialised causal LM of `config` in eval mode: the same weights for the
    same `seed` in every process (a rollout engine and a trainer built apart hold the same
    model, each in its own dtype). Router weights get std `router_std` (None: transformers'
    init), a DeepSeek-style selection bias std `bias_std`, DeepSeek-V4's hash routing distinct
    experts per token. `auto`: the transformers auto class that builds it (a
    vision-language model: "AutoModelForImageTextToText")."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if router_std is not None and name.endswith(ROUTER_WEIGHTS) and param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * router_std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * bias_std)
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=gen)[: buf.shape[1]] for _ in buf]
                buf.copy_(torch.stack(rows))
    return model.to(dtype).eval()


def tiny_moe(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """The demo's tiny Qwen3-MoE causal LM (`tiny_moe_config(**overrides)`), seeded."""
    return seeded_moe(tiny_moe_config(**overrides), seed, dtype)


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


def group_advantages(rewards: np.ndarray, n: int) -> np.ndarray:
    """GRPO advantages: rewards normalised within each prompt's group of n samples."""
    groups = rewards.reshape(-1, n)
    adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
    return adv.reshape(-1)


def right_padded(sequences: list[np.ndarray], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, S]` input ids and attention mask, right padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[b, : len(seq)] = 1
    return ids, mask


def grpo_loss(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, prompt_lens: list[int], adv: Any
) -> torch.Tensor:
    """Policy-gradient loss over completion tokens: -mean(advantage * log p(token))."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    completion = mask[:, 1:].clone()
    for b, p in enumerate(prompt_lens):
        completion[b, : max(p - 1, 0)] = 0
    weights = torch.as_tensor(adv, dtype=torch.float32)[:, None] * completion
    return -(logp * weights).sum() / completion.sum().clamp(min=1)


def start_ray(num_cpus: int = 2) -> None:
    """The examples' Ray: join the cluster `ray job submit` runs them on, or start a small
    local one (its own, even if another local cluster runs)."""
    import os

    import ray

    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        ray.init(address="auto", log_to_driver=False)
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            object_store_memory=100 * 2**20,  # Ray's object store lives in /dev/shm too
            include_dashboard=False,
            log_to_driver=False,
        )


def make_prompts(num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 6-40 tokens of `tiny_moe`'s vocabulary, each starting with BOS (2)."""
    rng = np.random.default_rng(seed)
    vocab = TINY_MOE["vocab_size"]
    return [
        [2, *rng.integers(3, vocab, int(rng.integers(6, 41))).tolist()] for _ in range(num_prompts)
    ]
