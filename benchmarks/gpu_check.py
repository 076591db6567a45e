"""The GPU check in one go: what only a CUDA machine can show, as one table.

    python benchmarks/gpu_check.py [--quick] [--out DIR]

Needs torch, transformers, numpy and pyarrow; no Ray, no network. On a CUDA machine:

1. the CUDA tests (`pytest -m cuda`: no host sync in capture's and replay's hooks; pinned
   reads, device staging, a CUDA generate captured and replayed, value by value);
2. capture on a bfloat16 engine generating on the GPU, then the float32 trainer on the GPU:
   routing agreement with the engine natively and under `replay` (1.0000 expected);
3. a store read into pinned memory and a non-blocking copy to the device: bytes, time,
   equality with the stored routes;
4. replay's cost on the GPU: a training step (forward + backward) of the tiny model with
   and without `replay` of its own routes, median ratio over adjacent pairs.

Without CUDA the CUDA parts are reported as skipped and the rest runs on the CPU (the
tests run it so). Prints one table; writes gpu_check.json to --out (default: $OUT or the
temp dir). Exit status 1 if a part failed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from harness import ROOT, layout_of_model, paired, write_json

from routing_replay import RoutingLayout, RoutingStore, capture, replay, to_torch
from routing_replay.model.agreement import routing_agreement
from routing_replay.testing import make_prompts, tiny_moe


def cuda_tests() -> dict:
    """`pytest -m cuda` in a subprocess: its summary line and exit status."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"ok": proc.returncode == 0, "summary": lines[-1] if lines else proc.stderr[-300:]}


def agreement(device: str, prompts: int, new_tokens: int) -> dict:
    """bf16 engine generates under capture; fp32 trainer natively and under replay."""
    engine = tiny_moe(0, torch.bfloat16).to(device)
    trainer = tiny_moe(0, torch.float32).to(device)
    rows = make_prompts(prompts, seed=1)
    width = max(len(r) for r in rows)
    ids = torch.zeros((prompts, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):  # left padded, as generate wants
        ids[b, width - len(r) :] = torch.tensor(r)
        mask[b, width - len(r) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    with capture(engine) as cap, torch.no_grad():
        out = engine.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
            min_new_tokens=new_tokens, pad_token_id=0,
        )  # fmt: skip
    recorded = cap.routes()
    full_mask = torch.cat([mask, torch.ones_like(out[:, width:])], 1)
    with capture(trainer) as native, torch.no_grad():
        trainer(input_ids=out, attention_mask=full_mask)
    routes = torch.full((*out.shape, *recorded[0].shape[1:]), -1, dtype=torch.int16)
    for b, r in enumerate(recorded):
        start = int((full_mask[b] == 0).sum())
        routes[b, start : start + len(r)] = torch.from_numpy(r.astype(np.int16))
    layout = RoutingLayout.from_hf_config(trainer.config)
    with replay(trainer, routes, layout=layout), capture(trainer) as forced, torch.no_grad():
        trainer(input_ids=out, attention_mask=full_mask)
    return {
        "device": device,
        "tokens": int(full_mask.sum()),
        "without_replay": routing_agreement(recorded, native.routes()).router_agreement,
        "with_replay": routing_agreement(recorded, forced.routes()).router_agreement,
    }


def pinned_read(tokens: int) -> dict:
    """Read Qwen3-30B-A3B-shaped routes into pinned memory, copy them to the GPU."""
    layout = layout_of_model("qwen3-30b-a3b")
    rng = np.random.default_rng(0)
    name = f"gpu-check-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(name, layout, capacity_tokens=tokens + 1024) as store:
        routes = layout.random_routes(rng, tokens, np.uint8)
        ref = store.put("s0", routes)
        out = torch.empty(tokens * layout.bytes_per_token, dtype=torch.uint8, pin_memory=True)
        t0 = time.perf_counter()
        host = to_torch(store.read([ref], out=out))
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        on_device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        copy_s = time.perf_counter() - t0
        equal = bool(np.array_equal(on_device.cpu().numpy(), store.get(ref)))
        store.unlink()
    nbytes = tokens * layout.bytes_per_token
    return {
        "ok": equal and host.data_ptr() == out.data_ptr(),
        "bytes": nbytes,
        "read_s": read_s,
        "h2d_s": copy_s,
        "h2d_gib_s": nbytes / copy_s / 2**30,
    }


def replay_cost(device: str, batch: int, seq: int, pairs: int) -> dict:
    """A training step with and without replay of the model's own routes (same experts)."""
    model = tiny_moe(0, torch.float32).to(device).train()
    ids = torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(2))
    ids = ids.to(device)
    with capture(model) as cap, torch.no_grad():
        model(input_ids=ids)
    routes = torch.from_numpy(np.stack(cap.routes()).astype(np.int16))
    layout = RoutingLayout.from_hf_config(model.config)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        model(input_ids=ids).logits.float().mean().backward()

    def plain() -> None:  # each ends synchronized: the next starts on an idle device
        step()
        sync()

    def with_replay() -> None:
        with replay(model, routes, layout=layout):
            step()
        sync()

    a, b = paired(plain, with_replay, pairs)  # its warm-up prepares the model
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    return {"device": device, "batch": batch, "seq": seq, "overhead": statistics.median(ratios) - 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir())
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }
    rows: list[tuple[str, str, bool | None]] = []  # (part, result, ok; None: skipped)
    result: dict = {"env": env}
    if cuda:
        result["cuda_tests"] = t = cuda_tests()
        rows.append(("CUDA tests (pytest -m cuda)", t["summary"], t["ok"]))
    else:
        rows.append(("CUDA tests (pytest -m cuda)", "skipped: no CUDA", None))
    prompts, new = (4, 8) if args.quick else (16, 64)
    result["agreement"] = a = agreement(device, prompts, new)
    rows.append((
        f"bf16 engine -> fp32 trainer ({device})",
        f"agreement {a['without_replay']:.4f} natively, {a['with_replay']:.4f} with replay "
        f"({a['tokens']} tokens)",
        a["with_replay"] == 1.0,
    ))  # fmt: skip
    if cuda:
        result["pinned_read"] = p = pinned_read(32_768 if args.quick else 131_072)
        rows.append((
            "pinned read + non-blocking copy",
            f"{p['bytes'] / 2**20:.0f} MiB: read {p['read_s'] * 1e3:.1f} ms, to GPU "
            f"{p['h2d_s'] * 1e3:.1f} ms ({p['h2d_gib_s']:.1f} GiB/s), equal: {p['ok']}",
            p["ok"],
        ))  # fmt: skip
    else:
        rows.append(("pinned read + non-blocking copy", "skipped: no CUDA", None))
    batch, seq, pairs = (2, 32, 3) if args.quick else (8, 512, 11)
    result["replay_cost"] = c = replay_cost(device, batch, seq, pairs)
    rows.append((
        f"replay cost, training step ({device})",
        f"{c['overhead']:+.1%} ({batch} x {seq} tokens, median of {pairs} pairs)",
        True,
    ))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"GPU check: torch {env['torch']}, CUDA {env['cuda']}, {env['gpu'] or 'no GPU'}")
    for part, text, ok in rows:
        mark = "skip" if ok is None else ("ok" if ok else "FAIL")
        print(f"| {part:{width}} | {mark:4} | {text} |")
    result["rows"] = [{"part": p, "result": t, "ok": o} for p, t, o in rows]
    path = Path(args.out) / "gpu_check.json"
    write_json(path, result, indent=2)
    print(f"wrote {path}")
    return 1 if any(ok is False for _, _, ok in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
