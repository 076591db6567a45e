"""Measure the Ray read paths on two simulated nodes: local shm, remote via the store actor.

    python examples/ray_read_throughput.py [--samples 32] [--tokens 2048]

A writer on each node puts samples of the Qwen3-30B-A3B layout (48 MoE layers, top-8 of
128 experts: 384 B/token as uint8); a reader on the first node fetches them with
`fetch_batch` + `to_torch` (its own node's from shared memory, the other node's through that node's
store actor) and with `read_dataset` + `routes_collate_fn`. Prints medians of 5 rounds.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from routing_replay import RoutingLayout, to_torch
from routing_replay.ray import (
    StoreOptions,
    fetch_batch,
    node_store,
    read_dataset,
    routes_collate_fn,
    shutdown_node_stores,
)

LAYOUT = RoutingLayout(num_layers=48, top_k=8, num_experts=128)  # Qwen3-30B-A3B
JOB = "throughput"


class Writer:
    """Puts random samples into its node's store."""

    def put(self, prefix: str, samples: int, tokens: int) -> list:
        store = node_store(JOB, LAYOUT, options=StoreOptions(capacity_tokens=4 * samples * tokens))
        rng = np.random.default_rng(0)
        routes = LAYOUT.random_routes(rng, tokens, np.int32)
        return [store.put(f"{prefix}{i}", routes) for i in range(samples)]


class Reader:
    """Times the two read paths in a trainer-side worker."""

    def fetch(self, refs: list) -> float:
        t = time.perf_counter()
        routes = to_torch(fetch_batch(refs))  # what a trainer does with the batch
        assert routes.shape[0] == sum(r.num_tokens for r in refs)
        return time.perf_counter() - t

    def dataset(self, refs: list) -> float:
        t = time.perf_counter()
        rows = 0
        for b in read_dataset(refs).iter_torch_batches(
            batch_size=None, collate_fn=routes_collate_fn(LAYOUT)
        ):
            rows += len(b["sample_ids"])
        assert rows == len(refs)
        return time.perf_counter() - t


def main() -> None:
    """Start the two-node cluster, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 300 * 2**20}
    )
    cluster.add_node(num_cpus=2, object_store_memory=300 * 2**20)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        pin = [
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(n, soft=False), "num_cpus": 0.5}
            for n in nodes
        ]
        writers = [ray.remote(Writer).options(**p).remote() for p in pin]
        reader = ray.remote(Reader).options(**pin[0]).remote()
        local, remote = ray.get(
            [w.put.remote(f"n{k}-", args.samples, args.tokens) for k, w in enumerate(writers)]
        )
        mb = args.samples * args.tokens * LAYOUT.bytes_per_token / 2**20
        print(
            f"{args.samples} samples x {args.tokens} tokens x {LAYOUT.bytes_per_token} B = "
            f"{mb:.1f} MiB per node; a RoutingRef pickles to {len(pickle.dumps(local[0]))} B, "
            f"a list of {len(local)} to {len(pickle.dumps(local))} B"
        )
        ray.get(reader.fetch.remote(local[:1] + remote[:1]))  # warm up imports and mappings
        for label, refs, method in [
            ("fetch_batch + to_torch, same node (shm)", local, reader.fetch),
            ("fetch_batch + to_torch, other node", remote, reader.fetch),
            ("read_dataset + collate, same node", local, reader.dataset),
            ("read_dataset + collate, other node", remote, reader.dataset),
        ]:
            times = [ray.get(method.remote(refs)) for _ in range(5)]
            t = statistics.median(times)
            print(f"{label:40s} {t * 1e3:8.1f} ms  {mb / t:8.0f} MiB/s")
    finally:
        shutdown_node_stores(JOB)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
