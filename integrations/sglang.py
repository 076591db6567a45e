"""SGLang: `meta_info["routed_experts"]` payloads -> `RoutingStore` puts.

SGLang (`--enable-return-routed-experts`, request `return_routed_experts=True`) returns
the routes of a request in `meta_info["routed_experts"]`: standard base64 of the raw
bytes (`tensor.numpy().tobytes()`, no header) of an int32 array `[rows, num_hidden_layers,
top_k]`, row-major, one row per forwarded token: `len(prompt) + len(output) - 1` rows (the
last sampled token is never forwarded). With `routed_experts_start_len=N` in the request
only rows `N:` come back. Dense layers are rows of 0 (SGLang-JAX: -1). Some releases add
`meta_info["routed_experts_dtype"]` ("int32", "int16", "uint16", "uint8") for narrower
payloads; without it the payload is int32. SGLang itself is never imported.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from routing_replay import InvalidRoutesError, PutRequest, RoutingLayout, RoutingRef, RoutingStore
from routing_replay.integrations._rows import fill_prefix, place_rows, token_array

WIRE_DTYPES = {name: np.dtype(name) for name in ("int32", "int16", "uint16", "uint8")}


def _meta(response: Mapping[str, Any]) -> Mapping[str, Any]:
    """The `meta_info` dict of a /generate response, or the dict itself if it is one."""
    meta = response.get("meta_info", response)
    if not isinstance(meta, Mapping) or "routed_experts" not in meta:
        raise InvalidRoutesError(
            "no meta_info['routed_experts'] in this SGLang response: start the server with "
            "--enable-return-routed-experts and send return_routed_experts=True"
        )
    return meta


def decode_routed_experts(
    meta_info: Mapping[str, Any], layout: RoutingLayout, rows: int | None = None
) -> np.ndarray:
    """Decode a payload to `[rows, layers, top_k]` (layers: all hidden layers, or MoE only).

    With `rows` (the expected row count) the layer count is the one that matches it exactly.
    """
    payload = meta_info["routed_experts"]
    if payload is None:
        raise InvalidRoutesError(
            "meta_info['routed_experts'] is None: the request did not ask for routes "
            "(return_routed_experts=True) or the server lacks --enable-return-routed-experts"
        )
    name = meta_info.get("routed_experts_dtype") or "int32"
    if name not in WIRE_DTYPES:
        raise InvalidRoutesError(
            f"meta_info['routed_experts_dtype'] is {name!r}; supported: {sorted(WIRE_DTYPES)}"
        )
    dtype = WIRE_DTYPES[name]
    if isinstance(payload, str):
        payload = payload.encode("ascii", errors="replace")
    if not isinstance(payload, (bytes, bytearray)):
        raise InvalidRoutesError(
            f"meta_info['routed_experts'] must be a base64 string, got {type(payload).__name__}"
            " (a list means a pre-base64 SGLang: convert with np.asarray(..., np.int32))"
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InvalidRoutesError(
            f"meta_info['routed_experts'] is not valid base64 ({err}); the payload was "
            f"{len(payload)} characters: was it truncated or re-encoded on the way?"
        ) from None
    per_row = dtype.itemsize * layout.top_k
    widths = sorted({layout.num_layers, layout.num_moe_layers}, reverse=True)
    if rows is None:
        fits = [n for n in widths if len(raw) % (per_row * n) == 0]
    else:
        fits = [n for n in widths if len(raw) == rows * per_row * n]
    if not fits or len(raw) == 0:
        expect = (
            "a whole number of rows"
            if rows is None
            else f"{rows} rows (tokens - 1 - start_len) = "
            + " or ".join(str(rows * per_row * n) for n in widths)
            + " bytes"
        )
        raise InvalidRoutesError(
            f"meta_info['routed_experts'] decodes to {len(raw)} bytes; expected {expect} of "
            f"{name} [layers, top_k={layout.top_k}] with layers in {widths}. Causes: a layout "
            "that is not the served model's (layer count, top-k), token ids that are not this "
            f"response's, a wrong start_len, a dtype other than {name}, or a truncated payload"
        )
    layers = fits[0]
    return np.frombuffer(raw, dtype=dtype).reshape(-1, layers, layout.top_k)


def routes_from_sglang(
    response: Mapping[str, Any],
    layout: RoutingLayout,
    num_tokens: int,
    start_len: int = 0,
) -> np.ndarray:
    """`[num_tokens, L_moe, K]` routes (-1 missing) of one SGLang response.

    `num_tokens` is `len(prompt) + len(output)`; `start_len` is the request's
    `routed_experts_start_len` (0 by default): rows before it and the last row are missing.
    """
    meta = _meta(response)
    _check_counts(meta, num_tokens)
    rows = decode_routed_experts(meta, layout, rows=max(num_tokens - 1 - start_len, 0))
    return place_rows(layout, rows, num_tokens, start_len, source="SGLang routed_experts")


def _check_counts(meta: Mapping[str, Any], num_tokens: int) -> None:
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if prompt is not None and completion is not None and prompt + completion != num_tokens:
        raise InvalidRoutesError(
            f"meta_info says {prompt} prompt + {completion} completion tokens, but "
            f"{num_tokens} token ids were given: pass this response's prompt ids and output_ids"
        )


def sglang_request(
    store: RoutingStore,
    sample_id: str,
    response: Mapping[str, Any],
    prompt_ids: Sequence[int],
    output_ids: Sequence[int] | None = None,
    *,
    start_len: int = 0,
    prefix: str | RoutingRef | None = None,
) -> PutRequest:
    """One SGLang /generate response as a `PutRequest` for `store` (routes aligned, checked).

    `output_ids` defaults to `response["output_ids"]`. Token ids go with the routes so
    samples of one prompt store their common prefix once. With `start_len`, rows before it
    are missing, or copied from `prefix` (the stored earlier turn of a multi-turn episode).
    """
    _meta(response)  # a response without routes fails first, whatever else it lacks
    if output_ids is None:
        output_ids = response.get("output_ids")
        if output_ids is None:
            raise InvalidRoutesError(
                "the response has no 'output_ids': pass output_ids= (the generated token ids)"
            )
    prompt = token_array(prompt_ids, "prompt_ids")
    tokens = np.concatenate([prompt, token_array(output_ids, "output_ids")])
    routes = routes_from_sglang(response, store.layout, len(tokens), start_len)
    fill_prefix(store, routes, prefix, start_len, tokens)
    return PutRequest(sample_id, routes, prompt_len=len(prompt), token_ids=tokens)


def put_sglang(
    store: RoutingStore,
    sample_id: str,
    response: Mapping[str, Any],
    prompt_ids: Sequence[int],
    output_ids: Sequence[int] | None = None,
    **where: Any,
) -> RoutingRef:
    """Put one SGLang /generate response's routes into `store` (see `sglang_request`;
    `where`: its `start_len` and `prefix`)."""
    request = sglang_request(store, sample_id, response, prompt_ids, output_ids, **where)
    return store.put_many([request])[0]


def put_sglang_batch(
    store: RoutingStore,
    sample_ids: Sequence[str],
    responses: Sequence[Mapping[str, Any]],
    prompts: Sequence[Sequence[int]],
    *,
    start_len: int = 0,
) -> list[RoutingRef]:
    """Put the responses of one batched /generate call (a prompt's n samples, or many
    prompts: `prompts[i]` is response i's prompt) all at once, or none of them: one bad
    response, a duplicate id or a full store leaves nothing stored."""
    if not len(sample_ids) == len(responses) == len(prompts):
        raise InvalidRoutesError(
            f"{len(sample_ids)} sample ids, {len(responses)} responses and {len(prompts)} "
            "prompts: pass one of each per response"
        )
    requests = [
        sglang_request(store, i, r, p, start_len=start_len)
        for i, r, p in zip(sample_ids, responses, prompts, strict=True)
    ]
    return store.put_many(requests)


def encode_routed_experts(routes: np.ndarray) -> str:
    """What an SGLang server sends: base64 of int32 raw bytes (tests, and replaying logs)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode()
