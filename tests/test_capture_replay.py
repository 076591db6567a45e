"""Capture and replay on tiny transformers models of every supported MoE family.

Expert ids and weights are checked where the experts module is called (a forward pre-hook on
each layer's `mlp.experts`, registered here), never through routing_replay's own hooks.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from moe_models import FAMILIES, tiny_model

from routing_replay import MISSING, RoutingLayout, capture, replay
from routing_replay.errors import (
    InvalidRoutesError,
    LayoutMismatchError,
    UnsupportedGenerationError,
    UnsupportedModelError,
)
from routing_replay.model.adapters import find_routers
from routing_replay.routes import with_layout

B, S = 2, 6


# The fast tier: one family of each score function and layer pattern; all in the slow.
FAST = {
    "cohere2_moe",
    "cohere2_moe_sigmoid",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v4",
    "ernie4_5_moe",
    "gpt_oss",
    "jamba",
    "lfm2_moe",
    "minimax_m2",
    "qwen3_moe",
    "qwen3_next",
}
PARAMS = [pytest.param(f, marks=() if f in FAST else pytest.mark.slow, id=f) for f in FAMILIES]


@pytest.fixture(scope="module", params=PARAMS)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return tiny_model(family)


def layout_of(model) -> RoutingLayout:
    return RoutingLayout.from_hf_config(model.config)


def moe_mlps(model):
    """The MoE block of each MoE layer: the module that holds its router and its experts."""
    return [model.get_submodule(r.name.rsplit(".", 1)[0]) for r in find_routers(model).routers]


def router_of(mlp):
    return mlp.router if hasattr(mlp, "router") else mlp.gate


def router_weight(router):
    """The router's [E, H] weight (HunYuan keeps it in a Linear, `wg`)."""
    return next(p for p in router.parameters() if p.dim() == 2)


class Spy:
    """What each MoE layer's experts module was called with, and its router's logits."""

    def __init__(self, model):
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.logits: list[list[torch.Tensor]] = []
        self.inputs: list[list[torch.Tensor]] = []
        self.handles = []
        for j, mlp in enumerate(moe_mlps(model)):
            self.calls.append([])
            self.logits.append([])
            self.inputs.append([])
            self.handles.append(mlp.experts.register_forward_pre_hook(self._experts(j)))
            self.handles.append(router_of(mlp).register_forward_hook(self._router(j)))

    def _experts(self, j):
        def hook(module, args):
            _, ids, weights = args
            self.calls[j].append((ids.detach().clone(), weights.detach().clone()))

        return hook

    def _router(self, j):
        def hook(module, args, output):
            self.logits[j].append(output[0].detach().clone())
            self.inputs[j].append(tuple(a.detach().clone() for a in args))

        return hook

    def ids(self, j, call=0):
        return self.calls[j][call][0]

    def weights(self, j, call=0):
        return self.calls[j][call][1]

    def remove(self):
        for h in self.handles:
            h.remove()


