"""The whole trainer-side path on one machine: capture -> store -> read -> to_torch -> replay."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from moe_models import tiny_model

from routing_replay import RoutingLayout, RoutingStore, capture, replay, to_torch
from routing_replay.errors import InvalidArgumentError, LayoutMismatchError
from routing_replay.testing import tiny_moe


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


def test_routes_of_other_moe_layers_are_refused_at_replay(name):
    # The trainer's model routes in layers (1, 2, 3); the rollout's routes were stored for a
    # model whose MoE layers are (0, 1, 2): same L, same top-k, same expert count, so only
    # the layout can tell. read -> to_torch -> replay, with no extra argument, refuses them.
    model = tiny_moe(mlp_only_layers=[0])
    trained = RoutingLayout.from_hf_config(model.config)
    assert trained.moe_layers == (1, 2, 3)
    rollout = RoutingLayout(num_layers=4, top_k=4, num_experts=32, moe_layers=(0, 1, 2))
    tokens = torch.randint(3, 100, (1, 9))
    recorded = rollout.random_routes(np.random.default_rng(0), 9)
    with RoutingStore.create(name, rollout, capacity_tokens=256) as store:
        ref = store.put("s", recorded, token_ids=tokens[0])
        routes = to_torch(store.read([ref]), attention_mask=torch.ones(1, 9), input_ids=tokens)
    assert routes.layout == rollout and routes.shape == (1, 9, 3, 4)
    both = r"recorded under RoutingLayout\(.*moe_layers=\(0, 1, 2\)\), but the model's routers"
    with pytest.raises(LayoutMismatchError, match=both + r" are RoutingLayout\(.*\(1, 2, 3\)\)"):
        replay(model, routes)
    for carried in (routes[:, 2:], routes.unsqueeze(0)[0], routes.to(torch.int64)):
        with pytest.raises(LayoutMismatchError, match=both):  # views and casts keep it
            replay(model, carried)
    bare = routes.as_subclass(torch.Tensor)
    with pytest.raises(InvalidArgumentError, match="carry no layout"):
        replay(model, bare)
    with pytest.raises(LayoutMismatchError, match=both):
        replay(model, bare, layout=rollout)
    with pytest.raises(LayoutMismatchError, match=r"carry layout .* but layout="):
        replay(model, routes, layout=trained)
    with replay(model, bare, layout="unchecked"), torch.no_grad():  # the caller vouches
        model(input_ids=tokens)
