"""Cost of capture and replay, as ratios to the plain model measured in the same process.

    python benchmarks/overhead.py            # 8 prompts x (32 + 64 new) tokens; train 8 x 96
    python benchmarks/overhead.py --quick    # fewer repeats and tokens
    python benchmarks/overhead.py --models gemma4,nemotron_h,llama4   # families of issue 32

- capture: `model.generate` (KV cache, greedy, fixed length) with and without `capture`,
  including the `cap.routes()` call that aligns and returns the per-sample arrays.
- replay: one training step (forward + backward, train mode) with and without
  `replay(model, routes)` of the model's own routes (so the experts' work is the same),
  including building the context (validation of the routes). The first replay block
  prepares the model for good (a forward on each router that routes natively outside a
  block); the cost of that on native steps is measured too, against a copy never prepared.
- replay device bytes/token: what a `replay` block holds on the routers' device for the
  batch, summed over the actual tensors it keeps, at the Qwen3-30B-A3B routing shape
  (48 MoE layers, top-8 of 128 experts; a model with that routing and tiny layers).

Runs come in adjacent pairs (plain, with; then with, plain), so drift and other load hit
both; the overhead is the median per-pair ratio minus one (ratios of medians and of minima
are reported too). On a shared machine that end-to-end figure is noisy (±1-2%), so the
share of wall time spent inside routing_replay's own code (its hooks, setup and routes(),
timed from the inside; not PyTorch's hook dispatch, nor the backward of replay's few
weight ops) is reported as well ("own code"). Writes benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import RESULTS, machine, paired, timed, write_json
from tiny_moe import MODELS, MORE_MODELS, VOCAB, build

from routing_replay import RoutingLayout, capture, replay, with_layout
from routing_replay.model.capture import Capture, _Recorder
from routing_replay.model.replay import Replay
from routing_replay.testing import seeded_moe, tiny_moe_config

forcing_module = sys.modules["routing_replay.model.forcing"]


class LibraryClock:
    """Accumulates wall time spent inside routing_replay's own code (hooks, setup, routes()).

    `model`: a model prepared for replay, whose decoder hooks are timed too (they are
    registered functions, so they are wrapped where they are registered).
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.seconds = 0.0
        self.model = model
        self._patches: list[tuple[object, str, object]] = []
        self._hooks: list[tuple[dict, int, object]] = []

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def __enter__(self) -> LibraryClock:
        for owner, name, wrap in (
            (Capture, "__init__", self._timed),
            (Capture, "_begin", self._timed),
            (Capture, "_end", self._timed),
            (Capture, "routes", self._timed),
            (_Recorder, "__call__", self._timed),  # a router's hook, per router call
            (Replay, "__init__", self._timed),
            (Replay, "__enter__", self._timed),
            (Replay, "__exit__", self._timed),
            (forcing_module, "_force", self._timed),  # the forced ids, per router call
        ):
            original = owner.__dict__[name]
            self._patches.append((owner, name, original))
            setattr(owner, name, wrap(original))
        # The decoder's checks (batch shape before, every router called after) of a prepared
        # model. The router forwards' own part is `_force` (the rest is the model's forward).
        state = self._state()
        if state is not None:
            for handle in state.handles:
                for hooks in (
                    state.moe.decoder._forward_pre_hooks,
                    state.moe.decoder._forward_hooks,
                ):
                    if handle.id in hooks:
                        self._hooks.append((hooks, handle.id, hooks[handle.id]))
                        hooks[handle.id] = self._timed(hooks[handle.id])
        return self

    def _state(self):
        if self.model is None:
            return None
        for module in self.model.modules():
            state = module.__dict__.get("_routing_replay_state")
            if state is not None:
                return state
        return None

    def __exit__(self, *exc) -> None:
        for hooks, key, original in reversed(self._hooks):
            hooks[key] = original
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)


def alternate(plain, with_lib, repeat: int, model=None) -> dict:
    """Time plain() and with_lib() in adjacent pairs after a warm-up; overhead = median ratio - 1.

    The median of per-pair ratios is robust to load drifting during the run (other processes
    on a shared machine); medians and minima of each side are reported too.
    """
    a, b = paired(plain, with_lib, repeat)
    own = []
    for _ in range(repeat):  # time inside routing_replay's code, as a share of a plain run
        with LibraryClock(model) as clock:
            (total,) = timed(with_lib)
        own.append(clock.seconds / total)
    return {
        "own_code_share": statistics.median(own),
        "plain_s": statistics.median(a),
        "with_s": statistics.median(b),
        "overhead": statistics.median(y / x for x, y in zip(a, b, strict=True)) - 1,
        "overhead_of_medians": statistics.median(b) / statistics.median(a) - 1,
        "overhead_of_minima": min(b) / min(a) - 1,
        "repeat": repeat,
    }


def capture_overhead(model, prompts: int, prompt_len: int, new: int, repeat: int) -> dict:
    input_ids = torch.randint(3, VOCAB, (prompts, prompt_len))
    kwargs = dict(
        input_ids=input_ids,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )

    def plain():
        with torch.no_grad():
            model.generate(**kwargs)

    def with_capture():
        with capture(model) as cap, torch.no_grad():
            model.generate(**kwargs)
        routes = cap.routes()
        assert len(routes) == prompts and len(routes[0]) == prompt_len + new

    return alternate(plain, with_capture, repeat)


