"""SGLang: `/generate` and OpenAI-compatible responses -> `RoutingStore` puts.

SGLang (`--enable-return-routed-experts`, request `return_routed_experts=True`) returns
the routes of a request as standard base64 of the raw bytes (`tensor.numpy().tobytes()`,
no header) of an int32 array `[rows, num_hidden_layers, top_k]`, row-major, one row per
forwarded token: `len(prompt) + len(output) - 1` rows (the last sampled token is never
forwarded). With `routed_experts_start_len=N` in the request only rows `N:` come back.
Dense layers are rows of 0 (SGLang-JAX: -1). Upstream SGLang (read up to 0.5.23) always
sends int32 and names no dtype; a `routed_experts_dtype` ("int32", "int16", "uint16",
"uint8") beside the payload, for payloads narrowed on the way (not an upstream field), is
honoured.

Where the payload is:
- `/generate` (`put_sglang`, `put_sglang_batch`): `meta_info["routed_experts"]`.
- `/v1/completions`, `/v1/chat/completions` (`put_sglang_openai`; SGLang >= 0.5.9, the
  request's `routed_experts_start_len` by 0.5.14): the response-level
  `sglext["routed_experts"]`, which SGLang fills from the *first* choice only, so it
  is taken for single-choice responses only; per choice, `choices[i]["meta_info"]`
  (chat with `return_meta_info=True`, by 0.5.14) or `choices[i]["sgl_ext"]` (the per-choice
  form SGLang's docs describe). Token ids come from `return_token_ids=True`: completions
  `choices[i]["prompt_token_ids"]` / `["token_ids"]`, chat `["prompt_token_ids"]` /
  `["response_token_ids"]`, or chat's `sglext["input_ids"]` / `sglext["output_ids"][i]`.
SGLang itself is never imported.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from routing_replay import PutRequest, RoutingLayout, RoutingRef, RoutingStore
from routing_replay.errors import InvalidRoutesError, TokenMismatchError
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
    meta_info: Mapping[str, Any],
    layout: RoutingLayout,
    rows: int | None = None,
    *,
    container: str = "meta_info",
) -> np.ndarray:
    """Decode a payload to `[rows, layers, top_k]` (layers: all hidden layers, or MoE only).

    `meta_info` is the mapping that holds `routed_experts` (and maybe
    `routed_experts_dtype`): a /generate `meta_info`, or an OpenAI response's `sglext`;
    `container` names it in errors. With `rows` (the expected row count) the layer count is the
    one that matches it exactly.
    """
    field = f"{container}['routed_experts']"
    payload = meta_info["routed_experts"]
    if payload is None:
        raise InvalidRoutesError(
            f"{field} is None: the request did not ask for routes "
            "(return_routed_experts=True) or the server lacks --enable-return-routed-experts"
        )
    name = meta_info.get("routed_experts_dtype") or "int32"
    if name not in WIRE_DTYPES:
        raise InvalidRoutesError(
            f"{container}['routed_experts_dtype'] is {name!r}; supported: {sorted(WIRE_DTYPES)}"
        )
    dtype = WIRE_DTYPES[name]
    if isinstance(payload, str):
        payload = payload.encode("ascii", errors="replace")
    if not isinstance(payload, (bytes, bytearray)):
        raise InvalidRoutesError(
            f"{field} must be a base64 string, got {type(payload).__name__}"
            " (a list means a pre-base64 SGLang: convert with np.asarray(..., np.int32))"
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InvalidRoutesError(
            f"{field} is not valid base64 ({err}); the payload was "
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
            f"{field} decodes to {len(raw)} bytes; expected {expect} of "
            f"{name} [layers, top_k={layout.top_k}] with layers in {widths}. Causes: a layout "
            "that is not the served model's (layer count, top-k), token ids that are not this "
            f"response's, a wrong start_len, a dtype other than {name}, or a truncated payload"
        )
    layers = fits[0]
    return np.frombuffer(raw, dtype=dtype).reshape(-1, layers, layout.top_k)


def _routes(
    meta: Mapping[str, Any], container: str, layout: RoutingLayout, num_tokens: int, start_len: int
) -> np.ndarray:
    """`[num_tokens, L_moe, K]` routes (-1 missing) from the mapping holding the payload."""
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if prompt is not None and completion is not None and prompt + completion != num_tokens:
        raise InvalidRoutesError(
            f"{container} says {prompt} prompt + {completion} completion tokens, but "
            f"{num_tokens} token ids were given: pass this response's prompt and output ids"
        )
    rows = decode_routed_experts(
        meta, layout, rows=max(num_tokens - 1 - start_len, 0), container=container
    )
    return place_rows(
        layout, rows, num_tokens, start_len, source=f"SGLang {container}['routed_experts']"
    )


def routes_from_sglang(
    response: Mapping[str, Any],
    layout: RoutingLayout,
    num_tokens: int,
    start_len: int = 0,
) -> np.ndarray:
    """`[num_tokens, L_moe, K]` routes (-1 missing) of one SGLang /generate response.

    `num_tokens` is `len(prompt) + len(output)`; `start_len` is the request's
    `routed_experts_start_len` (0 by default): rows before it and the last row are missing.
    """
    return _routes(_meta(response), "meta_info", layout, num_tokens, start_len)


def _put_request(
    store: RoutingStore,
    sample_id: str,
    meta: Mapping[str, Any],
    container: str,
    prompt_ids: Any,
    output_ids: Any,
    start_len: int,
    prefix: str | RoutingRef | None,
) -> PutRequest:
    """One sample's checked, aligned `PutRequest`, whichever response form it came in."""
    prompt = token_array(prompt_ids, "prompt_ids")
    tokens = np.concatenate([prompt, token_array(output_ids, "output_ids")])
    routes = _routes(meta, container, store.layout, len(tokens), start_len)
    fill_prefix(store, routes, prefix, start_len, tokens)
    return PutRequest(sample_id, routes, prompt_len=len(prompt), token_ids=tokens)


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
    meta = _meta(response)  # a response without routes fails first, whatever else it lacks
    if output_ids is None:
        output_ids = response.get("output_ids")
        if output_ids is None:
            raise InvalidRoutesError(
                "the response has no 'output_ids': pass output_ids= (the generated token ids)"
            )
    return _put_request(
        store, sample_id, meta, "meta_info", prompt_ids, output_ids, start_len, prefix
    )


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


