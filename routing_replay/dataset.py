"""Moved: `routing_replay.dataset` is an old import path, kept for one release."""

from routing_replay._moved import forwarder

__getattr__ = forwarder(
    __name__,
    {
        "fetch_batch": "routing_replay.ray.dataset:fetch_batch",
        "read_dataset": "routing_replay.ray.dataset:read_dataset",
        "release_refs": "routing_replay.ray.dataset:release_refs",
        "routes_collate_fn": "routing_replay.ray.dataset:routes_collate_fn",
        "split_stale": "routing_replay.ray.dataset:split_stale",
    },
)
