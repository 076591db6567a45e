"""Tolerance mode and replay's metrics, at the experts (Qwen3-MoE: softmax scores; DeepSeek-V3:
sigmoid scores with a selection bias and group limit, which only choose)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compiling import Graphs, reset_dynamo
from moe_models import tiny_model
from tiny_families import random_routes

from routing_replay import capture, replay
from routing_replay.errors import InvalidArgumentError
from routing_replay.model.adapters import find_routers
from routing_replay.validate import MISSING

B, S = 2, 8
FAMILIES = ["qwen3_moe", "deepseek_v3"]


def batch(seed: int) -> torch.Tensor:
    return torch.randint(3, 90, (B, S), generator=torch.Generator().manual_seed(seed))


def spy(model):
    """Per MoE layer: the ids its experts get, and its router's live (logits, native ids)."""
    calls, handles = [], []
    for router in find_routers(model).routers:
        parent = model.get_submodule(router.name.rsplit(".", 1)[0])
        seen = {}
        calls.append(seen)

        def experts_hook(module, args, seen=seen):
            seen["ids"] = args[1].clone()

        def router_hook(module, args, out, seen=seen):
            with torch.no_grad():  # the router's own choice, bypassing replay
                native = type(module).forward(module, *args)
            seen["logits"], seen["native"] = native[0].clone(), native[2].clone()

        handles.append(parent.experts.register_forward_pre_hook(experts_hook))
        handles.append(router.module.register_forward_hook(router_hook))
    return calls, handles


def scores_of(family: str, logits_TE: torch.Tensor) -> torch.Tensor:
    """The trainer's score of every expert, written from transformers' routers."""
    if family == "qwen3_moe":
        return torch.softmax(logits_TE.float(), dim=-1)
    return logits_TE.sigmoid()


@pytest.mark.parametrize("family", FAMILIES)
def test_own_routes_with_full_tolerance_replace_nothing_and_agree(family):
    model = tiny_model(family)
    input_ids = batch(1)
    with capture(model) as cap, torch.no_grad():
        native = model(input_ids=input_ids).logits
    routes = torch.from_numpy(np.stack(cap.routes()))
    with replay(model, routes, layout=cap.layout, tolerance=1.0) as block, torch.no_grad():
        replayed = model(input_ids=input_ids).logits
    assert torch.equal(native, replayed)
    layers = cap.layout.num_moe_layers
    assert block.metrics() == {
        "replay/rows_replayed": B * S * layers,
        "replay/rows_missing": 0,
        "replay/native_agreement": 1.0,
        "replay/replace_rate": 0.0,
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ratio", [0.3, 0.9])
def test_slots_below_the_ratio_are_refilled_from_the_trainers_top_k(family, ratio):
    model = tiny_model(family)
    layout = find_routers(model).layout
    routes = random_routes(layout, seed=2, missing=0.25)
    calls, handles = spy(model)
    try:
        with replay(model, routes, layout=layout, tolerance=ratio) as block, torch.no_grad():
            model(input_ids=batch(3))
    finally:
        for handle in handles:
            handle.remove()
    flat = routes.reshape(B * S, layout.num_moe_layers, layout.top_k).tolist()
    forced_rows = refilled = agreed = 0
    for j, seen in enumerate(calls):
        scores = scores_of(family, seen["logits"]).tolist()
        for t in range(B * S):
            recorded, native = flat[t][j], seen["native"][t].tolist()
            got = seen["ids"][t].tolist()
            if recorded[0] == MISSING:
                assert got == native  # routes natively
                continue
            forced_rows += 1
            agreed += sorted(recorded) == sorted(native)
            weakest = min(scores[t][e] for e in native)
            kept = [e if scores[t][e] >= ratio * weakest else None for e in recorded]
            spare = [e for e in sorted(native, key=lambda e: -scores[t][e]) if e not in kept]
            want = [e if e is not None else spare.pop(0) for e in kept]
            assert got == want, (j, t)
            refilled += kept.count(None)
    metrics = block.metrics()
    assert metrics["replay/rows_replayed"] == forced_rows
    assert metrics["replay/rows_missing"] == B * S * layout.num_moe_layers - forced_rows
    assert metrics["replay/native_agreement"] == agreed / forced_rows
    assert metrics["replay/replace_rate"] == refilled / (forced_rows * layout.top_k)
    assert 0 < refilled < forced_rows * layout.top_k  # the ratio bites, and not everywhere


@pytest.mark.parametrize("tolerance", [0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_a_tolerance_outside_0_1_is_refused(tolerance):
    model = tiny_model("qwen3_moe")
    layout = find_routers(model).layout
    with pytest.raises(InvalidArgumentError, match="ratio in \\(0, 1\\]"):
        replay(model, random_routes(layout, 0, 0.0), layout=layout, tolerance=tolerance)


@pytest.mark.slow
def test_tolerance_under_compile_refills_as_eager():
    model = tiny_model("deepseek_v3")
    layout = find_routers(model).layout
    routes = random_routes(layout, seed=4, missing=0.25)
    input_ids = batch(5)
    results = []
    reset_dynamo()
    graphs = Graphs()
    for fn in (model, torch.compile(model, backend=graphs)):
        calls, handles = spy(model)
        try:
            with replay(model, routes, layout=layout, tolerance=0.6) as block, torch.no_grad():
                fn(input_ids=input_ids)
        finally:
            for handle in handles:
                handle.remove()
        results.append(([c["ids"] for c in calls], block.metrics()))
    (eager_ids, eager_m), (compiled_ids, compiled_m) = results
    assert all(torch.equal(a, b) for a, b in zip(eager_ids, compiled_ids, strict=True))
    assert graphs.count > 0
    assert eager_m == compiled_m and eager_m["replay/replace_rate"] > 0
