"""Alignment and cache probing on hand-built forwards and caches: no model, no hooks.

Each synthetic forward's routes are stamped with their sample and column: every expert id of
sample b at sequence column c is `1000 * b + 10 * c + 2 * layer + slot`, so an expected routes
array is written as the list of columns its rows come from (None: a -1 row).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, StaticCache
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from routing_replay import MISSING, RoutingLayout
from routing_replay.errors import CaptureAlignmentError
from routing_replay.model.alignment import (
    Forward,
    Group,
    group_samples,
    valid_mask,
    with_generated,
)
from routing_replay.model.hf_cache import cache_lengths, is_2d_mask, past_columns

LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=4096)
L, K = LAYOUT.num_moe_layers, LAYOUT.top_k
EOS = 99
PAD = 0


def stamp(b: int, column: int) -> np.ndarray:
    """The [L, K] routes of sample b at sequence column `column`."""
    return 1000 * b + 10 * column + np.arange(L * K).reshape(L, K)


def forward(ids_BS, valid_BS, past: int, batch: int | None = None, width: int | None = None):
    """A recorded forward over columns past.., its routes stamped by sample and column."""
    ids = torch.tensor(ids_BS) if ids_BS is not None else None
    valid = torch.tensor(valid_BS) if valid_BS is not None else None
    shape = tuple(ids.shape) if ids is not None else (batch, width)
    routes = np.stack([[stamp(b, past + s) for s in range(shape[1])] for b in range(shape[0])])
    return Forward(
        shape=shape,
        input_ids_BS=ids,
        valid_BS=valid,
        past=past,
        ids_L=[],
        routes_BSLK=torch.from_numpy(routes).to(torch.int64),
    )


def expected(b: int, columns: list[int | None]) -> np.ndarray:
    """Routes rows of sample b from these columns; None is a row never forwarded (-1)."""
    rows = [stamp(b, c) if c is not None else np.full((L, K), MISSING) for c in columns]
    return np.stack(rows).astype(np.int32)


# -- group_samples ---------------------------------------------------------------------------


def generate_group() -> Group:
    """Left-padded batch of 2 under generate: a prefill of 4 columns, then 3 decode steps.

    Sample 0 (one pad column) generates 31, EOS, then pads; sample 1 generates 41..44. The
    last generated token of each sample is produced but never forwarded.
    """
    return Group(
        forwards=[
            forward([[PAD, 11, 12, 13], [21, 22, 23, 24]], [[0, 1, 1, 1], [1, 1, 1, 1]], past=0),
            forward([[31], [41]], [[1], [1]], past=4),
            forward([[EOS], [42]], [[1], [1]], past=5),
            forward([[PAD], [43]], [[1], [1]], past=6),
        ],
        sequences=torch.tensor([[31, EOS, PAD, PAD], [41, 42, 43, 44]]),
        prompt_cols=4,
        eos=frozenset({EOS}),
    )


def test_generate_drops_padding_cuts_at_eos_and_marks_unforwarded_rows():
    (tokens0, routes0), (tokens1, routes1) = group_samples(generate_group(), LAYOUT)
    # Sample 0: pad column 0 dropped; prompt 11..13, then 31 and EOS (fed at columns 4, 5);
    # the pad fed after EOS (column 6) is cut.
    np.testing.assert_array_equal(tokens0, [11, 12, 13, 31, EOS])
    np.testing.assert_array_equal(routes0, expected(0, [1, 2, 3, 4, 5]))
    # Sample 1: 4 prompt tokens, 4 generated; 44 was never forwarded: its row is -1.
    np.testing.assert_array_equal(tokens1, [21, 22, 23, 24, 41, 42, 43, 44])
    np.testing.assert_array_equal(routes1, expected(1, [0, 1, 2, 3, 4, 5, 6, None]))
    assert routes0.dtype == routes1.dtype == np.int32


def test_generate_with_eos_as_last_token_marks_its_row_missing():
    group = generate_group()
    group.sequences = torch.tensor([[31, 32, 33, EOS], [41, 42, 43, 44]])
    group.forwards[2].input_ids_BS = torch.tensor([[32], [42]])
    group.forwards[3].input_ids_BS = torch.tensor([[33], [43]])
    (tokens0, routes0), _ = group_samples(group, LAYOUT)
    np.testing.assert_array_equal(tokens0, [11, 12, 13, 31, 32, 33, EOS])
    np.testing.assert_array_equal(routes0, expected(0, [1, 2, 3, 4, 5, 6, None]))


def test_right_padded_plain_forward_keeps_the_masked_columns():
    group = Group(
        forwards=[forward([[5, 6, 7, PAD], [8, 9, PAD, PAD]], [[1, 1, 1, 0], [1, 1, 0, 0]], 0)]
    )
    (tokens0, routes0), (tokens1, routes1) = group_samples(group, LAYOUT)
    np.testing.assert_array_equal(tokens0, [5, 6, 7])
    np.testing.assert_array_equal(routes0, expected(0, [0, 1, 2]))
    np.testing.assert_array_equal(tokens1, [8, 9])
    np.testing.assert_array_equal(routes1, expected(1, [0, 1]))


def test_decode_loop_without_mask_keeps_every_column():
    group = Group(
        forwards=[
            forward([[PAD, 1, 2]], [[0, 1, 1]], past=0),
            forward([[3]], None, past=3),
            forward([[4]], None, past=4),
        ]
    )
    [(tokens, routes)] = group_samples(group, LAYOUT)
    np.testing.assert_array_equal(tokens, [1, 2, 3, 4])
    np.testing.assert_array_equal(routes, expected(0, [1, 2, 3, 4]))


def test_inputs_embeds_forward_has_no_token_ids():
    group = Group(forwards=[forward(None, [[0, 1, 1], [1, 1, 1]], past=0, batch=2, width=3)])
    (tokens0, routes0), (tokens1, routes1) = group_samples(group, LAYOUT)
    assert tokens0 is None and tokens1 is None
    np.testing.assert_array_equal(routes0, expected(0, [1, 2]))
    np.testing.assert_array_equal(routes1, expected(1, [0, 1, 2]))


def test_one_forward_without_ids_drops_the_token_ids_of_the_group():
    group = generate_group()
    group.forwards[0].input_ids_BS = None  # a prefill from inputs_embeds
    (tokens0, routes0), (tokens1, _) = group_samples(group, LAYOUT)
    assert tokens0 is None and tokens1 is None
    np.testing.assert_array_equal(routes0, expected(0, [1, 2, 3, 4, 5]))


def test_batch_size_change_raises():
    group = generate_group()
    group.forwards[1] = forward([[31]], [[1]], past=4)
    with pytest.raises(CaptureAlignmentError, match="batch size changed within one generate call"):
        group_samples(group, LAYOUT)


def test_fed_tokens_that_differ_from_the_output_raise():
    group = generate_group()
    group.sequences = torch.tensor([[41, 42, 43, 44], [31, EOS, PAD, PAD]])  # rows swapped
    with pytest.raises(CaptureAlignmentError, match="do not match its output"):
        group_samples(group, LAYOUT)


# -- valid_mask, with_generated ----------------------------------------------------------------


def test_valid_mask():
    masked = forward([[1, 2, 3]], [[0, 2, 1]], past=0)
    np.testing.assert_array_equal(valid_mask(masked).numpy(), [[False, True, True]])
    unmasked = forward([[1, 2], [3, 4]], None, past=0)
    np.testing.assert_array_equal(valid_mask(unmasked).numpy(), [[True, True], [True, True]])


def test_with_generated_without_tokens_cuts_routes_only():
    group = generate_group()
    routes = expected(0, [1, 2, 3, 4, 5, 6])
    tokens, full = with_generated(group, 0, None, routes, prompt_tokens=3, layout=LAYOUT)
    assert tokens is None
    np.testing.assert_array_equal(full, expected(0, [1, 2, 3, 4, 5]))


def test_with_generated_without_eos_keeps_every_generated_token():
    group = generate_group()
    group.eos = frozenset()
    tokens = np.array([11, 12, 13, 31, EOS, PAD])
    routes = expected(0, [1, 2, 3, 4, 5, 6])
    tokens, full = with_generated(group, 0, tokens, routes, prompt_tokens=3, layout=LAYOUT)
    np.testing.assert_array_equal(tokens, [11, 12, 13, 31, EOS, PAD, PAD])
    np.testing.assert_array_equal(full, expected(0, [1, 2, 3, 4, 5, 6, None]))


# -- hf_cache ----------------------------------------------------------------------------------

CONFIG = dict(
    num_hidden_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=4,
    vocab_size=16,
)
KV = torch.zeros(1, 2, 3, 4)  # 3 tokens per layer


def filled(cache, layer_types=("full_attention", "full_attention")):
    """`cache` after a 3-token prefill through every attention layer."""
    for layer, kind in enumerate(layer_types):
        if kind != "linear_attention":
            cache.update(KV, KV, layer, cache_kwargs={"cache_position": torch.arange(3)})
    return cache


def config(layer_types=("full_attention", "full_attention")):
    return LlamaConfig(**CONFIG, layer_types=list(layer_types), sliding_window=4)


def test_is_2d_mask():
    assert is_2d_mask(torch.ones(2, 5))
    assert not is_2d_mask(torch.ones(2, 1, 5, 5))
    assert not is_2d_mask(None)
    assert not is_2d_mask([[1, 1]])


def test_whole_sequence_mask_alone_gives_the_answer():
    # The cache's device tensor is never consulted.
    static = filled(StaticCache(config=config(), max_cache_len=8))
    assert past_columns(torch.ones(2, 7), static, width=1, whole=True) == 6
    assert past_columns(torch.ones(2, 7), None, width=1, whole=True) == 6
    assert past_columns(torch.ones(2, 4), None, width=4, whole=True) == 0


def test_partial_mask_without_cache():
    assert past_columns(torch.ones(2, 5), None, width=2) == 3
    assert past_columns(None, None, width=2) == 0


def test_dynamic_cache_reports_python_ints():
    cache = filled(DynamicCache(config=config()))
    assert cache_lengths(cache) == [3, 3]
    assert past_columns(None, cache, width=1) == 3
    assert past_columns(torch.ones(1, 2), cache, width=1) == 3  # the larger of mask and cache
    assert past_columns(None, DynamicCache(), width=4) == 0  # empty, lazily built: no layers


def test_static_cache_length_on_device_gives_none():
    fresh = StaticCache(config=config(), max_cache_len=8)
    assert cache_lengths(fresh) == [0, 0]  # before its first update: python ints
    assert past_columns(None, fresh, width=3) == 0
    cache = filled(StaticCache(config=config(), max_cache_len=8))
    lengths = cache_lengths(cache)
    assert all(isinstance(t, torch.Tensor) for t in lengths)
    assert [int(t) for t in lengths] == [3, 3]
    assert past_columns(None, cache, width=1) is None  # only the tensor could tell
    assert past_columns(torch.ones(1, 5), cache, width=1) == 4  # a partial mask says it


def test_static_cache_sliding_layer_int_is_enough():
    kinds = ("sliding_attention", "full_attention")
    cache = filled(StaticCache(config=config(kinds), max_cache_len=8), kinds)
    lengths = cache_lengths(cache)
    assert lengths[0] == 3 and isinstance(lengths[1], torch.Tensor)
    assert past_columns(None, cache, width=1) == 3


def test_hybrid_minimax_cache_layer_reporting_zero():
    cache = MiniMaxCache()
    cache.set_linear_cache(0, torch.zeros(1, 2, 4, 4))  # linear attention keeps no tokens
    cache.update(KV, KV, 1)
    assert cache_lengths(cache) == [0, 3]
    assert past_columns(None, cache, width=1) == 3


def test_hybrid_linear_attention_caches():
    kinds = ("linear_attention", "full_attention")
    dynamic = filled(DynamicCache(config=config(kinds)), kinds)
    assert past_columns(None, dynamic, width=1) == 3
    static = filled(StaticCache(config=config(kinds), max_cache_len=8), kinds)
    assert past_columns(None, static, width=1) is None


class OneLength:
    """A cache interface without `__len__`: only layer 0 is asked."""

    def __init__(self, length):
        self.length = length
        self.asked = []

    def get_seq_length(self, layer=0):
        self.asked.append(layer)
        return self.length


class UntrackedLayers:
    """A cache whose layers after the first track no length (they raise, as transformers does)."""

    def __len__(self):
        return 3

    def get_seq_length(self, layer=0):
        if layer:
            raise ValueError("this layer does not track sequence length")
        return 5


def test_cache_interface_edges():
    one = OneLength(4)
    assert cache_lengths(one) == [4] and one.asked == [0]
    assert past_columns(None, OneLength(torch.tensor(4)), width=1) is None
    assert cache_lengths(UntrackedLayers()) == [5]
    assert past_columns(None, UntrackedLayers(), width=1) == 5
    assert cache_lengths(object()) == []
    assert cache_lengths(None) == []
