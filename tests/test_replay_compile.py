"""Replay under torch.compile, the device copy replay holds, and the attention-mask check.

Compiled replay must either force exactly what eager replay forces or refuse before the
forward runs; it must never route natively inside a block, nor replay a block's routes after
it. Graphs are counted with a backend that counts its calls, then compiles with aot_eager
(the same ATen ops as eager: bitwise) or inductor (fused kernels: close, not bitwise).
"""

from __future__ import annotations

import copy
import functools
import importlib
import io
import re

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from compiling import Graphs, reset_dynamo
from moe_models import tiny_model
from torch._dynamo.utils import counters

from routing_replay import MISSING, RoutingLayout, RoutingReplayError, replay
from routing_replay.errors import InvalidRoutesError, UnsupportedModelError
from routing_replay.model.adapters import find_routers
from routing_replay.routes import with_layout

pytestmark = pytest.mark.compile

# The package exports a function named like the module: fetch the module itself.
replay_mod = importlib.import_module("routing_replay.model.replay")
staging = importlib.import_module("routing_replay.model.staging")
forcing = importlib.import_module("routing_replay.model.forcing")
prepare_replay, is_prepared = replay_mod.prepare_replay, replay_mod.is_prepared

B, S = 2, 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    reset_dynamo()
    yield
    reset_dynamo()


def layout_of(model) -> RoutingLayout:
    return RoutingLayout.from_hf_config(model.config)


def random_routes(layout, shape, seed, missing=0.0):
    """Valid random routes (distinct ids per row), a fraction of (token, layer) rows missing."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    keys = rng.random((n, layout.num_moe_layers, layout.num_experts))
    ids = np.argsort(keys, axis=-1)[..., : layout.top_k].astype(np.int32)
    ids[rng.random((n, layout.num_moe_layers)) < missing] = MISSING
    return with_layout(
        torch.from_numpy(ids.reshape(*shape, layout.num_moe_layers, layout.top_k)), layout
    )


def input_ids(seed=0):
    return torch.randint(3, 97, (B, S), generator=torch.Generator().manual_seed(seed))


def compiled(model, style, backend):
    """`model` compiled as a whole, with `model.compile()`, or layer by layer (torchtitan)."""
    if style == "whole":
        return torch.compile(model, backend=backend)
    if style == "module.compile":
        model.compile(backend=backend)
        return model
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend=backend)
    return model


def experts_calls(model):
    """A list that gets one entry per call of any MoE layer's experts module."""
    calls = []
    for router in find_routers(model).routers:
        mlp = model.get_submodule(router.name.rsplit(".", 1)[0])
        mlp.experts.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


# -- compiled replay equals eager replay; native outside the block ----------------------------


