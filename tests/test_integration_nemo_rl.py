"""NeMo-RL-style batches: routes aligned through padding, packing, CP zigzag and SP slices."""

from __future__ import annotations

import functools
import inspect
import os
import uuid
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import InvalidRoutesError, TokenMismatchError
from routing_replay.integrations.nemo_rl import (
    attach_routes,
    cp_slice,
    fill_missing,
    input_ids_for_rank,
    pack,
    read_rank_routes,
    routes_for_rank,
    sp_slice,
)
from routing_replay.store.segment import segment_path

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=8, moe_layers=(0, 2))
LENGTHS = [5, 8, 3]


class Group:
    """A process group as Megatron's slicing reads it: `.size()` and `.rank()`."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def megatron_cp_batch(batch: dict, group) -> dict:
    """Megatron's own `get_batch_on_this_cp_rank` of `batch` on CP group `group`.

    megatron-core <= 0.16 takes `(batch, cp_group)` and reads `group.size()` / `.rank()` (a
    `Group` will do). 0.17+ takes `(batch, is_hybrid_cp, cp_group)` and asks torch.distributed
    for the group's size and rank: a `Group` is then stood in for by a real CP world of its
    size (the fake backend: ranks, no transport) in place of this process's default group for
    the call; a real group is passed as it is.
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" not in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, group)
    if not isinstance(group, Group):
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    had_default = dist.is_initialized()
    if had_default:  # the gloo fixture's one-rank group: put back afterwards
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=group.rank(), world_size=group.size(), store=FakeStore())
    try:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False)
    finally:
        dist.destroy_process_group()
        if had_default:
            init = f"file:///tmp/rr-pg-{uuid.uuid4().hex}"
            dist.init_process_group("gloo", init_method=init, world_size=1, rank=0)


@pytest.fixture
def gloo():
    """A one-rank gloo group (Megatron's mappings need `torch.distributed` initialised)."""
    pytest.importorskip("megatron.core", reason="pip install megatron-core (extra: megatron)")
    started = not dist.is_initialized()
    if started:
        init = f"file:///tmp/rr-pg-{uuid.uuid4().hex}"
        dist.init_process_group("gloo", init_method=init, world_size=1, rank=0)
    yield
    if started:
        dist.destroy_process_group()


def megatron_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's own SP scatter of `x` `[B, S, ...]`: it splits dim 0 of `[S, B, ...]`."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(x.transpose(0, 1), group=group).transpose(0, 1)


@functools.cache
def rope_config():
    """A `TransformerConfig` with unfused RoPE (tests/megatron_cpu.py's, warnings muted)."""
    from megatron_cpu import config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config(apply_rope_fusion=False)


