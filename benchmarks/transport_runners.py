"""Where the ways run (spawned processes, Ray actors) and `measure`: one way, one workload."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
import uuid
from typing import Any

import numpy as np
from harness import (
    ENV,
    ROOT,
    SimCluster,
    capacity,
    layout_of_model,
    mem_end,
    mem_start,
    sample_routes,
    to_int32,
    total_tokens,
)
from transport_ways import (
    WAYS,
    read_and_check,
    reader_setup,
    tensor_crc,
    writer_cleanup,
    writer_send,
    writer_setup,
)

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

        # The actors run this module's and the ways' code (by value when imported: a test).
        self.sim = SimCluster(2, object_store_bytes, (__name__, "transport_ways"))
        head, other = self.sim.nodes
        self.writer = {
            "head": self.sim.actor(RayRole, head),
            "other": self.sim.actor(RayRole, other),
        }
        self.reader = self.sim.actor(RayRole, head)
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
        from routing_replay.ray import shutdown_node_stores, store_actors

        for job in {name.split("-")[2] for name in store_actors()}:
            shutdown_node_stores(job)
        self.sim.close()


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
