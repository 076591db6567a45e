"""Every error routing_replay raises: one class per thing that can go wrong."""

from __future__ import annotations


class RoutingReplayError(Exception):
    """Base class of all routing_replay errors."""


class InvalidRoutesError(RoutingReplayError, ValueError):
    """Routes do not match the layout: shape, layer count, dtype or expert id range."""


class LayoutMismatchError(RoutingReplayError, ValueError):
    """A store, batch or model was built for another routing layout."""


class SampleNotFoundError(RoutingReplayError, KeyError):
    """A sample id is not (or no longer) in the store."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class DuplicateSampleError(RoutingReplayError, ValueError):
    """A sample id is already stored; release it first or pick a unique id."""


class StoreFullError(RoutingReplayError, MemoryError):
    """The store had no room before the put timeout ran out."""


class StoreUnavailableError(RoutingReplayError, OSError):
    """A store segment is missing, unreadable, or /dev/shm has no room for it."""


class CorruptStoreError(RoutingReplayError):
    """A store segment's tables are inconsistent: its routes cannot be trusted."""


class StoreBusyError(RoutingReplayError, TimeoutError):
    """A store's lock stayed held by another process past the operation's timeout."""


class ConcurrentReleaseError(RoutingReplayError, RuntimeError):
    """A sample was released while it was being read."""


class UnsupportedModelError(RoutingReplayError, TypeError):
    """A model has an MoE layer whose router no replay/capture adapter knows."""


class TokenMismatchError(RoutingReplayError, ValueError):
    """Routes were recorded for other tokens than those trained on (or a ref is stale)."""
