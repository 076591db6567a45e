"""The store's own descriptors: opened straight into their owner, closed once.

A descriptor a Ctrl-C separates from its owner stays open until the process exits (a
segment's mapping keeps a removed store's memory, a lock file keeps a lease). Python runs
signal handlers as a C call returns, so an open and the code that keeps its number must not
be two calls: each open here runs inside `map()`, which hands the number on in C, and each
close pops and closes inside C too.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os


def open_file(path: str, flags: int, mode: int = 0o600, *, follow: bool = False) -> io.FileIO:
    """`path` opened as a file object that owns its descriptor from the open on (closed at its
    `with` exit, or when it is collected): `os.open` runs inside `map`, which hands the number
    to the file object in C, so no signal handler or trace stop runs between the two; never
    through a link (unless `follow`: a user's own path), never waiting on a FIFO (O_NONBLOCK:
    check the type)."""
    how = "rb" if flags & os.O_ACCMODE == os.O_RDONLY else "wb"
    flags |= os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        return io.FileIO(*map(os.open, (path,), (flags,), (mode,)), how)
    except IsADirectoryError as e:  # the file object refuses a directory without closing it
        if isinstance(e.filename, int):
            os.close(e.filename)
        raise


def open_into(fds: list[int], path: str, flags: int, mode: int = 0o600) -> int:
    """Open `path` straight into the list `fds` (in C, as in `open_file`: no stop between the
    open and the list), which its caller closes whatever happens; returns the descriptor."""
    fds.extend(map(os.open, (path,), (flags,), (mode,)))
    return fds[-1]


def close_each(fds: list[int]) -> None:
    """Close and forget every descriptor in `fds`, each taken by one `pop` (atomic): threads
    closing at once, or a close after one stopped half-way, never close one twice (its
    number may by then name another file of the process). A close that fails (EIO: Linux
    has freed the descriptor anyway) does not stop the others; the first failure is raised
    once all are closed."""
    failed = None
    while fds:
        # pop and close inside C (no signal handler runs between them, which would lose the
        # number); an IndexError: another thread took the last one.
        try:
            with contextlib.suppress(IndexError):
                collections.deque(map(os.close, iter(fds.pop, None)), maxlen=0)
        except OSError as e:
            failed = failed or e
    if failed is not None:
        raise failed
