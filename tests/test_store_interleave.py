"""Deterministic interleavings: another process acts at every point where an operation
takes or drops the store lock, and every sample still reads back exactly.

For each scenario (a few samples put, then one operation under test) the operation is run
once to list the points where it takes or drops the lock (`lock.interleave`), then once per
point with an interference run by a second, attached process at that point: releasing and
reusing the pages the operation compared or located, putting the same id or a twin, a
writer dying with pages reserved, a reclaim. Afterwards every sample the two processes
were told is stored reads back byte for byte, the store holds nothing else, no page is
left reserved, and `verify()` passes. The operation itself may only end with the errors
its contract names (a full store, a duplicate id, a sample released while read).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from routing_replay import PutRequest, RoutingLayout, RoutingStore, to_torch
from routing_replay.errors import (
    ConcurrentReleaseError,
    DuplicateSampleError,
    SampleNotFoundError,
    StoreFullError,
)
from routing_replay.store.lock import interleave

LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
P = 4  # tokens per page
PAGES = 16  # pages in a store: small, so that released pages are reused at once
TOKENS = np.arange(PAGES * P) * 7 + 3  # every sample's token ids start alike: keys collide
FORK = mp.get_context("fork")


# -- the other process ------------------------------------------------------------------


def _die_mid_put(name: str, sample_id: str, routes: np.ndarray) -> None:
    """Put with a fresh handle and die (SIGKILL) once the pages are reserved."""
    store = RoutingStore.attach(name)
    takes = []

    def die(point: str) -> None:
        if point.endswith(":take"):
            takes.append(point)
            if len(takes) == 3:  # lookup, reserve, then here: before publishing
                os.kill(os.getpid(), signal.SIGKILL)

    with interleave(die):
        store.put(sample_id, routes, token_ids=TOKENS[: len(routes)])
    os._exit(3)  # not reached


def _serve(conn) -> None:
    """Run operations on attached stores for the test process; answer how each ended."""
    stores: dict[str, RoutingStore] = {}
    while (msg := conn.recv()) is not None:
        op, name, args = msg
        try:
            if op == "close":
                stores.pop(name).close()
                conn.send(None)
                continue
            store = stores.get(name) or stores.setdefault(name, RoutingStore.attach(name))
            if op == "put":
                sample_id, routes = args
                store.put(sample_id, routes, token_ids=TOKENS[: len(routes)], timeout=0.0)
            elif op == "release":
                store.release(args)
            elif op == "reclaim":
                store.reclaim()
            elif op == "read":
                store.read(args)
            elif op == "die_mid_put":
                pid = os.fork()
                if pid == 0:
                    _die_mid_put(name, *args)
                _, status = os.waitpid(pid, 0)
                assert os.WIFSIGNALED(status), status
            conn.send(None)
        except Exception as e:  # the test decides which errors are allowed
            conn.send(type(e).__name__)


class Other:
    """A second process attached to the test's stores, run one operation at a time."""

    def __init__(self) -> None:
        self._conn, child = FORK.Pipe()
        self._proc = FORK.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()

    def __call__(self, op: str, name: str, *args) -> str | None:
        """Run `op` there; the name of the error it raised, or None."""
        self._conn.send((op, name, args[0] if len(args) == 1 else args))
        return self._conn.recv()

    def stop(self) -> None:
        self._conn.send(None)
        self._proc.join(10)


@pytest.fixture(scope="module")
def other():
    o = Other()
    yield o
    o.stop()


# -- one run: a store, what is in it, an operation, an interference ------------------------


