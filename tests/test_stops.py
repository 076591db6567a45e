"""A store call stopped at any line leaves a whole store (issue 31).

The property: "A store call can be stopped at any line (SIGKILL, Ctrl-C, an exception from
below) and the next call, in this process or another, finds a whole store."

How it is shown. A scenario is a small spilling store (8-token pages, 12 of them) filled
with samples (a GRPO group sharing its prompt pages through token ids, samples with and
without token ids), then a sequence of store calls:

- `spill`: a put that must spill two samples (s0, and g-0, whose prompt pages stay shared),
  a read of a spilled and an in-memory sample, a release of a spilled and an in-memory one;
- `load`: `load_routes` of a small archive (made with `save_routes`: two samples sharing the
  group's prompt, whose pages the store already holds, and one without token ids) into a
  store with room for it (one `put_many`; the spill path is the `spill` scenario's);
- `release`: one `release` of several samples (all or none): spilled with shared pages, in
  memory with shared pages, in memory alone.

The sequence is run once, to its end, under `sys.settrace` to count every 'line' event in
frames whose code lies in the installed `routing_replay` package (nothing else is traced)
and check that it spills what the scenario says. Then, for each stop point N (an event
index), a forked child fills a freshly made store, runs the sequence again and is stopped
at event N:

- SIGKILL: the tracer kills the child there; the parent then checks the store;
- KeyboardInterrupt: the tracer raises it there, once. The call must end in it (another
  exception in its place is a failure). While the child sits idle, the parent makes store
  calls on its own handle (`stats`, `verify`): another process must not find the store
  wedged. Then the child checks the store through the same handle it was interrupted on,
  and once the child has exited, the parent checks again.
- nested: the tracer calls the store there, on the same handle and thread, as a signal
  handler would (`stats()`, a lookup). The nested call runs, or is refused with
  `StoreBusyError` (raised into the outer call, as a handler's error is), never inside the
  outer call's change; the sequence goes on or ends in that error; then the same checks.

A check (`check`): `verify()` passes; every sample put before the sequence and not
released by it reads back exactly (`get` and `read`, routes and token ids, compared with the
arrays the test put, never with a read of the store); the interrupted call's samples are
all absent or all exact (a put and a release are all or none); `len(store)` counts what
is readable; after `reclaim()` no page is left reserved and no spill file is left that no
sample needs; a new put (sharing the group's prompt) and a read of it succeed. Any
unexpected exception is a failure naming the stop point (event index, file:line, function).
Failures are collected over all stop points and reported together, one line per point.

Tiers. The scenarios have 2819, 1790 and 584 events. A stop point costs a fork, a fill and
a check: 20-40 ms, in two lean `forkserver` workers that each count the events themselves
(a fork of the pytest process costs 3x more). The stress tier (slow) stops at each distinct
(file, line) at its first and its second event: 1498, 1030 and 374 stop points for kill
and interrupt; for nested, each line where a lock is held at its first event (532, 235,
184): 6,755 in all. The default
tier runs the spill scenario, every STRIDE-th of its stop points (10, 10 and 4): about 2 s.
"""

from __future__ import annotations

import functools
import glob
import multiprocessing as mp
import os
import re
import signal
import sys
import time
import traceback
import uuid
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import routing_replay
from routing_replay import (
    PutRequest,
    RoutingLayout,
    RoutingStore,
    load_routes,
    save_routes,
    to_torch,
)
from routing_replay.errors import StoreBusyError
from routing_replay.store.segment import segment_path

LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=16)
P = 8  # tokens per page
PAGES = 12  # pages per store: the set-up fills 9
PUT_TIMEOUT = 1.0  # a wedged lock or a full store fails fast
BUDGET = 1 << 20  # spill budget: room for every spill here
PKG = os.path.dirname(os.path.abspath(routing_replay.__file__)) + os.sep
FORK = mp.get_context("fork")
LEAN = mp.get_context("forkserver")  # workers forked from a process that imported little
HELD = " [held]"  # marks a counted event where the call holds one of the handle's locks
WAIT_S = 60.0  # longest wait for a child's next message
STRIDE = 150  # the default tier stops at every STRIDE-th stop point of the stress tier

