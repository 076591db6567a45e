"""Routes from a rollout (writer) process to a trainer (reader) process, into torch, every way.

    python benchmarks/transport.py            # full workloads (Qwen3-30B-A3B, DeepSeek-V3 shapes)
    python benchmarks/transport.py --quick    # small sizes, every path (CI; ~30 s)

Ways (the same routes each time, checked by a CRC of the reader's tensor):

- json:        nested JSON lists, one message per sample, `torch.tensor` + `torch.cat` (reader)
- base64-i32:  base64 of an int32 `numpy.save` payload per sample, `np.load`, `torch.cat`
- raw-narrow:  a struct header (dtype, shape) + the narrow bytes per sample, received straight
               into the packed output (`recv_into`: the best case for this way)
- ray-i32:     int32 arrays `ray.put` per sample in a writer actor, `ray.get` + one packing copy
               in a reader actor (same node, and across two simulated nodes)
- store:       this project: `put` (uint8/uint16 ids as vLLM hands them, token ids so GRPO
               prompt pages are shared) in the writer, refs to the reader, `read` -> Arrow ->
               `to_torch`; same node (plain processes, and Ray actors) and across two simulated
               nodes (the remote read goes through the node store actor, as Arrow)
- store-i32-in: the same with int32 input (SGLang's form), converted in `put`
- copyto-*:    the limit, one `numpy.copyto` of the int32 and of the narrow bytes (one process)

Ways 1-3 and the same-node store run in two spawned processes joined by a Unix socketpair
(multiprocessing.Pipe); refs travel over the same socket. Ray ways run in actors of a
two-node `ray.cluster_utils.Cluster`. Time = reader's clock when the tensor exists minus the
writer's clock before its first byte (CLOCK_MONOTONIC is system-wide). JSON and base64 are
measured on a subset of samples and scaled per token (flagged in the table). Peak memory is
VmHWM (reset through /proc/self/clear_refs before each way) inside each process or actor.
Writes benchmarks/results/transport.json and docs/img/transport.png (the plot the docs show).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import multiprocessing as mp
import os
import pickle
import platform
import re
import select
import socket
import statistics
import struct
import sys
import tempfile
import time
import traceback
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
PLOTS = Path(__file__).parent.parent / "docs" / "img"  # plots the docs show
ROOT = Path(__file__).resolve().parent.parent
MB = 2**20
# Every process allocates with the system allocator, Arrow included: a pool that keeps freed
# pages (Arrow's default jemalloc/mimalloc) would hand later repeats pre-faulted memory that
# the numpy-based ways do not get, and would hide the reader's peak memory across ways.
ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system"}

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {"num_layers": 48, "top_k": 8, "num_experts": 128, "moe_layers": None},
    "deepseek-v3": {
        "num_layers": 61,
        "top_k": 8,
        "num_experts": 256,
        "moe_layers": list(range(3, 61)),
    },
}

# name: (where it runs, label)
WAYS: dict[str, tuple[str, str]] = {
    "json": ("proc", "JSON nested lists (socket)"),
    "base64-i32": ("proc", "base64 of int32 .npy (socket)"),
    "raw-narrow": ("proc", "raw narrow bytes + header (socket)"),
    "ray-i32": ("ray-same", "Ray object store, int32, same node"),
    "ray-i32-x": ("ray-cross", "Ray object store, int32, 2 nodes"),
    "store": ("proc", "this project: store, same node"),
    "store-ray": ("ray-same", "this project: store, Ray actors, same node"),
    "store-x": ("ray-cross", "this project: store, 2 nodes (store actor)"),
    "store-i32-in": ("proc", "this project: store, int32 input"),
    "copyto-i32": ("local", "numpy.copyto of int32 bytes"),
    "copyto-narrow": ("local", "numpy.copyto of narrow bytes"),
}
SLOW_WAYS = ("json", "base64-i32")


# -- workloads -------------------------------------------------------------------------


def layout_of_model(model: str) -> Any:
    from routing_replay import RoutingLayout

    m = MODELS[model]
    return RoutingLayout(m["num_layers"], m["top_k"], m["num_experts"], moe_layers=m["moe_layers"])


def grpo_spec(model: str, prompts: int, n: int, prompt_len: int, completion: int) -> dict:
    """n samples per prompt; a prompt's samples share its tokens and prompt routes."""
    T = prompt_len + completion
    samples = [(T, prompt_len, g, g * n + j) for g in range(prompts) for j in range(n)]
    return {
        "name": f"grpo {prompts}x{n}, {prompt_len}+{completion} tok",
        "kind": "grpo",
        "model": model,
        "samples": samples,
    }


def long_spec(model: str, count: int, tokens: int) -> dict:
    P = tokens - tokens // 8
    samples = [(tokens, P, 1000 + i, i) for i in range(count)]
    return {
        "name": f"long {count}x{tokens} tok",
        "kind": "long",
        "model": model,
        "samples": samples,
    }


