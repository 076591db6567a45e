"""Reads of samples another node's store holds, through that node's store actor.

Each read crosses in its wire form (each stored token once), over a direct connection from
the store actor where one can be made (`direct`), through Ray's object store otherwise;
all of one `fetch_batch`'s reads are in flight at once, and the reader takes them as they
come. Ray is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import Any

from routing_replay.errors import RoutingReplayError, StoreUnavailableError
from routing_replay.ray import direct
from routing_replay.ray.actor import store_actor
from routing_replay.ray.names import job_of, lost_error
from routing_replay.ray.scratch import Scratch
from routing_replay.store import Part, RoutingRef, WireBatch

REMOTE_PIECES = 4  # calls a read of one remote store's samples takes, at most
REMOTE_PIECE_TOKENS = 1 << 16  # and tokens each call reads, at least
RECEIVE_KEEP_BYTES = 512 << 20  # memory a reader keeps for the next direct reads' bytes
RECEIVE = Scratch(RECEIVE_KEEP_BYTES)  # (fresh pages cost more than the bytes put in them)
_ENDPOINTS: dict[tuple[str, str], tuple[str, int, bytes] | None] = {}  # by (store, node)
_UNREACHABLE: dict[tuple[str, str], float] = {}  # when to try a port that failed again
MAX_ENDPOINTS = 1024  # endpoints cached at most (then asked again)
RETRY_UNREACHABLE_S = 60.0  # a port that could not be reached is tried again after this
_SAID: set[tuple[str, str]] = set()  # stores whose unreachable port was warned of


def actor_for(group: list[RoutingRef]) -> Any:
    """The store actor that serves `group`'s store (all of one store)."""
    ref = group[0]
    job, ray_job = job_of(ref)  # (a store no node store actor made: read it on its node)
    try:
        return store_actor(job, node_id=ref.node_id, ray_job=ray_job)
    except StoreUnavailableError:
        raise lost_error(group, "no store actor runs for it") from None


def results(object_refs: list[Any], groups: list[list[RoutingRef]]) -> list[Any]:
    """ray.get, with errors raised by a store actor re-raised as routing_replay errors."""
    import ray

    out = []
    for obj, group in zip(object_refs, groups, strict=True):
        try:
            out.append(ray.get(obj))
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, (RoutingReplayError, direct.DirectUnavailable)):
                raise cause from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            raise lost_error(group, f"its store actor died: {type(e).__name__}") from None
    return out