def family_weights(family, router, logits_TE, ids_TK):
    """The weights each family's router computes at `ids_TK`, written from transformers' code."""
    if family in ("qwen3_moe", "qwen3_next", "qwen2_moe", "olmoe", "flex_olmo"):
        w = F.softmax(logits_TE, dtype=torch.float, dim=-1).gather(1, ids_TK)
        if router.norm_topk_prob:
            w /= w.sum(dim=-1, keepdim=True)
        return w.to(logits_TE.dtype)
    if family in ("mixtral", "minimax", "qwen3_5_moe", "hunyuan_v1_moe"):
        w = F.softmax(logits_TE.float(), dim=-1).gather(1, ids_TK)
        return w / w.sum(dim=-1, keepdim=True)
    if family.startswith("cohere2_moe"):
        top = logits_TE.gather(1, ids_TK)
        if router.expert_selection_fn == "softmax":
            return F.softmax(top, dim=1, dtype=torch.float)
        w = F.sigmoid(top)
        return w / torch.sum(w, dim=-1, keepdim=True) if router.norm_topk_prob else w
    if family == "lfm2_moe":
        w = logits_TE.sigmoid().gather(1, ids_TK)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-6)
        return w * router.routed_scaling_factor
    if family in ("gpt_oss", "granitemoe"):
        top = logits_TE.gather(1, ids_TK)
        return F.softmax(top, dim=1, dtype=top.dtype)
    if family == "jamba":
        return F.softmax(logits_TE, dim=-1, dtype=torch.float).gather(1, ids_TK)
    if family == "deepseek_v2":
        return logits_TE.softmax(dim=-1, dtype=torch.float32).gather(1, ids_TK) * (
            router.routed_scaling_factor
        )
    if family == "ernie4_5_moe":
        w = F.softmax(logits_TE, dim=1, dtype=torch.float).gather(1, ids_TK)
        return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=router.norm_min)
    if family == "deepseek_v4":
        w = router.score_fn(logits_TE).gather(1, ids_TK)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    if family == "minimax_m2":
        w = F.sigmoid(logits_TE.float()).gather(1, ids_TK)
        return w / w.sum(dim=-1, keepdim=True)
    if family in (
        "deepseek_v3",
        "deepseek_v32",
        "glm4_moe",
        "dots1",
        "glm4_moe_lite",
        "exaone_moe",
        "kimi_linear",
    ):
        w = logits_TE.sigmoid().gather(1, ids_TK)
        if router.norm_topk_prob:
            w /= w.sum(dim=-1, keepdim=True) + 1e-20
        return w * router.routed_scaling_factor
    raise AssertionError(family)


