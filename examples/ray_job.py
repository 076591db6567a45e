"""One GRPO-shaped step with rollout routing replay on Ray: the routing_replay "main job".

    python examples/ray_job.py                                      # starts a local Ray
    ray job submit --working-dir . -- python examples/ray_job.py    # on a running cluster

Rollout workers (one per node, bfloat16 copies of a tiny Qwen3-MoE) sample n completions
per prompt under `capture` and put the routes into their node's store; the driver gets
tokens and `RoutingRef`s only. It scores the completions (a toy reward), and a trainer
actor (float32 model) fetches the routes by ref, measures how often its own routing
agrees with the rollout's, and runs the GRPO update forward+backward under `replay`.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
import time
import uuid
from typing import Any

import numpy as np
import ray
import torch

from routing_replay import capture, replay, to_torch
from routing_replay.model.agreement import routing_agreement
from routing_replay.ray import (
    Rollout,
    StoreOptions,
    fetch_batch,
    rollout_worker,
    shutdown_node_stores,
    store_actors,
)
from routing_replay.testing import (
    group_advantages,
    grpo_loss,
    make_prompts,
    right_padded,
    start_ray,
    tiny_moe,
)

VOCAB = 128  # tiny_moe's vocabulary; token ids >= 3 are ordinary tokens


def reward(tokens: np.ndarray, prompt_len: int) -> float:
    """Toy reward: the fraction of completion tokens in the lower half of the vocabulary."""
    completion = tokens[prompt_len:]
    return float((completion < VOCAB // 2).mean()) if len(completion) else 0.0


class Trainer:
    """The training side: a float32 copy of the policy, fed routes by ref."""

    def __init__(self, seed: int = 0) -> None:
        torch.set_num_threads(1)
        self.model = tiny_moe(seed, torch.float32).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)

    def step(
        self,
        tokens: list[np.ndarray],
        prompt_lens: list[int],
        advantages: np.ndarray,
        refs: list[Any],
    ) -> dict[str, Any]:
        """Fetch the routes by ref, compare native routing, update under replay."""
        here = ray.get_runtime_context().get_node_id()
        t0 = time.perf_counter()
        batch = fetch_batch(refs, release=True)  # consumed: the stores free the pages
        fetch_s = time.perf_counter() - t0
        ids, mask = right_padded(tokens)
        routes = to_torch(batch, attention_mask=mask, input_ids=ids)  # [B, S, L, K], checked
        recorded = [routes[b, : len(t)] for b, t in enumerate(tokens)]
        with capture(self.model) as native, torch.no_grad():
            self.model(input_ids=ids, attention_mask=mask)
        without = routing_agreement(recorded, native.routes())
        self.opt.zero_grad()
        with replay(self.model, routes), capture(self.model) as forced:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            loss = grpo_loss(logits, ids, mask, prompt_lens, advantages)
            loss.backward()
        router_grad = sum(
            float(p.grad.norm()) for n, p in self.model.named_parameters() if "mlp.gate" in n
        )
        self.opt.step()
        with_replay = routing_agreement(recorded, forced.routes())
        return {
            "loss": float(loss),
            "router_grad_norm": router_grad,
            "without": without.as_dict(),
            "with": with_replay.as_dict(),
            "fetch_s": fetch_s,
            "routes_bytes": batch.nbytes,
            "tokens": int(mask.sum()),
            "local_samples": sum(r.node_id == here for r in refs),
        }


def run(
    job: str,
    num_prompts: int = 8,
    n: int = 4,
    max_new_tokens: int = 24,
    num_workers: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Roll out, score and train one step; returns the figures the summary prints."""
    t0 = time.perf_counter()
    nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
    model_fn = functools.partial(tiny_moe, seed, torch.bfloat16)  # the "inference engine"
    workers = [
        rollout_worker(
            job,
            model_fn,
            node_id=nodes[i % len(nodes)],
            num_cpus=0.5,
            store_options=StoreOptions(page_tokens=16),
        )
        for i in range(num_workers)
    ]
    trainer = ray.remote(Trainer).options(num_cpus=0.5).remote(seed)
    prompts = make_prompts(num_prompts, seed)
    shares = np.array_split(np.arange(num_prompts), num_workers)
    t_roll = time.perf_counter()
    pending = [
        w.generate.remote(
            [prompts[i] for i in share],
            n=n,
            max_new_tokens=max_new_tokens,
            first_prompt_index=int(share[0]),
            seed=seed + k,
        )
        for k, (w, share) in enumerate(zip(workers, shares, strict=True))
        if len(share)
    ]
    rollouts: list[Rollout] = [r for part in ray.get(pending) for r in part]
    rollout_s = time.perf_counter() - t_roll
    # What crossed into the driver: tokens and refs; the refs alone are O(samples).
    refs = [r.ref for r in rollouts]
    ref_bytes = len(pickle.dumps(refs))
    rewards = np.array([reward(r.tokens, r.prompt_len) for r in rollouts])
    adv = group_advantages(rewards, n)
    stats_before = _store_stats(job)
    t_train = time.perf_counter()
    metrics = ray.get(
        trainer.step.remote(
            [r.tokens for r in rollouts], [r.prompt_len for r in rollouts], adv, refs
        )
    )
    train_s = time.perf_counter() - t_train
    stats_after = _store_stats(job)
    for actor in [*workers, trainer]:
        ray.kill(actor)
    num_tokens = sum(r.ref.num_tokens for r in rollouts)
    return {
        **metrics,
        "nodes": len(nodes),
        "samples": len(rollouts),
        "mean_reward": float(rewards.mean()),
        "sample_tokens": num_tokens,
        "ref_bytes_per_sample": ref_bytes / len(refs),
        "routes_bytes_per_token": metrics["routes_bytes"] / num_tokens,
        "stored_before": stats_before,
        "stored_after": stats_after,
        "rollout_s": rollout_s,
        "train_s": train_s,
        "total_s": time.perf_counter() - t0,
    }