# Sample id -> (tokens, prompt group or None, put with token ids). Samples of a group share
# its 2-page prompt (routes and token ids), so their puts share its pages.
SPEC = {
    "s0": (2 * P, None, True),
    "g-0": (2 * P + 5, "g", True),
    "g-1": (3 * P, "g", True),
    "g-2": (2 * P + 3, "g", True),
    "s1": (2 * P, None, False),
    "new": (6 * P, None, True),
    "a-0": (2 * P + 4, "g", True),
    "a-1": (3 * P, "g", True),
    "a-2": (P + 2, None, False),
}
AFTER = (2 * P + 3, "g", True)  # the checks' own puts ("after-..."): share g's prompt
FILL = (("s0",), ("g-0", "g-1", "g-2"), ("s1",))  # 2 + 5 + 2 = 9 of 12 pages
ARCHIVED = ("a-0", "a-1", "a-2")


@functools.cache
def content(sample_id: str) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    """The routes, token ids (None: put without) and prompt length a sample id stands for,
    the same in every process."""
    num_tokens, group, with_ids = SPEC.get(sample_id, AFTER)
    rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
    routes = LAYOUT.random_routes(rng, num_tokens)
    tokens = rng.integers(0, 1000, num_tokens)
    if group is not None:
        g = np.random.default_rng(zlib.crc32(group.encode()))
        routes[: 2 * P] = LAYOUT.random_routes(g, 2 * P)
        tokens[: 2 * P] = g.integers(0, 1000, 2 * P)
    routes[-1] = -1  # the last row is never forwarded: missing
    routes.setflags(write=False)
    tokens.setflags(write=False)
    return routes, tokens if with_ids else None, None if group is None else 2 * P


def request(sample_id: str) -> PutRequest:
    routes, tokens, prompt_len = content(sample_id)
    return PutRequest(sample_id, routes, prompt_len, tokens)


def put_group(store: RoutingStore, sample_ids: tuple[str, ...]) -> None:
    """Put samples: one alone with `put`, several with one `put_many`."""
    if len(sample_ids) == 1:
        r = request(sample_ids[0])
        store.put(r.sample_id, r.routes, prompt_len=r.prompt_len, token_ids=r.token_ids)
    else:
        store.put_many([request(s) for s in sample_ids])


def read_back(batch: Any, sample_ids: list[str]) -> None:
    """Assert that a read's batch holds exactly the samples' routes and token ids."""
    assert batch.column("sample_id").to_pylist() == sample_ids
    want = np.concatenate([content(s)[0] for s in sample_ids])
    assert np.array_equal(to_torch(batch).numpy(), want), "routes differ"
    tokens = [None if content(s)[1] is None else content(s)[1].tolist() for s in sample_ids]
    assert batch.column("token_ids").to_pylist() == tokens, "token ids differ"


# -- scenarios ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One store call of a sequence, and what it puts and releases (each all or none)."""

    name: str
    call: Callable[[RoutingStore, str], Any]  # (store, archive path) -> its result
    check: Callable[[Any], None] = lambda result: None  # of its result, untraced
    puts: tuple[str, ...] = ()
    releases: tuple[str, ...] = ()
    spilled: tuple[str, ...] = ()  # in spill files once it ended (unstopped; count checked)


@dataclass(frozen=True)
class Scenario:
    """A store's fill, then the sequence of calls stopped at each of its lines."""

    name: str
    fill: tuple[tuple[str, ...], ...]  # put before the sequence, group by group
    steps: tuple[Step, ...]

    def expect(self, phase: int) -> tuple[dict[str, str], list[tuple[str, ...]]]:
        """Each sample's state once the sequence was stopped in step `phase` ("present",
        "absent" or "either"), and the groups whose samples must all be in one state."""
        states = {s: "present" for group in self.fill for s in group}
        for i, step in enumerate(self.steps[: phase + 1]):
            for s in step.puts:
                states[s] = "either" if i == phase else "present"
            for s in step.releases:
                states[s] = "either" if i == phase else "absent"
        if phase >= len(self.steps):
            return states, []
        step = self.steps[phase]
        return states, [g for g in (step.puts, step.releases) if len(g) > 1]


