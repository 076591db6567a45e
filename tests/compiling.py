"""torch.compile in tests: a backend that counts the graphs it compiles, and a fresh Dynamo.

Dynamo caches compiled frames per code object and, past its recompile limit (8), runs a frame
eagerly without a word: a test compiling many models through one lambda must reset it first
and check that graphs were compiled, or it tests eager mode under compile's name.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import counters


class Graphs:
    """A torch.compile backend that counts the graphs it is given, then compiles them."""

    def __init__(self, backend: str = "aot_eager") -> None:
        self.count = 0
        self.backend = torch._dynamo.lookup_backend(backend)

    def __call__(self, gm, example_inputs):
        self.count += 1
        return self.backend(gm, example_inputs)


def reset_dynamo() -> None:
    """Forget every compiled frame and the graph-break counters."""
    torch._dynamo.reset()
    counters.clear()
