"""A ref names one put; a put of several samples stores all of them or none.

Through the public API on a real store: an id released and put again (same tokens, other
routes) is never read or released through a ref of the earlier put; `put_many` of a
request's completions into too little room, with a duplicate id, with one bad sample, or
cut short by an exception or a SIGKILL in the middle of its publish, leaves the store as
it was.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from routing_replay import PutRequest, RoutingLayout, RoutingStore
from routing_replay.errors import (
    ConcurrentReleaseError,
    DuplicateSampleError,
    InvalidArgumentError,
    InvalidRoutesError,
    SampleNotFoundError,
    SampleReplacedError,
    StoreFullError,
)
from routing_replay.store import samples as sample_index
from routing_replay.store.lock import interleave

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=16, moe_layers=(0, 2))
P = 8  # tokens per page


@pytest.fixture
def store(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=32 * P, page_tokens=P) as s:
        yield s


def routes(seed: int, tokens: int) -> np.ndarray:
    return LAYOUT.random_routes(np.random.default_rng(seed), tokens)


def snapshot(store: RoutingStore) -> tuple:
    """What a failed operation must leave unchanged: samples, their routes, page use."""
    s = store.stats()
    ids = sorted(store.read(store_ids(store)).column("sample_id").to_pylist())
    return ids, [store.get(i).tobytes() for i in ids], s.pages_used, s.pages_pending, s.samples


def store_ids(store: RoutingStore) -> list[str]:
    t = store._core.tables
    return [bytes(t.s_sample_id[s]).decode() for s in store._core.samples.published().tolist()]


# -- a ref names one put -------------------------------------------------------------------


def test_a_ref_of_a_released_and_reput_id_reads_and_releases_nothing(store):
    tokens = np.arange(20) + 3
    r1, r2 = routes(1, 20), routes(2, 20)
    old = store.put("s3-p0-0", r1, token_ids=tokens, policy_version=3)
    store.release([old])
    new = store.put("s3-p0-0", r2, token_ids=tokens, policy_version=4)  # same tokens
    assert (old.tokens_digest, old.num_tokens) == (new.tokens_digest, new.num_tokens)
    assert new.serial > old.serial
    for call in (lambda: store.get(old), lambda: store.read([old]), lambda: store.release([old])):
        with pytest.raises(SampleReplacedError, match=r"'s3-p0-0' through this ref: it names put"):
            call()
    assert old not in store and new in store and "s3-p0-0" in store
    np.testing.assert_array_equal(store.get(new), r2)  # the old ref's release took nothing
    np.testing.assert_array_equal(store.get("s3-p0-0"), r2)  # by id: the current sample
    store.release([new])
    with pytest.raises(SampleNotFoundError, match="already released"):
        store.release([old])
    store.verify()


def test_a_stale_ref_in_a_batch_changes_nothing(store):
    keep = store.put("keep", routes(3, 9))
    stale = store.put("gone", routes(4, 9))
    store.release([stale])
    store.put("gone", routes(5, 9))
    before = snapshot(store)
    with pytest.raises(SampleReplacedError):
        store.release([keep, stale])  # refs are resolved before anything is released
    assert snapshot(store) == before
    with pytest.raises(SampleReplacedError):
        store.read([keep, stale])


def test_a_reput_between_locate_and_check_is_seen(store):
    # "b" lies entirely on pages "a" shares, so putting "b" again with equal routes reuses
    # the very pages at their generations: only the serial tells the new put apart.
    tokens, r = np.arange(2 * P) + 3, routes(6, 2 * P)
    store.put("a", np.concatenate([r, routes(7, P)]), token_ids=np.arange(3 * P) + 3)
    ref = store.put("b", r, token_ids=tokens)
    done = []

    def reput(point: str) -> None:
        if point == "read.locate:drop" and not done:
            done.append(point)
            store.release([ref])
            store.put("b", r, token_ids=tokens)

    with interleave(reput), pytest.raises(ConcurrentReleaseError, match="released"):
        store.read([ref])
    assert done and store.stats().pages_used == 3


# -- put_many: all or none -----------------------------------------------------------------


def completions(n: int, prompt: int = 2 * P, new: int = 10) -> list[PutRequest]:
    """n samples of one prompt (GRPO): equal prompt tokens and routes, own completions."""
    rng = np.random.default_rng(8)
    prompt_ids, prompt_routes = rng.integers(3, 1000, prompt), routes(9, prompt)
    return [
        PutRequest(
            f"req-{j}",
            np.concatenate([prompt_routes, routes(10 + j, new)]),
            prompt_len=prompt,
            token_ids=np.concatenate([prompt_ids, rng.integers(3, 1000, new)]),
            policy_version=7,
        )
        for j in range(n)
    ]


def test_put_many_shares_a_prompt_within_the_put_as_puts_one_by_one_do(store, name):
    batch = completions(4)
    refs = store.put_many(batch)
    used = store.stats().pages_used
    assert used == 2 + 4 * 2  # the 2 prompt pages once, 2 own pages per completion
    for ref, req in zip(refs, batch, strict=True):
        np.testing.assert_array_equal(store.get(ref), req.routes)
        assert (ref.sample_id, ref.prompt_len, ref.policy_version) == (req.sample_id, 2 * P, 7)
    assert [r.serial for r in refs] == list(range(refs[0].serial, refs[0].serial + 4))
    with RoutingStore.create(f"{name}-single", LAYOUT, 32 * P, page_tokens=P) as single:
        for req in batch:
            single.put(req.sample_id, req.routes, token_ids=req.token_ids)
        assert single.stats().pages_used == used
    store.verify()


def test_put_many_shares_each_page_with_the_earliest_sample_equal_up_to_it(store):
    # Five samples with the same 4 pages of tokens (+ a partial page of their own): routes
    # equal to sample 0's, or to sample 1's, which leaves 0's at page 2 (same tokens), or
    # to neither from page 3 on. Each page is stored once per distinct chain up to it.
    tokens = np.arange(4 * P, dtype=np.int32) + 3
    first, other = routes(1, 4 * P), routes(2, 4 * P)
    forked = np.concatenate([first[: 2 * P], other[2 * P :]])  # 0's until page 2
    late = np.concatenate([first[: 3 * P], other[3 * P :]])  # 0's until page 3
    heads = [first, forked, forked, first, late]
    batch = [
        PutRequest(
            f"s{k}",
            np.concatenate([head, routes(10 + k, 3)]),
            token_ids=np.concatenate([tokens, [7, 8, k]]),
        )
        for k, head in enumerate(heads)
    ]
    refs = store.put_many(batch)
    # s0: 4 + 1; s1: 2 of its own + 1; s2: s1's chain + 1; s3: s0's + 1; s4: 1 + 1.
    assert store.stats().pages_used == 5 + 3 + 1 + 1 + 2
    for ref, req in zip(refs, batch, strict=True):
        np.testing.assert_array_equal(store.get(ref), req.routes)
    store.verify()


def test_put_many_into_room_for_two_of_three_stores_none(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=8 * P, page_tokens=P) as store:
        store.put("other", routes(1, P))  # 1 page; 7 left, the request needs 2 + 3 * 2 = 8
        before = snapshot(store)
        with pytest.raises(StoreFullError, match="a put of 3 samples needs 8 more pages"):
            store.put_many(completions(3), timeout=0.05)
        assert snapshot(store) == before
        store.put_many(completions(2))  # 6 pages: fits
        store.verify()


def test_put_many_with_a_stored_id_or_a_bad_sample_stores_none(store):
    store.put("req-2", routes(1, 5))
    before = snapshot(store)
    with pytest.raises(DuplicateSampleError, match="'req-2' is already in store"):
        store.put_many(completions(3))
    assert snapshot(store) == before
    bad = completions(2)
    bad.append(PutRequest("req-9", np.full((5, 2, 2), 16)))  # expert 16 of 16
    with pytest.raises(InvalidRoutesError, match="out of range"):
        store.put_many(bad)
    with pytest.raises(InvalidArgumentError, match="'req-0' more than once"):
        store.put_many([*completions(1), *completions(1)])
    with pytest.raises(InvalidArgumentError, match="PutRequest"):
        store.put_many([("req-0", routes(1, 5))])
    assert snapshot(store) == before
    store.verify()


def test_put_many_cut_short_inside_its_publish_stores_none(store, monkeypatch):
    store.put("other", routes(1, 5))
    before = snapshot(store)
    real, calls = sample_index.SampleIndex.publish, []

    def fail_on_third(self, *args):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt  # an async exception inside the holding
        return real(self, *args)

    monkeypatch.setattr(sample_index.SampleIndex, "publish", fail_on_third)
    with pytest.raises(KeyboardInterrupt):
        store.put_many(completions(4))
    monkeypatch.undo()
    assert len(calls) == 3  # two samples were published inside the holding, then rolled back
    assert snapshot(store) == before
    store.verify()


def test_put_many_killed_inside_its_publish_stores_none(store):
    store.put("other", routes(1, 5))
    before = snapshot(store)
    pid = os.fork()
    if pid == 0:  # a writer process, killed after its second sample's slot was filled
        try:
            writer = RoutingStore.attach(store.name)
            real, calls = sample_index.SampleIndex.publish, []

            def die_on_third(self, *args):
                calls.append(args[0])
                if len(calls) == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(self, *args)

            sample_index.SampleIndex.publish = die_on_third
            writer.put_many(completions(4))
        finally:
            os._exit(3)  # not reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert store._core.tables.dirty  # it died holding the lock, half-way through its publish
    assert snapshot(store) == before  # the next locker rolled it back and reclaimed its pages
    assert "req-0" not in store and "req-1" not in store
    store.verify()
