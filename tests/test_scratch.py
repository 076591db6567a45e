"""The store actor's reused narrowing buffers (`Scratch`): a lease's bytes are its own
until it ends, then serve the next lease; what is kept stays within its bound."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from line_stops import interrupted_at

from routing_replay.ray.scratch import Scratch


def test_open_leases_never_share_bytes_and_an_ended_ones_serve_the_next():
    scratch = Scratch(keep_bytes=1 << 20)
    with scratch.lease() as take_a:
        a = take_a(100)
        a2 = take_a(30)  # a second take of one lease: bytes of its own too
        with scratch.lease() as take_b:
            b = take_b(50)
            assert (a.size, a2.size, b.size) == (100, 30, 50)
            assert not np.shares_memory(a, b) and not np.shares_memory(a, a2)
            assert not np.shares_memory(a2, b)
        with scratch.lease() as take_c:  # b's buffer is free again: the smallest that fits
            c = take_c(40)
            assert np.shares_memory(c, b) and not np.shares_memory(c, a)
            with scratch.lease() as take_d:  # c holds it: a fresh one
                d = take_d(40)
                assert not any(np.shares_memory(d, x) for x in (a, a2, b))
    assert scratch.kept_bytes == 100 + 30 + 50 + 40


def test_a_lease_ended_by_an_error_gives_its_bytes_back():
    scratch = Scratch(keep_bytes=1 << 20)
    with pytest.raises(RuntimeError), scratch.lease() as take:
        a = take(64)
        raise RuntimeError("ray.put failed")
    with scratch.lease() as take:
        assert np.shares_memory(take(64), a)


def test_what_is_kept_stays_within_keep_bytes_largest_first():
    scratch = Scratch(keep_bytes=100)
    with scratch.lease() as take_a, scratch.lease() as take_b, scratch.lease() as take_c:
        take_a(80), take_b(60), take_c(20)
    assert scratch.kept_bytes == 100  # 80 and 20: the 60 does not fit beside the 80
    with scratch.lease() as take:
        take(200)  # larger than the bound: never kept
    assert scratch.kept_bytes == 100


def test_a_lease_stopped_at_any_line_never_stalls_the_next():
    # Before: a Ctrl-C as a lease's `with self._lock:` block ended left the lock held, and
    # every later read of the process (its receive buffers) waited on it for good.
    scratch = Scratch(keep_bytes=100)

    def use() -> None:
        with scratch.lease() as take, scratch.lease() as other:
            take(64), take(32), other(80)

    events, _ = interrupted_at(0, use)
    assert events > 20
    for stop in range(1, events + 1):
        # (in a thread: a stalled lease fails the test instead of hanging it)
        stopped_then_used = threading.Thread(
            target=lambda stop=stop: (interrupted_at(stop, use), use()), daemon=True
        )
        stopped_then_used.start()
        stopped_then_used.join(5)
        assert not stopped_then_used.is_alive(), f"a lease stopped at event {stop} stalls the next"
        assert scratch.kept_bytes <= 100
