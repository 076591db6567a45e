"""How capture reads a transformers cache's length (DynamicCache, StaticCache, hybrid caches).

Only python ints are read: a length kept in a device tensor is never read here, since on CUDA
that read waits for the device.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import Tensor

from routing_replay.compat.transformers import keeps_no_tokens


def is_2d_mask(mask: Any) -> bool:
    """True for a [batch, columns] attention mask (not a 4-D one, not None)."""
    return isinstance(mask, Tensor) and mask.dim() == 2


def past_columns(mask: Tensor | None, cache: Any, width: int, whole: bool = False) -> int | None:
    """Columns forwarded before this one, from python ints only: never a device read.

    From the 2-D attention mask (generate's covers the whole sequence) and every cache layer
    whose length is a python int (DynamicCache, sliding-window layers, a StaticCache before
    its first update). A hybrid model's cache reports 0 for layers that keep no tokens
    (MiniMax: linear attention in layer 0), so every layer is asked. A StaticCache layer
    keeps its length in a device tensor, which is not read: None when only such a tensor
    could say the answer is not 0. `whole`: the mask is known to span the whole sequence.
    """
    past = mask.shape[1] - width if mask is not None else 0
    if whole and mask is not None:
        return past
    on_device = False
    for length in cache_lengths(cache):
        if isinstance(length, Tensor):
            on_device = True
        else:
            past = max(past, int(length))
    return None if on_device and past == 0 else past


def cache_lengths(cache: Any) -> list[Any]:
    """Each layer's `get_seq_length`, as the cache returns it (an int or a tensor, unread)."""
    if not hasattr(cache, "get_seq_length"):
        return []
    lengths = []
    for layer in range(max(len(cache), 1) if hasattr(cache, "__len__") else 1):
        if keeps_no_tokens(cache, layer):  # linear attention: its length is no column count
            continue
        with contextlib.suppress(ValueError, IndexError):  # a layer that tracks no length
            lengths.append(cache.get_seq_length(layer))
    return lengths
