"""Threads sharing one store handle lose nothing (issue 31).

Every thread of a process shares one `RoutingStore` handle (a Ray actor's threads share
`node_store`'s mapping). These tests run writer threads and a reader thread on ONE handle
of a small spilling store, for a fixed number of operations, and prove:

- no put, read, release or `verify()` raises: the store is sized so that neither its
  spill budget nor its sample slots run out, so not even `StoreFullError` is expected;
- nothing is lost: every sample put is read exactly once, with exactly the routes, token
  ids and prompt length derived from its id (never compared with another read), then
  released;
- at the end `verify()` passes, the store is empty and no spill file is left.

Issue 31, on the code before its fix: two threads whose puts find the store full pick the
same victim; the second one's spill write fails with a raw `FileExistsError` out of `put`,
and its clean-up removes the first one's committed file, so a later read of that sample
raises `CorruptStoreError` ("is missing") and `verify()` fails while it is stored.

The Ray case does the same through the public Ray API, in a subprocess with its own
single-node Ray (this pytest process never starts Ray): a threaded rollout actor whose
threads put through `node_store` (one handle per process), while a threaded trainer
actor reads and releases through the node's store actor (whose threads share its handle).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections import Counter

import numpy as np
import pytest

from routing_replay import PutRequest, RoutingLayout, RoutingStore, to_torch
from routing_replay.errors import StoreUnavailableError
from routing_replay.store.segment import SHM_DIR, segment_path

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=16)  # 6 bytes a token, uint8
P = 8  # page_tokens
PAGES = 16  # 128 tokens: the store holds ~5 samples, writers ahead of the reader spill
BUDGET = 1 << 24  # a sample's file is at most 448 bytes: the budget never runs out
MAX_SAMPLES = 512  # more slots than samples ever stored at once: no StoreFullError either
WRITERS, PER_WRITER, GROUP = 3, 60, 4  # a group's samples share a one-page prompt
LAG = 24  # the reader runs at most this many samples behind the writers
ROUNDS = 4  # fresh stores and ids; on the code before the fix 40 of 40 rounds failed


def content(sample_id: str) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(routes, token ids or None, prompt_len) that a sample id always stands for.

    Samples `<prefix>g<group>-<j>` of a group share a one-page prompt (token ids and
    routes), so puts with token ids share its page; one sample in 8 has no token ids."""
    rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
    group = np.random.default_rng(zlib.crc32(sample_id.rsplit("-", 1)[0].encode()))
    completion = int(rng.integers(1, 3 * P))  # 2-4 pages in all
    routes = np.concatenate([LAYOUT.random_routes(group, P), LAYOUT.random_routes(rng, completion)])
    routes[-1] = -1  # the last row is never forwarded: missing
    tokens = np.concatenate([group.integers(0, 1000, P), rng.integers(0, 1000, completion)])
    with_ids = zlib.crc32(sample_id.encode()) % 8 != 0
    return routes, tokens if with_ids else None, P


def sample_ids(prefix: str, count: int) -> list[str]:
    return [f"{prefix}g{i // GROUP}-{i % GROUP}" for i in range(count)]


def request(sample_id: str) -> PutRequest:
    routes, tokens, prompt_len = content(sample_id)
    return PutRequest(sample_id, routes, prompt_len, tokens)


def wrong_rows(batch, sample_ids: list[str]) -> list[str]:
    """Ids among a read's rows whose routes, token ids or prompt_len are not their own."""
    lengths = batch.column("num_tokens").to_pylist()
    bounds = np.cumsum([0, *lengths])
    packed = to_torch(batch).numpy()
    tokens = batch.column("token_ids").to_pylist()
    prompts = batch.column("prompt_len").to_pylist()
    wrong = []
    for k, sid in enumerate(sample_ids):
        routes, want_tokens, prompt_len = content(sid)
        if (
            batch.column("sample_id")[k].as_py() != sid
            or not np.array_equal(packed[bounds[k] : bounds[k + 1]], routes)
            or tokens[k] != (None if want_tokens is None else want_tokens.tolist())
            or prompts[k] != prompt_len
        ):
            wrong.append(sid)
    return wrong


def spill_files(spill_root: str) -> list[str]:
    """The files in the store's own spill directory (`<spill_dir>/rr_<name>-<uid>`)."""
    dirs = [d for d in os.listdir(spill_root) if d.startswith("rr_")]
    assert len(dirs) == 1, dirs
    return [f for f in os.listdir(os.path.join(spill_root, dirs[0])) if f.endswith(".spill")]


