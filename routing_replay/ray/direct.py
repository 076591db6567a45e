"""Reads across nodes over a TCP connection from the store actor straight to the reader.
(One module over 400 lines by design: one wire protocol, the actor's end and the reader's,
side by side.)

Ray's object store moved a read's wire form at 0.7-1.3 GB/s on the 2-core VM where this was
measured (the actor's `ray.put` copies it into the object store, the object manager sends
it in chunks, the reader maps it), where one TCP stream moved 2.4-3.1 GB/s. Here the stored
runs go from the segment into the socket and from the socket into memory the reader reuses:
one kernel copy on each side. Ray still carries the call (its refs, its errors, the actor's
death) and gives the reader the actor's address and a secret (one per actor) that every
connection presents first. A reader that cannot connect reads through Ray's object store;
`ROUTING_REPLAY_DIRECT=0` (in the reader's or the actor's environment) turns this path off.

One connection per call:
    reader -> actor: HELLO, the secret, a request id (the call names it)
    actor -> reader: header length (8 bytes, little-endian), a JSON header, each array's
                     bytes back to back, then DONE once the read was checked unchanged
                     (`read_wire`): without DONE the reader uses nothing it received.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import math
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from routing_replay.layout import RoutingLayout
from routing_replay.store import WireBatch
from routing_replay.store.read import Request

ENV = "ROUTING_REPLAY_DIRECT"
HELLO = b"RRDIRECT"
SECRET_BYTES = REQUEST_BYTES = 16
DONE = b"RRDONE\x00\x00"
LENGTH = struct.Struct("<Q")
MAX_HEADER_BYTES = 64 << 20  # sample ids and their prompt lengths, as JSON
ARRAY_DTYPES = frozenset({"<i8", "|b1", "|u1", "<u2", "<i4"})  # what a wire batch holds
ALIGN = 64  # each array's place in the reader's buffer
CONNECT_TIMEOUT_S = 5.0  # a reader that cannot connect in this long reads through Ray
HELLO_TIMEOUT_S = 5.0  # a connection that does not say who it is in this long is closed
MAX_HELLOS = 64  # connections saying hello at once; more are closed at once (a flood)
ACCEPT_RETRY_S = 0.05  # an accept that failed (no descriptors left) is tried again after
CLAIM_WAIT_S = 10.0  # a call waits this long for its reader's connection
UNCLAIMED_S = 60.0  # a connection no call claimed in this long is closed
SWEEP_EVERY_S = 5.0  # how often the server looks for such connections
SEND_STALL_S = 30.0  # a reader that takes no byte for this long is given up (read via Ray)
MAX_SENDS = 12  # streams an actor sends at once (of its 16 threads); more go through Ray:
# threads stay free for puts, stats and Ray-path reads however many readers stop taking bytes
LOCAL_ERRNOS = frozenset(  # a connect that fails for want of something here, not there
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL}
)
POLL_S = 0.2  # a reader waiting on its connections looks at its calls this often
STALLED_S = 30.0  # a call that returned, its stream silent this long: read through Ray


def enabled() -> bool:
    """Whether this process takes or serves direct reads."""
    return os.environ.get(ENV, "1") != "0"


class DirectUnavailable(RuntimeError):
    """The direct path failed as a transport (no connection, a broken stream): the read is
    done again through Ray's object store. Not a store error: nothing about the samples."""


def _recv_by(sock: socket.socket, n: int, seconds: float) -> bytes:
    """n bytes, all of them within `seconds` (a peer sending a byte at a time gains nothing)."""
    buf, deadline = bytearray(n), time.monotonic() + seconds
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("too slow")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("closed")
        got += k
    return bytes(buf)


# -- the store actor's side --------------------------------------------------------------


