"""The vLLM hosts' store handles outlive the store they attached: the middleware and the
rollout hosts attach a store removed and created anew under the same name (a trainer that
restarted) instead of refusing every later response's routes. The middleware releases
what it stored for a response that never reached the client (the send raised, the request
was cancelled, the client went away during the put), never one that did.

Runs in the main suite: `RoutesToRefs` and `StoreHost` import vLLM lazily, and what is
tested here is their store handle and the middleware's ASGI flow (a plain ASGI app that
answers as vLLM's completions endpoint does), not the engine.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
import types

import numpy as np
import pytest
import transformers

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import StoreUnavailableError, UnsupportedModelError
from routing_replay.integrations.vllm import RoutesNotStoredError, StoreHost, unclosed_handles
from routing_replay.integrations.vllm_middleware import (
    COMPLETIONS,
    COUNTS,
    PUT_TIMEOUT_ENV,
    STORE_ENV,
    RoutesToRefs,
    choice_ref,
)
from routing_replay.store.lock import interleave
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
    host._host("job", str(tmp_path), name, None)
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


PROMPT, OUTPUT = [1, 2, 3, 4], [5, 6, 7]  # 7 tokens: one page of 8


async def completions_app(scope, receive, send):
    """Answers as vLLM's /v1/completions does: one choice, its routes as base64 .npy."""
    request = json.loads((await receive())["body"])
    assert request["return_token_ids"] is True
    routes = LAYOUT.random_routes(np.random.default_rng(0), len(PROMPT) + len(OUTPUT) - 1)
    npy = io.BytesIO()
    np.save(npy, routes.astype(np.int32))
    choice = {"index": 0, "text": "", "token_ids": OUTPUT, "prompt_token_ids": PROMPT}
    choice["routed_experts"] = base64.b64encode(npy.getvalue()).decode()
    body = json.dumps({"id": "cmpl-x", "choices": [choice]}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Client:
    """One request's ASGI receive/send: the body, then (when `gone` is set) a disconnect;
    `send` raises `fail` or waits forever with `hang`."""

    def __init__(self, fail: BaseException | None = None, hang: bool = False) -> None:
        self.fail, self.hang = fail, hang
        self.gone = asyncio.Event()
        self.sent: list[dict] = []
        self._asked = False

    async def receive(self) -> dict:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": b'{"prompt": [1, 2, 3, 4]}'}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await asyncio.Event().wait()
        self.sent.append(message)

    def body(self) -> dict:
        return json.loads(self.sent[-1]["body"])


SCOPE = {"type": "http", "method": "POST", "path": COMPLETIONS, "headers": []}


async def until(check, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_the_middleware_releases_what_never_reached_the_client(name, monkeypatch, caplog):
    monkeypatch.setenv(STORE_ENV, name)
    monkeypatch.setenv(PUT_TIMEOUT_ENV, "30")
    store = RoutingStore.create(name, LAYOUT, 64, page_tokens=8)
    middleware = RoutesToRefs(completions_app)
    before = COUNTS.as_dict().get("undelivered", {})

    def counted(reason: str) -> int:  # responses released for `reason` in this test
        return COUNTS.as_dict().get("undelivered", {}).get(reason, 0) - before.get(reason, 0)

    def full() -> list:  # every free page held: the next response's put waits for room
        stats = store.stats()
        free = stats.pages_total - stats.pages_used - stats.pages_pending
        return [store.put("filler", LAYOUT.random_routes(np.random.default_rng(1), free * 8))]

    async def scenario() -> None:
        # Delivered: the sample stays, its ref in the body.
        ok = Client()
        await middleware(SCOPE, ok.receive, ok.send)
        ref = choice_ref(ok.body()["choices"][0])
        assert ref.sample_id in store and len(store) == 1
        # The send raises (a server whose client went away): released, each time.
        for _ in range(3):
            dropped = Client(fail=OSError("client disconnected"))
            with pytest.raises(OSError, match="client disconnected"):
                await middleware(SCOPE, dropped.receive, dropped.send)
        await until(lambda: len(store) == 1, "the undelivered samples stayed stored")
        assert counted("OSError") == 3
        # Cancelled while sending.
        stuck = Client(hang=True)
        task = asyncio.ensure_future(middleware(SCOPE, stuck.receive, stuck.send))
        await until(lambda: len(store) == 2, "the response was never stored")
        await asyncio.sleep(0.05)  # in its send
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: len(store) == 1, "the cancelled response's sample stayed stored")
        assert counted("cancelled") == 1
        # Cancelled while its put waits for room: released once the put has stored it.
        held = full()
        waiting = Client()
        task = asyncio.ensure_future(middleware(SCOPE, waiting.receive, waiting.send))
        await until(lambda: COUNTS.in_flight == 1, "the put never started")
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store.release(held)  # room: the put goes on and stores it, then it is released
        await until(lambda: COUNTS.in_flight == 0, "the put never ended")
        await until(lambda: counted("cancelled") == 2, "the cancelled put was not counted")
        await until(lambda: len(store) == 1, "the cancelled put's sample stayed stored")
        # The client goes away while the put waits (uvicorn then drops what is sent): the
        # body goes out with a null ref, the sample is released.
        held = full()
        leaving = Client()
        task = asyncio.ensure_future(middleware(SCOPE, leaving.receive, leaving.send))
        await until(lambda: COUNTS.in_flight == 1, "the put never started")
        leaving.gone.set()
        await asyncio.sleep(0.1)
        store.release(held)
        await task
        (choice,) = leaving.body()["choices"]
        assert choice["routing_ref"] is None and "routed_experts" not in choice
        assert choice["routing_error"] == (
            "RoutesNotStoredError: the response did not reach the client (disconnect): its "
            "routes were released"
        )
        await until(lambda: len(store) == 1, "the gone client's sample stayed stored")
        assert counted("disconnect") == 1
        assert (
            "routing_replay: response 'cmpl-x' (1 choices) did not reach the client (disconnect): "
            "its stored routes are released" in caplog.text
        )
        assert ref.sample_id in store  # the delivered one, all along

    try:
        asyncio.run(scenario())
    finally:
        store.close()
        store.unlink()


class Uvicorn(Client):
    """As uvicorn's request cycle: once the client has gone, `receive` answers a disconnect
    at once and `send` drops what it is given without raising."""

    async def send(self, message: dict) -> None:
        if not self.gone.is_set():
            self.sent.append(message)


def test_a_client_gone_before_the_watch_starts_leaves_nothing_stored(name, monkeypatch):
    monkeypatch.setenv(STORE_ENV, name)
    store = RoutingStore.create(name, LAYOUT, 64, page_tokens=8)
    before = dict(COUNTS.undelivered)
    try:
        for _ in range(3):  # it leaves after vLLM's handler answered, before the put
            client = Uvicorn()

            async def app(scope, receive, send, client=client):
                async def leaving(message: dict) -> None:
                    if message["type"] == "http.response.body":
                        client.gone.set()
                    await send(message)

                await completions_app(scope, receive, leaving)

            asyncio.run(RoutesToRefs(app)(SCOPE, client.receive, client.send))
            assert client.sent == []  # uvicorn dropped the response
        deadline = time.monotonic() + 10
        while len(store):
            assert time.monotonic() < deadline, f"{len(store)} samples stayed stored"
            time.sleep(0.01)
        assert COUNTS.undelivered["disconnect"] - before.get("disconnect", 0) == 3
    finally:
        store.close()
        store.unlink()


def test_a_null_body_passes_through_uncounted(name, monkeypatch, caplog):
    monkeypatch.setenv(STORE_ENV, name)
    store = RoutingStore.create(name, LAYOUT, 64, page_tokens=8)

    refused = dict(COUNTS.refused)
    try:
        for body in (b"null", b"{}", b'{"object": "error"}'):  # null: with_cancellation's

            async def app(scope, receive, send, body=body):
                await receive()
                headers = [(b"content-type", b"application/json")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})

            client = Client()
            asyncio.run(RoutesToRefs(app)(SCOPE, client.receive, client.send))
            start, end = client.sent
            assert end["body"] == body and start["status"] == 200
            assert not [k for k, _ in start["headers"] if k.startswith(b"x-routing-replay")]
        assert dict(COUNTS.refused) == refused
        assert "were not stored" not in caplog.text
    finally:
        store.close()
        store.unlink()


