"""The ways routes travel from a writer to a reader: each way's writer and reader sides."""

from __future__ import annotations

import base64
import io
import json
import pickle
import select
import socket
import struct
import time
import zlib
from typing import Any

import numpy as np
from harness import layout_of_model, mem_end, sample_routes, sample_tokens, to_int32, total_tokens

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


def tensor_crc(t: Any, keep: bool) -> tuple[int, np.ndarray | None]:
    """CRC32 of a packed routes tensor's int16 form, in chunks (no full-size temporary)."""
    import torch

    crc, step = 0, 1 << 16
    for lo in range(0, t.shape[0], step):
        crc = zlib.crc32(t[lo : lo + step].to(torch.int16).numpy(), crc)
    return crc, (t.to(torch.int16).numpy().copy() if keep else None)


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
        from routing_replay import PutRequest

        store, tokens, refs = st["store"], st["tokens"], []
        st["busy"] = 0.0  # seconds inside put: where the writer's time goes
        for group in prompt_groups(spec):  # an engine's request: a prompt's n samples
            t = time.perf_counter()
            puts = [
                PutRequest(
                    f"r{rep}-s{i}",
                    src[i],
                    prompt_len=spec["samples"][i][1],
                    token_ids=None if tokens is None else tokens[i],
                )
                for i in group
            ]
            done = store.put_many(puts)
            st["busy"] += time.perf_counter() - t
            if sock is None:
                refs += done
            else:  # each ref goes as soon as its sample is in: the reader reads meanwhile
                for ref in done:
                    send_msg(sock, pickle.dumps(ref))
        return refs if sock is None else None
    else:
        raise ValueError(way)
    return None


def prompt_groups(spec: dict) -> list[list[int]]:
    """Runs of consecutive samples of one prompt: what one engine request returns (GRPO's n
    completions), put together as the integrations put them (`put_many`)."""
    groups: list[list[int]] = []
    for i, (_, _, group, _) in enumerate(spec["samples"]):
        if groups and spec["samples"][groups[-1][-1]][2] == group:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


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
