"""The whole trainer-side path on one machine: capture -> store -> read -> to_torch -> replay."""

from __future__ import annotations

import uuid

import pytest
import torch
from moe_models import tiny_model

from routing_replay import RoutingLayout, RoutingStore, capture, replay, to_torch


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_generate_store_and_replay_reproduces_rollout_routes(family):
    model = tiny_model(family)
    layout = RoutingLayout.from_hf_config(model.config)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (prompts != 0).long()
    with capture(model) as cap, torch.no_grad():
        out = model.generate(
            input_ids=prompts,
            attention_mask=mask,
            max_new_tokens=5,
            do_sample=True,
            eos_token_id=None,
        )
    store = RoutingStore.create(f"rr-test-{uuid.uuid4().hex[:8]}", layout, capacity_tokens=1024)
    try:
        refs = [
            store.put(f"s{b}", routes, prompt_len=int(mask[b].sum()), token_ids=tokens)
            for b, (routes, tokens) in enumerate(zip(cap.routes(), cap.token_ids(), strict=True))
        ]
        # The trainer's batch: the rollout's left-padded sequences, routes aligned by the mask.
        train_mask = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], dim=1)
        routes_BSLK = to_torch(store.read(refs), attention_mask=train_mask)
    finally:
        store.close()
        store.unlink()
    with torch.no_grad():
        native = model(input_ids=out, attention_mask=train_mask).logits
        with replay(model, routes_BSLK), capture(model) as used:
            replayed = model(input_ids=out, attention_mask=train_mask).logits
    # The same model and precision: replaying its own rollout routes changes nothing...
    assert torch.equal(native, replayed)
    # ... and every routed token was forced to the rollout's experts.
    for recorded, forced in zip(cap.routes(), used.routes(), strict=True):
        keep = (recorded != -1).all(-1)
        assert (forced[keep] == recorded[keep]).all()