@pytest.mark.parametrize(
    ("family", "style", "when"),
    [
        ("qwen3_moe", "whole", "inside"),  # compiled first inside the block
        ("qwen3_moe", "whole", "prepared"),  # prepare_replay, then torch.compile
        ("qwen3_moe", "whole", "before"),  # compiled and run natively, never prepared
        ("qwen3_moe", "module.compile", "before"),
        ("qwen3_moe", "per-layer", "inside"),
        ("qwen3_moe", "per-layer", "before"),
        ("deepseek_v3", "whole", "before"),
        ("deepseek_v3", "per-layer", "prepared"),
        ("gpt_oss", "whole", "inside"),
        ("gpt_oss", "module.compile", "prepared"),
    ],
)
def test_compiled_replay_equals_eager_replay(family, style, when):
    model, eager = tiny_model(family), tiny_model(family)  # same seed: the same weights
    layout = layout_of(model)
    ids = input_ids()
    # Two batches of one shape whose missing rows differ (the second has none at all).
    first = random_routes(layout, (B, S), seed=1, missing=0.3)
    second = random_routes(layout, (B, S), seed=2)
    with torch.no_grad():
        native = eager(input_ids=ids).logits
        with replay(eager, first):
            expected_first = eager(input_ids=ids).logits
        with replay(eager, second):
            expected_second = eager(input_ids=ids).logits
        assert not torch.equal(expected_first, native)  # the routes change the routing

        graphs = Graphs()
        if when == "prepared":
            prepare_replay(model)
        run = compiled(model, style, graphs)
        if when == "before":
            assert torch.equal(run(input_ids=ids).logits, native)
        before = graphs.count
        with replay(model, first):
            assert torch.equal(run(input_ids=ids).logits, expected_first)
        replaying = graphs.count - before
        with replay(model, second):  # a new batch of the same shape: no recompile
            assert torch.equal(run(input_ids=ids).logits, expected_second)
        assert graphs.count == before + replaying
        # After the block: native, compiled again once into the native variant at most...
        assert torch.equal(run(input_ids=ids).logits, native)
        after = graphs.count
        # ... and each variant is reused from then on.
        with replay(model, first):
            assert torch.equal(run(input_ids=ids).logits, expected_first)
        assert torch.equal(run(input_ids=ids).logits, native)
        assert graphs.count == after
    assert not counters["graph_break"], dict(counters["graph_break"])
    if style != "per-layer":
        # One graph for the whole replayed model: no graph break per layer (nor anywhere).
        assert replaying == 1
        assert after - before == 2  # the replaying variant and the native one
    elif when == "before":  # the MoE layers' graphs are compiled again with replay's routers
        assert replaying == layout.num_moe_layers
    else:  # each decoder layer its own graph (natively too: Dynamo specialises on layer_idx)
        assert replaying == len(model.model.layers)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_compiled_backward_router_grads_equal_eager_replay(family):
    model, eager = tiny_model(family).train(), tiny_model(family).train()
    layout = layout_of(model)
    ids = input_ids(seed=4)
    run = torch.compile(model, backend="aot_eager")

    def step(m, forward, routes):
        m.zero_grad(set_to_none=True)
        with replay(m, routes):
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    for seed in (5, 6):
        routes = random_routes(layout, (B, S), seed=seed, missing=0.2)
        loss, grads = step(model, run, routes)
        loss_eager, grads_eager = step(eager, eager, routes)
        assert torch.equal(loss, loss_eager)
        assert grads.keys() == grads_eager.keys()
        for name in grads:  # aot_eager runs eager's ATen ops: bitwise, router weights included
            assert torch.equal(grads[name], grads_eager[name]), name
        routers = [r.name for r in find_routers(model).routers]
        router_grads = [n for n in grads if any(n.startswith(r + ".") for r in routers)]
        assert len(router_grads) >= layout.num_moe_layers
        assert all(grads[n].abs().sum() > 0 for n in router_grads)


def test_inductor_forward_backward_prepared_whole_model():
    family = "qwen3_moe"
    model, eager = tiny_model(family).train(), tiny_model(family).train()
    layout = layout_of(model)
    ids = input_ids(seed=7)
    prepare_replay(model)
    graphs = Graphs("inductor")
    run = torch.compile(model, backend=graphs)
    with torch.no_grad():
        native = eager(input_ids=ids).logits
    for seed in (8, 9):
        routes = random_routes(layout, (B, S), seed=seed, missing=0.3)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        with replay(model, routes):
            out = run(input_ids=ids, labels=ids)
            out.loss.backward()
        with replay(eager, routes):
            ref = eager(input_ids=ids, labels=ids)
            ref.loss.backward()
        # Inductor fuses and reorders float reductions (compiled without replay it differs
        # from eager by ~1e-7 as well), so close, not bitwise. Another routing would be far off.
        assert (ref.logits - native).abs().max() > 1e-3
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert graphs.count == 1  # one forward graph, the second batch reusing it
    with torch.no_grad():  # native after the block
        torch.testing.assert_close(run(input_ids=ids).logits, native, rtol=1e-5, atol=1e-5)


def test_inductor_compiled_before_replay_per_layer():
    family = "deepseek_v3"
    model, eager = tiny_model(family), tiny_model(family)
    layout = layout_of(model)
    ids = input_ids(seed=10)
    routes = random_routes(layout, (B, S), seed=11, missing=0.3)
    with torch.no_grad():
        native = eager(input_ids=ids).logits
        with replay(eager, routes):
            expected = eager(input_ids=ids).logits
        run = compiled(model, "per-layer", "inductor")
        torch.testing.assert_close(run(input_ids=ids).logits, native, rtol=1e-5, atol=1e-5)
        with replay(model, routes):
            got = run(input_ids=ids).logits
        assert (expected - native).abs().max() > 1e-3
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run(input_ids=ids).logits, native, rtol=1e-5, atol=1e-5)


