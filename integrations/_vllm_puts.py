"""vLLM request outputs and HTTP choices -> aligned samples and `PutRequest`s for a store,
and a terminal output -> an episode's turn (the async server's)."""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routing_replay import Episode, PutRequest, RoutingLayout, RoutingRef, RoutingStore
from routing_replay.errors import InvalidRoutesError, RoutingReplayError
from routing_replay.integrations._rows import fill_prefix, place_rows, token_array
from routing_replay.integrations._vllm_versions import (
    PolicyVersions,
    join_versions,
    policy_versions_of,
)


def decode_npy_b64(payload: str | bytes, what: str = "routed_experts") -> np.ndarray:
    """Decode vLLM's HTTP form of an array: base64 of `numpy.save` bytes (never pickles)."""
    if isinstance(payload, str):
        payload = payload.encode("ascii", errors="replace")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InvalidRoutesError(
            f"{what} is not valid base64 ({err}), {len(payload)} characters: truncated?"
        ) from None
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise InvalidRoutesError(
            f"{what} is base64 but not a complete .npy array ({err}); vLLM's HTTP endpoints "
            "send base64 of numpy.save bytes: was the payload truncated or from another server?"
        ) from None


def _array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, (str, bytes)):
        return decode_npy_b64(value, what)
    return np.asarray(value)


def routes_from_vllm(
    layout: RoutingLayout,
    num_tokens: int,
    routed_experts: Any,
    prompt_routed_experts: Any = None,
    *,
    prompt_len: int | None = None,
    start: int = 0,
) -> np.ndarray:
    """`[num_tokens, L_moe, K]` routes (-1 missing) of one sample, from any of vLLM's shapes.

    `num_tokens` is prompt + completion length. `routed_experts` covers positions
    `start .. num_tokens - 2` (shape 1 and HTTP), or only the completion's forwarded tokens
    when `prompt_routed_experts` (shape 2, needs `prompt_len`) covers `start .. prompt_len-1`.
    `start` is the request's `routed_experts_prompt_start` (0 by default).
    """
    if routed_experts is None:
        raise InvalidRoutesError(
            "routed_experts is None: start vLLM with enable_return_routed_experts=True "
            "(a request aborted before its first forward has none either)"
        )
    rows = _array(routed_experts, "routed_experts")
    if prompt_routed_experts is not None:
        prompt = _array(prompt_routed_experts, "prompt_routed_experts")
        if prompt_len is None or len(prompt) != prompt_len - start:
            raise InvalidRoutesError(
                f"prompt_routed_experts has {len(prompt)} rows for a prompt of {prompt_len} "
                f"tokens from position {start}: pass prompt_len= and the routes' start"
            )
        if prompt.ndim != 3 or rows.ndim != 3 or prompt.shape[1:] != rows.shape[1:]:
            raise InvalidRoutesError(
                f"prompt_routed_experts {prompt.shape} and routed_experts {rows.shape} must "
                "both be [rows, num_layers, top_k] with equal num_layers and top_k"
            )
        rows = np.concatenate([prompt, rows])
    return place_rows(layout, rows, num_tokens, start, source="vLLM routed_experts")


@dataclass(frozen=True)
class VllmSample:
    """One completion of a vLLM request, aligned for the store."""

    tokens: np.ndarray  # int64 prompt + completion ids
    prompt_len: int
    routes: np.ndarray  # [len(tokens), L_moe, K], -1 missing
    logprobs: np.ndarray | None  # float32 [gen_len], the sampled tokens' log-probs
    policy_version: PolicyVersions = None  # what to put it with (see `policy_versions_of`)


