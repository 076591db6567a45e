"""The two C library calls that numpy and `mmap` do not offer: a compare that writes
nothing, and a new mapping over an existing one (a forked child's copy of a store)."""

from __future__ import annotations

import ctypes
import mmap

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.memcmp.restype = ctypes.c_int
_LIBC.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
MAP_FIXED = 0x10  # Linux, every architecture


def same_memory(a: int, b: int, nbytes: int) -> bool:
    """Whether `nbytes` at addresses `a` and `b` are equal: memcmp reads both once and
    writes nothing (numpy's `==` writes a mask, then reduces it: 1.4x the time on a GRPO
    prompt's routes)."""
    return _LIBC.memcmp(a, b, nbytes) == 0


def map_privately(mapping: mmap.mmap, fd: int) -> bool:
    """Map `fd` copy-on-write over `mapping`, at its address: its views stay valid but
    write only this process's copy from then on. False if the kernel refused."""
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view
    flags, prot = mmap.MAP_PRIVATE | MAP_FIXED, mmap.PROT_READ | mmap.PROT_WRITE
    return _LIBC.mmap(address, len(mapping), prot, flags, fd, 0) == address
