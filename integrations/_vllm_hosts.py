"""What the vLLM hosts share: the store they put in, its handles and threads, counts, releases."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from routing_replay import RoutingLayout, RoutingRef, RoutingStore
from routing_replay.errors import (
    SampleNotFoundError,
    StoreUnavailableError,
    UnsupportedModelError,
)
from routing_replay.ray import StoreOptions, node_store

# Families whose routes vLLM records with a choice rewritten to expert 0 (docs/engines.md):
# replaying them would send those tokens through expert 0. Refused where a host starts.
LOSSY_FAMILIES = {
    "longcat_flash": "a pick of a zero-computation expert (ZeroExpertRouter._compute_routing)",
    "zaya": "a pick of the skip expert (its router's 'no expert')",
}
# Families whose routed_experts vLLM fills in a way not checked here: refused, with why.
UNVERIFIED_FAMILIES = {
    "diffusion_gemma": "a block-diffusion model: each denoising step and each commit route "
    "the canvas again, and which pass a generated token's row keeps is not verified "
    "(docs/engines.md)",
}
# Environment the worker sets (if unset) before importing vLLM: in-process engine core.
DEFAULT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# Threads the async servers run store calls in: a put may wait `put_timeout` for room.
STORE_THREADS = 64
_store_executor: ThreadPoolExecutor | None = None
_store_executor_lock = threading.Lock()
RELEASE_RETRY_S = (0.5, 30.0)  # a failed release is tried again: first wait, longest wait
log = logging.getLogger("routing_replay.integrations.vllm")  # the public module's name


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


_unclosed: list[RoutingStore] = []  # stale handles whose close failed: closed again later
_unclosed_lock = threading.Lock()


def check_family(config: Any) -> None:
    """Refuse a model whose vLLM routes lose a choice (`LOSSY_FAMILIES`) or are not known to
    mean what replay needs (`UNVERIFIED_FAMILIES`), saying what to do."""
    family = getattr(config, "model_type", None)
    if family in UNVERIFIED_FAMILIES:
        raise UnsupportedModelError(
            f"vLLM's routed_experts of {family}: {UNVERIFIED_FAMILIES[family]}; record the "
            "routes in the trainer instead (R2, docs/replay.md)"
        )
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
