"""Replay under FSDP2 (`fully_shard`) on two gloo CPU ranks, with activation checkpointing.

Two spawned processes (tests/fsdp_ranks.py) each train their own data shard, two
micro-batches of gradient accumulation, `with replay(model, routes): loss = ...;
(loss / 2).backward()`, on a tiny transformers MoE model sharded per decoder layer and then
at the root. Their losses and full gradients (`grad.full_tensor()`) must equal those of the
same model, unsharded and without checkpointing, replaying the same routes on the same four
micro-batches here, gradients averaged over the ranks as FSDP2 reduces them. The ids that
reached the experts are checked where the experts module is called (a forward pre-hook on
each MoE layer's `experts`, in the ranks), for the forward and for the checkpoint recompute.
"""

from __future__ import annotations

import functools
import multiprocessing as mp

import fsdp_ranks
import numpy as np
import pytest
import torch
import torch.distributed as dist
from fsdp_ranks import MICRO, WORLD, micro_batch
from moe_models import tiny_model

from routing_replay import RoutingLayout, capture, replay
from routing_replay.model.adapters import find_routers

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="needs torch.distributed gloo",
    ),
]

# Replayed FSDP2 runs that must equal the unsharded replayed model.
EQUAL = {
    "qwen3_moe-transformers_ckpt": dict(family="qwen3_moe", ckpt="transformers"),
    "qwen3_moe-transformers_ckpt_reentrant": dict(
        family="qwen3_moe", ckpt="transformers", ckpt_kwargs={"use_reentrant": True}
    ),
    "qwen3_moe-torch_ckpt_wrapper": dict(family="qwen3_moe", ckpt="torch"),
    "deepseek_v3-transformers_ckpt": dict(family="deepseek_v3", ckpt="transformers"),
    "gpt_oss-transformers_ckpt": dict(family="gpt_oss", ckpt="transformers"),
}
# Backward after the replay block exits: the recompute routes natively.
OUTSIDE = {
    "outside-reentrant": dict(
        family="qwen3_moe", ckpt="transformers", ckpt_kwargs={"use_reentrant": True}
    ),
    "outside-non_reentrant": dict(family="qwen3_moe", ckpt="transformers"),
}
CASES = {
    **{n: {**c, "backward": "inside"} for n, c in EQUAL.items()},
    **{n: {**c, "backward": "outside"} for n, c in OUTSIDE.items()},
}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case, run by the two ranks (one pair of processes): results by case, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('fsdp') / 'process-group'}"
    procs = [
        ctx.Process(target=fsdp_ranks.run, args=(rank, init, CASES, results))
        for rank in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        got = sorted((results.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return {
        name: [r["cases"].get(name, {"error": "not run: an earlier case failed"}) for r in got]
        for name in CASES
    }


def ranks_of(sharded, name: str) -> list[dict]:
    errors = [r["error"] for r in sharded[name] if "error" in r]
    assert not errors, "\n".join(errors)
    return sharded[name]


@functools.cache
def reference(family: str) -> dict:
    """The unsharded model, no checkpointing, replaying every rank's micro-batches.

    losses and experts_ids (per MoE layer, what its experts module received) by (rank,
    micro-batch); fsdp_order: the gradients averaged over ranks in FSDP2's order (per
    micro-batch a reduce-scatter, the ranks' sum over the world size; the results summed
    micro-batch by micro-batch); accumulated: plain accumulation over the four micro-batches
    (another order); routers: the names of the router weights.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: the same CPU kernels
    try:
        model = tiny_model(family).train()
        layout = RoutingLayout.from_hf_config(model.config)
        seen: list[list[np.ndarray]] = [[] for _ in range(layout.num_moe_layers)]
        for j, block in enumerate(fsdp_ranks.moe_blocks(model)):
            block.experts.register_forward_pre_hook(
                lambda m, args, j=j: seen[j].append(args[1].detach().numpy().copy())
            )
        losses, experts_ids, grads, accumulated = {}, {}, {}, {}
        for rank in range(WORLD):
            for mb in range(MICRO):
                input_ids, routes = micro_batch(rank, mb, layout)
                model.zero_grad(set_to_none=True)
                with replay(model, routes, layout=layout):
                    loss = model(input_ids=input_ids, labels=input_ids).loss
                    (loss / MICRO).backward()
                losses[rank, mb] = loss.detach()
                experts_ids[rank, mb] = [calls.pop() for calls in seen]
                grads[rank, mb] = {
                    n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
                }
                for n, g in grads[rank, mb].items():
                    accumulated[n] = accumulated.get(n, 0) + g / WORLD
        fsdp_order = {}
        for n in grads[0, 0]:
            fsdp_order[n] = (grads[0, 0][n] + grads[1, 0][n]) / WORLD
            for mb in range(1, MICRO):
                fsdp_order[n] = fsdp_order[n] + (grads[0, mb][n] + grads[1, mb][n]) / WORLD
        routers = [
            f"{r.name}.{n}"
            for r in find_routers(model).routers
            for n, p in r.module.named_parameters()
            if p.dim() == 2
        ]
        return dict(
            losses=losses,
            experts_ids=experts_ids,
            fsdp_order=fsdp_order,
            accumulated=accumulated,
            routers=routers,
        )
    finally:
        torch.set_num_threads(threads)


def assert_bitwise(got: np.ndarray, expected: torch.Tensor, what) -> None:
    expected = expected.numpy()
    assert got.shape == expected.shape, what
    diff = np.abs(got.astype(np.float64) - expected).max(initial=0.0)
    assert np.array_equal(got, expected), f"{what}: not bitwise equal, max |diff| {diff:.3e}"


def check_forced(rank_result: dict, layout: RoutingLayout, recompute_forced: bool = True):
    """Every experts call received the routes' ids on the rows that have routes."""
    calls = rank_result["calls"]
    assert len(calls) == layout.num_moe_layers
    recompute_differs = []
    for j, layer_calls in enumerate(calls):
        assert len(layer_calls) == 2 * MICRO  # per micro-batch: forward, recompute in backward
        for mb in range(MICRO):
            _, routes = micro_batch(rank_result["rank"], mb, layout)
            flat = routes.reshape(-1, layout.num_moe_layers, layout.top_k)[:, j].numpy()
            have = (flat != -1).all(-1)
            assert 0 < have.sum() < len(have)  # forced rows and native-fallback rows
            forward, recompute = layer_calls[2 * mb], layer_calls[2 * mb + 1]
            assert np.array_equal(forward[have], flat[have]), (rank_result["rank"], mb, j)
            if recompute_forced:
                assert np.array_equal(recompute, forward), (rank_result["rank"], mb, j)
            else:
                recompute_differs.append(not np.array_equal(recompute[have], flat[have]))
    return recompute_differs


def native_disagreement(family: str, rank: int, mb: int) -> float:
    """Fraction of forced (token, layer) rows whose routes differ from native routing."""
    model = tiny_model(family)
    layout = RoutingLayout.from_hf_config(model.config)
    input_ids, routes = micro_batch(rank, mb, layout)
    with capture(model) as cap, torch.no_grad():
        model(input_ids=input_ids)
    native = torch.from_numpy(np.stack(cap.routes())).long().sort(-1).values
    forced = routes.long().sort(-1).values
    have = (routes != -1).all(-1)
    return float((native != forced).any(-1)[have].float().mean())


@pytest.mark.parametrize("name", list(EQUAL))
def test_fsdp2_replay_equals_unsharded_replay(sharded, name):
    family = EQUAL[name]["family"]
    got = ranks_of(sharded, name)
    ref = reference(family)
    layout = RoutingLayout.from_hf_config(tiny_model(family).config)

    # The routes are not what the model would choose anyway.
    assert native_disagreement(family, 0, 0) > 0.5
    for r in got:
        assert r["warnings"] == []
        # Forward and recompute, on every rank and MoE layer, received the forced ids...
        check_forced(r, layout)
        for mb in range(MICRO):
            # ... and the rows without routes (native fallback) chose as unsharded.
            for j, ids in enumerate(ref["experts_ids"][r["rank"], mb]):
                assert np.array_equal(r["calls"][j][2 * mb], ids), (r["rank"], mb, j)
            # Each micro-batch's loss: bitwise (all-gathered parameters, the same kernels).
            assert_bitwise(r["losses"][mb], ref["losses"][r["rank"], mb], ("loss", r["rank"], mb))
    grads = got[0]["grads"]
    assert grads.keys() == ref["fsdp_order"].keys()
    for param, grad in grads.items():
        # Bitwise when summed in FSDP2's order: with two ranks, the sum over ranks and the
        # division by 2 are exact; the micro-batches accumulate in the same order.
        assert_bitwise(grad, ref["fsdp_order"][param], param)
        # Plain accumulation over the four micro-batches sums in another order: rounding.
        torch.testing.assert_close(
            torch.from_numpy(grad), ref["accumulated"][param], rtol=1e-5, atol=1e-8, msg=param
        )
    for param in ref["routers"]:
        assert np.abs(grads[param]).sum() > 0, param


def test_fsdp2_backward_outside_replay_reentrant_gives_other_gradients(sharded):
    """Reentrant checkpointing, backward after the block: the recompute routes natively.

    The forward replayed (its losses are right), the recompute in backward did not, and
    nothing stops the backward: the gradients are silently those of other experts. (replay
    does not warn here: it counts the forwards that run with grad enabled, and a reentrant
    checkpoint runs its forward under no_grad.)
    """
    got = ranks_of(sharded, "outside-reentrant")
    ref = reference("qwen3_moe")
    layout = RoutingLayout.from_hf_config(tiny_model("qwen3_moe").config)
    for r in got:
        assert r["checkpoint_error"] is None
        assert all(check_forced(r, layout, recompute_forced=False))
        for mb in range(MICRO):
            assert_bitwise(r["losses"][mb], ref["losses"][r["rank"], mb], ("loss", r["rank"], mb))
    grads, expected = got[0]["grads"], ref["fsdp_order"]
    assert grads.keys() == expected.keys()
    for param in ref["routers"]:
        assert not np.allclose(grads[param], expected[param].numpy(), rtol=1e-3, atol=0), param
    # The experts weights too: other experts received the tokens in the recompute.
    experts = [p for p in grads if ".mlp.experts." in p]
    assert experts and all(not np.allclose(grads[p], expected[p].numpy()) for p in experts)


def test_fsdp2_backward_outside_replay_non_reentrant_warns_and_fails(sharded):
    """Non-reentrant checkpointing, backward after the block: replay warns at each exit, and
    the recompute routes natively, so torch's check of the recomputed tensors raises
    CheckpointError (native routing saves other tensors) or, if it did not, the gradients
    are those of other experts."""
    got = ranks_of(sharded, "outside-non_reentrant")
    for r in got:
        assert len(r["warnings"]) == len(r["losses"])  # one per micro-batch run
        assert all("inside the `with replay" in w for w in r["warnings"])
    if got[0]["checkpoint_error"] is not None:
        assert all("torch.utils.checkpoint" in r["checkpoint_error"] for r in got)
    else:
        ref = reference("qwen3_moe")
        grads = got[0]["grads"]
        assert any(
            not np.allclose(grads[p], ref["fsdp_order"][p].numpy(), rtol=1e-3, atol=0)
            for p in ref["routers"]
        )
