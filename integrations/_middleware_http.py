"""What the vLLM middleware shows over HTTP: the routes it handles, its header and fields,
refs as JSON, sample ids from client-supplied response ids, what a rewrite returns, and
the counters of vLLM's `/metrics` and their in-process twin (`MiddlewareCounts`).

Sample ids are `<response id, made safe>-<12 random hex digits>-<choice index>`
  (`sample_ids`). The response id (`id` on completions and chat, `request_id` on generate)
  comes from the client: vLLM builds it from the `X-Request-Id` header (`cmpl-`,
  `chatcmpl-`, `generate-tokens-` + the header), else a random one. Characters outside
  `A-Za-z0-9._:-` become `_` and it is cut to 96 characters, so every id is a valid store
  id (at most 128 bytes, no `/`, `\\`, NUL); the random part, one draw per response, keeps
  a retry with the same header from colliding with the first try.

Clients use `choice_ref` and `ref_from_json` (re-exported by `vllm_middleware`); the
middleware (`vllm_middleware.RoutesToRefs`) uses the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

from routing_replay import RoutingRef
from routing_replay.integrations.vllm import RoutesNotStoredError, StoreCounts

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"
PATHS = (COMPLETIONS, CHAT, GENERATE)
STORE_ENV = "RR_STORE_NAME"
VERSIONS_ENV = "RR_WEIGHT_VERSIONS"  # JSON {label: policy version} for non-decimal labels
PUT_TIMEOUT_ENV = "RR_PUT_TIMEOUT"  # seconds a response's put waits for room
OPT_OUT = (b"x-routing-replay", b"body")
ERROR_HEADER = b"x-routing-replay-error"  # on a response whose routes were not stored
ERROR_FIELD = "routing_error"  # per choice, beside "routing_ref": null
ID_PREFIX_CHARS = 96  # + "-" + 12 hex + "-" + index: within the store's 128-byte ids
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
_HEADER_CHARS = 1000


def ref_json(ref: RoutingRef) -> dict[str, Any]:
    """A ref as the JSON object the middleware sends (`routing_ref`)."""
    return dataclasses.asdict(ref)


def ref_from_json(obj: Mapping[str, Any] | str | None) -> RoutingRef:
    """The `RoutingRef` of a response's `routing_ref` (a dict, or its JSON text). A null
    one (routes not stored) raises `RoutesNotStoredError`: `choice_ref` says why."""
    if obj is None or obj == "null":
        raise RoutesNotStoredError(
            "routing_ref is null: the middleware did not store this choice's routes; the "
            f"choice's {ERROR_FIELD!r} field (and the response's "
            f"{ERROR_HEADER.decode()!r} header) say why: use choice_ref(choice)"
        )
    data = json.loads(obj) if isinstance(obj, str) else dict(obj)
    spans = tuple((int(a), int(b)) for a, b in data.pop("policy_versions", ()))
    return RoutingRef(**data, policy_versions=spans)


def choice_ref(choice: Mapping[str, Any]) -> RoutingRef:
    """The `RoutingRef` of one choice of a middleware response; `RoutesNotStoredError`
    naming why when its routes were not stored."""
    ref = choice.get("routing_ref")
    if ref is not None:
        return ref_from_json(ref)
    why = choice.get(ERROR_FIELD) or (
        "the choice has no routing_ref: was the server started with --middleware "
        "routing_replay.integrations.vllm_middleware.RoutesToRefs and "
        "--enable-return-routed-experts, without the x-routing-replay: body header?"
    )
    raise RoutesNotStoredError(
        f"choice {choice.get('index')}: its routes were not stored, so it has no ref: {why}"
    )


def sample_ids(response_id: Any, indices: list[int]) -> list[str]:
    """Store ids of a response's choices: `<response id, made safe>-<12 hex>-<index>`.

    The response id comes from the client (`X-Request-Id`): characters outside
    `A-Za-z0-9._:-` become `_`, it is cut to `ID_PREFIX_CHARS`, and one random draw per
    response makes a retry with the same header a new sample, never a duplicate.
    """
    base = _ID_UNSAFE.sub("_", str(response_id))[:ID_PREFIX_CHARS] or "response"
    draw = secrets.token_hex(6)
    return [f"{base}-{draw}-{int(i)}" for i in indices]


def header_text(text: str) -> bytes:
    """An error text as a header value: printable ASCII, at most 1000 characters."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:_HEADER_CHARS].encode()


def unstored_body(body: bytes, text: str) -> bytes:
    """A rewritten body whose refs were released: each ref null, `routing_error` `text`."""
    response = json.loads(body)
    for choice in response.get("choices") or []:
        if isinstance(choice, dict) and choice.get("routing_ref") is not None:
            choice["routing_ref"] = None
            choice[ERROR_FIELD] = text
    return json.dumps(response, separators=(",", ":")).encode()


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


@dataclasses.dataclass
class Rewritten:
    """A response body after `RoutesToRefs.rewrite`: `error` when its routes were not
    stored (the body then carries null refs and the error's text), `stored` when they were
    (`refs`: the choices' refs the body carries)."""

    body: bytes
    response_id: str = ""
    choices: int = 0
    stored: bool = False
    error: BaseException | None = None
    refs: list[RoutingRef] = dataclasses.field(default_factory=list)


def prometheus_metrics() -> tuple[Any, ...] | None:
    """The counters vLLM's `/metrics` shows (prometheus_client's default registry), or
    None without prometheus_client."""
    try:
        from prometheus_client import REGISTRY, Counter, Gauge
    except ImportError:
        return None
    specs = (
        (Counter, "routing_replay_routes_stored", "responses whose routes were stored", ()),
        (
            Counter,
            "routing_replay_routes_refused",
            "responses sent without their routes (not stored), by error class",
            ("error",),
        ),
        (Gauge, "routing_replay_routes_in_flight", "responses whose routes are being put", ()),
        (
            Counter,
            "routing_replay_routes_undelivered",
            "responses whose routes were stored, then released: the response did not reach "
            "the client (disconnect, cancelled, or the send's error class)",
            ("reason",),
        ),
        (
            Gauge,
            "routing_replay_routes_unreleased",
            "samples whose release failed (the store busy past the timeout) and is retried: "
            "still stored",
            (),
        ),
        (
            Gauge,
            "routing_replay_served_model",
            "1 for the model the server serves (its model_type), and whether its routes are "
            "refused (vLLM records a choice of its routers lossily: refused=yes)",
            ("model_type", "refused"),
        ),
    )
    metrics = []
    for kind, name, doc, labels in specs:
        try:
            metrics.append(kind(name, doc, labels))
        except ValueError:  # registered already (this module imported twice)
            metrics.append(REGISTRY._names_to_collectors[name])
    return tuple(metrics)


@dataclasses.dataclass
class MiddlewareCounts(StoreCounts):
    """`StoreCounts`, and `undelivered`: responses whose routes were stored but that did
    not reach the client, by reason (`disconnect`, `cancelled`, the send's error class):
    their samples were released."""

    undelivered: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "undelivered": dict(self.undelivered)}
