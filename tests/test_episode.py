"""Multi-turn episodes on a real transformers MoE model: turns captured, one sample stored."""

from __future__ import annotations

import contextlib
import gc
import inspect
import linecache
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from line_stops import PACKAGE, forked_at, interrupted_at

from routing_replay import (
    MISSING,
    Episode,
    RoutingLayout,
    RoutingRef,
    RoutingReplayError,
    RoutingStore,
    capture,
    replay,
)
from routing_replay.errors import (
    DuplicateSampleError,
    InvalidArgumentError,
    InvalidRoutesError,
    StoreBusyError,
    TokenMismatchError,
)
from routing_replay.model.adapters import find_routers
from routing_replay.model.agreement import routing_agreement
from routing_replay.store.segment import FORKED_INSIDE_EXIT
from routing_replay.testing import tiny_moe


@pytest.fixture(scope="module")
def model():
    return tiny_moe(seed=0)


def generate(model, tokens, new=5):
    """One engine turn: greedy continuation of `tokens`, and its routes as captured."""
    with capture(model) as cap, torch.no_grad():
        model.generate(
            input_ids=torch.tensor([tokens]),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    (ids,), (routes,) = cap.token_ids(), cap.routes()
    return ids.tolist(), routes


def test_three_turns_with_tool_output_and_prefix_cached_rows(model, name):
    layout = find_routers(model).layout
    with RoutingStore.create(name, layout, 4096, page_tokens=8) as store:
        episode = Episode(store, "ep7", prompt_len=9)
        tokens1, routes1 = generate(model, list(range(10, 19)))  # 9 prompt + 5 new
        episode.add_turn(tokens1, routes1, policy_version=0)
        # Turn 2: a tool's output appended, the engine prefix-caches the history and is
        # asked for rows from the first token it did not forward (turn 1's last).
        start = len(tokens1) - 1
        tokens2, full2 = generate(model, [*tokens1, 40, 41, 42])
        asked2 = full2.copy()
        asked2[:start] = MISSING
        ref2 = episode.add_turn(tokens2, asked2, policy_version=1)
        shared_after_two = store.stats().dedup_saved_bytes
        tokens3, full3 = generate(model, [*tokens2, 50, 51])
        changed = list(tokens3)
        changed[3] += 1  # the template re-tokenised the history
        with pytest.raises(TokenMismatchError, match=r"episode 'ep7' turn 3: token 3 of the"):
            episode.add_turn(changed, full3, policy_version=1)
        assert store.stats().samples == 2  # nothing put for the refused turn
        asked3 = full3.copy()
        asked3[: len(tokens2) - 1] = MISSING
        episode.add_turn(tokens3, asked3, policy_version=1)
        final = episode.close()
        assert final.sample_id == "ep7-t3" and store.stats().samples == 1
        with pytest.raises(RoutingReplayError, match="is closed"):
            episode.add_turn([*tokens3, 1], np.vstack([asked3, asked3[-1:]]))

        # The episode is exactly what the engine produced, turn by turn.
        s1, s2 = len(tokens1) - 1, len(tokens2) - 1
        want = np.concatenate([routes1[:s1], full2[s1:s2], full3[s2:]])
        got = layout.decode(store.get(final))
        np.testing.assert_array_equal(got, want)
        assert (got[:-1] != MISSING).all() and (got[-1] == MISSING).all()
        assert final.policy_versions == ((0, 0), (len(tokens1), 1))
        assert final.prompt_len == 9 and ref2.num_tokens == len(tokens2)
        assert shared_after_two >= 8 * layout.bytes_per_token  # turn 1's full page shared

        # Replayed in the trainer: every recorded row is the experts' choice.
        routes = torch.from_numpy(got.astype(np.int64))[None]
        with replay(model, routes, layout=layout), capture(model) as cap, torch.no_grad():
            model(input_ids=torch.tensor([tokens3]))
        agreement = routing_agreement([got], cap.routes(), layout)
        assert agreement.router_agreement == 1.0
        assert agreement.num_tokens == len(tokens3) - 1


def test_turn_checks(model, name):
    layout = find_routers(model).layout
    with RoutingStore.create(name, layout, 4096) as store:
        episode = Episode(store, "e")
        tokens, routes = generate(model, [10, 11, 12])
        with pytest.raises(RoutingReplayError, match="has no turns"):
            episode.close()
        with pytest.raises(InvalidRoutesError, match="7 rows of routes for 8 tokens"):
            episode.add_turn(tokens, routes[:-1])
        episode.add_turn(tokens, routes)
        with pytest.raises(InvalidRoutesError, match="no more than the 8 of the turns before"):
            episode.add_turn(tokens, routes)
        more, more_routes = generate(model, [*tokens, 20])
        versioned = Episode(store, "w")
        versioned.add_turn(tokens, routes, policy_version=0)
        with pytest.raises(InvalidRoutesError, match="pass policy_version for every turn"):
            versioned.add_turn(more, more_routes)
        narrow = layout.encode(more_routes)  # uint8 with the marker, as vLLM hands ids over
        ref = episode.add_turn(more, narrow)
        np.testing.assert_array_equal(layout.decode(store.get(ref))[:-1], more_routes[:-1])


def test_stored_history_rows_win_over_recomputed_ones(model, name):
    layout = find_routers(model).layout
    with RoutingStore.create(name, layout, 4096) as store:
        episode = Episode(store, "h")
        tokens1, routes1 = generate(model, [10, 11, 12, 13])
        episode.add_turn(tokens1, routes1)
        tokens2, full2 = generate(model, [*tokens1, 40])
        recomputed = full2.copy()
        recomputed[2, 0] = (routes1[2, 0] + 1) % layout.num_experts  # another expert set
        ref = episode.add_turn(tokens2, recomputed)
        got = layout.decode(store.get(ref))
        np.testing.assert_array_equal(got[: len(tokens1) - 1], routes1[:-1])  # the stored
        np.testing.assert_array_equal(got[len(tokens1) - 1 :], full2[len(tokens1) - 1 :])
        assert episode.conflicts >= 1


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 5])
def test_a_turn_stopped_at_each_line_can_be_added_again_and_close_leaves_one_sample(
    model, name, stride
):
    # Ctrl-C inside add_turn after its put committed left the turn stored but not in the
    # episode: the turn could never be added again, and close() kept its sample for good.
    # Then a third turn, whose engine returns no routes for the history (a prefix cache):
    # before, a stop between the turn's ref and its state lost turn 2's rows and version.
    layout = find_routers(model).layout
    first, first_routes = generate(model, [10, 11, 12])
    second, second_routes = generate(model, [*first, 20, 21])
    third, third_routes = generate(model, [*second, 30, 31])
    cached = third_routes.copy()
    cached[: len(second)] = -1
    n1, n2 = len(first), len(second)
    with RoutingStore.create(name, layout, 4096) as store:
        stop = 1
        while True:
            episode = Episode(store, f"e{stop}")
            episode.add_turn(first, first_routes, policy_version=1)
            seen, _ = interrupted_at(
                stop, lambda e=episode: e.add_turn(second, second_routes, policy_version=2)
            )
            if episode.num_turns == 1:
                episode.add_turn(second, second_routes, policy_version=2)
            assert episode.num_turns == 2
            episode.add_turn(third, cached, policy_version=3)
            assert episode.close() == episode.refs[-1]
            assert len(store) == 1 and f"e{stop}-t3" in store  # the episode's one sample
            got = store.get(episode.ref)
            np.testing.assert_array_equal(got[: n2 - 1], second_routes[: n2 - 1])
            np.testing.assert_array_equal(got[n2:-1], third_routes[n2:-1])
            assert episode.ref.policy_versions == ((0, 1), (n1, 2), (n2, 3)), stop
            store.release([episode.ref])
            if seen < stop:
                break
            stop += stride
        assert stop > 20 * stride
        store.verify()


