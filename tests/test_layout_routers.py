"""Layouts of families whose routers pick more ids, or route more often, than their config's
expert count and layer count say (transformers 5.25): the layout from_hf_config gives, and
the routers of the tiny model built from the same config sitting where it says."""

from __future__ import annotations

import torch
from hf_configs import build, routers, tiny

from routing_replay import RoutingLayout


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
