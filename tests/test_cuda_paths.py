"""The CUDA paths, end to end on a GPU (skipped without one): reads into pinned memory, routes
staged to the device, capture of a CUDA generate, replay of its routes at the experts.

`tests/test_cuda_sync.py` checks that the hooks never synchronise; these check the values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moe_models import tiny_model

from routing_replay import RoutingLayout, RoutingStore, capture, replay, to_torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture
def store(name):
    layout = RoutingLayout(num_layers=4, top_k=4, num_experts=32)
    with RoutingStore.create(name, layout, capacity_tokens=4096, page_tokens=16) as s:
        yield s


def test_read_into_pinned_memory_then_to_the_device(store):
    rng = np.random.default_rng(0)
    samples = [store.layout.random_routes(rng, n) for n in (5, 40, 17)]
    refs = [store.put(f"s{i}", r) for i, r in enumerate(samples)]
    out = torch.empty(62 * store.layout.bytes_per_token, dtype=torch.uint8, pin_memory=True)
    routes = to_torch(store.read(refs, out=out))
    assert routes.data_ptr() == out.data_ptr() and routes.layout == store.layout
    on_device = routes.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert on_device.is_cuda and on_device.layout == store.layout
    np.testing.assert_array_equal(on_device.cpu().numpy(), np.concatenate(samples))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_cuda_capture_store_replay_reproduces_its_own_logits(family, name):
    model = tiny_model(family).cuda()
    layout = RoutingLayout.from_hf_config(model.config)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]], device="cuda")
    mask = (prompts != 0).long()
    with capture(model) as cap, torch.no_grad():
        out = model.generate(
            input_ids=prompts, attention_mask=mask, max_new_tokens=6, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    with RoutingStore.create(name, layout, capacity_tokens=1024) as store:
        refs = [
            store.put(f"s{b}", routes, token_ids=tokens)
            for b, (routes, tokens) in enumerate(zip(cap.routes(), cap.token_ids(), strict=True))
        ]
        train_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long, device="cuda")], dim=1)
        routes = to_torch(store.read(refs), attention_mask=train_mask.cpu(), input_ids=out.cpu())
    with torch.no_grad():
        native = model(input_ids=out, attention_mask=train_mask).logits
        with replay(model, routes, attention_mask=train_mask), capture(model) as used:
            replayed = model(input_ids=out, attention_mask=train_mask).logits
    # The model's own routes, replayed on the same device: the same experts, the same logits.
    torch.testing.assert_close(replayed, native, rtol=0, atol=0)
    for recorded, forced in zip(cap.routes(), used.routes(), strict=True):
        kept = (recorded != -1).all(-1)
        np.testing.assert_array_equal(forced[kept], recorded[kept])
