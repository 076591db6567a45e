"""Policy versions on refs: put validates them, refs carry them, split_stale bounds staleness."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import InvalidArgumentError
from routing_replay.ray import split_stale

LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=8)


@pytest.fixture
def store(name):
    with RoutingStore.create(name, LAYOUT, 1024) as s:
        yield s


def routes(T=10, seed=0):
    return LAYOUT.random_routes(np.random.default_rng(seed), T)


def test_refs_carry_versions_through_pickle(store):
    one = store.put("a", routes(), policy_version=3)
    turns = store.put("b", routes(), policy_version=[(0, 2), (6, 4)])
    none = store.put("c", routes())
    assert (one.policy_versions, one.policy_version) == (((0, 3),), 3)
    assert (turns.policy_versions, turns.policy_version) == (((0, 2), (6, 4)), 2)
    assert (none.policy_versions, none.policy_version) == ((), None)
    assert pickle.loads(pickle.dumps(turns)) == turns


@pytest.mark.parametrize(
    ("version", "words"),
    [
        (-1, "must be an int >= 0 or a sequence"),
        (True, "must be an int >= 0 or a sequence"),
        ("3", "must be an int >= 0 or a sequence"),
        ([], "must be an int >= 0 or a sequence"),
        ([(0, 1.5)], "must be an int >= 0 or a sequence"),
        ([(1, 2)], r"spans \[\(1, 2\)\] of sample 'x' must start at token 0"),
        ([(0, 1), (0, 2)], "rise strictly below its 10 tokens"),
        ([(0, 1), (10, 2)], "rise strictly below its 10 tokens"),
    ],
)
def test_bad_versions_are_refused_and_store_nothing(store, version, words):
    with pytest.raises(InvalidArgumentError, match=words):
        store.put("x", routes(), policy_version=version)
    assert store.stats().samples == 0


def test_split_stale_keeps_order_and_needs_versions(store):
    refs = [store.put(f"s{v}", routes(seed=v), policy_version=v) for v in (5, 2, 4, 3)]
    episode = store.put("e", routes(), policy_version=[(0, 3), (4, 5)])  # oldest span counts
    fresh, stale = split_stale([*refs, episode], policy_version=5, max_staleness=1)
    assert [r.sample_id for r in fresh] == ["s5", "s4"]
    assert [r.sample_id for r in stale] == ["s2", "s3", "e"]
    fresh, stale = split_stale(refs, policy_version=5, max_staleness=0)
    assert [r.sample_id for r in fresh] == ["s5"]
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        split_stale(refs, policy_version=5, max_staleness=-1)
    unversioned = store.put("u", routes())
    with pytest.raises(InvalidArgumentError, match="sample 'u' was put without a policy_version"):
        split_stale([*refs, unversioned], policy_version=5, max_staleness=1)


def test_reads_take_no_staleness_bound(store):
    # A read used to release the stale samples it left out: a side effect of a read.
    from routing_replay.ray import fetch_batch, read_dataset

    refs = [store.put("s", routes(), policy_version=1)]
    for read in (fetch_batch, read_dataset):
        with pytest.raises(InvalidArgumentError, match=r"split_stale\(refs"):
            read(refs, policy_version=3, max_staleness=1)
    assert store.stats().samples == 1  # nothing released by a refused call


@pytest.mark.parametrize("size", [-1, 0, 2.5, True, "8"])
def test_read_dataset_refuses_a_block_size_that_is_not_a_positive_int(store, size):
    # samples_per_block=-1 used to read nothing, then release every sample (all lost).
    from routing_replay.ray import read_dataset

    refs = [store.put(f"s{i}", routes(), policy_version=1) for i in range(3)]
    with pytest.raises(InvalidArgumentError, match="samples_per_block must be"):
        read_dataset(refs, release=True, samples_per_block=size)
    assert store.stats().samples == 3


def test_the_ray_paths_refuse_what_is_not_a_ref_before_touching_a_store(store):
    from routing_replay.ray import fetch_batch, read_dataset, release_refs, split_stale

    ref = store.put("s", routes(), policy_version=1)
    for call in (fetch_batch, read_dataset, release_refs):
        with pytest.raises(InvalidArgumentError, match="takes the RoutingRefs that put returned"):
            call([ref, "s"])
    with pytest.raises(InvalidArgumentError, match="takes the RoutingRefs"):
        split_stale(["s"], policy_version=3, max_staleness=1)
    for bad in (None, -1, 1.5):
        with pytest.raises(InvalidArgumentError, match="max_staleness must be an int >= 0"):
            split_stale([ref], policy_version=3, max_staleness=bad)
    assert split_stale([ref], policy_version=3, max_staleness=2) == ([ref], [])
    assert store.stats().samples == 1