def pieces(indices: list[int], refs: list[RoutingRef]) -> list[list[int]]:
    """A remote store's refs (their indices) in up to REMOTE_PIECES runs of consecutive refs,
    each of REMOTE_PIECE_TOKENS tokens or more (a GRPO group's shared prompt pages then
    travel once per run it spans)."""
    tokens = [refs[i].num_tokens for i in indices]
    count = min(REMOTE_PIECES, len(indices), max(1, sum(tokens) // REMOTE_PIECE_TOKENS))
    out, start, seen, total = [], 0, 0, sum(tokens)
    for j, n in enumerate(tokens):
        seen += n
        if seen * count >= total * (len(out) + 1) and len(out) < count - 1:
            out.append(indices[start : j + 1])
            start = j + 1
    return [*out, indices[start:]] if start < len(indices) else out


class RemoteReads:
    """One `fetch_batch`'s reads of other nodes' stores, started at once (`wires()` takes
    them). `take(n)`: memory the direct reads receive into, valid while the caller uses the
    wire batches."""

    def __init__(
        self,
        groups: list[list[RoutingRef]],
        part: Part,
        ranges: list[list | None],
        take: Callable[[int], Any],
    ) -> None:
        self.groups, self._part, self._ranges = groups, part, ranges
        self._actors = [actor_for(g) for g in groups]
        self.calls: list[Any] = []
        self.pulls: list[direct.DirectPull | None] = []
        try:
            endpoints = _endpoints(self._actors, groups)
            for i in range(len(groups)):
                self.pulls.append(None)
                self.pulls[i] = self._connect(i, endpoints[i], take)
                self.calls.append(self._call(i, self.pulls[i]))
        except BaseException:
            self.close()
            raise

    def _connect(
        self, i: int, endpoint: Any, take: Callable[[int], Any]
    ) -> direct.DirectPull | None:
        """A pull on the store actor's endpoint; None: read through Ray (no endpoint, this
        process out of descriptors, or the port unreachable, which is said once)."""
        actor, ref = self._actors[i], self.groups[i][0]
        try:
            pull = direct.connect(endpoint, take)
            if pull is None and endpoint is not None:
                fresh = _ask_again(actor, ref)  # (a restarted actor's new port?)
                if fresh is not None and fresh != endpoint:
                    pull = direct.connect(fresh, take)
                if pull is None and fresh is not None:
                    _unreachable(ref, fresh)
        except direct.DirectUnavailable:  # (short of descriptors here: says nothing of there)
            return None
        return pull

    def _call(self, i: int, pull: direct.DirectPull | None) -> Any:
        actor, group = self._actors[i], self.groups[i]
        kwargs = {"part": self._part, "ranges": self._ranges[i]}
        if pull is None:
            return actor.read.remote(group, **kwargs)
        return actor.read.remote(group, request=pull.request, **kwargs)

    def wires(self) -> list[WireBatch]:
        """Every read's wire batch, in order; a read whose direct stream failed as a transport
        is done again through Ray's object store."""
        try:  # (first: a stop anywhere after this closes every connection)
            import ray

            direct_at = [i for i, p in enumerate(self.pulls) if p is not None]
            failed = direct.drain([self.pulls[i] for i in direct_at], self._check(direct_at))
            wires: list[Any] = [None] * len(self.groups)
            for k, i in enumerate(direct_at):
                if k not in failed:
                    results([self.calls[i]], [self.groups[i]])  # (raises the call's error)
                    wires[i] = self.pulls[i].wire()  # type: ignore[union-attr]
                    continue
                with contextlib.suppress(direct.DirectUnavailable):
                    results([self.calls[i]], [self.groups[i]])  # a store error is raised
                self.pulls[i] = None
                self.calls[i] = self._call(i, None)  # the transport failed: through Ray
            through_ray = [i for i, w in enumerate(wires) if w is None]
            shipped = dict(zip(through_ray, self._pull_objects(through_ray), strict=True))
            if shipped:
                ray.wait(list(shipped.values()), num_returns=len(shipped), fetch_local=True)
            for i, obj in shipped.items():
                (wires[i],) = results([obj], [self.groups[i]])
            return wires
        finally:
            self.close()

    def _check(self, direct_at: list[int]) -> Callable[[list[int]], list[int]]:
        """For `drain`: raises the error of a call that failed while its stream waits, and
        gives up the streams whose call returned long ago (read through Ray instead)."""
        import ray

        def check(waiting: list[int]) -> list[int]:
            calls = [self.calls[direct_at[k]] for k in waiting]
            ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
            give_up = []
            for k, call in zip(waiting, calls, strict=True):
                if call in ready:
                    i = direct_at[k]
                    try:
                        results([call], [self.groups[i]])  # (raises a store error)
                    except direct.DirectUnavailable:
                        give_up.append(k)  # (its connection never reached the call)
                        continue
                    if direct.stalled(self.pulls[i]):  # type: ignore[arg-type]
                        give_up.append(k)
            return give_up

        return check

    def _pull_objects(self, indices: list[int]) -> list[Any]:
        """The wire objects of the calls through Ray, each pull started as its call returns."""
        import ray

        shipped: dict[int, Any] = {}
        waiting = {self.calls[i]: i for i in indices}
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1)
            for call in done:
                i = waiting.pop(call)
                (shipped[i],) = results([call], [self.groups[i]])
                ray.wait([shipped[i]], timeout=0, fetch_local=True)  # (starts its pull)
        return [shipped[i] for i in indices]

    def close(self) -> None:
        """Close every connection; collect every call (no "unhandled error" in the logs)."""
        import ray

        try:
            for pull in self.pulls:  # (one a stop skips closes as it goes: its __del__)
                if pull is not None:
                    pull.close()
        finally:
            calls, self.calls = self.calls, []
            for call in calls:
                with contextlib.suppress(Exception):
                    ray.get(call)


def _endpoints(actors: list[Any], groups: list[list[RoutingRef]]) -> list[Any]:
    """Each store actor's direct endpoint (None: read through Ray), asked once per store."""
    import ray

    if not direct.enabled():
        return [None] * len(groups)
    if len(_ENDPOINTS) > MAX_ENDPOINTS:  # (one per store incarnation ever read)
        _ENDPOINTS.clear()
        _UNREACHABLE.clear()
    keys = [(g[0].store, g[0].node_id) for g in groups]
    now = time.monotonic()
    for key in keys:  # (a port that failed a while ago: ask and try again)
        if _UNREACHABLE.get(key, now) < now:
            _ENDPOINTS.pop(key, None)
            _UNREACHABLE.pop(key, None)
    asked = {}
    for key, actor in zip(keys, actors, strict=True):
        if key not in _ENDPOINTS and key not in asked:
            asked[key] = actor.endpoint.remote()
    found = {key: _ENDPOINTS.get(key) for key in keys if key not in asked}
    for key, call in asked.items():
        try:
            found[key] = ray.get(call)
        except Exception:  # (an actor that died: its read says so)
            found[key] = None
        _ENDPOINTS[key] = found[key]  # (other threads may clear the cache meanwhile)
    return [found[key] for key in keys]


def _ask_again(actor: Any, ref: RoutingRef) -> tuple[str, int, bytes] | None:
    """The store actor's endpoint now (a cached one could not be reached: the actor may have
    been restarted since), cached; None if it has none or is gone."""
    import ray

    try:
        endpoint = ray.get(actor.endpoint.remote())
    except Exception:  # (gone: its read says so)
        endpoint = None
    _ENDPOINTS[ref.store, ref.node_id] = endpoint
    return endpoint


def _unreachable(ref: RoutingRef, endpoint: tuple[str, int, bytes]) -> None:
    """A store actor this process cannot connect to: its reads go through Ray for a while
    (RETRY_UNREACHABLE_S), then the port is tried again; said once per store."""
    key = ref.store, ref.node_id
    _ENDPOINTS[key] = None
    _UNREACHABLE[key] = time.monotonic() + RETRY_UNREACHABLE_S
    if key in _SAID:
        return
    if len(_SAID) > MAX_ENDPOINTS:
        _SAID.clear()
    _SAID.add(key)
    warnings.warn(
        f"cannot connect to the store actor of {ref.store!r} at {endpoint[0]}:{endpoint[1]} "
        f"(a firewall between nodes?): its samples are read through Ray's object store, "
        f"more slowly. Open that port range between nodes, or set "
        f"{direct.ENV}=0 to silence this",
        RuntimeWarning,
        stacklevel=5,
    )
