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

from routing_replay.errors import RoutingReplayError
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.model.capture import capture
from routing_replay.model.replay import replay
from routing_replay.reader import cu_seqlens, to_torch
from routing_replay.routes import UNCHECKED, RoutesTensor, with_layout
from routing_replay.shard import TokenShard
from routing_replay.store import (
    Episode,
    PutRequest,
    RoutingRef,
    RoutingStore,
    load_routes,
    save_routes,
)

# What a user needs in the first hour. The rest lives in its module: errors in
# `routing_replay.errors`, `routing_agreement` in `model.agreement`, `load_balancing_loss` in
# `model.aux_loss`, `register_router` in `model.adapters`, `sweep_stores` in `store`, the
# Arrow schema in `schema`, the Ray plane in `routing_replay.ray`.
__all__ = [
    "MISSING",
    "UNCHECKED",
    "Episode",
    "PutRequest",
    "RoutesTensor",
    "RoutingLayout",
    "RoutingRef",
    "RoutingReplayError",
    "RoutingStore",
    "TokenShard",
    "capture",
    "cu_seqlens",
    "load_routes",
    "replay",
    "save_routes",
    "to_torch",
    "with_layout",
]
__version__ = "0.1.0"
