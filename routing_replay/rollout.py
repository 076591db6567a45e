"""Rollout workers: Ray actors that generate with `capture` and keep the routes on their node.

A `RolloutWorker` hosts an inference model (here a transformers MoE model; an engine such
as vLLM plugs in the same way: its routes go to `node_store(...).put`). Each `generate`
call samples `n` completions per prompt under `capture`, puts every sample's routes into
its node's store (with `prompt_len` and the token ids, so GRPO's n samples of a prompt
share their full prompt pages), and returns `Rollout`s: tokens and a `RoutingRef`, never
the routes.

Ray is imported inside the functions: `import routing_replay` works without Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from routing_replay.capture import capture
from routing_replay.layout import RoutingLayout
from routing_replay.store import DEFAULT_PAGE_TOKENS, RoutingRef
from routing_replay.store_actor import DEFAULT_CAPACITY_TOKENS, current_node_id, node_store

if TYPE_CHECKING:
    from ray.actor import ActorHandle


@dataclass(frozen=True)
class Rollout:
    """One generated sample as the rollout side hands it out: tokens and a ref, never routes."""

    sample_id: str
    prompt_index: int
    prompt_len: int
    ref: RoutingRef
    tokens: np.ndarray | None = None  # int32 prompt + completion ids, aligned with the routes


def demo_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny seeded Qwen3-MoE causal LM (4 MoE layers, top-4 of 32 experts) for demos and tests."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # init near zero: let the input decide routing
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model.to(dtype).eval()


def demo_tokenizer() -> Any:
    """A character-level tokenizer for `demo_model`: pad 0, eos 1, bos 2, printable ASCII 3-97."""
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


class RolloutWorker:
    """Hosts an inference model; generates under `capture` and puts routes in its node's store."""

    def __init__(
        self,
        job: str,
        model_fn: Callable[[], torch.nn.Module],
        *,
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        torch_threads: int | None = 1,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.job = job
        self.model = model_fn()
        self.layout = RoutingLayout.from_hf_config(self.model.config)
        self.node_id = current_node_id()
        self._store_options = {"capacity_tokens": capacity_tokens, "page_tokens": page_tokens}

    def info(self) -> dict[str, Any]:
        """Node id and routing layout of this worker."""
        return {"node_id": self.node_id, "layout": self.layout.to_json()}

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_new_tokens: int = 16,
        step: int = 0,
        policy_version: int | None = None,
        first_prompt_index: int = 0,
        seed: int = 0,
        temperature: float = 1.0,
        return_tokens: bool = True,
    ) -> list[Rollout]:
        """Sample `n` completions per prompt; routes go to this node's store, refs come back.

        Each ref carries `policy_version` (default `step`: the version of the weights this
        worker generates with). Sample ids are `s<step>-p<prompt index>-<j>`: prompt indices
        must be unique across the workers of a step (pass `first_prompt_index`), as every
        worker of a node shares that node's store.
        """
        store = node_store(self.job, self.layout, **self._store_options)
        version = step if policy_version is None else policy_version
        pad = self.model.config.pad_token_id
        rows = [list(p) for p in prompts for _ in range(n)]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):  # left padding, as generate expects
            input_ids[b, width - len(row) :] = torch.tensor(row)
            mask[b, width - len(row) :] = 1
        torch.manual_seed(seed)
        with capture(self.model) as cap, torch.no_grad():
            self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                pad_token_id=pad,
            )
        out = []
        for b, (routes, tokens) in enumerate(zip(cap.routes(), cap.token_ids(), strict=True)):
            prompt_index = first_prompt_index + b // n
            sample_id = f"s{step}-p{prompt_index}-{b % n}"
            prompt_len = len(rows[b])
            ref = store.put(
                sample_id, routes, prompt_len=prompt_len, token_ids=tokens, policy_version=version
            )
            kept = np.asarray(tokens, dtype=np.int32) if return_tokens else None
            out.append(Rollout(sample_id, prompt_index, prompt_len, ref, kept))
        return out


def rollout_worker(
    job: str,
    model_fn: Callable[[], torch.nn.Module],
    *,
    node_id: str | None = None,
    num_cpus: float = 1,
    **kwargs: Any,
) -> ActorHandle:
    """Start a `RolloutWorker` Ray actor (pinned to `node_id` if given); returns its handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": num_cpus}
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(RolloutWorker).options(**options).remote(job, model_fn, **kwargs)
