"""Real disk errors in the spill tier: a put waits, then says why; the store stays whole.

No mocks: a full tmpfs (ENOSPC), a file-size limit (`RLIMIT_FSIZE`: EFBIG; Python ignores
SIGXFSZ, so the write raises), the store's spill directory removed under it (ENOENT).
For each, a put that must spill and cannot (issue 31):

- waits its `timeout` (measured: at least the timeout; no upper bound is asserted), then
  raises `StoreFullError` whose message names the cause (the OSError's strerror) and the
  spill directory; today the raw OSError escapes at once;
- leaves the store whole (`verify()`), every earlier sample, spilled or in memory, exact
  (in the removed directory's case, a sample whose file went with it raises
  `CorruptStoreError`, never other routes), nothing of the failed put stored and no
  partial spill file behind;
- once the disk has room again (a larger tmpfs, the limit raised, the directory
  recreated) the same put succeeds and reads back exact.

And `RoutingStore.create(..., spill_dir=<a full tmpfs>)` with the default budget (half
the free space: 0) is refused with `StoreUnavailableError` naming the directory and its
free bytes; today it reports the new store "is corrupt".

Expected routes are derived from each sample id (`routes_of`), never read from the store.
Mounting a tmpfs needs root (CAP_SYS_ADMIN): those tests skip, saying so, without it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from typing import NamedTuple

import numpy as np
import pytest

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import CorruptStoreError, StoreFullError, StoreUnavailableError

TIMEOUT = 0.5  # a failed put's wait: asserted as a lower bound only
WIDE = RoutingLayout(num_layers=4, top_k=8, num_experts=64)  # 32 bytes a token: files fill 64k
SMALL = RoutingLayout(num_layers=3, top_k=2, num_experts=16)  # 6 bytes a token


def routes_of(layout: RoutingLayout, sample_id: str, num_tokens: int) -> np.ndarray:
    """The routes a sample id always stands for (missing last row, as engines give)."""
    routes = layout.random_routes(np.random.default_rng(zlib.crc32(sample_id.encode())), num_tokens)
    routes[-1] = -1
    return routes


def tokens_of(sample_id: str, num_tokens: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(sample_id.encode()) + 1).integers(0, 1000, num_tokens)


def store_dir(spill_root) -> str:
    """The store's own spill directory: the one `rr_<name>-<uid>` under `spill_dir`."""
    (d,) = [d for d in os.listdir(spill_root) if d.startswith("rr_")]
    return os.path.join(spill_root, d)


class Outcome(NamedTuple):
    """How a put ended: seconds taken, and what it raised (type name, message), if anything.
    The exception itself is not kept: its traceback could pin views of the segment."""

    elapsed: float
    full: bool  # it raised StoreFullError
    error: str | None  # "<type>: <message>"
    message: str


def timed_put(store: RoutingStore, sample_id: str, routes, **kw) -> Outcome:
    start = time.monotonic()
    try:
        store.put(sample_id, routes, timeout=TIMEOUT, **kw)
    except Exception as e:
        return Outcome(
            time.monotonic() - start,
            isinstance(e, StoreFullError),
            f"{type(e).__name__}: {e}",
            str(e),
        )
    return Outcome(time.monotonic() - start, False, None, "")


def check_refused(put: Outcome, strerror: str, spill_root) -> None:
    """A put that could not spill: StoreFullError after its timeout, naming why and where."""
    what = f"{put.error or 'success'} after {put.elapsed:.3f}s"
    assert put.full, f"expected StoreFullError, got {what}"
    assert put.elapsed >= TIMEOUT, f"the put gave up before its {TIMEOUT}s timeout: {what}"
    assert strerror in put.message, f"the cause ({strerror!r}) is not named: {what}"
    assert str(spill_root) in put.message, f"the spill directory is not named: {what}"


# -- a tmpfs of our own ------------------------------------------------------------------


def mount_tmpfs(path, size: str) -> None:
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: the tmpfs cases need one (and root)")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr}")


