"""The Ray plane: one store actor per (job, node), refs through the driver, reads by node.

Read in this order:

- `options`: `StoreOptions`, how a node's store is made;
- `names`: the store actors' and segments' names, `store_actors` (the live ones);
- `actor`: the node store actor (creates, serves and removes a node's store);
- `shutdown`: `shutdown_node_stores`, and the sweep of segments dead actors left;
- `client`: `node_store(job, layout)` and this process's cache of attached stores;
- `dataset`: `fetch_batch`, `read_dataset`, `release_refs`, `split_stale` (`assemble` places
  rows of several stores);
- `collate`: `routes_collate_fn`, a dataset's batches as packed torch tensors;
- `rollout`: `RolloutWorker`, a transformers model generating under `capture`.

Ray is imported inside the functions: `import routing_replay.ray` works without Ray.
"""

from routing_replay.ray.actor import store_actor
from routing_replay.ray.client import node_store
from routing_replay.ray.collate import routes_collate_fn
from routing_replay.ray.dataset import fetch_batch, read_dataset, release_refs, split_stale
from routing_replay.ray.names import store_actors
from routing_replay.ray.options import StoreOptions
from routing_replay.ray.rollout import Rollout, RolloutWorker, rollout_worker
from routing_replay.ray.shutdown import shutdown_node_stores

__all__ = [
    "Rollout",
    "RolloutWorker",
    "StoreOptions",
    "fetch_batch",
    "node_store",
    "read_dataset",
    "release_refs",
    "rollout_worker",
    "routes_collate_fn",
    "shutdown_node_stores",
    "split_stale",
    "store_actor",
    "store_actors",
]
