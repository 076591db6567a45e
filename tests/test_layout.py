"""RoutingLayout: HF configs of every MoE family, storage dtype, encode/decode at the edge."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from transformers import (
    DeepseekV3Config,
    DeepseekV4Config,
    Ernie4_5_MoeConfig,
    Glm4MoeConfig,
    GptOssConfig,
    HunYuanMoEV1Config,
    JambaConfig,
    Lfm2MoeConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from routing_replay import InvalidRoutesError, RoutingLayout


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (Qwen3MoeConfig(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8),
         RoutingLayout(48, 8, 128)),
        (Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]),
         RoutingLayout(6, 8, 128, (1, 5))),
        (Qwen2MoeConfig(num_hidden_layers=4, num_experts=60, num_experts_per_tok=4,
                        mlp_only_layers=[0]),
         RoutingLayout(4, 4, 60, (1, 2, 3))),
        (MixtralConfig(num_hidden_layers=32), RoutingLayout(32, 2, 8)),
        (OlmoeConfig(num_hidden_layers=16), RoutingLayout(16, 8, 64)),
        (DeepseekV3Config(), RoutingLayout(61, 8, 256, tuple(range(3, 61)))),
        (Glm4MoeConfig(num_hidden_layers=46, n_routed_experts=160, first_k_dense_replace=3),
         RoutingLayout(46, 8, 160, tuple(range(3, 46)))),
        (GptOssConfig(num_hidden_layers=24, num_local_experts=32),
         RoutingLayout(24, 4, 32)),
        (Ernie4_5_MoeConfig(), RoutingLayout(28, 6, 64, tuple(range(1, 28)))),
        # 3 hash-routed layers, then learned routers: all 43 route.
        (DeepseekV4Config(), RoutingLayout(43, 6, 256)),
        (Ernie4_5_MoeConfig(num_hidden_layers=8, moe_layer_start_index=2, moe_layer_end_index=6,
                            moe_layer_interval=2),
         RoutingLayout(8, 6, 64, (3, 5))),
        (Lfm2MoeConfig(), RoutingLayout(32, 4, 32, tuple(range(2, 32)))),
        (JambaConfig(), RoutingLayout(32, 2, 16, tuple(range(1, 32, 2)))),
        (HunYuanMoEV1Config(num_hidden_layers=4, num_experts=16, moe_topk=2),
         RoutingLayout(4, 2, 16)),
        # Older HunYuan configs list the expert count and top-k per layer.
        (SimpleNamespace(num_hidden_layers=2, num_experts=[16, 16], moe_topk=[2, 2]),
         RoutingLayout(2, 2, 16)),
    ],
)  # fmt: skip
def test_from_hf_config(config, expected):
    assert RoutingLayout.from_hf_config(config) == expected


def test_storage_dtype_and_bytes():
    qwen3 = RoutingLayout(48, 8, 128)
    assert (qwen3.dtype, qwen3.missing, qwen3.bytes_per_token) == (np.uint8, 255, 384)
    assert qwen3.signed_dtype == np.int8  # 255 reads back as -1 with no conversion
    glm = RoutingLayout(46, 8, 160, tuple(range(3, 46)))
    assert (glm.dtype, glm.signed_dtype) == (np.uint8, np.int16)
    dsv3 = RoutingLayout(61, 8, 256, tuple(range(3, 61)))
    assert (dsv3.dtype, dsv3.missing, dsv3.bytes_per_token) == (np.uint16, 65535, 928)
    assert dsv3.signed_dtype == np.int16
    assert RoutingLayout(4, 2, 255).dtype == np.uint8
    assert RoutingLayout(4, 2, 256).dtype == np.uint16


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [
        (e, d)
        for e in (8, 128, 160, 256, 40_000)
        for d in (np.int64, np.int32, np.int16, np.uint16, np.uint8)
        if e - 1 <= np.iinfo(d).max  # ids must fit the input dtype
    ],
)
def test_encode_decode_round_trip(experts, dtype):
    layout = RoutingLayout(5, 3, experts, (0, 2, 4))
    info = np.iinfo(dtype)
    rng = np.random.default_rng(experts)
    routes = rng.integers(0, experts, (40, 5, 3)).astype(dtype)
    if info.min < 0:
        routes[::7] = -1
    elif dtype == layout.dtype:
        routes[::7] = layout.missing  # narrow engine output marks missing with the max
    stored = layout.encode(routes)
    assert stored.dtype == layout.dtype
    back = layout.decode(stored)
    expected = routes[:, [0, 2, 4]].astype(np.int64)
    expected[expected == layout.missing] = -1
    assert back.dtype == layout.signed_dtype
    assert np.array_equal(back, expected)


def test_invalid_layouts_and_routes():
    with pytest.raises(ValueError, match="top_k=9 exceeds"):
        RoutingLayout(4, 9, 8)
    with pytest.raises(ValueError, match="moe_layers"):
        RoutingLayout(4, 2, 8, (3, 1))
    with pytest.raises(ValueError, match="moe_layers"):
        RoutingLayout(4, 2, 8, (4,))
    layout = RoutingLayout(4, 2, 8, (1, 3))
    with pytest.raises(InvalidRoutesError, match=r"expert id 8 at token 1, MoE layer 0"):
        layout.encode(np.array([[[0, 1], [2, 3]], [[8, 1], [2, 3]]]))
    with pytest.raises(InvalidRoutesError, match="have 3 layers"):
        layout.encode(np.zeros((2, 3, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="does not look like an MoE config"):
        RoutingLayout.from_hf_config(type("Dense", (), {"num_hidden_layers": 2})())
    odd = SimpleNamespace(
        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, mlp_layer_types=["x", "dense"]
    )
    with pytest.raises(ValueError, match=r"mlp_layer_types has \['x'\]"):
        RoutingLayout.from_hf_config(odd)
    per_layer = SimpleNamespace(num_hidden_layers=2, num_experts=[16, 32], moe_topk=2)
    with pytest.raises(ValueError, match=r"expert count differs between layers \(\[16, 32\]\)"):
        RoutingLayout.from_hf_config(per_layer)
