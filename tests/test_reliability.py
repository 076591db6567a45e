"""Fault injection on real processes and real /dev/shm: nothing committed is lost, nothing
torn or misaligned is ever returned.

The CI sizes are the issue's; `ROUTING_REPLAY_SOAK=1` multiplies trials and samples by 10.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
import pytest
from store_stats import held

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import (
    ConcurrentReleaseError,
    InvalidArgumentError,
    LayoutMismatchError,
    SampleNotFoundError,
    StoreFullError,
    StoreUnavailableError,
)
from routing_replay.store import list_stores, sweep_stores
from routing_replay.store import sweep as sweep_module
from routing_replay.store.segment import segment_path

pytestmark = pytest.mark.stress

SOAK = 10 if os.environ.get("ROUTING_REPLAY_SOAK") else 1
LAYOUT = RoutingLayout(num_layers=5, top_k=2, num_experts=32, moe_layers=(1, 2, 4))
FORK = mp.get_context("fork")


def content(sample_id: str, max_len: int = 400) -> np.ndarray:
    """The routes a sample id always stands for: derived from the id, so any process checks."""
    rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
    T = int(rng.integers(1, max_len))
    routes = LAYOUT.random_routes(rng, T, np.int16)
    routes[-1] = -1
    return routes


def _kill(p) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.join()


# -- writers killed at random points of the put path ------------------------------------


def _put_forever(name: str, first: int, committed) -> None:
    store = RoutingStore.attach(name)
    prompt = np.arange(64)
    for i in range(first, first + 10**9):
        sid = f"w{i}"
        routes = content(sid)
        # Half the samples share a 64-token prompt prefix: the sharing path is killed too.
        if i % 2:
            routes[:64] = (7, 8)
            tokens = np.concatenate([prompt, np.full(max(len(routes) - 64, 0), i)])[: len(routes)]
            store.put(sid, routes, token_ids=tokens)
        else:
            store.put(sid, routes)
        committed.value = i
        if i % 20 == 19:
            store.release([f"w{j}" for j in range(max(first, i - 19), i + 1)])


def _expected(sid: str) -> np.ndarray:
    routes = content(sid)
    if int(sid[1:]) % 2:
        routes[:64] = (7, 8)
    return routes


def test_writers_killed_at_random_points(name):
    trials = 100 * SOAK
    rng = np.random.default_rng(1)
    with RoutingStore.create(name, LAYOUT, capacity_tokens=50_000, page_tokens=16) as store:
        first = 0
        for _ in range(trials):
            committed = FORK.Value("q", -1, lock=False)
            p = FORK.Process(target=_put_forever, args=(name, first, committed))
            p.start()
            while committed.value < 0 and p.is_alive():
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.03))
            _kill(p)
            last = committed.value
            assert last >= first, "the writer died before committing anything"
            block = (last + 1) // 20 * 20  # the writer's last release covered [block-20, block)
            present = {i for i in range(first, last + 2) if f"w{i}" in store}
            assert present >= set(range(max(block, first), last + 1))
            for i in present:
                assert np.array_equal(store.get(f"w{i}"), _expected(f"w{i}"))
            store.verify()
            store.release([f"w{i}" for i in present])
            first = last + 2 + 20  # fresh ids, never reused across trials
        store.reclaim()
        stats = store.stats()
        assert (stats.samples, stats.pages_used, stats.pages_pending) == (0, 0, 0)
        store.verify()


# -- readers killed mid-read --------------------------------------------------------------


def _read_forever(name: str, ids: list[str], started) -> None:
    store = RoutingStore.attach(name)
    while True:
        store.read(ids)
        started.value = 1


def test_readers_killed_mid_read(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=400_000) as store:
        ids = [f"r{i}" for i in range(400)]
        for sid in ids:
            store.put(sid, content(sid))
        before = store.stats()
        rng = np.random.default_rng(2)
        for _ in range(10 * SOAK):
            started = FORK.Value("i", 0, lock=False)
            p = FORK.Process(target=_read_forever, args=(name, ids, started))
            p.start()
            while not started.value:
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.02))
            _kill(p)
        assert held(store.stats()) == held(before)  # a reader changes nothing, even killed
        store.put("after", content("after"))  # and the lock was not left held
        batch = store.read(ids)
        assert batch.num_rows == 400
        for sid in ids[:50]:
            assert np.array_equal(store.get(sid), content(sid))
        store.verify()


# -- the owner killed while others are attached --------------------------------------------


def _own(name: str, ready) -> None:
    RoutingStore.create(name, LAYOUT, capacity_tokens=20_000)
    ready.set()
    time.sleep(600)


def test_owner_killed_while_attached(name):
    ready = FORK.Event()
    owner = FORK.Process(target=_own, args=(name, ready))
    owner.start()
    assert ready.wait(30)
    writer = RoutingStore.attach(name, LAYOUT)
    reader = RoutingStore.attach(name)
    for i in range(20):
        writer.put(f"o{i}", content(f"o{i}"))
    _kill(owner)
    # Attached processes keep working on their mapping.
    for i in range(20, 30):
        writer.put(f"o{i}", content(f"o{i}"))
    for i in range(30):
        assert np.array_equal(reader.get(f"o{i}"), content(f"o{i}"))
    info = {s.name: s for s in list_stores()}[name]
    assert not info.owner_alive and info.stats.samples == 30
    # The sweeper removes it (its owner is dead); mappings stay valid until closed.
    assert [s.name for s in sweep_stores(dry_run=True) if s.name == name] == [name]
    assert os.path.exists(segment_path(name))
    assert name in [s.name for s in sweep_stores()]
    assert not os.path.exists(segment_path(name))
    assert np.array_equal(reader.get("o29"), content("o29"))
    with pytest.raises(StoreUnavailableError, match="no routing store named"):
        RoutingStore.attach(name)
    writer.close()
    reader.close()


# -- 8 writers and 4 readers hammering one store -------------------------------------------


def _hammer_writer(name: str, w: int, n: int, progress) -> None:
    store = RoutingStore.attach(name)
    for i in range(n):
        sid = f"h{w}-{i}"
        store.put(sid, content(sid, 200))
        progress[w] = i + 1
        if i >= 200 and i % 50 == 0:  # release old ones: readers race with reuse
            store.release([f"h{w}-{j}" for j in range(i - 200, i - 150)])


def _hammer_reader(name: str, writers: int, progress, stop, result) -> None:
    store = RoutingStore.attach(name)
    rng = np.random.default_rng(os.getpid())
    checked = raced = 0
    wrong = []
    while not stop.value or checked < 250:  # every reader checks 250 samples at least
        ids = []
        for w in rng.integers(0, writers, 4).tolist():
            if progress[w]:  # among a writer's last 220 puts: most are there, some released
                done = progress[w]
                ids.append(f"h{w}-{int(rng.integers(max(0, done - 220), done))}")
        ids = list(dict.fromkeys(ids))
        if not ids:
            continue
        try:
            batch = store.read(ids)
        except (SampleNotFoundError, ConcurrentReleaseError):
            raced += 1  # released before or while we read: an error, never wrong data
            continue
        offsets = batch.column("routed_experts").offsets.to_numpy()
        values = batch.column("routed_experts").flatten().flatten().to_numpy()
        values = values.view(np.int8).reshape(-1, 3, 2)
        for j, sid in enumerate(batch.column("sample_id").to_pylist()):
            if not np.array_equal(values[offsets[j] : offsets[j + 1]], content(sid, 200)):
                wrong.append(sid)
            checked += 1
    result.put((checked, raced, wrong))


def test_eight_writers_four_readers(name):
    writers, per_writer = 8, 2500 * SOAK  # 20,000 samples in CI
    with RoutingStore.create(name, LAYOUT, capacity_tokens=600_000, page_tokens=32) as store:
        progress = FORK.Array("q", writers, lock=False)
        stop = FORK.Value("i", 0, lock=False)
        result = FORK.Queue()
        ws = [
            FORK.Process(target=_hammer_writer, args=(name, w, per_writer, progress))
            for w in range(writers)
        ]
        rs = [
            FORK.Process(target=_hammer_reader, args=(name, writers, progress, stop, result))
            for _ in range(4)
        ]
        for p in ws + rs:
            p.start()
        for p in ws:
            p.join(600)
            assert p.exitcode == 0
        stop.value = 1
        outcomes = [result.get(timeout=60) for _ in rs]
        for p in rs:
            p.join(60)
        assert all(wrong == [] for _, _, wrong in outcomes)
        assert sum(checked for checked, _, _ in outcomes) > 1000
        # End to end: exactly the samples the writers did not release are there, each
        # with the checksum of what was put.
        released_upto = max(i for i in range(200, per_writer) if i % 50 == 0) - 150
        for w in range(writers):
            for i in range(per_writer):
                sid = f"h{w}-{i}"
                assert (sid in store) == (i >= released_upto), sid
                if i >= released_upto:
                    expected = content(sid, 200).astype(np.int8)
                    assert zlib.crc32(store.get(sid).tobytes()) == zlib.crc32(expected.tobytes())
        assert len(store) == writers * (per_writer - released_upto)
        store.verify()


# -- a full store ----------------------------------------------------------------------------


def _blocked_writer(name: str, w: int, timeout: float, result) -> None:
    store = RoutingStore.attach(name)
    try:
        for i in range(5):
            store.put(
                f"b{w}-{i}",
                np.broadcast_to([w, w + 1], (64, 3, 2)).astype(np.int64),
                timeout=timeout,
            )
        result.put((w, "ok", ""))
    except StoreFullError as e:
        result.put((w, "full", str(e)))


def test_full_store_writers_resume_or_time_out(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=256, page_tokens=64) as store:
        for i in range(4):
            store.put(f"fill{i}", np.broadcast_to([0, 1], (64, 3, 2)).astype(np.int64))
        result = FORK.Queue()
        ws = [FORK.Process(target=_blocked_writer, args=(name, w, 20, result)) for w in range(3)]
        for p in ws:
            p.start()
        time.sleep(0.3)
        assert store.stats().samples == 4  # everyone is blocked
        store.release([f"fill{i}" for i in range(4)])
        # Consume as they come: 15 puts through 4 pages, no deadlock.
        done, seen = set(), set()
        deadline = time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            for w in range(3):
                for i in range(5):
                    sid = f"b{w}-{i}"
                    if sid not in seen and sid in store:
                        assert np.array_equal(
                            store.get(sid), np.broadcast_to([w, w + 1], (64, 3, 2))
                        )
                        store.release([sid])
                        seen.add(sid)
            while not result.empty():
                w, outcome, _ = result.get()
                assert outcome == "ok"
                done.add(w)
            time.sleep(0.01)
        assert done == {0, 1, 2} and len(seen) == 15
        for p in ws:
            p.join(10)
        # Nobody releases: every blocked writer times out with the capacity in the error.
        for i in range(4):
            store.put(f"fill{i}", np.broadcast_to([0, 1], (64, 3, 2)).astype(np.int64))
        ws = [FORK.Process(target=_blocked_writer, args=(name, w, 0.5, result)) for w in range(3)]
        t0 = time.monotonic()
        for p in ws:
            p.start()
        outcomes = [result.get(timeout=30) for _ in ws]
        assert time.monotonic() - t0 < 20
        for _, outcome, message in outcomes:
            assert outcome == "full" and "256 tokens" in message and "capacity_tokens" in message
        for i in range(4):
            assert np.array_equal(store.get(f"fill{i}"), np.broadcast_to([0, 1], (64, 3, 2)))
        store.verify()


# -- /dev/shm too small ------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_small_tmpfs_fails_before_anything_is_made():
    mount = tempfile.mkdtemp()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mount]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        code = (
            "from routing_replay import RoutingStore, RoutingLayout\n"
            "layout = RoutingLayout(48, 8, 128)\n"
            "try:\n"
            "    RoutingStore.create('too-big', layout, capacity_tokens=10_000)\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
            "with RoutingStore.create('fits', layout, capacity_tokens=1000) as s:\n"
            "    print('fits', s.capacity_tokens)\n"
        )
        env = {**os.environ, "ROUTING_REPLAY_SHM_DIR": mount}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        first, second = out.stdout.splitlines()
        assert first.startswith("StoreUnavailableError") and "MiB free but store" in first
        assert "--shm-size" in first
        assert second == "fits 1024"
        assert os.listdir(mount) == []  # nothing half-made, and 'fits' was unlinked
    finally:
        subprocess.run(["umount", mount], check=False)
        os.rmdir(mount)


# -- ids, references, layouts --------------------------------------------------------------


def test_ids_refs_and_layouts(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=2000, page_tokens=16) as store:
        a, b = content("a"), content("b")
        ref = store.put("x", a)
        store.release([ref])
        with pytest.raises(SampleNotFoundError, match="already released"):
            store.get(ref)
        with pytest.raises(SampleNotFoundError):
            store.release([ref])
        store.put("x", b)  # the id is free again, with new content
        assert np.array_equal(store.get("x"), b)
        with pytest.raises(SampleNotFoundError, match="never put"):
            store.read(["never"])
        for bad in ("a/b", "..\\x", "", "x" * 129, "tab\there"):
            with pytest.raises(InvalidArgumentError, match="sample_id"):
                store.put(bad, a)
        with pytest.raises(LayoutMismatchError):
            RoutingStore.attach(name, RoutingLayout(5, 2, 32, (1, 2, 3)))
        assert np.array_equal(store.get("x"), b)
        store.verify()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another user")
def test_other_user_cannot_open(name):
    with RoutingStore.create(name, LAYOUT, capacity_tokens=100):
        assert os.stat(segment_path(name)).st_mode & 0o777 == 0o600

        def as_nobody(result) -> None:
            os.setgid(65534)
            os.setuid(65534)
            try:
                RoutingStore.attach(name)
                result.put("opened")
            except StoreUnavailableError as e:
                result.put(str(e))

        result = FORK.Queue()
        p = FORK.Process(target=as_nobody, args=(result,))
        p.start()
        message = result.get(timeout=30)
        p.join()
        assert message == (
            f"store {name!r} ({segment_path(name)}) belongs to another user, root (uid 0): "
            "stores are owner-only; attach as the user that created it"
        )


# -- stale segments -------------------------------------------------------------------------


def test_sweep_never_touches_a_live_store_and_cli(name):
    dead = name + "-dead"
    code = (
        "from routing_replay import RoutingStore, RoutingLayout\n"
        f"RoutingStore.create({dead!r}, RoutingLayout(4, 2, 8), capacity_tokens=100)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # exits, no unlink
    with RoutingStore.create(name, LAYOUT, capacity_tokens=100) as live:
        live.put("s", content("s"))
        out = subprocess.run(
            [sys.executable, "-m", "routing_replay.cli", "ls"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert f"{dead} " in out and "(dead)" in out and name in out
        out = subprocess.run(
            [sys.executable, "-m", "routing_replay.cli", "sweep", "--dry-run"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert f"would remove {segment_path(dead)} " in out and f"{segment_path(name)} " not in out
        assert os.path.exists(segment_path(dead))
        subprocess.run(
            [sys.executable, "-m", "routing_replay.cli", "sweep"],
            check=True,
            timeout=60,
            capture_output=True,
        )
        assert not os.path.exists(segment_path(dead))
        assert os.path.exists(segment_path(name))
        assert np.array_equal(live.get("s"), content("s"))


def test_sweep_removes_only_the_file_it_judged(name, monkeypatch):
    # A dead store is judged stale; before sweep unlinks it, its name is swept by someone
    # else and created again by a live owner: the new store must stay.
    code = (
        "from routing_replay import RoutingStore, RoutingLayout\n"
        f"RoutingStore.create({name!r}, RoutingLayout(4, 2, 8), capacity_tokens=100)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # exits, no unlink
    real_list = sweep_module.list_stores
    created = []

    def judged_then_recreated(prefix: str = "") -> list:
        infos = real_list(prefix)
        assert [i.name for i in infos if i.name == name and not i.owner_alive] == [name]
        os.unlink(segment_path(name))
        created.append(RoutingStore.create(name, LAYOUT, capacity_tokens=100))
        created[0].put("s", content("s"))
        return infos

    monkeypatch.setattr(sweep_module, "list_stores", judged_then_recreated)
    try:
        assert name not in [s.name for s in sweep_stores(prefix=name)]
        assert os.path.exists(segment_path(name)) and created[0].is_current()
        with RoutingStore.attach(name) as again:
            assert np.array_equal(again.get("s"), content("s"))
    finally:
        created[0].close()
        created[0].unlink()
