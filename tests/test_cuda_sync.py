"""On CUDA: capture's and replay's hooks never synchronise the device (skipped without CUDA).

The hooks run under torch.cuda.set_sync_debug_mode("error"), which raises on any
synchronising call (.item(), .cpu(), .nonzero(), a blocking copy). The HF experts loop
itself synchronises (it calls nonzero), so only routing_replay's own code is run in that mode.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from moe_models import tiny_model

from routing_replay import RoutingLayout, capture, replay

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
    rep = replay(model, routes)  # validated on the host, before anything runs
    with rep, torch.no_grad():
        with no_sync():
            for router in (r.module for r in rep.moe.routers):
                _, _, ids = router(hidden)
        assert len(rep._on_device) == 1  # one copy of the batch's routes, not one per layer
    flat = routes.reshape(10, layout.num_moe_layers, layout.top_k)
    assert torch.equal(ids.cpu()[2:], flat[2:, -1].long())
