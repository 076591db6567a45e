"""The direct read path's protocol (`routing_replay.ray.direct`) on real sockets and a real
store, without Ray: what a reader builds is the store's own read, or nothing."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import resource
import socket
import threading
import time

import numpy as np
import pytest

from routing_replay import PutRequest, RoutingLayout, RoutingStore
from routing_replay.errors import ConcurrentReleaseError
from routing_replay.ray import direct

# 256 experts: ids stored in two bytes and narrowed to one on the wire, the marker listed apart
LAYOUT = RoutingLayout(num_layers=3, top_k=2, num_experts=256)
P = 8


def fresh(n: int) -> np.ndarray:
    return np.empty(n, dtype=np.uint8)


@pytest.fixture
def store(name, tmp_path):
    """A spilling store: a GRPO group (one prompt, shared pages), a spilled sample, a sample
    with a missing row."""
    rng = np.random.default_rng(0)
    with RoutingStore.create(name, LAYOUT, 6 * P, page_tokens=P, spill_dir=tmp_path) as s:
        prompt = LAYOUT.random_routes(rng, 2 * P, LAYOUT.dtype)
        prompt_tokens = rng.integers(0, 1000, 2 * P, dtype=np.int32)
        puts = []
        for i in range(3):
            routes = np.concatenate([prompt, LAYOUT.random_routes(rng, 5, LAYOUT.dtype)])
            routes[-1] = LAYOUT.missing
            tokens = np.concatenate([prompt_tokens, rng.integers(0, 1000, 5, dtype=np.int32)])
            puts.append(PutRequest(f"g{i}", routes, prompt_len=2 * P, token_ids=tokens))
        s.put("early", LAYOUT.random_routes(rng, 3 * P, LAYOUT.dtype))  # spilled by the group
        refs = [s.put("early2", LAYOUT.random_routes(rng, P, LAYOUT.dtype))]
        refs += s.put_many(puts)
        assert s.stats().samples_spilled >= 1
        yield s, [*refs, "early"]


def serve(server: direct.DirectServer, store: RoutingStore, refs, request, after=None):
    """A store actor's `read(request=...)`, in a thread: the thread, and what it raised."""
    raised: list = []

    def run() -> None:
        try:
            with server.stream(request) as conn:

                def ship(wire):
                    direct.send(conn, wire.narrowed())
                    if after is not None:
                        after()
                    return 0

                store.read_wire(refs, ship=ship)
                conn.sendall(direct.DONE)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, raised


def test_a_direct_read_builds_exactly_the_stores_read(store):
    s, refs = store
    server = direct.DirectServer("127.0.0.1")
    try:
        pull = direct.connect((*server.address, server.secret), fresh)
        thread, raised = serve(server, s, refs, pull.request)
        assert direct.drain([pull], lambda waiting: []) == []
        thread.join()
        assert raised == []
        assert pull.wire().batch().equals(s.read(refs))
        pull.close()
    finally:
        server.close()


def test_a_read_whose_check_fails_after_it_was_sent_gives_the_reader_nothing(store, name):
    # The bytes went out, then the sample was released (a page may be reused under them):
    # the actor sends no DONE, so the reader builds nothing from what it received.
    s, refs = store
    other = RoutingStore.attach(name)
    server = direct.DirectServer("127.0.0.1")
    try:
        pull = direct.connect((*server.address, server.secret), fresh)
        thread, raised = serve(
            server, s, refs, pull.request, after=lambda: other.release([refs[0]])
        )
        assert direct.drain([pull], lambda waiting: []) == [0]  # failed: read it through Ray
        thread.join()
        assert len(raised) == 1 and isinstance(raised[0], ConcurrentReleaseError)
        assert not pull.finished
        pull.close()
    finally:
        server.close()
        other.close()