def _store_stats(job: str) -> dict[str, int]:
    stats = ray.get([a.stats.remote() for a in store_actors(job).values()])
    keys = ("samples", "pages_used", "bytes_used", "dedup_saved_bytes")
    return {k: sum(s[k] for s in stats) for k in keys}


def summary(m: dict[str, Any]) -> str:
    """The figures of one step, for people."""
    per_layer = lambda a: " ".join(f"{x:.3f}" for x in a["per_layer"])  # noqa: E731
    before, after = m["stored_before"], m["stored_after"]
    return "\n".join(
        [
            f"routing_replay GRPO step on Ray: {m['samples']} samples ({m['sample_tokens']} "
            f"tokens) on {m['nodes']} node(s), mean reward {m['mean_reward']:.3f}",
            f"  driver received per sample: {m['ref_bytes_per_sample']:.0f} B of RoutingRef "
            f"(routes: {m['routes_bytes_per_token']:.0f} B/token, never through the driver)",
            f"  node stores after rollout: {before['samples']} samples, {before['pages_used']} "
            f"pages, {before['dedup_saved_bytes']} B saved by prompt-page sharing; after the "
            f"trainer consumed them: {after['samples']} samples, {after['pages_used']} pages",
            f"  trainer read {m['local_samples']} samples from its node's shared memory and "
            f"{m['samples'] - m['local_samples']} through other nodes' store actors "
            f"({m['routes_bytes'] / 1024:.1f} KiB of routes, fetch {m['fetch_s'] * 1e3:.1f} ms)",
            f"  routing agreement, trainer (fp32) vs rollout (bf16), without replay: "
            f"{m['without']['router_agreement']:.4f} of router decisions, "
            f"{m['without']['token_disagreement']:.3f} of tokens differ in some layer; "
            f"per layer {per_layer(m['without'])}",
            f"  routing agreement with replay: {m['with']['router_agreement']:.4f} "
            f"(per layer {per_layer(m['with'])})",
            f"  replayed update: loss {m['loss']:.4f}, router grad norm "
            f"{m['router_grad_norm']:.3g} (routers still learn)",
            f"  time: rollout {m['rollout_s']:.1f} s (actor start included), train step "
            f"{m['train_s']:.1f} s, total {m['total_s']:.1f} s",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Run one step and print its summary; exit status 0 when replay reproduced every route."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    start_ray()
    job = f"grpo-{uuid.uuid4().hex[:8]}"
    try:
        m = run(job, args.prompts, args.n, args.max_new_tokens, args.workers, args.seed)
    finally:
        shutdown_node_stores(job)
    print(summary(m))
    print(f"  wall time including Ray start: {time.perf_counter() - start:.1f} s")
    ok = m["with"]["router_agreement"] == 1.0 and m["stored_after"]["samples"] == 0
    print("OK" if ok else "FAILED: replay did not reproduce every route, or samples leaked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
