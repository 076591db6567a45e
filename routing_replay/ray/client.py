"""The client side of node stores: `node_store(job, layout)` and this process's attach cache.

Every process that puts or reads (rollout workers, trainer workers, the driver) maps a
node's store once and keeps the mapping in `_attached`, by store name. A store whose
incarnation is gone (its actor died or was shut down, its segment swept) is unmapped at the
next `node_store` / read / release of this process, so its /dev/shm memory comes back
instead of staying mapped, deleted, for the life of the process.
"""

from __future__ import annotations

import time

from routing_replay.errors import LayoutMismatchError, StoreBusyError, StoreUnavailableError
from routing_replay.layout import RoutingLayout
from routing_replay.ray.actor import START_ATTEMPTS, store_actor
from routing_replay.ray.options import StoreOptions, store_options
from routing_replay.store import RoutingStore

_attached: dict[str, RoutingStore] = {}  # this process's mappings, by store name
_closing: list[RoutingStore] = []  # dead stores whose close must wait for a view to go


def node_store(
    job: str, layout: RoutingLayout, options: StoreOptions | None = None
) -> RoutingStore:
    """This node's RoutingStore for `job` (attached), starting the node's store actor if needed.

    Call it in any Ray task, actor or driver, once per step rather than once per process: it
    asks the actor which segment is current, so a writer never keeps putting into the
    segment of a store actor that died. `options` (`StoreOptions`: capacity, pages, slots,
    spill, job watch) apply when the node's actor starts.
    """
    import ray

    options = store_options(options)
    for attempt in range(START_ATTEMPTS):
        # A store actor killed a moment ago may still hold its name: get_if_exists then
        # hands back the dying actor. Ask again, briefly, before giving up.
        try:
            info = ray.get(store_actor(job, layout, options=options).info.remote())
            break
        except ray.exceptions.RayActorError as e:
            if attempt == START_ATTEMPTS - 1 or "creation task" in str(e):  # __init__ raised
                raise StoreUnavailableError(
                    f"the store actor of job {job!r} on this node failed to start or died: {e}"
                ) from e
            time.sleep(0.2 * (attempt + 1))
    return attached(info["store"], layout)


def attached(name: str, layout: RoutingLayout | None = None) -> RoutingStore:
    """This process's mapping of the live store `name`, attaching (once) if needed; every
    mapping of a store that is gone is closed on the way. Lock-free: a Ctrl-C anywhere in
    here leaves nothing that blocks the process's next call (a thread lock would stay held
    if the stop fell on its release)."""
    _close_dead()
    store = _attached.get(name)
    if store is None:
        new = RoutingStore.attach(name, layout)
        if not _is_live(new):
            _close([new])
            raise StoreUnavailableError(
                f"store {name!r}: its owner process is dead (the node's store actor "
                "died); its samples are lost"
            )
        store = _attached.setdefault(name, new)  # (one mapping per store, whoever is first)
        if store is not new:
            _close([new])  # another thread attached it meanwhile
    if layout is not None and layout != store.layout:
        raise LayoutMismatchError(f"store {name!r} holds routes for {store.layout}, not {layout}")
    return store


def _close_dead() -> None:
    """Unmap every cached store whose incarnation is gone. Names are per incarnation, so a
    name that maps to a dead store never maps to a live one; each dead mapping is taken out
    (`pop`) by one thread only, and each waiting close by the thread that popped it."""
    for name, store in list(_attached.items()):
        if _is_gone(name, store):
            gone = _attached.pop(name, None)
            if gone is not None:
                _closing.append(gone)
    for _ in range(len(_closing)):
        try:
            store = _closing.pop(0)
        except IndexError:  # (another thread took the rest)
            break
        _closing.extend(_close([store]))


def _close(stores: list[RoutingStore]) -> list[RoutingStore]:
    """Close each store without waiting; those still in use (a call of another thread on
    the handle, or a view of it) are returned, to be closed at a later call."""
    busy = []
    for store in stores:
        try:
            store.close(timeout=0)
        except (BufferError, StoreBusyError):  # StoreBusyError is an OSError: caught first
            busy.append(store)
        except OSError:
            pass  # closed half-way already: nothing left to give back
    return busy


def _is_gone(name: str, store: RoutingStore) -> bool:
    """Whether the cached mapping `name` -> `store` is of a store that is gone. Another
    thread may be closing it already (it took it out first): a probe of a handle closed
    under it fails any way it likes, and means gone as well."""
    if _attached.get(name) is not store:
        return False  # (taken out by another thread: that one closes it)
    try:
        return not _is_live(store)
    except Exception:
        return True


def _is_live(store: RoutingStore) -> bool:
    """The store is in use: the file at its path, or a segment removed from /dev/shm under
    its live actor (which serves it), and the owner (the actor) is alive."""
    return store.is_served() and store.owner_alive()
