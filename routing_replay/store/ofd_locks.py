"""Leases: open-file-description (OFD) byte-range locks, one byte per lease.

The kernel drops a description's locks when its last descriptor closes, so a lease is
free exactly when its holder is gone (killed or exited): liveness without pids.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os


class _Flock(ctypes.Structure):
    """`struct flock` of fcntl(2) on 64-bit Linux."""

    _fields_ = [
        ("l_type", ctypes.c_short),
        ("l_whence", ctypes.c_short),
        ("l_start", ctypes.c_int64),
        ("l_len", ctypes.c_int64),
        ("l_pid", ctypes.c_int32),
    ]


def _flock(kind: int, offset: int) -> bytes:
    return bytes(_Flock(kind, os.SEEK_SET, offset, 1, 0))


def lease_try(fd: int, offset: int) -> bool:
    """Take the lease at byte `offset` on `fd`'s description; False if another holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, offset))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lease_drop(fd: int, offset: int) -> None:
    """Give back the lease at byte `offset` held on `fd`'s description."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, offset))


def lease_held(fd: int, offset: int) -> bool:
    """Whether a description other than `fd`'s holds the lease at byte `offset`.

    A description never conflicts with its own locks: a caller asks about its own lease
    from its own bookkeeping, not here.
    """
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_RDLCK, offset))
    return _Flock.from_buffer_copy(answer).l_type != fcntl.F_UNLCK