def megatron_thd_positions(cu_seqlens: torch.Tensor, cp_group) -> torch.Tensor:
    """The packed positions Megatron places on this CP rank of a THD batch, as Megatron says.

    Transformer Engine's `thd_get_partitioned_indices` (what `get_thd_batch_on_this_cp_rank`
    calls) is CUDA only, so ask Megatron's CPU code for THD under CP instead: unfused RoPE
    (`apply_rotary_pos_emb` with `cu_seqlens`, its exact-offset mode) rotates every local
    token by the angle of the packed position it stands for. Angle = position / 1000 on a
    unit vector: the position is read back exactly.
    """
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    total, cp = int(cu_seqlens[-1]), cp_group.size()
    assert total < 3000  # angles stay below pi: atan2 gives them back
    freqs = (
        (torch.arange(total, dtype=torch.float64) / 1000).view(total, 1, 1, 1).expand(-1, 1, 1, 2)
    )
    unit = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(total // cp, 1, 2)
    out = apply_rotary_pos_emb(unit, freqs, rope_config(), cu_seqlens=cu_seqlens, cp_group=cp_group)
    return torch.round(torch.atan2(out[:, 0, 1], out[:, 0, 0]) * 1000).long()


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
    with pytest.raises(InvalidRoutesError, match="8 routed tokens but the row holds"):
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


def test_packed_cp_slice_matches_megatron_thd_positions():
    # Oracle: the packed positions Megatron's own THD code puts on each CP rank (RoPE with
    # cu_seqlens under CP, see megatron_thd_positions), for several packings and CP sizes.
    pytest.importorskip("megatron.core", reason="pip install megatron-core (extra: megatron)")
    g = torch.Generator().manual_seed(0)
    for lengths in ([5, 8, 3], [1, 12, 0, 7, 4], [16]):
        for cp in (2, 3, 4):
            ids = torch.randint(3, 60, (len(lengths), max(lengths)), generator=g)
            routes = torch.randint(-1, 8, (*ids.shape, 2, 2), generator=g, dtype=torch.int8)
            batch = {"input_ids": ids, "input_lengths": torch.tensor(lengths)}
            packed = pack({**batch, "routed_experts": routes}, multiple=2 * cp)
            cu = packed["cu_seqlens"]
            everywhere = []
            for r in range(cp):
                pos = megatron_thd_positions(cu, Group(cp, r))
                everywhere.append(pos)
                assert torch.equal(
                    cp_slice(torch.arange(int(cu[-1]))[None], cp, r, cu_seqlens=cu)[0], pos
                )
                assert torch.equal(
                    input_ids_for_rank(packed, cp_size=cp, cp_rank=r), packed["input_ids"][:, pos]
                )
                assert torch.equal(
                    routes_for_rank(packed, cp_size=cp, cp_rank=r), packed["routed_experts"][:, pos]
                )
            # Megatron's ranks cover every packed position exactly once.
            assert torch.equal(torch.cat(everywhere).sort().values, torch.arange(int(cu[-1])))


def test_sp_slice_is_contiguous_per_tp_rank(gloo):
    # Oracle: Megatron's `scatter_to_sequence_parallel_region` on each TP rank (it splits
    # dim 0 of [S, B, ...]; our tensors are [B, S, ...], megatron_sp transposes).
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 24), generator=g)
    routes = torch.randint(-1, 8, (3, 24, 2, 2), generator=g, dtype=torch.int8)
    hidden = torch.randn(24, 3, 16, generator=g)  # [S, B, H], as Megatron holds activations
    for tp in (1, 2, 3, 4, 6):
        for r in range(tp):
            for x in (ids, routes, routes[:1]):
                assert torch.equal(sp_slice(x, tp, r), megatron_sp(x, Group(tp, r)))
            want = scatter_to_sequence_parallel_region(hidden, group=Group(tp, r))
            assert torch.equal(sp_slice(hidden, tp, r, seq_dim=0), want)
    with pytest.raises(InvalidRoutesError, match="tp_size = 5"):
        sp_slice(ids, 5, 0)