class DirectServer:
    """A store actor's listening socket. Each connection says hello (the actor's secret, a
    request id) on a thread of its own, then waits for the call that names its request."""

    def __init__(self, host: str) -> None:
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._listener = socket.create_server((host, 0), backlog=128)
        self.address = (host, self._listener.getsockname()[1])
        self._waiting: dict[bytes, tuple[socket.socket, float]] = {}
        self._refused: dict[bytes, float] = {}  # requests refused before their hello came
        self._cond = threading.Condition()
        self._hellos = threading.BoundedSemaphore(MAX_HELLOS)
        self._sends = threading.BoundedSemaphore(MAX_SENDS)
        self._listener.settimeout(SWEEP_EVERY_S)  # (an idle accept wakes up to sweep)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="rr-direct").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self._sweep()
                continue
            except OSError:  # out of descriptors, a connection reset while queued, ...
                time.sleep(ACCEPT_RETRY_S)  # (until closed: then the loop ends)
                continue
            if not self._hellos.acquire(blocking=False):  # a flood: no thread for it
                conn.close()
                continue
            try:
                threading.Thread(target=self._hello, args=(conn,), daemon=True).start()
            except BaseException:
                self._hellos.release()
                conn.close()

    def _hello(self, conn: socket.socket) -> None:
        try:
            hello = _recv_by(conn, len(HELLO) + SECRET_BYTES + REQUEST_BYTES, HELLO_TIMEOUT_S)
            conn.settimeout(SEND_STALL_S)  # (each `send` waits this long at most for room)
        except OSError:
            conn.close()
            return
        finally:
            self._hellos.release()
        secret, request = hello[len(HELLO) : -REQUEST_BYTES], hello[-REQUEST_BYTES:]
        if hello[: len(HELLO)] != HELLO or not hmac.compare_digest(secret, self.secret):
            conn.close()
            return
        self._sweep()
        with self._cond:
            if self._refused.pop(request, None) is not None:  # its call was refused: the
                conn.close()  # reader reads through Ray, and sees this stream end at once
                return
            previous = self._waiting.pop(request, None)
            if previous is not None:  # (a request id said twice: neither is trusted)
                previous[0].close()
                conn.close()
                return
            self._waiting[request] = (conn, time.monotonic())
            self._cond.notify_all()

    def _sweep(self) -> None:
        """Close the connections whose call never came (their reader stopped or gave up)."""
        now = time.monotonic()
        with self._cond:
            for key, (old, since) in list(self._waiting.items()):
                if now - since > UNCLAIMED_S:
                    del self._waiting[key]
                    old.close()
            for key, since in list(self._refused.items()):
                if now - since > UNCLAIMED_S:  # (its hello never came)
                    del self._refused[key]

    @contextlib.contextmanager
    def stream(self, request: bytes) -> Iterator[socket.socket]:
        """The connection of the reader that made `request`, holding one of MAX_SENDS send
        slots until the `with` ends; `DirectUnavailable` if none is free (the reader reads
        through Ray instead) or the connection never came."""
        if not self._sends.acquire(blocking=False):
            with self._cond:  # (its reader sees the stream end and reads through Ray)
                waiting = self._waiting.pop(request, None)
                if waiting is None:
                    self._refused[request] = time.monotonic()  # (closed when it comes)
            if waiting is not None:
                waiting[0].close()
            raise DirectUnavailable(f"{MAX_SENDS} direct reads are being sent already")
        try:
            with self.claim(request) as conn:
                yield conn
        finally:
            self._sends.release()

    def claim(self, request: bytes) -> socket.socket:
        """The connection of the reader that made `request` (waiting for it a while)."""
        deadline = time.monotonic() + CLAIM_WAIT_S
        with self._cond:
            while request not in self._waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DirectUnavailable(
                        f"the reader's connection for request {request.hex()} never came"
                    )
                self._cond.wait(left)
            return self._waiting.pop(request)[0]

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # (wakes its accept: a close does not)
        self._listener.close()
        with self._cond:
            for conn, _ in self._waiting.values():
                conn.close()
            self._waiting.clear()