@pytest.mark.parametrize("where", ["self.check_history(tokens, turn)", "turns = [*self.refs"])
def test_close_while_another_thread_adds_a_turn_is_refused_and_loses_nothing(model, name, where):
    # Thread A is inside add_turn, before its put or after it committed; the episode is
    # closed from another thread meanwhile (a server whose turn coroutine was cancelled
    # while its store thread goes on). Before: close released A's committed turn, or
    # returned turn 1's ref while A's turn landed after it.
    layout = find_routers(model).layout
    first, first_routes = generate(model, [10, 11, 12])
    second, second_routes = generate(model, [*first, 20, 21])
    held, go = threading.Event(), threading.Event()

    def hold_after_the_put(frame, event, arg):
        here = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if frame.f_code is Episode._add_turn.__code__ and where in here:
            held.set()
            go.wait()
        return hold_after_the_put

    with RoutingStore.create(name, layout, 4096) as store:
        episode = Episode(store, "ep")
        episode.add_turn(first, first_routes)

        def adder():
            sys.settrace(hold_after_the_put)
            try:
                episode.add_turn(second, second_routes)
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=adder, daemon=True)
        thread.start()
        assert held.wait(10)
        try:
            with pytest.raises(RoutingReplayError, match="another call is inside add_turn"):
                episode.close()
            with pytest.raises(RoutingReplayError, match="another call is inside add_turn"):
                episode.add_turn(second, second_routes)
        finally:
            go.set()
            thread.join()
        ref = episode.close()
        assert ref.sample_id == "ep-t2" and len(store) == 1
        np.testing.assert_array_equal(store.get(ref)[:-1], second_routes[:-1])