def test_a_stream_cut_at_every_byte_is_never_used(store):
    """The store actor stopped (killed, its connection closed) after each byte it sent: the
    reader reports the stream failed, every time; the whole stream builds the exact read."""
    s, refs = store
    a, b = socket.socketpair()
    with a, b:
        s.read_wire(refs, ship=lambda wire: direct.send(a, wire.narrowed()))
        a.sendall(direct.DONE)
        a.shutdown(socket.SHUT_WR)
        stream = b"".join(iter(lambda: b.recv(1 << 16), b""))
    cut = len(stream)
    listener = socket.create_server(("127.0.0.1", 0))
    hello = len(direct.HELLO) + direct.SECRET_BYTES + direct.REQUEST_BYTES

    def send_cut() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test ended early
                return
            with conn:
                conn.recv(hello, socket.MSG_WAITALL)
                conn.sendall(stream[:cut])
                if cut == len(stream):
                    return

    thread = threading.Thread(target=send_cut)
    thread.start()
    address = listener.getsockname()
    try:
        for cut in [*range(len(stream)), len(stream)]:  # (send_cut reads `cut`)
            pull = direct.DirectPull(address, b"\0" * direct.SECRET_BYTES, fresh)
            failed = direct.drain([pull], lambda waiting: [])
            pull.close()
            if cut < len(stream):
                assert failed == [0] and not pull.finished, f"cut after byte {cut}"
        assert failed == [] and pull.wire().batch().equals(s.read(refs))
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # (wakes its accept: a close alone does not)
        thread.join()
        listener.close()
    assert len(stream) > 1000


@pytest.mark.slow
def test_connections_without_the_secret_or_a_call_are_closed(monkeypatch):
    monkeypatch.setattr(direct, "HELLO_TIMEOUT_S", 0.2)
    monkeypatch.setattr(direct, "CLAIM_WAIT_S", 0.2)
    server = direct.DirectServer("127.0.0.1")
    try:
        request = b"r" * direct.REQUEST_BYTES
        for hello in (
            direct.HELLO + b"x" * direct.SECRET_BYTES + request,  # a wrong secret
            b"GET / HTTP/1.1\r\n\r\n",  # something else, that then waits
            direct.HELLO[:4],
        ):
            with socket.create_connection(server.address) as c:
                c.sendall(hello)
                c.settimeout(5)
                assert c.recv(1) == b""  # closed by the actor
        with socket.create_connection(server.address) as slow:  # a byte at a time: the
            slow.settimeout(5)  # deadline is the whole hello's (before: each byte's)
            hello, closed_after = direct.HELLO + server.secret + request, None
            for i, byte in enumerate(hello):
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed_after = i
                    break
                time.sleep(0.05)
            assert closed_after is not None and closed_after < len(hello) // 2, closed_after
        with pytest.raises(direct.DirectUnavailable, match="never came"):
            server.claim(request)  # (none of them was let in)
        monkeypatch.setattr(direct, "UNCLAIMED_S", 0.0)
        left = socket.create_connection(server.address)
        left.sendall(direct.HELLO + server.secret + request)
        assert direct.connect((*server.address, server.secret), fresh) is not None
        left.settimeout(5)
        assert left.recv(1) == b""  # unclaimed, and closed once another came
        left.close()
    finally:
        server.close()


def _serve_with_few_descriptors(conn) -> None:
    """A DirectServer in a process left 6 free descriptors: sends its endpoint, lets a flood
    of connections run it out of them, then claims one request and says whether it came."""
    server = direct.DirectServer("127.0.0.1")
    conn.send((*server.address, server.secret))
    used = len(os.listdir("/proc/self/fd"))
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 6, limit))
    request = conn.recv()  # (after the flood ended)
    try:
        server.claim(request)
        conn.send("claimed")
    except direct.DirectUnavailable as e:
        conn.send(str(e))


@pytest.mark.slow
def test_a_server_run_out_of_descriptors_accepts_again_once_they_are_back():
    # Before: the first accept() failing (EMFILE) ended the server's accept loop for good:
    # every later direct read waited 10 s for a connection that was never accepted (52).
    mine, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_serve_with_few_descriptors, args=(theirs,))
    child.start()
    try:
        host, port, secret = mine.recv()
        flood = [socket.create_connection((host, port)) for _ in range(40)]  # past its limit
        time.sleep(1)  # (each waits for its hello, holding a descriptor there)
        for c in flood:
            c.close()
        pull = direct.connect((host, port, secret), fresh)
        mine.send(pull.request)
        assert mine.recv() == "claimed"
        pull.close()
    finally:
        child.kill()
        child.join()


def _waiting_for(server: direct.DirectServer, *requests: bytes) -> None:
    """Until the server has taken each request's hello (its thread runs apart)."""
    deadline = time.monotonic() + 5
    while not all(r in server._waiting for r in requests):
        assert time.monotonic() < deadline, "a hello never reached the server"
        time.sleep(0.01)


