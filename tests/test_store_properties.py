"""Property-based: any sequence of put / read / release keeps the store's tables consistent."""

from __future__ import annotations

import os
import uuid

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from routing_replay import RoutingLayout, RoutingStore, StoreFullError
from routing_replay.shm import segment_path

LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=4)
PAGE = 4
CAPACITY = 64  # 16 pages: full stores happen often
PROMPTS = [np.arange(12), np.arange(12) + 100, np.arange(8) + 500]


class StoreMachine(RuleBasedStateMachine):
    """A model (dict of id -> routes) run side by side with a real store."""

    def __init__(self) -> None:
        super().__init__()
        self.name = f"test-prop-{uuid.uuid4().hex[:10]}"
        self.store = RoutingStore.create(
            self.name, LAYOUT, capacity_tokens=CAPACITY, page_tokens=PAGE, put_timeout=0
        )
        self.model: dict[str, np.ndarray] = {}
        self.counter = 0

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
        sid = f"p{self.counter}"
        self.counter += 1
        used = self.store.stats().pages_used
        try:
            self.store.put(sid, routes, token_ids=tokens if shared else None)
        except StoreFullError:
            assert used + -(-len(tokens) // PAGE) > CAPACITY // PAGE or shared
            return
        self.model[sid] = routes

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        self.store.release(ids)
        for sid in ids:
            del self.model[sid]

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
        assert free == int((self.store._t.p_refcount == 0).sum())
        for sid, routes in self.model.items():
            assert np.array_equal(self.store.get(sid), routes)

    def teardown(self):
        self.store.close()
        os.unlink(segment_path(self.name))


StoreMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreProperties = StoreMachine.TestCase
