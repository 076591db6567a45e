"""Moved: `routing_replay.rollout` is an old import path, kept for one release."""

from routing_replay._moved import forwarder

__getattr__ = forwarder(
    __name__,
    {
        "Rollout": "routing_replay.ray.rollout:Rollout",
        "RolloutWorker": "routing_replay.ray.rollout:RolloutWorker",
        "rollout_worker": "routing_replay.ray.rollout:rollout_worker",
        "demo_model": "routing_replay.testing:tiny_moe",
        "demo_tokenizer": "routing_replay.testing:tiny_tokenizer",
    },
)
