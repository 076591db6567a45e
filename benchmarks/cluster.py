"""A larger simulated cluster: rollout nodes apart from trainer nodes, every rank reading its
share of every rollout node's routes (disaggregated RL: slime, AReaL, prime-rl).

    python benchmarks/cluster.py            # 4 rollout nodes, 8 ranks on 2 trainer nodes
    python benchmarks/cluster.py --quick    # small sizes, every check (the tests; ~1 min)

Each rollout node's writer actor puts its GRPO groups (Qwen3-30B-A3B shape, token ids, one
`put_many` per group as the rollout hosts do) into its node store; each of the 8 rank actors
takes `refs[rank::8]` and reads them with `fetch_batch(..., out=)` into memory it reuses
every step: 1/8 of every node's samples, from 4 store actors at once, all ranks at once.
The baseline, in the same run: the writers `ray.put` each sample as int32 and the ranks
`ray.get` their share and pack it into their reused int32 output.

Per way: the slowest rank's read (what a step waits for), the median rank's, each store
actor's bytes served (its own counter) over the slowest read, bytes crossing nodes
(measured: the actors' `bytes_served`; for int32 the arrays the ranks received) and each
rank's peak private memory. Every rank's tensor is checked against routes generated here
(CRC32 of the int16 form). Writes benchmarks/results/cluster.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
import zlib
from typing import Any

import numpy as np
from harness import (
    MB,
    RESULTS,
    SimCluster,
    layout_of_model,
    machine,
    markdown_table,
    mem_end,
    mem_start,
    to_int32,
    write_json,
)

MODEL = "qwen3-30b-a3b"


def workload(quick: bool) -> dict[str, Any]:
    """GRPO groups: (prompt tokens, completion tokens, samples a group, groups a node)."""
    if quick:
        return {"prompt": 96, "completion": 40, "n": 8, "groups": 2}
    return {"prompt": 2048, "completion": 1024, "n": 8, "groups": 16}


def samples_of(w: dict, node: int) -> list[tuple[str, int, int]]:
    """(sample id, group seed, sample seed) of one rollout node's samples, group by group."""
    return [
        (f"n{node}-g{g}-s{j}", node * 1000 + g, (node * 1000 + g) * 100 + j)
        for g in range(w["groups"])
        for j in range(w["n"])
    ]


def routes_of(w: dict, group: int, seed: int, layout: Any) -> np.ndarray:
    """A sample's stored-dtype routes: its group's prompt, then its own completion; the last
    row missing (the last sampled token is never forwarded)."""
    prompt = layout.random_routes(np.random.default_rng([group, 1]), w["prompt"], layout.dtype)
    own = layout.random_routes(np.random.default_rng([seed, 2]), w["completion"], layout.dtype)
    out = np.concatenate([prompt, own])
    out[-1] = layout.missing
    return out


def tokens_of(w: dict, group: int, seed: int) -> np.ndarray:
    prompt = np.random.default_rng([group, 3]).integers(0, 150_000, w["prompt"], dtype=np.int32)
    own = np.random.default_rng([seed, 4]).integers(0, 150_000, w["completion"], dtype=np.int32)
    return np.concatenate([prompt, own])


# -- the actors -----------------------------------------------------------------------------


