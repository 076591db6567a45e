"""Repair stopped at any line finishes on the next call (issue 31).

The property: "repair finishes from any point at which it was itself stopped". Repair runs
in the first lock holding after a holder died or raised half-way; a process killed or
interrupted while repairing leaves the dirty flag set, so the next holding repairs again,
from whatever the stopped repair had already changed.

How it is shown. A small spilling store (8-token pages, 8 of them) holds "a" (4 pages, with
token ids) and "b" (4 pages). A forked writer puts "c", which must spill "a", and is
SIGKILLed inside the spill's commit holding (`test_spill._spill_and_die`), in one of the two
torn states a commit can leave after its commit point:

- `commit-field`: the slot's spill field set, its checksum and chain fields still those of
  the sample in memory, its pages not dropped;
- `commit-checksum`: the spill field and the spilled checksum set, the chain fields not.

A second forked child attaches (a fresh handle) and makes its first call, `stats()`, whose
lock holding repairs that. The call is run once to its end under `sys.settrace`, counting
the 'line' events of `routing_replay` code it runs (`line_stops.interrupted_at`; two thirds
of them repair's: `repair`, `Spiller.finish`, the rebuilds; the others take the lock and
read the counters), and checked to have repaired the torn commit. Then, on a fresh store
brought into the same torn state each time, the call is stopped at event N:

- kill: SIGKILL there; the parent's handle (another process) then checks the store;
- interrupt: KeyboardInterrupt there, which the call must end in; the same handle checks
  the store, then (the child alive and idle: no lock held outside a call) the parent.

A check: `verify()` passes; "a" and "b" read back exactly (`get` and `read`, routes and
token ids, compared with the arrays put, never with a read of the store); "c", whose put
the writer never committed, is absent; "a" stays spilled (its commit point was reached);
after `reclaim()` no page is reserved and no spill file is left that no sample needs; a
new put (the parent's needs a spill: the repaired spill tier spills again) reads back
exactly; `verify()` passes again. Failures of all stop points are reported together, one
line per point (event index, file:line, function).

Tiers. The call runs 440 line events from `commit-field` (events 39-329 in `repair` and
what it calls), 390 from `commit-checksum` (39-279). The default tier stops at
every STRIDE-th of repair's own events (5 stop points from `commit-field`, 4 from
`commit-checksum`, for each way: about 1.3 s; the fast tier runs `commit-field`, the slow
tier `commit-checksum` too), in the test's own process; the stress tier at every line
repair runs, at its first run (162 and 154 lines, 632 stop points over both ways; the
1,660 events of the whole calls were all tried once, with no failure). A stop point costs
two forks (the writer, the child) and the checks; the stress tier runs them in two lean
`forkserver` workers (`lean_workers.in_lean_workers`: a fork of the pytest process costs
more), each counting the events itself (the two counts must agree) and taking every second
stop point; their failures are reported together.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import uuid
from typing import Any

import numpy as np
import pytest
from lean_workers import in_lean_workers
from line_stops import interrupted_at
from test_spill import LAYOUTS, P, _spill_and_die, make, spilled_serials

from routing_replay import RoutingStore, to_torch
from routing_replay.store.segment import segment_path
from routing_replay.store.spill import Spiller

FORK = mp.get_context("fork")
LAYOUT = LAYOUTS[0]
PUT_TIMEOUT = 1.0  # a wedged lock fails a check fast
WAIT_S = 60.0  # longest wait for a child's next message
STRIDE = 58  # the default tier stops at every STRIDE-th line event of repair's
TORN = ("commit-field", "commit-checksum")
MODES = ("kill", "interrupt")
# What `Spiller.finish` finds torn in each state: the checksum not yet the spilled one.
TORN_CHECKSUMS = {"commit-field": 1, "commit-checksum": 0}

_rng = np.random.default_rng(31)
A = LAYOUT.random_routes(_rng, 4 * P)
A_TOKENS = _rng.integers(0, 1000, 4 * P)
B = LAYOUT.random_routes(_rng, 4 * P)
AFTER = {  # the checks' own puts: the child's fits in the free pages, the parent's spills
    "after-same": (LAYOUT.random_routes(_rng, 4 * P), _rng.integers(0, 1000, 4 * P)),
    "after-other": (LAYOUT.random_routes(_rng, 6 * P), None),
}
for _routes, _tokens in [(A, A_TOKENS), (B, None), *AFTER.values()]:
    _routes.setflags(write=False)


def one_line(e: BaseException) -> str:
    """An exception as one short line."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def check(
    store: RoutingStore, stored: dict[str, tuple[np.ndarray, Any]], new: str, a_serial: int
) -> tuple[list[str], bool]:
    """Check the whole store through `store` (see the module docstring): the problems
    found (calls failing alike reported once), and whether the check's own put `new` is
    stored."""
    problems: list[str] = []
    errors: dict[str, list[str]] = {}  # error (the store's name left out) -> calls raising it

    def attempt(what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:
            errors.setdefault(one_line(e).replace(store.name, "<store>"), []).append(what)
            return None

    def exact(sample_id: str) -> bool:
        return bool(np.array_equal(store.get(sample_id), stored[sample_id][0]))

    def read_all() -> None:
        ids = list(stored)
        batch = store.read(ids)
        want = np.concatenate([stored[s][0] for s in ids])
        assert np.array_equal(to_torch(batch).numpy(), want), "read: other routes"
        tokens = [None if stored[s][1] is None else stored[s][1].tolist() for s in ids]
        assert batch.column("token_ids").to_pylist() == tokens, "read: other token ids"

    def leftovers() -> None:
        stats = store.stats()
        serials = spilled_serials(store)
        assert stats.pages_pending == 0, f"{stats.pages_pending} pages still reserved"
        assert len(serials) == stats.samples_spilled, (
            f"{len(serials)} spill files for {stats.samples_spilled} spilled samples"
        )
        assert a_serial in serials, "'a' is no longer spilled"

    attempt("verify", store.verify)
    for sid in stored:
        if attempt(f"get {sid!r}", lambda s=sid: exact(s)) is False:
            problems.append(f"get {sid!r} returned other routes")
    attempt("read", read_all)
    if attempt("'c' in store", lambda: "c" in store):
        problems.append("'c', whose put never committed, is stored")
    attempt("reclaim", store.reclaim)
    attempt("leftovers after reclaim", leftovers)
    routes, tokens = AFTER[new]
    attempt(f"put {new!r}", lambda: store.put(new, routes, token_ids=tokens))
    stored = {**stored, new: AFTER[new]}
    put = attempt(f"get {new!r}", lambda: exact(new)) is True
    if not put:
        problems.append(f"the new put {new!r} does not read back")
    attempt("read after the new put", read_all)
    attempt("verify after the new put", store.verify)
    for error, calls in errors.items():
        more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
        problems.append(f"{', '.join(calls[:3])}{more} raised {error}")
    return problems, put


def _first_call(name: str, mode: str, stop: int, a_serial: int, conn: Any) -> None:
    """In a child: attach and run `stats()`, which repairs the torn commit, stopped at line
    event `stop` (mode "count": never); report to `conn`. Never returns."""
    try:
        store = RoutingStore.attach(name, put_timeout=PUT_TIMEOUT)
        lines: list[str] = []
        if mode == "count":
            torn: list[int] = []
            finish = Spiller.finish  # (this child's own copy of the class)
            Spiller.finish = lambda self: torn.append(finish(self)) or torn[-1]
            interrupted_at(0, store.stats, lines=lines)
            conn.send(("done", lines, torn))
        elif mode == "kill":

            def kill() -> None:
                conn.send(("stop", lines[-1]))
                os.kill(os.getpid(), signal.SIGKILL)

            interrupted_at(stop, store.stats, action=kill, lines=lines)
            conn.send(("not stopped", len(lines)))
        else:
            try:
                _, result = interrupted_at(stop, store.stats, lines=lines)
                other = None if result is None else "the call went on past it and returned"
            except BaseException as e:  # (KeyboardInterrupt alone is caught by the helper)
                other = f"the call raised {one_line(e)} in its place"
            if len(lines) < stop:
                conn.send(("not stopped", len(lines)))
            else:
                conn.send(("stopped", lines[-1], other))
                stored = {"a": (A, A_TOKENS), "b": (B, None)}
                conn.send(("report", *check(store, stored, "after-same", a_serial)))
                conn.recv()  # the parent has checked, this process alive and idle
    except BaseException as e:
        conn.send(("error", one_line(e)))
    finally:
        os._exit(0)


class Child:
    """A forked `_first_call` child, as the parent sees it."""

    def __init__(self, name: str, mode: str, stop: int, a_serial: int) -> None:
        self.conn, theirs = FORK.Pipe()
        self.process = FORK.Process(
            target=_first_call, args=(name, mode, stop, a_serial, theirs), daemon=True
        )
        self.process.start()
        theirs.close()

    def next(self) -> tuple:
        """The child's next message; ("eof",) once it is gone, ("timeout",) if silent."""
        if not self.conn.poll(WAIT_S):
            return ("timeout",)
        try:
            return self.conn.recv()
        except EOFError:
            return ("eof",)

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def torn_store(name: str, tmp_path: Any, torn: str) -> tuple[RoutingStore, int]:
    """A new store holding "a" and "b", left by a writer killed mid-commit of its spill of
    "a" (in state `torn`); the owner's handle and a's put serial."""
    store = make(name, tmp_path, pages=8, put_timeout=PUT_TIMEOUT)
    try:
        a_serial = store.put("a", A, token_ids=A_TOKENS).serial
        store.put("b", B)
        writer = FORK.Process(target=_spill_and_die, args=(name, torn))
        writer.start()
        writer.join()
        assert writer.exitcode == -signal.SIGKILL, f"the writer ended with {writer.exitcode}"
        assert store._core.tables.dirty, "the killed commit left no repair to do"
    except BaseException:
        store.close()
        store.unlink()
        raise
    return store, a_serial


def count_events(name: str, tmp_path: Any, torn: str) -> list[str]:
    """Run the repairing call to its end: its line events' places, in order."""
    store, a_serial = torn_store(name, tmp_path, torn)
    child = Child(name, "count", 0, a_serial)
    try:
        msg = child.next()
        assert msg[0] == "done", msg
        _, lines, finished = msg
        assert finished == [TORN_CHECKSUMS[torn]], f"Spiller.finish returned {finished}"
        assert any(line.startswith("store/repair.py:") for line in lines)
        child.close()
        problems, _ = check(store, {"a": (A, A_TOKENS), "b": (B, None)}, "after-other", a_serial)
        assert not problems, problems
        return lines
    finally:
        child.close()
        store.close()
        store.unlink()


def stop_at(name: str, tmp_path: Any, torn: str, mode: str, stop: int, at: str) -> list[str]:
    """Stop the repairing call at event `stop` (counted at `at`); the problems found."""
    store, a_serial = torn_store(name, tmp_path, torn)
    child = Child(name, mode, stop, a_serial)
    stored = {"a": (A, A_TOKENS), "b": (B, None)}
    problems: list[str] = []
    try:
        msg = child.next()
        if msg[0] not in ("stop", "stopped"):
            return [f"the child was not stopped there: {str(msg)[:300]}"]
        if msg[1] != at:
            return [f"stopped at {msg[1]}, not where counted: the events are not deterministic"]
        if mode == "kill":
            child.process.join(WAIT_S)
            if child.process.exitcode != -signal.SIGKILL:
                return [f"the child was not killed: {child.process.exitcode}, {child.next()}"]
        else:
            if msg[2] is not None:
                problems.append(msg[2])
            msg = child.next()
            if msg[0] != "report":
                return [*problems, f"the child's check did not end: {str(msg)[:300]}"]
            problems += [f"same handle: {p}" for p in msg[1]]
            if msg[2]:
                stored["after-same"] = AFTER["after-same"]
        found, _ = check(store, stored, "after-other", a_serial)
        return problems + [f"another process: {p}" for p in found]
    finally:
        if mode == "interrupt":
            with contextlib.suppress(OSError):  # (gone already)
                child.conn.send("done")
        child.close()
        store.close()
        store.unlink()


def sampled(lines: list[str]) -> range:
    """The default tier's stop points: every STRIDE-th event of repair's own, from the
    first line of `repair` to its last (event numbers count from 1)."""
    inside = [n for n, line in enumerate(lines, 1) if line.startswith("store/repair.py:")]
    return range(inside[0] + STRIDE // 2, inside[-1] + 1, STRIDE)


def each_line(lines: list[str]) -> list[int]:
    """The stress tier's stop points: every line from the first line of `repair` to its last,
    at its first run there (a loop's further runs repeat what the first showed)."""
    inside = [n for n, line in enumerate(lines, 1) if line.startswith("store/repair.py:")]
    seen: set[str] = set()
    stops = []
    for n in range(inside[0], inside[-1] + 1):
        if lines[n - 1] not in seen:
            seen.add(lines[n - 1])
            stops.append(n)
    return stops


def run_points(
    torn: str, mode: str, every: bool, spill_root: str, prefix: str, part: int = 0, parts: int = 1
) -> tuple[list[str], list[tuple[int, str]]]:
    """Count the events here, then stop at every `parts`-th of the stop points from `part`
    (in a worker of the stress tier, or in the test's own process): (the events' places,
    each failing stop point and its report line). Counted and stopped in one process: each
    child is forked from it and runs the lines its state leads to."""
    lines = count_events(f"{prefix}-count", spill_root, torn)
    stops = each_line(lines) if every else sampled(lines)
    failures = []
    for n in stops[part::parts]:
        at = lines[n - 1]
        problems = stop_at(f"{prefix}-{n}", spill_root, torn, mode, n, at)
        if problems:
            more = f" | (+{len(problems) - 4} more)" if len(problems) > 4 else ""
            failures.append((n, f"#{n} {at}: " + " | ".join(problems[:4]) + more))
    return lines, failures


def run(torn: str, mode: str, tmp_path: Any, every: bool) -> None:
    prefix = f"test-repair-stops-{uuid.uuid4().hex[:8]}"
    spill_root = tmp_path / "spill"
    spill_root.mkdir()
    if every:  # two lean workers, half of the stop points each: a fork of pytest costs more
        args = [(torn, mode, every, str(spill_root), f"{prefix}{i}", i, 2) for i in (0, 1)]
        parts = in_lean_workers(run_points, args)
        assert parts[0][0] == parts[1][0], "the workers counted other events"
        lines, failures = parts[0][0], sorted(f for _, part in parts for f in part)
    else:
        lines, failures = run_points(torn, mode, every, str(spill_root), prefix)
    stops = each_line(lines) if every else sampled(lines)
    assert os.listdir(spill_root) == []  # every store's directory went with its unlink
    shm = os.path.dirname(segment_path(prefix))
    assert not [f for f in os.listdir(shm) if f.startswith(f"rr_{prefix}")]
    assert not failures, (
        f"{torn}, {mode}: {len(failures)} of {len(stops)} stop points ({len(lines)} events) "
        "leave a store that does not repair:\n" + "\n".join(text for _, text in failures)
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "torn",
    [TORN[0], pytest.param(TORN[1], marks=pytest.mark.slow)],  # fast tier: one state
)
def test_repair_stopped_at_sampled_lines_finishes_on_the_next_call(torn, mode, tmp_path):
    run(torn, mode, tmp_path, every=False)


@pytest.mark.stress
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("torn", TORN)
def test_repair_stopped_at_each_line_finishes_on_the_next_call(torn, mode, tmp_path):
    run(torn, mode, tmp_path, every=True)