def samples_of(
    request_output: Any,
    layout: RoutingLayout,
    start: int = 0,
    *,
    policy_version: int | None = None,
    versions: Mapping[str, int] | None = None,
) -> list[VllmSample]:
    """Every completion of a finished `vllm.RequestOutput` (shape 1 or 2) as aligned
    samples, each with its policy version(s) (`policy_versions_of`)."""
    prompt = token_array(request_output.prompt_token_ids, "prompt_token_ids")
    prompt_routes = getattr(request_output, "prompt_routed_experts", None)
    out = []
    for completion in request_output.outputs:
        if completion.routed_experts is None and getattr(request_output, "finished", 1) is False:
            raise InvalidRoutesError(
                f"request {request_output.request_id!r} is not finished: vLLM sets "
                "routed_experts (and weight_versions) on the terminal output only; pass the "
                "last output of the stream (finished=True)"
            )
        output_ids = token_array(completion.token_ids, "token_ids")
        tokens = np.concatenate([prompt, output_ids])
        routes = routes_from_vllm(
            layout,
            len(tokens),
            completion.routed_experts,
            prompt_routes,
            prompt_len=len(prompt),
            start=start,
        )
        where = f"request {request_output.request_id!r} completion {completion.index}: "
        version = policy_versions_of(
            completion,
            len(prompt),
            len(output_ids),
            policy_version=policy_version,
            versions=versions,
            where=where,
        )
        logprobs = sampled_logprobs(completion)
        out.append(VllmSample(tokens, len(prompt), routes, logprobs, version))
    return out


def sampled_logprobs(completion: Any) -> np.ndarray | None:
    """The log-prob of each sampled token (vLLM `logprobs=0` or more), else None."""
    entries = getattr(completion, "logprobs", None)
    if not entries:
        return None
    return np.array(
        [float(step[tok].logprob) for tok, step in zip(completion.token_ids, entries, strict=True)],
        dtype=np.float32,
    )


def request_output_puts(
    store: RoutingStore,
    request_output: Any,
    sample_ids: Sequence[str] | Callable[[int], str],
    *,
    start: int = 0,
    prefix: str | RoutingRef | None = None,
    policy_version: int | None = None,
    versions: Mapping[str, int] | None = None,
) -> list[PutRequest]:
    """Each completion of a finished `vllm.RequestOutput` as a `PutRequest` for `store`.

    `start` is the request's `routed_experts_prompt_start`; rows before it are missing, or
    copied from `prefix` (the stored earlier turn of a multi-turn episode; pass its ref so
    its policy versions carry over). Policy versions: the completion's `weight_versions`
    mapped by `versions`, else `policy_version` (module doc).
    """
    samples = samples_of(
        request_output, store.layout, start, policy_version=policy_version, versions=versions
    )
    ids = [sample_ids(j) if callable(sample_ids) else sample_ids[j] for j in range(len(samples))]
    requests = []
    for i, s in zip(ids, samples, strict=True):
        fill_prefix(store, s.routes, prefix, start, s.tokens)
        version = join_versions(prefix, start, s.policy_version, len(s.tokens), f"{i!r}: ")
        requests.append(PutRequest(i, s.routes, s.prompt_len, s.tokens, version))
    return requests


def put_request_output(
    store: RoutingStore,
    request_output: Any,
    sample_ids: Sequence[str] | Callable[[int], str],
    *,
    start: int = 0,
    prefix: str | RoutingRef | None = None,
    policy_version: int | None = None,
    versions: Mapping[str, int] | None = None,
    timeout: float | None = None,
) -> list[RoutingRef]:
    """Put every completion of a `vllm.RequestOutput` into `store`, all or none; one ref per
    completion (see `request_output_puts`). `timeout` as in `RoutingStore.put_many`."""
    requests = request_output_puts(
        store,
        request_output,
        sample_ids,
        start=start,
        prefix=prefix,
        policy_version=policy_version,
        versions=versions,
    )
    return store.put_many(requests, timeout=timeout)