@dataclass
class World:
    """One store, the other process, and what each was told is stored."""

    store: RoutingStore
    other: Other
    rng: np.random.Generator
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    reserved_by_dead: int = 0
    main_id: str = ""
    log: list[str] = field(default_factory=list)
    fresh: int = 0

    def routes(self, pages: int) -> np.ndarray:
        """Fresh routes of `pages` full pages."""
        return LAYOUT.random_routes(self.rng, pages * P)

    def put(self, sample_id: str, routes: np.ndarray) -> None:
        """Put from this process, during the set-up."""
        self.store.put(sample_id, routes, token_ids=TOKENS[: len(routes)])
        self.expected[sample_id] = routes

    def put_there(self, sample_id: str, routes: np.ndarray) -> None:
        """Put from the other process; remembered if it was stored."""
        err = self.other("put", self.store.name, sample_id, routes)
        self.log.append(f"other put {sample_id}: {err or 'ok'}")
        assert err in (None, "StoreFullError", "DuplicateSampleError"), err
        if err is None:
            assert sample_id not in self.expected, f"{sample_id} stored twice"
            self.expected[sample_id] = routes

    def release_there(self, ids: list[str]) -> None:
        err = self.other("release", self.store.name, ids)
        self.log.append(f"other release {ids}: {err or 'ok'}")
        assert err in (None, "SampleNotFoundError"), err
        if err is None:
            for i in ids:
                del self.expected[i]

    def new_id(self) -> str:
        self.fresh += 1
        return f"n{self.fresh}"


# Interferences, run by the other process at one lock point of the operation under test.


