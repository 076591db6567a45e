"""On CUDA: capture's and replay's hooks never synchronise the device (skipped without CUDA).

The hooks run under torch.cuda.set_sync_debug_mode("error"), which raises on any
synchronising call (.item(), .cpu(), .nonzero(), a blocking copy). The HF experts loop
itself synchronises (it calls nonzero), so only routing_replay's own code is run in that mode:
called directly, or, under a whole `generate`, each of Capture's hook functions switched
into that mode while it runs (`strict_hooks`). tests/test_capture_sync.py checks the same
on the CPU with a counter of host reads.
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import numpy as np
import pytest
import torch
from moe_models import tiny_model

from routing_replay import RoutingLayout, capture, replay
from routing_replay.model.capture import Capture

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def strict_hooks(monkeypatch) -> collections.Counter:
    """Run each of Capture's hook functions in sync-debug "error" mode; count their calls."""
    calls: collections.Counter = collections.Counter()

    def strict(fn, name):
        def run(*args, **kwargs):
            calls[name] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    def lenient(fn):  # transformers' own prepare step, called from capture's wrapper
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("default")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        return run

    for name in ("_begin", "_end", "_outer_begin"):
        monkeypatch.setattr(Capture, name, strict(Capture.__dict__[name], name))
    recorder = Capture.__dict__["_recorder"]
    monkeypatch.setattr(Capture, "_recorder", lambda cap, j: strict(recorder(cap, j), "router"))
    wrap_prepare = Capture.__dict__["_wrap_prepare"]
    monkeypatch.setattr(
        Capture,
        "_wrap_prepare",
        lambda cap, prepare: strict(wrap_prepare(cap, lenient(prepare)), "prepare"),
    )
    return calls


NEW = 4  # new tokens: the prefill, then 3 decode steps
PROMPT = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])  # row 0 left padded
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
FULL = torch.tensor([[9, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])


def generate(model, impl, prompt, mask):
    kw = (
        {"do_sample": False} if impl is None else {"do_sample": False, "cache_implementation": impl}
    )
    mask = None if mask is None else mask.cuda()
    with capture(model) as cap, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            prompt.cuda(), attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, **kw
        )
    return out.cpu(), cap.routes(), cap.token_ids()


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
@pytest.mark.parametrize(
    ("family", "impl"),
    [
        ("qwen3_moe", "static"),  # StaticCache: every layer's length is a device tensor
        ("gpt_oss", "static"),  # sliding layers: python ints; full ones: device tensors
        ("qwen3_5_moe", "static"),  # hybrid: linear attention + static full attention
        ("qwen3_5_moe", None),  # hybrid, dynamic
        ("minimax", None),  # MiniMax's own hybrid cache (static is ignored for it)
    ],
)
def test_capture_hooks_do_not_sync_under_generate(monkeypatch, family, impl, padded):
    model = tiny_model(family).cuda()
    prompt, mask = (PROMPT, MASK) if padded else (FULL, None)
    torch.cuda.synchronize()
    calls = strict_hooks(monkeypatch)
    out, routes, tokens = generate(model, impl, prompt, mask)
    monkeypatch.undo()
    assert calls["_begin"] == calls["_end"] == NEW  # every forward ran through the hooks
    assert calls["router"] == NEW * len(routes[0][0])
    # The same routes as the same generate with a DynamicCache and no strict mode.
    ref_out, ref_routes, ref_tokens = generate(model, None, prompt, mask)
    assert torch.equal(out, ref_out)
    assert [len(r) for r in routes] == ([4 + NEW, 6 + NEW] if padded else [6 + NEW] * 2)
    for a, b in zip(routes + tokens, ref_routes + ref_tokens, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_capture_hooks_do_not_sync(family):
    model = tiny_model(family).cuda()
    cap = capture(model)
    routers = [r.module for r in cap.moe.routers]
    input_ids = torch.randint(3, 97, (2, 5), device="cuda")
    hidden = torch.randn(10, model.config.hidden_size, device="cuda")
    with cap, torch.no_grad():
        with no_sync():
            cap._begin(cap.moe.decoder, (), {"input_ids": input_ids})
            for router in routers:  # the router's own forward plus the capture hook
                router(hidden)
            cap._end(cap.moe.decoder, (), None)  # one stack, one async copy to pinned memory
        routes = cap.routes()  # the one wait
    assert len(routes) == 2 and routes[0].shape[0] == 5


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_replay_hooks_do_not_sync_and_copy_routes_once(family):
    model = tiny_model(family).cuda()
    layout = RoutingLayout.from_hf_config(model.config)
    routes = torch.randint(0, layout.num_experts, (2, 5, layout.num_moe_layers, 1))
    routes = routes + torch.arange(layout.top_k)  # distinct ids per row
    routes = routes % layout.num_experts
    routes[0, :2] = -1
    hidden = torch.randn(10, model.config.hidden_size, device="cuda")
    rep = replay(model, routes, layout=layout)  # validated on the host, before anything runs
    with rep, torch.no_grad():
        with no_sync():
            for router in (r.module for r in rep.moe.routers):
                _, _, ids = router(hidden)
        assert len(rep._on_device) == 1  # one copy of the batch's routes, not one per layer
    flat = routes.reshape(10, layout.num_moe_layers, layout.top_k)
    assert torch.equal(ids.cpu()[2:], flat[2:, -1].long())
