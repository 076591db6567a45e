"""The feed into a real megatron-core `TopKRouter` / `RouterReplay`, on CPU: 0.16.1 in the main
suite (Python < 3.12), 0.19.2 by `.ci/newest` (0.17+ need Python >= 3.12).

Two adjustments let Megatron's router run without CUDA or Transformer Engine: a
`gating()` that keeps the weights where they are (Megatron's moves them to CUDA), and
`moe_utils.te_general_gemm = None` when Transformer Engine is absent. One-rank gloo group.
"""

from __future__ import annotations

import uuid
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install megatron-core (extra: megatron)")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.router_replay import (  # noqa: E402
    RouterReplay,
    RouterReplayAction,
)
from megatron_cpu import B, H, S, allgather_moe_layers, config, cpu_gating  # noqa: E402

from routing_replay import RoutingLayout  # noqa: E402
from routing_replay.errors import InvalidRoutesError, LayoutMismatchError  # noqa: E402
from routing_replay.integrations.megatron import MegatronRouterFeed, replay_mask, stage_moe_layers  # noqa: E402
from routing_replay.integrations.nemo_rl import cp_slice, pack  # noqa: E402

# 4 layers, layer 1 dense; top-2 of 8 experts (megatron_cpu.config). Hidden 16.
LAYOUT = RoutingLayout(num_layers=4, top_k=2, num_experts=8, moe_layers=(0, 2, 3))


@pytest.fixture(scope="module", autouse=True)
def one_rank_megatron_on_cpu():
    """One-rank gloo group, model parallel (1, 1), and the two CPU adjustments."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = TopKRouter.gating
    TopKRouter.gating = cpu_gating
    started = not dist.is_initialized()
    if started:
        init = f"file:///tmp/rr-mcore-{uuid.uuid4().hex}"
        dist.init_process_group("gloo", init_method=init, world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()
    TopKRouter.gating = original
    RouterReplay.clear_global_router_replay_instances()


def build_stage(cfg: TransformerConfig, moe_layers: list[int]) -> torch.nn.ModuleList:
    """The routers of one pipeline stage, in build order, as Megatron's MoE layers make them."""
    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    return torch.nn.ModuleList(TopKRouter(cfg, pg) for _ in moe_layers)


def distinct_routes(seed: int = 0) -> torch.Tensor:
    """[B, S, L=3, K=2] routes, distinct ids per row, different per (b, s, layer)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(B * S * 3)]).view(
        B, S, 3, 2
    )


def test_forced_ids_reach_routing_map_probs_follow_live_scores_grads_flow():
    cfg = config()
    routers = build_stage(cfg, [0, 2, 3])
    feed = MegatronRouterFeed(LAYOUT, cfg, model=routers)
    routes = distinct_routes()
    feed.set(routes)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))  # Megatron: [S, B, H]
    for j, router in enumerate(routers):
        router.zero_grad()
        probs, routing_map = router(x)
        want = routes[:, :, j].transpose(0, 1).reshape(S * B, 2)  # row s*B + b
        got = routing_map.nonzero()[:, 1].view(S * B, 2)
        assert torch.equal(got, want.sort(-1).values)
        # probs: softmax over the live logits at the forced ids (topk-then-softmax).
        weight = router.weight.detach().clone().requires_grad_(True)
        bias = router.bias.detach().clone().requires_grad_(True)  # add_bias_linear=True
        logits = x.reshape(-1, H) @ weight.t() + bias
        ref = torch.softmax(logits.gather(1, want), -1)
        assert torch.allclose(probs.gather(1, want), ref, atol=1e-6)
        coef = torch.arange(1.0, 1 + 8).expand(S * B, 8)
        (probs * coef).sum().backward()
        (ref * coef.gather(1, want)).sum().backward()
        assert router.weight.grad.abs().sum() > 0
        assert torch.allclose(router.weight.grad, weight.grad, atol=1e-6)
        assert torch.allclose(router.bias.grad, bias.grad, atol=1e-6)
    feed.close()


def test_pipeline_stage_takes_its_layers_and_skips_dense():
    assert stage_moe_layers(LAYOUT, 0, 2) == [0]
    assert stage_moe_layers(LAYOUT, 1, 3) == [2, 3]
    cfg = config()
    routers = build_stage(cfg, [2, 3])  # stage 2 of 2: layers 2 and 3
    feed = MegatronRouterFeed(LAYOUT, cfg, layer_offset=2, num_local_layers=2, model=routers)
    routes = distinct_routes(1)
    tensors = feed.tensors(routes)
    assert [t.dtype for t in tensors] == [torch.int64, torch.int64]
    for t, column in zip(tensors, [1, 2], strict=True):
        assert torch.equal(t, routes[:, :, column].transpose(0, 1).reshape(-1, 2))
    feed.close()


def filler(i: int) -> list[int]:
    """fill_missing's ids for the i-th filled row, E=8, K=2: i and i + E/K, mod E."""
    return [i % 8, (i + 4) % 8]


