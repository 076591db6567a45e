"""RoutingStore with real processes on real /dev/shm: round trips, crashes, sharing, errors."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import os
import pickle
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
from line_stops import forked_at
from store_stats import held

from routing_replay import (
    PutRequest,
    RoutingLayout,
    RoutingRef,
    RoutingStore,
    cu_seqlens,
    to_torch,
)
from routing_replay.errors import (
    DuplicateSampleError,
    InvalidArgumentError,
    InvalidRoutesError,
    LayoutMismatchError,
    SampleNotFoundError,
    StoreBusyError,
    StoreFullError,
    StoreUnavailableError,
)
from routing_replay.store import token_digest
from routing_replay.store.lock import interleave
from routing_replay.store.segment import FORKED_INSIDE_EXIT, segment_path

# 6 layers, the first and fourth dense (DeepSeek-style), top-2 of 16 experts.
LAYOUT = RoutingLayout(num_layers=6, top_k=2, num_experts=16, moe_layers=(1, 2, 4, 5))
FORK = mp.get_context("fork")


def sample(i: int, layout: RoutingLayout = LAYOUT, max_len: int = 600):
    """Deterministic sample i: (routes [T, L_moe, K] int64 with -1 rows, prompt_len)."""
    rng = np.random.default_rng(i)
    T = int(rng.integers(1, max_len))
    routes = layout.random_routes(rng, T)
    routes[rng.random(T) < 0.05] = -1  # prefix-cache gaps
    routes[-1] = -1  # the last token is never forwarded
    return routes, int(rng.integers(0, T + 1))


def all_layers(routes: np.ndarray, layout: RoutingLayout = LAYOUT) -> np.ndarray:
    """The same routes as an engine returns them: every layer, dense ones as zeros."""
    full = np.zeros((len(routes), layout.num_layers, layout.top_k), dtype=np.uint8)
    full[:, list(layout.moe_layers)] = routes.astype(np.uint8)  # -1 -> 255 marker
    return full


def _writer(name: str, ids: range, done) -> None:
    with RoutingStore.attach(name) as store:
        for i in ids:
            routes, prompt_len = sample(i)
            # Odd samples arrive as an engine hands them over: uint8, all layers.
            store.put(f"s{i}", all_layers(routes) if i % 2 else routes, prompt_len=prompt_len)
    done.put(len(ids))


def _reader(name: str, ids: range, result) -> None:
    with RoutingStore.attach(name, LAYOUT) as store:
        bad = [i for i in ids if not np.array_equal(store.get(f"s{i}"), sample(i)[0])]
        batch = store.read([f"s{i}" for i in ids], part="completion")
        packed, cu = to_torch(batch).numpy(), cu_seqlens(batch).numpy()
        for j, i in enumerate(ids):
            routes, prompt_len = sample(i)
            if not np.array_equal(packed[cu[j] : cu[j + 1]], routes[prompt_len:]):
                bad.append(i)
    result.put(bad)


def test_round_trip_across_processes(name):
    n_samples, writers = 300, 3
    with RoutingStore.create(name, LAYOUT, capacity_tokens=200_000, page_tokens=64) as store:
        q = FORK.Queue()
        chunks = [range(w, n_samples, writers) for w in range(writers)]
        procs = [FORK.Process(target=_writer, args=(name, c, q)) for c in chunks]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert sum(q.get(timeout=5) for _ in procs) == n_samples
        readers = [FORK.Process(target=_reader, args=(name, c, q)) for c in chunks[:2]]
        for p in readers:
            p.start()
        for p in readers:
            p.join(60)
            assert p.exitcode == 0
        assert [q.get(timeout=5) for _ in readers] == [[], []]

        # And in the owner, the whole batch through Arrow and torch, packed and padded.
        ids = [f"s{i}" for i in range(n_samples)]
        batch = store.read(ids)
        assert batch.num_rows == n_samples
        assert batch.column("sample_id").to_pylist() == ids
        assert batch.column("prompt_len").to_pylist() == [sample(i)[1] for i in range(n_samples)]
        packed, cu = to_torch(batch), cu_seqlens(batch)
        assert packed.shape[1:] == (4, 2)
        for i in range(n_samples):
            assert np.array_equal(packed[cu[i] : cu[i + 1]].numpy(), sample(i)[0])
        stats = store.stats()
        assert stats.samples == n_samples
        assert stats.tokens_stored == sum(len(sample(i)[0]) for i in range(n_samples))
        assert stats.dedup_saved_bytes == 0


@pytest.mark.slow  # the fast tier stays under a minute
def test_attached_process_exit_does_not_unlink(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=1000) as store:
        routes = sample(1)[0]
        store.put("kept", routes)
        code = (
            "from routing_replay import RoutingStore\n"
            f"s = RoutingStore.attach({name!r})\n"
            "assert 'kept' in s\n"
            "s.close()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        # A second interpreter that attaches and exits without closing, too.
        code = f"from routing_replay import RoutingStore\ns = RoutingStore.attach({name!r})\n"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert os.path.exists(segment_path(name))
        assert np.array_equal(store.get("kept"), routes)
        assert stat.S_IMODE(os.stat(segment_path(name)).st_mode) == 0o600
    assert not os.path.exists(segment_path(name))


def _endless_writer(name: str, last_committed) -> None:
    store = RoutingStore.attach(name)
    i = 0
    while True:
        store.put(f"k{i}", sample(i, max_len=3000)[0])
        last_committed.value = i  # set only once the put returned: committed
        i += 1
        if i % 40 == 0:  # keep the store from filling: release the last 40
            store.release([f"k{j}" for j in range(i - 40, i)])


@pytest.mark.slow  # the fast tier stays under a minute
def test_writer_killed_mid_put(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=200_000, page_tokens=32) as store:
        rng = np.random.default_rng(0)
        for trial in range(8):
            last_committed = FORK.Value("q", -1, lock=False)
            p = FORK.Process(target=_endless_writer, args=(name, last_committed))
            p.start()
            while last_committed.value < 0:
                assert p.is_alive(), f"writer died before its first put: {p.exitcode}"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.02, 0.2))  # (a few hundred puts in)
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            last = last_committed.value
            present = {i for i in range(last + 2) if f"k{i}" in store}
            # Everything committed and not released by the writer itself reads back exact,
            # and the put in flight is either absent or whole.
            for i in present:
                assert np.array_equal(store.get(f"k{i}"), sample(i, max_len=3000)[0])
            assert present >= set(range((last + 1) // 40 * 40, last + 1))
            assert present <= set(range((last + 1) // 40 * 40 - 40, last + 2))
            # The store keeps working, and the dead writer's pages come back.
            store.release([f"k{i}" for i in present])
            store.reclaim()
            stats = store.stats()
            assert (stats.samples, stats.pages_used, stats.pages_pending) == (0, 0, 0)
            routes = sample(7)[0]
            store.put(f"after{trial}", routes)
            assert np.array_equal(store.get(f"after{trial}"), routes)
            store.release([f"after{trial}"])


def _die_mid_put(name: str, point: str, routes: np.ndarray) -> None:
    store = RoutingStore.attach(name)

    def die_at(p: str) -> None:
        if p == point:
            os.kill(os.getpid(), signal.SIGKILL)

    with interleave(die_at):
        store.put("doomed", routes)


def test_pages_of_a_dead_writer_are_reclaimed_whatever_its_pid(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=4096, page_tokens=32) as store:
        kept = sample(1)[0]
        store.put("kept", kept)
        before = store.stats()
        routes = LAYOUT.random_routes(np.random.default_rng(3), 160)  # 5 pages
        p = FORK.Process(target=_die_mid_put, args=(name, "put.publish:take", routes))
        p.start()
        p.join()
        assert p.exitcode == -signal.SIGKILL
        assert store.stats().pages_pending == 5 and "doomed" not in store
        # Its lease record names a pid that a live process has now (this one): liveness is
        # the kernel's lease, which died with the writer, never the pid.
        store._core.tables.leases["pid"][:] = os.getpid()
        assert store.reclaim() == 5
        assert store.stats() == before
        # A live writer's reservation (this process, mid-put) is never reclaimed.
        seen = []

        def reclaim_mid_put(point: str) -> None:
            if point == "put.publish:take":
                seen.extend([store.reclaim(), store.stats().pages_pending])

        with interleave(reclaim_mid_put):
            store.put("mine", routes)
        assert seen == [0, 5]
        assert np.array_equal(store.get("mine"), routes)
        assert np.array_equal(store.get("kept"), kept)
        store.verify()


def _put_with_the_parents_handle(store: RoutingStore, go, done) -> None:
    while not go.value:
        time.sleep(0.001)
    store.put("child", sample(3)[0])  # the handle this process inherited at fork
    done.value = 1
    store.close()  # a forked child is not the owner: this does not unlink


@pytest.mark.parametrize("locked_at_fork", [False, True])
def test_forked_child_with_the_parents_handle_waits_for_the_lock(name, locked_at_fork):
    # A forked child shares its parent's open file description, and flock belongs to the
    # description: unless the child opens its own, both are "inside" the lock at once.
    with RoutingStore.create(name, LAYOUT, capacity_tokens=20_000) as store:
        store.put("parent", sample(2)[0])
        go, done = FORK.Value("i", 0, lock=False), FORK.Value("i", 0, lock=False)
        p = FORK.Process(target=_put_with_the_parents_handle, args=(store, go, done))
        with contextlib.ExitStack() as held:
            if locked_at_fork:  # the child inherits a held thread lock too
                held.enter_context(store._core.lock.held("test", time.monotonic() + 60))
            p.start()
            if not locked_at_fork:
                held.enter_context(store._core.lock.held("test", time.monotonic() + 60))
            go.value = 1
            time.sleep(0.25)  # the child's put takes milliseconds once it may
            assert not done.value, "the child's put ran while the parent held the lock"
        p.join(timeout=20)
        if p.is_alive():  # deadlocked on a lock it inherited held
            p.kill()
            p.join()
        assert p.exitcode == 0 and done.value
        assert np.array_equal(store.get("child"), sample(3)[0])
        assert np.array_equal(store.get("parent"), sample(2)[0])
        store.verify()
        assert os.path.exists(segment_path(name))  # the child's close() did not unlink
        stats = store.stats()
        assert (stats.samples, stats.pages_pending) == (2, 0)


# (A fork of the whole suite's grown process costs tens of ms: every 11th point when slow.)
@pytest.mark.parametrize("stride", [pytest.param(11, marks=pytest.mark.slow), 97])
def test_a_child_forked_inside_a_put_ends_before_it_touches_the_store(name, stride):
    # Rounds 63-64: a process forked inside a put, on the putting thread (a signal handler
    # or a hook forks). The child went on with the put on the store itself, under a lock
    # of its own, alongside the parent's: a store verify() calls corrupt, or the parent's
    # put refused as a duplicate. Such a child now exits at once (status 70), before any
    # line of the call runs there, from the call's first line (round 65: not before it
    # registered).
    routes = sample(7, max_len=40)[0]
    tokens = np.arange(len(routes))
    with RoutingStore.create(name, LAYOUT, capacity_tokens=20_000, page_tokens=4) as store:
        base = store.put("base", routes, token_ids=tokens)  # the put below shares its pages
        stop = 1
        while True:
            pid, put = forked_at(
                stop, lambda stop=stop: store.put(f"s{stop}", routes, token_ids=tokens)
            )
            if pid == 0:
                os._exit(3)  # (never: a child forked inside a store call ends in the fork)
            if pid is None:  # the put ran to its end: every line was a fork point
                break
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            assert code == FORKED_INSIDE_EXIT, f"line event {stop}: the child exited {code}"
            assert isinstance(put, RoutingRef), f"line event {stop}: {put!r}"
            store.verify()
            np.testing.assert_array_equal(store.get(put), routes)
            np.testing.assert_array_equal(store.get(base), routes)
            store.release([put])
            stop += stride
        assert stop > 700


@pytest.mark.parametrize("stride", [pytest.param(5, marks=pytest.mark.slow), 37])
def test_a_child_forked_inside_a_create_never_removes_the_parents_store(name, tmp_path, stride):
    # Round 64: a fork inside RoutingStore.create (with a spill directory): the child's
    # create went on, failed, and its clean-up removed the parent's new segment and spill
    # directory; or, forked before the handle knew its owner, the child removed the store
    # as its owner. Such a child now exits at once (status 70).
    routes = sample(8, max_len=40)[0]
    stop = 1
    while True:
        pid, made = forked_at(
            stop,
            lambda stop=stop: RoutingStore.create(
                f"{name}-{stop}", LAYOUT, 4096, spill_dir=str(tmp_path)
            ),
        )
        if pid == 0:
            os._exit(3)  # (never: a child forked inside a create ends in the fork)
        assert isinstance(made, RoutingStore), f"line event {stop}: {made!r}"
        if pid is None:
            made.close()
            made.unlink()
            break
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert code == FORKED_INSIDE_EXIT, f"line event {stop}: the child exited {code}"
        with made as store:  # the parent's store is whole and its own
            store.put("s", routes)
            with RoutingStore.attach(store.name) as other:  # (another process's view)
                np.testing.assert_array_equal(other.get("s"), routes)
            assert os.path.isdir(store.spill_dir)
        stop += stride
    assert stop > 200


def test_a_child_forked_by_another_thread_mid_put_can_close_its_handle(name):
    # Round 66: the handle counted its calls by thread ident; a child forked by another
    # thread while a put ran inherited that call's entry, and a new thread of the child,
    # given the vanished thread's ident, made close() wait for a call that was not there
    # and raise StoreBusyError.
    inside, go = threading.Event(), threading.Event()
    with RoutingStore.create(name, LAYOUT, capacity_tokens=20_000) as store:

        def hold_inside(frame, event, arg):
            if store._core.calls and event == "line":
                inside.set()
                go.wait(30)
                return None
            return hold_inside

        def put():
            sys.settrace(hold_inside)
            try:
                store.put("a", sample(1)[0])
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=put)
        thread.start()
        try:
            assert inside.wait(30)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    idle = threading.Event()
                    new = threading.Thread(target=idle.wait)  # (may get the gone one's ident)
                    new.start()
                    store.close(timeout=1)
                    code = 0
                finally:
                    idle.set()
                    os._exit(code)
        finally:
            go.set()
            thread.join(30)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0  # before: 1
        np.testing.assert_array_equal(store.get("a"), sample(1)[0])


def _die_inside_critical_section(name: str) -> None:
    store = RoutingStore.attach(name)
    with store._core.lock.held("test", time.monotonic() + 60) as hold:
        hold.write()
        # Half of a release: refcounts, buckets and the free stack changed, the slot not
        # yet freed. Then death.
        store._core.tables.p_refcount[:] = 7
        store._core.tables.page_heads[:] = 3
        store._core.tables.hdr["free_pages"] = 0
        os.kill(os.getpid(), signal.SIGKILL)


def test_locker_killed_inside_critical_section_is_repaired(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=20_000, page_tokens=16) as store:
        prompt = np.arange(64)
        for i in range(6):
            routes = sample(i)[0][:40]
            shared = np.concatenate([np.broadcast_to([3, 4], (64, 4, 2)), routes])
            store.put(f"r{i}", shared, token_ids=np.concatenate([prompt, np.arange(len(routes))]))
        before = store.stats()
        p = FORK.Process(target=_die_inside_critical_section, args=(name,))
        p.start()
        p.join()
        assert p.exitcode == -signal.SIGKILL
        after = store.stats()  # the first locker repairs
        assert after == before
        for i in range(6):
            assert np.array_equal(store.get(f"r{i}")[64:], sample(i)[0][:40])
        # Sharing still works after the buckets were rebuilt.
        store.put("r6", np.broadcast_to([3, 4], (64, 4, 2)), token_ids=prompt)
        assert store.stats().pages_used == before.pages_used


def test_grpo_prefix_sharing_fits_in_35_percent():
    layout = RoutingLayout(48, 8, 128)  # Qwen3-30B-A3B shape
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(0, 150_000, 3000)
    prompt_routes = layout.random_routes(rng, 3000)
    n, completion = 8, 500
    unshared_tokens = n * (3000 + completion)
    name = f"test-grpo-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(name, layout, capacity_tokens=int(0.35 * unshared_tokens)) as store:
        samples = []
        for j in range(n):
            routes = np.concatenate([prompt_routes, layout.random_routes(rng, completion)])
            routes[-1] = -1
            tokens = np.concatenate([prompt_ids, rng.integers(0, 150_000, completion)])
            ref = store.put(f"g{j}", routes, prompt_len=3000, token_ids=tokens, timeout=0)
            assert ref == RoutingRef(
                f"g{j}",
                name,
                store.node_id,
                3500,
                3000,
                store.store_uid,
                token_digest(tokens),
                serial=j + 1,
            )
            samples.append(routes)
        for j, routes in enumerate(samples):
            assert np.array_equal(store.get(f"g{j}"), routes)
            assert np.array_equal(store.get(f"g{j}", "prompt"), prompt_routes)
        stats = store.stats()
        full_pages = 3000 // store.page_tokens
        assert stats.dedup_saved_bytes == (n - 1) * full_pages * store.page_tokens * 384
        assert stats.bytes_used <= 0.35 * unshared_tokens * layout.bytes_per_token

        # Multi-turn: turn 2 extends turn 1's tokens and shares all of turn 1's full pages.
        turn2 = np.concatenate([samples[0], layout.random_routes(rng, 100)])
        store.release([f"g{j}" for j in range(1, n)])
        used = store.stats().pages_used
        tokens2 = np.concatenate([prompt_ids, np.arange(completion + 100)])
        tokens1 = tokens2[:3500]
        store.release(["g0"])
        store.put("turn1", samples[0], token_ids=tokens1)
        store.put("turn2", turn2, token_ids=tokens2)
        assert store.stats().pages_used == used + -(-3600 // 128) - 3500 // 128
        assert np.array_equal(store.get("turn2"), turn2)
    assert not os.path.exists(segment_path(name))


def test_same_tokens_different_routes_are_not_merged(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=10_000, page_tokens=16) as store:
        tokens = np.arange(100)
        a = np.broadcast_to([5, 7], (100, 4, 2)).copy()
        b = a.copy()
        b[40, 2, 1] = 6  # one id differs, in the third page
        store.put("a", a, token_ids=tokens)
        store.put("b", b, token_ids=tokens)
        assert np.array_equal(store.get("a"), a)
        assert np.array_equal(store.get("b"), b)
        # Pages 0 and 1 are shared; from page 2 on the chains diverge.
        assert store.stats().dedup_saved_bytes == 2 * 16 * LAYOUT.bytes_per_token
        store.release(["a"])
        assert np.array_equal(store.get("b"), b)
        # An id that wraps to a shared page's bytes (261 -> uint8 5) is refused, not shared.
        wraps = b.copy()
        wraps[0, 0, 0] = 256 + 5
        with pytest.raises(InvalidRoutesError, match="expert id 261"):
            store.put("c", wraps, token_ids=tokens)
        assert "c" not in store


def test_sharing_finds_the_twin_with_equal_routes(name):
    """Two published chains with the same tokens but different routes: a third sample
    shares the one whose routes equal its own, whichever the key lookup meets first."""
    page = 16 * LAYOUT.bytes_per_token
    with RoutingStore.create(name, LAYOUT, capacity_tokens=10_000, page_tokens=16) as store:
        tokens = np.arange(100)  # 6 full pages (shareable) and a partial one
        a = LAYOUT.random_routes(np.random.default_rng(0), 100)
        b = a.copy()
        b[40, 2, 1] = next(e for e in range(16) if e not in a[40, 2])  # differs from page 3 on
        store.put("a", a, token_ids=tokens)
        store.put("b", b, token_ids=tokens)
        assert store.stats().dedup_saved_bytes == 2 * page
        store.put("like-a", a.astype(np.uint8), token_ids=tokens)  # narrow input
        assert store.stats().dedup_saved_bytes == (2 + 6) * page
        store.put("like-b", b.astype(np.int64), token_ids=tokens)  # wide input
        assert store.stats().dedup_saved_bytes == (2 + 6 + 6) * page
        for sid, routes in [("a", a), ("b", b), ("like-a", a), ("like-b", b)]:
            assert np.array_equal(store.get(sid), routes)
        # A bad id after a shared prefix is reported at its place in the whole sample.
        bad = a.astype(np.uint8)
        bad[70, 1, 0] = 20
        with pytest.raises(InvalidRoutesError, match="expert id 20 at token 70, MoE layer 1"):
            store.put("bad", bad, token_ids=tokens)
        assert "bad" not in store
        store.verify()


def test_shared_page_reused_after_its_compare_is_not_shared(name):
    """put compares candidate pages without the lock; if they are released and published
    again before it publishes, it must notice (generations) and start over, not share."""
    with RoutingStore.create(name, LAYOUT, capacity_tokens=128, page_tokens=16) as store:
        tokens = np.arange(64)  # 4 pages of 8
        a = LAYOUT.random_routes(np.random.default_rng(1), 64)
        other = LAYOUT.random_routes(np.random.default_rng(2), 64)
        store.put("a", a, token_ids=tokens)
        store.put("filler", other)  # the other 4 pages
        points = []

        def then_race(point: str) -> None:
            points.append(point)
            if points.count("put.reserve:take") == 1 and point == "put.reserve:take":
                with interleave(lambda _: None):  # b compared a's 4 pages: now they hold "other"
                    store.release(["a"])
                    store.put("other", other)
                    store.release(["filler"])

        with interleave(then_race):
            store.put("b", a, token_ids=tokens)
        assert np.array_equal(store.get("b"), a)
        assert np.array_equal(store.get("other"), other)
        assert store.stats().dedup_saved_bytes == 0
        store.verify()


def _release_later(name: str, ids: list[str], delay: float) -> None:
    store = RoutingStore.attach(name)
    time.sleep(delay)
    store.release(ids)


def test_full_store_waits_then_raises_and_keeps_data(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=256, page_tokens=64) as store:
        r = np.broadcast_to([1, 3], (128, 4, 2)).astype(np.int64)
        store.put("a", r)
        store.put("b", r + 1)
        t0 = time.monotonic()
        with pytest.raises(StoreFullError, match=r"256 tokens.*capacity_tokens"):
            store.put("c", r, timeout=0.3)
        assert time.monotonic() - t0 >= 0.3
        assert np.array_equal(store.get("a"), r) and np.array_equal(store.get("b"), r + 1)
        assert store.stats().pages_pending == 0
        # A writer blocked on a full store resumes when another process releases.
        p = FORK.Process(target=_release_later, args=(name, ["a"], 0.3))
        p.start()
        store.put("c", r + 2, timeout=10)
        p.join()
        assert np.array_equal(store.get("c"), r + 2)
        with pytest.raises(StoreFullError, match="at most 256"):
            store.put("huge", np.ones((300, 4, 2), dtype=np.int64))


def test_bad_input_is_refused_and_store_unharmed(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=4096, page_tokens=16) as store:
        good = sample(3)[0]
        store.put("good", good, prompt_len=2)
        before = store.stats()
        bad_puts = [
            (np.zeros((10, 4), dtype=np.int64), "shape"),  # 2-D
            (np.zeros((10, 5, 2), dtype=np.int64), "have 5 layers"),  # neither 4 nor 6
            (np.zeros((10, 4, 3), dtype=np.int64), "top_k=2"),
            (np.full((10, 4, 2), 16), "out of range"),
            (np.full((10, 4, 2), -2), "out of range"),
            (np.zeros((10, 4, 2), dtype=np.float32), "integer"),
            (np.zeros((0, 4, 2), dtype=np.int64), "no routed tokens"),
        ]
        for routes, message in bad_puts:
            with pytest.raises(InvalidRoutesError, match=message):
                store.put("new", routes)
        with pytest.raises(InvalidRoutesError, match="id 200 at token 0"):
            store.put("new", np.full((3, 4, 2), 200, dtype=np.uint8))
        with pytest.raises(DuplicateSampleError, match="already in store"):
            store.put("good", good)
        with pytest.raises(InvalidArgumentError, match="prompt_len"):
            store.put("new", good, prompt_len=len(good) + 1)
        for not_int in (3.7, True, np.float64(2.0), "2"):  # never truncated, never a bool
            with pytest.raises(InvalidArgumentError, match=r"prompt_len must be an int .* got"):
                store.put("new", good, prompt_len=not_int)
        store.put("np-int", good, prompt_len=np.int32(2))  # numpy ints are ints
        assert store.read(["np-int"]).column("prompt_len").to_pylist() == [2]
        store.release(["np-int"])
        # A repeated id within a top-k is stored as given: the engine edge (integrations)
        # and the consumers (replay, the Megatron feed) refuse it, exactly; scanning every
        # put would cost 10-17x its copy (benchmarks/store.py).
        twice = good.copy()
        twice[5, 2] = [7, 7]
        with pytest.raises(InvalidRoutesError, match=r"token 5, MoE layer 2 names an expert twice"):
            LAYOUT.check_distinct(twice)
        twice[6, 2] = [7, -1]  # a missing slot beside a real id is no repeat
        with pytest.raises(InvalidRoutesError, match=r"token 5, MoE layer 2"):
            LAYOUT.check_distinct(twice)
        store.put("as-given", twice)
        assert np.array_equal(store.get("as-given"), twice)
        store.release(["as-given"])
        with pytest.raises(InvalidArgumentError, match="token_ids"):
            store.put("new", good, token_ids=np.arange(len(good) - 1))
        with pytest.raises(InvalidArgumentError, match="sample_id"):
            store.put("a/b\n", good)
        with pytest.raises(SampleNotFoundError, match=r"'nope'.*nothing was changed"):
            store.get("nope")
        with pytest.raises(SampleNotFoundError, match="'nope'"):
            store.read(["good", "nope"])
        with pytest.raises(SampleNotFoundError, match="cannot release 'nope'"):
            store.release(["good", "nope"])  # all or nothing: 'good' stays
        store.put("noprompt", good)
        with pytest.raises(InvalidArgumentError, match="part='all'"):
            store.get("noprompt", part="prompt")
        store.release(["noprompt"])
        assert held(store.stats()) == held(before)  # the good puts and reads above came and went
        assert np.array_equal(store.get("good"), good)
        with pytest.raises(LayoutMismatchError, match="holds routes for"):
            RoutingStore.attach(name, RoutingLayout(6, 2, 32, (1, 2, 4, 5)))
        assert np.array_equal(store.get("good"), good)
    with pytest.raises(StoreUnavailableError, match="no routing store named"):
        RoutingStore.attach(name)


def test_create_checks_dev_shm_space_and_existing(name):
    huge = 10**12 // LAYOUT.bytes_per_token
    with pytest.raises(StoreUnavailableError, match=r"free but store .* needs.*--shm-size"):
        RoutingStore.create(name, LAYOUT, capacity_tokens=huge)
    assert not os.path.exists(segment_path(name))
    with (
        RoutingStore.create(name, LAYOUT, capacity_tokens=100),
        pytest.raises(StoreUnavailableError, match="already exists"),
    ):
        RoutingStore.create(name, LAYOUT, capacity_tokens=100)
    with pytest.raises(ValueError, match="store name"):
        RoutingStore.create("../etc", LAYOUT, capacity_tokens=100)


def test_only_owner_unlinks(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=100):
        attached = RoutingStore.attach(name)
        with pytest.raises(Exception, match="only the process that created"):
            attached.unlink()
        attached.close()
        assert os.path.exists(segment_path(name))


def test_wide_ids_layout_round_trip(name):
    layout = RoutingLayout(5, 8, 256, (2, 3, 4))  # DeepSeek-V3-like: 256 experts, 16-bit
    assert layout.dtype == np.uint16 and layout.bytes_per_token == 48
    with RoutingStore.create(name, layout, capacity_tokens=5000) as store:
        rng = np.random.default_rng(5)
        routes = layout.random_routes(rng, 700, np.int32)
        routes[rng.random((700, 3)) < 0.1] = -1
        store.put("w", routes)
        assert np.array_equal(store.get("w"), routes)
        assert np.array_equal(to_torch(store.read(["w"])).numpy(), routes)


def test_refs_and_handles_of_a_removed_store_are_refused(name):
    store = RoutingStore.create(name, LAYOUT, capacity_tokens=1000)
    attached = RoutingStore.attach(name)
    routes = sample(1)[0]
    ref = store.put("s", routes)
    assert ref.store_uid == store.store_uid != 0
    store.close()
    store.unlink()  # as `routing-replay sweep` would, or the owner's exit
    with RoutingStore.create(name, LAYOUT, capacity_tokens=1000) as again:
        assert again.store_uid != ref.store_uid
        new_ref = again.put("s", sample(2)[0])  # the same id, other routes
        with pytest.raises(StoreUnavailableError, match=r"handle .* is stale.*attach again"):
            attached.read([new_ref])  # the stale one is the handle, not the ref
        with pytest.raises(StoreUnavailableError, match="earlier store named"):
            again.get(ref)
        with pytest.raises(StoreUnavailableError, match="earlier store named"):
            again.release([ref])
        assert np.array_equal(again.get("s"), sample(2)[0])  # by id: this store's sample
        assert not attached.is_current()
        with pytest.raises(StoreUnavailableError, match=r"removed .* or re-created"):
            attached.put("t", routes)
        assert "t" not in again
        assert ref not in again and new_ref in again  # by ref: that very put, in this store
    attached.close()


def test_a_ref_is_in_its_own_store_only(name):
    # Before: `ref in store` matched id and put serial only, so a ref of another store filled
    # the same way was "in" it, while get/read/release of that ref refused it.
    with (
        RoutingStore.create(name, LAYOUT, capacity_tokens=1000) as a,
        RoutingStore.create(f"{name}-b", LAYOUT, capacity_tokens=1000) as b,
    ):
        ref_a, ref_b = a.put("s", sample(1)[0]), b.put("s", sample(1)[0])
        assert ref_a.serial == ref_b.serial and ref_a in a and ref_b in b
        assert ref_b not in a and ref_a not in b
        assert "s" in a and "s" in b


def test_a_ref_of_a_same_named_store_of_another_node_is_sent_there(name):
    # Plain stores of one name on two nodes (two nodes' /dev/shm, played here one after the
    # other): before, a ref of node B's read on node A was "in an earlier store named ...:
    # its routes are gone; re-run the rollout", while node B held them.
    with RoutingStore.create(name, LAYOUT, capacity_tokens=1000, node_id="node-b") as b:
        ref = b.put("s", sample(1)[0])
    with RoutingStore.create(name, LAYOUT, capacity_tokens=1000, node_id="node-a") as a:
        a.put("s", sample(1)[0])
        for call in (a.get, lambda r: a.read([r]), lambda r: a.release([r])):
            with pytest.raises(SampleNotFoundError, match=r"on node 'node-b'.*on its node"):
                call(ref)
        assert ref not in a and "s" in a


def test_a_handle_cannot_be_pickled_or_copied(name):
    # Before: pickle (Ray task arguments) raised a builtin TypeError about mmap, and
    # copy.copy made a second handle sharing the first one's internals.
    with RoutingStore.create(name, LAYOUT, capacity_tokens=1000) as store:
        for how in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(InvalidArgumentError, match=r"RoutingStore.attach\("):
                how(store)
        store.put("s", sample(1)[0])
        assert "s" in store


def test_handles_dropped_unclosed_give_their_leases_back(no_gc, name, tmp_path):
    # Before: a handle dropped without close() kept its descriptors and writer lease for the
    # life of the process: after max_writers of them every put was refused; and its shared
    # lock on the spill directory, which then outlived its dead owner's sweep.
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    with RoutingStore.create(
        name, LAYOUT, capacity_tokens=10_000, max_writers=2, spill_dir=tmp_path
    ) as store:
        before = fds()
        for i in range(4):  # e.g. a task body: attach, put, return the ref
            with pytest.warns(ResourceWarning, match="without close"):
                RoutingStore.attach(name).put(f"w{i}", sample(i)[0])
                assert fds() == before
        assert fds() == before
        store.put("mine", sample(9)[0])  # a lease is free for the owner
        for i in range(4):
            assert np.array_equal(store.get(f"w{i}"), sample(i)[0])
        store.verify()


def test_a_segment_removed_by_others_than_its_owner_still_takes_puts(name):
    # A wiped /dev/shm (systemd-logind's RemoveIPC) while the owner lives: the owner still
    # maps the store and serves it, so an attached handle's puts are kept, not refused. One
    # the owner removed itself takes none.
    owner = RoutingStore.create(name, LAYOUT, capacity_tokens=1000)
    writer = RoutingStore.attach(name)
    os.unlink(segment_path(name))
    assert not writer.is_current() and writer.is_served()
    ref = writer.put("after", sample(1)[0])
    np.testing.assert_array_equal(owner.get(ref), sample(1)[0])
    owner.unlink()  # the owner removes it (the file is already gone): marked all the same
    assert not writer.is_served()
    with pytest.raises(StoreUnavailableError, match="removed \\(by its owner"):
        writer.put("later", sample(2)[0])
    writer.close()
    owner.close()
    assert not writer.is_served() and not owner.is_served()  # closed (before: AttributeError)


def test_removing_a_wiped_store_leaves_the_store_made_under_its_name_since(name):
    # A wipe, then the obvious recovery: a new store under the same name. Before: the old
    # owner's unlink (or the end of its `with` block) deleted the new store's file, so no
    # process could attach it while its owner went on putting.
    old = RoutingStore.create(name, LAYOUT, capacity_tokens=1000)
    os.unlink(segment_path(name))
    new = RoutingStore.create(name, LAYOUT, capacity_tokens=1000)
    ref = new.put("s", sample(1)[0])
    old.unlink()
    old.close()
    with RoutingStore.attach(name) as reader:
        np.testing.assert_array_equal(reader.get(ref), sample(1)[0])
    new.close()
    new.unlink()
    assert not os.path.exists(segment_path(name))


def test_a_put_waiting_for_room_while_its_owner_removes_the_store_stores_nothing(name):
    # Before: it went on waiting, committed once a release made room, and returned a ref
    # into a store no process could attach any more.
    owner = RoutingStore.create(name, LAYOUT, capacity_tokens=4 * 16, page_tokens=16)
    writer, trainer = RoutingStore.attach(name), RoutingStore.attach(name)
    rows = [LAYOUT.random_routes(np.random.default_rng(i), 16) for i in range(5)]
    refs = [owner.put(f"s{i}", rows[i]) for i in range(4)]  # full
    said = []
    waiting = threading.Thread(
        target=lambda: said.append(_outcome(lambda: writer.put("late", rows[4], timeout=20)))
    )
    waiting.start()
    time.sleep(0.3)  # inside its put, waiting for room
    owner.unlink()
    trainer.release(refs[:1])  # room appears
    waiting.join(20)
    (error,) = said
    assert isinstance(error, StoreUnavailableError) and "nothing was put" in str(error)
    assert "late" not in owner and len(owner) == 3
    for handle in (writer, trainer, owner):
        handle.close()


def _outcome(call):
    try:
        return call()
    except Exception as e:  # the test's answer
        return e


def _hold_the_lock(name: str, held, go) -> None:
    store = RoutingStore.attach(name)
    with store._core.lock.held("test", time.monotonic() + 5):
        held.value = 1
        while not go.value:
            time.sleep(0.01)


@pytest.mark.slow  # the fast tier stays under a minute
def test_put_timeout_bounds_the_wait_for_the_lock(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=1000) as store:
        held, go = FORK.Value("i", 0, lock=False), FORK.Value("i", 0, lock=False)
        p = FORK.Process(target=_hold_the_lock, args=(name, held, go))
        p.start()
        while not held.value:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(StoreBusyError, match="lock stayed held by another process"):
            store.put("s", sample(1)[0], timeout=0.2)
        assert p.is_alive() and not go.value  # it gave up while the lock was still held
        waited = time.monotonic() - t0
        go.value = 1
        p.join(10)
        assert waited < 5  # the holder would have held it for ever
        store.put("s", sample(1)[0])  # released: the store is whole
        assert np.array_equal(store.get("s"), sample(1)[0])
        store.verify()


def _put_and_wait(name: str, sample_id: str, done, go) -> None:
    store = RoutingStore.attach(name)
    store.put(sample_id, sample(1)[0])
    done.value = 1
    while not go.value:
        time.sleep(0.01)


def test_writer_leases_run_out_with_a_clear_error_and_come_back(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=10_000, max_writers=2) as store:
        go = FORK.Value("i", 0, lock=False)
        writers = []
        for i in range(2):
            done = FORK.Value("i", 0, lock=False)
            p = FORK.Process(target=_put_and_wait, args=(name, f"w{i}", done, go))
            p.start()
            while not done.value:
                time.sleep(0.01)
            writers.append(p)
        with pytest.raises(StoreUnavailableError, match="all 2 writer leases are held"):
            store.put("mine", sample(2)[0])
        assert "mine" not in store and len(store) == 2
        go.value = 1
        for p in writers:
            p.join(10)
        store.put("mine", sample(2)[0])  # a dead writer's lease is taken over
        assert np.array_equal(store.get("mine"), sample(2)[0])
        assert np.array_equal(store.get("w0"), sample(1)[0])
        store.verify()


def test_the_digests_of_a_put_hash_a_shared_prompt_once_and_equal_each_samples_own(name):
    """A put's samples that share a prompt hash it once; each ref's digest is still
    blake2b-64 of that sample's own int32 token ids: prompts shared, one differing in its
    last prompt token, of other lengths, none, and whole-sample prompts."""
    import hashlib

    rng = np.random.default_rng(9)
    prompt = rng.integers(0, 1000, 40)
    cases = []  # (tokens, prompt_len)
    for j in range(3):
        cases.append((np.concatenate([prompt, rng.integers(0, 1000, 20 + j)]), 40))
    other = prompt.copy()
    other[-1] += 1
    cases += [
        (np.concatenate([other, rng.integers(0, 1000, 8)]), 40),
        (np.concatenate([prompt, rng.integers(0, 1000, 8)]), 40),
        (np.concatenate([prompt, rng.integers(0, 1000, 8)]), 24),
        (np.concatenate([prompt, rng.integers(0, 1000, 8)]), None),
        (prompt.copy(), 40),
        (prompt.copy(), 0),
    ]
    with RoutingStore.create(name, LAYOUT, 10_000, page_tokens=16) as store:
        refs = store.put_many(
            [
                PutRequest(f"s{i}", LAYOUT.random_routes(rng, len(t)), prompt_len=n, token_ids=t)
                for i, (t, n) in enumerate(cases)
            ]
        )
    want = [
        int.from_bytes(
            hashlib.blake2b(t.astype(np.int32).tobytes(), digest_size=8).digest(), "little"
        )
        | 1
        for t, _ in cases
    ]
    assert [r.tokens_digest for r in refs] == want