def test_a_pull_dropped_unclosed_closes_its_connection_at_once():
    # Before: a pull's parser held the pull (a reference cycle), so a reader stopped before
    # it closed its streams kept them open until a garbage collection (round 53).
    server = direct.DirectServer("127.0.0.1")
    gc.disable()
    try:
        pull = direct.connect((*server.address, server.secret), fresh)
        _waiting_for(server, pull.request)
        with server.claim(pull.request) as conn:
            del pull
            conn.settimeout(5)
            assert conn.recv(1) == b""  # the reader's end is closed
    finally:
        gc.enable()
        server.close()


@contextlib.contextmanager
def _big_read(name: str, tokens: int, rcvbuf: int | None = None):
    """A store holding one sample of `tokens` x 384 B, a server, and a reader's raw socket
    that said hello for its request: (store, ref, server, reader, request)."""
    layout = RoutingLayout(num_layers=48, top_k=8, num_experts=128)  # 384 B a token
    with RoutingStore.create(name, layout, tokens + (1 << 12)) as s:
        ref = s.put("big", layout.random_routes(np.random.default_rng(0), tokens, np.uint8))
        server = direct.DirectServer("127.0.0.1")
        try:
            request = b"q" * direct.REQUEST_BYTES
            with socket.socket() as reader:
                if rcvbuf is not None:
                    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                reader.connect(server.address)
                reader.sendall(direct.HELLO + server.secret + request)
                yield s, ref, server, reader, request
        finally:
            server.close()


def test_a_reader_that_takes_no_bytes_frees_the_actors_thread(name, monkeypatch):
    # Before: the actor's send waited up to 300 s for a reader that stopped taking bytes
    # (a host gone, a process paused), holding one of the actor's threads (round 53).
    monkeypatch.setattr(direct, "SEND_STALL_S", 0.3, raising=False)
    with _big_read(name, 60_000, rcvbuf=4096) as (s, ref, server, _, request):
        thread, raised = serve(server, s, [ref], request)  # the reader reads nothing
        thread.join(20)
        assert not thread.is_alive(), "the send still waits for the reader"
        assert [type(e) for e in raised] == [direct.DirectUnavailable]


def test_sends_past_the_cap_are_refused_at_once_and_their_reader_told(monkeypatch):
    # However many readers stop taking bytes, they hold MAX_SENDS of the actor's threads at
    # most: its other threads stay free for puts, stats and reads through Ray (round 53).
    monkeypatch.setattr(direct, "MAX_SENDS", 2, raising=False)
    server = direct.DirectServer("127.0.0.1")
    try:
        pulls = [direct.connect((*server.address, server.secret), fresh) for _ in range(3)]
        _waiting_for(server, *(p.request for p in pulls))
        with contextlib.ExitStack() as sending:
            for pull in pulls[:2]:
                sending.enter_context(server.stream(pull.request))
            start = time.monotonic()
            with pytest.raises(direct.DirectUnavailable, match="being sent already"):
                sending.enter_context(server.stream(pulls[2].request))
            assert time.monotonic() - start < 1

            def not_told(waiting: list[int]) -> list[int]:
                assert time.monotonic() < start + 5, "the refused read's stream never ended"
                return []

            assert direct.drain([pulls[2]], not_told) == [0]  # it ended: read through Ray
        again = direct.connect((*server.address, server.secret), fresh)
        _waiting_for(server, again.request)
        with server.stream(again.request):
            pass  # (the slots came back)
        again.close()
    finally:
        for pull in pulls:
            pull.close()
        server.close()


def _with_no_descriptor_free(endpoint, conn) -> None:
    """In a child: what connect and drain do with no descriptor left for them."""
    out = {}
    pull = direct.connect(endpoint, fresh)  # (made while descriptors are left)
    lowest_free = os.open(os.devnull, os.O_RDONLY)  # (the number a new descriptor takes)
    os.close(lowest_free)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        out["connect"] = f"returned {direct.connect(endpoint, fresh)!r}"
    except direct.DirectUnavailable as e:
        out["connect"] = f"DirectUnavailable: {e}"
    except BaseException as e:
        out["connect"] = f"raw {type(e).__name__}"
    for key, pulls in (("drain none", []), ("drain one", [pull])):
        try:
            out[key] = direct.drain(pulls, lambda waiting: [])
        except BaseException as e:
            out[key] = f"raw {type(e).__name__}"
    conn.send(out)