def run_threads(store: RoutingStore, prefix: str, per_writer: int) -> dict:
    """WRITERS writer threads and one reader thread on `store` (one handle): what happened.

    Writer w puts its samples in order (writer 0 and 1 one `put` each, writer 2 a group's
    samples in one `put_many`), then hands the refs to the reader. The reader reads them in
    the order they came, up to 4 at a time (a lone ref with `get`, else `read`), compares
    every row with `content`, checks `verify()` now and then, and releases them."""
    pending: queue.Queue = queue.Queue(maxsize=LAG)
    errors: list[str] = []  # "<op> <ids>: <type>: <message>"
    read: Counter = Counter()
    wrong: list[str] = []
    stored: list[str] = []
    most_spilled = [0]
    start = threading.Barrier(WRITERS + 1)

    def writer(w: int) -> None:
        start.wait()
        ids = sample_ids(f"{prefix}w{w}", per_writer)
        chunks = [ids[i : i + GROUP] for i in range(0, len(ids), GROUP)] if w == 2 else ids
        for chunk in chunks:
            try:
                if isinstance(chunk, list):
                    refs = store.put_many([request(sid) for sid in chunk])
                else:
                    routes, tokens, prompt_len = content(chunk)
                    refs = [store.put(chunk, routes, prompt_len=prompt_len, token_ids=tokens)]
            except Exception as e:  # every error is a finding
                errors.append(f"put {chunk}: {type(e).__name__}: {e}")
                continue
            for ref in refs:
                stored.append(ref.sample_id)
                pending.put(ref)
        pending.put(None)

    def reader() -> None:
        start.wait()
        writers_left, batches = WRITERS, 0
        while writers_left:
            batch = []
            while len(batch) < 4 and writers_left:
                ref = pending.get()
                if ref is None:
                    writers_left -= 1
                else:
                    batch.append(ref)
            if not batch:
                continue
            ids = [r.sample_id for r in batch]
            read.update(ids)
            try:
                if len(batch) == 1:
                    if not np.array_equal(store.get(batch[0]), content(ids[0])[0]):
                        wrong.append(ids[0])
                else:
                    wrong.extend(wrong_rows(store.read(batch), ids))
            except Exception as e:
                errors.append(f"read {ids}: {type(e).__name__}: {e}")
            batches += 1
            if batches % 5 == 0:
                try:
                    store.verify()
                except Exception as e:
                    errors.append(f"verify: {type(e).__name__}: {e}")
                most_spilled[0] = max(most_spilled[0], store.stats().samples_spilled)
            try:
                store.release(batch)
            except Exception as e:
                errors.append(f"release {ids}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(WRITERS)]
    threads.append(threading.Thread(target=reader, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a thread hung for 60 s"
    return {
        "errors": errors,
        "read": read,
        "wrong": wrong,
        "stored": stored,
        "most_spilled": most_spilled[0],
    }


def error_kinds(errors: list[str]) -> dict[str, int]:
    """{"<op> <error type>": count}."""
    return dict(Counter(f"{e.split(':')[0].split()[0]} {e.split(': ')[1]}" for e in errors))


def one_round(name: str, spill_root: str, prefix: str, per_writer: int) -> dict:
    """One store, one run of the threads; every expectation checked, what failed returned
    (empty: the round passed)."""
    with RoutingStore.create(
        name,
        LAYOUT,
        PAGES * P,
        page_tokens=P,
        max_samples=MAX_SAMPLES,
        spill_dir=spill_root,
        spill_budget=BUDGET,
        put_timeout=10.0,
    ) as store:
        out = run_threads(store, prefix, per_writer)
        expected = [sid for w in range(WRITERS) for sid in sample_ids(f"{prefix}w{w}", per_writer)]
        problems = {}
        if out["errors"]:
            problems["errors"] = error_kinds(out["errors"])
            problems["first errors"] = out["errors"][:2]
        if sorted(out["stored"]) != sorted(expected):
            problems["not stored"] = len(set(expected) - set(out["stored"]))
        if dict(out["read"]) != {sid: 1 for sid in out["stored"]}:
            problems["not read exactly once"] = sum(
                1 for sid in out["stored"] if out["read"][sid] != 1
            )
        if out["wrong"]:
            problems["wrong rows"] = out["wrong"][:5]
        try:
            store.verify()
        except Exception as e:
            problems["verify at the end"] = f"{type(e).__name__}: {e}"
        stats = store.stats()
        if (stats.samples, stats.samples_spilled, stats.pages_used, stats.pages_pending) != (
            0,
            0,
            0,
            0,
        ):
            problems["left in the store"] = str(stats)
        if spill_files(spill_root):
            problems["spill files left"] = len(spill_files(spill_root))
        if out["most_spilled"] == 0:
            problems["never spilled"] = "the test did not make the store spill"
        return problems


def check_rounds(name: str, tmp_path, rounds: int, per_writer: int) -> None:
    failed = {}
    for r in range(rounds):
        root = tmp_path / f"r{r}"
        root.mkdir()
        try:
            problems = one_round(f"{name}-{r}", str(root), f"r{r}", per_writer)
        finally:  # the owner's exit unlinks it; unless that failed half-way
            if os.path.exists(segment_path(f"{name}-{r}")):
                os.unlink(segment_path(f"{name}-{r}"))
        if problems:
            failed[r] = problems
    if failed:
        totals: Counter = Counter()
        for problems in failed.values():
            totals.update(problems.get("errors", {}))
        first = min(failed)
        raise AssertionError(
            f"{len(failed)} of {rounds} rounds failed; errors in all: {dict(totals)}; "
            f"round {first}: {failed[first]}"
        )


def test_three_writers_and_a_reader_on_one_handle(name, tmp_path):
    # 4 rounds x (3 writers x 60 samples): ~1 s. Every round spills (the store holds ~5
    # samples, the reader runs up to 24 behind).
    check_rounds(name, tmp_path, ROUNDS, PER_WRITER)


@pytest.mark.stress
def test_three_writers_and_a_reader_on_one_handle_long(name, tmp_path):
    # The same, 12 rounds x (3 writers x 240 samples): ~20 s.
    check_rounds(name, tmp_path, 12, 4 * PER_WRITER)


# -- on Ray: a threaded rollout actor puts, a threaded trainer reads via the store actor --


def _ray_main(job: str, spill_root: str, rounds: int, per_call: int) -> dict:
    """Run in a subprocess: a single-node Ray, a node store with a small spilling store.

    Each round, a threaded rollout actor (max_concurrency=3: its threads share the one
    handle `node_store` maps in its process) gets 3 concurrent `put` calls of `per_call`
    samples; meanwhile a threaded trainer actor (max_concurrency=2) reads the previous
    round's refs, 4 at a time, through the store actor (`read`, in the wire form), checks
    them and releases them through it, so the store actor serves concurrent calls on its
    threads. The store holds ~5 samples: puts spill. Returns errors, counts, end state."""
    import ray

    from routing_replay.ray import StoreOptions, node_store, shutdown_node_stores, store_actor

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    options = StoreOptions(
        capacity_tokens=PAGES * P,
        page_tokens=P,
        max_samples=MAX_SAMPLES,
        job_watch_s=None,
        spill_dir=spill_root,
        spill_budget=BUDGET,
    )
    try:
        node_store(job, LAYOUT, options)  # the store actor starts here

        @ray.remote(num_cpus=0, max_concurrency=3)
        class Rollout:
            def put(self, sample_ids: list[str]) -> tuple[list, list[str], int]:
                store = node_store(job, LAYOUT, options)  # this process's one handle
                refs, errors, spilled = [], [], 0
                for sid in sample_ids:
                    routes, tokens, prompt_len = content(sid)
                    try:
                        refs.append(store.put(sid, routes, prompt_len=prompt_len, token_ids=tokens))
                    except Exception as e:
                        errors.append(f"put {sid}: {type(e).__name__}: {e}")
                    spilled = max(spilled, store.stats().samples_spilled)
                return refs, errors, spilled

        @ray.remote(num_cpus=0, max_concurrency=2)
        class Trainer:
            def train(self, refs: list) -> tuple[list[str], list[str], list[str]]:
                """Read refs through the store actor, check them, release them through it."""
                actor = store_actor(job)
                ids = [r.sample_id for r in refs]
                errors, wrong = [], []
                try:
                    wire = ray.get(ray.get(actor.read.remote(refs)))
                    wrong = wrong_rows(wire.batch(), ids)
                except Exception as e:
                    errors.append(f"read {ids}: {type(e).__name__}: {str(e)[:300]}")
                try:
                    ray.get(actor.release.remote(refs))
                except Exception as e:
                    errors.append(f"release {ids}: {type(e).__name__}: {str(e)[:300]}")
                return ids, wrong, errors

        rollout, trainer = Rollout.remote(), Trainer.remote()
        errors, wrong, read, stored, trains, most_spilled = [], [], Counter(), [], [], 0
        for r in range(rounds):
            calls = [rollout.put.remote(sample_ids(f"r{r}w{w}", per_call)) for w in range(WRITERS)]
            for refs, put_errors, spilled in ray.get(calls):
                errors += put_errors
                most_spilled = max(most_spilled, spilled)
                stored += [ref.sample_id for ref in refs]
                trains += [trainer.train.remote(refs[i : i + 4]) for i in range(0, len(refs), 4)]
        for ids, bad, train_errors in ray.get(trains):
            read.update(ids)
            wrong += bad
            errors += train_errors
        store = node_store(job, LAYOUT, options)  # the driver's handle
        try:
            store.verify()
            verified = "ok"
        except Exception as e:
            verified = f"{type(e).__name__}: {e}"
        stats = ray.get(store_actor(job).stats.remote())
        expected = [
            sid
            for r in range(rounds)
            for w in range(WRITERS)
            for sid in sample_ids(f"r{r}w{w}", per_call)
        ]
        return {
            "errors": error_kinds(errors),
            "first_errors": errors[:3],
            "not_stored": len(set(expected) - set(stored)),
            "not_read_once": sum(1 for sid in stored if read[sid] != 1),
            "wrong": wrong[:5],
            "verify": verified,
            "left": [
                stats[k] for k in ("samples", "samples_spilled", "pages_used", "pages_pending")
            ],
            "most_spilled": most_spilled,
            "files_left": spill_files(spill_root),
        }
    finally:
        shutdown_node_stores(job)
        ray.shutdown()


@pytest.mark.ray
def test_threaded_rollout_actor_and_store_actor_on_ray(tmp_path):
    job = f"threads-{uuid.uuid4().hex[:8]}"
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_threads as t; "
        "print('RESULT ' + json.dumps(t._ray_main(sys.argv[2], sys.argv[3], 6, 20)))"
    )
    try:
        # Its own session: on a timeout the whole group goes, Ray's processes included.
        proc = subprocess.Popen(
            [sys.executable, "-c", code, os.path.dirname(__file__), job, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-3000:]
        result = json.loads(lines[-1].removeprefix("RESULT "))
        assert result["most_spilled"] > 0, result  # the puts did spill
        assert result["errors"] == {}, result
        assert (result["not_stored"], result["not_read_once"], result["wrong"]) == (0, 0, []), (
            result
        )
        assert result["verify"] == "ok", result
        assert result["left"] == [0, 0, 0, 0], result
        assert result["files_left"] == [], result
    finally:  # whatever a crashed run left: the job's segments, its spill directory
        for path in glob.glob(os.path.join(SHM_DIR, f"rr_{job}.*")):
            os.unlink(path)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_handle_closed_while_another_thread_calls_it(name):
    """`close` from one thread while another reads through the same handle (the Ray client
    closes a dead store's handle this way): close waits for no call in flight, and the reader
    gets either its routes or `StoreUnavailableError` (closed), never a raw OSError."""
    layout = RoutingLayout(num_layers=3, top_k=2, num_experts=16)
    routes = layout.random_routes(np.random.default_rng(0), 64)
    owner = RoutingStore.create(name, layout, 1024, page_tokens=8)
    owner.put("a", routes)
    for _ in range(20):
        handle = RoutingStore.attach(name)
        outcomes, started = Counter(), threading.Event()

        def reader(h=handle, seen=outcomes, go=started):
            while True:
                go.set()
                try:
                    ok = np.array_equal(h.get("a"), routes)
                    seen["exact" if ok else "wrong"] += 1
                except StoreUnavailableError:
                    seen["closed"] += 1
                    return
                except Exception as e:
                    seen[f"{type(e).__name__}: {e}"] += 1
                    return

        thread = threading.Thread(target=reader)
        thread.start()
        started.wait()
        while True:
            try:
                handle.close()
                break
            except BufferError:  # a call of the reader in flight: again
                time.sleep(0)
        thread.join()
        assert set(outcomes) <= {"exact", "closed"} and outcomes["closed"] == 1, outcomes
    owner.verify()
    owner.close()
    owner.unlink()


def test_the_client_closes_a_dead_stores_handle_once_its_last_call_ends(name):
    """The Ray client's cache (`node_store`, `fetch_batch`): a store is re-created while a
    thread's read on the old handle is in flight. The next attach does not wait for that read,
    and once it ends the old handle is closed, its descriptors given back (before: close gave
    up after the put timeout under the cache's lock, and the handle was dropped unclosed, its
    descriptors on the removed segment open for the life of the process)."""
    from routing_replay.ray import client

    def on_removed_segment() -> list[str]:
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [t for t in targets if name in t and t.endswith("(deleted)")]

    owner = RoutingStore.create(name, LAYOUT, 256, page_tokens=8)
    old = client.attached(name, LAYOUT)
    ref = old.put("a", LAYOUT.random_routes(np.random.default_rng(0), 10))
    in_read, finish = threading.Event(), threading.Event()

    def slow_read() -> None:
        def tracer(frame, event, arg):
            if frame.f_code.co_name == "batch" and frame.f_code.co_filename.endswith("read.py"):
                in_read.set()
                finish.wait(30)
            return None

        sys.settrace(tracer)
        try:
            old.read([ref])
        except StoreUnavailableError:
            pass
        finally:
            sys.settrace(None)

    reader = threading.Thread(target=slow_read)
    reader.start()
    new = None
    try:
        assert in_read.wait(30)
        owner.close()
        owner.unlink()  # its store actor died; another one made the store again
        new = RoutingStore.create(name, LAYOUT, 256, page_tokens=8)
        handle = client.attached(name, LAYOUT)
        assert handle is not old and old in client._closing  # not waited for: kept to close
        finish.set()
        reader.join()
        assert client.attached(name, LAYOUT) is handle  # a later call closes the old one
        assert old not in client._closing and on_removed_segment() == []
    finally:
        finish.set()
        reader.join()
        if name in client._attached:
            client._close([client._attached.pop(name)])
        if new is not None:
            new.close()
            new.unlink()


def test_attached_stopped_at_each_line_leaves_nothing_that_blocks_another_thread(name):
    """A Ctrl-C at each line of `client.attached` (every node_store and same-node read of a
    process goes through it), with a dead store's mapping in the cache to close on the way:
    another thread's call then answers, with the one live mapping. Before: a stop on the
    exit of its `with` lock left the lock held, and every later call of the process waited
    for good (round 53)."""
    from line_stops import interrupted_at

    from routing_replay.ray import client

    def attach() -> RoutingStore:
        return client.attached(name, LAYOUT)

    def with_a_dead_mapping() -> None:
        for cached in [n for n in client._attached if n.startswith(name)]:
            client._close([client._attached.pop(cached)])
        dead = RoutingStore.create(f"{name}-dead", LAYOUT, 64, page_tokens=8)
        client.attached(dead.name, LAYOUT)
        dead.close()
        dead.unlink()

    owner = RoutingStore.create(name, LAYOUT, 256, page_tokens=8)
    try:
        with_a_dead_mapping()
        lines: list[str] = []
        interrupted_at(0, attach, lines=lines)
        stops = [n for n, line in enumerate(lines, 1) if line.startswith("ray/client.py")]
        assert len(stops) > 10
        for stop in stops:
            with_a_dead_mapping()
            interrupted_at(stop, attach)
            got: list[RoutingStore] = []
            other = threading.Thread(target=lambda got=got: got.append(attach()), daemon=True)
            other.start()
            other.join(10)
            assert not other.is_alive(), f"stop at {lines[stop - 1]}: another thread waits"
            assert got[0] is client._attached[name] and got[0].stats().samples == 0
            assert f"{name}-dead" not in client._attached
    finally:
        for cached in [n for n in client._attached if n.startswith(name)]:
            client._close([client._attached.pop(cached)])
        owner.close()


def test_a_cached_mapping_another_thread_closed_is_judged_gone_not_raised(name):
    """`attached` looks at every cached mapping; one that another thread has just taken out
    and closed (its store died) must read as gone, whatever its probe then raises. Before:
    `node_store` and same-node reads of a live store raised a raw `OSError` (EBADF), an
    `AttributeError`, or the dead store's "closed in this process" (round 54)."""
    from routing_replay.ray import client

    owner = RoutingStore.create(name, LAYOUT, 256, page_tokens=8)
    other = RoutingStore.create(f"{name}-other", LAYOUT, 64, page_tokens=8)
    closing = RoutingStore.attach(other.name, LAYOUT)
    segment = closing._core.segment
    real_fd, gone_fd = segment._lock_fd, os.dup(segment._lock_fd)
    os.close(gone_fd)
    segment._lock_fd = gone_fd  # (where another thread's close is: its lock descriptor shut)
    try:
        client._attached[other.name] = closing
        assert client.attached(name, LAYOUT).stats().samples == 0
        assert other.name not in client._attached
    finally:
        for cached in [n for n in client._attached if n.startswith(name)]:
            client._close([client._attached.pop(cached)])
        segment._lock_fd = real_fd
        with contextlib.suppress(Exception):
            closing.close()
        other.unlink()
        other.close()
        owner.close()
