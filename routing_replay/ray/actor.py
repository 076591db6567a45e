"""Node store actors: one Ray actor per (job, Ray job, node) that owns that node's store.

`job` is the caller's name for its run; the Ray job id is added to every name, so two Ray
jobs that pass the same `job` (two experiments on one cluster, a resubmitted script) never
share a store, and neither removes the other's. The actor is named
`rr-store.<job>.<Ray job id>.<node id[:12]>` in the `routing_replay` namespace, pinned to
its node with a hard node-affinity strategy, and *detached*: it is started by whichever
process of the Ray job first calls `node_store(job, layout)` on the node (a rollout worker,
usually), so it must not die with that process. It is tied to its Ray job instead: it
watches it and unlinks its segment and exits when the job's driver is gone, even if the
driver died without `shutdown_node_stores(job)`. It creates the node's segment
`/dev/shm/rr_<job>.<Ray job id>.<node id[:12]>.<incarnation>` (with `node_id=` Ray's node
id, so `RoutingRef.node_id` says where a sample lives), serves reads of its samples to
other nodes (in their wire form: each stored token once, shared prompt pages too; Ray
Data blocks as Arrow tables), releases, and unlinks on `shutdown_node_stores(job)`.

A store actor that dies loses its samples: a restarted actor (the next `node_store` call
on the node starts one) sweeps the dead incarnation's segment and creates a new one under
a new name, so refs to the lost samples fail with `StoreUnavailableError` instead of
silently reading another run's data.

Ray is imported inside the functions: `import routing_replay` works without Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from routing_replay.compat.ray import job_table, named_actor
from routing_replay.errors import StoreUnavailableError
from routing_replay.layout import RoutingLayout
from routing_replay.ray import direct
from routing_replay.ray.metrics import EXPORT_EVERY_S, StoreMetrics
from routing_replay.ray.names import (
    NAMESPACE,
    actor_name,
    check_job,
    current_node_id,
    current_ray_job,
    lost_error,
    store_prefix,
)
from routing_replay.ray.options import StoreOptions, store_options
from routing_replay.ray.scratch import Scratch
from routing_replay.ray.shutdown import sweep_dead_segments
from routing_replay.store import (
    RoutingRef,
    RoutingStore,
    WireBatch,
)

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

_LOG = logging.getLogger(__name__)
START_ATTEMPTS = 3
CONCURRENT_CALLS = 16  # threads serving reads at once: every rank of a trainer node, and more
SCRATCH_KEEP_BYTES = 256 << 20  # narrowing buffers a store actor keeps between reads


# -- the actor -------------------------------------------------------------------------


class NodeStoreActor:
    """Owns one node's RoutingStore for one job: creates it, serves reads and releases, unlinks."""

    def __init__(self, job: str, layout_json: str, options: StoreOptions) -> None:

        self.job = check_job(job)
        self.node_id = current_node_id()
        self.ray_job_id = current_ray_job()
        self.swept = sweep_dead_segments(job, self.ray_job_id, self.node_id)
        self._layout, self._options = RoutingLayout.from_json(layout_json), options
        # Stores whose segment was removed from /dev/shm under this actor (systemd-logind's
        # RemoveIPC, a cleanup script): still mapped here, so their samples are still served.
        self.retired: dict[str, RoutingStore] = {}
        self._renew = threading.Lock()
        self.store = self._create()
        self.counters = dict.fromkeys(
            ("read_calls", "direct_reads", "samples_served", "bytes_served", "released"), 0
        )
        self._lock = threading.Lock()
        self._scratch = Scratch(SCRATCH_KEEP_BYTES)
        self._direct: direct.DirectServer | None = None  # started by the first `endpoint`
        self.metrics = StoreMetrics(job, self.node_id)
        exporter = threading.Thread(target=self._export_metrics, daemon=True)
        exporter.start()
        if options.job_watch_s:
            args = (options.job_watch_s,)
            threading.Thread(target=self._watch_job, args=args, daemon=True).start()

    def _export_metrics(self) -> None:
        """Bring the Ray metrics up to date every EXPORT_EVERY_S while the store lives."""
        logged: set[str] = set()
        while "store" in self.__dict__:
            try:
                self.metrics.export(self.stats())
            except StoreUnavailableError:  # shut down meanwhile
                pass
            except Exception as e:  # busy past the wait, a metrics backend error: say it once
                if type(e).__name__ not in logged:
                    logged.add(type(e).__name__)
                    _LOG.warning("store actor %s: metrics not exported: %r", self.job, e)
            time.sleep(EXPORT_EVERY_S)

    def _watch_job(self, interval: float) -> None:
        """Unlink and exit once the Ray job that started this actor is dead."""
        import ray

        while "store" in self.__dict__:
            time.sleep(interval)
            try:
                table = job_table()
            except Exception:  # the GCS may be briefly unreachable: try again later
                continue
            if table is None:  # a Ray without the job table: live until shut down
                return
            if any(j["JobID"] == self.ray_job_id and j["IsDead"] for j in table):
                self.shutdown()
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    def _create(self) -> RoutingStore:
        name = store_prefix(self.job, self.ray_job_id, self.node_id) + uuid.uuid4().hex[:8]
        kwargs = self._options.create_kwargs()
        return RoutingStore.create(name, self._layout, node_id=self.node_id, **kwargs)

    def _live(self) -> RoutingStore:
        """The store new puts go to: a new one if this one's segment left /dev/shm (no
        process could attach it any more; this actor keeps serving its samples)."""
        store = self.__dict__.get("store")
        if store is None:
            raise StoreUnavailableError(
                f"the store actor of job {self.job!r} on node {self.node_id[:12]} was shut "
                "down: its samples are gone"
            )
        if not store.is_current():
            with self._renew:
                if self.__dict__.get("store") is store:
                    if store.name not in self.retired:
                        _LOG.warning(
                            "store actor %s: segment of %s was removed from /dev/shm; its "
                            "samples stay served from this actor, new puts go to a new store",
                            self.job,
                            store.name,
                        )
                        self.retired[store.name] = store
                    try:
                        self.store = self._create()
                    except StoreUnavailableError as e:  # tried again at the next call
                        raise StoreUnavailableError(
                            f"the segment of store {store.name!r} was removed from /dev/shm "
                            f"(its samples are still served) and no new store could be made "
                            f"for new puts: {e}"
                        ) from None
            return self._live()
        return store

    def _holding(self, refs: list[RoutingRef | str]) -> RoutingStore:
        """The store holding `refs`: a retired one, by their store, or the current one."""
        names = {r.store for r in refs if isinstance(r, RoutingRef)}

        def retired() -> RoutingStore | None:
            return self.retired.get(next(iter(names))) if len(names) == 1 else None

        try:
            store = self._live()  # (finds a wipe: the refs' store may be retired by it)
        except StoreUnavailableError:
            if retired() is None:
                raise
            return retired()  # type: ignore[return-value]
        held = retired()
        if held is not None:
            return held
        _check_refs_in(refs, store.name, self.node_id)
        return store

    def _retire_if_empty(self, store: RoutingStore) -> None:
        """Give back a retired store once it holds nothing: marked removed first (under its
        lock: handles of it take no puts from then on), closed if still empty then."""
        try:
            if store.name not in self.retired or store is self.__dict__.get("store") or len(store):
                return  # (the current store too: no new one could be made yet)
            store.unlink()
            if len(store):  # a put committed before the mark: served until shutdown
                return
            store.close(timeout=0)
        except (BufferError, OSError):  # closed meanwhile by another call's give-back
            return  # (StoreUnavailableError), or another call still on it: at a later one
        self.retired.pop(store.name, None)

    def info(self) -> dict[str, Any]:
        """Store name, node, pid and layout: what `node_store` needs to attach."""
        store = self._live()
        return {
            "store": store.name,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "layout": store.layout.to_json(),
            "capacity_tokens": store.capacity_tokens,
            "page_tokens": store.page_tokens,
        }

    def read(
        self,
        refs: list[RoutingRef | str],
        part: str = "all",
        ranges: list | None = None,
        request: bytes | None = None,
    ) -> ObjectRef | int:
        """Samples (or their `ranges`) in their wire form (`WireBatch`): each stored token
        the rows need once (a GRPO group's shared prompt pages travel once; ids of a
        256-expert layout narrowed to one byte: `WireBatch.narrowed`), copied straight from
        the segment: by `ray.put` into the object that ships, whose ref is returned, or with
        `request`, into the connection the reader opened for it (`direct`), then DONE once
        the read was checked; returns the bytes sent. Reads never release: the caller
        releases once its whole batch was read (`release`)."""
        import ray

        server = self._direct
        if request is None:
            streaming: Any = contextlib.nullcontext()
        elif server is None:
            raise direct.DirectUnavailable("this store actor serves no direct reads")
        else:
            streaming = server.stream(request)  # (one of its send slots, or DirectUnavailable)
        with streaming as conn:
            store = self._holding(refs)
            shipped: list[int] = []

            def ship(wire: WireBatch) -> Any:
                with self._scratch.lease() as take:  # free again once copied out
                    wire = wire.narrowed(take)
                    shipped.append(wire.nbytes)
                    if conn is None:
                        return ray.put(wire)
                    if len(shipped) > 1:  # read again (a sample spilled under the first)
                        raise direct.DirectUnavailable("the read went again: one stream each")
                    direct.send(conn, wire)
                    return wire.nbytes

            got = store.read_wire(refs, part=part, ranges=ranges, ship=ship)  # type: ignore[arg-type]
            if conn is not None:
                direct.done(conn)
        self._count(len(refs), shipped[-1], direct=conn is not None)
        return got

    def endpoint(self) -> tuple[str, int, bytes] | None:
        """Where readers connect for direct reads (host, port, secret); None: read through
        Ray's object store (`ROUTING_REPLAY_DIRECT=0` here, or nothing can listen)."""
        import ray

        if not direct.enabled():
            return None
        with self._lock:
            if self._direct is None:
                try:
                    self._direct = direct.DirectServer(ray.util.get_node_ip_address())
                except OSError as e:
                    _LOG.warning("store actor %s: no direct reads (%r)", self.job, e)
                    return None
            return (*self._direct.address, self._direct.secret)

    def read_block(
        self, refs: list[RoutingRef | str], part: str = "all", ranges: list | None = None
    ) -> tuple[pa.Table, int]:
        """A Ray Data block of the samples or their `ranges` (Arrow rows, as a Dataset holds
        them), and its row count as a second return (call with num_returns=2)."""
        store = self._holding(refs)
        batch = store.read(refs, part=part, ranges=ranges)  # type: ignore[arg-type]
        self._count(batch.num_rows, batch.nbytes)
        return pa.Table.from_batches([batch]), batch.num_rows

    def _count(self, samples: int, nbytes: int, direct: bool = False) -> None:
        with self._lock:
            self.counters["read_calls"] += 1
            self.counters["direct_reads"] += direct
            self.counters["samples_served"] += samples
            self.counters["bytes_served"] += nbytes

    def release(self, refs: list[RoutingRef | str]) -> int:
        """Release samples of this store; returns how many."""
        store = self._holding(refs)
        store.release(refs)
        self._retire_if_empty(store)
        with self._lock:
            self.counters["released"] += len(refs)
        return len(refs)

    def stats(self) -> dict[str, Any]:
        """The store's StoreStats fields plus this actor's read/release counters, and the
        stores whose segment left /dev/shm and the samples they still hold (each store given
        back here, or at a release through this actor, once it holds none; metrics export
        calls this every few seconds)."""
        with self._lock:
            counters = dict(self.counters)
        store = self._live()
        for each in list(self.retired.values()):  # (released by their own handles meanwhile)
            self._retire_if_empty(each)
        retired = list(self.retired.values())
        return {
            **vars(store.stats()),
            **counters,
            "store": store.name,
            "retired_stores": len(retired),  # (given back once empty)
            "retired_samples": sum(_samples(s) for s in retired),
        }

    def shutdown(self) -> None:
        """Unmap and unlink the segment (idempotent); the caller then kills the actor."""
        store = self.__dict__.pop("store", None)
        if self._direct is not None:
            self._direct.close()
        for each in [*self.retired.values(), store] if store is not None else []:
            with contextlib.suppress(BufferError, OSError):
                each.close()
            each.unlink()

    def __ray_shutdown__(self) -> None:
        """Ray's graceful-exit hook: unlink the segment if `shutdown` was not called."""
        self.shutdown()


