"""routing_replay: Rollout Routing Replay for Mixture-of-Experts RL.

The data path, top to bottom, and where each part lives:

- the data contract: `layout` (RoutingLayout), `validate` (route checks), `schema` (Arrow),
  `reader` (`to_torch`), `shard` (`TokenShard`: a rank's token ranges), `errors`;
- `model/`: routers of transformers MoE models, `capture`, `replay`, agreement, aux loss;
- `store/`: the per-node shared-memory store, `RoutingRef`, episodes;
- `ray/`: node store actors, `fetch_batch` / `read_dataset`, rollout workers;
- `integrations/` (imported as `routing_replay.integrations`): vLLM, SGLang, NeMo-RL-style
  batches, TRL, verl, Megatron.
"""

from routing_replay._moved import forwarder
from routing_replay.errors import (
    ConcurrentReleaseError,
    CorruptArchiveError,
    CorruptStoreError,
    DuplicateSampleError,
    InvalidArgumentError,
    InvalidRoutesError,
    LayoutMismatchError,
    RoutingReplayError,
    SampleNotFoundError,
    SampleReplacedError,
    StoreBusyError,
    StoreFullError,
    StoreUnavailableError,
    TokenMismatchError,
    UnsupportedModelError,
)
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.model.adapters import register_router
from routing_replay.model.agreement import Agreement, routing_agreement
from routing_replay.model.aux_loss import load_balancing_loss
from routing_replay.model.capture import capture
from routing_replay.model.replay import prepare_replay, replay
from routing_replay.reader import cu_seqlens, to_torch
from routing_replay.routes import UNCHECKED, RoutesTensor, with_layout
from routing_replay.schema import layout_of, routes_schema
from routing_replay.shard import TokenShard
from routing_replay.store import (
    Episode,
    PutRequest,
    RoutingRef,
    RoutingStore,
    StoreInfo,
    StoreStats,
    list_stores,
    load_routes,
    save_routes,
    sweep_stores,
)

__all__ = [
    "MISSING",
    "UNCHECKED",
    "Agreement",
    "ConcurrentReleaseError",
    "CorruptArchiveError",
    "CorruptStoreError",
    "DuplicateSampleError",
    "Episode",
    "InvalidArgumentError",
    "InvalidRoutesError",
    "LayoutMismatchError",
    "PutRequest",
    "RoutesTensor",
    "RoutingLayout",
    "RoutingRef",
    "RoutingReplayError",
    "RoutingStore",
    "SampleNotFoundError",
    "SampleReplacedError",
    "StoreBusyError",
    "StoreFullError",
    "StoreInfo",
    "StoreStats",
    "StoreUnavailableError",
    "TokenMismatchError",
    "TokenShard",
    "UnsupportedModelError",
    "capture",
    "cu_seqlens",
    "layout_of",
    "list_stores",
    "load_balancing_loss",
    "load_routes",
    "prepare_replay",
    "register_router",
    "replay",
    "routes_schema",
    "routing_agreement",
    "save_routes",
    "sweep_stores",
    "to_torch",
    "with_layout",
]
__version__ = "0.1.0"

# Names that lived here before the Ray helpers moved to `routing_replay.ray` (one release).
__getattr__ = forwarder(
    __name__,
    {
        "Capture": "routing_replay.model.capture:Capture",
        "Replay": "routing_replay.model.replay:Replay",
        "Rollout": "routing_replay.ray.rollout:Rollout",
        "RolloutWorker": "routing_replay.ray.rollout:RolloutWorker",
        "rollout_worker": "routing_replay.ray.rollout:rollout_worker",
        "fetch_batch": "routing_replay.ray.dataset:fetch_batch",
        "read_dataset": "routing_replay.ray.dataset:read_dataset",
        "release_refs": "routing_replay.ray.dataset:release_refs",
        "routes_collate_fn": "routing_replay.ray.dataset:routes_collate_fn",
        "split_stale": "routing_replay.ray.dataset:split_stale",
        "node_store": "routing_replay.ray.client:node_store",
        "shutdown_node_stores": "routing_replay.ray.actor:shutdown_node_stores",
    },
)
