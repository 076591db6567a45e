"""Stress and pid namespaces: GRPO-shaped writers on a store so small its pages are reused
constantly, and writers, owners and reclaim across a real second pid namespace."""

from __future__ import annotations

import collections
import contextlib
import functools
import multiprocessing as mp
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import numpy as np
import pytest

from routing_replay import RoutingLayout, RoutingStore
from routing_replay.errors import ConcurrentReleaseError, SampleNotFoundError, StoreFullError
from routing_replay.store.segment import segment_path

pytestmark = pytest.mark.stress

try:
    from routing_replay.store.lock import interleave
except ImportError:  # the store before its redesign (tests of the test: see run_stress)
    from routing_replay.store import interleave

FORK = mp.get_context("fork")

# -- GRPO-shaped stress -------------------------------------------------------------------

STRESS_SECONDS = 20.0  # writers' loop time; the whole test takes a few seconds more
MIN_PUTS = 2000  # below this the run meant little (8,000-19,000 measured on 2 shared cores)
WRITERS = 4
PAGE = 16
PAGES_PER_WRITER = 7  # 28 pages in all: a group takes ~6-12, so pages are reused constantly
LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=8)
PROMPT_LENS = (35, 40, 48)  # prompt pool shared by every writer: pages shared across writers
JITTER = (0.2, 0.0005)  # share of lock drops followed by a pause, and its longest
VARIANTS = 2  # prompt routes per prompt: same tokens, other routes, so twins exist


def _routes(rng: np.random.Generator, T: int) -> np.ndarray:
    return LAYOUT.random_routes(rng, T)


@functools.lru_cache(maxsize=1)
def _prompt_pool() -> list[tuple[np.ndarray, list[np.ndarray]]]:
    rng = np.random.default_rng(1234)
    pool = []
    for i, n in enumerate(PROMPT_LENS):
        tokens = np.arange(n, dtype=np.int64) + 10_000 * (i + 1)
        pool.append((tokens, [_routes(rng, n) for _ in range(VARIANTS)]))
    return pool


@functools.lru_cache(maxsize=512)
def group(w: int, g: int) -> tuple[tuple[np.ndarray, np.ndarray, int], ...]:
    """Writer w's group g: (token_ids, routes, prompt_len) per sample, derived from (w, g)
    alone so any process recomputes what any sample id stands for.

    One prompt from the shared pool; completions whose token ids start alike. Members:
    0 is the base; "copy" repeats member 0's routes exactly (every page shared); "tail"
    shares member 0's prompt routes with its own completion; "twin" has the same tokens as
    a base-like sample but the prompt's other routes (a twin chain); "gap" is a tail with
    missing rows (prefix-cache gaps)."""
    rng = np.random.default_rng([w, g, 77])
    tokens, variants = _prompt_pool()[int(rng.integers(len(PROMPT_LENS)))]
    v = int(rng.integers(VARIANTS))
    P = len(tokens)
    base_len = int(rng.integers(4, 29))
    members = []
    for m in range(int(rng.integers(2, 5))):
        kind = "base" if m == 0 else ("copy", "tail", "twin", "gap")[int(rng.integers(4))]
        if kind == "copy":
            members.append(members[0])
            continue
        c = base_len if kind in ("tail", "twin") else int(rng.integers(4, 29))
        ids = np.concatenate([tokens, np.arange(c, dtype=np.int64) + 500])
        prompt = variants[(v + (kind == "twin")) % VARIANTS]
        routes = np.concatenate([prompt, _routes(rng, c)])
        if kind == "gap":
            routes[P:][rng.random(c) < 0.3] = -1
        routes[-1] = -1  # the last token is never forwarded
        members.append((ids, routes, P))
    return tuple(members)


def sid(w: int, g: int, m: int) -> str:
    return f"w{w}-g{g}-m{m}"


def expected(sample_id: str) -> np.ndarray:
    w, g, m = (int(x[1:]) for x in sample_id.split("-"))
    return group(w, g)[m][1]


def _batch_routes(batch) -> dict[str, np.ndarray]:
    col = batch.column("routed_experts")
    offsets = col.offsets.to_numpy()
    values = col.flatten().flatten().to_numpy().view(np.int8)
    values = values.reshape(-1, LAYOUT.num_moe_layers, LAYOUT.top_k)
    ids = batch.column("sample_id").to_pylist()
    return {s: values[offsets[j] : offsets[j + 1]] for j, s in enumerate(ids)}


