"""Store throughput: put and read of Qwen3-30B-A3B-shaped routes vs one numpy.copyto.

    python benchmarks/store.py            # 256 samples x 4096 tokens (402 MB of uint8 ids)
    python benchmarks/store.py --quick    # a small run that exercises the same path

Prints a table and writes benchmarks/results/store.json. Every figure is a ratio to a
copy of the same narrow bytes made in the same process, so machines compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import uuid
from pathlib import Path

import numpy as np

from routing_replay import RoutingLayout, RoutingStore, to_torch

RESULTS = Path(__file__).parent / "results"


def best_of(fn, repeat: int) -> float:
    """Fastest of `repeat` timed calls (each after a fresh setup inside fn)."""
    times = []
    for _ in range(repeat):
        times.append(fn())
    return min(times)


def run(samples: int, tokens: int, repeat: int) -> dict:
    layout = RoutingLayout(48, 8, 128)  # Qwen3-30B-A3B
    rng = np.random.default_rng(0)
    routes = np.stack([layout.random_routes(rng, tokens, np.uint8) for _ in range(samples)])
    routes[:, -1] = layout.missing  # last token: never forwarded
    routes_i32 = [routes[i].astype(np.int32) for i in range(min(samples, 16))]
    routes_i32 = [np.where(r == layout.missing, -1, r) for r in routes_i32]
    total_bytes = routes.nbytes
    dst = np.empty_like(routes)
    np.copyto(dst, routes)  # fault the pages in before timing

    def t_copy() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, routes)
        return time.perf_counter() - t0

    copy_s = best_of(t_copy, repeat)

    def t_copy_per_sample() -> float:
        t0 = time.perf_counter()
        for i in range(samples):
            np.copyto(dst[i], routes[i])
        return time.perf_counter() - t0

    copy_each_s = best_of(t_copy_per_sample, repeat)
    ids = [f"s{i}" for i in range(samples)]
    name = f"bench-{uuid.uuid4().hex[:8]}"
    out: dict = {}
    with RoutingStore.create(name, layout, capacity_tokens=samples * tokens) as store:

        def t_put() -> float:
            if len(store):
                store.release(ids)
            t0 = time.perf_counter()
            for i, sid in enumerate(ids):
                store.put(sid, routes[i])
            return time.perf_counter() - t0

        put_s = best_of(t_put, repeat)

        def t_read() -> float:
            t0 = time.perf_counter()
            batch = store.read(ids)
            out["batch"] = batch
            return time.perf_counter() - t0

        read_s = best_of(t_read, repeat)
        batch = out.pop("batch")
        reused = np.empty(routes.nbytes, dtype=np.uint8)  # a trainer's buffer, every step
        store.read(ids, out=reused)  # first touch, untimed

        def t_read_into() -> float:
            t0 = time.perf_counter()
            store.read(ids, out=reused)
            return time.perf_counter() - t0

        read_into_s = best_of(t_read_into, repeat)

        def t_torch() -> float:
            t0 = time.perf_counter()
            tensor = to_torch(batch)
            out["tensor"] = tensor
            return time.perf_counter() - t0

        torch_s = best_of(t_torch, repeat)
        tensor = out.pop("tensor")
        assert np.array_equal(tensor[:tokens].numpy(), layout.decode(routes[0]))
        assert np.array_equal(
            batch.column("routed_experts").flatten().flatten().to_numpy().reshape(routes.shape),
            routes,
        )

        # The int32 input path (what SGLang/base64 payloads decode to), per token.
        store.release(ids)
        n32 = len(routes_i32)
        t0 = time.perf_counter()
        for i in range(n32):
            store.put(f"i{i}", routes_i32[i])
        put_i32_s = (time.perf_counter() - t0) * samples / n32

    rows = {
        "copyto (narrow bytes)": copy_s,
        "copyto, one per sample": copy_each_s,
        "put (uint8 input)": put_s,
        "read -> Arrow": read_s,
        "put + read": put_s + read_s,
        "read -> reused buffer (out=)": read_into_s,
        "put + read (out=)": put_s + read_into_s,
        "Arrow -> torch (packed)": torch_s,
        "put + read + to_torch": put_s + read_s + torch_s,
        "put (int32 input)": put_i32_s,
    }
    return {
        "workload": {
            "layout": "Qwen3-30B-A3B (48 MoE layers, top-8, 128 experts)",
            "samples": samples,
            "tokens_per_sample": tokens,
            "narrow_bytes": total_bytes,
            "int32_bytes": total_bytes * 4,
        },
        "seconds": rows,
        "ratio_to_copyto": {k: v / copy_s for k, v in rows.items()},
        "GBps_int32_equivalent": {k: total_bytes * 4 / v / 1e9 for k, v in rows.items()},
        "target_put_plus_read_within": 4.0,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run for CI")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "store.json")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.tokens, args.repeat = 16, 512, 1
    result = run(args.samples, args.tokens, args.repeat)
    w = result["workload"]
    print(
        f"{w['samples']} samples x {w['tokens_per_sample']} tokens, {w['layout']}: "
        f"{w['narrow_bytes'] / 1e6:.0f} MB of uint8 ids"
    )
    print(f"{'step':<30}{'seconds':>10}{'x copyto':>10}{'GB/s int32-eq':>15}")
    for k, s in result["seconds"].items():
        ratio, gbps = result["ratio_to_copyto"][k], result["GBps_int32_equivalent"][k]
        print(f"{k:<30}{s:>10.4f}{ratio:>10.2f}{gbps:>15.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
