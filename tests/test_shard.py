"""TokenShard: a rank's token ranges follow the trainer's own slicing, and ranged reads
placed by the shard equal the same slicing applied to full reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay import MISSING, RoutingLayout, RoutingStore, TokenShard, to_torch
from routing_replay.errors import InvalidArgumentError, InvalidRoutesError, TokenMismatchError

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=16, moe_layers=(0, 2))
LENGTHS = [13, 1, 2, 22, 7]  # a one-token sample among them


@pytest.fixture
def filled(name):
    """Five samples (GRPO-like: samples 0 and 3 share their first 8 tokens' pages)."""
    store = RoutingStore.create(name, LAYOUT, capacity_tokens=512, page_tokens=4)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 500, 8)
    prompt_routes = rng.permuted(np.tile(np.arange(16), (8, 2, 1)), axis=-1)[..., :2]
    refs = []
    for s, n in enumerate(LENGTHS):
        tokens = rng.integers(0, 500, n)
        routes = rng.permuted(np.tile(np.arange(16), (n, 2, 1)), axis=-1)[..., :2]
        if s in (0, 3):
            tokens[:8], routes[:8] = prompt, prompt_routes
        refs.append(store.put(f"s{s}", routes, token_ids=tokens, prompt_len=min(n, 8)))
    yield store, refs
    store.close()
    store.unlink()


def full_padded(store, refs, seq_len):
    """The oracle: every sample read whole, right padded to `seq_len` (-1 beyond)."""
    table = store.read(refs)
    mask = torch.arange(seq_len) < torch.tensor(LENGTHS).unsqueeze(1)
    return to_torch(table, attention_mask=mask), full_ids(table, seq_len)


def full_ids(table, seq_len):
    ids = torch.zeros((len(LENGTHS), seq_len), dtype=torch.long)
    for b, row in enumerate(table.column("token_ids").to_pylist()):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids


def zigzag(x, cp, r):
    """Megatron's CP split of dim 1, written from its description: 2*cp chunks, r and 2cp-1-r."""
    chunks = x.chunk(2 * cp, dim=1)
    return torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=1)


def contiguous(x, size, r):
    return x.chunk(size, dim=1)[r]


def pad_to(x, multiple):
    extra = -x.shape[1] % multiple
    fill = torch.full((x.shape[0], extra, *x.shape[2:]), MISSING, dtype=x.dtype)
    return torch.cat([x, fill], dim=1)


CUTS = {
    "identity": lambda x: x,
    "cp2-rank0": lambda x: zigzag(x, 2, 0),
    "cp2-rank1": lambda x: zigzag(x, 2, 1),
    "cp3-rank1-then-sp2-rank1": lambda x: contiguous(zigzag(x, 3, 1), 2, 1),
    "rows-reordered-and-repeated": lambda x: x[[4, 0, 0, 3]],
    "flatten-pad-ulysses": lambda x: contiguous(pad_to(x.flatten(0, 1).unsqueeze(0), 4), 4, 3),
    "nothing-but-padding": lambda x: x[:, 23:],
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_ranged_read_placed_equals_the_same_cut_of_a_full_read(filled, cut):
    store, refs = filled
    fn, S = CUTS[cut], 24
    shard = TokenShard.padded(LENGTHS, S).map(fn)
    want_routes, ids = full_padded(store, refs, S)
    got = shard.place(store.read(refs, ranges=shard.ranges()), input_ids=fn(ids))
    assert torch.equal(got, fn(want_routes))
    assert got.layout == LAYOUT


def test_ranges_are_the_zigzag_chunks_clipped_to_each_sample(filled):
    # Padded to S = 24 under CP=2: rank 0 holds positions 0-5 and 18-23, rank 1 6-17.
    shard = TokenShard.padded(LENGTHS, 24)
    assert shard.map(lambda x: zigzag(x, 2, 0)).ranges() == [
        [(0, 6)],
        [(0, 1)],
        [(0, 2)],
        [(0, 6), (18, 22)],
        [(0, 6)],
    ]
    assert shard.map(lambda x: zigzag(x, 2, 1)).ranges() == [
        [(6, 13)],
        [(0, 0)],
        [(0, 0)],
        [(6, 18)],
        [(6, 7)],
    ]


def test_packed_shard_matches_packing_and_its_bounds():
    shard = TokenShard.packed([3, 0, 5], multiple=4)
    assert shard.index.tolist() == [[0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1, -1]]
    assert shard.cu_seqlens().tolist() == [0, 4, 4, 12]
    assert shard.ranges() == [[(0, 3)], [(0, 0)], [(0, 5)]]
    with pytest.raises(InvalidArgumentError, match=r"TokenShard\.packed"):
        shard.map(lambda x: x).cu_seqlens()


def test_every_token_lands_on_exactly_one_rank(filled):
    store, refs = filled
    base = TokenShard.padded(LENGTHS, 24)
    seen = [0] * len(LENGTHS)
    for cp_rank in range(3):
        for tp_rank in range(2):
            shard = base.map(lambda x, c=cp_rank, t=tp_rank: contiguous(zigzag(x, 3, c), 2, t))
            table = store.read(refs, ranges=shard.ranges())
            counts = table.column("num_tokens").to_pylist()
            assert counts == shard.num_tokens()
            seen = [a + b for a, b in zip(seen, counts, strict=True)]
    assert seen == LENGTHS  # six ranks read each token once: no rank reads a whole sample


def test_bad_shards_and_mismatched_reads_raise(filled):
    store, refs = filled
    with pytest.raises(InvalidArgumentError, match="outside the 45 tokens"):
        TokenShard(torch.tensor([[0, 45]]), LENGTHS)
    with pytest.raises(InvalidArgumentError, match="outside"):
        TokenShard(torch.tensor([[0, -2]]), LENGTHS)
    with pytest.raises(InvalidArgumentError, match="exceed seq_len"):
        TokenShard.padded(LENGTHS, 20)
    shard = TokenShard.padded(LENGTHS, 24).map(lambda x: zigzag(x, 2, 1))
    whole = store.read(refs)
    with pytest.raises(InvalidRoutesError, match=r"ranges=shard\.ranges"):
        shard.place(whole)  # read without the shard's ranges
    table = store.read(refs, ranges=shard.ranges())
    _, ids = full_padded(store, refs, 24)
    with pytest.raises(InvalidRoutesError, match="the shard's shape"):
        shard.place(table, input_ids=ids)  # not sliced as the shard was
    local = zigzag(ids, 2, 1).clone()
    local[3, 2] += 1  # sample 3's token 8 (position 6 + 2 of the rank's chunk)
    with pytest.raises(TokenMismatchError, match=r"'s3'.* at position 8 "):
        shard.place(table, input_ids=local)
    local[3, 2] -= 1
    assert shard.place(table, input_ids=local).shape == (5, 12, 2, 2)