def test_a_reader_out_of_descriptors_reads_through_ray_and_blames_no_firewall():
    # Before: connect called EMFILE "unreachable" (a firewall warning, and direct reads off
    # for that store for good), and drain raised a raw OSError making its selector (round 53).
    server = direct.DirectServer("127.0.0.1")
    mine, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(
        target=_with_no_descriptor_free, args=((*server.address, server.secret), theirs)
    )
    try:
        child.start()
        assert mine.poll(20)
        out = mine.recv()
        assert out["connect"].startswith("DirectUnavailable: no connection can be made here")
        assert out["drain none"] == [] and out["drain one"] == [0]
    finally:
        child.join(10)
        server.close()


def test_a_connection_no_call_claims_is_closed_with_no_other_coming(monkeypatch):
    # Before: only the next reader's hello closed it: readers stopped between connecting and
    # calling left the actor their connections (21 after ~2,000 stops, round 53).
    monkeypatch.setattr(direct, "UNCLAIMED_S", 0.2)
    monkeypatch.setattr(direct, "SWEEP_EVERY_S", 0.1, raising=False)
    server = direct.DirectServer("127.0.0.1")
    try:
        with socket.create_connection(server.address) as left:
            left.sendall(direct.HELLO + server.secret + b"u" * direct.REQUEST_BYTES)
            left.settimeout(5)
            assert left.recv(1) == b""  # closed by the actor, no other connection needed
    finally:
        server.close()


@pytest.mark.slow  # (3 s of waiting for a reader on purpose)
def test_a_slow_reader_is_not_cut_only_one_that_stops(name, monkeypatch):
    # Before: the stall timeout bounded each whole 4 MB `sendall`, so a reader slower than
    # 4 MB per timeout was cut although it kept taking bytes (round 54).
    monkeypatch.setattr(direct, "SEND_STALL_S", 0.5)
    with _big_read(name, 40_000) as (s, ref, server, reader, request):
        thread, raised = serve(server, s, [ref], request)
        got, since_pause, buf = 0, 0, bytearray(1 << 16)
        reader.settimeout(10)
        while True:  # 1 MB, then 0.2 s: 5 MB/s, about 3 s for the 15 MB
            n = reader.recv_into(buf)
            if not n:
                break
            got, since_pause = got + n, since_pause + n
            if since_pause >= 1 << 20:
                time.sleep(0.2)
                since_pause = 0
        thread.join(10)
        assert not thread.is_alive() and raised == []
        assert got > 40_000 * 384  # every byte, DONE included


def test_a_refused_reads_connection_is_closed_when_its_hello_comes_late(monkeypatch):
    # Before: a hello that came after its call was refused waited a minute for a claim that
    # never came, a descriptor each under bursts past the send cap (round 54).
    monkeypatch.setattr(direct, "MAX_SENDS", 1)
    server = direct.DirectServer("127.0.0.1")
    try:
        first = direct.connect((*server.address, server.secret), fresh)
        _waiting_for(server, first.request)
        late = b"l" * direct.REQUEST_BYTES
        with (
            server.stream(first.request),
            pytest.raises(direct.DirectUnavailable, match="being sent already"),
        ):
            server.stream(late).__enter__()
        with socket.create_connection(server.address) as c:
            c.sendall(direct.HELLO + server.secret + late)
            c.settimeout(5)
            assert c.recv(1) == b""  # closed at once
        first.close()
    finally:
        server.close()


def test_the_endpoint_cache_cleared_by_another_thread_mid_call_is_not_a_raw_error(store):
    # Before: `_endpoints` read the shared cache again for its answer: a thread that cleared
    # it meanwhile (the cache full) made the call raise KeyError (round 54).
    import inspect
    import sys

    from routing_replay.ray import remote

    _, refs = store
    ref = refs[0]
    endpoint = ("127.0.0.1", 1, b"s" * direct.SECRET_BYTES)
    remote._ENDPOINTS[ref.store, ref.node_id] = endpoint
    lines, first = inspect.getsourcelines(remote._endpoints)
    last = first + len(lines) - 1

    def clear_at_return(frame, event, arg):
        if frame.f_code is remote._endpoints.__code__ and frame.f_lineno == last:
            remote._ENDPOINTS.clear()
        return clear_at_return

    sys.settrace(clear_at_return)
    try:
        got = remote._endpoints([None], [[ref]])
    finally:
        sys.settrace(None)
        remote._ENDPOINTS.clear()
    assert got == [endpoint]
