"""Property-based: any sequence of put / read / release keeps the store's tables consistent,
also when another handle releases samples and reuses their pages in the middle of a put or
a read."""

from __future__ import annotations

import contextlib
import os
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import ConcurrentReleaseError, SampleNotFoundError, StoreFullError
from routing_replay.store.lock import interleave
from routing_replay.store.segment import segment_path

LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=4)
PAGE = 4
CAPACITY = 64  # 16 pages: full stores happen often
PROMPTS = [np.arange(12), np.arange(12) + 100, np.arange(8) + 500]


def batch_routes(batch) -> dict[str, np.ndarray]:
    """{sample id: routes} of a record batch from `read`."""
    col = batch.column("routed_experts")
    offsets = col.offsets.to_numpy()
    values = col.flatten().flatten().to_numpy().view(np.int8).reshape(-1, 2, 2)
    ids = batch.column("sample_id").to_pylist()
    return {s: values[offsets[j] : offsets[j + 1]] for j, s in enumerate(ids)}


class StoreMachine(RuleBasedStateMachine):
    """A model (dict of id -> routes) run side by side with a real store."""

    def __init__(self) -> None:
        super().__init__()
        self.name = f"test-prop-{uuid.uuid4().hex[:10]}"
        self.store = RoutingStore.create(
            self.name, LAYOUT, capacity_tokens=CAPACITY, page_tokens=PAGE, put_timeout=0
        )
        self.other = RoutingStore.attach(self.name, put_timeout=0)  # a second writer
        self.model: dict[str, np.ndarray] = {}
        self.tokens: dict[str, np.ndarray] = {}
        self.counter = 0

    def new_id(self) -> str:
        self.counter += 1
        return f"p{self.counter - 1}"

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        prompt_len=st.integers(0, 12),
        tail=st.integers(0, 10),
        same_routes=st.booleans(),
        seed=st.integers(0, 3),
        shared=st.booleans(),
    )
    def put(self, prompt, prompt_len, tail, same_routes, seed, shared):
        tokens = np.concatenate([PROMPTS[prompt][:prompt_len], np.arange(tail) + 1000])
        if len(tokens) == 0:
            return
        rng = np.random.default_rng(prompt if same_routes else seed + 10)
        routes = LAYOUT.random_routes(rng, len(tokens))
        routes[rng.random((len(tokens), 2)) < 0.2] = -1
        sid = self.new_id()
        used = self.store.stats().pages_used
        try:
            self.store.put(sid, routes, token_ids=tokens if shared else None)
        except StoreFullError:
            assert used + -(-len(tokens) // PAGE) > CAPACITY // PAGE or shared
            return
        self.model[sid] = routes
        self.tokens[sid] = tokens

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        prompt_len=st.integers(4, 12),
        tail=st.integers(0, 6),
        variant=st.integers(0, 1),
        at=st.integers(0, 6),
        seed_sharer=st.booleans(),
        data=st.data(),
    )
    def put_while_pages_are_reused(self, prompt, prompt_len, tail, variant, at, seed_sharer, data):
        """A put with token_ids during which, at its `at`-th lock point, the other handle
        releases samples and puts new ones with the same tokens but other routes: freed
        pages come back holding other routes under the same sharing keys. With
        `seed_sharer`, a sample it shares pages with is put first."""
        tokens = np.concatenate([PROMPTS[prompt][:prompt_len], np.arange(tail) + 1000])
        routes = self.routes(prompt, variant, len(tokens))
        if seed_sharer:
            first = self.routes(prompt, variant, len(tokens) + 1)  # the same first rows
            first_id = self.new_id()
            with contextlib.suppress(StoreFullError):
                self.other.put(first_id, first, token_ids=np.append(tokens, 2000))
                self.model[first_id], self.tokens[first_id] = first, np.append(tokens, 2000)
        # Those that hold this put's first page of tokens (its pages to share), or any.
        sharers = [v for v, t in self.tokens.items() if np.array_equal(t[:PAGE], tokens[:PAGE])]
        if data.draw(st.booleans()):
            victims = sharers
        elif self.model:
            victims = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True))
        else:
            victims = []
        others = data.draw(
            st.lists(
                st.tuples(st.sampled_from(["same", "victim"]), st.integers(0, 2)),
                min_size=1,
                max_size=3,
            )
        )
        sid = self.new_id()
        points: list[str] = []

        def race(point: str) -> None:
            points.append(point)
            if len(points) - 1 == at:
                self.reuse(victims, others, tokens, prompt)

        with interleave(race):
            try:
                self.store.put(sid, routes, token_ids=tokens)
            except StoreFullError:
                return
        self.model[sid], self.tokens[sid] = routes, tokens

    @precondition(lambda self: self.model)
    @rule(at=st.integers(0, 3), one=st.booleans(), data=st.data())
    def read_while_pages_are_reused(self, at, one, data):
        """A get (or read) during which, at its `at`-th lock point, the other handle releases
        samples (some of those read) and reuses their pages for other routes: the routes
        read are exact, or the read raises; never another sample's routes."""
        ids = data.draw(
            st.lists(
                st.sampled_from(sorted(self.model)),
                min_size=1,
                max_size=1 if one else 4,
                unique=True,
            )
        )
        if data.draw(st.booleans()):
            victims = ids
        else:
            victims = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True))
        others = data.draw(
            st.lists(st.tuples(st.sampled_from(["same", "victim"]), st.integers(0, 2)), max_size=3)
        )
        wanted = {i: self.model[i] for i in ids}
        points: list[str] = []

        def race(point: str) -> None:
            points.append(point)
            if len(points) - 1 == at:
                self.reuse(victims, others, self.tokens[ids[0]], len(PROMPTS))

        with interleave(race):
            try:
                if one:
                    got = {ids[0]: self.store.get(ids[0])}
                else:
                    got = batch_routes(self.store.read(ids))
            except (ConcurrentReleaseError, SampleNotFoundError):
                assert set(ids) & set(victims)  # only a sample released meanwhile is missed
                return
        for i, routes in got.items():
            assert np.array_equal(routes, wanted[i]), i

    def reuse(self, victims, others, tokens, prompt) -> None:
        """On the other handle: release `victims`, then put a sample for each of `others`
        with the same tokens as `tokens` ("same") or as the first victim ("victim"), routed
        otherwise: freed pages come back holding other routes under the same keys."""
        with interleave(lambda _: None):
            freed = self.tokens[victims[0]] if victims else tokens
            self.other.release(victims)
            for v in victims:
                del self.model[v], self.tokens[v]
            for whose, variant in others:
                like = tokens if whose == "same" else freed
                routes = self.routes(prompt, variant + 3, len(like))  # not the put's
                oid = self.new_id()
                try:
                    self.other.put(oid, routes, token_ids=like)
                except StoreFullError:
                    continue
                self.model[oid], self.tokens[oid] = routes, like

    @staticmethod
    def routes(prompt: int, variant: int, num_tokens: int) -> np.ndarray:
        """Routes whose first rows are the same for a (prompt, variant) at any length."""
        rng = np.random.default_rng([prompt, variant])
        return np.concatenate([LAYOUT.random_routes(rng, 1) for _ in range(num_tokens)])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        self.store.release(ids)
        for sid in ids:
            del self.model[sid], self.tokens[sid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        batch = self.store.read(ids)
        values = batch.column("routed_experts").flatten().flatten().to_numpy()
        expected = np.concatenate([self.model[i] for i in ids]).astype(np.int8)
        assert np.array_equal(values.view(np.int8).reshape(-1, 2, 2), expected)

    @invariant()
    def consistent(self):
        self.store.verify()
        stats = self.store.stats()
        assert stats.samples == len(self.model)
        assert stats.tokens_stored == sum(len(r) for r in self.model.values())
        assert stats.pages_used <= stats.pages_total and stats.pages_pending == 0
        free = stats.pages_total - stats.pages_used
        assert free == int((self.store._core.tables.p_refcount == 0).sum())
        for sid, routes in self.model.items():
            assert np.array_equal(self.store.get(sid), routes)

    def teardown(self):
        self.other.close()
        self.store.close()
        os.unlink(segment_path(self.name))


def _machine_test(examples: int) -> type:
    """The state machine as a test case of `examples` runs of up to 25 steps."""

    class Case(StoreMachine.TestCase):
        settings = settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )

    return Case