def test_an_episode_id_without_room_for_its_turns_is_refused_at_once(name):
    # Before: a 125-byte id was taken, and turn 10's sample id (129 bytes) refused, losing
    # the episode mid-conversation.
    layout = find_routers(tiny_moe()).layout
    with RoutingStore.create(name, layout, 64) as store:
        Episode(store, "e" * 120)
        for bad in ("e" * 121, 5, "a/b"):
            with pytest.raises(InvalidArgumentError):
                Episode(store, bad)


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 17])
def test_an_episode_reusing_a_stored_id_never_releases_that_sample(name, stride):
    # Before: a second episode under a closed one's id (an agent loop restarted) failed its
    # turn with DuplicateSampleError, then released the other's sample at its next call:
    # the trainer's ref was lost. Also stopped by Ctrl-C at each line of that turn.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    routes = layout.random_routes(np.random.default_rng(0), 10)
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        first = Episode(store, "agent7", prompt_len=4)
        first.add_turn(np.arange(10), routes)
        trainer = first.close()
        stop = 0
        while True:
            retry = Episode(store, "agent7", prompt_len=4)
            try:  # stopped at line event `stop`, or (0, or past its end) refused
                interrupted_at(stop, lambda e=retry: e.add_turn(np.arange(10), routes))
                refused = False
            except DuplicateSampleError as e:
                assert "'agent7-t1' is already in" in str(e)
                refused = True
            with pytest.raises(RoutingReplayError, match="has no turns"):
                retry.close()
            with pytest.raises(DuplicateSampleError):
                retry.add_turn(np.arange(10), routes)
            assert trainer in store, f"line event {stop}"
            if refused and stop:
                break
            stop += stride if stop else 1
        assert stop > 5
        np.testing.assert_array_equal(store.get(trainer), routes)
        assert len(store) == 1
        store.verify()


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 13])
def test_a_turn_stopped_at_any_line_never_releases_a_later_episodes_sample(name, stride):
    # Before: a turn stopped inside its put before the commit kept its id pending; another
    # episode under that id (a restarted loop) then stored it, and the stopped episode's
    # next call released that other episode's sample.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    routes = layout.random_routes(np.random.default_rng(0), 10)
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        stop = 1
        while True:
            first, second = Episode(store, f"r{stop}"), Episode(store, f"r{stop}")
            seen, _ = interrupted_at(stop, lambda e=first: e.add_turn(np.arange(10), routes))
            if seen < stop:  # ran to its end: every line was a stop point
                break
            try:
                theirs = second.add_turn(np.arange(10), routes)  # the first's put did not commit
            except DuplicateSampleError:
                theirs = None  # it did: the first episode's own
            if first.num_turns:  # stopped after its state was updated
                assert theirs is None and first.close() in store
            elif theirs is not None:
                with pytest.raises(DuplicateSampleError):
                    first.add_turn(np.arange(10), routes)
                assert theirs in store, f"line event {stop}"
            else:
                mine = first.add_turn(np.arange(10), routes)  # its stranded put released
                assert mine in store and len(store) == 1, f"line event {stop}"
            store.release([r for r in (theirs, first.ref) if r is not None and r in store])
            assert len(store) == 0, f"line event {stop}"
            stop += stride
        assert stop > 10 * stride
        store.verify()


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 11])
def test_a_turn_stopped_inside_its_put_never_releases_a_live_twins_turn_put_meanwhile(name, stride):
    # Round 60: two live episodes of one id (a restarted loop while the old one runs). At
    # each line of the first's turn, the second (another handle, as from another process)
    # puts that turn, then the first is stopped. Before, a put stopped before its commit
    # judged a commit by a window of serials, the second's fell in it, and the first's
    # next call released the second's sample.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(0)
    mine, theirs_routes = layout.random_routes(rng, 10), layout.random_routes(rng, 10)
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        other = RoutingStore.attach(name)
        stop, outcomes = 1, set()
        while True:
            first, second = Episode(store, f"w{stop}"), Episode(other, f"w{stop}")
            theirs = []

            def meanwhile(second=second, theirs=theirs):
                # Nothing put if the first's put committed, or holds the lock.
                with contextlib.suppress(DuplicateSampleError, StoreBusyError):
                    theirs.append(second.add_turn(np.arange(10), theirs_routes))
                raise KeyboardInterrupt

            try:
                interrupted_at(
                    stop, lambda e=first: e.add_turn(np.arange(10), mine), action=meanwhile
                )
                break  # ran to its end: every line was a stop point
            except KeyboardInterrupt:
                pass
            if theirs:
                assert theirs[0] in store, f"line event {stop}"
                with pytest.raises(DuplicateSampleError):
                    first.add_turn(np.arange(10), mine)
                assert theirs[0] in store, f"line event {stop}: the live twin's turn released"
                np.testing.assert_array_equal(store.get(theirs[0]), theirs_routes)
                store.release(theirs)
                outcomes.add("theirs kept")
            else:  # the first's put committed, or never ran: the first goes on
                if not first.num_turns:
                    first.add_turn(np.arange(10), mine)
                np.testing.assert_array_equal(store.get(first.close()), mine)
                store.release([first.ref])
                outcomes.add("mine")
            assert len(store) == 0, f"line event {stop}"
            stop += stride
        other.close()
        assert outcomes == {"theirs kept", "mine"} and stop > 10 * stride
        store.verify()


