"""Buffered rollouts survive a killed job: routes saved with the checkpoint, replayed on resume.

    python examples/resume_ray_job.py --checkpoint ckpt            # roll out, train, save
    python examples/resume_ray_job.py --checkpoint ckpt --resume   # a new job: load, train

Asynchronous RL trains on a buffer of rollouts that outlives a step; when the job dies, the
routes of the buffered samples (in /dev/shm, owned by the job's store actors) die with it.
The first run rolls out 8 prompts x 4 samples (two bfloat16 rollout workers), trains the
first half under replay and keeps the second half buffered; its checkpoint is the trainer
model's state dict, the buffer (tokens, prompt lengths, advantages, refs) and the buffered
samples' routes (`save_routes(..., read=fetch_batch)`), plus, as the oracle of the check,
the routes the store held. `--hold` then waits (the test kills the whole job here: driver,
actors, Ray). The resumed run starts no rollout worker: it loads the routes into its own
node store (`load_routes(..., old_refs)` gives the new refs), loads the model, and trains
the buffered half under replay; the experts must be called with exactly the saved routes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import sys
import time
import uuid
from typing import Any

import numpy as np
import ray
import torch

from routing_replay import RoutingLayout, capture, load_routes, replay, save_routes, to_torch
from routing_replay.model.agreement import routing_agreement
from routing_replay.ray import (
    StoreOptions,
    fetch_batch,
    node_store,
    rollout_worker,
    shutdown_node_stores,
)
from routing_replay.testing import group_advantages, grpo_loss, right_padded, tiny_moe

VOCAB = 128


class Trainer:
    """A float32 policy that trains on samples by ref under replay, and saves or loads."""

    def __init__(self, seed: int, state: str | None = None) -> None:
        torch.set_num_threads(1)
        self.model = tiny_moe(seed, torch.float32).train()
        if state:
            self.model.load_state_dict(torch.load(state, weights_only=True))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)

    def step(self, tokens: list, prompt_lens: list, adv: np.ndarray, refs: list) -> dict:
        """One replayed update on the samples; the routes its experts were called with."""
        ids, mask = right_padded(tokens)
        routes = to_torch(fetch_batch(refs, release=True), attention_mask=mask, input_ids=ids)
        self.opt.zero_grad()
        with replay(self.model, routes), capture(self.model) as forced:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            loss = grpo_loss(logits, ids, mask, prompt_lens, adv)
            loss.backward()
        self.opt.step()
        return {"loss": float(loss), "forced": forced.routes()}  # [T, L, K] per sample

    def save(self, path: str) -> None:
        torch.save(self.model.state_dict(), path)


def rollout(job: str, seed: int) -> list[Any]:
    model_fn = lambda: tiny_moe(seed, torch.bfloat16)  # noqa: E731  (the "inference engine")
    workers = [
        rollout_worker(job, model_fn, num_cpus=0.5, store_options=StoreOptions(page_tokens=16))
        for _ in range(2)
    ]
    rng = np.random.default_rng(seed)
    prompts = [[2, *rng.integers(3, VOCAB, int(rng.integers(6, 30))).tolist()] for _ in range(8)]
    pending = [
        w.generate.remote(prompts[k * 4 : k * 4 + 4], n=4, max_new_tokens=16,
                          first_prompt_index=k * 4, seed=seed + k)
        for k, w in enumerate(workers)
    ]  # fmt: skip
    out = [r for part in ray.get(pending) for r in part]
    for w in workers:
        ray.kill(w)
    return out


def first_run(job: str, ckpt: str, seed: int, hold: bool) -> dict:
    rollouts = rollout(job, seed)
    rewards = np.array([float((r.tokens[r.prompt_len :] < VOCAB // 2).mean()) for r in rollouts])
    adv = group_advantages(rewards, 4)
    half = len(rollouts) // 2
    trainer = ray.remote(Trainer).options(num_cpus=0.5).remote(seed)
    now, later = rollouts[:half], rollouts[half:]
    m = ray.get(
        trainer.step.remote([r.tokens for r in now], [r.prompt_len for r in now], adv[:half],
                            [r.ref for r in now])
    )  # fmt: skip
    # The checkpoint: model, buffer, the buffered samples' routes; the oracle beside it.
    os.makedirs(ckpt, exist_ok=True)
    ray.get(trainer.save.remote(os.path.join(ckpt, "model.pt")))
    refs = [r.ref for r in later]
    buffer = {
        "tokens": [r.tokens for r in later],
        "prompt_lens": [r.prompt_len for r in later],
        "advantages": adv[half:],
        "refs": refs,
    }
    with open(os.path.join(ckpt, "buffer.pkl"), "wb") as f:
        pickle.dump(buffer, f)
    routes_bytes = save_routes(os.path.join(ckpt, "routes.arrow"), refs, read=fetch_batch)
    held = to_torch(fetch_batch(refs))  # what the store holds: the oracle of the resume check
    np.save(os.path.join(ckpt, "expected.npy"), held.numpy())
    result = {"trained": len(now), "buffered": len(later), "loss": m["loss"],
              "archive_bytes": routes_bytes}  # fmt: skip
    with open(os.path.join(ckpt, "first.json"), "w") as f:
        json.dump(result, f)
    print(f"trained {len(now)} samples, buffered {len(later)}; checkpoint in {ckpt} "
          f"({routes_bytes} B of routes)", flush=True)  # fmt: skip
    if hold:
        print("HOLDING", flush=True)
        while True:  # the test kills the whole job here
            time.sleep(1)
    return result


def resume(job: str, ckpt: str, seed: int) -> dict:
    with open(os.path.join(ckpt, "buffer.pkl"), "rb") as f:
        buffer = pickle.load(f)
    layout = RoutingLayout.from_hf_config(tiny_moe(seed).config)
    store = node_store(job, layout)  # this node's store of the new job (its actor starts)
    old = buffer["refs"]
    new = load_routes(os.path.join(ckpt, "routes.arrow"), store, old)
    trainer = ray.remote(Trainer).options(num_cpus=0.5).remote(seed, os.path.join(ckpt, "model.pt"))
    m = ray.get(
        trainer.step.remote(buffer["tokens"], buffer["prompt_lens"], buffer["advantages"], new)
    )
    expected = np.load(os.path.join(ckpt, "expected.npy"))
    lengths = [len(t) for t in buffer["tokens"]]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    recorded = [expected[a:b] for a, b in itertools.pairwise(starts)]
    # The experts' ids (forced) against the routes saved before the kill, token by token.
    agreement = routing_agreement(recorded, m["forced"])
    exact = all(
        f.shape == r.shape
        and np.array_equal(np.sort(f[kept(r)], -1), np.sort(r[kept(r)].astype(f.dtype), -1))
        for f, r in zip(m["forced"], recorded, strict=True)
    )
    stats = store.stats()
    return {
        "resumed": len(new),
        "rollouts": 0,  # no rollout worker in this run: nothing regenerated
        "old_stores": sorted({r.store for r in old}),
        "new_store": store.name,
        "agreement": agreement.router_agreement,
        "exact": exact,
        "loss": m["loss"],
        "stored_after": stats.samples,
    }


def kept(routes: np.ndarray) -> np.ndarray:
    """The rows the rollout recorded (the others are routed natively)."""
    return (routes >= 0).all(-1).all(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold", action="store_true", help="wait after the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the resumed run's figures (JSON)")
    args = parser.parse_args(argv)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=2, object_store_memory=100 * 2**20,
                 include_dashboard=False, log_to_driver=False)  # fmt: skip
    job = f"resume-{uuid.uuid4().hex[:8]}"
    try:
        if not args.resume:
            first_run(job, args.checkpoint, args.seed, args.hold)
            print("OK")
            return 0
        m = resume(job, args.checkpoint, args.seed)
    finally:
        shutdown_node_stores(job)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(m, f)
    print(f"resumed {m['resumed']} buffered samples into {m['new_store']} (saved from "
          f"{', '.join(m['old_stores'])}); agreement at the experts with the saved routes "
          f"{m['agreement']:.4f}; loss {m['loss']:.4f}; nothing regenerated")  # fmt: skip
    ok = m["agreement"] == 1.0 and m["exact"] and m["stored_after"] == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