def test_replay_mask_marks_real_tokens_but_each_final_one():
    assert replay_mask([3, 5, 0], 5).tolist() == [
        [True, True, False, False, False],
        [True, True, True, True, False],
        [False] * 5,
    ]
    assert replay_mask([3, 5], 5, replay_final=True).tolist() == [
        [True, True, True, False, False],
        [True] * 5,
    ]
    # Packed: sequences of 3 and 2 tokens, each padded to 4 (nemo_rl.pack(multiple=4)).
    packed = pack(
        {"input_ids": torch.ones(2, 5, dtype=torch.long), "input_lengths": [3, 2]}, multiple=4
    )
    lengths = packed["cu_seqlens_unpadded"].diff()
    mask = replay_mask(lengths, cu_seqlens=packed["cu_seqlens"])
    assert mask.tolist() == [[True, True, False, False, True, False, False, False]]
    with pytest.raises(InvalidRoutesError, match=r"input_lengths must be in \[0, 5\]"):
        replay_mask([6], 5)
    with pytest.raises(InvalidRoutesError, match="one padded boundary per sequence"):
        replay_mask([3, 2], cu_seqlens=[0, 2, 8])
    with pytest.raises(ValueError, match="pass seq_len"):
        replay_mask([3])


def test_padding_and_final_tokens_get_filler_ids_real_tokens_are_kept():
    cfg = config()
    routers = build_stage(cfg, [0, 2, 3])
    feed = MegatronRouterFeed(LAYOUT, cfg, model=routers)
    routes = distinct_routes(2)  # [B=3, S=5, 3, 2]
    lengths = [5, 3, 4]  # right padding; each sample's final token has no routes
    for b, n in enumerate(lengths):
        routes[b, n - 1 :] = -1
    mask = replay_mask(lengths, S)
    tensors = feed.tensors(routes, replay_mask=mask)
    # Filled rows, counted row-major over (batch, position, layer), get fill_missing's ids.
    filled = [(b, s) for b in range(B) for s in range(S) if s >= lengths[b] - 1]
    for j, t in enumerate(tensors):
        got = t.view(S, B, 2)  # seq-major rows: s * B + b
        for b in range(B):
            for s in range(S):
                if s < lengths[b] - 1:
                    assert got[s, b].tolist() == routes[b, s, j].tolist()
                else:
                    i = filled.index((b, s)) * 3 + j  # 3 local MoE layers per token
                    assert got[s, b].tolist() == filler(i), (b, s, j)
    feed.close()


