"""routing_replay: Rollout Routing Replay for Mixture-of-Experts RL.

Data path, top to bottom: layout -> capture -> store (episodes) -> read -> replay.
"""

from routing_replay.agreement import Agreement, routing_agreement
from routing_replay.aux_loss import load_balancing_loss
from routing_replay.capture import Capture, capture
from routing_replay.dataset import (
    fetch_batch,
    read_dataset,
    release_refs,
    routes_collate_fn,
    split_stale,
)
from routing_replay.episode import Episode
from routing_replay.errors import (
    ConcurrentReleaseError,
    CorruptStoreError,
    DuplicateSampleError,
    InvalidRoutesError,
    LayoutMismatchError,
    RoutingReplayError,
    SampleNotFoundError,
    StoreBusyError,
    StoreFullError,
    StoreUnavailableError,
    TokenMismatchError,
    UnsupportedModelError,
)
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.reader import cu_seqlens, to_torch
from routing_replay.replay import Replay, prepare_replay, replay
from routing_replay.rollout import Rollout, RolloutWorker, rollout_worker
from routing_replay.schema import layout_of, routes_schema
from routing_replay.store import (
    RoutingRef,
    RoutingStore,
    StoreInfo,
    StoreStats,
    list_stores,
    sweep_stores,
)
from routing_replay.store_actor import node_store, shutdown_node_stores

__all__ = [
    "MISSING",
    "Agreement",
    "Capture",
    "ConcurrentReleaseError",
    "CorruptStoreError",
    "DuplicateSampleError",
    "Episode",
    "InvalidRoutesError",
    "LayoutMismatchError",
    "Replay",
    "Rollout",
    "RolloutWorker",
    "RoutingLayout",
    "RoutingRef",
    "RoutingReplayError",
    "RoutingStore",
    "SampleNotFoundError",
    "StoreBusyError",
    "StoreFullError",
    "StoreInfo",
    "StoreStats",
    "StoreUnavailableError",
    "TokenMismatchError",
    "UnsupportedModelError",
    "capture",
    "cu_seqlens",
    "fetch_batch",
    "layout_of",
    "list_stores",
    "load_balancing_loss",
    "node_store",
    "prepare_replay",
    "read_dataset",
    "release_refs",
    "replay",
    "rollout_worker",
    "routes_collate_fn",
    "routes_schema",
    "routing_agreement",
    "shutdown_node_stores",
    "split_stale",
    "sweep_stores",
    "to_torch",
]
__version__ = "0.1.0"
