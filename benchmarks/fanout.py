"""Fan-out of routes to trainer ranks: whole samples to every rank (today) vs each rank's ranges.

    python benchmarks/fanout.py            # 16 x 32K tokens and 8 GRPO groups of 8 x (2K + 1K)
    python benchmarks/fanout.py --quick    # small, ragged sizes, every path and check (CI; ~1 min)

Modelled on the slime host-OOM report (#2384/#2385: trainers fanned each sample's whole
routes out to every rank that touches it). A two-node `ray.cluster_utils.Cluster` in one
machine: the head is the rollout node, whose writer actor puts the routes into the node
store (`node_store(...).put_many`, with token ids: a GRPO group's 8 samples share their
prompt pages, checked on `pages_used`); the second node is the trainer node, where DP=2 x
CP=4 = 8 rank actors read them. DP rank d takes half of the samples (contiguous), and each
of its CP ranks needs Megatron's zigzag context-parallel share of every sample: each sample
padded to a multiple of 2 x CP and cut into 2 x CP chunks, CP rank r keeping chunks r and
2 x CP - 1 - r (NeMo-RL's packed THD path: `pack(multiple=2 * cp)`, then Transformer
Engine's per-sequence partitioning). Workloads, Qwen3-30B-A3B shape (48 MoE layers, top-8 of
128 experts, uint8 ids, 384 bytes a token):

- long: 16 samples x 32,768 tokens (each its own prompt);
- grpo: 8 groups x 8 samples x (2,048 prompt + 1,024 completion tokens).

Two paths, both through `routing_replay.integrations.nemo_rl`, in the same run:

- whole (today): `routes_for_rank(pack(attach_routes(batch, fetch=fetch_batch)), cp_rank=r)`:
  every CP rank reads its DP half's whole samples, then slices;
- ranges: `read_rank_routes(batch, cp_rank=r, pack_multiple=2 * cp, fetch=fetch_batch)`:
  `TokenShard` ranges through the same slicing, `fetch_batch(refs, ranges=...)`, `place`.

Checks: each rank's routes are identical on both paths and equal to a zigzag of the
generated routes done here by hand (CRC32 of the int8 bytes: whole == ranges == expected);
a rank's ranged read holds exactly its share of tokens (bytes read = share x 384; the
issue's bound is one page per range above it). Measured per rank: bytes read (num_tokens x
bytes_per_token of the Arrow batch it got), bytes received from the other node (its delta
of the rollout node's store actor `stats()["bytes_served"]`, the public counter: what the
actor shipped, in whatever form remote reads use), peak RSS (VmHWM of the rank actor,
reset through /proc/self/clear_refs before the step, minus its RSS then; of which private:
less the growth of its shared pages, i.e. the object-store pages it mapped), seconds; per
path: bytes that crossed nodes (bytes_served delta), all loopback TCP bytes of the machine
meanwhile (/proc/net/dev `lo`: Ray's object transfer between the two simulated nodes plus
every RPC, a cross-check from outside the library), wall time. Also dense int32 bytes
(tokens x 48 x 8 x 4) and cross-node bytes over them (the issue's target for grpo: <= 0.15).

The same 8 rank actors run both paths, after one small warm-up step of each (first-call
costs: imports, connections). Step 0 of every workload and path runs first, the ranks one
after the other (so the counter gives each rank's bytes received), and its memory is
reported: glibc maps and unmaps every block of 64 KiB and up (MALLOC_MMAP_THRESHOLD_), so
no step reuses memory another left on the heap. Object-store pages can be reused (Ray
places a new object where a freed one was, which the process may have mapped already):
`shared_over_received` says how much of what a rank received counted as new RSS, and
`private_plus_received` is a bound no reuse hides. Then the steady steps, every rank at
once, paths alternating, whose median time is reported.

Micro (one process, no Ray, before the cluster starts): `store.read([ref])` of a whole
32K-token sample against `ranges=` of 1/8 of it: the zigzag two-chunk 1/8 (CP = 8) and a
contiguous 1/8, and of one token (a read's fixed cost); into a new Arrow buffer (fresh
pages) and into a reused one (`out=`); median of repeats, ratio in the same run (issue
target <= 0.3x).

--quick: long 4 samples of 2,048 / 2,045 / 2,041 / 3 tokens, grpo 2 groups x 4 x (256 +
128 - 5j) tokens: ragged on purpose (per-sample padding; the 3-token sample leaves CP rank 3
an empty share, an `(0, 0)` range).

Prints one Markdown table and writes benchmarks/results/fanout.json (--out to change;
with --quick the default is fanout.quick.json in the temp dir, so committed results stay).
Exits non-zero if any rank's routes differ between the paths or from the expected ones.

Here: the micro measurement, the run and the command line; the workloads and the actors are
in fanout_ranks.py, the per-rank rows, table and targets in fanout_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import harness
from fanout_ranks import (
    CP,
    DP,
    MODEL,
    PAGE_TOKENS,
    PATHS,
    Rank,
    Writer,
    long_spec,
    micro,
    pages_expected,
    specs_for,
)
from fanout_report import summarise, summary, table, targets
from harness import (
    MB,
    RESULTS,
    SimCluster,
    layout_of_model,
    machine,
    write_json,
)

# Every process allocates with the system allocator, Arrow included (harness.ENV). And
# glibc maps every block of 64 KiB and up on its own and unmaps it when freed: by default it
# raises that threshold after the first large free (up to 32 MiB) and keeps freed memory on
# its heap, where the next step of the same process would reuse it without new RSS.
ENV = {**harness.ENV, "MALLOC_MMAP_THRESHOLD_": "65536"}


def loopback_bytes() -> int:
    """Bytes received on the loopback interface so far (all TCP between local processes)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    return 0