# -- OpenAI-compatible responses (/v1/completions, /v1/chat/completions) ----------------

_OPENAI_ASK = (
    "start the server with --enable-return-routed-experts and send "
    "return_routed_experts=True in the request body (openai client: extra_body=)"
)


def _as_dict(obj: Any) -> Mapping[str, Any]:
    """A response or choice as a mapping: dicts as they are, pydantic models (the openai
    client's objects, which keep SGLang's extra fields, or SGLang's own) dumped."""
    if isinstance(obj, Mapping):
        return obj
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    raise InvalidRoutesError(
        f"expected an SGLang OpenAI response as a dict (response.json()) or a pydantic model, "
        f"got {type(obj).__name__}"
    )


def _has_routes(ext: Any) -> bool:
    return isinstance(ext, Mapping) and "routed_experts" in ext


def _openai_payload(
    response: Mapping[str, Any], choices: Sequence[Mapping[str, Any]], i: int
) -> tuple[Mapping[str, Any], str]:
    """The mapping holding choice i's `routed_experts`, and its name for errors."""
    for key in ("meta_info", "sgl_ext", "sglext"):
        if _has_routes(choices[i].get(key)):
            return choices[i][key], f"choices[{i}].{key}"
    ext = response.get("sglext")
    if not _has_routes(ext):
        raise InvalidRoutesError(
            f"no routes for choice {i} of this SGLang OpenAI response (neither "
            f"sglext['routed_experts'] nor choices[{i}].meta_info / sgl_ext): {_OPENAI_ASK}"
        )
    if len(choices) > 1:
        raise InvalidRoutesError(
            f"this SGLang OpenAI response has {len(choices)} choices but one response-level "
            "sglext['routed_experts'], which SGLang fills from the first choice only (the "
            "others' routes are not in the response): send n=1 and one prompt per request, "
            "or on /v1/chat/completions return_meta_info=True (routes per choice in "
            "choices[i].meta_info, SGLang 0.5.14 and later), or use /generate"
        )
    return ext, "sglext"


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _openai_ids(given: Any, found: Any, name: str, choice: str, ask: str) -> Any:
    """The caller's ids, checked against the response's when it has them too."""
    if given is None:
        if found is None:
            raise InvalidRoutesError(f"{choice} has no {name}: {ask}")
        return found
    if found is not None and list(found) != list(given):
        raise TokenMismatchError(
            f"the {name} given for {choice} differ from the response's own: pass this "
            "response's ids, or none (they are then taken from the response)"
        )
    return given


