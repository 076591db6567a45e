"""Spill to disk: a full store moves samples to files and every read stays exact.

Expected values are the arrays the tests put, never a read of the store; each spilled
sample is found by its file name (its put serial), so the tests see which went where.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from routing_replay import Episode, PutRequest, RoutingLayout, RoutingStore, to_torch
from routing_replay.errors import CorruptStoreError, StoreFullError
from routing_replay.store import spill as spill_module
from routing_replay.store.lock import interleave

FORK = mp.get_context("fork")
LAYOUTS = [
    RoutingLayout(num_layers=3, top_k=2, num_experts=16),  # uint8 stored
    RoutingLayout(num_layers=4, top_k=3, num_experts=300, moe_layers=(1, 3)),  # uint16
]
P = 8
C = LAYOUTS[0].random_routes(np.random.default_rng(9), 4 * P)


def spilled_serials(store: RoutingStore) -> set[int]:
    """Put serials of the samples in spill files (from the files' names)."""
    return {int(n[:16], 16) for n in os.listdir(store.spill_dir) if n.endswith(".spill")}


def make(name, tmp_path, layout=LAYOUTS[0], pages=16, budget=10**7, **kw) -> RoutingStore:
    return RoutingStore.create(
        name, layout, pages * P, page_tokens=P, spill_dir=tmp_path, spill_budget=budget, **kw
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=["uint8", "uint16"])
def test_round_trip_exact(name, tmp_path, layout):
    rng = np.random.default_rng(0)
    with make(name, tmp_path, layout, pages=24, put_timeout=0.5) as store:
        expected, tokens, refs = {}, {}, []
        for step in range(6):
            # A GRPO group: 4 samples of one 2-page prompt (shared pages), put at once.
            prompt = rng.integers(0, 1000, 2 * P)
            prompt_routes = layout.random_routes(rng, 2 * P)
            requests = []
            for j in range(4):
                T = 2 * P + int(rng.integers(1, 3 * P))
                r = np.concatenate([prompt_routes, layout.random_routes(rng, T - 2 * P)])
                r[-1] = -1  # a missing row stays missing
                t = np.concatenate([prompt, rng.integers(0, 1000, T - 2 * P)])
                sid = f"g{step}-{j}"
                requests.append(
                    PutRequest(sid, r, 2 * P, t, policy_version=[(0, step), (T - 1, step + 1)])
                )
                expected[sid], tokens[sid] = r, t
            refs += store.put_many(requests)
        # A 3-turn episode, put turn by turn.
        ep = Episode(store, "ep", prompt_len=P)
        ep_tokens = rng.integers(0, 1000, 5 * P)
        ep_routes = layout.random_routes(rng, 5 * P)
        for end in (2 * P, 3 * P + 3, 5 * P):
            ep.add_turn(ep_tokens[:end], ep_routes[:end], policy_version=end)
        refs.append(ep.close())
        expected["ep-t3"], tokens["ep-t3"] = ep_routes, ep_tokens
        spilled = spilled_serials(store)
        assert spilled and len(spilled) < len(refs)  # both kinds are read below
        store.verify()
        # Every sample, alone and together, in memory or spilled: exact routes and tokens.
        for ref in refs:
            assert np.array_equal(store.get(ref), expected[ref.sample_id]), ref
        batch = store.read(refs)
        assert np.array_equal(
            to_torch(batch).numpy(), np.concatenate([expected[r.sample_id] for r in refs])
        )
        for row, ref in zip(batch.column("token_ids").to_pylist(), refs, strict=True):
            assert row == tokens[ref.sample_id].tolist()
        assert batch.column("prompt_len").to_pylist() == [r.prompt_len for r in refs]
        assert refs[0].policy_versions == ((0, 0), (len(expected["g0-0"]) - 1, 1))
        # Ranges (a context-parallel rank's two chunks) and the wire form, on both kinds.
        ranges = [
            [(1, 3), (len(expected[r.sample_id]) - 4, len(expected[r.sample_id]))] for r in refs
        ]
        want = np.concatenate(
            [np.concatenate([expected[r.sample_id][1:3], expected[r.sample_id][-4:]]) for r in refs]
        )
        assert np.array_equal(to_torch(store.read(refs, ranges=ranges)).numpy(), want)
        wire = store.read_wire(refs, part="completion")
        want = np.concatenate([expected[r.sample_id][r.prompt_len :] for r in refs])
        assert np.array_equal(to_torch(wire.batch()).numpy(), want)
        # Releases remove the files of spilled samples; the store is empty after.
        store.release(refs)
        assert [f for f in os.listdir(store.spill_dir) if f.endswith(".spill")] == []
        stats = store.stats()
        assert (stats.samples, stats.samples_spilled, stats.spilled_bytes, stats.pages_used) == (
            0,
            0,
            0,
            0,
        )
        store.verify()
        spill_dir = store.spill_dir
    assert not os.path.exists(spill_dir)  # the owner's unlink removes the directory


def test_unread_oldest_first(name, tmp_path):
    rng = np.random.default_rng(1)
    with make(name, tmp_path, pages=8) as store:
        refs = {f"s{i}": store.put(f"s{i}", LAYOUTS[0].random_routes(rng, 2 * P)) for i in range(4)}
        store.get(refs["s2"])  # read: spilled after every unread sample
        store.get(refs["s0"])
        order = []

        def put(sid: str) -> None:  # each 2-page put needs one sample's pages
            refs[sid] = store.put(sid, LAYOUTS[0].random_routes(rng, 2 * P))
            by_serial = {r.serial: i for i, r in refs.items()}
            order.append(sorted(by_serial[s] for s in spilled_serials(store)))

        put("n0")
        put("n1")
        put("n2")  # unread n0 goes before the read s0 and s2
        store.read([refs["n1"], refs["n2"]])  # now every sample in memory was read
        put("n3")  # the oldest read one goes: s0, put before s2
        put("n4")  # unread n3 first
        assert order == [
            ["s1"],
            ["s1", "s3"],
            ["n0", "s1", "s3"],
            ["n0", "s0", "s1", "s3"],
            ["n0", "n3", "s0", "s1", "s3"],
        ]


def test_both_full_refuses_and_loses_nothing(name, tmp_path):
    rng = np.random.default_rng(2)
    layout = LAYOUTS[0]
    one_file = spill_module.file_bytes(layout, P, 4 * P, 0)
    with make(name, tmp_path, pages=8, budget=2 * one_file, put_timeout=0.2) as store:
        kept = {f"s{i}": layout.random_routes(rng, 4 * P) for i in range(4)}
        for sid, r in kept.items():
            store.put(sid, r)  # the last two spill the first two: the budget is spent
        assert store.stats().spilled_bytes == 2 * one_file
        with pytest.raises(StoreFullError, match=r"spill files \(2 samples\) take .* budget"):
            store.put_many(
                [
                    PutRequest("x", layout.random_routes(rng, P)),
                    PutRequest("y", layout.random_routes(rng, P)),
                ]
            )
        assert "x" not in store and "y" not in store
        for sid, r in kept.items():
            assert np.array_equal(store.get(sid), r)
        store.verify()


@pytest.mark.slow  # seconds of slowed writes
@pytest.mark.parametrize("timeout", [0.0, 0.3])
def test_a_put_that_spills_keeps_its_timeout(name, tmp_path, monkeypatch, timeout):
    """A put spills within its timeout: at least one sample whatever the timeout, and none
    once it has passed; then StoreFullError saying so, every earlier sample exact, spilled
    or not. Before: after each spill the put tried again without looking at its deadline,
    so on a slow disk a put with timeout=0 spilled every victim it needed (~2 s here)."""
    layout = LAYOUTS[0]
    rng = np.random.default_rng(6)
    with make(name, tmp_path, pages=80) as store:
        kept = {f"s{i}": layout.random_routes(rng, P) for i in range(80)}  # one page each
        for sid, r in kept.items():
            store.put(sid, r)
        real_write = spill_module._write_all

        def slow_write(fd, data):  # a slow disk: 50 ms a write, one write a one-page file
            time.sleep(0.05)
            real_write(fd, data)

        monkeypatch.setattr(spill_module, "_write_all", slow_write)
        big = layout.random_routes(rng, 40 * P)  # needs 40 victims: 2 s of writes
        start = time.monotonic()
        with pytest.raises(StoreFullError, match=r"spilling to .* was still making room"):
            store.put("big", big, timeout=timeout)
        elapsed = time.monotonic() - start
        assert elapsed < timeout + 1.0, f"a put with timeout={timeout} took {elapsed:.2f}s"
        stats = store.stats()
        assert 1 <= stats.samples_spilled < 40, stats
        assert len(spilled_serials(store)) == stats.samples_spilled
        assert "big" not in store and len(store) == 80
        for sid, r in kept.items():  # spilled or in memory: exact
            assert np.array_equal(store.get(sid), r), sid
        store.verify()
        monkeypatch.setattr(spill_module, "_write_all", real_write)
        store.put("big", big)  # the default timeout: spills what it needs, and fills the store
        spilled = store.stats().samples_spilled
        one = layout.random_routes(rng, P)
        store.put("one", one, timeout=0)  # one victim makes room: at any timeout
        assert store.stats().samples_spilled == spilled + 1
        for sid, r in {**kept, "one": one, "big": big}.items():
            assert np.array_equal(store.get(sid), r), sid
        store.verify()


@pytest.mark.slow  # seconds of slowed writes
def test_a_put_waiting_for_another_threads_spill_says_so(name, tmp_path, monkeypatch):
    """Two threads of one handle: one spills slowly; the other's put, which finds the store
    full and waits past its 1 s lock wait for that spill, fails saying so (before: "too full
    for more" with most of the budget free). Nothing lost; the slow put completes."""
    layout = LAYOUTS[0]
    rng = np.random.default_rng(8)
    with make(name, tmp_path, pages=80) as store:
        kept = {f"s{i}": layout.random_routes(rng, P) for i in range(80)}
        for sid, r in kept.items():
            store.put(sid, r)
        real_write = spill_module._write_all
        writing = threading.Event()

        def slow_write(fd, data):  # 50 ms a one-page file: 40 victims take 2 s
            writing.set()
            time.sleep(0.05)
            real_write(fd, data)

        monkeypatch.setattr(spill_module, "_write_all", slow_write)
        big = layout.random_routes(rng, 40 * P)
        slow = threading.Thread(target=store.put, args=("big", big))
        slow.start()
        assert writing.wait(10)
        with pytest.raises(StoreFullError, match="another thread of this process was still"):
            store.put("other", layout.random_routes(rng, P), timeout=0.05)
        slow.join()
        assert "other" not in store and np.array_equal(store.get("big"), big)
        for sid, r in kept.items():
            assert np.array_equal(store.get(sid), r), sid
        store.verify()


def test_spill_files_are_readable_whatever_the_writers_umask(name, tmp_path):
    """A writer whose umask drops the owner's write bit still writes its spill files 0600
    (before: 0400, which every read then refused as damaged, the sample lost)."""
    rng = np.random.default_rng(9)
    a = LAYOUTS[0].random_routes(rng, 3 * P)
    old = os.umask(0o222)
    try:
        with make(name, tmp_path, pages=4) as store:
            store.put("a", a)
            store.put("b", LAYOUTS[0].random_routes(rng, 4 * P))  # "a" spills
            assert store.stats().samples_spilled == 1
            assert np.array_equal(store.get("a"), a)
            store.verify()
    finally:
        os.umask(old)


@pytest.mark.slow  # seconds of slowed writes
def test_a_put_renews_its_lock_wait_after_a_spill(name, tmp_path, monkeypatch):
    """A put with timeout=0 that spills for over a second, then meets the lock held (another
    handle's call), waits for it as any put does, at least 1 s, and stores its sample
    (before: its lock wait had run out during the spill: StoreBusyError)."""
    rng = np.random.default_rng(10)
    with make(name, tmp_path, pages=4) as store, RoutingStore.attach(name) as other:
        store.put("a", LAYOUTS[0].random_routes(rng, 4 * P))
        real_write = spill_module._write_all

        def slow_write(fd, data):  # a slow disk: 1.1 s for the one victim
            time.sleep(1.1)
            real_write(fd, data)

        held = threading.Event()

        def hold_lock():  # another handle's call, holding the lock just after the spill
            with other._core.lock.held("test", time.monotonic() + 5):
                held.set()
                time.sleep(0.3)

        real_make_room = store._core.spill.make_room

        def make_room(*args):
            made = real_make_room(*args)
            threading.Thread(target=hold_lock).start()
            assert held.wait(5)
            return made

        monkeypatch.setattr(spill_module, "_write_all", slow_write)
        monkeypatch.setattr(store._core.spill, "make_room", make_room)
        b = LAYOUTS[0].random_routes(rng, 2 * P)
        store.put("b", b, timeout=0)
        assert np.array_equal(store.get("b"), b) and store.stats().samples_spilled == 1
        store.verify()


def test_verify_keeps_a_file_a_clean_kept_for_a_spill_whose_sample_was_released(
    name, tmp_path, monkeypatch
):
    """A clean (another handle's reclaim) while a spill writes its victim's file keeps the
    file and the mark to clean; the victim is then released: verify() passes, and so it does
    after the spill ends (before: the clean cleared the mark, and verify called the store
    corrupt, "spill files no sample needs")."""
    rng = np.random.default_rng(11)
    with make(name, tmp_path, pages=4) as store, RoutingStore.attach(name) as other:
        a, b = (LAYOUTS[0].random_routes(rng, 2 * P) for _ in range(2))
        store.put("a", a)
        store.put("b", b)
        real_write = spill_module._write_all
        writing, go = threading.Event(), threading.Event()

        def paused_write(fd, data):
            writing.set()
            assert go.wait(10)
            real_write(fd, data)

        monkeypatch.setattr(spill_module, "_write_all", paused_write)
        c = LAYOUTS[0].random_routes(rng, 2 * P)
        putting = threading.Thread(target=store.put, args=("c", c))
        putting.start()
        assert writing.wait(10)  # "a", the oldest, is being written to its file
        other.reclaim()  # a clean: keeps the file of the spill in progress
        other.release(["a"])
        other.verify()
        go.set()
        putting.join()
        other.reclaim()
        other.verify()
        assert "a" not in other and np.array_equal(other.get("b"), b)
        assert np.array_equal(other.get("c"), c)


def test_verify_keeps_a_file_made_after_a_clean_listed_the_directory(name, tmp_path, monkeypatch):
    """A writer picks its victim; a clean (another handle's reclaim) lists the directory
    before the victim's file exists and clears the mark to clean; the victim is released;
    the writer then creates and writes the file. verify() passes while it is there (before:
    "spill files no sample needs, and none marked to clean": a healthy store called
    corrupt), and after the writer removes it."""
    rng = np.random.default_rng(13)
    with make(name, tmp_path, pages=4) as store, RoutingStore.attach(name) as other:
        rows = {s: LAYOUTS[0].random_routes(rng, 2 * P) for s in "abcd"}
        for s in "abc":
            store.put(s, rows[s])  # "a" spills: the directory holds a file
        real_check, real_write = spill_module.check_dir, spill_module._write_all
        picked, created, go = threading.Event(), threading.Event(), threading.Event()

        def check_dir(path):  # the victim "b" picked, its file not made yet
            picked.set()
            assert go.wait(10)
            go.clear()
            real_check(path)

        def write_all(fd, data):  # the file made, being written
            created.set()
            assert go.wait(10)
            real_write(fd, data)

        monkeypatch.setattr(spill_module, "check_dir", check_dir)
        monkeypatch.setattr(spill_module, "_write_all", write_all)
        putting = threading.Thread(target=store.put, args=("d", rows["d"]))
        putting.start()
        assert picked.wait(10)
        other.reclaim()  # lists "a"'s file only
        other.release(["b"])
        go.set()
        assert created.wait(10)
        other.verify()  # b's file is there, its sample gone, its writer alive
        go.set()
        putting.join()
        other.reclaim()
        other.verify()
        for s in "acd":
            assert np.array_equal(other.get(s), rows[s]), s


def test_a_fifo_in_a_spill_files_place_is_refused_not_waited_on(name, tmp_path):
    """A FIFO where a spilled sample's file was: the read raises CorruptStoreError at once
    and verify() says so (before: the read blocked forever in open)."""
    rng = np.random.default_rng(12)
    with make(name, tmp_path, pages=4) as store:
        store.put("a", LAYOUTS[0].random_routes(rng, 3 * P))
        store.put("b", LAYOUTS[0].random_routes(rng, 4 * P))  # "a" spills
        (file,) = [f for f in os.listdir(store.spill_dir) if f.endswith(".spill")]
        path = os.path.join(store.spill_dir, file)
        os.unlink(path)
        os.mkfifo(path, 0o600)
        with pytest.raises(CorruptStoreError, match="not a regular file"):
            store.get("a")
        with pytest.raises(CorruptStoreError, match="not a regular file of this user"):
            store.verify()
        os.unlink(path)
        store.release(["a"])
        store.verify()


def test_damaged_files_raise(name, tmp_path):
    rng = np.random.default_rng(3)
    with make(name, tmp_path, pages=4) as store:
        a = LAYOUTS[0].random_routes(rng, 3 * P)
        ref = store.put("a", a, token_ids=np.arange(3 * P))
        store.put("b", LAYOUTS[0].random_routes(rng, 4 * P))  # a goes to disk
        (file,) = [f for f in os.listdir(store.spill_dir) if f.endswith(".spill")]
        path = os.path.join(store.spill_dir, file)
        data = bytearray(Path(path).read_bytes())
        data[-1] ^= 1  # the last route byte: the last chunk's CRC fails, the first's not
        Path(path).write_bytes(data)
        assert np.array_equal(to_torch(store.read([ref], ranges=[(0, P)])).numpy(), a[:P])
        with pytest.raises(CorruptStoreError, match="rows 16-24 fail their CRC"):
            store.get(ref)
        Path(path).write_bytes(data[:-1])
        with pytest.raises(CorruptStoreError, match=r"bytes, \d+ expected"):
            store.get(ref)
        os.unlink(path)
        reads = store.stats().reads
        with pytest.raises(CorruptStoreError, match="is missing"):
            store.get(ref)
        assert store.stats().reads == reads  # a failed read is not counted (before: it was)


def _read_while_truncated(name: str, path: str, stop: int, want: np.ndarray) -> None:
    """Read sample "a", truncating its spill file at line event `stop` of SpillFile's
    constructor; exit 0 if the read was exact, 1 if CorruptStoreError, 2 otherwise."""
    store = RoutingStore.attach(name)
    seen = 0

    def tracer(frame, event, arg):
        nonlocal seen
        if frame.f_code is not spill_module.SpillFile.__init__.__code__:
            return None
        if event == "line":
            seen += 1
            if seen == stop:
                os.truncate(path, 4096)  # the header's page stays
        return tracer

    sys.settrace(tracer)
    try:
        got = store.get("a")
    except CorruptStoreError:
        os._exit(1)
    finally:
        sys.settrace(None)
    os._exit(0 if np.array_equal(got, want) else 2)


def test_a_spill_file_truncated_at_each_line_of_a_read_raises_or_reads_exact(name, tmp_path):
    """Before: the file was mapped, and a truncation (or a failing disk) under the mapping
    killed the reader with SIGBUS."""
    rng = np.random.default_rng(4)
    with make(name, tmp_path, pages=800) as store:
        a = LAYOUTS[0].random_routes(rng, 3000)  # a file of several pages
        store.put("a", a, token_ids=np.arange(3000))
        store.put("b", LAYOUTS[0].random_routes(rng, 4000))  # a goes to disk
        (file,) = [f for f in os.listdir(store.spill_dir) if f.endswith(".spill")]
        path = os.path.join(store.spill_dir, file)
        whole = Path(path).read_bytes()
        outcomes = []
        for stop in range(1, 40, 3):  # (the constructor runs ~25 lines)
            child = FORK.Process(target=_read_while_truncated, args=(name, path, stop, a))
            child.start()
            child.join(60)
            outcomes.append(child.exitcode)
            Path(path).write_bytes(whole)
        assert set(outcomes) == {0, 1}, outcomes  # never a signal (-7: SIGBUS)
        assert outcomes.index(0) > outcomes.index(1)  # cut before the copy: corrupt
        np.testing.assert_array_equal(store.get("a"), a)
        store.verify()


# -- a spiller killed at every step --------------------------------------------------------


def _spill_and_die(name: str, where: str) -> None:
    """Put a sample that needs a spill; SIGKILL this process at `where` in the spill."""
    store = RoutingStore.attach(name)

    def die(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "mid-write":
        real_write = spill_module._write_all
        spill_module._write_all = lambda fd, data: (real_write(fd, data[: len(data) // 2]), die())
    elif where == "commit-field":  # inside the commit holding: its commit point only
        spill_module.mark_spilled = lambda t, slot, code: (t.s_spill.__setitem__(slot, code), die())
    elif where == "commit-checksum":  # the checksum too, not the chain fields
        real_mark = spill_module.mark_spilled

        def mark_then_die(t, slot, code):
            chain_fields = int(t.s_num_pages[slot]), int(t.s_last_page[slot])
            real_mark(t, slot, code)
            t.s_num_pages[slot], t.s_last_page[slot] = chain_fields
            die()

        spill_module.mark_spilled = mark_then_die
    with interleave(lambda point: point == where and die()):
        store.put("c", C)
    os._exit(3)  # not reached


@pytest.mark.parametrize(
    "where",
    ["spill.pick:drop", "mid-write", "spill.commit:take", "commit-field", "commit-checksum"],
)
def test_spiller_killed_mid_spill(name, tmp_path, where):
    rng = np.random.default_rng(4)
    with make(name, tmp_path, pages=8) as store:
        a, b = (LAYOUTS[0].random_routes(rng, 4 * P) for _ in range(2))
        ref_a = store.put("a", a, token_ids=np.arange(4 * P))
        store.put("b", b)
        p = FORK.Process(target=_spill_and_die, args=(name, where))
        p.start()
        p.join()
        assert p.exitcode == -signal.SIGKILL
        committed = where.startswith("commit")
        written = committed or where in ("mid-write", "spill.commit:take")  # a's file is there
        assert spilled_serials(store) == ({ref_a.serial} if written else set())
        # The next holder repairs a cut-short commit; every sample reads back exactly.
        assert np.array_equal(store.get(ref_a), a) and np.array_equal(store.get("b"), b)
        assert "c" not in store
        store.reclaim()  # the dead spiller's uncommitted file goes
        assert spilled_serials(store) == ({ref_a.serial} if committed else set())
        stats = store.stats()
        assert (stats.samples_spilled, stats.pages_used, stats.pages_pending) == (
            int(committed),
            4 if committed else 8,
            0,
        )
        store.verify()
        store.put("c", C)  # room again, by spilling
        for sid, r in (("a", a), ("b", b), ("c", C)):
            assert np.array_equal(store.get(sid), r)
        store.verify()


# -- writers producing 3x the store, slow trainers reading every sample ---------------------


def content(sample_id: str) -> tuple[np.ndarray, np.ndarray]:
    """The routes and token ids a sample id always stands for (any process checks them)."""
    rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
    T = int(rng.integers(P, 12 * P))
    group = sample_id.rsplit("-", 1)[0]  # samples of a group share a 2-page prompt
    g = np.random.default_rng(zlib.crc32(group.encode()))
    routes = LAYOUTS[0].random_routes(rng, T + 2 * P)
    routes[: 2 * P] = LAYOUTS[0].random_routes(g, 2 * P)
    tokens = np.concatenate([g.integers(0, 1000, 2 * P), rng.integers(0, 1000, T)])
    return routes, tokens


def _writer(name: str, w: int, groups: int, queue, spilled) -> None:
    store = RoutingStore.attach(name, put_timeout=5.0)
    for g in range(groups):
        ids = [f"w{w}g{g}-{j}" for j in range(4)]
        requests = [PutRequest(i, *(c := content(i))[:1], token_ids=c[1]) for i in ids]
        store.put_many(requests)
        spilled.value = max(spilled.value, store.stats().samples_spilled)
        for i in ids:
            queue.put(i)
    queue.put(None)  # one per trainer: each stops after two
    queue.put(None)


def _trainer(name: str, queue, done, bad) -> None:
    store = RoutingStore.attach(name)
    writers_left = 2
    while writers_left:
        ids = []
        while len(ids) < 4 and writers_left:
            i = queue.get()
            if i is None:
                writers_left -= 1
            else:
                ids.append(i)
        if not ids:
            break
        batch = store.read(ids)
        rows = to_torch(batch).numpy()
        want = np.concatenate([content(i)[0] for i in ids])
        tokens = batch.column("token_ids").to_pylist()
        if not np.array_equal(rows, want) or tokens != [content(i)[1].tolist() for i in ids]:
            bad.value += 1
        store.release(ids)
        done.value += len(ids)
        time.sleep(0.02)  # a slow trainer: the writers run ahead, the store spills


@pytest.mark.stress
def test_rollout_of_three_stores_with_slow_trainers(name, tmp_path):
    groups = 25  # 2 writers x 25 groups x 4 samples of ~9 pages: >3x the store's 128 pages
    with make(name, tmp_path, pages=128, budget=1 << 26) as store:
        queue, done, bad = FORK.Queue(), FORK.Value("q", 0), FORK.Value("q", 0)
        pages_put = sum(
            -(-len(content(f"w{w}g{g}-{j}")[1]) // P)
            for w in range(2)
            for g in range(groups)
            for j in range(4)
        )
        assert pages_put > 3 * 128
        spilled = [FORK.Value("q", 0) for _ in range(2)]
        writers = [
            FORK.Process(target=_writer, args=(name, w, groups, queue, spilled[w]))
            for w in range(2)
        ]
        trainers = [FORK.Process(target=_trainer, args=(name, queue, done, bad)) for _ in range(2)]
        for p in [*writers, *trainers]:
            p.start()
        for p in [*writers, *trainers]:
            p.join(120)
            assert p.exitcode == 0, p
        assert (done.value, bad.value) == (2 * groups * 4, 0)
        assert max(s.value for s in spilled) > 20, [s.value for s in spilled]  # it did spill
        stats = store.stats()
        assert (stats.samples, stats.samples_spilled, stats.pages_used) == (0, 0, 0)
        assert [f for f in os.listdir(store.spill_dir) if f.endswith(".spill")] == []
        store.verify()


def test_spilled_samples_with_and_without_token_ids_read_together(name, tmp_path):
    # Token ids are optional per sample: a read (and its wire form) mixing spilled samples
    # with and without them, and one in memory, gets every row and every token id right.
    rng = np.random.default_rng(5)
    with make(name, tmp_path, pages=8) as store:
        bare = LAYOUTS[0].random_routes(rng, 2 * P)
        with_ids = LAYOUTS[0].random_routes(rng, 2 * P)
        ids = rng.integers(0, 1000, 2 * P)
        refs = [store.put("bare", bare), store.put("ids", with_ids, token_ids=ids)]
        refs.append(store.put("new", last := LAYOUTS[0].random_routes(rng, 8 * P)))
        assert spilled_serials(store) == {refs[0].serial, refs[1].serial}
        for batch in (store.read(refs), store.read_wire(refs).batch()):
            want = np.concatenate([bare, with_ids, last])
            assert np.array_equal(to_torch(batch).numpy(), want)
            assert batch.column("token_ids").to_pylist() == [None, ids.tolist(), None]


# -- a bit flipped at every byte of a spill file --------------------------------------------


@pytest.mark.parametrize(
    "stride",
    [pytest.param(1, marks=pytest.mark.stress, id="every-byte"), pytest.param(7, id="sampled")],
)
def test_a_flipped_bit_anywhere_in_a_spill_file_raises_or_reads_exactly(name, tmp_path, stride):
    """Every bit of every byte (every `stride`-th in the fast tier) of a spill file (header,
    CRCs, token ids, routes) flipped in turn: each read (whole, ranged, wire) of the sample
    raises CorruptStoreError or returns exactly its routes; never another error, never other
    routes."""
    rng = np.random.default_rng(11)
    with make(name, tmp_path, pages=4) as store:
        a = LAYOUTS[0].random_routes(rng, 2 * P + 3)
        store.put("a", a, prompt_len=4, token_ids=np.arange(2 * P + 3))
        store.put("b", LAYOUTS[0].random_routes(rng, 4 * P))  # a goes to disk
        (file,) = [f for f in os.listdir(store.spill_dir) if f.endswith(".spill")]
        path = os.path.join(store.spill_dir, file)
        clean = Path(path).read_bytes()
        outcomes = {"exact": 0, "refused": 0}
        bad = []
        for byte in range(0, len(clean), stride):
            for bit in range(8):
                data = bytearray(clean)
                data[byte] ^= 1 << bit
                Path(path).write_bytes(data)
                for how, read in (
                    ("get", lambda: store.get("a")),
                    ("ranged", lambda: to_torch(store.read(["a"], ranges=[(P, P + 4)])).numpy()),
                    ("wire", lambda: to_torch(store.read_wire(["a"]).batch()).numpy()),
                ):
                    want = a[P : P + 4] if how == "ranged" else a
                    try:
                        got = read()
                    except CorruptStoreError:
                        outcomes["refused"] += 1
                        continue
                    except Exception as e:
                        bad.append(f"byte {byte} bit {bit} {how}: {type(e).__name__}: {e}")
                        continue
                    if np.array_equal(got, want):
                        outcomes["exact"] += 1
                    else:
                        bad.append(f"byte {byte} bit {bit} {how}: other routes")
        Path(path).write_bytes(clean)
        assert np.array_equal(store.get("a"), a)
        assert not bad, f"{len(bad)} bad reads: {bad[:10]}"
        assert outcomes["refused"] > 0 and outcomes["exact"] > 0, outcomes
        store.verify()


# -- files a releaser killed after its commit left -------------------------------------------


def _release_and_die(name: str) -> None:
    """Release "a" (spilled), and die right after the release committed: before its file
    goes."""
    store = RoutingStore.attach(name)
    with interleave(lambda point: point == "release:drop" and os.kill(os.getpid(), 9)):
        store.release(["a"])
    os._exit(3)  # not reached


def test_a_file_a_killed_releaser_left_goes_with_the_next_spill(name, tmp_path):
    rng = np.random.default_rng(12)
    with make(name, tmp_path, pages=4) as store:
        store.put("a", LAYOUTS[0].random_routes(rng, 2 * P))
        store.put("b", LAYOUTS[0].random_routes(rng, 4 * P))  # a spilled
        assert len(spilled_serials(store)) == 1
        p = FORK.Process(target=_release_and_die, args=(name,))
        p.start()
        p.join()
        assert p.exitcode == -signal.SIGKILL
        assert "a" not in store and len(spilled_serials(store)) == 1  # released, file left
        c = LAYOUTS[0].random_routes(rng, 4 * P)
        ref = store.put("c", c)  # spills b, and removes what no sample names
        assert spilled_serials(store) == {2}  # b's file only (put serial 2)
        assert np.array_equal(store.get(ref), c) and store.get("b").shape == (4 * P, 3, 2)
        store.verify()