def test_another_instance_compiled_without_replay_stays_native():
    # Dynamo shares compiled code between instances of a class (it guards on structure, not
    # identity): an unprepared instance's code must not run a prepared one, nor the reverse.
    other, model, eager = tiny_model("qwen3_moe"), tiny_model("qwen3_moe"), tiny_model("qwen3_moe")
    ids = input_ids()
    routes = random_routes(layout_of(model), (B, S), seed=12, missing=0.3)
    with torch.no_grad():
        native = eager(input_ids=ids).logits
        with replay(eager, routes):
            expected = eager(input_ids=ids).logits
        run_other = torch.compile(other, backend="aot_eager")
        assert torch.equal(run_other(input_ids=ids).logits, native)
        run = torch.compile(model, backend="aot_eager")
        with replay(model, routes):
            assert torch.equal(run(input_ids=ids).logits, expected)
            assert torch.equal(run_other(input_ids=ids).logits, native)
        assert torch.equal(run(input_ids=ids).logits, native)
    assert not is_prepared(other)


def test_compiled_function_first_compiled_inside_the_block_is_native_after():
    model, eager = tiny_model("gpt_oss"), tiny_model("gpt_oss")
    ids = input_ids()
    routes = random_routes(layout_of(model), (B, S), seed=13, missing=0.3)
    logits = torch.compile(lambda x: model(input_ids=x).logits, backend="aot_eager")
    with torch.no_grad():
        native = eager(input_ids=ids).logits
        with replay(eager, routes):
            expected = eager(input_ids=ids).logits
        with replay(model, routes):
            assert torch.equal(logits(ids), expected)
        assert torch.equal(logits(ids), native)  # not the block's routes, baked in


# -- errors under compile: before the forward, never silent ------------------------------------


def test_compiled_batch_shape_mismatch_raises_before_the_experts():
    model = tiny_model("deepseek_v3")
    run = torch.compile(model, backend="aot_eager")
    routes = random_routes(layout_of(model), (B, S), seed=14)
    calls = experts_calls(model)
    with torch.no_grad():
        run(input_ids=input_ids())  # compiled natively first
        calls.clear()
        message = re.escape(
            "routes have batch shape [2, 5] but the model is called with input shape [2, 6]"
        )
        with pytest.raises(InvalidRoutesError, match=message), replay(model, routes[:, :-1]):
            run(input_ids=input_ids())
        assert not calls  # no expert ran
        with replay(model, routes):  # the model is fine afterwards
            run(input_ids=input_ids())
    # fullgraph=True cannot fall back to eager to raise: Dynamo raises, with our message.
    torch._dynamo.reset()  # (else the fall-back to eager above is remembered for this code)
    strict = torch.compile(model, backend="aot_eager", fullgraph=True)
    with (
        pytest.raises(torch._dynamo.exc.Unsupported, match=message),
        replay(model, routes[:, :-1]),
        torch.no_grad(),
    ):
        strict(input_ids=input_ids())


def test_compiled_router_bypassed_by_a_fused_kernel_fails_loudly():
    model = tiny_model("gpt_oss")
    mlp = model.model.layers[1].mlp

    def fused(hidden_states):  # what a hub kernel does: routes from router.weight directly
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, ids = torch.topk(F.linear(flat, mlp.router.weight).softmax(-1), 2)
        return mlp.experts(flat, ids, weights).reshape(hidden_states.shape), weights

    mlp.forward = fused
    run = torch.compile(model, backend="aot_eager")
    routes = random_routes(layout_of(model), (B, S), seed=15)
    error = pytest.raises(UnsupportedModelError, match=r"without calling the routers.*layers\.1")
    with error, replay(model, routes), torch.no_grad():
        run(input_ids=input_ids())


def test_unguarded_stance_is_refused_before_the_forward():
    model = tiny_model("qwen3_moe")
    run = torch.compile(model, backend="aot_eager")
    routes = random_routes(layout_of(model), (B, S), seed=16)
    calls = experts_calls(model)
    with torch.no_grad():
        run(input_ids=input_ids())
        calls.clear()
        with (
            torch.compiler.set_stance(skip_guard_eval_unsafe=True),
            pytest.raises(UnsupportedModelError, match="skip_guard_eval_unsafe"),
            replay(model, routes),
        ):
            run(input_ids=input_ids())
    assert not calls


