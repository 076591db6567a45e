"""Byte buffers reused from call to call: a store actor's narrowing buffers, and the memory
a reader receives direct reads into.

The fresh pages of a read-sized buffer cost more than filling it (DeepSeek-V3, 524,288
tokens: 0.15 s to narrow into a new 232 MB buffer, 0.04 s into a used one), so the actor
narrows each read into a buffer it keeps, leased for as long as `ray.put` takes to copy it
out; concurrent calls lease different buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np


class Scratch:
    """Buffers kept between leases, the largest first, up to `keep_bytes` in all. No lock:
    the free buffers sit in a dict whose single operations are atomic, so a lease stopped at
    any line (a Ctrl-C, `ray.cancel`) may leave a buffer to the collector, never a lock held
    that would stall every later read of the process."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, np.ndarray] = {}  # by id()

    @property
    def kept_bytes(self) -> int:
        return sum(buf.size for buf in list(self._free.values()))

    def _pop_fitting(self, n: int) -> np.ndarray | None:
        """The smallest free buffer of n bytes or more, taken; None if there is none."""
        while True:
            fits = [(buf.size, key) for key, buf in list(self._free.items()) if buf.size >= n]
            if not fits:
                return None
            buf = self._free.pop(min(fits)[1], None)
            if buf is not None:  # (else another lease took it meanwhile: look again)
                return buf

    @contextmanager
    def lease(self) -> Iterator[Callable[[int], np.ndarray]]:
        """`take(n)`: n bytes (uint8) that no other lease holds until this one ends."""
        taken: list[np.ndarray] = []

        def take(n: int) -> np.ndarray:
            buf = self._pop_fitting(n)
            if buf is None:
                buf = np.empty(n, dtype=np.uint8)
            taken.append(buf)
            return buf[:n]

        try:
            yield take
        finally:
            self._free.update({id(buf): buf for buf in taken})
            total = 0
            for key, buf in sorted(list(self._free.items()), key=lambda kv: -kv[1].size):
                if total + buf.size <= self.keep_bytes:
                    total += buf.size
                else:
                    self._free.pop(key, None)