def scaling_spec(model: str, tokens: int, per_sample: int = 2500, distinct: int = 64) -> dict:
    """`tokens` routed tokens in samples of `per_sample`, no token ids (no sharing); the
    writer cycles through `distinct` generated samples so its own memory stays small."""
    count = max(1, tokens // per_sample)
    samples = [(per_sample, 0, 10_000 + i % distinct, i % distinct) for i in range(count)]
    return {
        "name": f"scaling {count * per_sample:.0e}",
        "kind": "scaling",
        "model": model,
        "samples": samples,
    }


def capacity(spec: dict, page_tokens: int = 128) -> int:
    """Store tokens for the whole batch unshared: every sample rounded up to whole pages."""
    return sum(-(-s[0] // page_tokens) * page_tokens for s in spec["samples"]) + page_tokens


def total_tokens(spec: dict) -> int:
    return sum(s[0] for s in spec["samples"])


def subset(spec: dict, count: int) -> dict:
    return {**spec, "samples": spec["samples"][:count]}


def sample_routes(spec: dict, i: int, layout: Any, cache: dict | None = None) -> np.ndarray:
    """Sample i's routes `[T, L, K]` in the narrow dtype, stored marker on the last row."""
    T, P, group, seed = spec["samples"][i]
    L, K = layout.num_moe_layers, layout.top_k
    cache = {} if cache is None else cache
    out = np.empty((T, L, K), dtype=layout.dtype)
    if P:
        key = ("prompt", group, P)
        if key not in cache:
            cache.clear()
            rng = np.random.default_rng([group, 1])
            cache[key] = layout.random_routes(rng, P, layout.dtype)
        out[:P] = cache[key]
    rng = np.random.default_rng([seed, 2])
    out[P:] = layout.random_routes(rng, T - P, layout.dtype)
    out[-1] = layout.missing  # the last sampled token is never forwarded
    return out


def sample_tokens(spec: dict, i: int) -> np.ndarray:
    T, P, group, seed = spec["samples"][i]
    prompt = np.random.default_rng([group, 3]).integers(0, 150_000, P, dtype=np.int32)
    rest = np.random.default_rng([seed, 4]).integers(0, 150_000, T - P, dtype=np.int32)
    return np.concatenate([prompt, rest])


def to_int32(narrow: np.ndarray, layout: Any) -> np.ndarray:
    out = narrow.astype(np.int32)
    out[narrow == layout.missing] = -1
    return out


def expected(spec: dict, layout: Any, keep: bool) -> tuple[int, np.ndarray | None]:
    """CRC32 of the int16 form (-1 missing) of every sample in order, and the array if `keep`."""
    crc, parts, cache = 0, [], {}
    distinct: dict[tuple, np.ndarray] = {}  # the scaling series repeats 64 samples
    for i in range(len(spec["samples"])):
        key = spec["samples"][i]
        canon = distinct.get(key) if spec["kind"] == "scaling" else None
        if canon is None:
            canon = to_int32(sample_routes(spec, i, layout, cache), layout).astype(np.int16)
            if spec["kind"] == "scaling":
                distinct[key] = canon
        crc = zlib.crc32(canon, crc)
        if keep:
            parts.append(canon)
    return crc, (np.concatenate(parts) if keep else None)


def tensor_crc(t: Any, keep: bool) -> tuple[int, np.ndarray | None]:
    """CRC32 of a packed routes tensor's int16 form, in chunks (no full-size temporary)."""
    import torch

    crc, step = 0, 1 << 16
    for lo in range(0, t.shape[0], step):
        crc = zlib.crc32(t[lo : lo + step].to(torch.int16).numpy(), crc)
    return crc, (t.to(torch.int16).numpy().copy() if keep else None)


# -- memory ----------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in keys}


def mem_start() -> dict[str, int]:
    """Reset this process's peak RSS (Linux clear_refs 5) and return the baseline."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return proc_status()


def mem_end(base: dict[str, int]) -> dict[str, int]:
    now = proc_status()
    shared = (now["RssShmem"] + now["RssFile"]) - (base["RssShmem"] + base["RssFile"])
    return {
        "peak_rss": now["VmHWM"],
        "base_rss": base["VmRSS"],
        "peak_delta": now["VmHWM"] - base["VmRSS"],
        "shared_delta": shared,
        "private_delta": now["VmHWM"] - base["VmRSS"] - max(shared, 0),
    }


# -- socket helpers --------------------------------------------------------------------


def send_msg(sock: socket.socket, payload: Any) -> None:
    view = memoryview(payload).cast("B")
    sock.sendall(struct.pack("<Q", len(view)))
    sock.sendall(view)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("writer closed the socket mid-message")
        got += n


def recv_msg(sock: socket.socket) -> bytearray:
    head = bytearray(8)
    recv_into(sock, memoryview(head))
    buf = bytearray(struct.unpack("<Q", head)[0])
    recv_into(sock, memoryview(buf))
    return buf


# -- the ways: writer and reader sides -------------------------------------------------


def writer_setup(way: str, spec: dict, opts: dict) -> dict:
    """Build the writer's source routes (not timed): narrow or int32, as the way starts."""
    layout = layout_of_model(spec["model"])
    st: dict[str, Any] = {"way": way, "spec": spec, "layout": layout, "opts": opts}
    cache: dict = {}
    n = len(spec["samples"])
    wide = way in ("json", "base64-i32", "ray-i32", "ray-i32-x", "store-i32-in")
    st["src"] = []
    for i in range(n):  # one sample at a time: no full-size narrow copy next to the int32 one
        narrow = sample_routes(spec, i, layout, cache)
        st["src"].append(to_int32(narrow, layout) if wide else narrow)
    if way.startswith("store"):
        st["tokens"] = [sample_tokens(spec, i) for i in range(n)] if opts["token_ids"] else None
        if way in ("store", "store-i32-in"):
            from routing_replay import RoutingStore

            st["store"] = RoutingStore.attach(opts["store"], layout)
        else:
            from routing_replay.ray import StoreOptions, node_store

            st["store"] = node_store(
                opts["job"], layout, options=StoreOptions(capacity_tokens=opts["capacity"])
            )
    st["src_bytes"] = sum(a.nbytes for a in st["src"])
    return st


def writer_send(st: dict, rep: int, sock: socket.socket | None) -> Any:
    """Move the routes out of the writer. Returns what travels through a Ray driver, if any."""
    way, src, spec = st["way"], st["src"], st["spec"]
    if sock is not None:
        sock.sendall(struct.pack("<QQ", len(src), total_tokens(spec)))
    if way == "json":
        for a in src:
            send_msg(sock, json.dumps(a.tolist()).encode())
    elif way == "base64-i32":
        for a in src:
            bio = io.BytesIO()
            np.save(bio, a)
            send_msg(sock, base64.b64encode(bio.getbuffer()))
    elif way == "raw-narrow":
        for a in src:
            sock.sendall(struct.pack("<4sIII", a.dtype.str.encode(), *a.shape))
            sock.sendall(memoryview(a).cast("B"))
    elif way in ("ray-i32", "ray-i32-x"):
        import ray

        st["refs"] = [ray.put(a) for a in src]
        return [st["refs"]]
    elif way.startswith("store"):
        store, tokens, refs = st["store"], st["tokens"], []
        st["busy"] = 0.0  # seconds inside put: where the writer's time goes
        for i, a in enumerate(src):
            t = time.perf_counter()
            ref = store.put(
                f"r{rep}-s{i}",
                a,
                prompt_len=spec["samples"][i][1],
                token_ids=None if tokens is None else tokens[i],
            )
            st["busy"] += time.perf_counter() - t
            if sock is None:
                refs.append(ref)
            else:  # each ref goes as soon as its sample is in: the reader reads meanwhile
                send_msg(sock, pickle.dumps(ref))
        return refs if sock is None else None
    else:
        raise ValueError(way)
    return None


def writer_cleanup(st: dict) -> None:
    st.pop("refs", None)


def reader_setup(way: str, spec: dict, opts: dict) -> dict:
    layout = layout_of_model(spec["model"])
    st: dict[str, Any] = {"way": way, "spec": spec, "layout": layout, "opts": opts}
    if way in ("store", "store-i32-in"):
        from routing_replay import RoutingStore

        st["store"] = RoutingStore.attach(opts["store"], layout)
    return st


def reused_output(st: dict, nbytes: int) -> np.ndarray:
    """The reader's output memory: allocated at the first step, reused by the next ones (a
    trainer reads every step into the same, often pinned, buffer)."""
    out = st.get("out")
    if out is None or out.nbytes < nbytes:
        out = st["out"] = np.empty(nbytes, dtype=np.uint8)
    return out[:nbytes]


def reader_recv(st: dict, sock: socket.socket | None, payload: Any) -> Any:
    """Receive the routes and return them as one packed torch tensor `[sum_T, L, K]`."""
    import pyarrow as pa
    import torch

    from routing_replay import to_torch

    way, layout = st["way"], st["layout"]
    L, K = layout.num_moe_layers, layout.top_k
    if sock is not None:
        head = bytearray(16)
        recv_into(sock, memoryview(head))
        count, total = struct.unpack("<QQ", head)
    if way in ("json", "base64-i32"):
        if way == "json":
            parts = [
                torch.tensor(json.loads(recv_msg(sock)), dtype=torch.int32) for _ in range(count)
            ]
        else:
            parts = [
                torch.from_numpy(np.load(io.BytesIO(base64.b64decode(recv_msg(sock)))))
                for _ in range(count)
            ]
        out = reused_output(st, total * L * K * 4).view(np.int32).reshape(total, L, K)
        return torch.cat(parts, out=torch.from_numpy(out))
    if way == "raw-narrow":
        out = reused_output(st, total * layout.bytes_per_token).view(layout.dtype)
        out = out.reshape(total, L, K)
        flat, row = memoryview(out.reshape(-1)).cast("B"), 0
        row_bytes = L * K * layout.dtype.itemsize
        for _ in range(count):
            head = bytearray(16)
            recv_into(sock, memoryview(head))
            dtype, T, L_, K_ = struct.unpack("<4sIII", head)
            if (np.dtype(dtype.rstrip(b"\0").decode()), L_, K_) != (layout.dtype, L, K):
                raise ValueError(f"unexpected header {dtype, T, L_, K_}")
            recv_into(sock, flat[row * row_bytes : (row + T) * row_bytes])
            row += T
        return torch.from_numpy(layout.decode(out))
    if way in ("ray-i32", "ray-i32-x"):
        import ray

        (refs,) = payload
        arrays = ray.get(refs)
        st["crossed"] = sum(a.nbytes for a in arrays) if way == "ray-i32-x" else 0
        total = sum(len(a) for a in arrays)
        out = reused_output(st, total * L * K * 4).view(np.int32).reshape(total, L, K)
        np.concatenate(arrays, out=out)
        del arrays
        return torch.from_numpy(out)
    if way in ("store", "store-i32-in"):
        # One read per ref as it arrives, into consecutive slices of the reused output:
        # the batches form one table that `to_torch` views without a copy.
        out = reused_output(st, total * layout.bytes_per_token)
        refs, batches, at = [], [], 0
        st["busy"] = 0.0  # seconds inside read
        while len(refs) < count:
            group = [pickle.loads(recv_msg(sock))]  # wait for one, take all that arrived
            while len(refs) + len(group) < count and select.select([sock], [], [], 0)[0]:
                group.append(pickle.loads(recv_msg(sock)))
            t = time.perf_counter()
            batches.append(st["store"].read(group, out=out[at:]))
            st["busy"] += time.perf_counter() - t
            at += sum(r.num_tokens for r in group) * layout.bytes_per_token
            refs += group
        st["refs"] = refs
        st["batch"] = pa.Table.from_batches(batches)
        return to_torch(st["batch"])
    if way in ("store-ray", "store-x"):
        from routing_replay.ray import fetch_batch

        st["refs"] = payload
        # Into the reused output, as the same-node reader and Ray's int32 reader do.
        total = sum(r.num_tokens for r in payload)
        out = reused_output(st, total * layout.bytes_per_token)
        st["batch"] = fetch_batch(payload, out=out)
        return to_torch(st["batch"])
    raise ValueError(way)


def reader_cleanup(st: dict) -> dict:
    """Drop the received routes; the store ways release their samples (the trainer's job)."""
    info: dict[str, Any] = {}
    refs = st.pop("refs", None)
    st.pop("batch", None)
    if refs is None:
        return info
    if st["way"] in ("store", "store-i32-in"):
        s = st["store"].stats()
        info = {"bytes_used": s.bytes_used, "segment_bytes": s.segment_bytes}
        st["store"].release(refs)
    else:
        from routing_replay.ray import release_refs, store_actor

        stats = store_actor(st["opts"]["job"], node_id=refs[0].node_id).stats.remote()
        import ray

        s = ray.get(stats)
        info = {"bytes_used": s["bytes_used"], "segment_bytes": s["segment_bytes"]}
        if st["way"] == "store-x":  # what the store actor served this step, as it counts
            info["crossed"] = s["bytes_served"] - st.get("served", 0)
            st["served"] = s["bytes_served"]
        release_refs(refs)
    return info


def read_and_check(st: dict, sock: Any, payload: Any, rep: int, base: dict) -> dict:
    """One timed receive; on repeat 0 also memory and the CRC (after the clock stops)."""
    t = reader_recv(st, sock, payload)
    t1 = time.perf_counter()
    out: dict[str, Any] = {"t1": t1, "busy": st.pop("busy", None)}
    if rep == 0:
        out["mem"] = mem_end(base)
        out["returned_bytes"] = t.numel() * t.element_size()
        out["dtype"] = str(t.dtype).replace("torch.", "")
        out["shape"] = list(t.shape)
        out["crc"], out["routes"] = tensor_crc(t, st["opts"]["keep"])
    del t
    out["store"] = reader_cleanup(st)
    out["crossed"] = out["store"].pop("crossed", st.pop("crossed", 0))
    return out


# -- plain processes -------------------------------------------------------------------


def proc_main(role: str, ctrl: Any, data: Any) -> None:
    """A writer or reader process: runs the ways the parent sends, one at a time."""
    sys.path.insert(0, str(ROOT))
    os.environ.update(ENV)
    import torch  # noqa: F401  (imported before any baseline is taken)

    import routing_replay  # noqa: F401

    sock = socket.socket(fileno=os.dup(data.fileno()))
    while True:
        msg = ctrl.recv()
        if msg is None:
            return
        way, spec, repeats, opts = msg
        try:
            if WAYS[way][0] == "local":
                ctrl.send(("ok", run_copyto(way, spec, repeats, opts)))
                continue
            st = (writer_setup if role == "writer" else reader_setup)(way, spec, opts)
            ctrl.send(("ready", None))
            base = mem_start()
            reps = []
            for rep in range(repeats):
                assert ctrl.recv() == "go"
                if role == "writer":
                    t0 = time.perf_counter()
                    writer_send(st, rep, sock)
                    busy = st.pop("busy", None)
                    reps.append(
                        {"t0": t0, "busy": busy, "mem": mem_end(base) if rep == 0 else None}
                    )
                    writer_cleanup(st)
                else:
                    reps.append(read_and_check(st, sock, None, rep, base))
                ctrl.send(("done", None))
            extra = {"src_bytes": st.get("src_bytes")}
            if "store" in st:
                st.pop("store").close()
            del st  # the next way starts from an empty process
            ctrl.send(("ok", {"reps": reps, **extra}))
        except BaseException:
            ctrl.send(("error", traceback.format_exc()))


def run_copyto(way: str, spec: dict, repeats: int, opts: dict) -> dict:
    """The limit: one numpy.copyto of the batch's int32 or narrow bytes (dst pre-faulted)."""
    import torch

    layout = layout_of_model(spec["model"])
    cache: dict = {}
    L, K = layout.num_moe_layers, layout.top_k
    src = np.empty((total_tokens(spec), L, K), np.int32 if way == "copyto-i32" else layout.dtype)
    row = 0
    for i in range(len(spec["samples"])):
        a = sample_routes(spec, i, layout, cache)
        src[row : row + len(a)] = to_int32(a, layout) if way == "copyto-i32" else a
        row += len(a)
    base = mem_start()
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):  # the first copy faults dst in, like every way's first step
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    mem = mem_end(base)
    t = torch.from_numpy(layout.decode(dst) if way == "copyto-narrow" else dst)
    crc, routes = tensor_crc(t, opts["keep"])
    return {
        "seconds_each": times,
        "mem": mem,
        "returned_bytes": dst.nbytes,
        "dtype": str(t.dtype).replace("torch.", ""),
        "crc": crc,
        "routes": routes,
    }


class Procs:
    """A writer process and a reader process joined by a Unix socketpair."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        w_data, r_data = ctx.Pipe(duplex=True)  # a socketpair on Linux
        self.ctrl = {}
        self.procs = {}
        for role, data in (("writer", w_data), ("reader", r_data)):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=proc_main, args=(role, theirs, data), daemon=True)
            p.start()
            self.ctrl[role], self.procs[role] = mine, p

    def _get(self, role: str, timeout: float) -> Any:
        conn = self.ctrl[role]
        if not conn.poll(timeout):
            raise TimeoutError(f"{role} process did not answer within {timeout:.0f}s")
        kind, value = conn.recv()
        if kind == "error":
            raise RuntimeError(f"{role} process failed:\n{value}")
        return value

    def local(self, way: str, spec: dict, repeats: int, opts: dict) -> dict:
        self.ctrl["reader"].send((way, spec, repeats, opts))
        return self._get("reader", 900)

    def pair(self, way: str, spec: dict, repeats: int, opts: dict) -> dict:
        for role in ("reader", "writer"):
            self.ctrl[role].send((way, spec, repeats, opts))
        self._both(900)
        for _ in range(repeats):
            for role in ("reader", "writer"):
                self.ctrl[role].send("go")
            self._both(900)
        return self._both(900)

    def _both(self, timeout: float) -> dict:
        """One answer from each process, in whichever order: an error from either raises at
        once (the other may be blocked on the data socket; close() then kills it)."""
        from multiprocessing.connection import wait

        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < 2:
            pending = [self.ctrl[r] for r in ("writer", "reader") if r not in got]
            ready = wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no answer within {timeout:.0f}s")
            for role in ("writer", "reader"):
                if role not in got and self.ctrl[role] in ready:
                    got[role] = self._get(role, 0)
        return got

    def close(self) -> None:
        for role, conn in self.ctrl.items():
            with contextlib.suppress(OSError):
                conn.send(None)
            self.procs[role].join(10)
            if self.procs[role].is_alive():
                self.procs[role].kill()


# -- Ray actors ------------------------------------------------------------------------


class RayRole:
    """A writer or reader inside a Ray actor (the same code as the plain processes)."""

    def __init__(self) -> None:
        import torch  # noqa: F401

        import routing_replay  # noqa: F401

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def setup(self, role: str, way: str, spec: dict, opts: dict) -> None:
        self.role = role
        self.st = (writer_setup if role == "writer" else reader_setup)(way, spec, opts)
        self.base = mem_start()
        self.reps: list[dict] = []

    def write(self, rep: int) -> tuple[float, Any]:
        t0 = time.perf_counter()
        payload = writer_send(self.st, rep, None)
        busy = self.st.pop("busy", None)
        self.reps.append({"t0": t0, "busy": busy, "mem": mem_end(self.base) if rep == 0 else None})
        return t0, payload

    def cleanup(self) -> None:
        writer_cleanup(self.st)

    def read(self, rep: int, payload: Any) -> dict:
        out = read_and_check(self.st, None, payload, rep, self.base)
        self.reps.append(out)
        return {"t1": out["t1"]}

    def finish(self) -> dict:
        st, self.st = self.st, {}
        return {"reps": self.reps, "src_bytes": st.get("src_bytes")}


class RayCluster:
    """Two simulated nodes; a writer actor on each, a reader actor on the head."""

    def __init__(self, object_store_bytes: int) -> None:
        import ray
        from ray.cluster_utils import Cluster
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        args = {"num_cpus": 2, "object_store_memory": object_store_bytes}
        self.cluster = Cluster(initialize_head=True, head_node_args=args)
        self.cluster.add_node(**args)
        self.cluster.wait_for_nodes()
        env = {
            "env_vars": {
                **ENV,
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            }
        }
        ray.init(
            address=self.cluster.address,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=env,
        )
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        head = ray.get_runtime_context().get_node_id()
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        self.nodes = {"head": head, "other": other}
        actor = ray.remote(RayRole)

        def on(node: str) -> Any:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            return actor.options(num_cpus=0, scheduling_strategy=strategy).remote()

        self.writer = {"head": on(head), "other": on(other)}
        self.reader = on(head)
        ray.get([a.node.remote() for a in [*self.writer.values(), self.reader]])

    def pair(self, way: str, spec: dict, repeats: int, opts: dict) -> dict:
        import ray

        writer = self.writer["other" if WAYS[way][0] == "ray-cross" else "head"]
        ray.get(
            [
                writer.setup.remote("writer", way, spec, opts),
                self.reader.setup.remote("reader", way, spec, opts),
            ]
        )
        for rep in range(repeats):
            _, payload = ray.get(writer.write.remote(rep))
            ray.get(self.reader.read.remote(rep, payload))
            del payload
            ray.get(writer.cleanup.remote())
        w, r = ray.get([writer.finish.remote(), self.reader.finish.remote()])
        return {"writer": w, "reader": r}

    def close(self) -> None:
        import ray

        from routing_replay.ray import shutdown_node_stores, store_actors

        for job in {name.split("-")[2] for name in store_actors()}:
            shutdown_node_stores(job)
        ray.shutdown()
        self.cluster.shutdown()


# -- running a way, summarising ---------------------------------------------------------


def measure(
    way: str,
    spec: dict,
    procs: Procs,
    ray_cluster: RayCluster | None,
    repeats: int,
    keep: bool,
    token_ids: bool,
) -> dict:
    """Run one way on one workload: a first step (fresh reader memory), then `repeats`
    steady steps; seconds are their median."""
    repeats += 1  # step 0 is the first step
    where = WAYS[way][0]
    layout = layout_of_model(spec["model"])
    T = total_tokens(spec)
    opts: dict[str, Any] = {"keep": keep, "token_ids": token_ids}
    store = None
    if way in ("store", "store-i32-in"):
        from routing_replay import RoutingStore

        store = RoutingStore.create(f"bench-{uuid.uuid4().hex[:8]}", layout, capacity(spec))
        opts["store"] = store.name
    if way in ("store-ray", "store-x"):
        opts["job"] = f"bench{uuid.uuid4().hex[:8]}"
        opts["capacity"] = capacity(spec)
    busy: dict[str, float] = {}
    try:
        if where == "local":
            r = procs.local(way, spec, repeats, opts)
            reader, writer_mem = r, None
            all_s = r["seconds_each"]
        else:
            runner = procs if where == "proc" else ray_cluster
            got = runner.pair(way, spec, repeats, opts)
            w_reps, r_reps = got["writer"]["reps"], got["reader"]["reps"]
            all_s = [r["t1"] - w["t0"] for w, r in zip(w_reps, r_reps, strict=True)]
            reader, writer_mem = r_reps[0], w_reps[0]["mem"]
            if w_reps[0].get("busy") is not None:  # the store ways: time in put, in read
                busy["put"] = statistics.median(w["busy"] for w in w_reps[1:])
            if r_reps[0].get("busy") is not None:
                busy["read"] = statistics.median(r["busy"] for r in r_reps[1:])
        seconds = statistics.median(all_s[1:])  # steady state: rep 0 is the first step
    finally:
        if store is not None:
            store.close()
            store.unlink()
        if "job" in opts and ray_cluster is not None:
            from routing_replay.ray import shutdown_node_stores

            shutdown_node_stores(opts["job"])
    int32_bytes = T * layout.values_per_token * 4
    shm = 0
    if way.startswith("store"):
        shm = reader["store"].get("segment_bytes", 0)
    crossed = reader.get("crossed", 0)  # measured: the store actor's bytes_served, or Ray's
    return {
        "way": way,
        "label": WAYS[way][1],
        "tokens": T,
        "seconds": seconds,
        "seconds_first": all_s[0],
        "busy_seconds": busy,
        "seconds_all": all_s,
        "ns_per_token": seconds / T * 1e9,
        "GBps_int32": int32_bytes / seconds / 1e9,
        "returned_bytes": reader["returned_bytes"],
        "returned_dtype": reader["dtype"],
        "reader_mem": reader["mem"],
        "writer_mem": writer_mem,
        "shm_segment_bytes": shm,
        "shm_used_bytes": reader.get("store", {}).get("bytes_used", 0),
        "bytes_crossing": crossed,
        "crc": reader["crc"],
        "routes": reader.get("routes"),
    }


def run(
    quick: bool = False,
    repeats: int = 3,
    keep: bool = False,
    workloads: list[str] | None = None,
    ways: list[str] | None = None,
    scaling: list[int] | None = None,
    log: Any = print,
    checkpoint: Any = None,
) -> dict:
    """Every way on every workload (and the scaling series); returns the results dict."""
    sys.path.insert(0, str(ROOT))
    ways = ways or list(WAYS)
    specs = {}
    for model in MODELS:
        if quick:  # both dtypes (uint8, uint16), with and without prefix sharing
            if model == "qwen3-30b-a3b":
                specs[f"{model}/grpo"] = grpo_spec(model, 2, 4, 256, 128)
            else:
                specs[f"{model}/long"] = long_spec(model, 2, 1024)
        else:
            specs[f"{model}/grpo"] = grpo_spec(model, 64, 8, 2048, 1024)
            specs[f"{model}/long"] = long_spec(model, 16, 32768)
    if workloads:
        specs = {k: v for k, v in specs.items() if k in workloads}
    slow_samples = {"grpo": 8, "long": 1}  # ~25-33K tokens: a few seconds of JSON
    procs = Procs()
    ray_cluster = None
    results: dict[str, Any] = {"workloads": {}, "scaling": []}
    expected_cache: dict[tuple, tuple] = {}
    rows_of: dict[str, dict[str, dict]] = {key: {} for key in specs}

    def run_ways(phase: list[str]) -> None:
        """Run `phase`'s ways on every workload; the rows land in `rows_of`."""
        for key, spec in specs.items():
            layout = layout_of_model(spec["model"])
            T = total_tokens(spec)
            log(
                f"\n== {key}: {spec['name']}, {T} tokens, {layout.bytes_per_token} B/token "
                f"stored, {T * layout.values_per_token * 4 / 1e9:.2f} GB int32"
            )
            for way in phase:
                sub = spec
                if way in SLOW_WAYS and not quick:
                    sub = subset(spec, slow_samples[spec["kind"]])
                if way in ("ray-i32", "ray-i32-x"):
                    sub = ray_subset(spec, quick)
                reps = 1 if way in SLOW_WAYS and not quick else repeats
                t = time.perf_counter()
                row = measure(
                    way, sub, procs, ray_cluster, reps, keep, token_ids=spec["kind"] == "grpo"
                )
                ekey = (key, len(sub["samples"]))
                if ekey not in expected_cache or keep:
                    expected_cache[ekey] = expected(sub, layout, keep)
                crc, routes = expected_cache[ekey]
                row["identical"] = row["crc"] == crc
                row["expected_routes"] = routes
                if sub is not spec:  # scale per token to the full batch
                    row["measured_tokens"] = row["tokens"]
                    row["scaled"] = True
                    row["seconds"] = row["ns_per_token"] * T / 1e9
                    row["GBps_int32"] = T * layout.values_per_token * 4 / row["seconds"] / 1e9
                    row["tokens"] = T
                rows_of[key][way] = row
                log(
                    f"  {way:<14} {row['seconds']:9.4f}s  {row['ns_per_token']:10.1f} ns/token"
                    f"  identical={row['identical']}  ({time.perf_counter() - t:.1f}s wall)"
                    + "".join(f"  {k} {v / T * 1e9:.0f}" for k, v in row["busy_seconds"].items())
                )
            rows = {w: rows_of[key][w] for w in ways if w in rows_of[key]}  # table order
            add_ratios(rows)
            results["workloads"][key] = {
                "name": spec["name"],
                "model": spec["model"],
                "tokens": T,
                "samples": len(spec["samples"]),
                "bytes_per_token_stored": layout.bytes_per_token,
                "int32_bytes": T * layout.values_per_token * 4,
                "rows": rows,
            }
            if checkpoint:
                checkpoint(results)

    # Plain processes first: Ray's idle daemons (GCS, two raylets) would take CPU from them
    # on a 2-core machine. Then the scaling series, then the Ray ways.
    try:
        run_ways([w for w in ways if not WAYS[w][0].startswith("ray")])
        for n in scaling or []:
            spec = scaling_spec("qwen3-30b-a3b", n)
            layout = layout_of_model(spec["model"])
            crc_n = None
            for way in ("store", "raw-narrow", "copyto-narrow", "base64-i32", "json"):
                if (way == "json" and n > 10**4) or (way == "base64-i32" and n > 10**5):
                    continue
                if quick and way in SLOW_WAYS:
                    continue
                if way not in ways:
                    continue
                t = time.perf_counter()
                row = measure(
                    way,
                    spec,
                    procs,
                    ray_cluster,
                    repeats,
                    False,
                    token_ids=False,
                )
                crc_n = expected(spec, layout, False)[0] if crc_n is None else crc_n
                row["identical"] = row["crc"] == crc_n
                row.pop("routes", None)
                results["scaling"].append(row)
                if checkpoint:
                    checkpoint(results)
                log(
                    f"  scaling {row['tokens']:>9} {way:<14} {row['seconds']:9.4f}s "
                    f"{row['ns_per_token']:8.1f} ns/token identical={row['identical']} "
                    f"({time.perf_counter() - t:.1f}s wall)"
                )
        ray_ways = [w for w in ways if WAYS[w][0].startswith("ray")]
        if ray_ways:
            biggest = max(
                max(
                    total_tokens(ray_subset(s, quick))
                    * layout_of_model(s["model"]).values_per_token
                    * 4,
                    total_tokens(s) * layout_of_model(s["model"]).bytes_per_token,
                )
                for s in specs.values()
            )
            t = time.perf_counter()
            ray_cluster = RayCluster(max(200 * MB, int(biggest * 2.5)))
            log(f"ray: 2-node cluster up in {time.perf_counter() - t:.1f}s")
            run_ways(ray_ways)
    finally:
        procs.close()
        if ray_cluster is not None:
            ray_cluster.close()
    results["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    return results


RAY_I32_CAP = 1_500_000_000  # int32 bytes per Ray batch: up to 4 copies live (24 GB box)


def ray_subset(spec: dict, quick: bool) -> dict:
    """The Ray int32 ways hold the batch up to 4 times (writer, object store on each node,
    reader): above RAY_I32_CAP they run on the leading half/quarter of the samples."""
    layout = layout_of_model(spec["model"])
    nbytes = total_tokens(spec) * layout.values_per_token * 4
    keep = len(spec["samples"])
    while not quick and nbytes * keep / len(spec["samples"]) > RAY_I32_CAP and keep % 2 == 0:
        keep //= 2
    return spec if keep == len(spec["samples"]) else subset(spec, keep)


def add_ratios(rows: dict) -> None:
    """x slower than this project (same node vs same node, 2 nodes vs 2 nodes)."""
    for way, row in rows.items():
        ref = rows.get("store-x" if WAYS[way][0] == "ray-cross" else "store")
        if way == "store-ray":
            ref = rows.get("store-ray")
        row["x_store"] = row["seconds"] / ref["seconds"] if ref else None
        copy = rows.get("copyto-narrow")
        row["x_copyto_narrow"] = row["seconds"] / copy["seconds"] if copy else None
        mem = row["reader_mem"]
        row["reader_private_over_returned"] = mem["private_delta"] / row["returned_bytes"]
        row["reader_peak_over_returned"] = mem["peak_delta"] / row["returned_bytes"]


# -- report ----------------------------------------------------------------------------


def table(results: dict) -> str:
    lines = []
    for key, w in results["workloads"].items():
        lines.append(
            f"\n{key}: {w['name']}, {w['tokens']:,} tokens, "
            f"{w['int32_bytes'] / 1e9:.2f} GB int32, {w['bytes_per_token_stored']} B/token"
            " narrow"
        )
        lines.append(
            f"{'way':<46}{'seconds':>9}{'ns/tok':>9}{'1st':>9}{'GB/s i32':>9}{'x store':>9}"
            f"{'rd MB':>8}{'rd/ret':>7}{'wr MB':>8}{'shm MB':>8}{'x-node MB':>8}  ok"
        )
        for _way, r in w["rows"].items():
            wr = r["writer_mem"]["peak_delta"] / MB if r["writer_mem"] else float("nan")
            label = r["label"] + (f" *{r['measured_tokens']:,}" if r.get("scaled") else "")
            xs = f"{r['x_store']:9.1f}" if r["x_store"] is not None else f"{'-':>9}"
            lines.append(
                f"{label:<46}{r['seconds']:9.3f}{r['ns_per_token']:9.1f}{first_step_ns(r):9.0f}"
                f"{r['GBps_int32']:9.2f}"
                f"{xs}{r['reader_mem']['peak_delta'] / MB:8.0f}"
                f"{r['reader_private_over_returned']:7.2f}{wr:8.0f}"
                f"{r['shm_used_bytes'] / MB:8.0f}{r['bytes_crossing'] / MB:8.0f}  "
                f"{'yes' if r['identical'] else 'NO'}"
            )
    if results["scaling"]:
        lines.append("\nscaling (Qwen3-30B-A3B shape, samples of 2500 tokens, no sharing)")
        lines.append(f"{'tokens':>10} {'way':<16}{'seconds':>10}{'ns/token':>10}")
        for r in results["scaling"]:
            lines.append(
                f"{r['tokens']:>10} {r['way']:<16}{r['seconds']:10.4f}{r['ns_per_token']:10.1f}"
            )
    return "\n".join(lines)


def first_step_ns(row: dict) -> float:
    """ns/token of step 0 (fresh reader memory), on the tokens actually measured."""
    return row["seconds_first"] / row.get("measured_tokens", row["tokens"]) * 1e9


def markdown(results: dict) -> str:
    """The tables as Markdown (for docs/performance.md)."""
    out = []
    for key, w in results["workloads"].items():
        out.append(
            f"\n**{key}**: {w['name']}, {w['tokens']:,} tokens, {w['int32_bytes'] / 1e9:.2f} GB "
            f"as int32, {w['bytes_per_token_stored']} B/token stored\n"
        )
        out.append(
            "| way | seconds | ns/token | first step ns/token | GB/s (int32-eq.) | "
            "x this project | x copyto narrow | reader peak MB (x returned, private) | "
            "writer peak MB | /dev/shm MB | MB crossing nodes (measured) |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in w["rows"].values():
            label = r["label"] + (
                f" (on {r['measured_tokens']:,} tokens)" if r.get("scaled") else ""
            )
            x = f"{r['x_store']:.1f}" if r["x_store"] is not None else "-"
            wr = f"{r['writer_mem']['peak_delta'] / MB:.0f}" if r["writer_mem"] else "-"
            out.append(
                f"| {label} | {r['seconds']:.3f} | {r['ns_per_token']:,.0f} | "
                f"{first_step_ns(r):,.0f} | {r['GBps_int32']:.2f} | {x} | "
                f"{r['x_copyto_narrow']:.1f} | {r['reader_mem']['peak_delta'] / MB:.0f} "
                f"({r['reader_private_over_returned']:.2f}) | {wr} | "
                f"{r['shm_used_bytes'] / MB:.0f} | {r['bytes_crossing'] / MB:.0f} |"
            )
    if results["scaling"]:
        out.append("\n| routed tokens | way | seconds | ns/token |")
        out.append("|---|---|---|---|")
        for r in results["scaling"]:
            out.append(
                f"| {r['tokens']:,} | {WAYS[r['way']][1]} | {r['seconds']:.4f} | "
                f"{r['ns_per_token']:,.0f} |"
            )
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["workloads"])
    ncols = 2 if results["scaling"] else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 5.5), squeeze=False)
    ax = axes[0][0]
    ways = list(next(iter(results["workloads"].values()))["rows"])
    height = 0.8 / max(1, len(keys))
    for j, key in enumerate(keys):
        rows = results["workloads"][key]["rows"]
        y = [i + j * height for i in range(len(ways))]
        ax.barh(y, [rows[w]["ns_per_token"] for w in ways], height=height, label=key)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(ways))])
    ax.set_yticklabels([WAYS[w][1] for w in ways], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ns per routed token, writer process -> reader's torch tensor (log)")
    ax.legend(fontsize=7)
    ax.set_title("Moving routes, per token (lower is better)")
    if results["scaling"]:
        ax = axes[0][1]
        by_way: dict[str, list] = {}
        for r in results["scaling"]:
            by_way.setdefault(r["way"], []).append((r["tokens"], r["ns_per_token"]))
        for way, pts in by_way.items():
            ax.plot(*zip(*pts, strict=True), marker="o", label=WAYS[way][1])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("routed tokens in the batch")
        ax.set_ylabel("ns per token")
        ax.set_title("Scaling: per-token cost (Qwen3-30B-A3B shape)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def strip(results: dict) -> dict:
    """The results without the routes arrays (kept only for the test)."""
    drop = ("routes", "expected_routes")
    out = {k: v for k, v in results.items() if k not in ("workloads", "scaling")}
    out["workloads"] = {
        key: {
            **w,
            "rows": {
                way: {k: v for k, v in r.items() if k not in drop} for way, r in w["rows"].items()
            },
        }
        for key, w in results["workloads"].items()
    }
    out["scaling"] = [{k: v for k, v in r.items() if k not in drop} for r in results["scaling"]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for CI")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workloads", nargs="*", help="e.g. qwen3-30b-a3b/grpo")
    parser.add_argument("--ways", nargs="*", choices=list(WAYS))
    parser.add_argument(
        "--scaling",
        nargs="*",
        type=float,
        help="token counts for the scaling series (default 1e4..1e7)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="results JSON (the PNG goes next to it); default benchmarks/results/transport.json, "
        "or transport.quick.json in the temp dir with --quick (the committed results stay)",
    )
    parser.add_argument(
        "--report", type=Path, help="print the tables of a results JSON as Markdown, run nothing"
    )
    args = parser.parse_args()
    if args.report:
        print(markdown(json.loads(args.report.read_text())))
        return
    if args.out is None:
        quick_out = Path(tempfile.gettempdir()) / "transport.quick.json"
        args.out = quick_out if args.quick else RESULTS / "transport.json"
    if args.scaling is None:
        args.scaling = [1e4] if args.quick else [1e4, 1e5, 1e6, 1e7]

    def checkpoint(partial: dict) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps(strip(partial), indent=1))

    results = run(
        args.quick,
        1 if args.quick else args.repeat,
        False,
        args.workloads,
        args.ways,
        [int(n) for n in args.scaling],
        checkpoint=checkpoint,
    )
    text = table(results)
    print(text)
    results = strip(results)
    results["quick"] = args.quick
    results["command"] = " ".join(["python", "benchmarks/transport.py", *sys.argv[1:]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    png = PLOTS / args.out.with_suffix(".png").name
    plot(results, png)
    print(f"wrote {args.out} and {png}")
    bad = [
        (k, w)
        for k, v in results["workloads"].items()
        for w, r in v["rows"].items()
        if not r["identical"]
    ]
    bad += [("scaling", r["way"]) for r in results["scaling"] if not r["identical"]]
    if bad:
        raise SystemExit(f"routes differ: {bad}")


if __name__ == "__main__":
    main()