def _stress_writer(name: str, w: int, seconds: float, progress, result) -> None:
    n: collections.Counter = collections.Counter()
    wrong: list[str] = []
    held: collections.deque[list[str]] = collections.deque()  # complete groups, oldest first
    try:
        _stress_loop(name, w, seconds, progress, n, wrong, held)
        error = None
    except BaseException:
        error = traceback.format_exc()
    held_ids = [s for ids in held for s in ids]
    result.put({**n, "wrong_ids": wrong[:10], "held": held_ids, "error": error})


def _stress_loop(name: str, w: int, seconds: float, progress, n, wrong, held) -> None:
    rng = random.Random(w)

    def jitter(point: str) -> None:
        # Now and then a pause right after the lock is dropped: where a put compares pages
        # and a read copies them without the lock, the others get time to release and reuse.
        if point.endswith(":drop") and rng.random() < JITTER[0]:
            time.sleep(rng.random() * JITTER[1])

    with interleave(jitter):
        _stress_ops(name, w, seconds, progress, n, wrong, held, rng)


def _stress_ops(name: str, w: int, seconds: float, progress, n, wrong, held, rng) -> None:
    store = RoutingStore.attach(name, put_timeout=0)

    def check(sample_id: str, got: np.ndarray, how: str) -> None:
        n["reads"] += 1
        if not np.array_equal(got, expected(sample_id)):
            n["wrong"] += 1
            wrong.append(f"{how} {sample_id}")

    def release(ids: list[str]) -> None:
        if rng.random() < 0.5:
            store.release(ids)
        else:  # one by one, in any order
            for s in rng.sample(ids, len(ids)):
                store.release([s])
        n["released"] += len(ids)

    def read_others() -> None:
        # Mostly the group before a writer's current one: the group it releases next.
        ids = []
        for o in rng.sample([o for o in range(WRITERS) if o != w], rng.randint(1, 3)):
            g = int(progress[o]) - (rng.random() < 0.8)
            if g >= 0:
                ids += [sid(o, g, m) for m in range(len(group(o, g)))]
        if not ids:
            return
        try:
            if rng.random() < 0.5:
                one = rng.choice(ids)
                got = {one: store.get(one)}
            else:
                got = _batch_routes(store.read(ids))
        except (SampleNotFoundError, ConcurrentReleaseError):
            n["raced"] += 1  # released before or while read: an error, never wrong data
            return
        for s, routes in got.items():
            check(s, routes, "other")

    deadline = time.monotonic() + seconds
    g = 0
    while time.monotonic() < deadline:
        progress[w] = g
        members = group(w, g)
        ids = [sid(w, g, m) for m in range(len(members))]
        done: list[str] = []
        while len(done) < len(ids):
            s = ids[len(done)]
            tokens, routes, prompt_len = members[len(done)]
            try:
                store.put(s, routes, prompt_len=prompt_len, token_ids=tokens)
            except StoreFullError:
                n["full"] += 1
                if time.monotonic() > deadline:  # the others may be done, holding theirs
                    release(done)
                    break
                if held:
                    release(held.popleft())
                elif done:  # every writer holding half a group: give ours back, start over
                    release(done)
                    done = []
                    time.sleep(rng.random() * 0.005)
                else:
                    time.sleep(0.001)
                continue
            n["puts"] += 1
            done.append(s)
            check(s, store.get(s), "get")
            if rng.random() < 0.2:
                n["reads"] += 1
                if not np.array_equal(store.get(s, "prompt"), routes[:prompt_len]):
                    n["wrong"] += 1
                    wrong.append(f"prompt {s}")
            if rng.random() < 0.5:
                read_others()
        if len(done) < len(ids):
            break
        for s, got in _batch_routes(store.read(ids)).items():
            check(s, got, "read")
        held.append(ids)
        while len(held) > 1:  # release soon after: the group before this one
            release(held.popleft())
        g += 1
    store.close()


