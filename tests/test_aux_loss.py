"""`load_balancing_loss`: transformers' Switch aux loss, counting the replayed experts.

Every family whose transformers model computes an aux loss (`output_router_logits=True`)
is checked against that model's own `aux_loss` and its module's `load_balancing_loss_func`.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from moe_models import tiny_model
from tiny_families import tiny_family_model

from routing_replay import RoutingLayout, capture, replay
from routing_replay.errors import InvalidRoutesError
from routing_replay.model.aux_loss import load_balancing_loss

# The families whose transformers model has a load-balancing aux loss.
AUX_FAMILIES = [
    "deepseek_v4",
    "ernie4_5_moe",
    "flex_olmo",
    "gpt_oss",
    "granitemoe",
    "jamba",
    "minimax",
    "minimax_m2",
    "mixtral",
    "olmoe",
    "qwen2_moe",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_next",
]
# transformers 5.25's families new since (their tiny configs: tiny_families), with an aux loss.
NEW_AUX_FAMILIES = [
    "dbrx",
    "flint",
    "granitemoe_swa",
    "granitemoehybrid",
    "granitemoeshared",
    "jetmoe",
    "laguna",
    "lara_mini",
    "mellum",
    "minimax_m3_vl_text",
    "phimoe",
    "qwen4_exp_text",
]


def aux_model(family: str):
    return tiny_family_model(family) if family in NEW_AUX_FAMILIES else tiny_model(family)


B, S = 2, 6
IDS = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


def sizes(model) -> tuple[int, int]:
    layout = RoutingLayout.from_hf_config(model.config)
    return layout.num_experts, layout.top_k


def logit_columns(model) -> slice:
    """The routes' MoE-layer columns that record router logits (DeepSeek-V4: layer 0 hashes)."""
    return slice(1, None) if model.config.model_type == "deepseek_v4" else slice(None)


def native_routes(router_logits, top_k) -> torch.Tensor:
    """[B, S, L, K]: each layer's top-k of the softmax of its logits, computed here."""
    ids = [torch.topk(torch.softmax(t, dim=-1), top_k, dim=-1).indices for t in router_logits]
    return torch.stack(ids, dim=1).view(B, S, len(ids), top_k)


def forced_routes(num_experts, top_k, layers, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(B * S * layers)]
    return torch.stack(rows).view(B, S, layers, top_k)


def switch_loss(router_logits, routes, num_experts, mask=None) -> torch.Tensor:
    """The Switch loss written out: E * sum_e f_e * P_e over all layers, f from `routes`."""
    rows = router_logits[0].shape[0]
    w = torch.ones(rows) if mask is None else mask.reshape(-1).float()
    ids = routes.reshape(rows, len(router_logits), -1)
    counts = torch.zeros(num_experts)
    probs = torch.zeros(num_experts)
    for j, logits in enumerate(router_logits):
        k = ids.shape[-1]
        counts = counts + torch.bincount(
            ids[:, j].reshape(-1), weights=w.repeat_interleave(k), minlength=num_experts
        )
        probs = probs + (torch.softmax(logits, dim=-1) * w[:, None]).sum(0)
    total = w.sum() * len(router_logits)
    return num_experts * ((counts / total) * (probs / total)).sum()


@pytest.mark.parametrize("padded", [True, False], ids=["attention-mask", "no-mask"])
@pytest.mark.parametrize("family", AUX_FAMILIES + NEW_AUX_FAMILIES)
def test_native_routes_give_transformers_aux_loss_bitwise(family, padded):
    model = aux_model(family)
    E, K = sizes(model)
    mask = MASK if padded else None
    out = model(input_ids=IDS, attention_mask=mask, output_router_logits=True)
    hf_func = importlib.import_module(type(model).__module__).load_balancing_loss_func
    assert torch.equal(out.aux_loss, hf_func(out.router_logits, E, K, mask))
    L = len(out.router_logits)
    missing = torch.full((B, S, L, K), -1)  # every row native: transformers' own count
    native = native_routes(out.router_logits, K)
    half = torch.rand(B, S, L, 1, generator=torch.Generator().manual_seed(0)) < 0.5
    for routes in (missing, native, torch.where(half, missing, native)):
        ours = load_balancing_loss(
            out.router_logits, routes, num_experts=E, top_k=K, attention_mask=mask
        )
        assert torch.equal(ours, out.aux_loss)
    # [B * S, L, K] and int8 (to_torch's dtype) are the same routes.
    flat = native.reshape(B * S, L, K).to(torch.int8)
    ours = load_balancing_loss(out.router_logits, flat, num_experts=E, top_k=K, attention_mask=mask)
    assert torch.equal(ours, out.aux_loss)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replaying_captured_routes_equals_the_built_in_aux_loss(family):
    # Capture, then replay those routes: the replayed experts are the native ones.
    model = tiny_model(family)
    E, K = sizes(model)
    with capture(model) as cap, torch.no_grad():
        model(input_ids=IDS, attention_mask=MASK)
    routes = torch.full((B, S, *cap.routes()[0].shape[1:]), -1)
    for b, r in enumerate(cap.routes()):
        routes[b, S - len(r) :] = torch.from_numpy(r)
    with replay(model, routes, layout=cap.layout):
        out = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
    ours = load_balancing_loss(
        out.router_logits, routes, num_experts=E, top_k=K, attention_mask=MASK
    )
    assert torch.equal(ours, out.aux_loss)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v4"])
