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
- store:       this project: `put_many` of each prompt's samples, as an engine request returns
               them and the integrations put them (uint8/uint16 ids as vLLM hands them, token
               ids so GRPO prompt pages are shared) in the writer, refs to the reader,
               `read` -> Arrow -> `to_torch`; same node (plain processes, and Ray actors) and
               across two simulated nodes (the remote read goes through the node store actor)
- store-i32-in: the same with int32 input (SGLang's form), converted in `put`
- copyto-*:    the limit, one `numpy.copyto` of the int32 and of the narrow bytes (one process)

Ways 1-3 and the same-node store run in two spawned processes joined by a Unix socketpair
(multiprocessing.Pipe); refs travel over the same socket. Ray ways run in actors of a
two-node `ray.cluster_utils.Cluster`. Time = reader's clock when the tensor exists minus the
writer's clock before its first byte (CLOCK_MONOTONIC is system-wide). JSON and base64 are
measured on a subset of samples and scaled per token (flagged in the table). Peak memory is
VmHWM (reset through /proc/self/clear_refs before each way) inside each process or actor.
Writes benchmarks/results/transport.json and docs/img/transport.png (the plot the docs show).

Here: the workloads, the run and the command line; each way's writer and reader sides are in
transport_ways.py, the processes and actors that run them in transport_runners.py, the
tables and the plot in transport_report.py (shared plumbing: harness.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from harness import (
    MB,
    MODELS,
    PLOTS,
    RESULTS,
    ROOT,
    layout_of_model,
    machine,
    sample_routes,
    to_int32,
    total_tokens,
    write_json,
)
from transport_report import add_ratios, markdown, plot, strip, table
from transport_runners import Procs, RayCluster, measure
from transport_ways import SLOW_WAYS, WAYS

# -- workloads -------------------------------------------------------------------------


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


def subset(spec: dict, count: int) -> dict:
    return {**spec, "samples": spec["samples"][:count]}


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
    results["machine"] = machine()
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
        write_json(args.out.with_suffix(".partial.json"), strip(partial))

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
    write_json(args.out, results)
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