# -- the driver's own allocator ---------------------------------------------------------


def fixed_mmap_threshold() -> bool:
    """This process as the actors run (ENV's MALLOC_MMAP_THRESHOLD_, read by glibc only at
    start): every block of 64 KiB and up mapped fresh and unmapped when freed."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, 65536))  # M_MMAP_THRESHOLD
    return False


# -- the run ---------------------------------------------------------------------------


def run(quick: bool, repeats: int, log: Any = print) -> dict:
    import ray

    from routing_replay.ray import shutdown_node_stores, store_actor

    layout = layout_of_model(MODEL)
    bpt = layout.bytes_per_token
    specs = specs_for(quick)
    warm = long_spec([96, 61, 64, 5])  # a warm-up step: first-call costs stay out of step 0
    results: dict[str, Any] = {"workloads": {}}

    t = time.perf_counter()
    results["micro"] = micro(32768, 4, 21 if quick else 101)
    m = results["micro"]["rows"]
    log(
        f"micro: 1/8 of a {results['micro']['tokens_per_sample']}-token sample vs a full read: "
        + ", ".join(
            f"{k} {v['ratio_to_full']:.3f}x" for k, v in m.items() if not k.startswith("full")
        )
        + f" ({time.perf_counter() - t:.1f}s)"
    )

    everything = [*specs.values(), warm]
    capacity = sum(pages_expected(s)["unshared"] for s in everything) * PAGE_TOKENS
    # Object store: room for a step's batches many times over (Ray frees them as ranks drop
    # them; room keeps it from reusing the space of one freed a moment before).
    tokens_all = sum(T for s in everything for T, *_ in s["samples"])
    object_store = max(300 * MB, int(2 * (CP + 1) * tokens_all * (bpt + 4)))
    t = time.perf_counter()
    # the actors' code: by value when imported (a test), else from the workers' PYTHONPATH
    cluster = SimCluster(2, object_store, "fanout_ranks", env=ENV)
    head, trainer = cluster.nodes  # the head is the rollout node
    log(
        f"ray: 2-node cluster up in {time.perf_counter() - t:.1f}s "
        f"({object_store / MB:.0f} MB object store a node)"
    )
    job = f"fanout{uuid.uuid4().hex[:8]}"
    try:
        writer = cluster.actor(Writer, head, job, capacity)
        assert ray.get(writer.node.remote()) == head
        t = time.perf_counter()
        ranks = [
            cluster.actor(Rank, trainer, d, r, num_cpus=1 / (DP * CP))
            for d in range(DP)
            for r in range(CP)
        ]
        stored = {}
        for key, spec in [*specs.items(), ("warm", warm)]:
            t1 = time.perf_counter()
            stored[key] = ray.get(writer.put.remote(key, spec))
            log(
                f"{key}: put {len(spec['samples'])} samples in {time.perf_counter() - t1:.1f}s, "
                f"{stored[key]['pages_used']} pages (expected {pages_expected(spec)})"
            )
        nodes = ray.get([a.node.remote() for a in ranks])
        assert set(nodes) == {trainer}, "rank actors must run on the trainer node"
        log(f"{DP * CP} rank actors up in {time.perf_counter() - t:.1f}s")
        for path in PATHS:
            ray.get([a.step.remote(path, warm, stored["warm"]["refs"], -1) for a in ranks])
        store = store_actor(job, node_id=head)
        rows = {key: {p: [] for p in PATHS} for key in specs}  # [step][rank]
        totals: dict = {key: {p: [] for p in PATHS} for key in specs}

        def served() -> dict:
            return ray.get(store.stats.remote())

        def crossed(s0: dict, s1: dict) -> dict:
            return {k: s1[k] - s0[k] for k in ("bytes_served", "read_calls", "samples_served")}

        def step(key: str, path: str, rep: int) -> None:
            """Every rank's step at once (rep 0: one rank after the other, so the store
            actor's counter gives each rank's own bytes received)."""
            spec, refs = specs[key], stored[key]["refs"]
            s0, lo0 = served(), loopback_bytes()
            t0 = time.perf_counter()
            if rep == 0:
                got = []
                for a in ranks:
                    s_rank = served()
                    got.append(ray.get(a.step.remote(path, spec, refs, rep)))
                    got[-1]["crossed"] = crossed(s_rank, served())
            else:
                got = ray.get([a.step.remote(path, spec, refs, rep) for a in ranks])
            wall = time.perf_counter() - t0
            lo1, s1 = loopback_bytes(), served()
            c = crossed(s0, s1)
            totals[key][path].append(
                {
                    "wall_seconds": wall,
                    "cross_node_bytes": c["bytes_served"],
                    "read_calls": c["read_calls"],
                    "samples_served": c["samples_served"],
                    "loopback_bytes": lo1 - lo0,
                    "ranks_at_once": rep != 0,
                }
            )
            rows[key][path].append(got)
            log(
                f"  {key}/{path} step {rep}: {wall:.2f}s wall"
                f"{' (ranks one by one)' if rep == 0 else ''}, "
                f"{c['bytes_served'] / MB:.1f} MB crossed, "
                f"{(lo1 - lo0) / MB:.1f} MB loopback"
            )

        # Step 0 of every workload and path first, ranks one by one: its memory is reported
        # and each rank's bytes received are counted. Then the steady steps, every rank at
        # once, paths alternating: their median time is reported.
        for key in specs:
            for path in PATHS:
                step(key, path, 0)
        for key in specs:
            for rep in range(1, 1 + repeats):
                for path in PATHS:
                    step(key, path, rep)
        for a in ranks:
            ray.kill(a)
        ray.kill(writer)
        for key, spec in specs.items():
            results["workloads"][key] = summarise(spec, stored[key], rows[key], totals[key], layout)
    finally:
        with contextlib.suppress(Exception):
            shutdown_node_stores(job)
        cluster.close()
    results["machine"] = machine()
    return results


def main() -> None:
    os.environ.update(ENV)  # this process too (the micro measurement), before pyarrow loads
    mmap_fixed = fixed_mmap_threshold()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for CI (~1 min)")
    parser.add_argument("--repeat", type=int, default=None, help="steady steps per path")
    parser.add_argument(
        "--out",
        type=Path,
        help="results JSON; default benchmarks/results/fanout.json, or fanout.quick.json in "
        "the temp dir with --quick (the committed results stay)",
    )
    args = parser.parse_args()
    if args.out is None:
        quick_out = Path(tempfile.gettempdir()) / "fanout.quick.json"
        args.out = quick_out if args.quick else RESULTS / "fanout.json"
    repeats = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    t = time.perf_counter()
    results = run(args.quick, repeats)
    results["config"] = {
        "quick": args.quick,
        "steady_steps": repeats,
        "model": MODEL,
        "layout": "Qwen3-30B-A3B (48 MoE layers, top-8 of 128 experts, uint8 ids)",
        "dp": DP,
        "cp": CP,
        "page_tokens": PAGE_TOKENS,
        "cp_split": "Megatron zigzag per sample (THD), each sample padded to 2 x CP",
        "dp_split": "contiguous halves of the batch",
        "paths": {
            "whole": "routes_for_rank(pack(attach_routes(batch, fetch=fetch_batch), "
            "multiple=2*CP), cp_rank)",
            "ranges": "read_rank_routes(batch, cp_rank, pack_multiple=2*CP, fetch=fetch_batch)",
        },
        "memory": "VmHWM - VmRSS at reset (clear_refs 5), step 0 (after a warm-up step; "
        "ranks one by one), MALLOC_MMAP_THRESHOLD_=65536 in every actor; private = peak "
        "less the growth of shared (object-store) pages, which Ray may place on pages the "
        "process mapped before (shared_over_received < 1)",
        "driver_mmap_threshold_fixed": mmap_fixed,
        "seconds": "median of the steady steps (step 0 excluded)",
    }
    results["command"] = " ".join(["python", "benchmarks/fanout.py", *sys.argv[1:]])
    results["total_seconds"] = time.perf_counter() - t
    results["identical"] = all(w["identical"] for w in results["workloads"].values())
    results["targets"] = targets(results)
    print()
    print(table(results))
    print()
    print(summary(results))
    write_json(args.out, results)
    print(f"wrote {args.out} ({results['total_seconds']:.0f}s)")
    if not results["identical"]:
        bad = [
            (k, f"dp{r['dp_rank']} cp{r['cp_rank']}")
            for k, w in results["workloads"].items()
            for r in w["ranks"]
            if not r["identical"]
        ]
        raise SystemExit(f"routes differ between the paths or from the expected: {bad}")


if __name__ == "__main__":
    main()