@pytest.mark.parametrize("packed", [False, True])
def test_every_rank_routes_stay_aligned_with_its_tokens(filled, gloo, packed):
    # Each (CP, TP) rank's routes and ids must be exactly what Megatron gives that rank:
    # `get_batch_on_this_cp_rank` (padded) or its THD positions (packed), then its SP scatter.

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
        if packed:
            pos = megatron_thd_positions(batch["cu_seqlens"], Group(cp, cp_rank))
            mcore = {k: batch[k][:, pos] for k in ("input_ids", "routed_experts")}
        else:
            mcore = megatron_cp_batch(
                {k: batch[k].clone() for k in ("input_ids", "routed_experts")}, Group(cp, cp_rank)
            )
        ids = input_ids_for_rank(batch, cp_size=cp, cp_rank=cp_rank)
        assert torch.equal(ids, mcore["input_ids"])
        for tp_rank in range(tp):
            routes = routes_for_rank(
                batch, cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                sequence_parallel=True,
            )  # fmt: skip
            assert torch.equal(routes, megatron_sp(mcore["routed_experts"], Group(tp, tp_rank)))
            local_ids = megatron_sp(mcore["input_ids"], Group(tp, tp_rank))  # Megatron's SP scatter
            have = (routes != -1).all(-1).all(-1)
            want = torch.from_numpy(routes_of(local_ids[have].numpy()).astype(np.int8))
            assert torch.equal(routes[have], want)
            seen += int(have.sum())
    assert seen == sum(LENGTHS[:2]) - 2  # every routed token lands on exactly one rank


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_read_rank_routes_reads_only_the_ranks_tokens(filled, gloo, packed, sequence_parallel):
    # Each (CP, TP) rank reads its tokens' ranges and gets exactly what Megatron's own
    # slicing gives it of the whole batch's routes (get_batch_on_this_cp_rank / THD
    # positions, then the SP scatter); together the ranks read each routed token once
    # (with SP; TP times without: every TP rank holds the CP chunk).

    store, batch = filled
    cp, tp = 2, 2
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.zeros((3, 6), dtype=torch.long)], 1)
    whole = attach_routes(dict(batch), fetch=store.read)
    if packed:
        whole = pack(whole, multiple=2 * cp * tp)
    read = []

    def fetch(refs, ranges):
        table = store.read(refs, ranges=ranges)
        read.append(sum(table.column("num_tokens").to_pylist()))
        return table

    for cp_rank in range(cp):
        if packed:
            pos = megatron_thd_positions(whole["cu_seqlens"], Group(cp, cp_rank))
            mcore = whole["routed_experts"][:, pos]
        else:
            mcore = megatron_cp_batch(
                {"routed_experts": whole["routed_experts"].clone()}, Group(cp, cp_rank)
            )["routed_experts"]
        for tp_rank in range(tp):
            got = read_rank_routes(
                batch, cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                sequence_parallel=sequence_parallel,
                pack_multiple=2 * cp * tp if packed else None, fetch=fetch,
            )  # fmt: skip
            want = megatron_sp(mcore, Group(tp, tp_rank)) if sequence_parallel else mcore
            assert torch.equal(got, want), (cp_rank, tp_rank)
            assert got.layout == LAYOUT
    routed = sum(LENGTHS[:2])
    assert sum(read) == (routed if sequence_parallel else tp * routed)
    assert max(read) < routed  # no rank read its samples whole


def test_read_rank_routes_checks_the_ranks_tokens(filled):
    store, batch = filled
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.zeros((3, 2), dtype=torch.long)], 1)
    batch["input_ids"][1, 4] += 1  # sample s1's token 4: in CP rank 1's chunk (3-8)
    read_rank_routes(batch, cp_size=2, cp_rank=0, fetch=store.read)  # rank 0 does not hold it
    with pytest.raises(TokenMismatchError, match=r"'s1'.* at position 4 "):
        read_rank_routes(batch, cp_size=2, cp_rank=1, fetch=store.read)


def test_cp_slice_matches_megatron_get_batch_on_this_cp_rank(gloo):

    ids = torch.arange(2 * 24).view(2, 24)
    routes = torch.randint(0, 8, (2, 24, 2, 2))
    for cp in (2, 3):
        for r in range(cp):
            want = megatron_cp_batch(
                {"input_ids": ids.clone(), "routed_experts": routes.clone()}, Group(cp, r)
            )
            assert torch.equal(cp_slice(ids, cp, r), want["input_ids"])
            assert torch.equal(cp_slice(routes, cp, r), want["routed_experts"])


