"""Moved: `routing_replay.adapters` is an old import path, kept for one release."""

from routing_replay._moved import forwarder

__getattr__ = forwarder(
    __name__,
    {
        "find_routers": "routing_replay.model.adapters:find_routers",
        "register_router": "routing_replay.model.adapters:register_router",
    },
)
