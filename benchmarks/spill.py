"""Spill to disk: a rollout producing 3x the store's shared memory with a slow trainer, and
the cost of reading a spilled sample against one in memory.

    python benchmarks/spill.py            # Qwen3-30B-A3B routes (384 B/token), 8K-token samples
    python benchmarks/spill.py --quick    # smaller samples, the same paths

1. Reads: a store of 16 samples' room gets 48 (32 spill); each sample read alone (`get`
   into a new array, and `read` of 1/8 of its tokens), in memory, spilled with its file in
   the page cache, and spilled with the file dropped from it (posix_fadvise DONTNEED);
   medians, as ratios to in memory. Puts that spilled against puts that did not, and
   numpy `tofile` of the same bytes (the disk's speed).
2. Rollout: 2 writer processes put GRPO groups (4 samples sharing a 2K-token prompt) worth
   3x the store; 1 trainer process reads 8 samples at a time in put order, slower than the
   writers, checks each against the CRC its writer sent, releases. Once with a spilling
   store, once with the same store without (the puts wait for the trainer's releases):
   writers' wall time, put latency (max, p99), trainer wall time, samples checked.
Writes benchmarks/results/spill.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from archive import drop_cache
from harness import MB, RESULTS, layout_of_model, machine, timed, write_json

from routing_replay import PutRequest, RoutingStore, to_torch

LAYOUT = layout_of_model("qwen3-30b-a3b")
# Forked, not spawned like transport_runners' long-lived workers: writers_s counts the
# processes' start, which a fork makes instant (and no Ray is imported yet: see main).
FORK = mp.get_context("fork")


def routes(rng: np.random.Generator, tokens: int) -> np.ndarray:
    return LAYOUT.random_routes(rng, tokens, np.uint8)


# -- 1. reads and puts --------------------------------------------------------------------


def reads(tokens: int, directory: str) -> dict:
    rng = np.random.default_rng(0)
    samples = [routes(rng, tokens) for _ in range(48)]
    name = f"bench-spill-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(
        name, LAYOUT, 16 * tokens, spill_dir=directory, spill_budget=1 << 40
    ) as store:
        refs, put_s = [], []
        for i, r in enumerate(samples):
            before = store.stats().samples_spilled
            t = time.perf_counter()
            refs.append(store.put(f"s{i}", r, token_ids=np.arange(tokens)))
            put_s.append((time.perf_counter() - t, store.stats().samples_spilled > before))
        files = {
            int(n[:16], 16): os.path.join(store.spill_dir, n)
            for n in os.listdir(store.spill_dir)
            if n.endswith(".spill")
        }
        spilled = [r for r in refs if r.serial in files]
        memory = [r for r in refs if r.serial not in files]
        for ref in refs:  # every sample reads back exact
            assert np.array_equal(store.get(ref), samples[int(ref.sample_id[1:])])
        eighth = [(tokens // 2, tokens // 2 + tokens // 8)]

        def per_ref(refs_, action, cold=False) -> float:
            out = []
            for ref in refs_:
                if cold:
                    drop_cache(files[ref.serial])
                out.append(statistics.median(timed(lambda r=ref: action(r), 1 if cold else 5)))
            return statistics.median(out)

        def full(r):
            return store.get(r)

        def part(r):
            return store.read([r], ranges=eighth)

        result = {
            "sample_tokens": tokens,
            "sample_mb": tokens * LAYOUT.bytes_per_token / MB,
            "in_memory": len(memory),
            "spilled": len(spilled),
            "get_ms": {
                "memory": 1e3 * per_ref(memory, full),
                "spilled_cached": 1e3 * per_ref(spilled, full),
                "spilled_cold": 1e3 * per_ref(spilled, full, cold=True),
            },
            "read_eighth_ms": {
                "memory": 1e3 * per_ref(memory, part),
                "spilled_cached": 1e3 * per_ref(spilled, part),
                "spilled_cold": 1e3 * per_ref(spilled, part, cold=True),
            },
        }
        spilling = [s for s, did in put_s if did]
        plain = [s for s, did in put_s if not did]
        data = np.concatenate([samples[int(r.sample_id[1:])] for r in spilled[:1]])
        path = os.path.join(directory, "tofile.bin")
        tofile = statistics.median(timed(lambda: data.tofile(path), 5))
        os.unlink(path)
        result["put_ms"] = {
            "no_spill": 1e3 * statistics.median(plain),
            "spilling_one": 1e3 * statistics.median(spilling),
            "tofile_one": 1e3 * tofile,
        }
    for what in ("get_ms", "read_eighth_ms"):
        m = result[what]
        m["cached_ratio"] = m["spilled_cached"] / m["memory"]
        m["cold_ratio"] = m["spilled_cold"] / m["memory"]
    return result


# -- 2. the rollout -------------------------------------------------------------------------


def group_samples(
    w: int, g: int, prompt: int, completion: int
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng([w, g])
    prompt_routes, prompt_tokens = routes(rng, prompt), rng.integers(0, 150_000, prompt)
    out = []
    for j in range(4):
        n = int(rng.integers(completion // 2, completion * 3 // 2))
        r = np.concatenate([prompt_routes, routes(rng, n)])
        t = np.concatenate([prompt_tokens, rng.integers(0, 150_000, n)])
        out.append((f"w{w}g{g}-{j}", r, t))
    return out


def _writer(name, w, groups, prompt, completion, queue, latencies) -> None:
    store = RoutingStore.attach(name, put_timeout=600)
    for g in range(groups):
        group = group_samples(w, g, prompt, completion)
        t = time.perf_counter()
        store.put_many([PutRequest(i, r, prompt, tok) for i, r, tok in group])
        latencies.put(time.perf_counter() - t)
        for i, r, _ in group:
            queue.put((i, zlib.crc32(r.astype(np.int64)), len(r)))
    queue.put(None)


def _trainer(name, queue, writers, batch, step_s, result) -> None:
    store = RoutingStore.attach(name)
    checked = bad = 0
    num_tokens = {}
    left = writers
    t0 = time.perf_counter()
    while left:
        items = []
        while len(items) < batch and left:
            item = queue.get()
            if item is None:
                left -= 1
            else:
                items.append(item[:2])
                num_tokens[item[0]] = item[2]
        if not items:
            break
        rows = to_torch(store.read([i for i, _ in items])).numpy().astype(np.int64)
        at = 0
        for i, crc in items:
            n = num_tokens[i]
            bad += zlib.crc32(rows[at : at + n]) != crc
            at += n
            checked += 1
        time.sleep(step_s)  # the trainer's step: slower than the writers
        store.release([i for i, _ in items])
    result.put({"checked": checked, "bad": bad, "trainer_s": time.perf_counter() - t0})


def rollout(groups: int, prompt: int, completion: int, spill: str | None, step_s: float) -> dict:
    total = sum(
        sum(len(t) for _, _, t in group_samples(w, g, prompt, completion)) - 3 * prompt
        for w in range(2)
        for g in range(groups)
    )
    capacity = total // 3
    name = f"bench-spill-{uuid.uuid4().hex[:8]}"
    options = {} if spill is None else {"spill_dir": spill, "spill_budget": 1 << 40}
    with RoutingStore.create(name, LAYOUT, capacity, **options) as store:
        queue, latencies, result = FORK.Queue(), FORK.Queue(), FORK.Queue()
        writers = [
            FORK.Process(
                target=_writer, args=(name, w, groups, prompt, completion, queue, latencies)
            )
            for w in range(2)
        ]
        trainer = FORK.Process(target=_trainer, args=(name, queue, 2, 8, step_s, result))
        t0 = time.perf_counter()
        for p in [*writers, trainer]:
            p.start()
        for p in writers:
            p.join()
        writers_s = time.perf_counter() - t0
        peak = store.stats().samples_spilled
        trainer.join()
        out = result.get()
        lat = sorted(latencies.get() for _ in range(2 * groups))
        assert all(p.exitcode == 0 for p in [*writers, trainer])
        assert store.stats().samples == 0
    return {
        "stored_tokens": total,
        "capacity_tokens": capacity,
        "writers_s": writers_s,
        "put_ms_max": 1e3 * lat[-1],
        "put_ms_p99": 1e3 * lat[int(0.99 * (len(lat) - 1))],
        "spilled_at_writers_end": peak,
        **out,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="spill directory (default: a temporary one)")
    args = ap.parse_args()
    tokens, groups, prompt, completion, step_s = (
        (1024, 6, 256, 256, 0.05) if args.quick else (8192, 16, 2048, 2048, 0.15)
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        r = {"machine": {}, "reads": reads(tokens, directory)}
        r["rollout"] = {
            "spilling": rollout(groups, prompt, completion, directory, step_s),
            "no_spill": rollout(groups, prompt, completion, None, step_s),
        }
    r["machine"] = machine()  # after the forks: it imports torch and Ray
    rd, ro = r["reads"], r["rollout"]
    mb, n = rd["sample_mb"], rd["spilled"]
    print(f"reads of one {rd['sample_tokens']}-token sample ({mb:.1f} MB), {n} of 48 spilled:")
    print(f"{'':16}{'memory':>10}{'spilled, cached':>22}{'spilled, cold':>22}")
    for what in ("get_ms", "read_eighth_ms"):
        m = rd[what]
        cached = f"{m['spilled_cached']:.2f}ms ({m['cached_ratio']:.2f}x)"
        cold = f"{m['spilled_cold']:.2f}ms ({m['cold_ratio']:.2f}x)"
        print(f"{what:16}{m['memory']:>8.2f}ms{cached:>22}{cold:>22}")
    p = rd["put_ms"]
    print(
        f"put of one sample: {p['no_spill']:.2f} ms; spilling one: {p['spilling_one']:.2f} ms; "
        f"tofile of its bytes: {p['tofile_one']:.2f} ms"
    )
    print("rollout, 3x the store, slow trainer:")
    head = ("writers s", "put max ms", "put p99 ms", "trainer s", "checked", "bad")
    print(f"{'':12}" + "".join(f"{h:>12}" for h in head))
    for k, v in ro.items():
        cells = (v["writers_s"], v["put_ms_max"], v["put_ms_p99"], v["trainer_s"])
        print(
            f"{k:12}" + "".join(f"{c:>12.2f}" for c in cells) + f"{v['checked']:>12}{v['bad']:>12}"
        )
    out = Path(tempfile.gettempdir()) / "spill.quick.json" if args.quick else RESULTS / "spill.json"
    write_json(out, r, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