@pytest.mark.parametrize(("tp", "cp"), [(2, 2), (3, 1), (2, 3)])
def test_every_rank_matches_megatron_parallel_state_groups(tp, cp):
    # Every global rank of a TP x CP world in turn, in this process: a "fake" torch.distributed
    # backend (ranks and groups, no transport: the slices need no communication) and
    # Megatron's own `initialize_model_parallel`. Its TP / CP groups say which (cp, tp) slice
    # the rank holds; our slice must equal Megatron's CP slice then SP scatter on them.
    pytest.importorskip("megatron.core", reason="pip install megatron-core (extra: megatron)")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    g = torch.Generator().manual_seed(7)
    lengths = [5, 8, 3, 11]
    ids = torch.randint(3, 60, (len(lengths), 2 * cp * tp * 3), generator=g)
    routes = torch.randint(-1, 8, (*ids.shape, 2, 2), generator=g, dtype=torch.int8)
    padded = {"input_ids": ids, "routed_experts": routes}
    packed = pack({**padded, "input_lengths": torch.tensor(lengths)}, multiple=2 * cp * tp)
    seen = []
    for rank in range(tp * cp):
        dist.init_process_group("fake", rank=rank, world_size=tp * cp, store=FakeStore())
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                context_parallel_size=cp,
                create_gloo_process_groups=False,
            )
            tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
            tp_group = ps.get_tensor_model_parallel_group()
            seen.append((tp_rank, cp_rank))
            pos = megatron_thd_positions(packed["cu_seqlens"], ps.get_context_parallel_group())
            mcore = {
                "padded": megatron_cp_batch(
                    {k: v.clone() for k, v in padded.items()}, ps.get_context_parallel_group()
                ),
                "packed": {k: packed[k][:, pos] for k in ("input_ids", "routed_experts")},
            }
            for name, batch in (("padded", padded), ("packed", packed)):
                want = mcore[name]
                routes = routes_for_rank(
                    batch, cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank,
                    sequence_parallel=True,
                )  # fmt: skip
                cp_ids = input_ids_for_rank(batch, cp_size=cp, cp_rank=cp_rank)
                assert torch.equal(cp_ids, want["input_ids"]), (name, rank)
                want_routes = scatter_to_sequence_parallel_region(
                    want["routed_experts"].transpose(0, 1), tp_group
                ).transpose(0, 1)
                assert torch.equal(routes, want_routes), (name, rank)
                want_ids = scatter_to_sequence_parallel_region(cp_ids.T, tp_group).T
                assert torch.equal(sp_slice(cp_ids, tp, tp_rank), want_ids), (name, rank)
                assert routes.shape[1] * tp * cp == batch["input_ids"].shape[1]
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    assert sorted(seen) == [(t, c) for t in range(tp) for c in range(cp)]


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


def test_r2_recipe_replays_the_logprob_pass_in_later_mini_batches():
    # docs/integrations.md's R2 recipe for NeMo-RL-style batches, as written: the policy's
    # old-logprob pass under capture, its rows put with their tokens, refs in the batch; each
    # mini-batch after an optimizer step reads them back and replays. At the experts: the
    # second mini-batch gets exactly the old pass's ids on every real token, though the
    # updated router alone would pick others on some.
    from expert_spy import ExpertSpy

    from routing_replay import PutRequest, capture, replay
    from routing_replay.integrations.nemo_rl import REFS_KEY, ROUTES_KEY
    from routing_replay.testing import tiny_moe

    torch.manual_seed(0)
    policy = tiny_moe()
    layout = RoutingLayout.from_hf_config(policy.config)
    lengths = torch.tensor([12, 9, 11, 7])
    mask = (torch.arange(12) < lengths[:, None]).long()
    ids = torch.randint(3, 128, (4, 12)) * mask
    batch = {"input_ids": ids, "input_lengths": lengths}
    spy = ExpertSpy(policy)
    with RoutingStore.create(f"test-r2-{uuid.uuid4().hex[:8]}", layout, 10_000) as store:
        with capture(policy) as cap, torch.no_grad():
            policy(input_ids=ids, attention_mask=mask)
        old = {j: rows.view(4, 12, -1) for j, rows in spy.calls}  # layer -> [B, S, K]
        batch[REFS_KEY] = store.put_many(
            PutRequest(f"step0-s{b}", routes, token_ids=tokens)
            for b, (routes, tokens) in enumerate(zip(cap.routes(), cap.token_ids(), strict=True))
        )
        optimizer = torch.optim.SGD(policy.parameters(), lr=50.0)  # a large step: routers move
        moved = 0
        for rows in (slice(0, 2), slice(2, 4)):
            mb = {k: v[rows] for k, v in batch.items()}
            attach_routes(mb, fetch=store.read)
            start = len(spy.calls)
            with replay(policy, mb[ROUTES_KEY], attention_mask=mask[rows]):
                logits = policy(input_ids=mb["input_ids"], attention_mask=mask[rows]).logits
                logits.float().logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            real = mask[rows].bool()
            for (j, got), native in zip(spy.calls[start:], spy.native_topk[start:], strict=True):
                got, native = got.view(2, 12, -1), native.view(2, 12, -1)
                assert torch.equal(got[real], old[j][rows][real]), f"layer {j}"
                moved += int(
                    (native[real].sort(-1).values != got[real].sort(-1).values).any(-1).sum()
                )
        assert moved > 0  # the second mini-batch's own routing differs: replay forced it
        store.release(batch[REFS_KEY])
        assert len(store) == 0
    spy.remove()


