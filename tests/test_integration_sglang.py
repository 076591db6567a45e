"""SGLang payloads, built exactly as SGLang's detokenizer builds them, into a real store."""

from __future__ import annotations

import base64
import os
import uuid

import numpy as np
import pytest
import torch

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import InvalidRoutesError, LayoutMismatchError
from routing_replay.integrations.sglang import (
    decode_routed_experts,
    put_sglang,
    put_sglang_openai,
    routes_from_sglang,
)
from routing_replay.store.segment import segment_path

# 4 hidden layers, layer 1 dense (Qwen3-MoE mlp_only_layers style), top-2 of 8 experts.
LAYOUT = RoutingLayout(num_layers=4, top_k=2, num_experts=8, moe_layers=(0, 2, 3))
PAGE = 4


@pytest.fixture
def store():
    name = f"test-sglang-{uuid.uuid4().hex[:10]}"
    with RoutingStore.create(name, LAYOUT, capacity_tokens=256, page_tokens=PAGE) as s:
        yield s
    assert not os.path.exists(segment_path(name))


def engine_rows(num_rows: int, seed: int) -> np.ndarray:
    """What SGLang's capturer holds: int32 [rows, num_hidden_layers, top_k], dense rows 0."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((num_rows, LAYOUT.num_layers, LAYOUT.top_k), dtype=np.int32)
    for t in range(num_rows):
        for layer in LAYOUT.moe_layers:
            rows[t, layer] = rng.choice(LAYOUT.num_experts, LAYOUT.top_k, replace=False)
    return rows


def sglang_response(rows: np.ndarray, prompt_len: int, output_ids: list[int], **meta) -> dict:
    """A /generate response as SGLang returns it (detokenizer: b64 of tensor.numpy().tobytes())."""
    tensor = torch.from_numpy(rows).to(torch.int32)
    payload = base64.b64encode(tensor.numpy().tobytes()).decode("utf-8")
    info = {
        "id": "req-0",
        "prompt_tokens": prompt_len,
        "completion_tokens": len(output_ids),
        "finish_reason": {"type": "length", "length": len(output_ids)},
        "routed_experts": payload,
        **meta,
    }
    return {"text": "", "output_ids": output_ids, "meta_info": info}


def as_b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


def moe_only(rows: np.ndarray) -> np.ndarray:
    return rows[:, list(LAYOUT.moe_layers)]


def assert_untouched(store: RoutingStore) -> None:
    s = store.stats()
    assert (len(store), s.pages_used, s.pages_pending) == (0, 0, 0)


def test_full_payload_round_trip(store):
    prompt, output = [5, 6, 7, 8, 9], [10, 11, 12]
    rows = engine_rows(len(prompt) + len(output) - 1, seed=0)
    ref = put_sglang(store, "s0", sglang_response(rows, 5, output), prompt)
    assert (ref.num_tokens, ref.prompt_len) == (8, 5)
    got = store.get("s0")
    assert got.shape == (8, 3, 2)
    np.testing.assert_array_equal(got[:7], moe_only(rows))
    assert (got[7] == -1).all()  # the last sampled token was never forwarded
    np.testing.assert_array_equal(store.get("s0", part="prompt"), moe_only(rows)[:5])


def test_suffix_from_start_len_lands_at_its_offset(store):
    prompt, output = list(range(20, 30)), [31, 32, 33, 34]
    full = engine_rows(13, seed=1)
    start = 6  # routed_experts_start_len=6: SGLang returns rows 6: only
    response = sglang_response(full[start:], 10, output)
    put_sglang(store, "suffix", response, prompt, start_len=start)
    got = store.get("suffix")
    assert (got[:start] == -1).all() and (got[13] == -1).all()
    np.testing.assert_array_equal(got[start:13], moe_only(full)[start:])


def test_moe_only_and_narrow_dtype_payloads(store):
    prompt, output = [1, 2, 3], [4, 5]
    rows = engine_rows(4, seed=2)
    narrow = moe_only(rows).astype(np.uint8)
    payload = base64.b64encode(narrow.tobytes()).decode()
    response = sglang_response(rows, 3, output)
    response["meta_info"].update(routed_experts=payload, routed_experts_dtype="uint8")
    put_sglang(store, "narrow", response, prompt)
    np.testing.assert_array_equal(store.get("narrow")[:4], moe_only(rows))


def test_grpo_samples_share_prompt_pages(store):
    prompt = list(range(40, 52))  # 12 tokens: 3 full pages of 4
    prompt_rows = engine_rows(12, seed=3)
    for i in range(4):
        output = [60 + i, 61, 62, 63, 64 + i]
        completion_rows = engine_rows(4, seed=10 + i)  # 5 generated -> 4 forwarded rows
        rows = np.concatenate([prompt_rows, completion_rows])
        put_sglang(store, f"p0-s{i}", sglang_response(rows, 12, output), prompt)
    s = store.stats()
    # each sample: 17 tokens = 5 pages; the 3 prompt pages are stored once.
    assert (s.samples, s.pages_used) == (4, 3 + 4 * 2)
    assert s.bytes_unshared == 4 * 5 * PAGE * LAYOUT.bytes_per_token
    assert s.bytes_used == 11 * PAGE * LAYOUT.bytes_per_token


def test_decode_matches_sglang_extractor():
    rows = engine_rows(5, seed=4)
    info = sglang_response(rows, 3, [1, 2, 3])["meta_info"]
    flat = np.frombuffer(base64.b64decode(info["routed_experts"].encode("utf-8")), np.int32)
    np.testing.assert_array_equal(decode_routed_experts(info, LAYOUT).reshape(-1), flat)


def bad_cases():
    output = [9, 10, 11]
    rows = engine_rows(6, seed=5)
    good = sglang_response(rows, 4, output)["meta_info"]["routed_experts"]

    def response(payload=good, rows_=None, output_=output, **meta):
        r = sglang_response(rows if rows_ is None else rows_, 4, output_, **meta)
        if payload is not None:
            r["meta_info"]["routed_experts"] = payload
        return r

    out_of_range = rows.copy()
    out_of_range[2, 3, 1] = 8
    negative = rows.copy()
    negative[0, 0, 0] = -7
    dense_routed = rows.copy()
    dense_routed[1, 1] = [3, 4]
    zeros = rows.copy()
    zeros[:, list(LAYOUT.moe_layers)] = 0
    three_layers = np.zeros((6, 3 + 2, 2), np.int32)
    yield "wrong layer count", response(rows_=three_layers, payload=None), "240 bytes"
    yield "truncated base64", response(payload=good[:-3]), "not valid base64"
    yield "truncated at a 4-char boundary", response(payload=good[:-8]), "truncated"
    yield "not base64", response(payload=good[:-4] + "!!!!"), "not valid base64"
    yield "unknown dtype", response(routed_experts_dtype="float32"), "routed_experts_dtype"
    yield "float payload", response(payload=as_b64(rows.astype(np.float32))), "out of"
    yield "id out of range", response(rows_=out_of_range, payload=None), "expert id 8"
    yield "negative id", response(rows_=negative, payload=None), "expert id -7"
    extra = response()
    extra["output_ids"] = [*output, 12]
    yield "one output id too many", extra, "meta_info says"
    yield "rows not matching tokens", response(rows_=rows[:5], payload=None), "6 rows"
    yield "dense layer routed", response(rows_=dense_routed, payload=None), "layer 1 routes"
    yield "all-zero routes", response(rows_=zeros, payload=None), "twice"
    yield "no payload", {"meta_info": {"prompt_tokens": 4}}, "enable-return-routed-experts"
    yield "payload None", response(payload=None) | {"meta_info": {"routed_experts": None}}, "None"


@pytest.mark.parametrize("label,response,message", list(bad_cases()), ids=lambda x: x)
def test_bad_payloads_raise_and_leave_store_unharmed(store, label, response, message):
    with pytest.raises((InvalidRoutesError, LayoutMismatchError), match=message):
        put_sglang(store, "bad", response, [5, 6, 7, 8], output_ids=None)
    assert_untouched(store)
    assert "bad" not in store


def test_routes_without_store_have_trainer_rows():
    rows = engine_rows(3, seed=6)
    got = routes_from_sglang(sglang_response(rows, 2, [7, 8]), LAYOUT, num_tokens=4)
    assert got.dtype == LAYOUT.signed_dtype and got.shape == (4, 3, 2)
    np.testing.assert_array_equal(got[:3], moe_only(rows))


def test_second_turn_suffix_takes_its_prefix_from_the_first_turn(store):
    turn1_prompt, turn1_out = list(range(10, 18)), [20, 21, 22, 23]  # 12 tokens
    turn1_rows = engine_rows(11, seed=20)
    first = put_sglang(store, "ep0-t0", sglang_response(turn1_rows, 8, turn1_out), turn1_prompt)
    # Turn 2 extends turn 1's 12 tokens; it asks for routes from 11 (turn 1's last token was
    # never forwarded in turn 1, it is in turn 2).
    turn2_prompt = [*turn1_prompt, *turn1_out, 30, 31, 32, 33]  # 16 tokens
    turn2_out = [40, 41, 42, 43]
    turn2_rows = engine_rows(20 - 1 - 11, seed=21)
    response = sglang_response(turn2_rows, 16, turn2_out)
    put_sglang(store, "ep0-t1", response, turn2_prompt, start_len=11, prefix=first)
    got = store.get("ep0-t1")
    np.testing.assert_array_equal(got[:11], store.get("ep0-t0")[:11])
    np.testing.assert_array_equal(got[11:19], moe_only(turn2_rows))
    # pages of 4: turn 2 shares turn 1's first two pages (page 3 holds turn 1's -1 row 11).
    assert store.stats().pages_used == 3 + 5 - 2
    with pytest.raises(InvalidRoutesError, match="fewer than start=13"):
        response = sglang_response(engine_rows(6, seed=22), 16, turn2_out)
        put_sglang(store, "ep0-t2", response, turn2_prompt, start_len=13, prefix="ep0-t0")


def test_a_prefix_start_past_the_earlier_turns_last_row_is_refused(store):
    # start=len(turn 1), the natural value, would leave turn 1's last token (row 11, never
    # forwarded in turn 1) without routes for good: refused, naming the rule; nothing stored.
    turn1_prompt, turn1_out = list(range(10, 18)), [20, 21, 22, 23]  # 12 tokens
    first = put_sglang(
        store, "ep1-t0", sglang_response(engine_rows(11, seed=23), 8, turn1_out), turn1_prompt
    )
    turn2_prompt = [*turn1_prompt, *turn1_out, 30, 31]  # 14 tokens
    response = sglang_response(engine_rows(18 - 1 - 12, seed=24), 14, [40, 41, 42, 43])
    with pytest.raises(
        InvalidRoutesError, match=r"no routes at position 11 .* from len\(earlier turn\) - 1 = 11"
    ):
        put_sglang(store, "ep1-t1", response, turn2_prompt, start_len=12, prefix=first)
    assert "ep1-t1" not in store and len(store) == 1


def test_three_turn_episode_from_sglang_payloads(store):
    """SGLang episodes through routing_replay.Episode: each turn asks for routes from the
    first token the stored turns do not cover (`routed_experts_start_len`)."""
    from routing_replay import Episode
    from routing_replay.errors import TokenMismatchError

    episode = Episode(store, "sg", prompt_len=6)
    tokens, engine = list(range(10, 16)), {}  # the conversation so far; rows per position
    for turn, (out, tool) in enumerate([([20, 21, 22], [50, 51]), ([23, 24], [52]), ([25], [])]):
        start = max(len(episode.tokens) - 1, 0)
        num = len(tokens) + len(out)
        rows = engine_rows(num - 1 - start, seed=30 + turn)
        for i, row in enumerate(moe_only(rows)):
            engine[start + i] = row  # what the engine returned for that position
        response = sglang_response(rows, len(tokens), out)
        routes = routes_from_sglang(response, LAYOUT, num, start_len=start)
        episode.check_history(tokens)
        episode.add_turn([*tokens, *out], routes, policy_version=turn)
        tokens = [*tokens, *out, *tool]
    ref = episode.close()
    got = store.get(ref)
    want = np.stack([engine[t] for t in range(ref.num_tokens - 1)])
    np.testing.assert_array_equal(got[:-1], want)  # every turn's rows, at their positions
    assert (got[-1] == -1).all() and len(store) == 1
    assert ref.policy_versions == ((0, 0), (9, 1), (13, 2))
    drifted = Episode(store, "sg2")
    drifted.add_turn(
        [10, 11, 12],
        routes_from_sglang(sglang_response(engine_rows(2, seed=40), 2, [12]), LAYOUT, 3),
    )
    with pytest.raises(TokenMismatchError, match=r"episode 'sg2' turn 2: token 1 of the"):
        drifted.check_history([10, 99, 12, 13])


# -- OpenAI-compatible endpoints (/v1/completions, /v1/chat/completions) ---------------
#
# Responses built as SGLang 0.5.23 (PyPI wheel sglang-0.5.23-cp311, read for this test)
# builds them in python/sglang/srt/entrypoints/openai/:
# - serving_completions.py `_build_completion_response` and serving_chat.py
#   `_build_chat_response`: `sglext=SglExt(routed_experts=...)` at the *response* level,
#   from `ret[0]` only ("from first ret_item"); per choice, completions `token_ids` /
#   `prompt_token_ids` and chat `prompt_token_ids` / `response_token_ids`
#   (request `return_token_ids=True`); chat `meta_info=ret_item["meta_info"]` per choice
#   with `return_meta_info=True` (routes per choice; 0.5.21+ then leaves sglext's out).
# - protocol.py: `SglExt(routed_experts: Optional[str], input_ids, output_ids, ...)` and
#   the response/choice models, whose serializers drop None extension fields.
# - the payload: the same `meta_info["routed_experts"]` string as /generate
#   (detokenizer_manager.py `_b64_encode_per_request`: b64 of int32 `tobytes()`).
# SGLang's docs describe `sgl_ext` on each choice; no release up to 0.5.23 sends that, but
# it is read as well. `test_responses_match_sglang_protocol_classes` checks these dicts
# against SGLang's own pydantic classes where they import.

USAGE_NONE = {
    "prompt_tokens_details": None,
    "reasoning_tokens": 0,
    "completion_tokens_details": None,
}


def openai_response(kind: str, choices: list[dict], prompt_len: int, sglext=None) -> dict:
    completion = sum(len(c.get("token_ids", c.get("response_token_ids", []))) for c in choices)
    body = {
        "id": "req-0",
        "object": "text_completion" if kind == "completions" else "chat.completion",
        "created": 1700000000,
        "model": "default",
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + completion,
            "completion_tokens": completion,
            **USAGE_NONE,
        },
        "metadata": None,
    }
    if sglext is not None:
        body["sglext"] = sglext
    return body


def openai_choice(kind: str, index: int, prompt: list[int], output: list[int], **extra) -> dict:
    """One choice with return_token_ids=True; `extra`: meta_info (chat return_meta_info)."""
    if kind == "completions":
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": "length"}
        choice |= {"matched_stop": None, "token_ids": output, "prompt_token_ids": prompt}
    else:
        message = {"role": "assistant", "content": "", "reasoning_content": None}
        choice = {"index": index, "message": message, "logprobs": None, "finish_reason": "length"}
        choice |= {"matched_stop": None, "prompt_token_ids": prompt, "response_token_ids": output}
    return choice | extra


def single_choice(kind: str, rows: np.ndarray, prompt: list[int], output: list[int], **ext):
    """The default form: n=1, routes in the response-level sglext."""
    sglext = {"routed_experts": as_b64(rows), **ext}
    return openai_response(kind, [openai_choice(kind, 0, prompt, output)], len(prompt), sglext)


def stored_tokens(store: RoutingStore, sample_id: str) -> list[int]:
    return store.read([sample_id]).column("token_ids")[0].as_py()


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("dtype", ["int32", "uint16", "uint8", "int16"])
def test_openai_payloads_are_exact_in_every_dtype(store, kind, dtype):
    prompt, output = [5, 6, 7, 8, 9], [10, 11, 12]
    rows = engine_rows(7, seed=50)
    ext = {} if dtype == "int32" else {"routed_experts_dtype": dtype}  # int32: SGLang's own
    response = single_choice(kind, rows.astype(dtype), prompt, output, **ext)
    (ref,) = put_sglang_openai(store, ["s0"], response)
    assert (ref.num_tokens, ref.prompt_len) == (8, 5)
    got = store.get("s0")
    np.testing.assert_array_equal(got[:7], moe_only(rows))
    assert (got[7] == -1).all()  # the last sampled token was never forwarded
    assert stored_tokens(store, "s0") == prompt + output  # rows aligned to these ids


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_openai_start_len_suffix_and_second_turn_prefix(store, kind):
    turn1_prompt, turn1_out = list(range(10, 18)), [20, 21, 22, 23]  # 12 tokens
    turn1_rows = engine_rows(11, seed=51)
    response = single_choice(kind, turn1_rows, turn1_prompt, turn1_out)
    (first,) = put_sglang_openai(store, ["t0"], response)
    # Turn 2 asks routed_experts_start_len=11: SGLang returns rows [11, seqlen - 1) only.
    turn2_prompt, turn2_out = [*turn1_prompt, *turn1_out, 30, 31, 32, 33], [40, 41, 42, 43]
    suffix = engine_rows(20 - 1 - 11, seed=52)
    response = single_choice(kind, suffix, turn2_prompt, turn2_out)
    put_sglang_openai(store, ["t1-alone"], response, start_len=11)
    got = store.get("t1-alone")
    assert (got[:11] == -1).all() and (got[19] == -1).all()
    np.testing.assert_array_equal(got[11:19], moe_only(suffix))
    put_sglang_openai(store, ["t1"], response, start_len=11, prefix=first)
    got = store.get("t1")
    np.testing.assert_array_equal(got[:11], moe_only(turn1_rows))  # from turn 1
    np.testing.assert_array_equal(got[11:19], moe_only(suffix))
    assert stored_tokens(store, "t1") == turn2_prompt + turn2_out


def per_choice_response(kind: str, where: str, prompt: list[int], n: int, seed: int):
    """n choices of one prompt, routes per choice: chat `meta_info` (return_meta_info=True),
    or `sgl_ext` (the form SGLang's docs describe); and each choice's engine rows."""
    prompt_rows = engine_rows(len(prompt), seed=seed)
    choices, all_rows = [], []
    for i in range(n):
        output = [60 + i, 61, 62, 63, 64 + i]
        rows = np.concatenate([prompt_rows, engine_rows(4, seed=seed + 1 + i)])
        if where == "meta_info":
            carrier = sglang_response(rows, len(prompt), output)["meta_info"]
        else:
            carrier = {"routed_experts": as_b64(rows)}
        choices.append(openai_choice(kind, i, prompt, output, **{where: carrier}))
        all_rows.append(rows)
    return openai_response(kind, choices, len(prompt)), all_rows


@pytest.mark.parametrize("kind,where", [("chat", "meta_info"), ("completions", "sgl_ext")])
def test_openai_n_choices_share_the_prompt_pages(store, kind, where):
    prompt = list(range(40, 52))  # 12 tokens: 3 full pages of 4
    response, rows = per_choice_response(kind, where, prompt, n=4, seed=60)
    refs = put_sglang_openai(store, [f"p0-s{i}" for i in range(4)], response)
    assert [r.sample_id for r in refs] == [f"p0-s{i}" for i in range(4)]
    for i in range(4):
        np.testing.assert_array_equal(store.get(f"p0-s{i}")[:16], moe_only(rows[i]))
        assert stored_tokens(store, f"p0-s{i}") == [*prompt, 60 + i, 61, 62, 63, 64 + i]
    s = store.stats()
    # each sample: 17 tokens = 5 pages; the 3 prompt pages are stored once.
    assert (s.samples, s.pages_used) == (4, 3 + 4 * 2)


def test_openai_ids_from_sglext_and_from_the_caller(store):
    # chat return_input_ids_in_sglext / return_output_ids_in_sglext, no per-choice ids.
    prompt, output = [1, 2, 3, 4], [5, 6]
    rows = engine_rows(5, seed=70)
    choice = openai_choice("chat", 0, prompt, output)
    del choice["prompt_token_ids"], choice["response_token_ids"]
    sglext = {"routed_experts": as_b64(rows), "input_ids": prompt, "output_ids": [output]}
    put_sglang_openai(store, ["ext"], openai_response("chat", [choice], 4, sglext))
    assert stored_tokens(store, "ext") == prompt + output
    # without return_token_ids the caller passes them.
    bare = openai_response("chat", [choice], 4, {"routed_experts": as_b64(rows)})
    put_sglang_openai(store, ["given"], bare, prompt_ids=prompt, output_ids=[output])
    np.testing.assert_array_equal(store.get("given"), store.get("ext"))


def test_openai_response_as_a_pydantic_object(store):
    """The openai client's objects keep SGLang's extra fields (`sglext`, token ids)."""
    from pydantic import BaseModel, ConfigDict

    class ClientObject(BaseModel):  # what openai.types.Completion does with extra fields
        model_config = ConfigDict(extra="allow")

    prompt, output = [3, 4, 5], [6, 7]
    rows = engine_rows(4, seed=71)
    response = ClientObject(**single_choice("completions", rows, prompt, output))
    put_sglang_openai(store, ["obj"], response)
    np.testing.assert_array_equal(store.get("obj")[:4], moe_only(rows))


def openai_bad_cases():
    prompt, output = [5, 6, 7, 8], [9, 10, 11]
    rows = engine_rows(6, seed=72)
    good = single_choice("chat", rows, prompt, output)

    def edit(response=good, **sglext):
        r = {**response, "sglext": {**response["sglext"], **sglext}}
        return r

    no_ext = {k: v for k, v in good.items() if k != "sglext"}
    yield "missing sglext", no_ext, "no routes for choice 0", InvalidRoutesError
    yield "routes None", edit(routed_experts=None), r"sglext\['routed_experts'\] is None", None
    yield "wrong length", edit(routed_experts=as_b64(rows[:5])), "6 rows", None
    yield "unknown dtype", edit(routed_experts_dtype="float16"), "routed_experts_dtype", None
    bad_b64 = good["sglext"]["routed_experts"][:-4] + "!!!!"
    yield "bad base64", edit(routed_experts=bad_b64), "not valid base64", None
    yield "truncated", edit(routed_experts=good["sglext"]["routed_experts"][:-3]), "base64", None
    narrow = edit(routed_experts=as_b64(rows.astype(np.uint8)))  # no dtype: read as int32
    yield "uint8 sent as int32", narrow, "bytes", None
    no_ids = {**good, "choices": [openai_choice("chat", 0, prompt, output)]}
    del no_ids["choices"][0]["response_token_ids"]
    yield "no output ids", no_ids, "return_token_ids=True", InvalidRoutesError
    per_choice, _ = per_choice_response("chat", "meta_info", prompt, n=2, seed=73)
    per_choice["choices"][1]["meta_info"]["routed_experts"] = as_b64(rows[:3])
    yield "second choice bad", per_choice, r"choices\[1\].meta_info", None
    shared = openai_response(
        "completions",
        [openai_choice("completions", i, prompt, output) for i in range(2)],
        4,
        {"routed_experts": as_b64(rows)},
    )
    yield "n=2, one response-level payload", shared, "first choice only", InvalidRoutesError


@pytest.mark.parametrize(
    "response,message,error", [pytest.param(*case[1:], id=case[0]) for case in openai_bad_cases()]
)
def test_bad_openai_payloads_raise_and_leave_store_unharmed(store, response, message, error):
    ids = [f"bad-{i}" for i in range(len(response["choices"]))]
    with pytest.raises(error or (InvalidRoutesError, LayoutMismatchError), match=message):
        put_sglang_openai(store, ids, response)
    assert_untouched(store)


def test_openai_ids_that_disagree_are_refused(store):
    from routing_replay.errors import TokenMismatchError

    prompt, output = [5, 6, 7, 8], [9, 10, 11]
    response = single_choice("completions", engine_rows(6, seed=74), prompt, output)
    with pytest.raises(TokenMismatchError, match="prompt_token_ids given for choices"):
        put_sglang_openai(store, ["x"], response, prompt_ids=[5, 6, 7, 99])
    with pytest.raises(InvalidRoutesError, match="2 sample ids for 1 choices"):
        put_sglang_openai(store, ["x", "y"], response)
    assert_untouched(store)


def test_responses_match_sglang_protocol_classes(store):
    """Where SGLang's own protocol classes import (a side venv with openai + msgspec and
    SGLang's protocol.py), the dicts above are exactly what they serialize, and their
    objects go in directly."""
    protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    models = {"completions": protocol.CompletionResponse, "chat": protocol.ChatCompletionResponse}
    prompt, output = [5, 6, 7, 8, 9], [10, 11, 12]
    rows = engine_rows(7, seed=75)
    cases = [(kind, single_choice(kind, rows, prompt, output)) for kind in models]
    cases.append(("chat", per_choice_response("chat", "meta_info", prompt, n=3, seed=76)[0]))
    for n, (kind, body) in enumerate(cases):
        model = models[kind].model_validate(body)
        assert model.model_dump() == body
        ids = [f"proto{n}-{i}" for i in range(len(body["choices"]))]
        put_sglang_openai(store, ids, model)
    np.testing.assert_array_equal(store.get("proto0-0")[:7], moe_only(rows))
