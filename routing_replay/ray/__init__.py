"""The Ray plane: one store actor per (job, node), refs through the driver, reads by node.

Read in this order:

- `options`: `StoreOptions`, how a node's store is made;
- `actor`: the node store actor (creates, serves and removes a node's store), its names;
- `client`: `node_store(job, layout)` and this process's cache of attached stores;
- `dataset`: `fetch_batch`, `read_dataset`, `release_refs`, `split_stale` (`assemble` places
  rows of several stores);
- `collate`: `routes_collate_fn`, a dataset's batches as packed torch tensors;
- `rollout`: `RolloutWorker`, a transformers model generating under `capture`.

Ray is imported inside the functions: `import routing_replay.ray` works without Ray.
"""

from routing_replay.ray.actor import shutdown_node_stores, store_actor, store_actors
from routing_replay.ray.client import node_store
from routing_replay.ray.collate import routes_collate_fn
from routing_replay.ray.dataset import fetch_batch, read_dataset, release_refs, split_stale
from routing_replay.ray.options import StoreOptions
from routing_replay.ray.rollout import Rollout, RolloutWorker, rollout_worker

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