def send(conn: socket.socket, wire: WireBatch) -> None:
    """Send a wire batch's header and arrays (views of the segment: sent, not kept); a
    connection that fails is a transport's failure (`DirectUnavailable`)."""
    try:
        _send(conn, wire)
    except OSError as e:
        _reset(conn)
        raise DirectUnavailable(f"the reader's connection failed: {e!r}") from None


def done(conn: socket.socket) -> None:
    """Say the read was checked: the reader may use what it received."""
    try:
        _send_all(conn, DONE)
    except OSError as e:
        _reset(conn)
        raise DirectUnavailable(f"the reader's connection failed: {e!r}") from None


def _send_all(conn: socket.socket, data: Any) -> None:
    """`sendall`, with the socket's timeout per `send` (a reader that stops is given up,
    one that is slow is not: `sendall`'s timeout is for the whole call)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[conn.send(view) :]


def _reset(conn: socket.socket) -> None:
    """Make the connection's close a reset: a reader given up learns it at once, not after
    the bytes still queued for it."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _send(conn: socket.socket, wire: WireBatch) -> None:
    r = wire.request
    arrays = [r.num_tokens, r.has_tokens, r.copies, *wire.routes, *wire.tokens]
    if wire.missing is not None:
        arrays.append(wire.missing)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = json.dumps(
        {
            "layout": r.layout.to_json(),
            "sample_ids": list(r.sample_ids),
            "prompt_lens": list(r.prompt_lens),
            "runs": [len(wire.routes), len(wire.tokens), wire.missing is not None],
            "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
        }
    ).encode()
    _send_all(conn, LENGTH.pack(len(header)) + header)
    for a in arrays:
        if a.nbytes:
            _send_all(conn, a.reshape(-1).view(np.uint8))


# -- the reader's side -------------------------------------------------------------------


class DirectPull:
    """One call's connection, read without blocking so that many are read at once."""

    def __init__(self, address: tuple[str, int], secret: bytes, take: Callable[[int], Any]):
        self.request = secrets.token_bytes(REQUEST_BYTES)
        self._parsed: dict[str, Any] = {}  # the header and the arrays, as `_parts` reads them
        self._frames = _parts(take, self._parsed)  # (holds no `self`: nothing keeps a pull,
        self._frame, self._got = next(self._frames), 0  # and its socket, from its refcount)
        self.finished = False
        self.progress = time.monotonic()
        self.sock: socket.socket | None = None
        try:  # (last: a stop anywhere in the making leaves no connection open)
            self.sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
            self.sock.sendall(HELLO + secret + self.request)
            self.sock.setblocking(False)
        except BaseException:
            if self.sock is not None:
                self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def readable(self) -> None:
        """Take what the socket holds; `finished` once the stream ended with DONE."""
        got = self.sock.recv_into(self._frame[self._got :])
        if not got:
            raise DirectUnavailable("the store actor closed the connection before DONE")
        self._got += got
        self.progress = time.monotonic()
        while self._got == len(self._frame):
            try:
                self._frame, self._got = next(self._frames), 0
            except StopIteration:
                self.finished = True
                return

    def wire(self) -> WireBatch:
        """The received wire batch (views of the reader's buffer)."""
        meta, arrays = self._parsed["meta"], self._parsed["arrays"]
        runs, token_runs, has_missing = meta["runs"]
        if len(arrays) != 3 + runs + token_runs + bool(has_missing):
            raise DirectUnavailable("a header whose arrays do not add up")
        num_tokens, has_tokens, copies = arrays[:3]
        request = Request(
            RoutingLayout.from_json(meta["layout"]),
            meta["sample_ids"],
            num_tokens,
            meta["prompt_lens"],
            has_tokens,
            copies,
        )
        routes = arrays[3 : 3 + runs]
        tokens = arrays[3 + runs : 3 + runs + token_runs]
        return WireBatch(request, routes, tokens, arrays[-1] if has_missing else None)

    def close(self) -> None:
        sock = getattr(self, "sock", None)  # (a pull cut short while being made has none)
        if sock is not None:
            sock.close()

    __del__ = close  # a pull dropped unclosed (a stop between its making and its keeping)