def sglang_openai_requests(
    store: RoutingStore,
    sample_ids: Sequence[str],
    response: Any,
    prompt_ids: Sequence[int] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    *,
    start_len: int = 0,
    prefix: str | RoutingRef | None = None,
) -> list[PutRequest]:
    """Every choice of one SGLang /v1/completions or /v1/chat/completions response as a
    `PutRequest` (`sample_ids[i]` for `choices[i]`), routes aligned and checked.

    `prompt_ids` (the one prompt every choice continues) and `output_ids` (one list per
    choice) default to the response's own (request `return_token_ids=True`); given as
    well, they must equal them. `start_len` is the request's `routed_experts_start_len`;
    `prefix`, the stored earlier turn that fills rows `[0, start_len)` of every choice.
    """
    response = _as_dict(response)
    choices = [_as_dict(c) for c in response.get("choices") or ()]
    if not choices or len(sample_ids) != len(choices):
        raise InvalidRoutesError(
            f"{len(sample_ids)} sample ids for {len(choices)} choices in this SGLang OpenAI "
            "response: pass one sample id per choice (a non-streamed response's choices)"
        )
    if output_ids is not None and len(output_ids) != len(choices):
        raise InvalidRoutesError(
            f"{len(output_ids)} output_ids lists for {len(choices)} choices: pass one per "
            "choice, or none (they are then taken from the response)"
        )
    ext = response.get("sglext") if isinstance(response.get("sglext"), Mapping) else {}
    ext_outputs = ext.get("output_ids")
    requests = []
    for i, (sample_id, choice) in enumerate(zip(sample_ids, choices, strict=True)):
        meta, container = _openai_payload(response, choices, i)
        prompt = _openai_ids(
            prompt_ids,
            _first(choice.get("prompt_token_ids"), ext.get("input_ids")),
            "prompt_token_ids",
            f"choices[{i}]",
            "send return_token_ids=True, or pass prompt_ids=",
        )
        found = _first(
            choice.get("token_ids"),  # /v1/completions
            choice.get("response_token_ids"),  # /v1/chat/completions
            ext_outputs[i] if ext_outputs is not None and i < len(ext_outputs) else None,
        )
        output = _openai_ids(
            None if output_ids is None else output_ids[i],
            found,
            "output token ids",
            f"choices[{i}]",
            "send return_token_ids=True, or pass output_ids= (one list per choice)",
        )
        requests.append(
            _put_request(store, sample_id, meta, container, prompt, output, start_len, prefix)
        )
    return requests


def put_sglang_openai(
    store: RoutingStore,
    sample_ids: Sequence[str],
    response: Any,
    prompt_ids: Sequence[int] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    **where: Any,
) -> list[RoutingRef]:
    """Put every choice of one SGLang OpenAI-compatible response into `store`, all or none
    (see `sglang_openai_requests`; `where`: its `start_len` and `prefix`): a bad choice, a
    duplicate id or a full store leaves nothing stored. The n choices of one prompt store
    their common prompt pages once."""
    requests = sglang_openai_requests(store, sample_ids, response, prompt_ids, output_ids, **where)
    return store.put_many(requests)


def encode_routed_experts(routes: np.ndarray) -> str:
    """What an SGLang server sends: base64 of int32 raw bytes (tests, and replaying logs)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode()
