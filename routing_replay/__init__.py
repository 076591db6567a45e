"""routing_replay: Rollout Routing Replay for Mixture-of-Experts RL.

Data path, top to bottom: layout -> capture -> store -> read -> replay.
"""

from routing_replay.errors import (
    ConcurrentReleaseError,
    DuplicateSampleError,
    InvalidRoutesError,
    LayoutMismatchError,
    RoutingReplayError,
    SampleNotFoundError,
    StoreFullError,
    StoreUnavailableError,
)
from routing_replay.layout import MISSING, RoutingLayout

__all__ = [
    "MISSING",
    "ConcurrentReleaseError",
    "DuplicateSampleError",
    "InvalidRoutesError",
    "LayoutMismatchError",
    "RoutingLayout",
    "RoutingReplayError",
    "SampleNotFoundError",
    "StoreFullError",
    "StoreUnavailableError",
]
__version__ = "0.1.0"