def _parts(take: Callable[[int], Any], parsed: dict[str, Any]) -> Iterator[memoryview]:
    """The memory each next part of a stream goes into; parses as it goes, into `parsed`
    (the header as "meta", the arrays, views of `take`'s memory, as "arrays")."""
    head = bytearray(LENGTH.size)
    yield memoryview(head)
    (length,) = LENGTH.unpack(head)
    if length > MAX_HEADER_BYTES:
        raise DirectUnavailable(f"a header of {length} bytes: not a routing_replay stream")
    text = bytearray(length)
    yield memoryview(text)
    parsed["meta"] = meta = json.loads(text)
    specs = [(np.dtype(d), tuple(int(n) for n in shape)) for d, shape in meta["arrays"]]
    if any(dt.str not in ARRAY_DTYPES or min(shape, default=0) < 0 for dt, shape in specs):
        raise DirectUnavailable(f"arrays {meta['arrays']!r}: not a wire batch's")
    sizes = [dt.itemsize * math.prod(shape) for dt, shape in specs]
    places = np.cumsum([0] + [-(-n // ALIGN) * ALIGN for n in sizes]).tolist()
    buf = take(places[-1])
    parsed["arrays"] = arrays = []
    for (dt, shape), size, at in zip(specs, sizes, places, strict=False):
        part = buf[at : at + size]
        arrays.append(part.view(dt).reshape(shape))
        if size:
            yield memoryview(part)
    done = bytearray(len(DONE))
    yield memoryview(done)
    if done != DONE:
        raise DirectUnavailable("the stream did not end as a routing_replay stream ends")


def drain(pulls: list[DirectPull], check: Callable[[list[int]], list[int]]) -> list[int]:
    """Read every pull's stream at once (none waits on another's). While some are unfinished,
    `check(unfinished)` runs every POLL_S: it raises a call's error, and returns the pulls to
    give up. Returns the indices of the pulls whose stream failed as a transport, or was
    given up: the caller reads those through Ray."""
    failed: list[int] = []
    if not pulls:
        return failed
    try:
        sel = selectors.DefaultSelector()
    except OSError:  # (no descriptor left for it: every read goes through Ray)
        for pull in pulls:
            pull.close()
        return list(range(len(pulls)))
    with sel:
        for i, pull in enumerate(pulls):
            sel.register(pull.sock, selectors.EVENT_READ, i)
        while sel.get_map():
            events = sel.select(POLL_S)
            for key, _ in events:
                i = key.data
                try:
                    pulls[i].readable()
                except (OSError, DirectUnavailable, ValueError, KeyError, TypeError):
                    failed.append(i)  # (a broken stream, or one that is not ours)
                    sel.unregister(key.fileobj)
                    pulls[i].close()  # (its actor's send then fails at once, not in 300 s)
                    continue
                if pulls[i].finished:
                    sel.unregister(key.fileobj)
            if not events:
                for i in check([key.data for key in sel.get_map().values()]):
                    failed.append(i)
                    sel.unregister(pulls[i].sock)
                    pulls[i].close()
    return failed


def stalled(pull: DirectPull) -> bool:
    """Whether a pull whose call returned has waited too long for its bytes."""
    return time.monotonic() - pull.progress > STALLED_S


def connect(endpoint: tuple[str, int, bytes] | None, take: Callable[[int], Any]) -> Any:
    """A pull on the actor's endpoint, or None if there is none or it cannot be reached;
    `DirectUnavailable` if this process lacks what a connection takes (descriptors, ports,
    memory): that says nothing about the actor."""
    if endpoint is None:  # (none, or `enabled()` false: `remote._endpoints`)
        return None
    host, port, secret = endpoint
    try:
        return DirectPull((host, port), secret, take)
    except OSError as e:
        if e.errno in LOCAL_ERRNOS:
            raise DirectUnavailable(f"no connection can be made here: {e!r}") from None
        return None
