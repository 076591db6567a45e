"""routing_agreement: top-k sets per (token, layer), missing rows ignored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay import RoutingLayout
from routing_replay.errors import InvalidRoutesError
from routing_replay.model.agreement import routing_agreement


def test_sets_not_order_and_missing_ignored():
    recorded = np.array(
        [
            [[0, 1], [2, 3]],  # token 0: both layers agree (layer 1 in another order)
            [[0, 1], [2, 4]],  # token 1: layer 1 differs in one expert
            [[-1, -1], [5, 6]],  # token 2: layer 0 missing on the recorded side
            [[-1, -1], [-1, -1]],  # token 3: all missing
        ]
    )
    native = np.array(
        [
            [[1, 0], [3, 2]],
            [[0, 1], [2, 3]],
            [[0, 1], [7, 6]],
            [[0, 1], [2, 3]],
        ]
    )
    a = routing_agreement(recorded, native)
    assert a.num_decisions == 5 and a.num_tokens == 3
    assert a.router_agreement == pytest.approx(3 / 5)
    assert a.token_disagreement == pytest.approx(2 / 3)
    np.testing.assert_allclose(a.per_layer, [1.0, 1 / 3])
    assert a.expert_overlap == pytest.approx((2 + 2 + 2 + 1 + 1) / 10)
    assert a.as_dict()["per_layer"] == [1.0, pytest.approx(1 / 3)]
    assert a.layers == (0, 1)
    assert routing_agreement(recorded, native, RoutingLayout(4, 2, 8, (1, 3))).layers == (1, 3)
    with pytest.raises(InvalidRoutesError, match="layout has 3"):
        routing_agreement(recorded, native, RoutingLayout(4, 2, 8, (1, 2, 3)))


def test_lists_tensors_and_padded_shapes():
    rng = np.random.default_rng(0)
    parts = [rng.permutation(8)[None, None, :2].repeat(n, 0).repeat(3, 1) for n in (4, 7)]
    assert routing_agreement(parts, [torch.from_numpy(p) for p in parts]).router_agreement == 1.0
    padded = np.full((2, 7, 3, 2), -1)
    padded[0, 3:] = parts[0]
    padded[1] = parts[1]
    a = routing_agreement(padded, padded[..., ::-1].copy())
    assert (a.router_agreement, a.num_tokens, a.token_disagreement) == (1.0, 11, 0.0)


def test_nothing_to_compare_is_nan():
    a = routing_agreement(np.full((3, 2, 2), -1), np.zeros((3, 2, 2), np.int64))
    assert a.num_decisions == 0 and np.isnan(a.router_agreement) and np.isnan(a.per_layer).all()


@pytest.mark.parametrize(
    ("recorded", "native", "words"),
    [
        (np.zeros((3, 2, 2), np.int32), np.zeros((3, 2, 1), np.int32), "equal shapes"),
        (np.zeros((3, 2), np.int32), np.zeros((3, 2), np.int32), "equal shapes"),
        (np.zeros((3, 2, 2), np.uint8), np.zeros((3, 2, 2), np.uint8), "decode"),
        (np.zeros((3, 2, 2)), np.zeros((3, 2, 2)), "signed integer"),
    ],
)
def test_bad_inputs(recorded, native, words):
    with pytest.raises(InvalidRoutesError, match=words):
        routing_agreement(recorded, native)