class Boom(Exception):
    """An error raised inside a library call (not an interruption)."""


def in_thread(call):
    """`call()` in another thread (the main one stays alive); its result or error."""
    out = []

    def run():
        try:
            out.append(call())
        except Exception as e:  # the test's answer
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return out[0]


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 23])
@pytest.mark.parametrize("error", [KeyboardInterrupt, Boom])
def test_a_turn_or_close_stopped_at_any_line_then_used_from_another_thread(name, error, stride):
    # Stopped at a line of add_turn (turn 2) or of close, by Ctrl-C or by an error raised
    # inside the call; then a worker thread goes on: turn 2 again if it is not in, turn 3,
    # close, close again. Before: an error after the put's commit forgot the stored turn
    # (DuplicateSampleError for good), a stopped close could never close, and a worker
    # thread was refused for good after a Ctrl-C of the main thread.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100, 30)
    routes = layout.random_routes(rng, 30)
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        for step in ("turn", "close"):
            stop, runs = 1, 0
            while True:
                episode = Episode(store, f"{step[0]}{stop}")
                episode.add_turn(tokens[:10], routes[:10])
                if step == "turn":
                    seen, _ = interrupted_at(
                        stop, lambda e=episode: e.add_turn(tokens[:20], routes[:20]), error
                    )
                    if episode.num_turns == 1:
                        assert in_thread(lambda e=episode: e.add_turn(tokens[:20], routes[:20]))
                    assert in_thread(lambda e=episode: e.add_turn(tokens, routes))
                else:
                    episode.add_turn(tokens[:20], routes[:20])
                    episode.add_turn(tokens, routes)
                    seen, _ = interrupted_at(stop, episode.close, error)
                ref = in_thread(episode.close)
                assert isinstance(ref, RoutingRef), (step, stop, ref)
                assert in_thread(episode.close) == ref
                assert len(store) == 1 and ref.sample_id.endswith("-t3"), (step, stop)
                np.testing.assert_array_equal(store.get(ref), routes)
                store.release([ref])
                runs += 1
                if seen < stop:
                    break
                stop += stride
            assert runs > 5
        store.verify()