def replay_overhead(model, batch: int, seq: int, repeat: int) -> dict:
    input_ids = torch.randint(3, VOCAB, (batch, seq))
    # Replay the model's own routes, so the experts do the same work with and without replay
    # and the difference is the library's cost alone.
    unprepared = copy.deepcopy(model).train()  # before any replay: never prepared
    with capture(model) as cap, torch.no_grad():
        model(input_ids=input_ids)
    routes = with_layout(torch.from_numpy(np.stack(cap.routes())), cap.layout)
    routes[:, -1] = -1  # the last token of each sample: never forwarded at rollout
    model.train()

    def step_of(m):
        def step():
            m.zero_grad(set_to_none=True)
            m(input_ids=input_ids, labels=input_ids).loss.backward()

        return step

    step = step_of(model)

    def step_with_replay():
        with replay(model, routes):
            step()

    try:
        result = alternate(step, step_with_replay, repeat, model=model)
        # The model is prepared now: its native steps run replay's inactive router forwards.
        a, b = paired(step_of(unprepared), step, repeat)
        result["prepared_native_vs_unprepared"] = (
            statistics.median(y / x for x, y in zip(a, b, strict=True)) - 1
        )
        return result
    finally:
        model.eval()


def qwen3_30b_a3b_routing() -> torch.nn.Module:
    """Qwen3-30B-A3B's routing (48 MoE layers, top-8 of 128 experts) on tiny layers."""
    config = tiny_moe_config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=16,
        moe_intermediate_size=4,
        num_hidden_layers=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=128,
        num_experts_per_tok=8,
    )
    return seeded_moe(config, router_std=None)


def held_device_bytes(block) -> int:
    """Bytes of every tensor a replay block keeps for its batch (its per-device routes)."""
    return sum(
        value.numel() * value.element_size()
        for routes in block._on_device.values()
        for value in (getattr(routes, f.name) for f in dataclasses.fields(routes))
        if isinstance(value, torch.Tensor)
    )


def replay_device_bytes(tokens: int) -> dict:
    """Device bytes per token a replay block holds, inside it and after it, at Qwen3-30B-A3B."""
    model = qwen3_30b_a3b_routing()
    layers, top_k, experts = 48, 8, 128
    g = torch.Generator().manual_seed(0)
    keys = torch.rand(tokens, layers, experts, generator=g)
    routes = keys.argsort(dim=-1)[..., :top_k].to(torch.int32)[None]  # as capture returns them
    block = Replay(model, routes, layout=RoutingLayout.from_hf_config(model.config))
    with block:
        inside = held_device_bytes(block)
        dtypes = sorted(
            {
                str(getattr(r, f.name).dtype)
                for r in block._on_device.values()
                for f in dataclasses.fields(r)
            }
        )
    after = held_device_bytes(block)
    # Before 10197fc a block held the ids as int64 plus a [T, L] bool missing mask, for the
    # whole block and after it: the same tensors in those dtypes.
    wide = routes.numel() * torch.int64.itemsize + routes[..., 0].numel()
    return {
        "shape": f"{layers} MoE layers, top-{top_k}, {experts} experts",
        "tokens": tokens,
        "bytes_per_token": inside / tokens,
        "bytes_per_token_after_exit": after / tokens,
        "bytes_per_token_int64_before": wide / tokens,
        "dtypes": dtypes,
    }


def main() -> None:
    """Measure both overheads for both tiny models; print and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, of {sorted({**MODELS, **MORE_MODELS})}",
    )
    args = parser.parse_args()
    names = args.models.split(",")
    if args.quick:
        prompts, prompt_len, new, seq, repeat = 4, 16, 16, 48, 3
    else:
        prompts, prompt_len, new, seq, repeat = 8, 32, 64, 96, 21
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]  # other processes on the machine skew the end-to-end ratio
    results = {}
    for name in names:
        model = build(name)
        results[name] = {
            "capture_vs_generate": capture_overhead(model, prompts, prompt_len, new, repeat),
            "replay_vs_forward_backward": replay_overhead(model, prompts, seq, repeat),
        }
    memory = replay_device_bytes(tokens=1024)
    print(
        f"{'model':12} {'what':28} {'plain s':>9} {'with s':>9} {'overhead':>9} "
        f"{'of medians':>11} {'of minima':>10} {'own code':>9}"
    )
    for name, res in results.items():
        for what, r in res.items():
            print(
                f"{name:12} {what:28} {r['plain_s']:>9.3f} {r['with_s']:>9.3f} "
                f"{r['overhead']:>+9.2%} {r['overhead_of_medians']:>+11.2%} "
                f"{r['overhead_of_minima']:>+10.2%} {r['own_code_share']:>9.2%}"
            )
        prepared = res["replay_vs_forward_backward"].get("prepared_native_vs_unprepared")
        if prepared is not None:
            print(f"{name:12} {'native step, prepared model':28} {'':>9} {'':>9} {prepared:>+9.2%}")
    print(
        f"replay device bytes/token ({memory['shape']}): {memory['bytes_per_token']:.0f} "
        f"inside the block ({', '.join(memory['dtypes'])}), "
        f"{memory['bytes_per_token_after_exit']:.0f} after it; int64 ids and mask (before): "
        f"{memory['bytes_per_token_int64_before']:.0f}, also after it"
    )
    report = {
        "setup": {
            "prompts": prompts,
            "prompt_len": prompt_len,
            "new_tokens": new,
            "train_seq": seq,
            "dtype": "float32",
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "load_average_before_after": [load_before, os.getloadavg()[0]],
        },
        "machine": machine(),
        "models": results,
        "replay_device_memory": memory,
    }
    stem = "overhead" if names == list(MODELS) else "overhead-" + "-".join(names)
    path = RESULTS / (stem + ("-quick.json" if args.quick else ".json"))
    write_json(path, report, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