def run_stress(name: str, seconds: float = STRESS_SECONDS) -> dict:
    """Run the writers on a new store `name`; returns their counts and the final checks'."""
    capacity = WRITERS * PAGES_PER_WRITER * PAGE
    totals: collections.Counter = collections.Counter()
    with RoutingStore.create(name, LAYOUT, capacity_tokens=capacity, page_tokens=PAGE) as store:
        store.put("warm", _routes(np.random.default_rng(0), 20))
        _batch_routes(store.read(["warm"]))  # imports done once, before the fork
        store.release(["warm"])
        progress = FORK.Array("q", WRITERS, lock=False)
        for w in range(WRITERS):
            progress[w] = -1
        result = FORK.Queue()
        procs = [
            FORK.Process(target=_stress_writer, args=(name, w, seconds, progress, result))
            for w in range(WRITERS)
        ]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        outcomes = [result.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(60)
        totals["seconds"] = round(time.monotonic() - t0, 1)
        errors = [out.pop("error") for out in outcomes]
        held = [s for out in outcomes for s in out.pop("held")]
        wrong_ids = [s for out in outcomes for s in out.pop("wrong_ids")]
        for out in outcomes:
            totals.update(out)
        # The end: tables whole, nothing pending, exactly the kept samples, each exact.
        try:
            store.verify()
            totals["reclaimed"] = store.reclaim()
            stats = store.stats()
            totals["pending"] = stats.pages_pending
            totals["final_wrong"] = sum(not np.array_equal(store.get(s), expected(s)) for s in held)
            totals["final_samples"], totals["held"] = stats.samples, len(held)
        except Exception as e:  # reported, not raised: the counts above say more
            errors.append(f"final checks: {e!r}")
    return {**totals, "errors": [e for e in errors if e], "wrong_ids": wrong_ids}


def test_grpo_writers_release_and_reuse_small_store(name):
    out = run_stress(name)
    print({k: v for k, v in out.items() if k != "errors"})
    assert out.get("wrong", 0) == 0, out
    assert out["errors"] == []
    assert out["puts"] >= MIN_PUTS, out
    assert out["full"] > 0 and out["raced"] > 0  # the store was full, readers did race
    assert out["reclaimed"] == 0 and out["pending"] == 0
    assert out["final_wrong"] == 0 and out["final_samples"] == out["held"] > 0


# -- a second pid namespace --------------------------------------------------------------

NS_LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=8)

# Deterministic routes of a sample id, run here and (as source) in namespaced children.
CONTENT_SRC = """
import zlib
import numpy as np
from routing_replay import RoutingLayout
NS_LAYOUT = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
def ns_content(sample_id, num_tokens):
    rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
    return NS_LAYOUT.random_routes(rng, num_tokens)
"""
_content: dict = {}
exec(CONTENT_SRC, _content)
ns_content = _content["ns_content"]  # the same function here

# The namespace's init (pid 1) runs `body`, or forks it at pid `pid` first: writing
# ns_last_pid picks the next pid, so the store records a pid no host process has.
NS_PRELUDE = """
import os, sys
def at_pid(pid):
    if pid is None:
        return
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))
    child = os.fork()
    if child:
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    assert os.getpid() == pid, os.getpid()
"""


def _unshare_works() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_pid_namespace = pytest.mark.skipif(
    not _unshare_works(), reason="needs root and a working `unshare --pid --fork --mount-proc`"
)


