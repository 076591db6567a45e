"""A model's open capture blocks, and its methods wrapped once for all of them.

Blocks of one model queue on its decoder (`ACTIVE`) by atomic list appends: no lock a stop
could leave held. `generate`, `prepare_inputs_for_generation` and routing methods (DBRX)
get one `_Dispatch` each, never removed, that runs the actions of the blocks open for the
caller, so blocks may exit in any order, from any thread.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch
from torch import nn

from routing_replay.compat.torch import break_graph, run_eagerly
from routing_replay.model.forcing import wrapped
from routing_replay.model.owner import Owner, current_owner, owns

ACTIVE = "_routing_replay_capture"  # on the decoder: its capture blocks (`Entry`), in order
FULLGRAPH = (
    "capture: a forward's bookkeeping (which sample, which cache, whose thread) runs "
    "eagerly, between compiled graphs; compile without fullgraph=True while capturing"
)


class Queue(list):
    """A model's capture blocks (`Entry`), in order; a copy of the model starts with none."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (Queue, ())


class Entry:
    """A capture block in its model's queue: who entered it, and the block (weakly)."""

    def __init__(self, owner: Owner, capture: weakref.ref) -> None:
        self.owner, self.capture = owner, capture

    def is_open(self) -> bool:
        return getattr(self.capture(), "_open", False)


def drop(blocks: list, entry: Entry) -> None:
    """Remove `entry` from the queue (another thread may have removed it already)."""
    with contextlib.suppress(ValueError):
        blocks.remove(entry)


def recording(module: nn.Module, hook: Any) -> Any:
    """An action calling `hook(module, args, output)` after the method, like a forward hook."""

    def record(method: Any, *args: Any, **kwargs: Any) -> Any:
        output = method(*args, **kwargs)
        hook(module, args, output)
        return output

    return record


class _Dispatch:
    """A method of a model (`generate`, `prepare_inputs_for_generation`, a router's routing
    method) wrapped once and for good: each call runs through the actions of the capture
    blocks open for the caller (outermost first), none outside a block. Never removed, so
    blocks entered and exited in any order, from any thread, lose or strand no wrapper.
    Replay's forward of a routing method goes beneath it (`replay_beneath`): the block
    records the forced ids."""

    replay_beneath = True

    def __init__(self, decoder: nn.Module, inner: Any) -> None:
        self.decoder, self.inner = decoder, inner

    @property
    def __wrapped__(self) -> Any:  # signature lookups (generate reads prepare's) see through
        return self.inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.decoder.__dict__.get(ACTIVE):  # no block open: the method alone
            return self.inner(*args, **kwargs)
        if torch.compiler.is_compiling():  # the queue and owners are looked up eagerly
            break_graph(FULLGRAPH)
            return run_eagerly(functools.partial(self._dispatch, *args, **kwargs))
        return self._dispatch(*args, **kwargs)

    def _dispatch(self, *args: Any, **kwargs: Any) -> Any:
        call = self.inner
        now = current_owner()
        for entry in reversed(list(self.decoder.__dict__.get(ACTIVE, ()))):
            block = entry.capture()
            action = None if block is None else block._actions.get(id(self))
            if action is not None and entry.is_open() and owns(entry.owner, now):
                call = functools.partial(action, call)
        return call(*args, **kwargs)


def dispatch(target: Any, name: str, decoder: nn.Module) -> _Dispatch:
    """`target`'s dispatcher of `name` (found under other code's wrappers), installed if none."""
    found = wrapped(vars(target).get(name), _Dispatch)
    if found is not None:
        return found
    found = _Dispatch(decoder, getattr(target, name))
    setattr(target, name, found)
    return found
