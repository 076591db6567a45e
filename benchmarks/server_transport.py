"""Routes from a vLLM server to a trainer: in the HTTP body, as refs over HTTP, or over Ray.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        .venv-vllm/bin/python benchmarks/server_transport.py           # ~3 min on 2 CPUs
    ... benchmarks/server_transport.py --quick                         # 16 requests, 1 round

The same token-id requests (greedy, fixed length, `--concurrency` in flight) go three ways
to a real vllm-cpu 0.30 engine, a tiny Qwen3-MoE with a realistic routing shape (16 MoE
layers, top-8 of 64 experts by default; hidden 64) built here:

- http-body: the OpenAI server (`python -m vllm.entrypoints.openai.api_server`, what `vllm
  serve` runs; vllm-cpu's `vllm` script fails on `importlib.metadata.version("vllm")`) with
  `--enable-return-routed-experts`: each choice carries `routed_experts` as base64 `.npy`;
  the trainer decodes them (`routing_replay.integrations.vllm.routes_from_vllm`) into one
  packed tensor.
- http-refs: the same server and requests;
  `routing_replay.integrations.vllm_middleware.RoutesToRefs` (`--middleware`) puts each
  choice into this node's store and sends a JSON ref instead; the trainer reads the refs
  (`RoutingStore.read` -> `to_torch`). The server runs with the
  middleware for both HTTP ways: http-body requests opt out by a header (a pass-through),
  and the two ways alternate round by round on one engine.
- ray-store: `routing_replay.integrations.vllm_server.vllm_server` (AsyncLLM in a Ray actor,
  puts into the node store, replies with a `RoutingRef`); the trainer runs `fetch_batch` ->
  `to_torch`.

Client time: wall time of a round of requests (JSON parsing included) per generated token,
then the trainer-side decode/read to a packed `[sum_T, L, K]` tensor (release included);
medians over rounds. Bytes: HTTP bodies as received (plus request bodies and headers);
Ray: `len(ray.cloudpickle.dumps(x))` of each reply and of each call's arguments. Every way
ends with the routes a trainer replays; rows and completions are compared with the last
http-body round (bf16 routes depend a little on how requests were batched: http-body's own
round-to-round figure is the noise floor). Engines run one at a time, with identical engine
arguments (bf16, eager, no prefix caching: rounds repeat the same prompts; one OpenMP
thread), in phases HTTP, Ray, HTTP, Ray (`--phases`) so that drift shows. Writes
benchmarks/results/server_transport.json (`--quick` writes nothing unless `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from harness import RESULTS, ROOT, machine, write_json

sys.path.insert(0, str(ROOT))

from routing_replay.integrations.vllm import DEFAULT_ENV

for _key, _value in DEFAULT_ENV.items():
    os.environ.setdefault(_key, _value)
# One OpenMP thread per engine: Ray sets OMP_NUM_THREADS=num_cpus (1) for its actor, so the
# HTTP server's engine gets the same; two spinning OpenMP threads on a 2-core machine also
# slow down tenfold whenever anything else runs.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from server_transport_clients import (  # noqa: E402
    ENGINE,
    free_port,
    http_round,
    http_trainer_side,
    ray_round,
    ray_trainer_side,
    start_http_server,
    stop,
    wait_ready,
)

from routing_replay import RoutingLayout, RoutingStore  # noqa: E402
from routing_replay.ray import StoreOptions  # noqa: E402
from routing_replay.testing import tiny_moe  # noqa: E402

WAYS = {
    "http-body": "vllm serve, routed_experts base64 .npy in the body",
    "http-refs": "vllm serve + RoutesToRefs middleware, JSON refs",
    "ray-store": "Ray actor (AsyncLLM) puts into the store, RoutingRef replies",
}


def build_model(path: str, moe_layers: int, experts: int, top_k: int) -> dict[str, Any]:
    """A seeded tiny Qwen3-MoE, every layer MoE; its shape."""
    shape = {"num_hidden_layers": moe_layers, "num_experts": experts, "num_experts_per_tok": top_k}
    # vLLM's CPU attention has no kernel for head_dim 16
    model = tiny_moe(vocab_size=256, head_dim=32, **shape)
    model.save_pretrained(path)
    return {
        "family": "Qwen3-MoE (random init)",
        "params": sum(p.numel() for p in model.parameters()),
        "hidden_size": 64,
        "num_hidden_layers": moe_layers,
        "moe_layers": moe_layers,
        "num_experts": experts,
        "top_k": top_k,
        "vocab_size": 256,
    }


def prompts(n: int, length: int) -> list[list[int]]:
    return [[3 + (7 * i + 5 * j + i * j) % 250 for j in range(length)] for i in range(n)]


# -- main ----------------------------------------------------------------------------------


def summarise(rounds: list[dict], n_requests: int) -> dict:
    med = lambda k: statistics.median(r[k] for r in rounds)  # noqa: E731
    tokens = rounds[0]["tokens"]
    wall, decode = med("wall_s"), med("decode_s")
    total = statistics.median(r["wall_s"] + r["decode_s"] for r in rounds)
    last = rounds[-1]
    return {
        "rounds": len(rounds),
        "generated_tokens_per_round": tokens,
        "wall_s": wall,
        "trainer_decode_s": decode,
        "total_s": total,
        "ms_per_token_wall": 1e3 * wall / tokens,
        "ms_per_token_decode": 1e3 * decode / tokens,
        "ms_per_token_total": 1e3 * total / tokens,
        "wall_s_each_round": [r["wall_s"] for r in rounds],
        "phase_of_each_round": [r["phase"] for r in rounds],
        "median_request_latency_s": med("latency_s"),
        "response_bytes_per_request": last["response_bytes"] / n_requests,
        "routes_bytes_per_request": last["routes_bytes"] / n_requests,
        "header_bytes_per_request": last["header_bytes"] / n_requests,
        "request_bytes_per_request": last["request_bytes"] / n_requests,
        "response_bytes_per_generated_token": last["response_bytes"] / tokens,
        "routes_in_body": last["in_body"],
    }


def agreement(a: dict, b: dict) -> dict:
    """Routes and tokens of two rounds: rows equal as sets (vLLM's order within a row is not
    by score), and completions equal. Rounds differ only by how requests were batched."""
    same_rows = (a["routes"].sort(-1).values == b["routes"].sort(-1).values).all(-1).all(-1)
    same_tokens = [x == y for x, y in zip(a["completions"], b["completions"], strict=True)]
    return {
        "routes_identical": bool(torch.equal(a["routes"], b["routes"])),
        "token_rows_equal": float(same_rows.float().mean()),
        "completions_equal": sum(same_tokens) / len(same_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="per way and phase")
    parser.add_argument("--phases", type=int, default=2, help="HTTP, Ray, HTTP, Ray, ...")
    parser.add_argument("--moe-layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument(
        "--out", help="JSON path (default results/server_transport.json; none with --quick)"
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds, args.phases = 16, 1, 1
    import ray
    import vllm

    from routing_replay.integrations.vllm_server import vllm_server
    from routing_replay.ray import shutdown_node_stores

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    reqs = prompts(args.requests, args.prompt_len)
    warm = prompts(args.concurrency, args.prompt_len)
    work = Path(tempfile.mkdtemp(prefix="rr-server-transport-"))
    model_dir = str(work / "model")
    shape = build_model(model_dir, args.moe_layers, args.experts, args.top_k)
    layout = RoutingLayout.from_hf_config(transformers.AutoConfig.from_pretrained(model_dir))
    shape["routed_bytes_per_token_uint8"] = layout.bytes_per_token
    cap = args.requests * (args.prompt_len + args.new_tokens) * 4
    store_name = f"rr-bench-{uuid.uuid4().hex[:8]}"
    store = RoutingStore.create(store_name, layout, capacity_tokens=cap, page_tokens=16)
    rounds: dict[str, list[dict]] = {w: [] for w in WAYS}
    starts: dict[str, list[float]] = {"http": [], "ray": []}

    def http_phase(phase: int) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = work / f"server{phase}.log"
        proc = start_http_server(model_dir, port, store_name, log)

        def http(batch: list[list[int]], tag: str, refs: bool) -> dict:
            rnd = asyncio.run(
                http_round(url, model_dir, batch, args.new_tokens, args.concurrency, tag, refs)
            )
            side = http_trainer_side(rnd, layout, store if refs else None)
            side["wall_s"] = rnd["wall_s"]
            return side

        try:
            starts["http"].append(asyncio.run(wait_ready(url, proc)))
            for refs in (False, True):  # warm-up: the first forwards and reads are slow
                http(warm, f"p{phase}warm{int(refs)}", refs)
            for k in range(args.rounds):
                order = (False, True) if k % 2 == 0 else (True, False)  # ABBA against drift
                for refs in order:
                    way = "http-refs" if refs else "http-body"
                    side = http(reqs, f"p{phase}{way}{k}", refs)
                    side["phase"] = phase
                    rounds[way].append(side)
                    print(f"phase {phase} {way} round {k}: {side['wall_s']:.2f} s", flush=True)
        except BaseException:
            print(log.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            stop(proc)

    def ray_phase(phase: int) -> None:
        job = f"srvbench{uuid.uuid4().hex[:6]}"
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            t0 = time.perf_counter()
            actor = vllm_server(
                job,
                model_dir,
                engine_kwargs=ENGINE,
                store_options=StoreOptions(page_tokens=16, capacity_tokens=cap),
            )
            ray.get(actor.start.remote(), timeout=600)
            starts["ray"].append(time.perf_counter() - t0)

            async def run() -> list[dict]:
                n, c = args.new_tokens, args.concurrency
                ray_trainer_side(await ray_round(actor, warm, n, c, f"p{phase}w"))
                return [
                    await ray_round(actor, reqs, n, c, f"p{phase}r{k}") for k in range(args.rounds)
                ]

            for k, rnd in enumerate(asyncio.run(run())):
                side = ray_trainer_side(rnd)
                side["wall_s"], side["phase"] = rnd["wall_s"], phase
                rounds["ray-store"].append(side)
                print(f"phase {phase} ray-store round {k}: {side['wall_s']:.2f} s", flush=True)
            ray.get(actor.shutdown.remote())
            ray.kill(actor)
            shutdown_node_stores(job)
        finally:
            ray.shutdown()

    try:
        for phase in range(args.phases):
            http_phase(phase)
            ray_phase(phase)
    finally:
        store.close()
        store.unlink()
        shutil.rmtree(work, ignore_errors=True)

    base = rounds["http-body"][-1]
    agree = {w: agreement(rounds[w][-1], base) for w in WAYS}
    if len(rounds["http-body"]) > 1:  # the noise floor: the same way, another round
        agree["http-body"] = agreement(rounds["http-body"][-2], base)
    results = {w: summarise(rounds[w], args.requests) for w in WAYS}
    ref = results["http-body"]
    for w, r in results.items():
        r["time_per_token_vs_http_body"] = r["ms_per_token_total"] / ref["ms_per_token_total"]
        r["wall_per_token_vs_http_body"] = r["ms_per_token_wall"] / ref["ms_per_token_wall"]
        r["response_bytes_vs_http_body"] = (
            r["response_bytes_per_request"] / ref["response_bytes_per_request"]
        )
        r["vs_last_http_body_round"] = agree[w]
    print(
        f"\n{'way':10} {'wall ms/tok':>11} {'decode':>8} {'total':>8} {'vs body':>8} "
        f"{'resp B/req':>11} {'routes B':>9} {'vs body':>8} {'req B':>6} {'rows eq':>8}"
    )
    for w, r in results.items():
        print(
            f"{w:10} {r['ms_per_token_wall']:>11.3f} {r['ms_per_token_decode']:>8.4f} "
            f"{r['ms_per_token_total']:>8.3f} {r['time_per_token_vs_http_body']:>8.3f} "
            f"{r['response_bytes_per_request']:>11.0f} {r['routes_bytes_per_request']:>9.0f} "
            f"{r['response_bytes_vs_http_body']:>8.3f} {r['request_bytes_per_request']:>6.0f} "
            f"{agree[w]['token_rows_equal']:>8.4f}"
        )
    report = {
        "setup": {
            "model": shape,
            "requests_per_round": args.requests,
            "prompt_tokens": args.prompt_len,
            "new_tokens": args.new_tokens,
            "concurrency": args.concurrency,
            "rounds_per_way_and_phase": args.rounds,
            "phases": f"{args.phases} x (HTTP server: body/refs rounds alternating; Ray actor)",
            "sampling": "greedy, ignore_eos, logprobs of the sampled token",
            "engine": ENGINE,
            "engine_env": {k: os.environ[k] for k in (*DEFAULT_ENV, "OMP_NUM_THREADS")},
            "http_server": "python -m vllm.entrypoints.openai.api_server (vllm serve's server),"
            " --middleware routing_replay.integrations.vllm_middleware.RoutesToRefs; "
            "http-body requests opt out by header",
            "http_client": "aiohttp, one keep-alive connection per slot",
            "ray_server": "routing_replay.integrations.vllm_server.vllm_server "
            "(one actor, num_cpus=1)",
            "bytes": "HTTP: body bytes as received (headers separate); Ray: "
            "len(ray.cloudpickle.dumps(reply)) and of (prompt, params, kwargs)",
            "trainer_side": "to one packed [sum_T, L, K] torch tensor: base64+npy decode and "
            "routes_from_vllm (http-body); RoutingStore.read + to_torch + release "
            "(http-refs); fetch_batch(release=True) + to_torch (ray-store)",
            "agreement": "last round of each way vs the last http-body round (http-body: vs "
            "its previous round); rounds differ only in how requests were batched (bf16)",
            "server_start_s": starts,
            "vllm": vllm.__version__,
            "load_average_before_after": [load_before, os.getloadavg()[0]],
            "benchmark_s": time.perf_counter() - started,
        },
        "machine": machine(),
        "ways": WAYS,
        "results": results,
    }
    path = args.out or (None if args.quick else RESULTS / "server_transport.json")
    if path is not None:
        write_json(Path(path), report, indent=2)
        print(f"wrote {path}")
    print(f"benchmark: {report['setup']['benchmark_s']:.0f} s")


if __name__ == "__main__":
    main()