@pytest.mark.slow  # the fast tier stays under a minute
def test_a_failed_release_is_retried_until_done(name, monkeypatch):
    monkeypatch.setenv(STORE_ENV, name)
    monkeypatch.setenv(PUT_TIMEOUT_ENV, "1")
    store = RoutingStore.create(name, LAYOUT, 64, page_tokens=8)
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:  # another holder of the store's lock (a stopped process, say)
        with store._core.lock.held("test", time.monotonic() + 30):
            held.set()
            let_go.wait(30)

    def hook(point: str) -> None:  # the first release's lock wait finds it held
        if point == "release:take" and not held.is_set():
            threading.Thread(target=hold, daemon=True).start()
            held.wait(10)

    before = COUNTS.undelivered["OSError"]
    try:
        with interleave(hook):
            client = Client(fail=OSError("client disconnected"))
            with pytest.raises(OSError):
                asyncio.run(RoutesToRefs(completions_app)(SCOPE, client.receive, client.send))
            assert COUNTS.undelivered["OSError"] == before + 1
            deadline = time.monotonic() + 5
            while COUNTS.as_dict().get("unreleased") != 1 and time.monotonic() < deadline:
                time.sleep(0.01)  # the release fails after its 1 s wait: kept, counted
            pending = COUNTS.as_dict().get("unreleased")
            assert len(store) == 1
            let_go.set()
            deadline = time.monotonic() + 10
            while len(store):  # the retry releases it
                assert time.monotonic() < deadline, "the sample stayed stored: never retried"
                time.sleep(0.01)
            assert pending == 1 and COUNTS.unreleased == 0
    finally:
        let_go.set()
        store.close()
        store.unlink()