def http_choice_put(
    store: RoutingStore,
    sample_id: str,
    prompt_ids: Sequence[int],
    choice: Mapping[str, Any],
    prompt_routed_experts: str | None = None,
    *,
    start: int = 0,
    prefix: str | RoutingRef | None = None,
    policy_version: int | None = None,
    versions: Mapping[str, int] | None = None,
) -> PutRequest:
    """One choice of a vLLM HTTP response (`token_ids`, `.npy` base64 routes, maybe
    `weight_versions`) as a `PutRequest`. Keywords as in `request_output_puts`."""
    if prompt_ids is None:
        raise InvalidRoutesError(
            f"sample {sample_id!r}: no prompt token ids: request them (return_token_ids=True: "
            "per choice on completions, response-level on chat and generate)"
        )
    prompt = token_array(prompt_ids, "prompt_ids")
    if choice.get("token_ids") is None:
        raise InvalidRoutesError(
            "the choice has no token_ids: request them (return_token_ids=True / the "
            "token-in-token-out generate endpoint)"
        )
    output_ids = token_array(choice["token_ids"], "token_ids")
    tokens = np.concatenate([prompt, output_ids])
    routes = routes_from_vllm(
        store.layout,
        len(tokens),
        choice.get("routed_experts"),
        prompt_routed_experts,
        prompt_len=len(prompt),
        start=start,
    )
    fill_prefix(store, routes, prefix, start, tokens)
    where = f"sample {sample_id!r}: "
    version = policy_versions_of(
        choice,
        len(prompt),
        len(output_ids),
        policy_version=policy_version,
        versions=versions,
        where=where,
    )
    version = join_versions(prefix, start, version, len(tokens), where)
    return PutRequest(sample_id, routes, len(prompt), tokens, version)


def put_http_choice(
    store: RoutingStore,
    sample_id: str,
    prompt_ids: Sequence[int],
    choice: Mapping[str, Any],
    prompt_routed_experts: str | None = None,
    **where: Any,
) -> RoutingRef:
    """Put one choice of a vLLM HTTP response (see `http_choice_put`; `where`: its `start`,
    `prefix`, `policy_version`, `versions`)."""
    request = http_choice_put(store, sample_id, prompt_ids, choice, prompt_routed_experts, **where)
    return store.put_many([request])[0]


def encode_npy_b64(array: np.ndarray) -> str:
    """What vLLM's HTTP endpoints send for an array (`numpy2base64`): tests and log replays."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def add_engine_turn(
    episode: Episode,
    final: Any,
    layout: RoutingLayout,
    *,
    start: int,
    policy_version: int | None,
    turn: int,
) -> RoutingRef:
    """Add the turn a request's terminal `RequestOutput` (`final`, one completion) ends.

    Its routes cover positions `start..` (`routed_experts_prompt_start`); the episode's
    stored turns fill the rows before. The turn's policy version is the engine's weight
    version label when it gives one (vLLM 0.32, see `routing_replay.integrations.vllm`),
    else `policy_version`. An episode records one version per turn: a turn the engine
    generated with several (weights changed mid-turn) is refused.
    """
    if final is None or final.outputs[0].routed_experts is None:
        raise RoutingReplayError(
            f"episode {episode.episode_id!r} turn {turn}: the engine returned no routes "
            "(aborted before its first forward?); the turn was not added"
        )
    (sample,) = samples_of(final, layout, start, policy_version=policy_version)
    version = sample.policy_version
    if isinstance(version, tuple):
        distinct = sorted({v for _, v in version})
        if len(distinct) > 1:
            raise RoutingReplayError(
                f"episode {episode.episode_id!r} turn {turn}: generated by policy versions "
                f"{distinct} (spans {list(version)}): the weights changed mid-turn, and an "
                "episode records one version per turn. Update weights through "
                "VllmServer.update_weights (in-flight turns finish first), or put such "
                "samples with routing_replay.integrations.vllm.put_request_output (per-token "
                "spans)"
            )
        version = distinct[0]
    return episode.add_turn(sample.tokens, sample.routes, policy_version=version)