def test_real_token_without_routes_is_refused_unless_opted_in():
    cfg = config()
    routers = build_stage(cfg, [0, 2, 3])
    feed = MegatronRouterFeed(LAYOUT, cfg, model=routers)
    routes = distinct_routes(7)
    routes[:, -1] = -1  # every final token: fine
    routes[1, 2, 1] = -1  # a real token's layer-2 routes are missing: a gap
    mask = replay_mask([S] * B, S)
    refused = r"batch 1, position 2 has no route for layer 2, but replay_mask marks it as a real"
    with pytest.raises(InvalidRoutesError, match=refused):
        feed.tensors(routes, replay_mask=mask)
    with pytest.raises(InvalidRoutesError, match=refused):
        feed.set(routes, replay_mask=mask)
    assert feed._rows == []  # nothing was set
    # Opted in: that row gets filler ids too, in the same row-major count.
    tensors = feed.tensors(routes, replay_mask=mask, fill_real="filler")
    # Filled rows in order: (b=0, s=4) x 3 layers, (1, 2, layer 2), (1, 4) x 3, (2, 4) x 3.
    assert tensors[1].view(S, B, 2)[2, 1].tolist() == filler(3)
    assert tensors[0].view(S, B, 2)[2, 1].tolist() == routes[1, 2, 0].tolist()
    assert [t.view(S, B, 2)[4, 2].tolist() for t in tensors] == [filler(7), filler(8), filler(9)]
    # Without a mask, padding cannot be told from real tokens: any missing row is refused.
    with pytest.raises(InvalidRoutesError, match=r"batch 0, position 4 .* got no replay_mask"):
        feed.tensors(routes)
    assert torch.equal(torch.stack(feed.tensors(routes, fill_real="filler")), torch.stack(tensors))
    with pytest.raises(ValueError, match=r"'error' or 'filler'.*no per-row native"):
        feed.tensors(routes, replay_mask=mask, fill_real="native")
    with pytest.raises(InvalidRoutesError, match=r"replay_mask is \(3, 4\) but the routes"):
        feed.tensors(routes, replay_mask=mask[:, :4])
    with pytest.raises(InvalidRoutesError, match="only 0 and 1"):
        feed.tensors(routes, replay_mask=mask.long() * 2)
    feed.close()


def test_packed_cp_sliced_batch_mask_follows_the_routes():
    # Packed, CP=2: routes and mask sliced the same way; the final tokens are filled.
    cfg = config()
    routers = build_stage(cfg, [0, 2, 3])
    feed = MegatronRouterFeed(LAYOUT, cfg, model=routers)
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "input_lengths": [6, 3]}
    batch["routed_experts"] = distinct_routes(9).reshape(1, 15, 3, 2)[:, :12].reshape(2, 6, 3, 2)
    batch["routed_experts"][0, 5] = -1
    batch["routed_experts"][1, 2:] = -1  # final token, then padding
    packed = pack(batch, multiple=4)  # lengths 6 -> 8, 3 -> 4: T = 12
    mask = replay_mask(packed["cu_seqlens_unpadded"].diff(), cu_seqlens=packed["cu_seqlens"])
    cu = packed["cu_seqlens"]
    for rank in range(2):
        routes = cp_slice(packed["routed_experts"], 2, rank, cu_seqlens=cu)
        local_mask = cp_slice(mask, 2, rank, cu_seqlens=cu)
        tensors = feed.tensors(routes, replay_mask=local_mask)
        missing = (routes[0] == -1).any(-1)  # [T_local, 3]
        # Exactly the final tokens and padding lack routes (all layers), as the mask says.
        assert torch.equal(missing.all(-1), ~local_mask[0])
        assert torch.equal(missing.any(-1), missing.all(-1))
        i = 0
        for t in range(routes.shape[1]):
            for j in range(3):
                if missing[t, j]:
                    assert tensors[j][t].tolist() == filler(i), (rank, t, j)
                    i += 1
                else:
                    assert tensors[j][t].tolist() == routes[0, t, j].tolist()
        assert i == 3 * int((~local_mask).sum()) > 0
    gap = packed["routed_experts"].clone()
    gap[0, 2] = -1  # a real token of sequence 0, CP rank 1 holds it (chunk 1 of 4)
    local = cp_slice(gap, 2, 1, cu_seqlens=cu)
    with pytest.raises(InvalidRoutesError, match="batch 0, position 0 has no route for layer 0"):
        feed.tensors(local, replay_mask=cp_slice(mask, 2, 1, cu_seqlens=cu))
    feed.close()


def test_step_boundary_clears_the_recompute_queue_and_backward_replays():
    cfg = config()
    routers = build_stage(cfg, [0, 2, 3])
    feed = MegatronRouterFeed(LAYOUT, cfg, model=routers)
    first, second = distinct_routes(3), distinct_routes(4)
    feed.set(first)
    feed.set(second)  # two micro-batches: both queued for recompute
    assert [len(r.replay_backward_list) for r in RouterReplay.global_router_replay_instances] == [
        2,
        2,
        2,
    ]
    feed.backward()  # recompute of micro-batch 1 pops its routes first
    x = torch.randn(S, B, H)
    _, routing_map = routers[0](x)
    want = first[:, :, 0].transpose(0, 1).reshape(-1, 2).sort(-1).values
    assert torch.equal(routing_map.nonzero()[:, 1].view(-1, 2), want)
    feed.end_step()
    assert all(
        not r.replay_backward_list and r.target_topk_idx is None and r.router_replay_action is None
        for r in RouterReplay.global_router_replay_instances
    )
    feed.close()