def _loaded(refs: list[Any]) -> None:
    assert [r.sample_id for r in refs] == list(ARCHIVED)


SCENARIOS = {
    "spill": Scenario(
        "spill",
        FILL,
        (
            # 6 pages into 3 free: spills s0 (2 pages) and g-0 (1 page of its own).
            Step(
                "put",
                lambda store, _: put_group(store, ("new",)),
                puts=("new",),
                spilled=("s0", "g-0"),
            ),
            Step(
                "read",
                lambda store, _: store.read(["g-0", "g-1"]),  # spilled, in memory
                check=lambda batch: read_back(batch, ["g-0", "g-1"]),
                spilled=("s0", "g-0"),
            ),
            Step(
                "release",
                lambda store, _: store.release(["s0", "s1"]),  # spilled, in memory
                releases=("s0", "s1"),
                spilled=("g-0",),
            ),
        ),
    ),
    "load": Scenario(
        "load",
        FILL[:2],  # room for the load: 4 new pages (a-0 and a-1 share g's prompt pages)
        (Step("load_routes", lambda store, path: load_routes(path, store), _loaded, ARCHIVED),),
    ),
    "release": Scenario(
        "release",
        (*FILL, ("new",)),  # s0 and g-0 spilled
        (
            Step(
                "release",
                lambda store, _: store.release(["g-0", "g-1", "s1"]),
                releases=("g-0", "g-1", "s1"),
                spilled=("s0",),
            ),
        ),
    ),
}


def make_archive(path: str) -> None:
    """Save the archived samples (a pair sharing a prompt, one without token ids)."""
    name = f"stops-archive-{uuid.uuid4().hex[:10]}"
    with RoutingStore.create(name, LAYOUT, 64 * P, page_tokens=P) as store:
        refs = store.put_many([request(s) for s in ARCHIVED])
        save_routes(path, refs, read=store.read)


# -- the check ------------------------------------------------------------------------------


class Wedged(Exception):
    """The store's lock stayed held: further checks would only wait and say so again."""