@pytest.mark.slow  # the fast tier stays under a minute
def test_a_stale_handle_that_could_not_be_closed_is_closed_later(name, monkeypatch):
    monkeypatch.setenv(STORE_ENV, name)
    monkeypatch.setenv(PUT_TIMEOUT_ENV, "1")
    owner = RoutingStore.create(name, LAYOUT, 4096)
    middleware = RoutesToRefs(app=None)
    first = middleware.store()
    working, finish = threading.Event(), threading.Event()

    def hook(point: str) -> None:  # a put of another thread, still working (not waiting)
        if point == "put.publish:drop" and threading.current_thread().name == "slow":
            working.set()
            finish.wait(30)

    slow = threading.Thread(target=put_one, args=(first, "slow"), name="slow")
    try:
        with interleave(hook):
            slow.start()
            assert working.wait(10)
            owner = recreate(owner)
            second = middleware.store()  # its close of the stale handle fails (busy)
            assert second is not first and first._core.segment.fd >= 0
            assert unclosed_handles() == 1
            finish.set()
            slow.join(10)
        assert middleware.store() is second  # the next call closes the stale handle
        assert first._core.segment.fd < 0 and unclosed_handles() == 0
        second.close()
    finally:
        finish.set()
        owner.close()
        owner.unlink()


@pytest.mark.parametrize(
    ("family", "config"),
    [
        ("zaya", {"num_experts": 8, "num_experts_per_tok": 1}),
        ("longcat_flash", {"n_routed_experts": 8, "zero_expert_num": 2, "moe_topk": 2}),
    ],
)
def test_a_host_refuses_a_family_whose_vllm_routes_lose_choices(tmp_path, family, config):
    """vLLM records LongCat's zero-expert and Zaya's skip picks as expert 0 (docs/engines.md):
    replaying them would route those tokens through expert 0, so a host does not start."""
    transformers.AutoConfig.for_model(family, num_hidden_layers=2, **config).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedModelError, match=f"of a {family} model as expert 0"):
        StoreHost()._host("job", str(tmp_path), "never-made", None)


def test_a_host_refuses_a_block_diffusion_model_whose_vllm_routes_are_unverified(tmp_path):
    transformers.AutoConfig.for_model("diffusion_gemma").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="of diffusion_gemma: a block-diffusion"):
        StoreHost()._host("job", str(tmp_path), "never-made", None)


@pytest.mark.parametrize(
    "config",
    [transformers.LongcatFlashConfig(), transformers.ZayaConfig()],
    ids=["longcat", "zaya"],
)
def test_the_middleware_stores_no_routes_of_a_model_vllm_records_lossily(name, monkeypatch, config):
    # vLLM's app state (`init_app_state`) holds the served model's config: a LongCat or Zaya
    # model's routes name expert 0 for a choice vLLM does not record, so none is stored;
    # the generation still goes out, each choice saying why it has no ref.
    monkeypatch.setenv(STORE_ENV, name)
    store = RoutingStore.create(name, LAYOUT, 64, page_tokens=8)
    state = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=config))
    )
    scope = {**SCOPE, "app": types.SimpleNamespace(state=state)}
    refused = COUNTS.refused["UnsupportedModelError"]
    middleware = RoutesToRefs(completions_app)
    for _ in range(2):
        client = Client()
        asyncio.run(middleware(scope, client.receive, client.send))
        (choice,) = client.body()["choices"]
        assert choice["routing_ref"] is None and "routed_experts" not in choice
        assert choice["token_ids"] == OUTPUT  # the generation itself
        assert choice["routing_error"].startswith("UnsupportedModelError: ")
        assert config.model_type in choice["routing_error"]
        with pytest.raises(RoutesNotStoredError, match="R2"):
            choice_ref(choice)
    family, why = middleware.served(None)  # read once, from the first request's app
    assert family == config.model_type and "R2" in why
    assert COUNTS.refused["UnsupportedModelError"] == refused + 2
    assert len(store) == 0
    store.close()
    store.unlink()