def test_virtual_pipeline_chunks_each_replay_their_own_micro_batch():
    # Rank 0 of PP=2 x VPP=2 on the 4-layer model: chunk 0 is layer 0, chunk 1 is layer 2.
    # The interleaved schedule runs chunk 0 on micro-batches 0 and 1 before chunk 1 sees
    # micro-batch 0, so each chunk's feed is set when that chunk runs.
    cfg = config()
    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    chunks = [torch.nn.ModuleList([TopKRouter(cfg, pg)]) for _ in range(2)]
    for chunk, layer in zip(chunks, [0, 2], strict=True):
        chunk[0].set_layer_number(layer + 1)  # as TransformerLayer does: global, 1-based
    feeds = [
        MegatronRouterFeed(LAYOUT, cfg, layer_offset=o, num_local_layers=1, model=c)
        for o, c in zip([0, 2], chunks, strict=True)
    ]
    micro = [distinct_routes(10), distinct_routes(11)]
    x = torch.randn(S, B, H)

    def forced(c: int, m: int) -> torch.Tensor:
        column = [0, 1][c]  # MoE layers (0, 2, 3): layer 0 is column 0, layer 2 column 1
        return micro[m][:, :, column].transpose(0, 1).reshape(-1, 2).sort(-1).values

    for c, m in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        feeds[c].set(micro[m])
        _, routing_map = chunks[c][0](x)
        assert torch.equal(routing_map.nonzero()[:, 1].view(-1, 2), forced(c, m)), (c, m)
    # Backward recompute, chunk 1 first: each chunk pops its own micro-batches in order.
    for c in [1, 0]:
        feeds[c].backward()
        for m in [0, 1]:
            _, routing_map = chunks[c][0](x)
            assert torch.equal(routing_map.nonzero()[:, 1].view(-1, 2), forced(c, m)), (c, m)
    for feed in feeds:
        feed.close()
    assert all(r.router_replay_action is None for r in RouterReplay.global_router_replay_instances)
    # A chunk fed another chunk's layers, or a count that does not match, is refused.
    with pytest.raises(
        LayoutMismatchError, match="router of layer 2 would be fed the routes of layer 3"
    ):
        MegatronRouterFeed(LAYOUT, cfg, layer_offset=3, num_local_layers=1, model=chunks[1])
    with pytest.raises(
        LayoutMismatchError, match="1 replaying routers but the feed's layers hold 2"
    ):
        MegatronRouterFeed(LAYOUT, cfg, layer_offset=2, num_local_layers=2, model=chunks[1])


def test_validation_megatron_lacks():
    cfg = config()
    routers = build_stage(cfg, [0, 2, 3])
    feed = MegatronRouterFeed(LAYOUT, cfg, model=routers)
    routes = distinct_routes(5)
    with pytest.raises(InvalidRoutesError, match="top_k=2"):
        feed.tensors(routes[..., :1])
    with pytest.raises(InvalidRoutesError, match="integer expert ids"):
        feed.tensors(routes.float())
    with pytest.raises(InvalidRoutesError, match="3 MoE layers"):
        feed.tensors(routes[:, :, :2])
    bad = routes.clone()
    bad[1, 2, 0, 1] = 8
    with pytest.raises(InvalidRoutesError, match="expert id 8 at batch 1, position 2"):
        feed.tensors(bad)
    twice = routes.clone()
    twice[0, 3, 2, 1] = twice[0, 3, 2, 0]
    with pytest.raises(InvalidRoutesError, match=r"batch 0, position 3, MoE layer 3 names an"):
        feed.tensors(twice)
    partial = routes.clone()
    partial[1, 4, 1, 0] = -1  # even on a row filler ids could take: the recorded id is real
    no_replay = torch.zeros(partial.shape[:2], dtype=torch.bool)
    with pytest.raises(InvalidRoutesError, match=r"batch 1, position 4, MoE layer \d+ holds some"):
        feed.tensors(partial, replay_mask=no_replay)
    feed.set(routes[:, :4])  # fewer rows than the router will see
    with pytest.raises(InvalidRoutesError, match="sees 15 tokens but was fed 12 rows"):
        routers[0](torch.randn(S, B, H))
    feed.close()
    with pytest.raises(LayoutMismatchError, match="moe_router_fusion"):
        MegatronRouterFeed(LAYOUT, config(moe_router_fusion=True))
    with pytest.raises(LayoutMismatchError, match="moe_enable_routing_replay=False"):
        MegatronRouterFeed(LAYOUT, config(moe_enable_routing_replay=False))
    with pytest.raises(LayoutMismatchError, match="moe_router_topk=4"):
        MegatronRouterFeed(LAYOUT, config(moe_router_topk=4))
    build_stage(cfg, [0, 2, 3])
    TopKRouter(cfg, ProcessGroupCollection.use_mpu_process_groups())  # joins the class list
    with pytest.raises(LayoutMismatchError, match="clear_global_router_replay_instances"):
        MegatronRouterFeed(LAYOUT, cfg)


