"""Every error routing_replay raises: one class per thing that can go wrong.

Each name says what was wrong; the message says what to do. Bad arguments are
`ValueError`s (`InvalidArgumentError`, `InvalidRoutesError`, `LayoutMismatchError`,
`TokenMismatchError`); a missing or replaced sample is a `KeyError`; a store that cannot be
reached is an `OSError`. A full store is none of the built-in kinds: an out-of-memory
handler must never swallow it.
"""

from __future__ import annotations


class RoutingReplayError(Exception):
    """Base class of all routing_replay errors."""


class InvalidArgumentError(RoutingReplayError, ValueError):
    """An argument is malformed: a sample id, prompt_len, policy version, part, an option."""


class InvalidRoutesError(RoutingReplayError, ValueError):
    """Routes are malformed: shape, dtype, an expert id out of range or repeated, a partly
    missing row, routes on padding, rows misaligned with the tokens."""


class LayoutMismatchError(RoutingReplayError, ValueError):
    """A store, batch, routes tensor or model was built for another routing layout."""


class TokenMismatchError(RoutingReplayError, ValueError):
    """Routes were recorded for other tokens than those trained on."""


class SampleNotFoundError(RoutingReplayError, KeyError):
    """A sample id is not (or no longer) in the store."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class SampleReplacedError(SampleNotFoundError):
    """A ref's sample was released and its id put again: the ref names a put that is gone."""


class DuplicateSampleError(RoutingReplayError, ValueError):
    """A sample id is already stored; release it first or pick a unique id."""


class StoreFullError(RoutingReplayError):
    """The store had no room (pages or sample slots) before the put timeout ran out."""


class StoreUnavailableError(RoutingReplayError, OSError):
    """A store segment is missing, unreadable, or /dev/shm has no room for it."""


class CorruptStoreError(RoutingReplayError):
    """A store segment's tables are inconsistent: its routes cannot be trusted."""


class CorruptArchiveError(RoutingReplayError):
    """A route archive is truncated, damaged or not an archive: nothing is loaded from it."""


class StoreBusyError(RoutingReplayError, TimeoutError):
    """A store's lock stayed held by another process past the operation's timeout."""


class ConcurrentReleaseError(RoutingReplayError, RuntimeError):
    """A sample was released (or released and put again) while it was being read."""


class UnsupportedModelError(RoutingReplayError, TypeError):
    """A model has an MoE layer whose router no replay/capture adapter knows."""


class UnsupportedGenerationError(RoutingReplayError, NotImplementedError):
    """A `generate` mode capture cannot follow token by token (beam search, assisted or
    speculative decoding): nothing of that call is recorded."""


class CaptureAlignmentError(RoutingReplayError, RuntimeError):
    """Captured forwards cannot be aligned with what `generate` returned."""