@pytest.mark.parametrize("tolerance", [None, 1.0])
def test_replay_batch_gives_each_steps_metrics_as_a_plain_dict(tolerance):
    # A NeMo-RL-style loop: two micro-batches a step, each replayed by `replay_batch` around
    # its forward and backward, the step's `StepMetrics` popped after them. Step 1 replays
    # the policy's own routes (captured on the same weights); step 2 random routes for the
    # same tokens, whose agreement and (tolerance 1.0) replaced slots are counted here at
    # the experts: the router's own top-k of each call against the recorded ids.
    from expert_spy import ExpertSpy

    from routing_replay import PutRequest, capture
    from routing_replay.integrations.nemo_rl import (
        REFS_KEY,
        ROUTES_KEY,
        StepMetrics,
        replay_batch,
    )
    from routing_replay.testing import tiny_moe

    torch.manual_seed(0)
    policy = tiny_moe()
    layout = RoutingLayout.from_hf_config(policy.config)
    L, K = layout.num_moe_layers, layout.top_k
    lengths = torch.tensor([12, 9, 11, 7])
    mask = (torch.arange(12) < lengths[:, None]).long()
    ids = torch.randint(3, 128, (4, 12)) * mask
    real = int(lengths.sum())
    with capture(policy) as cap, torch.no_grad():
        policy(input_ids=ids, attention_mask=mask)
    rng = np.random.default_rng(0)
    pairs = list(zip(cap.routes(), cap.token_ids(), strict=True))
    own = [(f"own-{b}", r, t) for b, (r, t) in enumerate(pairs)]
    rand = [(f"rand-{b}", layout.random_routes(rng, len(t)), t) for b, (_, t) in enumerate(pairs)]
    spy = ExpertSpy(policy)
    step = StepMetrics()
    logged = []
    with RoutingStore.create(f"test-m-{uuid.uuid4().hex[:8]}", layout, 10_000) as store:
        for samples in (own, rand):
            refs = store.put_many(PutRequest(s, r, token_ids=t) for s, r, t in samples)
            batch = {"input_ids": ids, "input_lengths": lengths, REFS_KEY: refs}
            agreed = outside = forced = 0
            for rows in (slice(0, 2), slice(2, 4)):
                mb = attach_routes({k: v[rows] for k, v in batch.items()}, fetch=store.read)
                start = len(spy.calls)
                with replay_batch(policy, mb, replay_tolerance=tolerance, metrics=step):
                    logits = policy(input_ids=mb["input_ids"], attention_mask=mask[rows]).logits
                    logits.float().logsumexp(-1).mean().backward()
                want = mb[ROUTES_KEY].as_subclass(torch.Tensor).long()
                for (j, _), native in zip(spy.calls[start:], spy.native_topk[start:], strict=True):
                    rec = want[:, :, j].reshape(-1, K)
                    has = (rec != -1).all(-1)
                    forced += int(has.sum())
                    same = (rec.sort(-1).values == native.sort(-1).values).all(-1)
                    agreed += int(same[has].sum())
                    outside += int((~(rec[:, :, None] == native[:, None, :]).any(-1))[has].sum())
            logged.append(step.pop())  # after the step's backward (no optimizer step here)
            assert forced == real * L
            assert logged[-1]["replay/rows_replayed"] == real * L
            assert logged[-1]["replay/rows_missing"] == (ids.numel() - real) * L  # padding
            assert logged[-1]["replay/native_agreement"] == pytest.approx(agreed / forced)
            replaced = outside / (forced * K) if tolerance == 1.0 else 0.0
            assert logged[-1]["replay/replace_rate"] == pytest.approx(replaced, abs=0)
            store.release(refs)
    spy.remove()
    assert step.pop() is None
    assert logged[0] == {  # the policy's own routes: all agree, nothing replaced
        "replay/rows_replayed": real * L,
        "replay/rows_missing": (ids.numel() - real) * L,
        "replay/native_agreement": 1.0,
        "replay/replace_rate": 0.0,
    }
    assert logged[1]["replay/native_agreement"] < 0.5  # random routes: mostly not its own
    assert (logged[1]["replay/replace_rate"] > 0.25) == (tolerance == 1.0)