def test_a_signal_handler_closing_the_episode_inside_its_turn_is_refused(name):
    # A SIGTERM handler that closes open episodes runs in the thread it interrupts: at each
    # line of turn 2 it calls close(). Before: at some lines it released the committed turn
    # (lost), at others returned turn 1's ref while turn 2 was stored after it (a leak).
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(1)
    tokens, routes = rng.integers(0, 100, 20), layout.random_routes(rng, 20)
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        stop, refused = 1, 0
        while True:
            episode = Episode(store, f"s{stop}")
            episode.add_turn(tokens[:10], routes[:10])
            said, seen = [], 0

            def handler(frame, event, arg, episode=episode, stop=stop, said=said):
                nonlocal seen
                if event == "line" and frame.f_code.co_filename.startswith(PACKAGE):
                    seen += 1
                    if seen == stop:
                        sys.settrace(None)
                        try:
                            said.append(episode.close())
                        except RoutingReplayError as e:  # (its frames: the handler's, which
                            said.append(str(e))  # views the traced frame: not kept)
                return handler if frame.f_code.co_filename.startswith(PACKAGE) else None

            sys.settrace(handler)
            try:
                ref = episode.add_turn(tokens, routes)
            finally:
                sys.settrace(None)
            if said and isinstance(said[0], str):
                assert "another call is inside add_turn" in said[0]
                refused += 1
            if not said:  # ran to its end before the stop: every line was tried
                break
            assert not isinstance(said[0], RoutingRef), (stop, said[0])  # never closed inside
            assert episode.close() == ref and len(store) == 1
            np.testing.assert_array_equal(store.get(ref), routes)
            store.release([ref])
            stop += 7
        assert refused > 20


def test_an_episode_reads_no_threads_frames_where_a_collection_can_hang(name):
    # CPython before 3.11.9 (gh-106883): a collection that starts inside
    # sys._current_frames frees a threading.local, whose clear waits for the lock that call
    # holds, and the process hangs. An audit hook leaves such a local in a cycle, due, as
    # that call starts. Before: add_turn read every thread's frames there and never
    # returned (the suite hung in it); it reads none now.
    script = f"""
import gc, sys, threading
import numpy as np
from routing_replay import Episode, RoutingLayout, RoutingStore

def due(event, args):
    if event == "sys._current_frames" and not seen:
        seen.append(1)
        holder = {{"local": threading.local()}}
        holder["self"] = holder  # a cycle only a collection frees
        del holder
        spare = {{}}
        del spare  # (the call's dict comes from the free list: no collection before the lock)
        gc.set_threshold(1)  # the next object tracked starts one

seen = []
layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
rng = np.random.default_rng(0)
tokens, routes = rng.integers(0, 100, 16), layout.random_routes(rng, 16)
with RoutingStore.create({name!r}, layout, 1024, page_tokens=4) as store:
    sys.addaudithook(due)
    episode = Episode(store, "e")
    episode.add_turn(tokens[:8], routes[:8])
    ref = episode.add_turn(tokens, routes)
    assert episode.close() == ref and not seen
    np.testing.assert_array_equal(store.get(ref), routes)
print("returned")
"""
    done = _run_with_deadline(script, 30)
    assert done == "returned", done