def check(
    store: RoutingStore,
    spill_root: str,
    states: dict[str, str],
    together: list[tuple[str, ...]],
    tag: str,
) -> tuple[list[str], dict[str, bool]]:
    """Check the whole store through `store`, whose spill directory is under `spill_root`
    (see the module docstring); returns the
    problems found (calls failing alike reported once) and which samples are stored (the
    check's own put included)."""
    problems: list[str] = []
    errors: dict[str, list[str]] = {}  # error -> the calls that raised it

    def attempt(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except StoreBusyError as e:
            errors.setdefault(one_line(e), []).append(what)
            raise Wedged from e  # every later call would wait and fail alike
        except Exception as e:
            errors.setdefault(one_line(e), []).append(what)
            return None

    found: dict[str, bool] = {}
    try:
        attempt("verify", store.verify)
        for sid, state in states.items():
            found[sid] = there = attempt(f"{sid!r} in store", lambda s=sid: s in store)
            if there is None:
                continue
            if (state == "present" and not there) or (state == "absent" and there):
                problems.append(f"{sid!r} should be {state}, is {'not ' * (not there)}stored")
            elif there and attempt(f"get {sid!r}", lambda s=sid: check_get(store, s)) is False:
                problems.append(f"get {sid!r} returned other routes")
        for group in together:
            if len({found.get(s) for s in group}) > 1:
                problems.append(f"{group} are not all or none stored: {found}")
        stored = [s for s in states if found.get(s)]
        if stored:
            attempt("read", lambda: read_back(store.read(stored), stored))
        n = attempt("len", lambda: len(store))
        if None not in found.values() and n is not None and n != len(stored):
            problems.append(f"len(store) = {n}, {len(stored)} samples are stored")
        attempt("reclaim", store.reclaim)
        attempt("leftovers after reclaim", lambda: no_leftovers(store, spill_root))
        after = "after-" + re.sub(r"\W+", "-", tag)
        attempt("new put", lambda: put_group(store, (after,)))
        found[after] = attempt(f"get {after!r}", lambda: check_get(store, after)) is True
        if not found[after]:
            problems.append(f"the new put {after!r} does not read back")
        attempt("verify after the new put", store.verify)
    except Wedged:
        pass
    for error, calls in errors.items():
        more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
        problems.append(f"{', '.join(calls[:3])}{more} raised {error}")
    return [f"{tag}: {p}" for p in problems], found


def one_line(e: BaseException) -> str:
    """An exception as one short line (an assertion's own message, without pytest's)."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def check_get(store: RoutingStore, sample_id: str) -> bool:
    return bool(np.array_equal(store.get(sample_id), content(sample_id)[0]))


def spill_dir(store: RoutingStore, spill_root: str) -> str:
    """The store's own directory of spill files under `spill_root` (`rr_<name>-<uid>`)."""
    (path,) = glob.glob(os.path.join(glob.escape(spill_root), f"rr_{store.name}-*"))
    return path


def no_leftovers(store: RoutingStore, spill_root: str) -> None:
    """No page reserved, and no spill file but the spilled samples' (verify checks those)."""
    stats = store.stats()
    files = sorted([f for f in os.listdir(spill_dir(store, spill_root)) if f.endswith(".spill")])
    assert stats.pages_pending == 0, f"{stats.pages_pending} pages still reserved"
    assert len(files) == stats.samples_spilled, (
        f"{len(files)} spill files for {stats.samples_spilled} spilled samples: {files}"
    )


# -- the traced child -----------------------------------------------------------------------


_OURS: dict[Any, bool] = {}  # code object -> whether it is the package's


def _ours(code: Any) -> bool:
    ours = _OURS.get(code)
    if ours is None:
        ours = _OURS[code] = code.co_filename.startswith(PKG)
    return ours


def where(frame: Any) -> str:
    """A line event's place: file (in the package), line, function."""
    code = frame.f_code
    return f"{code.co_filename[len(PKG) :]}:{frame.f_lineno} {code.co_qualname}"


class Tracer:
    """Counts 'line' events of package code; at event `stop`, kills this process ("kill"),
    raises KeyboardInterrupt once ("interrupt"), calls the store as a signal handler would
    ("nested": `stats()` and a lookup on the same handle, its error raised there as a
    handler's is), or only records ("count")."""

    def __init__(self, mode: str, stop: int, conn: Any) -> None:
        self.mode, self.stop, self.conn = mode, stop, conn
        self.events = 0
        self.lines: list[str] = []  # every event's place ("count")
        self.at: str | None = None  # the stop's place
        self.store: RoutingStore | None = None  # the handle a "nested" call uses
        self.inner: str | None = None  # how the nested call ended

    def start(self) -> None:
        sys.settrace(self._call)

    def pause(self) -> None:
        sys.settrace(None)

    def _call(self, frame: Any, event: str, arg: Any) -> Any:
        return self._line if _ours(frame.f_code) else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "line":
            return self._line
        n, self.events = self.events, self.events + 1
        if self.mode == "count":
            held = self.store is not None and (
                self.store._core.lock._mutex.owned() or self.store._core.spill._mutex.owned()
            )
            self.lines.append(where(frame) + HELD * held)
        elif n == self.stop:
            self.at = where(frame)
            if self.mode == "nested":
                return self._nested()
            if self.mode == "kill":
                self.conn.send(("stop", self.at))
                os.kill(os.getpid(), signal.SIGKILL)
            sys.settrace(None)
            raise KeyboardInterrupt  # (an exception from a tracer also ends tracing)
        return self._line

    def _nested(self) -> Any:
        sys.settrace(None)  # the handler's own lines are not events of the sequence
        try:
            self.store.stats()
            assert ("g-1" in self.store) is not None
            self.inner = "ok"
        except StoreBusyError:
            self.inner = "StoreBusyError"
            raise  # into the interrupted line, as a handler's error is
        except BaseException as e:
            self.inner = describe(e)
            raise
        finally:
            sys.settrace(self._call)
        return self._line


def _child(conn: Any, run: Run) -> None:
    """Fill the store, run the sequence traced, stopped at event `run.stop`; report. Never
    returns."""
    phase, scenario = -1, run.scenario
    tracer = Tracer(run.mode, run.stop, conn)
    try:
        for sample_id in SPEC:
            content(sample_id)  # computed before the trace: no event of the test's own
        store = RoutingStore.attach(run.store.name, put_timeout=PUT_TIMEOUT)
        tracer.store = store
        for group in scenario.fill:
            put_group(store, group)
        try:
            for phase, step in enumerate(scenario.steps):
                conn.send(("phase", phase))
                tracer.start()
                result = step.call(store, run.archive)
                tracer.pause()
                step.check(result)
                if run.mode == "count":
                    conn.send(("spilled", phase, store.stats().samples_spilled))
        except BaseException as e:
            tracer.pause()
            if tracer.at is None or (run.mode == "nested" and tracer.inner != "StoreBusyError"):
                raise  # not stopped yet, or not by the stop: the sequence itself failed
            if run.mode == "nested":  # refused inside the outer call, which then failed
                conn.send(("nested", tracer.inner, describe(e)))
                states, together = scenario.expect(phase)
                conn.send(("report", *check(store, run.spill_root, states, together, "same")))
                return
            # Interrupted: the call should end in the KeyboardInterrupt; say if not.
            other = None if type(e) is KeyboardInterrupt else describe(e)
            conn.send(("stopped", phase, tracer.at, other))
            conn.recv()  # the parent has looked from its process
            states, together = scenario.expect(phase)
            conn.send(("report", *check(store, run.spill_root, states, together, "same handle")))
        else:
            if run.mode == "nested":  # the nested call ran, and the sequence to its end
                conn.send(("nested", tracer.inner, None))
                states, together = scenario.expect(len(scenario.steps))
                conn.send(("report", *check(store, run.spill_root, states, together, "same")))
                return
            conn.send(("done", tracer.events, tracer.lines))
    except BaseException as e:
        tracer.pause()
        conn.send(("error", phase, tracer.at, describe(e), traceback.format_exc(limit=-6)))
    finally:
        os._exit(0)


def describe(e: BaseException) -> str:
    """An exception in one line, with the exceptions it was raised while handling."""
    text = one_line(e)
    while (e := e.__context__) is not None:
        text += f" (raised while handling {one_line(e)})"
    return text


# -- the parent -----------------------------------------------------------------------------


@dataclass
class Run:
    """One forked child on a fresh store, as the parent sees it."""

    scenario: Scenario
    store: RoutingStore  # the parent's handle (the owner)
    spill_root: str
    archive: str
    mode: str
    stop: int = -1
    pid: int = 0
    conn: Any = None
    phase: int = -1

    def start(self) -> None:
        self.conn, child_end = FORK.Pipe()
        self.pid = os.fork()
        if self.pid == 0:
            self.conn.close()
            _child(child_end, self)
        child_end.close()

    def next(self) -> tuple:
        """The child's next message other than its phase; ("eof",) once it is gone."""
        while True:
            if not self.conn.poll(WAIT_S):
                return ("timeout",)
            try:
                msg = self.conn.recv()
            except EOFError:
                return ("eof",)
            if msg[0] != "phase":
                return msg
            self.phase = msg[1]

    def wait(self) -> int:
        """The child's wait status once it ended (killed if it had not ended in time)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return status
            time.sleep(0.001)
        os.kill(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        self.pid = 0
        return status

    def close(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        if self.conn is not None:
            self.conn.close()


def fresh_store(name: str, spill_root: str) -> RoutingStore:
    return RoutingStore.create(
        name,
        LAYOUT,
        PAGES * P,
        page_tokens=P,
        spill_dir=spill_root,
        spill_budget=BUDGET,
        put_timeout=PUT_TIMEOUT,
    )


def count_events(scenario: Scenario, name: str, spill_root: str, archive: str) -> list[str]:
    """Run the sequence to its end once: every line event's place, in order (marked HELD
    where the call holds one of the handle's locks: where a nested call can be refused)."""
    store = fresh_store(name, spill_root)
    run = Run(scenario, store, spill_root, archive, "count")
    try:
        run.start()
        for step in scenario.steps:  # the sequence spills what the scenario says
            assert run.next() == ("spilled", run.phase, len(step.spilled)), step.name
        msg = run.next()
        assert msg[0] == "done", msg
        problems, _ = check(store, spill_root, *scenario.expect(len(scenario.steps)), "unstopped")
        assert not problems, problems
        return msg[2]
    finally:
        run.close()
        store.close()
        store.unlink()


def stop_at(
    scenario: Scenario, name: str, spill_root: str, archive: str, mode: str, stop: int, at: str
) -> list[str]:
    """Run the sequence stopped at event `stop` (counted at `at`) in a child; the problems
    found, each on one line."""
    store = fresh_store(name, spill_root)
    run = Run(scenario, store, spill_root, archive, mode, stop)
    try:
        run.start()
        problems = {"kill": killed, "interrupt": interrupted, "nested": nested}[mode](run, at)
        files = spill_dir(store, spill_root)
        short = {files: "<spill dir>", spill_root: "<spill root>", store.name: "<store>"}
        for long, token in short.items():
            problems = [p.replace(long, token) for p in problems]
        return problems
    finally:
        run.close()
        store.close()
        store.unlink()


def killed(run: Run, at: str) -> list[str]:
    """SIGKILL: the child dies at the stop; another process then finds a whole store."""
    msg = run.next()
    if msg[0] == "stop":
        if msg[1] != at:
            return [f"stopped at {msg[1]}, not where counted: the events are not deterministic"]
        msg = run.next()
    status = run.wait()
    if msg[0] != "eof" or not os.WIFSIGNALED(status):
        return [f"the child was not killed at the stop: {str(msg)[:300]}"]
    return check(run.store, run.spill_root, *run.scenario.expect(run.phase), "another process")[0]


def interrupted(run: Run, at: str) -> list[str]:
    """KeyboardInterrupt: while the child is idle another process is not kept out; then the
    child checks through the same handle; then another process, once the child is gone."""
    msg = run.next()
    if msg[0] != "stopped":
        return [f"the child was not interrupted at the stop: {str(msg)[:300]}"]
    _, _, stopped_at, other = msg
    if stopped_at != at:
        return [f"stopped at {stopped_at}, not where counted: the events are not deterministic"]
    problems = [] if other is None else [f"the call raised {other}"]
    try:
        run.store.stats()
        run.store.verify()
    except Exception as e:
        problems.append(f"another process, child idle: {one_line(e)}")
    run.conn.send("go")
    msg = run.next()
    if msg[0] != "report":
        return [*problems, f"the child's check did not end: {str(msg)[:300]}"]
    _, child_problems, found = msg
    run.wait()
    # What the child found stored or not stays so; its own put is stored.
    states, _ = run.scenario.expect(run.phase)
    states = {s: {True: "present", False: "absent"}.get(found.get(s), v) for s, v in states.items()}
    states.update({s: "present" for s, there in found.items() if there and s not in states})
    gone = check(run.store, run.spill_root, states, [], "another process, child gone")[0]
    return [*problems, *child_problems, *gone]


def nested(run: Run, at: str) -> list[str]:
    """A store call made at the stop on the same thread (a signal handler's): it runs, or is
    refused with StoreBusyError, which the outer call then raises; the store stays whole."""
    msg = run.next()
    if msg[0] != "nested":
        return [f"the nested call did not end as allowed: {str(msg)[:300]}"]
    _, inner, outer = msg
    problems = []
    if inner not in ("ok", "StoreBusyError"):
        problems.append(f"the nested call raised {inner}")
    if outer is not None and not outer.startswith("StoreBusyError"):
        problems.append(f"the outer call raised {outer}")
    msg = run.next()
    if msg[0] != "report":
        return [*problems, f"the child's check did not end: {str(msg)[:300]}"]
    _, child_problems, found = msg
    run.wait()
    states = {s: "present" if there else "absent" for s, there in found.items()}
    gone = check(run.store, run.spill_root, states, [], "another process, child gone")[0]
    return [*problems, *child_problems, *gone]


def stop_points(events: list[str], every: bool, mode: str) -> list[int]:
    """The stress tier's stop points: each distinct line at its first and second event (for
    "nested", its first, and only where the call holds a lock: elsewhere a nested call
    simply runs);
    the default tier's: every STRIDE-th of those."""
    seen: Counter[str] = Counter()
    points = []
    runs = 1 if mode == "nested" else 2  # (a nested call: the lock held at a line, once)
    for n, place in enumerate(events):
        seen[place] += 1
        if seen[place] <= runs and (mode != "nested" or place.endswith(HELD)):
            points.append(n)
    return points if every else points[STRIDE // 2 :: STRIDE]


def warm_up(archive: str) -> None:
    """Load the archive once in this process: each forked child then finds Arrow's memory
    pool and threads started, instead of starting them (a 10x slower load)."""
    name = f"stops-warm-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(name, LAYOUT, 64 * P, page_tokens=P) as store:
        load_routes(archive, store)


def run_points(
    name: str, mode: str, every: bool, tmp: str, prefix: str, part: int = 0, parts: int = 1
) -> tuple[int, int, list[str]]:
    """Count the events here, then stop at every `parts`-th of the stop points from `part`
    (in a worker of the stress tier, or in the test's own process): (events, stop points,
    failures). Counted and stopped in one process: which lines run depends on its state
    (caches, Arrow's threads), and each fork inherits it."""
    scenario = SCENARIOS[name]
    spill_root, archive = os.path.join(tmp, "spill"), os.path.join(tmp, "routes.arrow")
    warm_up(archive)
    events = count_events(scenario, f"{prefix}-count", spill_root, archive)
    points = stop_points(events, every, mode)
    failures = []
    for n in points[part::parts]:
        at = events[n].removesuffix(HELD)
        problems = stop_at(scenario, f"{prefix}-{n}", spill_root, archive, mode, n, at)
        if problems:
            more = f" | (+{len(problems) - 4} more)" if len(problems) > 4 else ""
            failures.append(f"#{n} {at}: " + " | ".join(problems[:4]) + more)
    return len(events), len(points), failures


def run_scenario(scenario: Scenario, mode: str, tmp_path: Any, every: bool) -> None:
    os.makedirs(tmp_path / "spill")
    make_archive(str(tmp_path / "routes.arrow"))
    prefix = f"stops-{uuid.uuid4().hex[:8]}"
    if every:  # two lean workers: a fork of this pytest process costs 3x more
        args = [(scenario.name, mode, every, str(tmp_path), f"{prefix}{i}", i, 2) for i in (0, 1)]
        with LEAN.Pool(2) as pool:
            parts = pool.starmap(run_points, args)
        assert len({(e, p) for e, p, _ in parts}) == 1, "the workers counted other events"
        (events, points, _), failures = parts[0], [f for _, _, part in parts for f in part]
    else:
        events, points, failures = run_points(scenario.name, mode, every, str(tmp_path), prefix)
    assert os.listdir(tmp_path / "spill") == []
    shm = os.path.dirname(segment_path(prefix))
    assert not [f for f in os.listdir(shm) if f.startswith(f"rr_{prefix}")]
    assert not failures, (
        f"{scenario.name}, {mode}: {len(failures)} of {points} stop points "
        f"({events} events) leave a broken store:\n" + "\n".join(failures)
    )


MODES = ["kill", "interrupt", "nested"]
CASES = [(s, m) for s in SCENARIOS for m in MODES]


@pytest.mark.parametrize("mode", MODES)
def test_stopped_at_sampled_lines(mode, tmp_path, scenario="spill"):  # the others: stress
    run_scenario(SCENARIOS[scenario], mode, tmp_path, every=False)


@pytest.mark.stress
@pytest.mark.parametrize(("scenario", "mode"), CASES)
def test_stopped_at_each_line(scenario, mode, tmp_path):
    run_scenario(SCENARIOS[scenario], mode, tmp_path, every=True)
