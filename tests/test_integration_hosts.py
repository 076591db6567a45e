"""The vLLM hosts' store handles outlive the store they attached: the middleware and the
rollout hosts attach a store removed and created anew under the same name (a trainer that
restarted) instead of refusing every later response's routes.

Runs in the main suite: `RoutesToRefs` and `StoreHost` import vLLM lazily, and what is
tested here is their store handle, not the engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from routing_replay import RoutingLayout, RoutingStore, StoreUnavailableError
from routing_replay.integrations.vllm import StoreHost
from routing_replay.integrations.vllm_middleware import STORE_ENV, RoutesToRefs
from routing_replay.testing import tiny_moe

LAYOUT = RoutingLayout.from_hf_config(tiny_moe().config)


def recreate(store: RoutingStore) -> RoutingStore:
    """The trainer restarts: its store goes, a new one takes the name."""
    store.close()
    store.unlink()
    return RoutingStore.create(store.name, LAYOUT, 4096)


def put_one(store: RoutingStore, sample_id: str) -> np.ndarray:
    routes = LAYOUT.random_routes(np.random.default_rng(len(sample_id)), 12)
    store.put(sample_id, routes)
    return routes


def test_the_middleware_attaches_a_store_created_anew(name, monkeypatch):
    monkeypatch.setenv(STORE_ENV, name)
    owner = RoutingStore.create(name, LAYOUT, 4096)
    middleware = RoutesToRefs(app=None)
    first = middleware.store()
    put_one(first, "before")
    owner = recreate(owner)
    with pytest.raises(StoreUnavailableError, match="re-created"):
        put_one(first, "stale")  # what every later response got before
    second = middleware.store()
    assert second is not first and second.store_uid == owner.store_uid
    routes = put_one(second, "after")
    assert np.array_equal(owner.get("after"), routes) and len(owner) == 1
    assert middleware.store() is second  # kept while it is current
    second.close()
    owner.close()
    owner.unlink()


def test_a_host_with_a_store_name_attaches_a_store_created_anew(name, tmp_path):
    tiny_moe().config.save_pretrained(tmp_path)
    host = StoreHost()
    host._host("job", str(tmp_path), name, capacity_tokens=4096, page_tokens=16)
    owner = RoutingStore.create(name, LAYOUT, 4096)
    first = host.store()
    put_one(first, "before")
    owner = recreate(owner)
    second = host.store()
    assert second is not first and second.store_uid == owner.store_uid
    routes = put_one(second, "after")
    assert np.array_equal(owner.get("after"), routes)
    second.close()
    owner.close()
    owner.unlink()