def test_routing_that_bypasses_router_replay_is_refused():
    # Megatron's sinkhorn routing (and quantile_balancing, megatron-core 0.17+) picks the
    # experts without asking RouterReplay: targets set on the router never reach its map.
    cfg = config(moe_router_load_balancing_type="sinkhorn")
    (router,) = build_stage(cfg, [0])
    targets = distinct_routes(3)[:, :, 0].transpose(0, 1).reshape(S * B, 2)  # seq-major
    router.router_replay.set_target_indices(targets)
    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, routing_map = router(torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)))
    router.router_replay.clear_router_replay_action()
    chosen = routing_map.nonzero()[:, 1].view(S * B, 2)  # each row's 2 experts, ascending
    assert int((chosen == targets.sort(-1).values).all(-1).sum()) == 0  # not one row replayed
    for kind in ("sinkhorn", "quantile_balancing"):
        with pytest.raises(LayoutMismatchError, match=f"moe_router_load_balancing_type='{kind}'"):
            MegatronRouterFeed(LAYOUT, config(moe_router_load_balancing_type=kind))
    cfg = config(moe_router_load_balancing_type="seq_aux_loss")  # routes through RouterReplay
    MegatronRouterFeed(LAYOUT, cfg, model=build_stage(cfg, [0, 2, 3])).close()


def test_moe_layer_allgather_dispatches_tokens_to_the_forced_experts():
    cfg, layers = allgather_moe_layers()
    feed = MegatronRouterFeed(LAYOUT, cfg, model=layers)
    routes = distinct_routes(6)
    routes[2, 3:] = -1  # the final token and padding at the end of the last sequence
    mask = replay_mask([S, S, 4], S)
    feed.set(routes, replay_mask=mask)
    received: dict[int, int] = {}
    for e, expert in enumerate(layers[1].experts.local_experts):
        expert.register_forward_hook(
            lambda m, args, out, e=e: received.__setitem__(e, args[0].shape[0])
        )
    x = torch.randn(S, B, H, requires_grad=True)
    out, _ = layers[1](x)  # global layer 2: routes column 1
    sent = feed.tensors(routes, replay_mask=mask)[1]
    assert received == {e: int((sent == e).sum()) for e in range(8)}
    assert torch.equal(sent[: 3 * B], routes[:, :3, 1].transpose(0, 1).reshape(-1, 2))
    out.sum().backward()
    assert layers[1].router.weight.grad.abs().sum() > 0 and x.grad is not None
    feed.close()


@pytest.mark.distributed
def test_two_expert_parallel_ranks_dispatch_each_ranks_forced_tokens():
    # Two spawned processes, EP=2 over gloo: rank r holds experts [4r, 4r + 4). Every
    # expert must receive exactly the rows, from both ranks, whose forced ids name it.
    import multiprocessing as mp

    import megatron_cpu

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file:///tmp/rr-mcore-ep-{uuid.uuid4().hex}"
    procs = [ctx.Process(target=megatron_cpu.run, args=(r, init, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((results.get(timeout=120) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [r["experts"] for r in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for r in got:
        assert all(r["rows_match"].values()), r
        assert r["router_grad"] > 0 and r["x_grad"]
    # Every token of both ranks went to K=2 experts: 2 ranks x 15 tokens x 2.
    assert sum(sum(r["counts"].values()) for r in got) == 2 * megatron_cpu.S * megatron_cpu.B * 2
