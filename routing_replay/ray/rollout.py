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

from routing_replay.layout import RoutingLayout
from routing_replay.model.capture import capture
from routing_replay.ray.client import node_store
from routing_replay.ray.names import current_node_id
from routing_replay.ray.options import StoreOptions
from routing_replay.store import PutRequest, RoutingRef

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


class RolloutWorker:
    """Hosts an inference model; generates under `capture` and puts routes in its node's store."""

    def __init__(
        self,
        job: str,
        model_fn: Callable[[], torch.nn.Module],
        *,
        store_options: StoreOptions | None = None,
        torch_threads: int | None = 1,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.job = job
        self.model = model_fn()
        self.layout = RoutingLayout.from_hf_config(self.model.config)
        self.node_id = current_node_id()
        self.store_options = store_options

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

        All samples of the call are put at once (`RoutingStore.put_many`): an error leaves
        none of them stored.

        Each ref carries `policy_version` (default `step`: the version of the weights this
        worker generates with). Sample ids are `s<step>-p<prompt index>-<j>`: prompt indices
        must be unique across the workers of a step (pass `first_prompt_index`), as every
        worker of a node shares that node's store.
        """
        store = node_store(self.job, self.layout, self.store_options)
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
        requests = [
            PutRequest(
                f"s{step}-p{first_prompt_index + b // n}-{b % n}", r, len(rows[b]), t, version
            )
            for b, (r, t) in enumerate(zip(cap.routes(), cap.token_ids(), strict=True))
        ]
        refs = store.put_many(requests)  # the whole generate call, or nothing of it
        return [
            Rollout(
                q.sample_id, first_prompt_index + b // n, q.prompt_len, ref, _kept(q, return_tokens)
            )
            for b, (q, ref) in enumerate(zip(requests, refs, strict=True))
        ]


def _kept(request: PutRequest, keep: bool) -> np.ndarray | None:
    return np.asarray(request.token_ids, dtype=np.int32) if keep else None


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
