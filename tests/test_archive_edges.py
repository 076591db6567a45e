"""Route archive edges: a `read` that reuses one `out` buffer, saves to one path at once,
policy versions an archive cannot hold, the syncs a save makes, and a disk or path that
refuses the file. Each save either writes exactly the samples read or raises a
routing_replay error and leaves nothing behind (but for a directory that fails to sync
after the rename: the archive is complete, and the error says so)."""

from __future__ import annotations

import errno
import functools
import glob
import os
import resource
import signal
import stat
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from line_stops import interrupted_at

from routing_replay import RoutingLayout, RoutingRef, RoutingStore, load_routes, save_routes
from routing_replay.errors import InvalidArgumentError, StoreUnavailableError
from routing_replay.store import archive
from routing_replay.store.segment import segment_path

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=16)


@pytest.fixture
def stores():
    """Make stores that are removed afterwards."""
    made = []

    def make(capacity_tokens=1 << 16):
        name = f"test-archive-edges-{uuid.uuid4().hex[:10]}"
        store = RoutingStore.create(name, LAYOUT, capacity_tokens=capacity_tokens, page_tokens=8)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
        store.unlink()
        assert not os.path.exists(segment_path(store.name))


def put_samples(store, prefix, count, tokens, seed=0):
    rng = np.random.default_rng(seed)
    return [
        store.put(
            f"{prefix}{i}",
            LAYOUT.random_routes(rng, tokens),
            token_ids=rng.integers(0, 1000, tokens),
            policy_version=i,
        )
        for i in range(count)
    ]


def assert_loads_exactly(stores, path, src, refs):
    dst = stores()
    new = load_routes(path, dst)
    assert [r.sample_id for r in new] == [r.sample_id for r in refs]
    assert dst.read(new).equals(src.read(refs))
    assert [r.policy_versions for r in new] == [r.policy_versions for r in refs]


def test_a_read_into_one_reused_out_buffer_saves_each_sample_with_its_own_routes(stores, tmp_path):
    # `read` fills one `out` buffer each call: the batch being written is a view of it.
    # Before, the next chunk was read into it while a thread still checksummed and wrote
    # the last: samples of the archive held later samples' routes (with valid CRCs) or
    # failed their CRC. Now such a save is written again, each batch before the next read.
    src = stores()
    refs = put_samples(src, "x", 64, 500)
    buf = np.empty(1000 * LAYOUT.bytes_per_token, np.uint8)
    reads = []

    def read(chunk):
        reads.append(len(chunk))
        return src.read(chunk, out=buf)

    path = tmp_path / "routes.arrow"
    save_routes(path, refs, read=read, chunk_tokens=1000)  # two samples a chunk
    assert_loads_exactly(stores, path, src, refs)
    assert sorted(os.listdir(tmp_path)) == ["routes.arrow"]
    # A read of new memory keeps reading one chunk while the last is written: once each.
    fresh = []

    def read_new(chunk):
        fresh.append(len(chunk))
        return src.read(chunk)

    save_routes(path, refs, read=read_new, chunk_tokens=1000)
    assert len(fresh) == 32
    assert_loads_exactly(stores, path, src, refs)


