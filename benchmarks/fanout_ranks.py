"""The fan-out workloads, each rank's expected share, the micro read and the Ray actors."""

from __future__ import annotations

import gc
import statistics
import time
import uuid
import zlib
from typing import Any

import numpy as np
from harness import layout_of_model, mem_end, mem_start, sample_routes, sample_tokens

MODEL = "qwen3-30b-a3b"
DP, CP = 2, 4
PAGE_TOKENS = 128
PATHS = ("whole", "ranges")


def long_spec(lengths: list[int]) -> dict:
    """One sample per length, each its own prompt (7/8 of it) and completion."""
    samples = [(T, T - T // 8, 1000 + i, i) for i, T in enumerate(lengths)]
    return {"kind": "long", "name": f"long {len(lengths)} x {max(lengths)} tok", "samples": samples}


def grpo_spec(groups: int, n: int, prompt: int, completions: list[int]) -> dict:
    """`groups` prompts of `prompt` tokens, n samples each (completion j: completions[j])."""
    samples = [
        (prompt + completions[j], prompt, g, 100_000 + g * n + j)
        for g in range(groups)
        for j in range(n)
    ]
    name = f"grpo {groups} x {n} x ({prompt} + {max(completions)}) tok"
    return {"kind": "grpo", "name": name, "samples": samples, "group_size": n}


def specs_for(quick: bool) -> dict[str, dict]:
    if quick:
        return {
            "long": long_spec([2048, 2045, 2041, 3]),
            "grpo": grpo_spec(2, 4, 256, [128 - 5 * j for j in range(4)]),
        }
    return {"long": long_spec([32768] * 16), "grpo": grpo_spec(8, 8, 2048, [1024] * 8)}


def dp_indices(spec: dict, dp_rank: int) -> list[int]:
    """The samples DP rank `dp_rank` trains: its contiguous 1/DP of the batch."""
    n = len(spec["samples"])
    return list(range(dp_rank * n // DP, (dp_rank + 1) * n // DP))


def zigzag_spans(n: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """Written here, not taken from the library: the (start, stop) token spans of a sample
    of n tokens that CP rank `rank` holds under Megatron's zigzag (the sample padded to a
    multiple of 2 x cp, chunks rank and 2 x cp - 1 - rank), each clipped to the sample.
    Spans may be empty; the two are adjacent for the middle rank."""
    padded = -(-n // (2 * cp)) * (2 * cp)
    c = padded // (2 * cp)
    spans = []
    for chunk in (rank, 2 * cp - 1 - rank):
        spans.append((min(chunk * c, n), min((chunk + 1) * c, n)))
    return spans


def share_tokens(spec: dict, indices: list[int], cp_rank: int) -> int:
    return sum(b - a for i in indices for a, b in zigzag_spans(spec["samples"][i][0], CP, cp_rank))


def expected_crc(routes: list[np.ndarray], lengths: list[int], cp_rank: int, missing: int) -> int:
    """CRC32 of what the rank's routers see, built by hand: each sample padded with the
    missing marker to a multiple of 2 x CP, then its two zigzag chunks, samples in order
    (the bytes of the int8 tensor the integration returns, -1 = 255)."""
    crc = 0
    for r, n in zip(routes, lengths, strict=True):
        padded_n = -(-n // (2 * CP)) * (2 * CP)
        padded = np.full((padded_n, *r.shape[1:]), missing, dtype=r.dtype)
        padded[:n] = r
        c = padded_n // (2 * CP)
        for chunk in (cp_rank, 2 * CP - 1 - cp_rank):
            crc = zlib.crc32(np.ascontiguousarray(padded[chunk * c : (chunk + 1) * c]), crc)
    return crc


def pages_expected(spec: dict) -> dict[str, int]:
    """Pages the workload takes in the store: unshared, and with a group's full prompt pages
    stored once (token ids and routes of the prompt are equal across the group)."""
    unshared = sum(-(-T // PAGE_TOKENS) for T, *_ in spec["samples"])
    shared, seen = 0, set()
    for T, P, group, _ in spec["samples"]:
        full = P // PAGE_TOKENS if spec["kind"] == "grpo" else 0
        if full and group not in seen:
            seen.add(group)
            shared += full
        shared += -(-(T - full * PAGE_TOKENS) // PAGE_TOKENS)
    return {"unshared": unshared, "shared": shared}


# -- micro: 1/8 of a sample vs all of it, one process -----------------------------------


def micro(tokens: int, samples: int, repeats: int) -> dict:
    """Median seconds of `store.read` of a whole sample and of 1/8 of it (zigzag two chunks
    at CP = 8, and contiguous), and of one token (the fixed cost of a read), rotating over
    `samples` stored samples, variants interleaved; each into a new Arrow buffer (fresh
    pages, as the ranks read) and into a buffer reused every read (`out=`: a trainer's
    steady state)."""
    from routing_replay import PutRequest, RoutingStore

    layout = layout_of_model(MODEL)
    spec = long_spec([tokens] * samples)
    cache: dict = {}
    name = f"bench-fanout-{uuid.uuid4().hex[:8]}"
    cap = samples * -(-tokens // PAGE_TOKENS) * PAGE_TOKENS
    cp8 = 8
    c = tokens // (2 * cp8)
    ranges = {
        "full": None,
        "zigzag 1/8 (CP=8, rank 1: 2 chunks)": [(c, 2 * c), ((2 * cp8 - 2) * c, (2 * cp8 - 1) * c)],
        "contiguous 1/8": [(3 * tokens // 8, 4 * tokens // 8)],
        "one token": [(tokens // 2, tokens // 2 + 1)],
    }
    variants = [(k, into) for into in ("new", "out=") for k in ranges]
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    got_tokens: dict[str, int] = {}
    out = np.empty(tokens * layout.bytes_per_token, dtype=np.uint8)
    out[:] = 0  # faulted in once, as a trainer's reused buffer
    with RoutingStore.create(name, layout, cap, page_tokens=PAGE_TOKENS) as store:
        try:
            refs = store.put_many(
                PutRequest(
                    f"m{i}",
                    sample_routes(spec, i, layout, cache),
                    prompt_len=spec["samples"][i][1],
                    token_ids=sample_tokens(spec, i),
                )
                for i in range(samples)
            )
            for rep in range(repeats + 1):  # rep 0 warms up
                for k, into in variants:
                    ref = refs[rep % samples]
                    kw: dict[str, Any] = {} if ranges[k] is None else {"ranges": [ranges[k]]}
                    if into == "out=":
                        kw["out"] = out
                    t0 = time.perf_counter()
                    batch = store.read([ref], **kw)
                    dt = time.perf_counter() - t0
                    got_tokens[k] = int(batch.column("num_tokens")[0].as_py())
                    del batch
                    if rep:
                        times[(k, into)].append(dt)
        finally:
            store.unlink()
    med = {v: statistics.median(t) for v, t in times.items()}
    rows = {}
    for k, into in variants:
        name = k if into == "new" else f"{k}, out="
        rows[name] = {
            "into": "new Arrow buffer" if into == "new" else "reused buffer (out=)",
            "tokens_read": got_tokens[k],
            "bytes_read": got_tokens[k] * layout.bytes_per_token,
            "median_seconds": med[(k, into)],
            "ns_per_token_read": med[(k, into)] / got_tokens[k] * 1e9,
            "ratio_to_full": med[(k, into)] / med[("full", into)],
        }
    return {
        "tokens_per_sample": tokens,
        "samples_rotated": samples,
        "repeats": repeats,
        "rows": rows,
        "target_ratio_at_most": 0.3,
    }


# -- Ray actors ------------------------------------------------------------------------


class Writer:
    """The rollout node's writer: puts each workload into the node store, as rollout
    workers do (`node_store(job, layout).put_many`, one call per GRPO group)."""

    def __init__(self, job: str, capacity_tokens: int) -> None:
        self.job, self.capacity = job, capacity_tokens

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def put(self, key: str, spec: dict) -> dict:
        from routing_replay import PutRequest
        from routing_replay.ray import StoreOptions, node_store

        layout = layout_of_model(MODEL)
        store = node_store(self.job, layout, options=StoreOptions(capacity_tokens=self.capacity))
        before = store.stats()
        cache: dict = {}
        routes = [sample_routes(spec, i, layout, cache) for i in range(len(spec["samples"]))]
        n = spec.get("group_size", len(spec["samples"]))  # long: one put_many (one step)
        refs = []
        t0 = time.perf_counter()
        for lo in range(0, len(routes), n):
            refs += store.put_many(
                PutRequest(
                    f"{key}-{i}",
                    routes[i],
                    prompt_len=spec["samples"][i][1],
                    token_ids=sample_tokens(spec, i),
                )
                for i in range(lo, lo + n)
            )
        put_s = time.perf_counter() - t0
        after = store.stats()
        crcs = {}
        for d in range(DP):
            idx = dp_indices(spec, d)
            for r in range(CP):
                crcs[f"{d},{r}"] = expected_crc(
                    [routes[i] for i in idx],
                    [spec["samples"][i][0] for i in idx],
                    r,
                    layout.missing,
                )
        return {
            "refs": refs,
            "expected_crc": crcs,
            "put_seconds": put_s,
            "pages_used": after.pages_used - before.pages_used,
            "bytes_used": after.bytes_used - before.bytes_used,
            "bytes_unshared": after.bytes_unshared - before.bytes_unshared,
            "page_tokens": after.page_tokens,
        }


class Rank:
    """One trainer rank (DP rank, CP rank) on the trainer node."""

    def __init__(self, dp_rank: int, cp_rank: int) -> None:
        import torch

        import routing_replay.integrations.nemo_rl
        import routing_replay.ray  # noqa: F401

        self.dp_rank, self.cp_rank = dp_rank, cp_rank
        self.threads = torch.get_num_threads()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def step(self, path: str, spec: dict, refs: list, rep: int) -> dict:
        """One training step's read of this rank's routes on `path`; returns measurements."""
        import torch

        from routing_replay.integrations import nemo_rl
        from routing_replay.ray import fetch_batch

        layout = layout_of_model(MODEL)
        idx = dp_indices(spec, self.dp_rank)
        lengths = [spec["samples"][i][0] for i in idx]
        S = max(lengths)
        input_ids = torch.zeros((len(idx), S), dtype=torch.long)
        for b, i in enumerate(idx):
            input_ids[b, : lengths[b]] = torch.from_numpy(sample_tokens(spec, i).astype(np.int64))
        batch = {
            "input_ids": input_ids,
            "input_lengths": torch.tensor(lengths),
            "routing_refs": [refs[i] for i in idx],
        }
        got: dict[str, Any] = {}

        def fetch(rr: list, **kwargs: Any) -> Any:
            t = time.perf_counter()
            table = fetch_batch(rr, **kwargs)
            got["fetch_seconds"] = time.perf_counter() - t
            got["tokens_read"] = int(np.asarray(table.column("num_tokens")).sum())
            got["batch_nbytes"] = table.nbytes
            got["ranges"] = kwargs.get("ranges")
            return table

        gc.collect()  # what earlier steps left is not this step's
        base = mem_start()
        t0 = time.perf_counter()
        if path == "whole":
            packed = nemo_rl.pack(nemo_rl.attach_routes(batch, fetch=fetch), multiple=2 * CP)
            out = nemo_rl.routes_for_rank(packed, cp_size=CP, cp_rank=self.cp_rank)
            del packed
        elif path == "ranges":
            out = nemo_rl.read_rank_routes(
                batch, cp_size=CP, cp_rank=self.cp_rank, pack_multiple=2 * CP, fetch=fetch
            )
        else:
            raise ValueError(path)
        seconds = time.perf_counter() - t0
        mem = mem_end(base)
        flat = out.as_subclass(torch.Tensor).contiguous()
        crc = zlib.crc32(flat.numpy().view(np.uint8))
        ranges = got.pop("ranges")
        n_ranges = None
        if ranges is not None:
            n_ranges = sum(
                1
                for entry in ranges
                for a, b in ([entry] if isinstance(entry[0], int) else entry)
                if b > a
            )
        share = share_tokens(spec, idx, self.cp_rank)
        bpt = layout.bytes_per_token
        return {
            "path": path,
            "rep": rep,
            "dp_rank": self.dp_rank,
            "cp_rank": self.cp_rank,
            "samples": len(idx),
            "whole_tokens": sum(lengths),
            "share_tokens": share,
            "tokens_read": got["tokens_read"],
            "bytes_read": got["tokens_read"] * bpt,
            "whole_bytes": sum(lengths) * bpt,
            "share_bytes": share * bpt,
            "ranges_read": n_ranges,
            "page_bound_bytes": None
            if n_ranges is None
            else (share + n_ranges * PAGE_TOKENS) * bpt,
            "batch_nbytes": got["batch_nbytes"],
            "seconds": seconds,
            "fetch_seconds": got["fetch_seconds"],
            "mem": mem,
            "crc": crc,
            "shape": list(flat.shape),
            "dtype": str(flat.dtype).replace("torch.", ""),
            "torch_threads": self.threads,
        }