def test_forced_routes_are_counted_the_built_in_loss_counts_native(family):
    model = tiny_model(family)
    E, K = sizes(model)
    layout = RoutingLayout.from_hf_config(model.config)
    routes = forced_routes(E, K, layout.num_moe_layers, seed=3)
    routes[0, :2] = -1  # padding
    with replay(model, routes, attention_mask=MASK, layout=layout):
        out = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
    counted = routes[:, :, logit_columns(model)]
    ours = load_balancing_loss(
        out.router_logits, counted, num_experts=E, top_k=K, attention_mask=MASK
    )
    # The built-in loss re-runs top-k on the logits: it counts the native experts.
    native = native_routes(out.router_logits, K)
    assert not torch.equal(counted[1], native[1])
    assert torch.equal(
        out.aux_loss,
        load_balancing_loss(out.router_logits, native, num_experts=E, top_k=K, attention_mask=MASK),
    )
    # Ours counts the forced ids: the Switch loss written out, and not the built-in value.
    ref = switch_loss(out.router_logits, counted.clamp(min=0), E, MASK)  # padding weighs 0
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert abs(ours.item() - out.aux_loss.item()) > 1e-3


def test_gradient_reaches_every_router_weight():
    model = tiny_model("qwen3_moe")
    E, K = sizes(model)
    layout = RoutingLayout.from_hf_config(model.config)
    routes = forced_routes(E, K, layout.num_moe_layers, seed=4)
    routers = [model.model.layers[i].mlp.gate.weight for i in layout.moe_layers]

    def grads(loss_fn):
        model.zero_grad(set_to_none=True)
        with replay(model, routes, layout=layout):
            out = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
        loss_fn(out).backward()
        return [w.grad.clone() for w in routers]

    ours = grads(
        lambda out: load_balancing_loss(
            out.router_logits, routes, num_experts=E, top_k=K, attention_mask=MASK
        )
    )
    ref = grads(lambda out: switch_loss(out.router_logits, routes, E, MASK))
    builtin = grads(lambda out: out.aux_loss)
    for g, r, n in zip(ours, ref, builtin, strict=True):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(g, n)  # counts differ, so the gradient does


def test_attention_mask_drops_padding_rows_like_transformers():
    model = tiny_model("qwen3_moe")
    E, K = sizes(model)
    with torch.no_grad():
        out = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
    L = len(out.router_logits)
    routes = forced_routes(E, K, L, seed=5)
    other = routes.clone()
    other[0, :2] = forced_routes(E, K, L, seed=6)[0, :2]  # different ids on the padding
    pad_missing = routes.clone()
    pad_missing[0, :2] = -1

    def loss(r, mask=MASK):
        return load_balancing_loss(
            out.router_logits, r, num_experts=E, top_k=K, attention_mask=mask
        )

    assert torch.equal(loss(routes), loss(other))
    assert torch.equal(loss(routes), loss(pad_missing))
    assert not torch.equal(loss(routes), loss(routes, mask=None))  # padding counted without
    # The mask is transformers': a float weight per row (here 0/1 ints, or bool).
    assert torch.equal(loss(routes), loss(routes, mask=MASK.bool()))


