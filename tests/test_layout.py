"""RoutingLayout: HF configs of every MoE family, storage dtype, encode/decode at the edge."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from hf_configs import build, routers, tiny
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

from routing_replay import RoutingLayout, capture, replay
from routing_replay.errors import InvalidArgumentError, InvalidRoutesError


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
    with pytest.raises(
        ValueError, match=r"expert count \(num_experts\) differs between MoE layers \(\[16, 32\]\)"
    ):
        RoutingLayout.from_hf_config(per_layer)


# -- families whose layout needs more than the common fields (transformers 5.25) ----------
# (config, expected layout, model class, router class): the tiny model built from the config
# must have that router exactly at the layout's MoE layers, with num_experts output rows.
FAMILIES = {
    # Gemma 4: `top_k_experts`; every decoder layer has the MoE block when enabled.
    "gemma4_text": (
        lambda: tiny("Gemma4TextConfig", num_hidden_layers=3, enable_moe_block=True,
                     hidden_size_per_layer_input=16, vocab_size_per_layer_input=256),
        RoutingLayout(3, 2, 8), "Gemma4TextModel", "Gemma4TextRouter",
    ),
    "diffusion_gemma_text": (
        lambda: tiny("DiffusionGemmaTextConfig", num_hidden_layers=3),
        RoutingLayout(3, 2, 8), "DiffusionGemmaEncoderTextModel", "DiffusionGemmaTextRouter",
    ),
    # DBRX: E and K in the nested `ffn_config`, `n_layers` for num_hidden_layers.
    "dbrx": (
        lambda: tiny("DbrxConfig", n_layers=3, n_heads=4, max_seq_len=64,
                     attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                     ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 6, "moe_top_k": 3}),
        RoutingLayout(3, 3, 6), "DbrxModel", "DbrxRouter",
    ),
    # LongCat-Flash: 2 decoder layers (num_hidden_layers says 4), 8 routed + 2 zero experts.
    "longcat_flash": (
        lambda: tiny("LongcatFlashConfig", num_layers=2, zero_expert_num=2, head_dim=8,
                     ffn_hidden_size=64),
        RoutingLayout(2, 2, 10), "LongcatFlashModel", "LongcatFlashTopkRouter",
    ),
    # Nemotron-H: blocks; only the 'moe' ones route.
    "nemotron_h": (
        lambda: tiny("NemotronHConfig", layers_block_type=[
            "linear_attention", "moe", "full_attention", "mlp", "moe"]),
        RoutingLayout(5, 2, 8, (1, 4)), "NemotronHModel", "NemotronHTopkRouter",
    ),
    # Llama 4 Maverick-style interleaving: MoE every 2nd layer.
    "llama4_text": (
        lambda: tiny("Llama4TextConfig", num_hidden_layers=4, interleave_moe_layer_step=2,
                     intermediate_size_mlp=64),
        RoutingLayout(4, 2, 8, (1, 3)), "Llama4TextModel", "Llama4Router",
    ),
    # Kolibri 1.1: `mlp_only_layers` (default [0, 1]) without `decoder_sparse_step`.
    "kolibri1_1": (
        lambda: tiny("Kolibri1_1Config", num_hidden_layers=4, index_num_heads=2),
        RoutingLayout(4, 2, 8, (2, 3)), "Kolibri1_1Model", "Kolibri1_1TopKRouter",
    ),
    # Qwen3-Omni talker: MoE in every layer whatever decoder_sparse_step/mlp_only_layers say.
    "qwen3_omni_moe_talker_text": (
        lambda: tiny("Qwen3OmniMoeTalkerTextConfig", num_hidden_layers=3, decoder_sparse_step=2,
                     mlp_only_layers=[0], shared_expert_intermediate_size=32),
        RoutingLayout(3, 2, 8), "Qwen3OmniMoeTalkerModel", "Qwen3OmniMoeTalkerTextTopKRouter",
    ),
    # dots3 vision: expert counts per layer (`per_layer_config`), equal over the MoE layers.
    "dots3_note_vision": (
        lambda: tiny("Dots3NoteVisionConfig", num_hidden_layers=3, pyramid_num_routed=[-1, 4, 4],
                     adapter_in_dim=64, adapter_out_dim=64, patch_size=2),
        RoutingLayout(3, 2, 4, (1, 2)), "Dots3NoteVisionModel", "Dots3NoteVisionTopKRouter",
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_hf_config_reads_the_family(family):
    config, expected, _, _ = FAMILIES[family]
    assert RoutingLayout.from_hf_config(config()) == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_familys_routers_sit_at_the_layouts_moe_layers(family):
    make_config, _, model_class, router_class = FAMILIES[family]
    config = make_config()
    layout = RoutingLayout.from_hf_config(config)
    model = build(model_class, config)
    found = routers(model, router_class)
    assert [layer for layer, _ in found] == list(layout.moe_layers)
    for _, name in found:  # one score row per expert
        rows = {p.shape[0] for p in model.get_submodule(name).parameters() if p.dim() == 2}
        assert rows == {layout.num_experts}, name


def test_doge_routes_only_with_is_moe():
    with pytest.raises(InvalidArgumentError, match=r"DogeConfig has is_moe=False: .* dense"):
        RoutingLayout.from_hf_config(transformers.DogeConfig())  # names 16384 experts
    config = tiny("DogeConfig", num_hidden_layers=2, is_moe=True, num_experts=16)
    layout = RoutingLayout.from_hf_config(config)
    assert layout == RoutingLayout(2, 2, 16)
    # Its MoE block selects experts inline: no router module, the block is at each layer.
    model = build("DogeModel", config)
    assert [layer for layer, _ in routers(model, "DogeCDMoE")] == list(layout.moe_layers)
    dense = build("DogeModel", tiny("DogeConfig", num_hidden_layers=2))
    assert routers(dense, "DogeCDMoE") == []


def test_doge_layout_counts_the_experts_its_product_keys_reach():
    """Doge's MoE block picks expert ix * num_keys + iy with num_keys = floor(sqrt(num_experts))
    keys a half: with 8 experts, 2 keys, so ids 0..3 only. The layout counts those 4, so routes
    naming 4..7 (no forward picks them, and they have no score) are refused at replay."""
    config = tiny("DogeConfig", num_hidden_layers=2, is_moe=True, num_experts=8)
    layout = RoutingLayout.from_hf_config(config)
    assert layout == RoutingLayout(2, 2, 4)
    model = build("DogeForCausalLM", config)
    input_ids = torch.arange(3, 35).reshape(2, 16)
    with capture(model) as cap, torch.no_grad():
        model(input_ids=input_ids)
    assert cap.layout == layout
    routes = torch.from_numpy(np.stack(cap.routes()))
    assert set(routes.flatten().tolist()) == {0, 1, 2, 3}
    routes[0, 0, 0, 0] = 5  # an embedding row the block never looks up
    bad = r"expert id 5 .* \[0, 4\)"
    with pytest.raises(InvalidRoutesError, match=bad), replay(model, routes, layout=layout):
        model(input_ids=input_ids)


def test_inkling2_loop_without_looping_routes_once_per_layer():
    looped = transformers.Inkling2LoopTextConfig()  # layers 6..17 run 3 times: a layer a pass
    assert RoutingLayout.from_hf_config(looped).num_layers == 24 + 2 * 12
    config = tiny(
        "Inkling2LoopTextConfig", num_hidden_layers=3, loop_num_passes=1,
        loop_layer_index_start=1, loop_layer_index_end=2, n_layers_per_attn_res_block=1,
    )  # fmt: skip
    layout = RoutingLayout.from_hf_config(config)
    assert layout == RoutingLayout(3, 2, 8)
    model = build("Inkling2LoopTextModel", config)
    found = routers(model, "Inkling2LoopTopKRouter")
    assert [layer for layer, _ in found] == list(layout.moe_layers)


def test_longcat_routers_pick_zero_experts_past_the_routed_ones():
    config = FAMILIES["longcat_flash"][0]()
    assert config.num_hidden_layers == 4  # two attention sublayers per decoder layer
    model = build("LongcatFlashModel", config)
    router = model.layers[0].mlp.router
    with torch.no_grad():
        router.classifier.weight.zero_()
        router.e_score_correction_bias.copy_(torch.arange(10.0))  # zero experts 8, 9 win
        _, _, ids = router(torch.randn(3, 64))
    assert sorted(set(ids.flatten().tolist())) == [8, 9]
    assert RoutingLayout.from_hf_config(config).num_experts == 10


def test_multimodal_configs_use_their_moe_text_config():
    text = tiny("Gemma4TextConfig", num_hidden_layers=3, enable_moe_block=True)
    assert RoutingLayout.from_hf_config(
        transformers.Gemma4Config(text_config=text)
    ) == RoutingLayout(3, 2, 8)
    llama4 = tiny("Llama4TextConfig", num_hidden_layers=4, interleave_moe_layer_step=2)
    assert RoutingLayout.from_hf_config(
        transformers.Llama4Config(text_config=llama4)
    ) == RoutingLayout(4, 2, 8, (1, 3))
    diffusion = tiny("DiffusionGemmaTextConfig", num_hidden_layers=2)
    assert RoutingLayout.from_hf_config(
        transformers.DiffusionGemmaConfig(text_config=diffusion)
    ) == RoutingLayout(2, 2, 8)
    # Qwen3-Omni: the thinker (trained) and the talker nest text configs; the thinker's wins.
    thinker = tiny("Qwen3OmniMoeTextConfig", num_hidden_layers=4, decoder_sparse_step=2)
    omni = transformers.Qwen3OmniMoeConfig(
        thinker_config={"text_config": thinker.to_dict()},
        talker_config={"text_config": {"num_hidden_layers": 3, "num_experts": 16}},
    )
    assert RoutingLayout.from_hf_config(omni) == RoutingLayout(4, 2, 8, (1, 3))
    assert RoutingLayout.from_hf_config(omni.talker_config) == RoutingLayout(3, 8, 16)


# Every multimodal config of transformers 5.25 whose text stack is MoE (defaults).
MULTIMODAL_MOE = (
    "aria", "dots3_note", "ernie4_5_vl_moe", "glm4v_moe", "glm5_next", "hy_v4_vl", "inkling2",
    "inkling_mm_model", "kimi_k25", "llama4", "minimax_m3_vl", "mistral_large4", "muse_spark",
    "nemo_speechlm", "nemotron_h_omni", "qwen3_5_moe", "qwen3_vl_moe", "qwen4_exp", "step3p7",
    "unlimited_ocr", "qwen3_omni_moe",
)  # fmt: skip


@pytest.mark.parametrize("model_type", MULTIMODAL_MOE)
def test_a_multimodal_config_reads_as_its_text_config(model_type):
    config = transformers.CONFIG_MAPPING[model_type]()
    assert getattr(config, "num_hidden_layers", None) is None
    text = config.get_text_config()  # Qwen3-Omni: the thinker's
    assert text is not config
    assert RoutingLayout.from_hf_config(config) == RoutingLayout.from_hf_config(text)


def test_nemotron_h_legacy_pattern():
    # The hub's remote-code configs give the pattern string; 'E' blocks route.
    hub = SimpleNamespace(
        num_hidden_layers=6, hybrid_override_pattern="ME*E-E", n_routed_experts=8,
        num_experts_per_tok=2,
    )  # fmt: skip
    assert RoutingLayout.from_hf_config(hub) == RoutingLayout(6, 2, 8, (1, 3, 5))
    converted = tiny("NemotronHConfig", hybrid_override_pattern="ME*E-E")
    assert RoutingLayout.from_hf_config(converted) == RoutingLayout(6, 2, 8, (1, 3, 5))


def test_dbrx_ffn_config_as_a_dict():
    raw = SimpleNamespace(num_hidden_layers=2, ffn_config={"moe_num_experts": 16, "moe_top_k": 4})
    assert RoutingLayout.from_hf_config(raw) == RoutingLayout(2, 4, 16)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # Dense Gemma 4 names experts, but its model builds MLPs.
        (lambda: tiny("Gemma4TextConfig", num_hidden_layers=2),
         r"Gemma4TextConfig has enable_moe_block=False: .* dense"),
        # dots3's vision encoder: 4, 8, ... 64 experts in its last 17 blocks.
        (lambda: transformers.Dots3NoteVisionConfig(),
         r"Dots3NoteVisionConfig: the expert count \(num_local_experts\) differs between MoE "
         r"layers \(\[4, 8, 12, .*cannot be stored or replayed"),
        (lambda: tiny("NemotronHConfig", layers_block_type=["linear_attention", "mlp"]),
         r"NemotronHConfig has no MoE layer among its 2 layers"),
        (lambda: SimpleNamespace(num_experts=8, num_experts_per_tok=2),
         r"SimpleNamespace has no num_hidden_layers .*build RoutingLayout"),
        (lambda: transformers.SwitchTransformersConfig(),
         r"SwitchTransformersConfig does not look like an MoE config: no top-k attribute"),
    ],
)  # fmt: skip
def test_unroutable_configs_are_refused_saying_why(config, message):
    with pytest.raises(InvalidArgumentError, match=message):
        RoutingLayout.from_hf_config(config())


# -- multi-token prediction -------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "main", "with_mtp", "count"),
    [
        # DeepSeek-V3 and GLM-4-MoE: MTP layers are MoE (no dense first layers among them).
        (lambda: tiny("DeepseekV3Config", num_hidden_layers=4, first_k_dense_replace=2,
                      num_nextn_predict_layers=2),
         RoutingLayout(4, 2, 8, (2, 3)), RoutingLayout(6, 2, 8, (2, 3, 4, 5)), 2),
        (lambda: tiny("Glm4MoeConfig", num_hidden_layers=3, first_k_dense_replace=1,
                      num_mtp_layers=1),
         RoutingLayout(3, 2, 8, (1, 2)), RoutingLayout(4, 2, 8, (1, 2, 3)), 1),
        # ERNIE 4.5: its MoE interval starts after layer 0, so its one MTP layer is dense.
        (lambda: tiny("Ernie4_5_MoeConfig", num_hidden_layers=3, moe_num_experts=8, moe_k=2,
                      num_nextn_predict_layers=1),
         RoutingLayout(3, 2, 8, (1, 2)), RoutingLayout(4, 2, 8, (1, 2)), 1),
        # Inkling: `mtp_mlp_layer_types` says dense; Mellum: sparse.
        (lambda: tiny("InklingTextConfig", num_hidden_layers=2, num_mtp_layers=1),
         RoutingLayout(2, 2, 8), RoutingLayout(3, 2, 8, (0, 1)), 1),
        (lambda: tiny("MellumConfig", num_hidden_layers=2, num_mtp_layers=1),
         RoutingLayout(2, 2, 8), RoutingLayout(3, 2, 8), 1),
        # Bailing-Hybrid lists `mlp_layer_types` only: its MTP layer is MoE.
        (lambda: tiny("BailingHybridConfig", num_hidden_layers=2, num_experts_per_token=2,
                      first_k_dense_replace=1, layer_types=None, mlp_layer_types=None,
                      num_mtp_layers=1),
         RoutingLayout(2, 2, 8, (1,)), RoutingLayout(3, 2, 8, (1, 2)), 1),
        # Nemotron-H: one MTP step of blocks (attention, moe), numbered after the decoder's.
        (lambda: tiny("NemotronHConfig", layers_block_type=["moe", "full_attention"],
                      num_nextn_predict_layers=1),
         RoutingLayout(2, 2, 8, (0,)), RoutingLayout(4, 2, 8, (0, 3)), 2),
        # No MTP: the same layout either way.
        (lambda: tiny("Qwen3MoeConfig", num_hidden_layers=2),
         RoutingLayout(2, 2, 8), RoutingLayout(2, 2, 8), 0),
    ],
)  # fmt: skip
def test_mtp_layers_are_left_out_unless_asked_for(config, main, with_mtp, count):
    from routing_replay.hf_config import mtp_layer_count

    config = config()
    assert RoutingLayout.from_hf_config(config) == main
    assert RoutingLayout.from_hf_config(config, mtp=True) == with_mtp
    assert mtp_layer_count(config) == count


@pytest.mark.parametrize(
    ("config_class", "model_class", "fields"),
    [
        ("DeepseekV3Config", "DeepseekV3ForCausalLM",
         {"num_hidden_layers": 3, "first_k_dense_replace": 1, "num_nextn_predict_layers": 2}),
        ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
         {"num_hidden_layers": 3, "moe_num_experts": 8, "moe_k": 2,
          "num_nextn_predict_layers": 1}),
    ],
)  # fmt: skip
def test_mtp_layers_route_where_transformers_mtp_model_routes(config_class, model_class, fields):
    """transformers builds MTP layers only in a separate MtpModel (generate(use_mtp=True)):
    the main model has no router past its decoder layers, the MtpModel has them where the
    `mtp=True` layout says."""
    from transformers.modeling_layers import MtpModel

    from routing_replay.hf_config import mtp_layer_count

    config = tiny(config_class, **fields)
    model = build(model_class, config)
    main = RoutingLayout.from_hf_config(config)
    assert _router_layers(model) == list(main.moe_layers)
    mtp = MtpModel(model, mtp_layer_count(config))
    full = RoutingLayout.from_hf_config(config, mtp=True)
    assert [main.num_layers + i for i in _router_layers(mtp)] == list(
        full.moe_layers[main.num_moe_layers :]
    )


def _router_layers(model: torch.nn.Module) -> list[int]:
    """Layer indices of a model's routers (classes named like DeepseekV3TopkRouter)."""
    names = [n for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
    return [int(n.split("layers.")[1].split(".")[0]) for n in names]


@pytest.mark.parametrize(
    ("experts", "dtype", "marker"),
    [(128, "uint8", 255), (256, "uint16", 65535), (256, "int32", -1), (64, "int64", -1)],
)
def test_an_id_out_of_range_is_found_in_any_chunk_of_the_check(experts, dtype, marker, monkeypatch):
    # The range check runs chunk by chunk of the tokens (a chunk stays in cache): a bad id
    # in the first, a middle or the last chunk is found, with or without the marker near it.
    from routing_replay import layout as layout_module

    monkeypatch.setattr(layout_module, "CHECK_CHUNK_BYTES", 3 * 2 * 2 * np.dtype(dtype).itemsize)
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=experts)
    routes = layout.random_routes(np.random.default_rng(0), 50, np.dtype(dtype))
    routes[-1] = marker  # an engine's last row
    layout.check_ids(routes)
    for token in (0, 1, 25, 48, 49):
        for value in (experts, *((-2,) if marker == -1 else ())):
            bad = routes.copy()
            bad[token, 1, 0] = value
            with pytest.raises(
                InvalidRoutesError, match=rf"expert id {value} at token {token}, MoE"
            ):
                layout.check_ids(bad)