TestStoreProperties = _machine_test(15)  # the fast tier's
TestStorePropertiesLong = pytest.mark.stress(_machine_test(60))


@st.composite
def page_batches(draw):
    """Samples of a put_many, page by page: each full page's tokens and routes one of a few
    variants (equal pages at equal positions happen often), then a partial page or none."""
    count = draw(st.integers(2, 6))
    return [
        (
            [
                (draw(st.integers(0, 1)), draw(st.integers(0, 2)))
                for _ in range(draw(st.integers(1, 5)))
            ],
            draw(st.integers(0, PAGE - 1)),
        )
        for _ in range(count)
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_batches())
def test_put_many_stores_each_distinct_page_prefix_once(samples):
    # A page is stored once per distinct content of the pages up to and including it: the
    # count of distinct prefixes, worked out here from the variants, not by the store.
    from routing_replay import PutRequest

    requests, prefixes = [], set()
    for k, (pages, tail) in enumerate(samples):
        toks, rows = [], []
        for i, (tv, rv) in enumerate(pages):
            toks.append(np.arange(PAGE) + 1000 * tv + 10 * i)
            rng = np.random.default_rng([rv, i])
            rows.append(LAYOUT.random_routes(rng, PAGE))
            prefixes.add(tuple(pages[: i + 1]))
        if tail:
            toks.append(np.full(tail, 7 + k))
            rows.append(LAYOUT.random_routes(np.random.default_rng([99, k]), tail))
        requests.append(PutRequest(f"s{k}", np.concatenate(rows), token_ids=np.concatenate(toks)))
    name = f"test-prop-{uuid.uuid4().hex[:10]}"
    with RoutingStore.create(name, LAYOUT, capacity_tokens=256, page_tokens=PAGE) as store:
        refs = store.put_many(requests)
        tails = sum(1 for _, tail in samples if tail)
        assert store.stats().pages_used == len(prefixes) + tails
        for ref, req in zip(refs, requests, strict=True):
            np.testing.assert_array_equal(store.get(ref), req.routes)
        store.verify()