class Namespaced:
    """A python process in a new pid namespace, talked to line by line over stdin/stdout."""

    def __init__(self, body: str, pid: int | None = None) -> None:
        code = CONTENT_SRC + NS_PRELUDE + f"at_pid({pid!r})\n" + textwrap.dedent(body)
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def expect(self, word: str, timeout: float = 60) -> list[str]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {word!r} from the namespaced process") from None
        assert line.split()[:1] == [word], f"expected {word!r}, got {line!r}"
        return line.split()[1:]

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def init_pid(self) -> int:
        """Host pid of the namespace's init: the child unshare forked."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            (child,) = f.read().split()
        return int(child)

    def finish(self) -> int:
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        return self.proc.wait(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.finish()


def _absent_pid() -> int:
    """A pid no host process has (a pid-based liveness check would call its owner dead)."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    rng = random.Random()
    while True:
        pid = rng.randrange(max(1000, pid_max // 2), pid_max)
        if not os.path.exists(f"/proc/{pid}"):
            return pid


# A writer that attaches, reserves its pages and stops right before publishing: says
# "ready", waits for a line, publishes, says "put", then reads the host's samples named on
# the next line and says "ok <count>" if each is exact.
STOPPED_WRITER = """
from routing_replay import RoutingStore
from routing_replay.store.lock import interleave
name, sid, n = {name!r}, {sid!r}, {n}
store = RoutingStore.attach(name)
routes = ns_content(sid, n)
def stop_before_publish(point):
    if point == "put.publish:take":
        print("ready", os.getpid(), flush=True)
        sys.stdin.readline()
with interleave(stop_before_publish):
    store.put(sid, routes)
print("put", flush=True)
assert (store.get(sid) == routes).all()
ids = sys.stdin.readline().split()
bad = [s for s in ids if not np.array_equal(store.get(s), ns_content(s, 16))]
print("ok" if not bad else "bad", len(ids) - len(bad), flush=True)
store.close()
"""


@needs_pid_namespace
def test_namespaced_writer_mid_put_keeps_its_pages(name):
    pages = 5
    with RoutingStore.create(name, NS_LAYOUT, capacity_tokens=20 * 16, page_tokens=16) as store:
        store.put("before", ns_content("before", 40))  # 3 pages
        pid = _absent_pid()
        ns = Namespaced(STOPPED_WRITER.format(name=name, sid="ns", n=pages * 16), pid)
        try:
            assert ns.expect("ready") == [str(pid)]
            assert not os.path.exists(f"/proc/{pid}")  # its pid means nothing here
            assert store.reclaim() == 0
            assert store.stats().pages_pending == pages
            free = 20 - 3 - pages
            host = [f"h{i}" for i in range(free)]
            for s in host:  # one page each: every free page
                store.put(s, ns_content(s, 16), timeout=0)
            with pytest.raises(StoreFullError):
                store.put("one-too-many", ns_content("x", 1), timeout=0)
            stats = store.stats()
            assert (stats.pages_used, stats.pages_pending) == (20 - pages, pages)
            assert store.reclaim() == 0 and store.stats().pages_pending == pages
            store.verify()
            ns.send("go")
            ns.expect("put")
            ns.send(" ".join(host))
            assert ns.expect("ok") == [str(free)]
            assert ns.finish() == 0
        finally:
            ns.kill()
        assert np.array_equal(store.get("ns"), ns_content("ns", pages * 16))
        assert np.array_equal(store.get("before"), ns_content("before", 40))
        for s in host:
            assert np.array_equal(store.get(s), ns_content(s, 16))
        stats = store.stats()
        assert (stats.pages_used, stats.pages_pending, stats.samples) == (20, 0, 2 + free)
        store.verify()


def _status_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return None


@needs_pid_namespace
def test_namespaced_writer_killed_mid_put_is_reclaimed(name):
    pages = 4
    with RoutingStore.create(name, NS_LAYOUT, capacity_tokens=12 * 16, page_tokens=16) as store:
        store.put("kept", ns_content("kept", 32))  # 2 pages
        before = store.stats()
        # The writer is its namespace's init, pid 1: a pid that is alive on the host, so a
        # pid-based check would never free its pages.
        ns = Namespaced(STOPPED_WRITER.format(name=name, sid="doomed", n=pages * 16))
        try:
            assert ns.expect("ready") == ["1"] and os.path.exists("/proc/1")
            inner = ns.init_pid()
            assert store.reclaim() == 0 and store.stats().pages_pending == pages
            os.kill(inner, signal.SIGKILL)  # the python process itself
            assert ns.proc.wait(60) != 0
            assert _status_of(inner) is None  # gone, reaped: not a zombie
        finally:
            ns.kill()
        assert store.stats().pages_pending == pages and "doomed" not in store
        assert store.reclaim() == pages
        assert store.reclaim() == 0
        assert store.stats() == before
        store.verify()
        for i in range(12 - 2):  # every page is usable again
            store.put(f"after{i}", ns_content(f"after{i}", 16), timeout=0)
        with pytest.raises(StoreFullError):
            store.put("one-too-many", ns_content("x", 1), timeout=0)
        assert np.array_equal(store.get("kept"), ns_content("kept", 32))
        store.verify()


# An owner in the namespace: creates the store, puts a sample, says "ready <pid>", and
# keeps it until a line comes; then unlinks it.
NS_OWNER = """
from routing_replay import RoutingStore
with RoutingStore.create({name!r}, NS_LAYOUT, capacity_tokens=64, page_tokens=16) as store:
    store.put("ns", ns_content("ns", 20))
    print("ready", os.getpid(), flush=True)
    sys.stdin.readline()
print("done", flush=True)
"""


@needs_pid_namespace
def test_store_owned_in_another_namespace_is_alive_to_ls_and_sweep(name):
    pid = _absent_pid()
    ns = Namespaced(NS_OWNER.format(name=name), pid)
    try:
        assert ns.expect("ready") == [str(pid)]
        assert not os.path.exists(f"/proc/{pid}")
        out = subprocess.run(
            [sys.executable, "-m", "routing_replay.cli", "ls"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        (row,) = [line for line in out.splitlines() if line.startswith(f"{name} ")]
        assert f"owner {pid} " in row and "(dead)" not in row, row
        assert "1 samples" in row
        out = subprocess.run(
            [sys.executable, "-m", "routing_replay.cli", "sweep"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert segment_path(name) not in out
        assert os.path.exists(segment_path(name))
        store = RoutingStore.attach(name)
        assert store.owner_alive()
        assert np.array_equal(store.get("ns"), ns_content("ns", 20))
        store.close()
        ns.send("go")
        ns.expect("done")
        assert ns.finish() == 0
    finally:
        ns.kill()
    assert not os.path.exists(segment_path(name))