def random_routes(layout, shape, seed, missing=0.0):
    """Valid random routes (distinct ids per row), a fraction of (token, layer) rows missing."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    keys = rng.random((n, layout.num_moe_layers, layout.num_experts))
    ids = np.argsort(keys, axis=-1)[..., : layout.top_k].astype(np.int32)
    drop = rng.random((n, layout.num_moe_layers)) < missing
    ids[drop] = MISSING
    return with_layout(
        torch.from_numpy(ids.reshape(*shape, layout.num_moe_layers, layout.top_k)), layout
    )


def batch(seed=0, b=B, s=S, pad=(2, 0)):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for i, p in enumerate(pad[:b]):
        input_ids[i, :p] = 0
        mask[i, :p] = 0
    return input_ids, mask


def left_pad(routes, s, layout):
    out = np.full((len(routes), s, layout.num_moe_layers, layout.top_k), MISSING, np.int32)
    for b, r in enumerate(routes):
        out[b, s - len(r) :] = r
    return with_layout(torch.from_numpy(out), layout)


# -- replay: forced ids and the family's weights, at the experts -----------------------------


def test_replay_forces_ids_with_family_weights(family, model):
    layout = layout_of(model)
    input_ids, mask = batch()
    routes = random_routes(layout, (B, S), seed=1, missing=0.3)
    spy = Spy(model)
    with replay(model, routes), torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask)
    spy.remove()
    flat = routes.reshape(B * S, layout.num_moe_layers, layout.top_k)
    for j, mlp in enumerate(moe_mlps(model)):
        forced_TK = flat[:, j].long()
        missing_T = (forced_TK == MISSING).any(-1)
        assert 0 < int(missing_T.sum()) < B * S
        ids, weights = spy.ids(j), spy.weights(j)
        # Forced rows: exactly the given ids, in the given order.
        assert torch.equal(ids[~missing_T], forced_TK[~missing_T])
        # Weights: the family's formula at those ids from the live logits. The formula is the
        # same sequence of float ops as the family's router, so equality is exact.
        router = router_of(mlp)
        expected = family_weights(family, router, spy.logits[j][0], ids)
        assert torch.equal(weights[~missing_T], expected[~missing_T])
        # Missing rows: the model's own routing of this layer's input (forced rows in earlier
        # layers changed it), from the router's own forward, bypassing every hook.
        with torch.no_grad():
            _, native_w, native_ids = router.forward(*spy.inputs[j][0])
        assert weights.dtype == native_w.dtype
        assert torch.equal(ids[missing_T], native_ids[missing_T])
        assert torch.equal(weights[missing_T], native_w[missing_T])


def test_all_missing_routes_natively(family, model):
    layout = layout_of(model)
    input_ids, mask = batch()
    routes = torch.full((B, S, layout.num_moe_layers, layout.top_k), MISSING)
    with torch.no_grad():
        native = model(input_ids=input_ids, attention_mask=mask).logits
        with replay(model, routes, layout=layout):
            replayed = model(input_ids=input_ids, attention_mask=mask).logits
    assert torch.equal(native, replayed)


def test_capture_then_replay_reproduces_logits(family, model):
    input_ids, mask = batch(seed=3)
    with capture(model) as cap, torch.no_grad():
        native = model(input_ids=input_ids, attention_mask=mask).logits
    routes = cap.routes()
    assert [len(r) for r in routes] == mask.sum(1).tolist()  # padding stripped
    padded = left_pad(routes, S, layout_of(model))
    with replay(model, padded), torch.no_grad():
        replayed = model(input_ids=input_ids, attention_mask=mask).logits
    assert torch.equal(native, replayed)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_then_replay_reproduces_bf16_logits(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    input_ids, mask = batch(seed=6)
    with capture(model) as cap, torch.no_grad():
        native = model(input_ids=input_ids, attention_mask=mask).logits
    with replay(model, left_pad(cap.routes(), S, layout_of(model))), torch.no_grad():
        replayed = model(input_ids=input_ids, attention_mask=mask).logits
    assert native.dtype == torch.bfloat16 and torch.equal(native, replayed)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax"])  # minimax: cache layer 0 is linear
def test_capture_hand_written_decode_loop(family):
    model = tiny_model(family)
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with capture(model) as cap, torch.no_grad():
        out = model(input_ids=input_ids, use_cache=True)
        sequence = input_ids
        for _ in range(3):
            token = out.logits[:, -1:].argmax(-1)
            sequence = torch.cat([sequence, token], dim=1)
            out = model(input_ids=token, cache=out.past_key_values, use_cache=True)
    with capture(model) as full, torch.no_grad():
        model(input_ids=sequence)
    assert [t.tolist() for t in cap.token_ids()] == sequence.tolist()
    for step, whole in zip(cap.routes(), full.routes(), strict=True):
        assert np.array_equal(step, whole)


def test_router_grad_and_gradient_checkpointing(family):
    model = tiny_model(family).train()
    layout = layout_of(model)
    input_ids, _ = batch(seed=4, pad=())
    routes = random_routes(layout, (B, S), seed=5, missing=0.2)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        spy = Spy(model)
        with replay(model, routes):
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
        spy.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, spy

    loss, grads, spy = loss_and_grads()
    for mlp in moe_mlps(model):
        weight = router_weight(router_of(mlp))
        name = next(n for n, p in model.named_parameters() if p is weight)
        assert grads[name].abs().sum() > 0, name
    assert all(len(calls) == 1 for calls in spy.calls)

    model.activation_checkpointing_enable()
    try:
        loss_ckpt, grads_ckpt, spy_ckpt = loss_and_grads()
    finally:
        model.activation_checkpointing_disable()
    # The recompute in backward routes the same: every experts call saw the forced ids.
    assert all(len(calls) == 2 for calls in spy_ckpt.calls)
    for j in range(layout.num_moe_layers):
        assert torch.equal(spy_ckpt.ids(j, 0), spy_ckpt.ids(j, 1))
        assert torch.equal(spy_ckpt.ids(j, 0), spy.ids(j, 0))
    # Recomputing runs the same CPU kernels on the same inputs: bitwise equal.
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name


def test_replay_gradients_match_a_hand_written_forced_router(family):
    """Gradients under replay equal those of a router rewritten by hand to force the ids."""
    model = tiny_model(family).train()
    layout = layout_of(model)
    input_ids, _ = batch(seed=15, pad=())
    routes = random_routes(layout, (B, S), seed=16)  # every row forced
    flat = routes.reshape(B * S, layout.num_moe_layers, layout.top_k).long()

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with replay(model, routes):
        ours = grads()
    routers = [router_of(mlp) for mlp in moe_mlps(model)]
    for j, router in enumerate(routers):

        def forced(hidden, *rest, router=router, j=j):  # rest: MiniMax-M2's bias argument
            logits, _, _ = type(router).forward(router, hidden, *rest)  # the family's logits
            return logits, family_weights(family, router, logits, flat[:, j]), flat[:, j]

        router.forward = forced
    try:
        reference = grads()
    finally:
        for router in routers:
            del router.forward
    assert ours.keys() == reference.keys()
    for name in ours:
        # The same ops in the same order forward and backward: bitwise equal.
        assert torch.equal(ours[name], reference[name]), name


# -- capture with generate --------------------------------------------------------------------


def test_capture_generate_left_padded(family, model):
    layout = layout_of(model)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16]]
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, p in enumerate(prompts):
        input_ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        first = model.generate(**kwargs, eos_token_id=None, pad_token_id=0)
    # Sample 0 ends at its first new token (from the second on) that it did not make before.
    new0 = first[0, width:].tolist()
    stop = next(i for i in range(1, len(new0)) if new0[i] not in new0[:i])
    eos = new0[stop]
    with capture(model) as cap, torch.no_grad():
        out = model.generate(**kwargs, eos_token_id=eos, pad_token_id=0)
    routes, tokens = cap.routes(), cap.token_ids()
    assert len(routes) == len(prompts)
    for b, p in enumerate(prompts):
        new = out[b, width:].tolist()
        end = new.index(eos) + 1 if eos in new else len(new)
        expected = p + new[:end]
        assert tokens[b].tolist() == expected
        r = routes[b]
        assert r.dtype == np.int32 and r.shape == (len(expected), *routes[0].shape[1:])
        # A token is forwarded unless it is the last column generate produced.
        forwarded = len(p) + end - (1 if width + end == out.shape[1] else 0)
        assert (r[:forwarded] != MISSING).all() and (r[forwarded:] == MISSING).all()
        assert r.shape[1:] == (layout.num_moe_layers, layout.top_k)
        # A plain float32 forward over the sample alone routes every forwarded token the same.
        with capture(model) as full, torch.no_grad():
            model(input_ids=torch.tensor([expected]))
        assert np.array_equal(full.routes()[0][:forwarded], r[:forwarded])
    assert (routes[0].shape[0], tokens[0][-1]) == (3 + stop + 1, eos)


def test_capture_generate_settings():
    model = tiny_model("olmoe")
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.no_grad():
        first = model.generate(input_ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
    model.generation_config.eos_token_id = int(first[0, 4])
    try:
        # generate's own precedence: an explicit eos_token_id=None disables the config's EOS.
        with capture(model) as cap, torch.no_grad():
            model.generate(input_ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
        assert [len(r) for r in cap.routes()] == [8, 8]
        with capture(model) as cap, torch.no_grad():
            model.generate(input_ids, max_new_tokens=5, do_sample=False)
        assert len(cap.routes()[0]) == 3 + 2
    finally:
        model.generation_config.eos_token_id = 1
    with capture(model) as cap, torch.no_grad():
        out = model.generate(
            input_ids, max_new_tokens=4, do_sample=True, num_return_sequences=3, eos_token_id=None
        )
    assert [t.tolist() for t in cap.token_ids()] == out.tolist()
    with capture(model) as cap, torch.no_grad():  # prompt given as embeddings only
        embeds = model.get_input_embeddings()(input_ids)
        new = model.generate(inputs_embeds=embeds, max_new_tokens=3, eos_token_id=None)
    assert cap.token_ids() == [None, None]  # routes still align: prompt, then new tokens
    with capture(model) as full, torch.no_grad():
        model(input_ids=torch.cat([input_ids, new], dim=1))
    for r, f in zip(cap.routes(), full.routes(), strict=True):
        assert r.shape == f.shape and np.array_equal(r[:-1], f[:-1]) and (r[-1] == -1).all()
    with capture(model), pytest.raises(UnsupportedGenerationError, match="beam"):
        model.generate(input_ids, max_new_tokens=2, num_beams=2)
    wrapped = model.generate  # wrapped once and for good: records nothing outside a block
    with capture(model) as outer:
        assert model.generate is wrapped
        with capture(model) as inner, torch.no_grad():
            model.generate(input_ids, max_new_tokens=2, do_sample=False)
        with torch.no_grad():
            model.generate(input_ids, max_new_tokens=2, do_sample=False)
    with torch.no_grad():
        model.generate(input_ids, max_new_tokens=2, do_sample=False)
    assert model.generate is wrapped
    assert len(inner.routes()) == 2 and len(outer.routes()) == 4


def test_capture_inside_replay_records_forced_ids():
    model = tiny_model("qwen3_moe")
    layout = layout_of(model)
    input_ids, _ = batch(pad=())
    routes = random_routes(layout, (B, S), seed=7)
    with replay(model, routes), capture(model) as cap, torch.no_grad():
        model(input_ids=input_ids)
    assert np.array_equal(np.stack(cap.routes()), routes.numpy())
    with capture(model) as cap, replay(model, routes), torch.no_grad():  # either nesting order
        model(input_ids=input_ids)
    assert np.array_equal(np.stack(cap.routes()), routes.numpy())


def test_routes_over_all_layers_are_accepted():
    model = tiny_model("deepseek_v3")  # layer 0 is dense
    layout = layout_of(model)
    routes = random_routes(layout, (B, S), seed=14)
    all_layers = torch.full((B, S, layout.num_layers, layout.top_k), MISSING, dtype=torch.int32)
    all_layers[:, :, list(layout.moe_layers)] = routes
    input_ids, mask = batch()
    with torch.no_grad():
        with replay(model, routes):
            moe_only = model(input_ids=input_ids, attention_mask=mask).logits
        with replay(model, all_layers, layout=layout):
            every_layer = model(input_ids=input_ids, attention_mask=mask).logits
    assert torch.equal(moe_only, every_layer)


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_other_experts_implementations(impl):
    model = tiny_model("qwen2_moe")
    model.set_experts_implementation(impl)
    layout = layout_of(model)
    input_ids, mask = batch()
    routes = random_routes(layout, (B, S), seed=18, missing=0.3)
    spy = Spy(model)
    with replay(model, routes), torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask)
    spy.remove()
    for j in range(layout.num_moe_layers):
        forced = routes.reshape(B * S, layout.num_moe_layers, -1)[:, j].long()
        keep = (forced != MISSING).all(-1)
        assert torch.equal(spy.ids(j)[keep], forced[keep])
    with capture(model) as cap, torch.no_grad():
        native = model(input_ids=input_ids, attention_mask=mask).logits
    with replay(model, left_pad(cap.routes(), S, layout)), torch.no_grad():
        assert torch.equal(native, model(input_ids=input_ids, attention_mask=mask).logits)


def test_packed_batch():
    model = tiny_model("deepseek_v3")
    layout = layout_of(model)
    input_ids = torch.randint(3, 97, (1, 11))
    routes = random_routes(layout, (1, 11), seed=8, missing=0.2)
    spy = Spy(model)
    with replay(model, routes), torch.no_grad():
        model(input_ids=input_ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]))
    spy.remove()
    for j in range(layout.num_moe_layers):
        forced = routes[0, :, j].long()
        keep = (forced != MISSING).all(-1)
        assert torch.equal(spy.ids(j)[keep], forced[keep])


def test_one_copy_of_routes_per_batch_and_one_host_copy_per_forward(monkeypatch):
    """The CUDA design, checked on CPU: no per-layer transfer in replay or capture."""
    # The package exports functions named like these modules: fetch the modules themselves.
    capture_mod = importlib.import_module("routing_replay.model.capture")
    staging = importlib.import_module("routing_replay.model.staging")

    model = tiny_model("qwen3_moe")
    layout = layout_of(model)
    input_ids, mask = batch()
    made = []
    real = staging.DeviceRoutes
    monkeypatch.setattr(staging, "DeviceRoutes", lambda **kw: made.append(1) or real(**kw))
    with replay(model, random_routes(layout, (B, S), seed=9)), torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask)
        model(input_ids=input_ids, attention_mask=mask)
    assert len(made) == 1

    copies = []
    real_to_host = capture_mod._to_host
    monkeypatch.setattr(
        capture_mod, "_to_host", lambda t, **kw: copies.append(t) or real_to_host(t, **kw)
    )
    with capture(model), torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask)
    routes_copies = [t for t in copies if t is not None and t.dim() == 4]
    assert len(routes_copies) == 1 and layout.num_moe_layers > 1


# -- errors before the forward -------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ("layers", LayoutMismatchError, "MoE layers only"),
        ("top_k", LayoutMismatchError, "top_k"),
        ("too_big", InvalidRoutesError, r"at index \[1, 2, 0\], slot 0 is out of range"),
        ("negative", InvalidRoutesError, "out of range"),
        ("float", InvalidRoutesError, "integer"),
        ("unsigned", InvalidRoutesError, "decode"),
        ("duplicate", InvalidRoutesError, r"index \[0, 1, 1\] names an expert twice"),
        ("partial", InvalidRoutesError, r"index \[1, 3, 0\] holds some but not all"),
        ("rank", InvalidRoutesError, "input_ids.shape"),
        ("batch_shape", InvalidRoutesError, "batch shape"),
    ],
)
def test_bad_routes_raise_before_forward(change, error, words):
    model = tiny_model("deepseek_v3")
    layout = layout_of(model)
    input_ids, mask = batch()
    routes = random_routes(layout, (B, S), seed=10)
    if change == "layers":
        routes = routes[:, :, :1]
    elif change == "top_k":
        routes = routes[..., :-1]
    elif change == "too_big":
        routes[1, 2, 0, 0] = layout.num_experts
    elif change == "negative":
        routes[1, 2, 0, 0] = -2
    elif change == "float":
        routes = routes.float()
    elif change == "unsigned":
        routes = routes.clamp(min=0).to(torch.uint8)
    elif change == "duplicate":
        routes[0, 1, 1, 1] = routes[0, 1, 1, 0]
    elif change == "partial":  # routes of a smaller top_k padded with -1
        routes[1, 3, 0, -1] = -1
    elif change == "rank":
        routes = routes[0, 0]
    elif change == "batch_shape":
        routes = routes[:, :-1]
    spy = Spy(model)
    with pytest.raises(error, match=words), replay(model, routes), torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask)
    spy.remove()
    assert all(not calls for calls in spy.calls)  # no expert ran


def test_unknown_router_fails_loudly():
    model = tiny_model("qwen3_moe")
    gate = model.model.layers[2].mlp.gate

    class CustomRouter(type(gate)):
        pass

    gate.__class__ = CustomRouter
    routes = random_routes(layout_of(model), (B, S), seed=11)
    with pytest.raises(UnsupportedModelError, match=r"layer\(s\) \[2\].*CustomRouter"):
        replay(model, routes)
    with pytest.raises(UnsupportedModelError, match="CustomRouter"):
        capture(model)


def test_router_bypassed_by_a_fused_kernel_fails_loudly():
    model = tiny_model("gpt_oss")
    mlp = model.model.layers[1].mlp

    def fused(hidden_states):  # what a hub kernel does: routes from router.weight directly
        router = mlp.router
        logits = F.linear(hidden_states.reshape(-1, hidden_states.shape[-1]), router.weight)
        weights, ids = torch.topk(logits.softmax(-1), router.top_k)
        out = mlp.experts(hidden_states.reshape(-1, hidden_states.shape[-1]), ids, weights)
        return out.reshape(hidden_states.shape), weights

    mlp.forward = fused
    routes = random_routes(layout_of(model), (B, S), seed=13)
    error = pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.router")
    with error, replay(model, routes), torch.no_grad():
        model(input_ids=batch(pad=())[0])
    error = pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.router")
    with error, capture(model), torch.no_grad():
        model(input_ids=batch(pad=())[0])


def test_wrapped_model():
    model = tiny_model("mixtral")
    wrapper = torch.nn.Module()
    wrapper.module = model  # what DistributedDataParallel looks like from outside
    routes = random_routes(layout_of(model), (B, S), seed=17)
    spy = Spy(model)
    with replay(wrapper, routes), torch.no_grad():
        model(input_ids=batch(pad=())[0])
    spy.remove()
    assert torch.equal(spy.ids(0), routes[:, :, 0].reshape(B * S, -1).long())


def test_dense_model_fails_loudly():
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match="not an MoE model"):
        capture(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_backward_outside_replay_under_checkpointing_warns(reentrant):
    # Reentrant checkpointing runs the layers under no_grad in the forward: the pass is
    # counted at the decoder, where the caller's grad mode holds.
    model = tiny_model("olmoe").train()
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    input_ids, _ = batch(pad=())
    routes = random_routes(layout_of(model), (B, S), seed=12)
    with pytest.warns(RuntimeWarning, match="inside the `with replay"), replay(model, routes):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    # The recompute now routes natively; torch usually notices the changed saved tensors too.
    with contextlib.suppress(torch.utils.checkpoint.CheckpointError):
        loss.backward()


def test_every_nth_layer_checkpointed_warns_only_when_backward_is_outside():
    # transformers' every_n_layers=2 checkpoints decoder layers 0 and 2: DeepSeek-V3's first
    # layer is dense, so its first MoE layer is not recomputed (before: the block counted
    # recomputes there only, and warned with backward inside it).
    model = tiny_model("deepseek_v3").train()
    layout = layout_of(model)
    assert layout.moe_layers[0] == 1
    model.activation_checkpointing_enable(every_n_layers=2)
    input_ids, _ = batch(pad=())
    routes = random_routes(layout, (B, S), seed=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with replay(model, routes):
            model(input_ids=input_ids, labels=input_ids).loss.backward()
    with pytest.warns(RuntimeWarning, match="inside the `with replay"), replay(model, routes):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    with contextlib.suppress(torch.utils.checkpoint.CheckpointError):
        loss.backward()


@pytest.mark.parametrize(
    "checkpointing",
    [{}, {"every_n_layers": 2}, {"activation_checkpointing_kwargs": {"use_reentrant": True}}],
    ids=["every-layer", "every-2nd", "reentrant"],
)
def test_metrics_count_each_forward_once_under_checkpointing(checkpointing):
    # A recompute is not another forward (before: recomputes were tallied, so with every 2nd
    # layer checkpointed the checkpointed MoE layers counted twice and the metrics moved).
    model = tiny_model("deepseek_v3").train()
    input_ids, _ = batch(pad=())
    with torch.no_grad(), capture(model) as cap:
        model(input_ids=input_ids)
    routes = torch.from_numpy(np.stack(cap.routes())).long()
    routes[:, :, 0] = (routes[:, :, 0] + 1) % cap.layout.num_experts  # MoE layer 0 disagrees

    def step() -> dict:
        with replay(model, routes, layout=cap.layout, tolerance=0.9) as block:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        return block.metrics()

    plain = step()
    assert plain["replay/rows_replayed"] == routes.shape[0] * routes.shape[1] * 2
    assert 0 < plain["replay/native_agreement"] < 1 and plain["replay/replace_rate"] > 0
    model.activation_checkpointing_enable(**checkpointing)
    try:
        assert step() == plain
    finally:
        model.activation_checkpointing_disable()


def test_a_forward_failing_inside_the_block_is_not_waited_for_by_its_exit():
    # A forward that fails (an out-of-memory retried, say) has no backward: the block's exit
    # does not warn that backward ran outside it (before: it counted the forward at its start).
    model = tiny_model("qwen3_moe").train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    input_ids, _ = batch(pad=())
    routes = random_routes(layout_of(model), (B, S), seed=12)

    def fail(module, args, output):
        raise RuntimeError("out of memory (a stand-in)")

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with replay(model, routes):
            hook = model.model.layers[-1].register_forward_hook(fail)
            with pytest.raises(RuntimeError, match="stand-in"):
                model(input_ids=input_ids, labels=input_ids)
            hook.remove()
            model(input_ids=input_ids, labels=input_ids).loss.backward()
