"""NeMo-RL-style batches: routes aligned through padding, packing, CP zigzag and SP slices."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

from routing_replay import InvalidRoutesError, RoutingLayout, RoutingStore
from routing_replay.integrations.nemo_rl import (
    attach_routes,
    cp_slice,
    fill_missing,
    input_ids_for_rank,
    pack,
    routes_for_rank,
    sp_slice,
)
from routing_replay.store.segment import segment_path

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=8, moe_layers=(0, 2))
LENGTHS = [5, 8, 3]


def routes_of(tokens: np.ndarray) -> np.ndarray:
    """Routes that encode their token: layer l slot k holds (token + l + 3k) % 8, distinct."""
    t = tokens[:, None, None]
    layer = np.arange(2)[None, :, None]
    slot = np.arange(2)[None, None, :]
    return (t + layer + 3 * slot) % 8


@pytest.fixture
def filled():
    """A store with three samples and the NeMo-RL batch over them (row 2 has no ref)."""
    name = f"test-nemo-{uuid.uuid4().hex[:10]}"
    store = RoutingStore.create(name, LAYOUT, capacity_tokens=256, page_tokens=4)
    rng = np.random.default_rng(0)
    S = 10
    input_ids = torch.zeros((3, S), dtype=torch.long)
    refs = []
    for b, n in enumerate(LENGTHS):
        tokens = rng.integers(3, 60, n)
        input_ids[b, :n] = torch.from_numpy(tokens)
        routes = routes_of(tokens)
        routes[-1] = -1  # the last token was never forwarded by the engine
        ref = store.put(f"s{b}", routes, prompt_len=2, token_ids=tokens)
        refs.append(ref if b != 2 else None)
    batch = {"input_ids": input_ids, "input_lengths": torch.tensor(LENGTHS), "routing_refs": refs}
    yield store, batch
    store.close()
    store.unlink()
    assert not os.path.exists(segment_path(name))


def expected_padded(batch) -> torch.Tensor:
    out = torch.full((3, 10, 2, 2), -1, dtype=torch.int8)
    for b, n in enumerate(LENGTHS[:2]):
        r = routes_of(batch["input_ids"][b, :n].numpy())
        r[-1] = -1
        out[b, :n] = torch.from_numpy(r.astype(np.int8))
    return out


def test_attach_routes_aligns_with_right_padded_input_ids(filled):
    store, batch = filled
    attach_routes(batch, fetch=store.read)
    assert batch["routed_experts"].dtype == torch.int8
    assert torch.equal(batch["routed_experts"], expected_padded(batch))


def test_pack_matches_packed_input_ids(filled):
    store, batch = filled
    packed = pack(attach_routes(batch, fetch=store.read), multiple=4)
    assert packed["cu_seqlens"].tolist() == [0, 8, 16, 20]
    assert packed["cu_seqlens_unpadded"].tolist() == [0, 5, 13, 16]
    ids, routes = packed["input_ids"][0], packed["routed_experts"][0]
    assert ids.shape == (20,) and routes.shape == (20, 2, 2)
    assert ids[5:8].tolist() == [0, 0, 0] and (routes[5:8] == -1).all()
    assert packed["position_ids"][0].tolist() == [*range(8), *range(8), *range(4)]
    exp = expected_padded(batch)
    assert torch.equal(routes[0:5], exp[0, :5]) and torch.equal(routes[8:16], exp[1, :8])
    assert (routes[16:] == -1).all()  # row 2: no ref


def test_wrong_length_and_bad_batches_raise(filled):
    store, batch = filled
    batch["input_lengths"] = torch.tensor([5, 7, 3])
    with pytest.raises(InvalidRoutesError, match="8 routed tokens but input_lengths"):
        attach_routes(batch, fetch=store.read)
    batch["input_lengths"] = torch.tensor([5, 8])
    with pytest.raises(InvalidRoutesError, match="input_lengths"):
        attach_routes(batch, fetch=store.read)
    batch["input_lengths"] = torch.tensor(LENGTHS)
    with pytest.raises(InvalidRoutesError, match="fetch returned samples"):
        attach_routes(batch, fetch=lambda refs: store.read(refs[::-1]))


def test_cp_zigzag_exact_positions():
    pos = torch.arange(8).unsqueeze(0)  # [1, 8], cp_size 2 -> 4 chunks of 2
    assert cp_slice(pos, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert cp_slice(pos, 2, 1).tolist() == [[2, 3, 4, 5]]
    packed = torch.arange(12).unsqueeze(0)  # two sequences of 8 and 4 (padded to 4)
    cu = torch.tensor([0, 8, 12])
    assert cp_slice(packed, 2, 0, cu_seqlens=cu).tolist() == [[0, 1, 6, 7, 8, 11]]
    assert cp_slice(packed, 2, 1, cu_seqlens=cu).tolist() == [[2, 3, 4, 5, 9, 10]]
    with pytest.raises(InvalidRoutesError, match="2\\*cp_size = 4"):
        cp_slice(torch.arange(6).unsqueeze(0), 2, 0)


def test_sp_slice_is_contiguous_per_tp_rank():
    x = torch.arange(12).unsqueeze(0)
    assert [sp_slice(x, 3, r).tolist() for r in range(3)] == [
        [[0, 1, 2, 3]],
        [[4, 5, 6, 7]],
        [[8, 9, 10, 11]],
    ]
    with pytest.raises(InvalidRoutesError, match="tp_size = 5"):
        sp_slice(x, 5, 0)


@pytest.mark.parametrize("packed", [False, True])
def test_every_rank_routes_stay_aligned_with_its_tokens(filled, packed):
    store, batch = filled
    attach_routes(batch, fetch=store.read)
    cp, tp = 2, 2
    if packed:
        batch = pack(batch, multiple=2 * cp * tp)
    else:  # pad S to a multiple of 2 * cp * tp
        for key in ("input_ids", "routed_experts"):
            pad = torch.full((3, 6, *batch[key].shape[2:]), 0 if key == "input_ids" else -1)
            batch[key] = torch.cat([batch[key], pad.to(batch[key].dtype)], dim=1)
    seen = 0
    for cp_rank in range(cp):
        ids = input_ids_for_rank(batch, cp_size=cp, cp_rank=cp_rank)
        for tp_rank in range(tp):
            routes = routes_for_rank(
                batch, cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                sequence_parallel=True,
            )  # fmt: skip
            local_ids = sp_slice(ids, tp, tp_rank)  # what Megatron's SP scatter gives this rank
            have = (routes != -1).all(-1).all(-1)
            want = torch.from_numpy(routes_of(local_ids[have].numpy()).astype(np.int8))
            assert torch.equal(routes[have], want)
            seen += int(have.sum())
    assert seen == sum(LENGTHS[:2]) - 2  # every routed token lands on exactly one rank


def test_cp_slice_matches_megatron_get_batch_on_this_cp_rank():
    mcore_utils = pytest.importorskip("megatron.core.utils")
    import torch.distributed as dist

    class Group:  # the CP topology Megatron asks for: .size() and .rank() of the group
        def __init__(self, size: int, rank: int) -> None:
            self._size, self._rank = size, rank

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return self._rank

    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "gloo", init_method=f"file:///tmp/rr-pg-{uuid.uuid4().hex}", world_size=1, rank=0
        )
    try:
        ids = torch.arange(2 * 24).view(2, 24)
        routes = torch.randint(0, 8, (2, 24, 2, 2))
        for cp in (2, 3):
            for r in range(cp):
                want = mcore_utils.get_batch_on_this_cp_rank(
                    {"input_ids": ids.clone(), "routed_experts": routes.clone()}, Group(cp, r)
                )
                assert torch.equal(cp_slice(ids, cp, r), want["input_ids"])
                assert torch.equal(cp_slice(routes, cp, r), want["routed_experts"])
    finally:
        if started:
            dist.destroy_process_group()


def test_fill_missing_distinct_spread_never_expert_zero_column():
    routes = torch.full((2, 32, 3, 4), -1, dtype=torch.int8)
    routes[0, :5] = torch.tensor([0, 1, 2, 3], dtype=torch.int8)
    out, filled = fill_missing(routes, num_experts=16)
    assert out.dtype == torch.int64 and int(filled.sum()) == 64 * 3 - 15
    assert torch.equal(out[0, :5], routes[0, :5].long())  # real routes untouched
    rows = out[filled]
    assert (rows.sort(-1).values.diff(dim=-1) > 0).all()  # distinct within every row
    counts = torch.bincount(rows.flatten(), minlength=16)
    assert counts.max() - counts.min() <= 4  # every expert used about equally
    ep_rank = rows // 4  # EP=4 ranks of 4 experts: each row hits every rank once
    assert (ep_rank.sort(-1).values == torch.arange(4)).all()
    assert not (rows == 0).all(0).any()  # never a column of expert 0
