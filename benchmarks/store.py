"""Store throughput: put and read of Qwen3-30B-A3B-shaped routes vs one numpy.copyto, and
how put and release scale with the number of samples stored.

    python benchmarks/store.py            # 256 samples x 4096 tokens (402 MB of uint8 ids),
                                          # scaling at 10^3, 10^5 and 10^6 stored samples
    python benchmarks/store.py --quick    # a small run that exercises the same path

Prints tables and writes benchmarks/results/store.json. Throughput figures are ratios to a
copy of the same narrow bytes made in the same process, so machines compare; scaling
figures are ratios to the smallest store, measured in the same process.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
from harness import RESULTS, layout_of_model, machine, timed, write_json

from routing_replay import RoutingLayout, RoutingStore, to_torch


def run(samples: int, tokens: int, repeat: int) -> dict:
    layout = layout_of_model("qwen3-30b-a3b")
    rng = np.random.default_rng(0)
    routes = np.stack([layout.random_routes(rng, tokens, np.uint8) for _ in range(samples)])
    routes[:, -1] = layout.missing  # last token: never forwarded
    routes_i32 = [routes[i].astype(np.int32) for i in range(min(samples, 16))]
    routes_i32 = [np.where(r == layout.missing, -1, r) for r in routes_i32]
    total_bytes = routes.nbytes
    dst = np.empty_like(routes)
    np.copyto(dst, routes)  # fault the pages in before timing

    copy_s = min(timed(lambda: np.copyto(dst, routes), repeat))

    def copy_per_sample() -> None:
        for i in range(samples):
            np.copyto(dst[i], routes[i])

    copy_each_s = min(timed(copy_per_sample, repeat))
    ids = [f"s{i}" for i in range(samples)]
    name = f"bench-{uuid.uuid4().hex[:8]}"
    out: dict = {}
    with RoutingStore.create(name, layout, capacity_tokens=samples * tokens) as store:

        def empty() -> None:
            if len(store):
                store.release(ids)

        def put() -> None:
            for i, sid in enumerate(ids):
                store.put(sid, routes[i])

        put_s = min(timed(put, repeat, setup=empty))

        def check() -> None:
            for i in range(samples):
                layout.check_distinct(routes[i])

        check_s = min(timed(check, repeat))  # what put would pay to refuse repeated top-k ids
        read_s = min(timed(lambda: out.update(batch=store.read(ids)), repeat))
        batch = out.pop("batch")
        reused = np.empty(routes.nbytes, dtype=np.uint8)  # a trainer's buffer, every step
        store.read(ids, out=reused)  # first touch, untimed
        read_into_s = min(timed(lambda: store.read(ids, out=reused), repeat))
        torch_s = min(timed(lambda: out.update(tensor=to_torch(batch)), repeat))
        tensor = out.pop("tensor")
        assert np.array_equal(tensor[:tokens].numpy(), layout.decode(routes[0]))

        # The same batch in read-only memory, as Ray's object store or an IPC stream hands
        # it over: to_torch copies it (a tensor must never write into memory others read).
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        received = pa.ipc.open_stream(sink.getvalue()).read_next_batch()
        assert not received.column("routed_experts").flatten().flatten().buffers()[1].is_mutable

        torch_read_only_s = min(timed(lambda: out.update(tensor=to_torch(received)), repeat))
        assert np.array_equal(out.pop("tensor").numpy(), tensor.numpy())

        assert np.array_equal(
            batch.column("routed_experts").flatten().flatten().to_numpy().reshape(routes.shape),
            routes,
        )

        # With token ids (what the engine adapters pass): stored and digested at put, read
        # back as the token_ids column. Distinct tokens per sample: nothing is shared.
        token_ids = rng.integers(0, 150_000, (samples, tokens))

        def put_tokens() -> None:
            for i, sid in enumerate(ids):
                store.put(sid, routes[i], token_ids=token_ids[i])

        put_tokens_s = min(timed(put_tokens, repeat, setup=empty))
        read_tokens_s = min(timed(lambda: out.update(batch=store.read(ids)), repeat))
        got = out.pop("batch").column("token_ids")
        assert np.array_equal(got.flatten().to_numpy().reshape(samples, tokens), token_ids)

        # The int32 input path (what SGLang/base64 payloads decode to), per token.
        store.release(ids)
        n32 = len(routes_i32)

        def put_i32() -> None:
            for i in range(n32):
                store.put(f"i{i}", routes_i32[i])

        put_i32_s = timed(put_i32)[0] * samples / n32

    rows = {
        "copyto (narrow bytes)": copy_s,
        "copyto, one per sample": copy_each_s,
        "put (uint8 input)": put_s,
        "repeated-id scan (not in put)": check_s,
        "read -> Arrow": read_s,
        "put + read": put_s + read_s,
        "read -> reused buffer (out=)": read_into_s,
        "put + read (out=)": put_s + read_into_s,
        "Arrow -> torch (packed)": torch_s,
        "Arrow -> torch, read-only batch (copied)": torch_read_only_s,
        "put + read + to_torch": put_s + read_s + torch_s,
        "put (int32 input)": put_i32_s,
        "put with token_ids (uint8 input)": put_tokens_s,
        "read -> Arrow, with token_ids": read_tokens_s,
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
        "machine": machine(),
    }


def scaling(sizes: list[int], ops: int) -> dict:
    """Per-put and per-release cost of small samples in a fragmented store of N samples
    (`ops` of each, at most the smallest N)."""
    assert 3 * ops <= min(sizes), "releases pick distinct stored samples"
    layout = RoutingLayout(4, 2, 8)  # small rows: 10^6 samples fit in memory
    tokens, page_tokens = 16, 16  # one page per sample
    rng = np.random.default_rng(1)
    pool = [layout.random_routes(rng, tokens, np.uint8) for _ in range(64)]
    rows = {}
    for n in sizes:
        name = f"bench-scale-{uuid.uuid4().hex[:8]}"
        cap = (n + ops) * tokens
        with RoutingStore.create(
            name, layout, capacity_tokens=cap, page_tokens=page_tokens, max_samples=n + ops
        ) as store:
            for i in range(n):
                store.put(f"s{i}", pool[i % 64])
            # Fragment: release every other sample and put them back, so the free stack
            # and the id buckets are scattered, as after many GRPO steps.
            half = [f"s{i}" for i in range(0, n, 2)]
            store.release(half)
            for i in range(0, n, 2):
                store.put(f"s{i}", pool[i % 64])
            rounds = 3  # best of three rounds of `ops` each: one op is ~0.1 ms, noise is not
            victims = rng.permutation(n)[: rounds * ops].tolist()
            for j in range(100):  # warm up the timed paths (first calls, page faults)
                store.put(f"warm{j}", pool[j % 64])
                store.release([f"warm{j}"])
            put_s = release_s = get_s = float("inf")
            for r in range(rounds):
                new_ids = [f"new{r}-{j}" for j in range(ops)]
                t0 = time.perf_counter()
                for j, sid in enumerate(new_ids):
                    store.put(sid, pool[j % 64])
                put_s = min(put_s, (time.perf_counter() - t0) / ops)
                t0 = time.perf_counter()
                for v in victims[r * ops : (r + 1) * ops]:
                    store.release([f"s{v}"])
                release_s = min(release_s, (time.perf_counter() - t0) / ops)
                t0 = time.perf_counter()
                for sid in new_ids:
                    store.get(sid)
                get_s = min(get_s, (time.perf_counter() - t0) / ops)
            assert len(store) == n and np.array_equal(store.get("new0-0"), layout.decode(pool[0]))
            store.verify()
        rows[n] = {"put_us": put_s * 1e6, "release_us": release_s * 1e6, "get_us": get_s * 1e6}
    base = rows[sizes[0]]
    return {
        "workload": {
            "layout": "4 MoE layers, top-2 of 8 experts",
            "tokens_per_sample": tokens,
            "page_tokens": page_tokens,
            "ops_timed": ops,
            "rounds": 3,
        },
        "per_op": {str(n): r for n, r in rows.items()},
        "ratio_to_smallest": {
            str(n): {k: v / base[k] for k, v in r.items()} for n, r in rows.items()
        },
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
    sizes = [10**3, 10**4] if args.quick else [10**3, 10**5, 10**6]
    result["scaling"] = scaling(sizes, 200 if args.quick else 300)
    w = result["workload"]
    print(
        f"{w['samples']} samples x {w['tokens_per_sample']} tokens, {w['layout']}: "
        f"{w['narrow_bytes'] / 1e6:.0f} MB of uint8 ids"
    )
    print(f"{'step':<34}{'seconds':>10}{'x copyto':>10}{'GB/s int32-eq':>15}")
    for k, s in result["seconds"].items():
        ratio, gbps = result["ratio_to_copyto"][k], result["GBps_int32_equivalent"][k]
        print(f"{k:<34}{s:>10.4f}{ratio:>10.2f}{gbps:>15.2f}")
    sc = result["scaling"]
    print(
        f"\nscaling: one put, release and get of a {sc['workload']['tokens_per_sample']}-token "
        f"sample in a fragmented store of N samples (best of 3 rounds of "
        f"{sc['workload']['ops_timed']})"
    )
    print(f"{'N stored':>10}{'put us':>10}{'release us':>12}{'get us':>10}{'put x smallest':>16}")
    for n, r in sc["per_op"].items():
        ratio = sc["ratio_to_smallest"][n]["put_us"]
        print(
            f"{int(n):>10}{r['put_us']:>10.1f}{r['release_us']:>12.1f}{r['get_us']:>10.1f}"
            f"{ratio:>16.2f}"
        )
    write_json(args.out, result, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