def remount(path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 KiB tmpfs at tmp_path/spill, unmounted afterwards (lazily if still in use)."""
    path = tmp_path / "spill"
    mount_tmpfs(path, "64k")
    yield path
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path) -> None:
    """Take every free block of the file system at `path` (unbuffered writes)."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


# -- ENOSPC --------------------------------------------------------------------------------


def test_no_space_on_the_spill_disk(name, tmpfs):
    # 128-token samples (4.6 KiB files, two tmpfs pages each) into room for 4 in memory and
    # a 64 KiB tmpfs under a 16 MiB budget: every put after the 4th spills one sample, until
    # the tmpfs is full and the spill write fails with ENOSPC although the budget has room.
    T = 128
    with RoutingStore.create(
        name, WIDE, 4 * T, page_tokens=16, spill_dir=tmpfs, spill_budget=1 << 24
    ) as store:
        refs = {}
        for i in range(40):  # 40 files could never fit: the disk fills long before
            sid = f"s{i}"
            put = timed_put(store, sid, routes_of(WIDE, sid, T), token_ids=tokens_of(sid, T))
            if put.error is not None:
                break
            refs[sid] = True
        assert put.error is not None, "the tmpfs never filled"
        spilled = store.stats().samples_spilled
        assert spilled >= 3, f"only {spilled} samples spilled before the disk filled"
        check_refused(put, os.strerror(errno.ENOSPC), tmpfs)
        check_whole(store, WIDE, refs, T, tmpfs, failed=sid)
        # Room again: the tmpfs grows; the same put now spills and succeeds.
        remount(tmpfs, "1m")
        store.put(sid, routes_of(WIDE, sid, T), token_ids=tokens_of(sid, T), timeout=TIMEOUT)
        refs[sid] = True
        check_whole(store, WIDE, refs, T, tmpfs)


def check_whole(store: RoutingStore, layout, refs: dict, T: int, spill_root, failed=None):
    """verify() passes, every stored sample reads exact, the failed one is not stored, and
    the spill directory holds exactly the spilled samples' files, none partial."""
    store.verify()
    for sid in refs:
        np.testing.assert_array_equal(store.get(sid), routes_of(layout, sid, T), err_msg=sid)
    if failed is not None:
        assert failed not in store
    assert len(store) == len(refs)
    files = [f for f in os.listdir(store_dir(spill_root)) if f.endswith(".spill")]
    assert len(files) == store.stats().samples_spilled, f"files left behind: {sorted(files)}"


# -- EFBIG ---------------------------------------------------------------------------------

FSIZE_LIMIT = 100  # bytes: below every spill file here (the smallest is 176)


def _efbig_child(name: str, spill_root: str) -> dict:
    """Run in a subprocess: attach, limit file sizes, put a sample that must spill, and
    report what happened (the test asserts)."""
    import resource

    store = RoutingStore.attach(name)
    files = sorted([f for f in os.listdir(store_dir(spill_root)) if f.endswith(".spill")])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, hard))
    out: dict = {"files_before": files}
    out["put"] = timed_put(store, "x", routes_of(SMALL, "x", 48))._asdict()
    out["files_after"] = sorted(
        [f for f in os.listdir(store_dir(spill_root)) if f.endswith(".spill")]
    )
    out["x_stored"] = "x" in store
    out["after_failure"] = state(store)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again: the limit raised
    try:
        store.put("x", routes_of(SMALL, "x", 48), timeout=TIMEOUT)
        out["retry"] = "ok"
    except Exception as e:
        out["retry"] = f"{type(e).__name__}: {e}"
    out["after_retry"] = state(store)
    store.close()
    return out


EFBIG_SAMPLES = {"a0": 8, "a1": 8, "b0": 56, "b1": 56, "b2": 16}  # id -> tokens


def state(store: RoutingStore) -> dict:
    """verify() and every sample of EFBIG_SAMPLES (and x) compared with what was put."""
    try:
        store.verify()
        verified = "ok"
    except Exception as e:
        verified = f"{type(e).__name__}: {e}"
    reads = {}
    for sid, T in [*EFBIG_SAMPLES.items(), ("x", 48)]:
        if sid == "x" and "x" not in store:
            continue
        try:
            same = np.array_equal(store.get(sid), routes_of(SMALL, sid, T))
            reads[sid] = "exact" if same else "WRONG ROUTES"
        except Exception as e:
            reads[sid] = f"{type(e).__name__}: {e}"
    return {"verify": verified, "reads": reads, "spilled": store.stats().samples_spilled}


