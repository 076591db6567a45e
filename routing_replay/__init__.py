"""routing_replay: Rollout Routing Replay for Mixture-of-Experts RL.

Data path, top to bottom: layout -> capture -> store -> read -> replay.
"""

from routing_replay.agreement import Agreement, routing_agreement
from routing_replay.capture import Capture, capture
from routing_replay.errors import (
    ConcurrentReleaseError,
    DuplicateSampleError,
    InvalidRoutesError,
    LayoutMismatchError,
    RoutingReplayError,
    SampleNotFoundError,
    StoreFullError,
    StoreUnavailableError,
    UnsupportedModelError,
)
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.reader import cu_seqlens, to_torch
from routing_replay.replay import Replay, replay
from routing_replay.schema import layout_of, routes_schema
from routing_replay.store import RoutingRef, RoutingStore, StoreStats

__all__ = [
    "MISSING",
    "Agreement",
    "Capture",
    "ConcurrentReleaseError",
    "DuplicateSampleError",
    "InvalidRoutesError",
    "LayoutMismatchError",
    "Replay",
    "RoutingLayout",
    "RoutingRef",
    "RoutingReplayError",
    "RoutingStore",
    "SampleNotFoundError",
    "StoreFullError",
    "StoreStats",
    "StoreUnavailableError",
    "UnsupportedModelError",
    "capture",
    "cu_seqlens",
    "layout_of",
    "replay",
    "routes_schema",
    "routing_agreement",
    "to_torch",
]
__version__ = "0.1.0"