def test_nested_blocks_on_one_model_are_refused():
    model = tiny_model("qwen3_moe")
    routes = random_routes(layout_of(model), (B, S), seed=17)
    with replay(model, routes), pytest.raises(RoutingReplayError, match="already active"):
        replay(model, routes).__enter__()
    with replay(model, routes), torch.no_grad():  # the outer block closed cleanly
        model(input_ids=input_ids())


def accelerate_style_hook(module, calls):
    """What accelerate's add_hook_to_module does: a new instance forward around the old one."""
    old_forward = module.forward

    def new_forward(module, *args, **kwargs):
        calls.append(1)
        return old_forward(*args, **kwargs)

    module.forward = functools.update_wrapper(functools.partial(new_forward, module), old_forward)


@pytest.mark.parametrize("order", ["hooked before replay, compiled", "hooked after replay"])
def test_other_instance_forwards_on_routers_are_kept(order):
    model, eager = tiny_model("deepseek_v3"), tiny_model("deepseek_v3")
    ids = input_ids()
    routes = random_routes(layout_of(model), (B, S), seed=22, missing=0.3)
    routers = [r.module for r in find_routers(model).routers]
    calls = []
    with torch.no_grad():
        native = eager(input_ids=ids).logits
        with replay(eager, routes):
            expected = eager(input_ids=ids).logits
        run = model
        if order == "hooked after replay":
            prepare_replay(model)
        for router in routers:
            accelerate_style_hook(router, calls)
        if order != "hooked after replay":
            run = torch.compile(model, backend="aot_eager")
            assert torch.equal(run(input_ids=ids).logits, native)
            assert not is_prepared(model)
        else:
            assert is_prepared(model)  # their forward calls ours (its __wrapped__)
        calls.clear()
        with replay(model, routes):
            assert torch.equal(run(input_ids=ids).logits, expected)
        assert torch.equal(run(input_ids=ids).logits, native)
    assert len(calls) == 2 * len(routers)  # their forward ran in both forwards, compiled too
    outer = functools.partial if order == "hooked after replay" else forcing.ReplayingForward
    assert all(isinstance(r.__dict__["forward"], outer) for r in routers)
    assert is_prepared(model)


def test_prepared_model_survives_deepcopy_and_pickling():
    model = tiny_model("qwen3_moe")
    ids = input_ids()
    routes = random_routes(layout_of(model), (B, S), seed=18)
    prepare_replay(model)
    with torch.no_grad():
        native = model(input_ids=ids).logits
        with replay(model, routes):
            expected = model(input_ids=ids).logits
        twin = copy.deepcopy(model)  # e.g. a reference model
        assert is_prepared(twin)
        twin.model.layers[0].mlp.gate.weight.mul_(2.0)  # its routers use its own weights
        twin_native = twin(input_ids=ids).logits
        assert not torch.equal(twin_native, native)
        with replay(model, routes):  # the original's block does not reach the copy
            assert torch.equal(twin(input_ids=ids).logits, twin_native)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert is_prepared(loaded)
        with replay(loaded, routes):
            assert torch.equal(loaded(input_ids=ids).logits, expected)


# -- the device copy: narrow ids, widened per layer, freed on exit -----------------------------


def test_device_copy_is_narrow_widened_per_layer_and_freed_on_exit():
    model = tiny_model("qwen3_moe")
    layout = layout_of(model)
    routes = random_routes(layout, (B, S), seed=19, missing=0.3).to(torch.int64)
    widths = []
    for router in find_routers(model).routers:
        mlp = model.get_submodule(router.name.rsplit(".", 1)[0])
        mlp.experts.register_forward_pre_hook(lambda module, args: widths.append(args[1].dtype))
    block = replay(model, routes)
    (held,) = block._on_device.values()
    assert held.ids.dtype == torch.uint8 and held.missing.dtype == torch.bool
    rows = B * S * layout.num_moe_layers
    assert block.device_bytes == rows * layout.top_k + rows  # 1 byte per id, 1 per (token, layer)
    with block, torch.no_grad():
        model(input_ids=input_ids())
        state = block._state
    assert widths == [torch.int64] * layout.num_moe_layers  # the experts get int64 ids
    assert block.device_bytes == 0 and not block._on_device
    assert not state.active and state.layer_routes is None and state.owner is None
    with block, torch.no_grad():  # a block entered again copies its routes again
        model(input_ids=input_ids())
    assert [staging.id_dtype(e) for e in (8, 256, 257, 2**15, 2**15 + 1)] == [
        torch.uint8,
        torch.uint8,
        torch.int16,
        torch.int16,
        torch.int32,
    ]


