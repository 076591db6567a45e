"""Multi-turn agentic RL with rollout routing replay on Ray: episodes with a toy tool.

    python examples/agentic_ray_job.py

An agent server (a Ray actor hosting a bfloat16 copy of the demo MoE model) serves turns:
`generate(token_ids, episode_id=, turn=)` continues the conversation so far under
`capture` and adds the turn to that episode in its node's store (`routing_replay.Episode`:
one sample per episode, the earlier turns' pages shared, a changed history refused). Agent
loops on the driver run episodes concurrently: the model speaks, a toy calculator tool
answers (its output tokens are appended), the model speaks again; three turns. Closing an
episode gives one ref. The trainer (float32) fetches the episodes by ref under a staleness
bound, measures how often its own routing agrees with the rollout's, and updates under
`replay` with the loss on the model's own tokens only (not the prompt, not tool output).
`routing_replay.integrations.vllm_server.VllmServer` serves the same `generate` /
`close_episode` calls with vLLM's AsyncLLM (tests/test_integration_vllm_server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ray_job

from routing_replay import Episode, capture, replay, to_torch
from routing_replay.model.adapters import find_routers
from routing_replay.model.agreement import routing_agreement
from routing_replay.ray import (
    StoreOptions,
    fetch_batch,
    node_store,
    release_refs,
    shutdown_node_stores,
    split_stale,
)
from routing_replay.testing import tiny_moe

ray.cloudpickle.register_pickle_by_value(ray_job)  # workers cannot import examples/
TURNS, NEW_TOKENS = 3, 8


class AgentServer:
    """A rollout server for agent loops: turns of episodes, routes into the node store."""

    def __init__(self, job: str, seed: int = 0) -> None:
        torch.set_num_threads(1)
        self.model = tiny_moe(seed, torch.bfloat16)
        self.store = node_store(
            job, find_routers(self.model).layout, options=StoreOptions(page_tokens=16)
        )
        self.episodes: dict[str, Episode] = {}
        self.policy_version = 0
        self.peak_shared = 0  # bytes the store saved by sharing pages across turns

    def generate(self, token_ids: list[int], *, episode_id: str, turn: int) -> dict[str, Any]:
        """Continue `token_ids` (the conversation so far); the turn joins its episode."""
        if turn == 1:
            self.episodes[episode_id] = Episode(self.store, episode_id, prompt_len=len(token_ids))
        episode = self.episodes[episode_id]
        episode.check_history(token_ids, turn)  # before generating anything
        ids = torch.tensor([token_ids])
        with capture(self.model) as cap, torch.no_grad():
            self.model.generate(
                input_ids=ids,
                # explicit: without it generate masks every pad-id token as padding, also a
                # sampled one inside the conversation (and capture would drop its row)
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=True,
                top_k=0,
                eos_token_id=None,
                pad_token_id=0,
            )
        (tokens,), (routes,) = cap.token_ids(), cap.routes()
        ref = episode.add_turn(tokens, routes, policy_version=self.policy_version)
        self.peak_shared = max(self.peak_shared, self.store.stats().dedup_saved_bytes)
        return {"token_ids": tokens[len(token_ids) :].tolist(), "ref": ref}

    def close_episode(self, episode_id: str) -> Any:
        """The episode's one ref; its earlier turns are released."""
        return self.episodes.pop(episode_id).close()

    def set_policy_version(self, version: int) -> None:
        """What the weights sync would do: later turns carry this version."""
        self.policy_version = version

    def stats(self) -> dict[str, int]:
        """The node store's samples, and the most bytes shared across turns so far."""
        return {"samples": self.store.stats().samples, "peak_shared_bytes": self.peak_shared}


def calculator(completion: list[int]) -> list[int]:
    """A toy tool: the sum of the completion's tokens, mod 1000, as digit tokens."""
    digits = str(sum(completion) % 1000)
    return [3 + 16 + int(d) for d in digits]  # tiny_tokenizer's ids for '0'..'9'


async def episode_loop(server, episode_id: str, prompt: list[int]) -> dict[str, Any]:
    """One agent loop: model turn, tool output, model turn, ... ; the model's token spans."""
    tokens, spans = list(prompt), []
    for turn in range(1, TURNS + 1):
        reply = await server.generate.remote(tokens, episode_id=episode_id, turn=turn)
        spans.append((len(tokens), len(tokens) + len(reply["token_ids"])))
        tokens += reply["token_ids"]
        if turn < TURNS:
            tokens += calculator(reply["token_ids"])
    ref = await server.close_episode.remote(episode_id)
    return {"tokens": np.array(tokens), "model_spans": spans, "ref": ref}