def release_and_reuse(w: World) -> None:
    """Release every stored sample, then put samples of the same tokens and sizes but other
    routes: the pages just freed come back at once with other contents."""
    old = {i: r for i, r in w.expected.items() if i != w.main_id}
    if old:
        w.release_there(list(old))
    for routes in old.values():
        w.put_there(w.new_id(), w.routes(len(routes) // P))


def put_twins(w: World) -> None:
    """Put a copy of every stored sample under a new id (more references to shared pages),
    and one of the same tokens with other routes on its last page (a twin)."""
    for routes in list(w.expected.values()):
        w.put_there(w.new_id(), routes)
        twin = routes.copy()
        twin[-P:] = w.routes(1)
        w.put_there(w.new_id(), twin)


def put_same_id(w: World) -> None:
    """Put the operation's own sample id, with other routes."""
    if w.main_id:
        w.put_there(w.main_id, w.routes(2))


def reput_same_ids(w: World) -> None:
    """Release every stored sample and put each id again, same tokens, other routes: a
    re-rollout under an id scheme that repeats (refs made before must not see it)."""
    for sample_id, routes in list(w.expected.items()):
        if sample_id == w.main_id:
            continue
        w.release_there([sample_id])
        # Not found: the operation under test released it, and its bookkeeping lags (it
        # runs after this lock drop); the operation sees the re-put and keeps it.
        w.expected.pop(sample_id, None)
        w.put_there(sample_id, w.routes(len(routes) // P))


def dead_writer(w: World) -> None:
    """A writer reserves 3 pages and is killed before publishing."""
    assert w.other("die_mid_put", w.store.name, w.new_id(), w.routes(3)) is None
    w.reserved_by_dead += 3


def reclaim(w: World) -> None:
    assert w.other("reclaim", w.store.name) is None


def fill(w: World) -> None:
    """Put a store's worth of new samples, reading each: in a spilling store, every sample
    put before goes to disk (oldest first) and its pages to the new ones; an operation that
    located one copies pages given to another sample (without spill, the puts find it full)."""
    for _ in range(4):
        w.put_there(sample_id := w.new_id(), w.routes(PAGES // 4))
        if sample_id in w.expected:
            assert w.other("read", w.store.name, [sample_id]) is None


INTERFERENCES = [release_and_reuse, put_twins, put_same_id, dead_writer, reclaim, fill]
REF_INTERFERENCES = [*INTERFERENCES, reput_same_ids]


# Scenarios: a set-up, and the operation under test (returning what it did to the model).


def _main_put(w: World, sample_id: str, routes: np.ndarray) -> Callable[[], None]:
    w.main_id = sample_id

    def op() -> None:
        try:
            w.store.put(sample_id, routes, token_ids=TOKENS[: len(routes)], timeout=0.05)
        except (StoreFullError, DuplicateSampleError) as e:
            w.log.append(f"main put: {type(e).__name__}")
            return
        assert sample_id not in w.expected, f"{sample_id} stored twice"
        w.expected[sample_id] = routes

    return op


def prefix_hit(w: World) -> Callable[[], None]:
    """b is a (same tokens, same routes: all three pages shared) and one page more."""
    a = w.routes(3)
    w.put("a", a)
    return _main_put(w, "b", np.concatenate([a, w.routes(1)]))


def twin_pages(w: World) -> Callable[[], None]:
    """The first page found for b's second key has other routes (c's); its twin (a's) has
    b's: b shares a's first two pages through the slow path."""
    a = w.routes(3)
    w.put("a", a)
    w.put("c", np.concatenate([a[:P], w.routes(2)]))
    return _main_put(w, "b", np.concatenate([a[: 2 * P], w.routes(1)]))


def no_prefix(w: World) -> Callable[[], None]:
    """A put that shares nothing (other routes from the first page on)."""
    w.put("a", w.routes(2))
    return _main_put(w, "b", w.routes(3))


def reclaim_to_fit(w: World) -> Callable[[], None]:
    """A dead writer holds pages that b needs: b's put reclaims them."""
    w.put("a", w.routes(4))
    dead_writer(w)
    dead_writer(w)  # 4 + 6 of 16 pages: b's 7 fit only after the reclaim
    return _main_put(w, "b", w.routes(7))


def read_shared(w: World) -> Callable[[], None]:
    """Read two samples that share pages."""
    a = w.routes(3)
    w.put("a", a)
    w.put("b", np.concatenate([a[: 2 * P], w.routes(1)]))
    wanted = {i: w.expected[i] for i in ("a", "b")}

    def op() -> None:
        try:
            batch = w.store.read(list(wanted))
            single = w.store.get("b")
        except (ConcurrentReleaseError, SampleNotFoundError) as e:
            w.log.append(f"main read: {type(e).__name__}")
            return
        same = np.array_equal(to_torch(batch).numpy(), np.concatenate(list(wanted.values())))
        assert same, "read: wrong routes"
        same = np.array_equal(single, wanted["b"])
        assert same, "get: wrong routes"

    return op


def release_shared(w: World) -> Callable[[], None]:
    """Release a sample whose first pages another sample shares."""
    a = w.routes(3)
    w.put("a", a)
    w.put("b", np.concatenate([a[: 2 * P], w.routes(1)]))
    return _release_a(w)


def reclaim_dead(w: World) -> Callable[[], None]:
    """Reclaim the pages of a dead writer."""
    w.put("a", w.routes(2))
    dead_writer(w)
    return w.store.reclaim


def put_many_shared(w: World) -> Callable[[], None]:
    """One put of three samples: two share a's first pages and their own third page (a
    GRPO group whose prompt was put before), one shares nothing. All of them or none."""
    a = w.routes(3)
    w.put("a", a)
    third = w.routes(1)
    batch = {
        "g0": np.concatenate([a[: 2 * P], third, w.routes(1)]),
        "g1": np.concatenate([a[: 2 * P], third, w.routes(1)]),
        "g2": w.routes(2),
    }
    w.main_id = "g1"

    def op() -> None:
        requests = [PutRequest(i, r, token_ids=TOKENS[: len(r)]) for i, r in batch.items()]
        try:
            w.store.put_many(requests, timeout=0.05)
        except (StoreFullError, DuplicateSampleError) as e:
            w.log.append(f"main put_many: {type(e).__name__}")
            stored = [i for i in batch if i in w.store and i not in w.expected]
            assert not stored, f"a failed put_many left {stored} stored"
            return
        for sample_id, routes in batch.items():
            assert sample_id not in w.expected, f"{sample_id} stored twice"
            w.expected[sample_id] = routes

    return op


def read_by_refs(w: World) -> Callable[[], None]:
    """Read two samples that share pages through their refs: the routes of those puts, or
    an error, never the routes of a later put of the same id."""
    a = w.routes(3)
    refs = [
        w.store.put("a", a, token_ids=TOKENS[: 3 * P]),
        w.store.put(
            "b", (b := np.concatenate([a[: 2 * P], w.routes(1)])), token_ids=TOKENS[: 3 * P]
        ),
    ]
    w.expected.update(a=a, b=b)
    put = np.concatenate([a, b])

    def op() -> None:
        try:
            batch = w.store.read(refs)
            single = w.store.get(refs[1])
        except (ConcurrentReleaseError, SampleNotFoundError) as e:  # (SampleReplacedError too)
            w.log.append(f"main read: {type(e).__name__}")
            return
        assert np.array_equal(to_torch(batch).numpy(), put), "read by refs: another put's routes"
        assert np.array_equal(single, b), "get by ref: another put's routes"

    return op


def release_by_ref(w: World) -> Callable[[], None]:
    """Release through a ref: that put, or an error; never a later put of the same id."""
    a = w.routes(3)
    ref = w.store.put("a", a, token_ids=TOKENS[: 3 * P])
    w.store.put("c", w.routes(1), token_ids=TOKENS[:P])
    w.expected.update(a=a, c=w.store.get("c"))
    w.main_id = "c"  # not "a": the re-put must reach the released id

    def op() -> None:
        try:
            w.store.release([ref])
        except SampleNotFoundError as e:  # released meanwhile, or released and put again
            w.log.append(f"main release: {type(e).__name__}")
            return
        # Released: the put the ref names. A re-put of "a" after it stays (and _check reads
        # it); had the release taken the re-put instead, _check finds it gone.
        if w.expected.get("a") is a:
            del w.expected["a"]

    return op


def put_spills(w: World) -> Callable[[], None]:
    """The store is full: b's put spills a (unread) to disk, or a and c."""
    w.put("a", w.routes(6))
    w.put("c", w.routes(6))
    w.store.get("c")
    return _main_put(w, "b", w.routes(7))


def release_spilled(w: World) -> Callable[[], None]:
    """Release a sample in a spill file."""
    w.put("a", w.routes(8))
    w.put("c", w.routes(8))
    w.put("d", w.routes(4))  # spills a
    return _release_a(w)


def _release_a(w: World) -> Callable[[], None]:
    """The operation: release "a"."""

    def op() -> None:
        try:
            w.store.release(["a"])
        except SampleNotFoundError:
            w.log.append("main release: SampleNotFoundError")
            return
        del w.expected["a"]

    return op


SPILL_SCENARIOS = [put_spills, release_spilled]  # on a spilling store only
SCENARIOS = [
    put_many_shared,
    prefix_hit,
    twin_pages,
    no_prefix,
    reclaim_to_fit,
    read_shared,
    release_shared,
    reclaim_dead,
]


def _check(w: World) -> None:
    """Everything the processes were told is stored reads back exactly; nothing else is."""
    store = w.store
    for sample_id, routes in w.expected.items():
        assert sample_id in store, f"{sample_id} was stored but is gone"
        same = np.array_equal(store.get(sample_id), routes)
        assert same, f"{sample_id}: wrong routes"
    assert len(store) == len(w.expected)
    store.reclaim()
    stats = store.stats()
    assert stats.pages_pending == 0, "pages left reserved after a reclaim"
    if stats.spill_budget:  # every file is a spilled sample's: none left by a dead spiller
        assert (
            len([f for f in os.listdir(store.spill_dir) if f.endswith(".spill")])
            == stats.samples_spilled
        ), "stray spill files"
    store.verify()


def _run(name: str, other: Other, scenario, interference, at: int | None, spill) -> list[str]:
    """Set up, run the operation with `interference` at lock point `at`; the points seen.
    `spill`: a directory for a spilling store, or None."""
    spilling = {} if spill is None else {"spill_dir": spill, "spill_budget": 1 << 24}
    with RoutingStore.create(
        name, LAYOUT, capacity_tokens=PAGES * P, page_tokens=P, **spilling
    ) as store:
        try:
            w = World(store, other, np.random.default_rng(at or 0))
            op = scenario(w)
            points: list[str] = []

            def hook(point: str) -> None:
                points.append(point)
                if len(points) - 1 == at:
                    interference(w)

            with interleave(hook):
                op()
            released = any(line.startswith("other release") for line in w.log)
            failed = any(line == "main read: ConcurrentReleaseError" for line in w.log)
            assert released or not failed, "a read failed though nothing was released"
            _check(w)
            return points
        except AssertionError as e:
            where = "" if at is None else f" at point {at} ({points[at]})"
            raise AssertionError(
                f"{scenario.__name__} with {interference.__name__}{where}: {e}; log: {w.log}"
            ) from e
        finally:
            other("close", name)


# In the slow tier only: reclaim_to_fit's interleavings take 4 s; prefix_hit and twin_pages
# share pages as put_many_shared does, which the fast tier runs.
SLOW = {reclaim_to_fit, prefix_hit, twin_pages}


@pytest.mark.parametrize(
    ("scenario", "spill"),
    [
        (s, False) if s not in SLOW else pytest.param(s, False, marks=pytest.mark.slow)
        for s in SCENARIOS
    ]
    + [pytest.param(s, True, marks=pytest.mark.slow) for s in SCENARIOS]  # the fast tier: once
    + [(s, True) for s in SPILL_SCENARIOS],
    ids=lambda x: x.__name__ if callable(x) else ("spilling" if x else "in-memory"),
)
def test_every_interleaving_reads_back_exactly(name, other, scenario, spill, tmp_path):
    _every_interleaving(name, other, scenario, INTERFERENCES, tmp_path if spill else None)


@pytest.mark.parametrize(
    "spill", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["in-memory", "spilling"]
)
@pytest.mark.parametrize("scenario", [read_by_refs, release_by_ref], ids=lambda s: s.__name__)
def test_refs_name_one_put_at_every_interleaving(name, other, scenario, spill, tmp_path):
    # Among the interferences: every id released and put again, same tokens, other routes.
    _every_interleaving(name, other, scenario, REF_INTERFERENCES, tmp_path if spill else None)


def _every_interleaving(name, other, scenario, interferences, spill) -> None:
    points = _run(name, other, scenario, reclaim, None, spill)  # no interference: the points
    assert len(points) >= 2 and len(points) % 2 == 0, points
    for interference in interferences:
        for at in range(len(points)):
            _run(f"{name}-{interference.__name__}-{at}", other, scenario, interference, at, spill)


# -- async exceptions ---------------------------------------------------------------------


class Interrupt(BaseException):
    """Stands for an async exception (KeyboardInterrupt, a timeout's SIGALRM handler)."""


@pytest.mark.parametrize("twice", [False, True], ids=["once", "again-in-clean-up"])
def test_async_exception_at_every_point_of_a_put_leaks_nothing(name, twice):
    # An exception raised where put takes or drops the lock: the put is whole or absent,
    # and its reserved pages go back at once. Raised again inside the put's own clean-up,
    # they stay reserved (pending) only until this handle next reclaims or runs short.
    with RoutingStore.create(name, LAYOUT, capacity_tokens=PAGES * P, page_tokens=P) as store:
        rng = np.random.default_rng(0)
        a = LAYOUT.random_routes(rng, 3 * P)
        store.put("a", a, token_ids=TOKENS[: 3 * P])
        b = np.concatenate([a, LAYOUT.random_routes(rng, 2 * P)])
        points: list[str] = []
        with interleave(points.append):
            store.put("b", b, token_ids=TOKENS[: 5 * P])
        store.release(["b"])
        orphaned = 0
        for at in range(len(points)):
            seen: list[str] = []

            def interrupt(point: str, at: int = at, seen: list[str] = seen) -> None:
                seen.append(point)
                if len(seen) - 1 == at or (twice and point == "put.unreserve:take"):
                    raise Interrupt(point)

            with interleave(interrupt), contextlib.suppress(Interrupt):
                store.put("b", b, token_ids=TOKENS[: 5 * P])
            where = f"interrupted at {points[at]}"
            if "b" in store:  # interrupted after the commit point: whole
                assert np.array_equal(store.get("b"), b), where
                store.release(["b"])
            pending = store.stats().pages_pending
            if not twice:
                assert pending == 0, where
            elif pending:
                assert seen[-1] == "put.unreserve:take", where
                orphaned += 1
                # The next put that runs short takes them back.
                big = LAYOUT.random_routes(rng, (PAGES - 3) * P)
                store.put("big", big)
                assert store.stats().pages_pending == 0, where
                assert np.array_equal(store.get("big"), big)
                store.release(["big"])
            assert np.array_equal(store.get("a"), a), where
            assert store.stats().pages_used == 3, where
            store.verify()
        assert len(points) == 6  # lookup, reserve, publish: take and drop each
        assert orphaned == (2 if twice else 0)  # cut short at reserve:drop and publish:take