def test_saves_to_one_path_at_once_each_write_their_own_file_and_the_last_wins(stores, tmp_path):
    # Before, both wrote "<path>.partial-<pid>": one raised FileNotFoundError from
    # os.replace and the file held a mix of both (failing its CRCs) or the other's samples.
    src = stores()
    first, second = put_samples(src, "a", 6, 40, 1), put_samples(src, "b", 6, 40, 2)
    path = tmp_path / "routes.arrow"
    both_writing = threading.Barrier(2, timeout=10)
    first_done = threading.Event()
    results = {}

    def save(key, refs):
        calls = []

        def read(chunk):
            calls.append(chunk)
            if len(calls) == 2:  # both temp files exist and hold a batch
                both_writing.wait()
            if key == "second" and len(calls) == 3:
                assert first_done.wait(10)
            return src.read(chunk)

        try:
            results[key] = save_routes(path, refs, read=read, chunk_tokens=80)  # 3 chunks
        except Exception as e:  # reported below
            results[key] = e
        finally:
            if key == "first":
                first_done.set()

    threads = [
        threading.Thread(target=save, args=("first", first)),
        threading.Thread(target=save, args=("second", second)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(results.get(k), int) for k in ("first", "second")), results
    assert results["second"] == os.path.getsize(path)
    assert_loads_exactly(stores, path, src, second)  # the last save to finish, whole
    assert sorted(os.listdir(tmp_path)) == ["routes.arrow"]


def test_policy_versions_beyond_int64_are_refused_at_put(stores, tmp_path):
    # Before, put took them and save_routes raised a raw OverflowError (spans are int64).
    src = stores()
    routes = LAYOUT.random_routes(np.random.default_rng(3), 6)
    for version in (2**63, 2**70, [(0, 1), (3, 2**64)]):
        with pytest.raises(InvalidArgumentError, match="at most 2\\*\\*63 - 1"):
            src.put("v", routes, policy_version=version)
        assert "v" not in src
    top = src.put("v", routes, policy_version=[(0, 5), (2, 2**63 - 1)])
    path = tmp_path / "routes.arrow"
    save_routes(path, [top], read=src.read)
    assert load_routes(path, stores())[0].policy_versions == ((0, 5), (2, 2**63 - 1))


def test_a_disk_that_refuses_the_file_is_a_store_unavailable_error_and_leaves_nothing(
    stores, tmp_path
):
    # Before: a raw OSError (EFBIG under RLIMIT_FSIZE, as ENOSPC on a full disk).
    src = stores()
    refs = put_samples(src, "x", 8, 500)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(StoreUnavailableError, match="File too large") as raised:
            save_routes(tmp_path / "routes.arrow", refs, read=src.read, chunk_tokens=1000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert isinstance(raised.value, OSError) and "routes.arrow" in str(raised.value)
    assert os.listdir(tmp_path) == []


def test_the_file_is_synced_before_its_rename_and_its_directory_after(
    stores, tmp_path, monkeypatch
):
    """A save survives a power cut: the file's data is on disk before the rename makes it the
    archive, and the rename itself once the directory is synced after it (a relative path's
    too: the current directory). A directory that fails to sync is a StoreUnavailableError
    that says the archive is complete but its rename may not survive."""
    src = stores()
    refs = put_samples(src, "x", 3, 20)
    real_fsync, real_replace = os.fsync, os.replace
    done: list[tuple] = []

    def fsync(fd):
        st = os.fstat(fd)
        done.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        if failing and stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    def replace(src_path, dst_path, **kwargs):
        real_replace(src_path, dst_path, **kwargs)
        done.append(("rename", os.path.abspath(dst_path)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    failing = False
    (tmp_path / "in").mkdir()
    monkeypatch.chdir(tmp_path)
    for path in (tmp_path / "in" / "routes.arrow", "routes.arrow"):
        done.clear()
        save_routes(path, refs, read=src.read)
        archive_path = os.path.abspath(path)
        file_ino, dir_ino = os.stat(path).st_ino, os.stat(os.path.dirname(archive_path)).st_ino
        assert done == [
            ("fsync", "file", file_ino),
            ("rename", archive_path),
            ("fsync", "dir", dir_ino),
        ], f"{path}: syncs and renames in order {done}"
        assert_loads_exactly(stores, path, src, refs)
    failing = True
    with pytest.raises(StoreUnavailableError, match="rename may not survive a power cut"):
        save_routes(tmp_path / "in" / "other.arrow", refs, read=src.read)
    assert_loads_exactly(stores, tmp_path / "in" / "other.arrow", src, refs)  # complete


def test_a_path_in_a_missing_directory_or_naming_one_is_refused_before_any_read(stores, tmp_path):
    # Before: raw FileNotFoundError, and IsADirectoryError from os.replace after every
    # sample was read and written.
    src = stores()
    refs = put_samples(src, "x", 2, 30)

    def read(chunk):
        raise AssertionError("read before the path was checked")

    with pytest.raises(InvalidArgumentError, match="does not exist; create it first"):
        save_routes(tmp_path / "nope" / "routes.arrow", refs, read=read)
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        save_routes(tmp_path, refs, read=read)
    os.mkfifo(tmp_path / "pipe")  # before: replaced by the archive (as root: /dev/null too)
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    for other in ("pipe", "link"):
        with pytest.raises(InvalidArgumentError, match="is not a regular file"):
            save_routes(tmp_path / other, refs, read=read)
    assert sorted(os.listdir(tmp_path)) == ["link", "pipe"]
    os.unlink(tmp_path / "pipe")
    os.unlink(tmp_path / "link")
    for chunk in ("5", None, 0, True):  # before: a raw TypeError for "5" and None
        with pytest.raises(InvalidArgumentError, match="chunk_tokens must be an int >= 1"):
            save_routes(tmp_path / "routes.arrow", refs, read=read, chunk_tokens=chunk)
    assert os.listdir(tmp_path) == []


def test_a_ref_made_by_hand_saves_an_archive_that_loads(stores, tmp_path):
    """A hand-made ref (no serial, no digest) reads its sample; the archive saves the digest
    of the tokens it read, so it loads (before: every load refused it as damaged)."""
    src = stores()
    [real] = put_samples(src, "a", 1, 20)
    hand = RoutingRef(real.sample_id, src.name, real.node_id, real.num_tokens)
    path = str(tmp_path / "r.arrow")
    save_routes(path, [hand], read=src.read)
    dst = stores()
    [new] = load_routes(path, dst)
    assert new.tokens_digest == real.tokens_digest
    assert dst.read([new]).equals(src.read([real]))
    assert load_routes(path, stores(), [hand])[0].tokens_digest == real.tokens_digest


@pytest.mark.parametrize(
    "stride", [pytest.param(7, id="every-7th"), pytest.param(1, marks=pytest.mark.slow, id="all")]
)
def test_a_save_stopped_at_any_line_leaves_no_temporary_file(stores, tmp_path, stride):
    """KeyboardInterrupt at each line of routing_replay code a save runs: no `.partial-*` file
    stays, and the archive is absent or loads exactly (before: stops between the temporary
    file's creation and the clean-up's `try` left it for good)."""
    src = stores()
    refs = put_samples(src, "s", 3, 9)
    path = str(tmp_path / "r.arrow")

    def traced(stop: int) -> int:
        save = functools.partial(save_routes, path, refs, read=src.read, chunk_tokens=10)
        return interrupted_at(stop, save)[0]

    events = traced(0)
    assert events > 100
    for stop in range(1, events + 1, stride):
        traced(stop)
        assert glob.glob(path + ".partial-*") == [], f"stopped at line event {stop}"
        if os.path.exists(path):
            assert_loads_exactly(stores, path, src, refs)
            os.unlink(path)


def test_a_save_killed_mid_write_leaves_a_file_the_next_save_removes(stores, tmp_path):
    # SIGKILL (preemption mid-checkpoint) runs no clean-up: its `.partial-*` file stays. A
    # later save to the path removes it once no process holds its lock and it has not been
    # written for DEAD_PARTIAL_S; a save still running keeps its own.
    src = stores()
    refs = put_samples(src, "s", 3, 9)
    path = str(tmp_path / "r.arrow")
    read_to, done_to = os.pipe()
    go_from, go_to = os.pipe()
    pid = os.fork()
    if pid == 0:  # a save that stops inside its write, then is killed there
        os.close(read_to)
        os.close(go_to)

        def read(chunk, **kwargs):
            os.write(done_to, b"x")
            os.read(go_from, 1)  # never answered: killed here
            return src.read(chunk, **kwargs)

        try:
            save_routes(path, refs, read=read)
        finally:
            os._exit(1)
    os.close(done_to)
    os.close(go_from)
    assert os.read(read_to, 1) == b"x"  # the child is inside its save, its file made
    (live,) = glob.glob(path + ".partial-*")
    save_routes(path, refs, read=src.read)  # the live save's file is locked: kept
    assert glob.glob(path + ".partial-*") == [live]
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read_to)
    os.close(go_to)
    save_routes(path, refs, read=src.read)  # dead, but written just now: kept a while
    assert glob.glob(path + ".partial-*") == [live]
    stale = os.stat(live).st_mtime - archive.DEAD_PARTIAL_S - 1
    os.utime(live, (stale, stale))  # a minute later
    mine = path + ".partial-backup"  # a user's file that shares the prefix: never touched
    Path(mine).write_bytes(b"keep")
    os.utime(mine, (stale, stale))
    save_routes(path, refs, read=src.read)
    assert glob.glob(path + ".partial-*") == [mine]
    assert_loads_exactly(stores, path, src, refs)


def test_a_fifo_given_to_load_routes_is_refused_not_waited_on(stores, tmp_path):
    """A FIFO at the path: an InvalidArgumentError at once, the store empty (before: the load
    blocked forever opening it)."""
    path = str(tmp_path / "routes.arrow")
    os.mkfifo(path)
    dst = stores()
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        load_routes(path, dst)
    assert len(dst) == 0


def test_an_archive_that_cannot_be_opened_is_not_called_damaged(stores, tmp_path):
    """Out of descriptors, a missing file or a directory: the error names the cause, not a
    damaged archive (before: CorruptArchiveError "save the routes again" for a good file),
    the store stays empty, and the same file loads once descriptors are back."""
    src = stores()
    refs = put_samples(src, "a", 2, 30)
    path = str(tmp_path / "routes.arrow")
    save_routes(path, refs, read=src.read)
    dst = stores()
    with pytest.raises(InvalidArgumentError, match="no archive file at"):
        load_routes(str(tmp_path / "other.arrow"), dst)
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        load_routes(tmp_path, dst)
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        with pytest.raises(StoreUnavailableError, match=r"Too many open files.*nothing was loaded"):
            load_routes(path, dst)
    finally:
        for fd in held:
            os.close(fd)
    assert len(dst) == 0
    assert_loads_exactly(stores, path, src, refs)


def test_an_archive_changed_in_place_after_its_check_loads_what_was_checked(stores, tmp_path):
    """The file is overwritten with another archive (same size, same inode: `cp` over it),
    then cut to 64 bytes, after every batch was checked and before the put copies the
    routes (before: the other archive's routes were stored, unchecked, with no error; a cut
    killed the loader with SIGBUS). Routes come from the batches read and checked."""
    src = stores()
    a, b = str(tmp_path / "a.arrow"), str(tmp_path / "b.arrow")
    tokens = np.arange(40)
    refs_a = [
        src.put(f"s{i}", LAYOUT.random_routes(np.random.default_rng(i), 40), token_ids=tokens)
        for i in range(3)
    ]
    save_routes(a, refs_a, read=src.read)
    want = {r.sample_id: src.get(r) for r in refs_a}
    src.release(refs_a)
    refs_b = [
        src.put(f"s{i}", LAYOUT.random_routes(np.random.default_rng(9 + i), 40), token_ids=tokens)
        for i in range(3)
    ]
    save_routes(b, refs_b, read=src.read)
    assert os.path.getsize(a) == os.path.getsize(b)
    whole_b = Path(b).read_bytes()

    def overwrite_then_cut():
        with open(a, "r+b") as f:  # in place: the same inode
            f.write(whole_b)
        os.truncate(a, 64)

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is RoutingStore.put_many.__wrapped__.__code__:
            sys.settrace(None)
            overwrite_then_cut()
        return None

    dst = stores()
    sys.settrace(tracer)
    try:
        loaded = load_routes(a, dst)
    finally:
        sys.settrace(None)
    assert os.path.getsize(a) == 64  # the change happened, during the load
    assert {r.sample_id: dst.get(r).tolist() for r in loaded} == {
        k: v.tolist() for k, v in want.items()
    }