def test_errors_say_what_to_pass():
    model = tiny_model("qwen3_moe")
    E, K = sizes(model)
    with torch.no_grad():
        out = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
        plain = model(input_ids=IDS, attention_mask=MASK)
    routes = native_routes(out.router_logits, K)
    with pytest.raises(InvalidRoutesError, match="output_router_logits=True"):
        load_balancing_loss(plain.router_logits, routes, num_experts=E, top_k=K)
    with pytest.raises(InvalidRoutesError, match=r"\[B, S, 2 MoE layers, top_k=2\] over the 12"):
        load_balancing_loss(out.router_logits, routes[:, :, :1], num_experts=E, top_k=K)
    with pytest.raises(InvalidRoutesError, match="over the 12 rows"):
        load_balancing_loss(out.router_logits, routes[:, :5], num_experts=E, top_k=K)
    bad = routes.clone()
    bad[1, 3, 1, 0] = E
    with pytest.raises(InvalidRoutesError, match="expert id 8 at row 9, MoE layer 1"):
        load_balancing_loss(out.router_logits, bad, num_experts=E, top_k=K)
    with pytest.raises(InvalidRoutesError, match="integer expert ids"):
        load_balancing_loss(out.router_logits, routes.float(), num_experts=E, top_k=K)
    with pytest.raises(InvalidRoutesError, match="num_experts=16"):
        load_balancing_loss(out.router_logits, routes, num_experts=16, top_k=K)
    with pytest.raises(InvalidRoutesError, match="attention_mask has 10 positions for 12"):
        load_balancing_loss(
            out.router_logits, routes, num_experts=E, top_k=K, attention_mask=MASK[:, :5]
        )


def product_key_routes(router_logits, num_keys, top_k) -> torch.Tensor:
    """[B, S, L, K]: Doge's native experts written out: expert x * num_keys + y scores
    logits[0][x] + logits[1][y]; the top-k of all num_keys ** 2 scores, by sorting."""
    ids = []
    for layer in router_logits:
        scores = (layer[0][:, :, None] + layer[1][:, None, :]).reshape(layer.shape[1], -1)
        ids.append(torch.argsort(scores, dim=-1, descending=True, stable=True)[:, :top_k])
    return torch.stack(ids, dim=1).view(B, S, len(ids), top_k)


@pytest.mark.parametrize("padded", [True, False], ids=["attention-mask", "no-mask"])
def test_doge_product_keys_count_the_replayed_experts(padded):
    # Before: Doge's router logits ([2, tokens, num_keys] per layer, the key halves) were
    # refused. Native routes give Doge's own aux_loss bitwise; forced ones are counted.
    model = tiny_family_model("doge")
    E, K = sizes(model)
    num_keys = 4
    assert num_keys**2 == E
    mask = MASK if padded else None
    out = model(input_ids=IDS, attention_mask=mask, output_router_logits=True)
    L = len(out.router_logits)
    assert out.router_logits[0].shape == (2, B * S, num_keys)
    native = product_key_routes(out.router_logits, num_keys, K)
    half = torch.rand(B, S, L, 1, generator=torch.Generator().manual_seed(0)) < 0.5
    missing = torch.full((B, S, L, K), -1)
    for routes in (missing, native, torch.where(half, missing, native)):
        ours = load_balancing_loss(
            out.router_logits, routes, num_experts=E, top_k=K, attention_mask=mask
        )
        assert torch.equal(ours, out.aux_loss)
    # Forced ids: E * sum_e f_e * P_e written out (f over every counted id, P the mean
    # softmax of the product scores), with a gradient into every router.
    routes = forced_routes(E, K, L, seed=7)
    ours = load_balancing_loss(
        out.router_logits, routes, num_experts=E, top_k=K, attention_mask=mask
    )
    w = torch.ones(B * S) if mask is None else mask.reshape(-1).float()
    ids = routes.reshape(B * S, L, K)
    counts = sum(
        torch.bincount(ids[:, j].reshape(-1), weights=w.repeat_interleave(K), minlength=E)
        for j in range(L)
    )
    probs = sum(
        (
            torch.softmax((t[0][:, :, None] + t[1][:, None, :]).reshape(B * S, E), -1) * w[:, None]
        ).sum(0)
        for t in out.router_logits
    )
    ref = E * ((counts / (w.sum() * L * K)) * (probs / (w.sum() * L))).sum()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert abs(ours.item() - out.aux_loss.item()) > 1e-3
    # Under replay (Doge's own block modifies its routing softmax in place, so its native
    # forward has no backward in transformers 5.25; replay recomputes the block).
    model.zero_grad(set_to_none=True)
    with replay(model, routes, layout=RoutingLayout.from_hf_config(model.config)):
        again = model(input_ids=IDS, attention_mask=mask, output_router_logits=True)
    load_balancing_loss(
        again.router_logits, routes, num_experts=E, top_k=K, attention_mask=mask
    ).backward()
    gates = [p.grad for n, p in model.named_parameters() if "router_gate" in n]
    assert len(gates) == L and all(g.abs().sum() > 0 for g in gates)
    with pytest.raises(InvalidRoutesError, match="num_keys \\*\\* 2"):
        load_balancing_loss(out.router_logits, routes, num_experts=20, top_k=K)