def _run_with_deadline(script: str, seconds: float) -> str:
    """Run `script` in a new interpreter; its last line of output, or why it gave none."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=seconds
        )
    except subprocess.TimeoutExpired:
        return f"no answer in {seconds} s: the process hangs"
    lines = done.stdout.split()
    return lines[-1] if done.returncode == 0 and lines else done.stderr[-2000:]


class _Blocking:
    """Token ids whose conversion waits for `go`: an add_turn held inside its call."""

    def __init__(self, tokens, inside: threading.Event, go: threading.Event):
        self.tokens, self.inside, self.go = tokens, inside, go

    def __array__(self, dtype=None, copy=None):
        self.inside.set()
        self.go.wait(30)
        return np.asarray(self.tokens, dtype=dtype)


def test_a_fork_child_of_a_process_with_a_turn_running_can_go_on_with_the_episode(name):
    # Round 57: another thread was inside add_turn when the process forked; in the child
    # that thread is gone but its frame never ends, and every call of the episode there
    # was refused for good. Calls of threads that are gone no longer count.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(2)
    tokens, routes = rng.integers(0, 100, 24), layout.random_routes(rng, 24)
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        episode = Episode(store, "e")
        episode.add_turn(tokens[:8], routes[:8])
        inside, go = threading.Event(), threading.Event()
        held, said = _Blocking(tokens[:16], inside, go), []

        def turn() -> None:
            try:
                episode.add_turn(held, routes[:16])
            except DuplicateSampleError as e:  # the child's turn 2 is in the shared store
                said.append(e)

        thread = threading.Thread(target=turn)
        thread.start()
        try:
            assert inside.wait(30)
            with pytest.raises(RoutingReplayError, match="another call is inside"):
                episode.add_turn(tokens, routes)  # (here that thread still runs)
            pid = os.fork()
            if pid == 0:  # the child: the episode goes on there, from a new thread
                code, refs = 1, []  # (which may get the ident of the thread gone: round 58)
                try:
                    child = threading.Thread(
                        target=lambda: refs.append(episode.add_turn(tokens, routes))
                    )
                    child.start()
                    child.join(30)
                    code = 0 if refs and np.array_equal(store.get(refs[0]), routes) else 2
                finally:
                    os._exit(code)
            assert os.waitpid(pid, 0)[1] == 0  # (before: refused, exit 2)
        finally:
            go.set()
            thread.join(30)
        assert len(said) == 1 and episode.num_turns == 1  # here: refused, nothing stored
        np.testing.assert_array_equal(store.get("e-t2"), routes)  # the child's turn


def test_a_fork_child_never_releases_the_put_a_parent_thread_is_making(name):
    # Round 61: a thread's turn waits inside its put (the store is full) when the process
    # forks. The child's copy of the episode held that put's mark, and once the parent's
    # put committed, the child's close() took it for its own stopped put and released it:
    # the parent's ref named nothing.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(3)
    tokens, routes = rng.integers(0, 100, 16), layout.random_routes(rng, 16)
    with RoutingStore.create(name, layout, 16, page_tokens=4) as store:
        store.put_timeout = 30
        episode = Episode(store, "e")
        episode.add_turn(tokens[:8], routes[:8])
        filler = store.put("filler", routes[:8])  # the store is full
        refs = []
        thread = threading.Thread(target=lambda: refs.append(episode.add_turn(tokens, routes)))
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while episode._putting is None and time.monotonic() < deadline:
                time.sleep(0.001)  # until the turn is inside its put, waiting for room
            pid = os.fork()
            if pid == 0:  # the child: once the parent's turn is in, its copy closes
                code = 1
                try:
                    while "e-t2" not in store and time.monotonic() < deadline:
                        time.sleep(0.001)
                    code = 0 if episode.close().sample_id == "e-t1" else 2
                finally:
                    os._exit(code)
            store.release([filler])  # room: the parent's put commits
            thread.join(30)
            assert os.waitpid(pid, 0)[1] == 0
        finally:
            store.release([r for r in [filler] if r in store])
            thread.join(30)
        assert refs == [episode.ref] and refs[0] in store  # before: released by the child
        np.testing.assert_array_equal(store.get(episode.close()), routes)
        assert len(store) == 1


@pytest.mark.parametrize("stopped_in", ["the forking thread", "another thread"])
def test_a_fork_child_settles_a_turn_stopped_before_the_fork(name, stopped_in):
    # Round 62: a turn stopped after its put committed, then the process forks and the
    # child goes on with the episode. Round 61's fix left every put made before a fork to
    # the parent: the child's turn was refused for good and its sample stranded. Round 63:
    # round 62's fix settled it only if the forking thread had made it. A put whose call
    # ended before the fork was over: the child settles it.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(4)
    tokens, routes = rng.integers(0, 100, 16), layout.random_routes(rng, 16)

    def stop_after_the_put(frame, event, arg):
        here = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if frame.f_code is Episode._add_turn.__code__ and "turns = [*self.refs" in here:
            raise KeyboardInterrupt
        return stop_after_the_put

    def stopped_turn():
        sys.settrace(stop_after_the_put)
        try:
            episode.add_turn(tokens, routes)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)

    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        episode = Episode(store, "e")
        episode.add_turn(tokens[:8], routes[:8])
        if stopped_in == "another thread":
            thread = threading.Thread(target=stopped_turn)
            thread.start()
            thread.join(30)
        else:
            stopped_turn()
        assert episode.num_turns == 1 and "e-t2" in store  # committed, not recorded
        pid = os.fork()
        if pid == 0:  # the child: the turn again, then close
            code = 1
            try:
                episode.add_turn(tokens, routes)
                ref = episode.close()
                code = 0 if np.array_equal(store.get(ref), routes) else 2
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0  # before: DuplicateSampleError, exit 1
        assert len(store) == 1 and "e-t2" in store  # the child's episode, nothing stranded


def test_a_child_forked_inside_a_turn_ends_and_the_parents_turn_stands(name):
    # Rounds 63 and 65: the thread making a turn forked inside that call (a signal handler,
    # a hook), before its put. Parent and child both put the turn; the child's copy then
    # released the parent's recorded turn (round 62's rule), or, winning the put, left
    # the parent's turn refused for good. A child forked inside a turn now ends at once.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(5)
    tokens, routes = rng.integers(0, 100, 16), layout.random_routes(rng, 16)
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        for line in ("check_history(tokens", "._put_marked(", "turns = [*self.refs"):
            episode = Episode(store, f"e{len(line)}")
            episode.add_turn(tokens[:8], routes[:8])

            def there(frame, line=line):
                here = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
                return frame.f_code is Episode._add_turn.__code__ and line in here

            pid, ref = forked_at(there, lambda e=episode: e.add_turn(tokens, routes))
            if pid == 0:
                os._exit(3)  # (the child never gets here: it ended in the fork)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == FORKED_INSIDE_EXIT
            assert ref == episode.ref and ref in store, line
            np.testing.assert_array_equal(store.get(episode.close()), routes)
            assert len(store) == 1
            store.release([ref])


def test_a_childs_failed_turn_never_marks_a_parent_threads_running_put_as_over(name):
    # Round 66: another thread forked while a turn was inside its put; the child's own
    # add_turn raised early, and its clean-up stamped the parent's running put as ended
    # there, so a grandchild's close() took it for a put over before its fork and
    # released the parent's recorded turn.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(6)
    tokens, routes = rng.integers(0, 100, 16), layout.random_routes(rng, 16)
    inside, go = threading.Event(), threading.Event()

    def hold_before_the_put(frame, event, arg):
        here = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        if frame.f_code is Episode._add_turn.__code__ and "._put_marked(" in here:
            inside.set()
            go.wait(30)
        return hold_before_the_put

    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        episode, refs = Episode(store, "e"), []

        def turn():
            sys.settrace(hold_before_the_put)
            try:
                refs.append(episode.add_turn(tokens, routes))
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=turn)
        thread.start()
        try:
            assert inside.wait(30)
            pid = os.fork()  # (from this thread: not inside a call, the child goes on)
            if pid == 0:
                code = 1
                try:
                    with contextlib.suppress(InvalidRoutesError):
                        episode.add_turn(tokens[:5], routes)  # raises before any put
                    grandchild = os.fork()
                    if grandchild == 0:
                        with contextlib.suppress(RoutingReplayError):
                            episode.close()  # ("has no turns")
                        os._exit(0)
                    code = os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1])
                finally:
                    os._exit(code)
        finally:
            go.set()
            thread.join(30)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert refs == [episode.ref] and refs[0] in store  # before: released by the grandchild
        np.testing.assert_array_equal(store.get(refs[0]), routes)


def _alone_line(text: str) -> int:
    """The line of `Episode._alone` whose code contains `text`."""
    lines, first = inspect.getsourcelines(Episode._alone)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_of_two_calls_entered_at_once_the_first_goes_on(name):
    # Round 59: a call was refused by any other entered call, so threads that called again
    # after a refusal kept refusing each other (2 threads: 11 turns in 3 s). Now the call
    # entered first goes on and the later one waits for it.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(4)
    tokens, routes = rng.integers(0, 100, 30), layout.random_routes(rng, 30)
    code, line = Episode._alone.__code__, _alone_line("alone = not inside_call")
    entered = {who: threading.Event() for who in ("first", "second")}
    go = {who: threading.Event() for who in ("first", "second")}
    said = {}
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        episode = Episode(store, "e")
        episode.add_turn(tokens[:10], routes[:10])

        def turn(who: str, n: int) -> None:
            def hook(frame, event, arg):
                if frame.f_code is not code:
                    return None
                if event == "line" and frame.f_lineno == line:  # its frame entered
                    entered[who].set()
                    go[who].wait(30)
                return hook

            sys.settrace(hook)
            try:
                said[who] = episode.add_turn(tokens[:n], routes[:n])
            except RoutingReplayError as e:
                said[who] = e
            finally:
                sys.settrace(None)

        first = threading.Thread(target=turn, args=("first", 20))
        first.start()
        assert entered["first"].wait(30)
        second = threading.Thread(target=turn, args=("second", 30))
        second.start()
        assert entered["second"].wait(30)
        go["first"].set()  # both entered: the first looks at the calls entered before it
        first.join(30)
        go["second"].set()
        second.join(30)
        assert isinstance(said["first"], RoutingRef), said  # (before: refused)
        assert isinstance(said["second"], RoutingRef) and episode.num_turns == 3
        np.testing.assert_array_equal(store.get(episode.ref), routes)


@pytest.mark.stress  # 14 full collections of the suite's heap: 6 s
def test_a_call_entering_while_another_copies_the_entries_is_no_raw_error(name):
    # Round 59: `_alone` listed the live dict of entered calls; a collection during the
    # listing ran a finalizer that let another thread enter, and the listing raised a raw
    # RuntimeError (dictionary changed size). Each threshold makes the collection start at
    # another allocation of that line.
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=8)
    rng = np.random.default_rng(5)
    tokens, routes = rng.integers(0, 100, 30), layout.random_routes(rng, 30)
    code, line = Episode._alone.__code__, _alone_line("self._calls.")
    entered_line = _alone_line("alone = not inside_call")
    outcomes = []
    with RoutingStore.create(name, layout, 4096, page_tokens=4) as store:
        for threshold in range(1, 8):
            episode = Episode(store, f"e{threshold}")
            episode.add_turn(tokens[:10], routes[:10])
            go, inside, release, other = threading.Event(), threading.Event(), threading.Event(), []

            def enter(episode=episode, go=go, inside=inside, release=release, other=other):
                def hold(frame, event, arg):
                    if event == "line" and frame.f_code is code and frame.f_lineno == entered_line:
                        inside.set()
                        release.wait(10)
                    return hold

                go.wait(10)
                sys.settrace(hold)
                try:
                    other.append(episode.add_turn(tokens[:30], routes[:30]))
                except RoutingReplayError as e:
                    other.append(e)
                finally:
                    sys.settrace(None)

            thread = threading.Thread(target=enter)
            thread.start()

            class Finalizer:
                def __del__(self, go=go, inside=inside):
                    go.set()
                    inside.wait(10)  # the other thread's call has entered

            def at(frame, event, arg, fired=[], threshold=threshold):  # noqa: B006 (once)
                if event == "line" and frame.f_code is code and frame.f_lineno == line:
                    if not fired:
                        fired.append(1)
                        gc.collect()
                        cycle = Finalizer()
                        cycle.me = cycle
                        del cycle
                        gc.set_threshold(threshold)
                    return None
                return at if frame.f_code is code else None

            sys.settrace(at)
            try:
                episode.add_turn(tokens[:20], routes[:20])
                outcomes.append("went on")
            except RoutingReplayError:
                outcomes.append("refused")
            except RuntimeError as e:  # (before: dictionary changed size during iteration)
                outcomes.append(f"raw: {e}")
            finally:
                sys.settrace(None)
                gc.set_threshold(700)
                go.set()
                release.set()
                thread.join(30)
            gc.collect()
    assert not [o for o in outcomes if o.startswith("raw")], outcomes
