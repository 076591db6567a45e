"""Layouts of families whose routers pick more ids, or route more often, than their config's
expert count and layer count say (transformers 5.25): the layout from_hf_config gives, and
the routers of the tiny model built from the same config sitting where it says."""

from __future__ import annotations

import torch
from hf_configs import build, routers, tiny

from routing_replay import RoutingLayout
from routing_replay.hf_config import loop_layers
from routing_replay.model.adapters import find_routers


def test_zaya_layout_counts_its_skip_expert():
    """Zaya's routers pick among num_experts + 1 ids (the last: skip, no expert) and then hand
    the experts id 0 with weight 0 for it; routes record the choice, so E + 1 experts."""
    config = tiny("ZayaConfig", num_hidden_layers=3, num_experts_per_tok=1)
    layout = RoutingLayout.from_hf_config(config)
    assert layout == RoutingLayout(3, 1, 9)
    model = build("ZayaModel", config)
    found = routers(model, "ZayaRouter")
    assert [layer for layer, _ in found] == list(layout.moe_layers)
    router = model.get_submodule(found[0][1])
    assert router.router_mlp.out_proj.weight.shape[0] == layout.num_experts
    with torch.no_grad():
        router.balancing_biases[-1] = 2.0  # the skip expert wins every token
        logits, weights, ids, _ = router(torch.randn(1, 3, 64))
    assert logits.shape == (3, layout.num_experts)
    assert ids.flatten().tolist() == [0, 0, 0] and weights.flatten().tolist() == [0, 0, 0]


def test_jetmoe_layout_has_two_routed_layers_per_decoder_layer():
    """JetMoE routes twice a decoder layer, in its mixture-of-attention and in its MLP (same
    top-k and expert count): decoder layer i is routed layers 2i and 2i + 1."""
    config = tiny("JetMoeConfig", num_hidden_layers=3)
    layout = RoutingLayout.from_hf_config(config)
    assert layout == RoutingLayout(6, 2, 8)
    model = build("JetMoeModel", config)
    found = routers(model, "JetMoeTopKGating")
    assert [layer for layer, _ in found] == [0, 0, 1, 1, 2, 2]
    moe = find_routers(model)
    assert [r.layer for r in moe.routers] == list(layout.moe_layers)
    parts = ("self_attention.experts.router", "mlp.router")
    assert [r.name for r in moe.routers] == [f"layers.{i}.{p}" for i in range(3) for p in parts]
    for router in moe.routers:  # one logit per expert
        assert router.module.layer.weight.shape[0] == layout.num_experts


def test_inkling2_loop_layout_has_a_layer_per_pass_in_execution_order():
    """Inkling2-Loop runs layers s..e-1 P times a forward, each pass routing again: each pass
    is a layout layer, numbered in execution order (what replay uses)."""
    config = tiny(
        "Inkling2LoopTextConfig", num_hidden_layers=4, loop_num_passes=3,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        loop_layer_index_start=1, loop_layer_index_end=3, n_layers_per_attn_res_block=1,
    )  # fmt: skip
    layout = RoutingLayout.from_hf_config(config)
    assert layout == RoutingLayout(8, 2, 8)
    steps = [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2), (3, 0)]
    assert loop_layers(config) == steps
    moe = find_routers(build("Inkling2LoopTextModel", config))
    assert [(r.name, r.loop_pass or 0) for r in moe.routers] == [
        (f"layers.{i}.mlp.gate", p) for i, p in steps
    ]
    assert [r.layer for r in moe.routers] == list(layout.moe_layers)