@pytest.mark.stress  # a subprocess that imports the package: 2 s
def test_file_too_large_for_the_writer(name, tmp_path):
    # A 16-page store: a0, a1 (1 page each) spill here, freely, when b2 arrives; b0, b1, b2
    # fill memory. A writer whose files may not exceed 100 bytes then puts x (6 pages): its
    # spill of b0 (or of any sample in memory) fails with EFBIG.
    with RoutingStore.create(
        name, SMALL, 16 * 8, page_tokens=8, spill_dir=tmp_path, spill_budget=1 << 24
    ) as store:
        for sid, T in EFBIG_SAMPLES.items():
            store.put(sid, routes_of(SMALL, sid, T), token_ids=tokens_of(sid, T))
        assert store.stats().samples_spilled == 2  # a0, a1: written by this process
        code = (
            "import json, sys; sys.path.insert(0, sys.argv[1]); import test_disk_errors as t; "
            "print('RESULT ' + json.dumps(t._efbig_child(*sys.argv[2:])))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, os.path.dirname(__file__), name, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = json.loads(lines[-1].removeprefix("RESULT "))
        check_refused(Outcome(**out["put"]), os.strerror(errno.EFBIG), tmp_path)
        exact = {sid: "exact" for sid in EFBIG_SAMPLES}
        assert out["after_failure"] == {"verify": "ok", "reads": exact, "spilled": 2}, out
        assert not out["x_stored"]
        assert out["files_after"] == out["files_before"], out  # no partial file left
        assert out["retry"] == "ok", out
        assert out["after_retry"]["verify"] == "ok", out
        assert out["after_retry"]["reads"] == {**exact, "x": "exact"}, out
        # And here, in another process: the same samples, exact.
        store.verify()
        for sid, T in [*EFBIG_SAMPLES.items(), ("x", 48)]:
            np.testing.assert_array_equal(store.get(sid), routes_of(SMALL, sid, T), err_msg=sid)


# -- the spill directory removed ------------------------------------------------------------


def test_spill_directory_removed_between_puts(name, tmp_path):
    # 4 samples of 4 pages in an 8-page store: s0, s1 spill. Then the store's spill directory
    # is removed (an over-eager clean-up of the disk); the next put must spill s2 and cannot.
    T = 32
    with RoutingStore.create(
        name, SMALL, 8 * 8, page_tokens=8, spill_dir=tmp_path, spill_budget=1 << 24
    ) as store:
        ids = ["s0", "s1", "s2", "s3"]
        for sid in ids:
            store.put(sid, routes_of(SMALL, sid, T), token_ids=tokens_of(sid, T))
        assert store.stats().samples_spilled == 2
        directory = store_dir(tmp_path)
        shutil.rmtree(directory)
        check_refused(
            timed_put(store, "x", routes_of(SMALL, "x", T)), os.strerror(errno.ENOENT), tmp_path
        )
        assert "x" not in store and len(store) == 4
        # Samples whose files went with the directory raise; never other routes.
        for sid in ("s0", "s1"):
            with pytest.raises(CorruptStoreError):
                store.get(sid)
        for sid in ("s2", "s3"):  # in memory: exact
            np.testing.assert_array_equal(store.get(sid), routes_of(SMALL, sid, T))
        store.release(["s0", "s1"])  # lost: released, as the error says
        store.verify()
        if os.path.exists(directory):  # nothing of the failed put was left there
            assert [f for f in os.listdir(directory) if f.endswith(".spill")] == []
        # Room again: the directory is back (as the store made it: 0700).
        os.makedirs(directory, 0o700, exist_ok=True)
        store.put("x", routes_of(SMALL, "x", T), timeout=TIMEOUT)
        store.verify()
        for sid in ("s2", "s3", "x"):
            np.testing.assert_array_equal(store.get(sid), routes_of(SMALL, sid, T))
        assert (
            len([f for f in os.listdir(directory) if f.endswith(".spill")])
            == store.stats().samples_spilled
            == 1
        )


# -- create on a full disk ------------------------------------------------------------------


def test_create_on_a_full_spill_disk_is_refused_clearly(name, tmpfs):
    fill(tmpfs)
    st = os.statvfs(tmpfs)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(StoreUnavailableError) as caught:
        RoutingStore.create(name, SMALL, 128, page_tokens=8, spill_dir=tmpfs)
    message = str(caught.value)
    assert str(tmpfs) in message, message
    assert "free" in message.lower(), message  # and how many bytes are: "0 bytes free"
    assert re.search(rf"\b{free}\s*(bytes|B)\b|free\D{{0,20}}\b{free}\b", message), message
    # Nothing was made: no segment, no spill directory.
    assert os.listdir(tmpfs) == ["filler"]
    with pytest.raises(StoreUnavailableError):
        RoutingStore.attach(name)


# -- a spill disk remounted read-only -----------------------------------------------------------


def test_a_release_on_a_read_only_spill_disk_commits_and_its_file_goes_later(name, tmpfs):
    """ext4 remounts read-only on errors: a release of a spilled sample still commits and
    returns (its file cannot go yet), and the next spill once the disk is writable again
    removes it."""
    T = 16
    store = RoutingStore.create(  # 5 pages: room for two samples and a half
        name, SMALL, 2 * T + 8, page_tokens=8, spill_dir=tmpfs, spill_budget=1 << 20
    )
    try:
        for sid in ("s0", "s1", "s2"):
            store.put(sid, routes_of(SMALL, sid, T))  # s0 spilled
        assert store.stats().samples_spilled == 1
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
        try:
            store.release(["s0", "s1"])  # no raw OSError: the commit stands
            assert "s0" not in store and "s1" not in store
            assert len([f for f in os.listdir(store_dir(tmpfs)) if f.endswith(".spill")]) == 1
            np.testing.assert_array_equal(store.get("s2"), routes_of(SMALL, "s2", T))
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
        for sid in ("s3", "s4", "s5"):  # spills again: the left file goes on the way
            store.put(sid, routes_of(SMALL, sid, T))
        files = [f for f in os.listdir(store_dir(tmpfs)) if f.endswith(".spill")]
        assert len(files) == store.stats().samples_spilled >= 1  # s0's is gone
        for sid in ("s2", "s3", "s4", "s5"):
            np.testing.assert_array_equal(store.get(sid), routes_of(SMALL, sid, T))
        store.verify()
    finally:
        store.close()
        store.unlink()