def _samples(store: RoutingStore) -> int:
    """Samples a retired store holds (0 if another call gave it back meanwhile)."""
    try:
        return len(store)
    except StoreUnavailableError:
        return 0


def _check_refs_in(refs: list[RoutingRef | str], store: str, node_id: str) -> None:
    lost = [r for r in refs if isinstance(r, RoutingRef) and r.store != store]
    if lost:
        raise lost_error(lost, f"now {store!r}")


# -- starting, finding, stopping ------------------------------------------------------


def _actor_class() -> Any:
    import ray

    global _REMOTE
    if _REMOTE is None:
        _REMOTE = ray.remote(NodeStoreActor)
    return _REMOTE


_REMOTE: Any = None


def store_actor(
    job: str,
    layout: RoutingLayout | None = None,
    *,
    node_id: str | None = None,
    ray_job: str | None = None,
    options: StoreOptions | None = None,
) -> ActorHandle:
    """The store actor of `job` on `node_id` (default: this node) of Ray job `ray_job`
    (default: this process's); starts it given a layout, with `options` (`StoreOptions`)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or current_node_id()
    ray_job = ray_job or current_ray_job()
    name = actor_name(job, ray_job, node_id)
    if layout is None:
        handle = named_actor(name, NAMESPACE)
        if handle is None:
            raise StoreUnavailableError(
                f"no store actor for job {job!r} (Ray job {ray_job}) on node {node_id[:12]} "
                f"({name!r} in namespace {NAMESPACE!r}): it was shut down, its node or Ray "
                "job died, or nothing was stored there"
            )
        return handle
    return (
        _actor_class()
        .options(
            name=name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=CONCURRENT_CALLS,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(job, layout.to_json(), store_options(options))
    )
