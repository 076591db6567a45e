"""The two-node read: `fetch_batch` as a trainer calls it (over the direct connection to the
store actor), then the Ray path in phases (the store actor's call, the pull of what it
shipped, the rebuild into the reader's reused memory), then Ray's own transfer of as many
bytes in as many objects, the floor of any path through Ray's object store.

    python benchmarks/remote_profile.py deepseek-v3 grpo     # or qwen3-30b-a3b, long

A writer actor on the second of two simulated nodes puts the batch (as benchmarks/
transport.py builds it) into its node store; the driver, on the head, reads it through the
store actor, step by step, and prints each phase. Nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import numpy as np
from harness import MB, SimCluster, capacity, layout_of_model, sample_routes, sample_tokens


class Writer:
    def __init__(self, job: str, model: str, kind: str) -> None:
        import transport as T

        from routing_replay.ray import StoreOptions, node_store

        layout = layout_of_model(model)
        grpo = kind == "grpo"
        self.spec = T.grpo_spec(model, 64, 8, 2048, 1024) if grpo else T.long_spec(model, 16, 32768)
        self.store = node_store(job, layout, StoreOptions(capacity_tokens=capacity(self.spec)))
        cache: dict = {}
        n = len(self.spec["samples"])
        self.routes = [sample_routes(self.spec, i, layout, cache) for i in range(n)]
        self.tokens = [sample_tokens(self.spec, i) for i in range(n)]

    def ship(self, nbytes: int, pieces: int) -> tuple[list, float]:
        """`nbytes` of random bytes put in `pieces` objects: their refs, and the puts' time."""
        import ray

        data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        t = time.perf_counter()
        refs = [ray.put(p) for p in np.array_split(data, pieces)]
        return refs, time.perf_counter() - t

    def put(self, step: int) -> list:
        return [
            self.store.put(f"s{step}-{i}", r, prompt_len=self.spec["samples"][i][1], token_ids=t)
            for i, (r, t) in enumerate(zip(self.routes, self.tokens, strict=True))
        ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=["qwen3-30b-a3b", "deepseek-v3"])
    ap.add_argument("kind", choices=["grpo", "long"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    import ray

    from routing_replay.ray import fetch_batch, release_refs, shutdown_node_stores, store_actor
    from routing_replay.ray.remote import REMOTE_PIECES

    layout = layout_of_model(args.model)
    cluster = SimCluster(2, 4 << 30, __name__)
    job = f"prof{uuid.uuid4().hex[:6]}"
    try:
        writer = cluster.actor(Writer, cluster.nodes[1], job, args.model, args.kind)
        out, totals, directs = None, [], []
        for step in range(args.steps):
            tp = time.perf_counter()
            refs = ray.get(writer.put.remote(step))
            put_s = time.perf_counter() - tp
            tokens = sum(r.num_tokens for r in refs)
            if out is None:  # a trainer's reused output (step 0 pays its page faults)
                out = np.empty(tokens * layout.bytes_per_token, dtype=np.uint8)
            actor = store_actor(job, node_id=cluster.nodes[1])
            before = ray.get(actor.stats.remote())["direct_reads"]
            td = time.perf_counter()
            fetch_batch(refs, out=out)  # the direct path (Ray's where none can be made)
            direct_s = time.perf_counter() - td
            direct_reads = ray.get(actor.stats.remote())["direct_reads"] - before
            t0 = time.perf_counter()
            shipped = ray.get(actor.read.remote(refs))  # the store actor's call
            t1 = time.perf_counter()
            ray.wait([shipped], fetch_local=True)  # the pull to this node
            t2 = time.perf_counter()
            wire = ray.get(shipped)
            wire.batch(out)  # the rebuild
            nbytes = wire.nbytes
            t3 = time.perf_counter()
            totals.append(t3 - t0)
            directs.append(direct_s)
            print(
                f"step {step}: put {put_s:.3f} s; fetch_batch {direct_s:.3f} s ({direct_reads} "
                f"direct reads); Ray path: actor {t1 - t0:.3f} s, pull {t2 - t1:.3f} s, "
                f"rebuild {t3 - t2:.3f} s; {wire.nbytes / MB:.0f} MB in {len(wire.routes)} runs, "
                f"{tokens:,} tokens",
                flush=True,
            )
            del wire, shipped
            release_refs(refs)
        print(
            f"steady median: fetch_batch {statistics.median(directs[1:]):.3f} s, "
            f"Ray path {statistics.median(totals[1:]):.3f} s"
        )
        puts, pulls = [], []  # Ray alone: the same bytes, put on the writer's node, pulled here
        for _ in range(args.steps):
            refs, put_s = ray.get(writer.ship.remote(nbytes, REMOTE_PIECES))
            t = time.perf_counter()
            ray.wait(refs, num_returns=len(refs), fetch_local=True)
            pulls.append(time.perf_counter() - t)
            puts.append(put_s)
            del refs
        print(
            f"Ray alone, {nbytes / MB:.0f} MB in {REMOTE_PIECES} objects: put median "
            f"{statistics.median(puts):.3f} s (min {min(puts):.3f}), pull median "
            f"{statistics.median(pulls):.3f} s (min {min(pulls):.3f})"
        )
    finally:
        shutdown_node_stores(job)
        cluster.close()


if __name__ == "__main__":
    main()
