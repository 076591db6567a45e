"""Reads of token ranges: each row holds exactly the requested tokens, in order, and only
those tokens are copied. Checked against slices of a full read, over samples that share
their prompt pages (a GRPO group), with random and two-chunk (context-parallel) ranges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay import (
    InvalidArgumentError,
    PutRequest,
    RoutingLayout,
    RoutingStore,
    TokenMismatchError,
    to_torch,
)
from routing_replay.reader import cu_seqlens
from routing_replay.store import read as read_module

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=16, moe_layers=(0, 2))
P = 8


@pytest.fixture
def group(name):
    """A store holding a GRPO group: 4 samples of one 20-token prompt (2 shared full pages),
    completions of 5-30 tokens, and one sample put without token ids."""
    rng = np.random.default_rng(0)
    prompt_ids, prompt_routes = rng.integers(3, 500, 20), LAYOUT.random_routes(rng, 20)
    samples = {}
    requests = []
    for j, n in enumerate((5, 13, 30, 8)):
        routes = np.concatenate([prompt_routes, LAYOUT.random_routes(rng, n)])
        routes[-1] = -1
        tokens = np.concatenate([prompt_ids, rng.integers(3, 500, n)])
        samples[f"g{j}"] = (routes, tokens)
        requests.append(PutRequest(f"g{j}", routes, prompt_len=20, token_ids=tokens))
    bare = LAYOUT.random_routes(rng, 17)
    samples["bare"] = (bare, None)
    requests.append(PutRequest("bare", bare, prompt_len=4))
    with RoutingStore.create(name, LAYOUT, capacity_tokens=64 * P, page_tokens=P) as store:
        refs = store.put_many(requests)
        assert store.stats().pages_used < sum(-(-len(r) // P) for r, _ in samples.values())
        yield store, refs, samples


def expected(samples, ref, part, pairs):
    """The rows a full read gives, sliced by hand: routes, token ids, prompt tokens."""
    routes, tokens = samples[ref.sample_id]
    lo = ref.prompt_len if part == "completion" else 0
    index = np.concatenate([np.arange(lo + a, lo + b) for a, b in pairs]).astype(int)
    prompt = int((index < ref.prompt_len).sum())
    return routes[index], None if tokens is None else tokens[index], prompt


def random_pairs(rng, length: int) -> list[tuple[int, int]]:
    cuts = np.sort(rng.integers(0, length + 1, 2 * int(rng.integers(1, 4))))
    return [(int(a), int(b)) for a, b in cuts.reshape(-1, 2)]


def cp_chunks(length: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """Context parallel's load-balanced split: 2*cp chunks, rank r takes r and 2cp-1-r."""
    edges = np.linspace(0, length, 2 * cp + 1).astype(int)
    first, second = rank, 2 * cp - 1 - rank
    return [
        (int(edges[first]), int(edges[first + 1])),
        (int(edges[second]), int(edges[second + 1])),
    ]


@pytest.mark.parametrize("part", ["all", "prompt", "completion"])
def test_random_and_context_parallel_ranges_equal_slices_of_a_full_read(group, part):
    store, refs, samples = group
    rng = np.random.default_rng(1)
    for trial in range(40):
        lengths = [len(store.get(r, part)) for r in refs]
        if trial % 2:
            cp = int(rng.integers(1, 4))
            ranges = [cp_chunks(n, cp, int(rng.integers(0, cp))) for n in lengths]
        else:
            ranges = [random_pairs(rng, n) for n in lengths]
        batch = store.read(refs, part=part, ranges=ranges)
        routes = to_torch(batch).numpy()
        bounds = cu_seqlens(batch).tolist()
        for i, (ref, pairs) in enumerate(zip(refs, ranges, strict=True)):
            want, want_tokens, prompt = expected(samples, ref, part, pairs)
            np.testing.assert_array_equal(routes[bounds[i] : bounds[i + 1]], want)
            assert batch.column("num_tokens")[i].as_py() == len(want)
            assert batch.column("prompt_len")[i].as_py() == prompt
            got_tokens = batch.column("token_ids")[i].as_py()
            assert got_tokens == (None if want_tokens is None else want_tokens.tolist())


def test_only_the_requested_tokens_are_copied(group, monkeypatch):
    store, refs, _ = group
    copied = []
    real = read_module.ReadPlan.copy

    def spy(self, pages_data, i, span, out):
        if pages_data is store._t.data:
            copied.append((i, span.start, span.stop))
        return real(self, pages_data, i, span, out)

    monkeypatch.setattr(read_module.ReadPlan, "copy", spy)
    store.read(refs[:3], ranges=[(2, 3), [(0, 0), (9, 17)], [(20, 21), (40, 50)]])
    assert copied == [(0, 2, 3), (1, 0, 0), (1, 9, 17), (2, 20, 21), (2, 40, 50)]


def test_token_checks_work_on_slices(group):
    store, refs, samples = group
    ranges = [[(0, 4), (21, 24)], [(10, 22)]]
    batch = store.read(refs[1:3], ranges=ranges)
    trained = np.concatenate(
        [
            samples[ref.sample_id][1][a:b]
            for ref, pairs in zip(refs[1:3], ranges, strict=True)
            for a, b in pairs
        ]
    )
    to_torch(batch, input_ids=torch.from_numpy(trained))  # the rollout's tokens: passes
    trained[5] += 1
    with pytest.raises(TokenMismatchError, match=r"sample 'g1': .* position 5"):
        to_torch(batch, input_ids=torch.from_numpy(trained))


@pytest.mark.parametrize(
    ("ranges", "words"),
    [
        ([(3, 2)], "must rise"),
        ([(0, 34)], "stay within its 33 tokens"),
        ([[(0, 5), (4, 9)]], "not overlap"),
        ([(-1, 2)], "pair of ints >= 0"),
        ([(0.5, 2)], "pair of ints >= 0"),
        (["0:2"], "pair of ints >= 0"),
        ([[]], "pair of ints >= 0"),
        ([(0, 2), (0, 2)], "2 entries for 1 samples"),
    ],
)
def test_bad_ranges_raise_and_change_nothing(group, ranges, words):
    store, refs, _ = group
    before = store.stats()
    with pytest.raises(InvalidArgumentError, match=words):
        store.read(refs[1:2], ranges=ranges)
    assert store.stats() == before
    store.verify()
