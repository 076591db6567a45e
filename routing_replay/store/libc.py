"""The C library call numpy does not offer: a compare that writes nothing."""

from __future__ import annotations

import ctypes

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.memcmp.restype = ctypes.c_int
_LIBC.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def same_memory(a: int, b: int, nbytes: int) -> bool:
    """Whether `nbytes` at addresses `a` and `b` are equal: memcmp reads both once and
    writes nothing (numpy's `==` writes a mask, then reduces it: 1.4x the time on a GRPO
    prompt's routes)."""
    return _LIBC.memcmp(a, b, nbytes) == 0