class Writer:
    """One rollout node: its samples, put into its node store or `ray.put` as int32."""

    def __init__(self, job: str, node: int, w: dict) -> None:
        from routing_replay.ray import StoreOptions, node_store

        self.layout = layout_of_model(MODEL)
        self.w, self.samples = w, samples_of(w, node)
        pages = -(-(w["prompt"] + w["completion"]) // 128) * len(self.samples)
        self.store = node_store(job, self.layout, StoreOptions(capacity_tokens=pages * 128))
        self.routes = [routes_of(w, g, s, self.layout) for _, g, s in self.samples]
        self.tokens = [tokens_of(w, g, s) for _, g, s in self.samples]

    def put(self, rep: int) -> list:
        from routing_replay import PutRequest

        refs, n = [], self.w["n"]
        for g in range(0, len(self.samples), n):
            refs += self.store.put_many(
                [
                    PutRequest(
                        f"{self.samples[i][0]}-r{rep}",
                        self.routes[i],
                        prompt_len=self.w["prompt"],
                        token_ids=self.tokens[i],
                    )
                    for i in range(g, g + n)
                ]
            )
        return refs

    def put_int32(self) -> list:
        import ray

        return [ray.put(to_int32(r, self.layout)) for r in self.routes]


class Rank:
    """One trainer rank: reads its share into output memory it reuses every step."""

    def __init__(self) -> None:
        import routing_replay  # noqa: F401  (imported before the memory baseline)

        self.out: np.ndarray | None = None
        self.base = mem_start()

    def _output(self, nbytes: int) -> np.ndarray:
        if self.out is None or self.out.nbytes < nbytes:
            self.out = np.empty(nbytes, dtype=np.uint8)
        return self.out[:nbytes]

    def read(self, way: str, share: list, start_at: float) -> dict:
        """Wait until `start_at` (every rank starts together), read, return timings and CRC."""
        import ray
        import torch

        from routing_replay import to_torch
        from routing_replay.ray import fetch_batch

        layout = layout_of_model(MODEL)
        time.sleep(max(0.0, start_at - time.perf_counter()))
        t0 = time.perf_counter()
        received = 0
        if way == "store":
            out = self._output(sum(r.num_tokens for r in share) * layout.bytes_per_token)
            batch = fetch_batch(share, out=out)
            routes = to_torch(batch)
        else:
            arrays = ray.get(share)
            received = sum(a.nbytes for a in arrays)
            total = sum(len(a) for a in arrays)
            out = self._output(total * layout.values_per_token * 4).view(np.int32)
            np.concatenate(arrays, out=out.reshape(total, *arrays[0].shape[1:]))
            del arrays
            routes = torch.from_numpy(out.reshape(total, layout.num_moe_layers, layout.top_k))
        t1 = time.perf_counter()
        crc = zlib.crc32(routes.to(torch.int16).numpy())
        return {"t0": t0, "t1": t1, "crc": crc, "received": received, "mem": mem_end(self.base)}


# -- the run ----------------------------------------------------------------------------------


def expected_crcs(w: dict, rollout: int, ranks: int, layout: Any) -> list[int]:
    """CRC32 of the int16 form of each rank's share, in its order (generated here)."""
    every = [s for node in range(rollout) for s in samples_of(w, node)]
    crcs = []
    for rank in range(ranks):
        parts = [to_int32(routes_of(w, g, s, layout), layout) for _, g, s in every[rank::ranks]]
        crcs.append(zlib.crc32(np.concatenate(parts).astype(np.int16)))
    return crcs


def run(quick: bool, rollout: int, trainer_nodes: int, ranks: int, repeats: int, log=print):
    import ray

    from routing_replay.ray import release_refs, shutdown_node_stores, store_actor

    w, layout = workload(quick), layout_of_model(MODEL)
    per_node = w["groups"] * w["n"] * (w["prompt"] + w["completion"])
    int32_node = per_node * layout.values_per_token * 4
    # A trainer node's object store receives its ranks' int32 share of every rollout node.
    store_bytes = max(200 * MB, int(1.5 * int32_node * rollout / trainer_nodes))
    cluster = SimCluster(trainer_nodes + rollout, store_bytes, __name__)
    job = f"cl{uuid.uuid4().hex[:6]}"
    try:
        trainer_ids, rollout_ids = cluster.nodes[:trainer_nodes], cluster.nodes[trainer_nodes:]
        writers = [cluster.actor(Writer, n, job, i, w) for i, n in enumerate(rollout_ids)]
        rank_actors = [
            cluster.actor(Rank, trainer_ids[r * trainer_nodes // ranks]) for r in range(ranks)
        ]
        ray.get([a.__ray_ready__.remote() for a in writers + rank_actors])
        actors = [store_actor(job, node_id=n) for n in rollout_ids]
        want = expected_crcs(w, rollout, ranks, layout)
        results: dict[str, Any] = {}
        for way in ("store", "ray-int32"):
            steps = []
            for rep in range(repeats + 1):  # step 0: fresh output memory
                if way == "store":
                    refs = [
                        r for part in ray.get([a.put.remote(rep) for a in writers]) for r in part
                    ]
                    served0 = [ray.get(a.stats.remote())["bytes_served"] for a in actors]
                else:
                    refs = [r for p in ray.get([a.put_int32.remote() for a in writers]) for r in p]
                start = time.perf_counter() + 0.5  # every rank starts then, together
                got = ray.get(
                    [a.read.remote(way, refs[r::ranks], start) for r, a in enumerate(rank_actors)]
                )
                step = {
                    "slowest_s": max(g["t1"] - g["t0"] for g in got),
                    "median_s": statistics.median(g["t1"] - g["t0"] for g in got),
                    "wall_s": max(g["t1"] for g in got) - min(g["t0"] for g in got),
                    "identical": [g["crc"] for g in got] == want,
                    "peak_private_mb": [g["mem"]["private_delta"] / MB for g in got],
                }
                if way == "store":
                    served = [ray.get(a.stats.remote())["bytes_served"] for a in actors]
                    step["served"] = [b - a for a, b in zip(served0, served, strict=True)]
                    release_refs(refs)
                else:
                    step["served"] = [sum(g["received"] for g in got)]
                    del refs
                steps.append(step)
                log(
                    f"  {way:<10} step {rep}: slowest rank {step['slowest_s']:.3f}s, median "
                    f"{step['median_s']:.3f}s, crossing {sum(step['served']) / MB:.0f} MB, "
                    f"identical={step['identical']}"
                )
            results[way] = summarise(steps, per_node * rollout, layout)
        return {
            "machine": machine(),
            "workload": {
                **w,
                "model": MODEL,
                "rollout_nodes": rollout,
                "ranks": ranks,
                "trainer_nodes": trainer_nodes,
                "tokens": per_node * rollout,
            },
            "ways": results,
        }
    finally:
        shutdown_node_stores(job)
        cluster.close()


def summarise(steps: list[dict], tokens: int, layout: Any) -> dict:
    steady = steps[1:]
    slowest = statistics.median(s["slowest_s"] for s in steady)
    wall = statistics.median(s["wall_s"] for s in steady)
    served = steady[0]["served"]
    return {
        "slowest_rank_s": slowest,
        "median_rank_s": statistics.median(s["median_s"] for s in steady),
        "first_step_slowest_s": steps[0]["slowest_s"],
        "ns_per_token": slowest / tokens * 1e9,
        "bytes_crossing": sum(served),
        "per_actor_MBps": [b / MB / wall for b in served] if len(served) > 1 else None,
        "int32_bytes": tokens * layout.values_per_token * 4,
        "peak_private_mb_per_rank": steps[0]["peak_private_mb"],
        "identical": all(s["identical"] for s in steps),
        "steps": steps,
    }


def report(res: dict) -> str:
    w, ways = res["workload"], res["ways"]
    rows = []
    labels = {
        "store": "this project (store actors, wire form)",
        "ray-int32": "Ray object store, int32",
    }
    for way, r in ways.items():
        per_actor = r["per_actor_MBps"]
        rows.append(
            [
                labels[way],
                f"{r['slowest_rank_s']:.3f}",
                f"{r['median_rank_s']:.3f}",
                f"{r['first_step_slowest_s']:.3f}",
                f"{r['bytes_crossing'] / MB:,.0f}",
                "-" if per_actor is None else " / ".join(f"{x:.0f}" for x in per_actor),
                f"{max(r['peak_private_mb_per_rank']):,.0f}",
                "yes" if r["identical"] else "NO",
            ]
        )
    head = (
        f"{w['rollout_nodes']} rollout nodes x {w['groups']} GRPO groups of {w['n']} x "
        f"({w['prompt']} + {w['completion']}) tokens ({w['tokens']:,} tokens, {w['model']}), "
        f"{w['ranks']} ranks on {w['trainer_nodes']} trainer nodes\n\n"
    )
    table = markdown_table(
        [
            "way",
            "slowest rank s",
            "median rank s",
            "first step s",
            "MB crossing (measured)",
            "per store actor MB/s",
            "peak rank MB",
            "exact",
        ],
        rows,
    )
    ratio = ways["ray-int32"]["slowest_rank_s"] / ways["store"]["slowest_rank_s"]
    return head + table + f"\n\nRay int32 / this project, slowest rank: {ratio:.2f}x\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rollout-nodes", type=int, default=4)
    ap.add_argument("--trainer-nodes", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "cluster.json"))
    args = ap.parse_args()
    res = run(args.quick, args.rollout_nodes, args.trainer_nodes, args.ranks, args.repeats)
    from pathlib import Path

    write_json(Path(args.out), res)
    print(report(res))
    if not all(r["identical"] for r in res["ways"].values()):
        raise SystemExit("a rank's routes differ from the generated ones")


if __name__ == "__main__":
    main()