class Trainer:
    """Float32 policy; the loss covers the model's own tokens of each episode."""

    def __init__(self, seed: int = 0) -> None:
        torch.set_num_threads(1)
        self.model = tiny_moe(seed, torch.float32).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)

    def step(self, episodes: list[dict], advantages: np.ndarray, version: int) -> dict:
        """Fetch the episodes by ref (at most one version stale), compare, update."""
        fresh, stale = split_stale(
            [e["ref"] for e in episodes], policy_version=version, max_staleness=1
        )
        release_refs(stale)  # beyond the bound: never trained on, so their pages go now
        keep = [e["ref"] in fresh for e in episodes]
        episodes = [e for e, k in zip(episodes, keep, strict=True) if k]
        advantages = np.asarray(advantages)[keep]
        batch = fetch_batch(fresh, release=True)  # released once the whole batch was read
        ids, mask = ray_job.right_padded([e["tokens"] for e in episodes])
        routes = to_torch(batch, attention_mask=mask, input_ids=ids)  # checked token by token
        recorded = [routes[b, : len(e["tokens"])] for b, e in enumerate(episodes)]
        loss_mask = torch.zeros_like(mask, dtype=torch.float32)
        for b, e in enumerate(episodes):
            for start, end in e["model_spans"]:
                loss_mask[b, start:end] = 1.0  # predicted tokens: the model's, not the tool's
        with capture(self.model) as native, torch.no_grad():
            self.model(input_ids=ids, attention_mask=mask)
        self.opt.zero_grad()
        with replay(self.model, routes, attention_mask=mask), capture(self.model) as forced:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
            weights = torch.as_tensor(advantages, dtype=torch.float32)[:, None] * loss_mask[:, 1:]
            loss = -(logp[..., 0] * weights).sum() / loss_mask[:, 1:].sum()
            loss.backward()
        self.opt.step()
        return {
            "loss": float(loss),
            "without": routing_agreement(recorded, native.routes()).router_agreement,
            "with": routing_agreement(recorded, forced.routes()).router_agreement,
            "tokens": int(mask.sum()),
            "model_tokens": int(loss_mask.sum()),
        }


async def rollout(server, step: int, num_episodes: int, rng: np.random.Generator) -> list:
    prompts = [[2, *rng.integers(3, 100, 12).tolist()] for _ in range(num_episodes)]
    loops = [episode_loop(server, f"s{step}-e{i}", p) for i, p in enumerate(prompts)]
    return await asyncio.gather(*loops)


def main(argv: list[str] | None = None) -> dict:
    """Run `--steps` steps of `--episodes` episodes; print and return the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=6)
    args = parser.parse_args(argv)
    ray_job.start_ray()
    job = f"agent{uuid.uuid4().hex[:6]}"
    # one capture per model at a time: the actor serves turns one by one (max_concurrency=1)
    server = ray.remote(AgentServer).options(num_cpus=0.5).remote(job)
    trainer = ray.remote(Trainer).options(num_cpus=0.5).remote()
    rng = np.random.default_rng(0)
    figures = []
    try:
        for step in range(args.steps):
            ray.get(server.set_policy_version.remote(step))
            episodes = asyncio.run(rollout(server, step, args.episodes, rng))
            stored = ray.get(server.stats.remote())
            last = [e["tokens"][e["model_spans"][-1][0] :] for e in episodes]  # final answers
            rewards = np.array([np.mean(t < 64) for t in last])  # a toy reward
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            out = ray.get(trainer.step.remote(episodes, advantages, step))
            after = ray.get(server.stats.remote())
            figures.append({"step": step, **out, "stored": stored, "stored_after": after})
            print(
                f"step {step}: {len(episodes)} episodes x {TURNS} turns, {out['tokens']} tokens "
                f"({out['model_tokens']} the model's), up to {stored['peak_shared_bytes']} B "
                f"shared across turns; routing agreement without replay {out['without']:.4f}, with "
                f"{out['with']:.4f}; loss {out['loss']:.4f}; samples stored "
                f"{stored['samples']} -> {after['samples']} after the step"
            )
            assert out["with"] == 1.0 and after["samples"] == 0
    finally:
        shutdown_node_stores(job)
        ray.shutdown()
    return {"steps": figures}


if __name__ == "__main__":
    main()