# -- attention_mask: padding positions hold no routes ------------------------------------------


def left_padded_mask():
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0  # row 0: 2 padding positions, then 4 tokens
    return mask


def routes_at(layout, mask, seed, shift=0, right=False):
    """Routes where `mask` has tokens (moved by `shift`, or packed to the left if `right`)."""
    full = random_routes(layout, (B, S), seed=seed)
    out = torch.full_like(full, MISSING)
    for b in range(B):
        positions = torch.nonzero(mask[b]).flatten()
        if right:
            positions = torch.arange(len(positions))
        positions = positions + shift
        keep = (positions >= 0) & (positions < S)
        out[b, positions[keep]] = full[b, positions[keep]]
    return out


SUFFIX = (
    ". Routes must be aligned with input_ids position by position (to_torch(batch, "
    "attention_mask=mask) pads them like the batch)"
)


PADDING_CASES = {
    "right-padded routes": (
        "routes hold expert ids at padding position [0, 0] (attention_mask is 0 there; 2 "
        "padding positions hold routes): routes are misaligned with the batch, likely "
        "right-padded routes for a left-padded batch (this row's routes start at position "
        "0, its tokens start at 2)"
    ),
    "left-padded routes": (
        "routes hold expert ids at padding position [0, 4] (attention_mask is 0 there; 2 "
        "padding positions hold routes): routes are misaligned with the batch, likely "
        "left-padded routes for a right-padded batch (this row's routes end at the last "
        "position, its tokens end at 3)"
    ),
    "one earlier": (
        "routes hold expert ids at padding position [0, 1] (attention_mask is 0 there; 1 "
        "padding positions hold routes): routes are misaligned with the batch, likely "
        "shifted by one position (earlier than the tokens: an off-by-one)"
    ),
    "one later": (
        "routes hold expert ids at padding position [0, 4] (attention_mask is 0 there; 1 "
        "padding positions hold routes): routes are misaligned with the batch, likely "
        "shifted by one position (later than the tokens: an off-by-one)"
    ),
}


@pytest.mark.parametrize("case", sorted(PADDING_CASES))
def test_routes_at_padding_positions_are_refused(case):
    message = PADDING_CASES[case]
    model = tiny_model("deepseek_v3")
    layout = layout_of(model)
    mask = left_padded_mask()
    if case == "right-padded routes":
        routes = routes_at(layout, mask, seed=20, right=True)
    elif case == "left-padded routes":
        mask = mask.flip(1)  # row 0: 4 tokens, then 2 padding positions
        routes = routes_at(layout, mask.flip(1), seed=20)
    elif case == "one earlier":
        routes = routes_at(layout, mask, seed=20, shift=-1)
    else:
        mask = mask.flip(1)
        routes = routes_at(layout, mask, seed=20, shift=1)
    with pytest.raises(InvalidRoutesError) as raised:
        replay(model, routes, attention_mask=mask)
    assert str(raised.value) == message + SUFFIX
    with pytest.raises(InvalidRoutesError, match=re.escape(message)):
        staging.validate_routes(routes, layout, attention_mask=mask.numpy())


def test_attention_mask_allows_missing_real_tokens_in_one_host_sync(monkeypatch):
    model = tiny_model("deepseek_v3")
    layout = layout_of(model)
    mask = left_padded_mask()
    routes = routes_at(layout, mask, seed=21)
    routes[0, 3] = MISSING  # a prefix-cache gap on a real token
    routes[1, -1, 0] = MISSING  # one missing layer of the last token
    syncs = []
    for name in ("tolist", "item", "cpu", "numpy", "nonzero", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda *a, _real=real, _n=name, **k: syncs.append(_n) or _real(*a, **k),
        )
    block = replay(model, routes, attention_mask=mask.bool())
    monkeypatch.undo()
    assert syncs == ["tolist"]  # the one host sync, shared with the range and repeat checks
    with block, torch.no_grad():
        model(input_ids=input_ids(), attention_mask=mask)
    with pytest.raises(InvalidRoutesError, match=r"attention_mask has shape \[2, 5\] but the"):
        replay(model, routes, attention_mask=mask[:, 1:])
