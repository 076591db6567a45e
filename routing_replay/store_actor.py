"""Moved: `routing_replay.store_actor` is an old import path, kept for one release."""

from routing_replay._moved import forwarder

__getattr__ = forwarder(
    __name__,
    {
        "node_store": "routing_replay.ray.client:node_store",
        "shutdown_node_stores": "routing_replay.ray.actor:shutdown_node_stores",
        "store_actor": "routing_replay.ray.actor:store_actor",
        "store_actors": "routing_replay.ray.actor:store_actors",
    },
)
