"""Vision-language MoE models: capture and replay the text stack, image tokens included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moe_models import IMAGE_TOKEN, VL_CONFIGS, tiny_vl_model

from routing_replay import MISSING, RoutingLayout, capture, replay
from routing_replay.model.adapters import find_routers

# Two samples: text, an image start marker, the image's 4 tokens, (an end marker,) text.
PROMPTS = {
    "qwen3_vl_moe": [[5, 92, 90, 90, 90, 90, 7, 8], [9, 92, 90, 90, 90, 90, 10, 11]],
    "glm4v_moe": [[5, 92, 90, 90, 90, 90, 93, 8], [9, 92, 90, 90, 90, 90, 93, 11]],
}


@pytest.fixture(params=sorted(VL_CONFIGS))
def family(request):
    return request.param


def inputs(family: str, ids: torch.Tensor | None = None) -> dict:
    """Model inputs with one random 4 x 4-patch image per sample."""
    ids = torch.tensor(PROMPTS[family]) if ids is None else ids
    g = torch.Generator().manual_seed(7)
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=torch.randn(2 * 16, 3 * 4 * 4, generator=g),
        image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]),
        mm_token_type_ids=(ids == IMAGE_TOKEN).long(),
    )


def test_layout_and_routers_come_from_the_text_stack(family):
    model = tiny_vl_model(family)
    layout = RoutingLayout.from_hf_config(model.config)
    moe = find_routers(model)
    assert [r.layer for r in moe.routers] == list(layout.moe_layers)
    assert all(".language_model.layers." in r.name for r in moe.routers)


def test_capture_then_replay_with_an_image_reproduces_logits(family):
    model = tiny_vl_model(family)
    with capture(model) as cap, torch.no_grad():
        native = model(**inputs(family)).logits
    routes = cap.routes()
    assert [len(r) for r in routes] == [8, 8]  # image tokens are routed rows like any other
    # The text stack got embeddings; the token ids come from the model's own input.
    assert [t.tolist() for t in cap.token_ids()] == PROMPTS[family]
    with replay(model, torch.from_numpy(np.stack(routes)), layout=cap.layout), torch.no_grad():
        replayed = model(**inputs(family)).logits
    assert torch.equal(native, replayed)


def test_replay_forces_the_given_ids_on_image_tokens(family):
    model = tiny_vl_model(family)
    layout = RoutingLayout.from_hf_config(model.config)
    rng = np.random.default_rng(3)
    keys = rng.random((2, 8, layout.num_moe_layers, layout.num_experts))
    forced = torch.from_numpy(np.argsort(keys, -1)[..., : layout.top_k].astype(np.int32))
    seen = []
    moe = find_routers(model)
    blocks = [model.get_submodule(r.name.rsplit(".", 1)[0]) for r in moe.routers]
    hooks = [
        b.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
        for b in blocks
    ]
    with replay(model, forced, layout=layout), torch.no_grad():
        model(**inputs(family))
    for h in hooks:
        h.remove()
    for j, ids_TK in enumerate(seen):
        assert torch.equal(ids_TK, forced[:, :, j].reshape(-1, layout.top_k).long())


def test_capture_follows_generate_with_an_image(family):
    model = tiny_vl_model(family)
    kw = inputs(family)
    with capture(model) as cap, torch.no_grad():
        out = model.generate(**kw, max_new_tokens=3, do_sample=False, eos_token_id=None)
    routes = cap.routes()
    assert [len(r) for r in routes] == [11, 11]
    assert [t.tolist() for t in cap.token_ids()] == out.tolist()
    for r in routes:  # the last generated token is never forwarded
        assert (r[:-1] != MISSING).all() and (r[-1] == MISSING).all()
    # A forward over the whole generated sequences routes every forwarded token the same.
    with capture(model) as full, torch.no_grad():
        model(**inputs(family, out))
    for step, whole in zip(routes, full.routes(), strict=True):
        assert np.array_equal(step[:-1], whole[:-1])
