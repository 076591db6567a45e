"""How a node's store is made: one value from `node_store` (and the rollout hosts) to the
store actor that creates it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from routing_replay.errors import InvalidArgumentError
from routing_replay.store import DEFAULT_PAGE_TOKENS
from routing_replay.store.routing_store import check_sizes

DEFAULT_CAPACITY_TOKENS = 1 << 20
DEFAULT_JOB_WATCH_S = 5.0
MAX_JOB_WATCH_S = 3600.0  # a watch slower than this would not find a dead job in time


@dataclass(frozen=True)
class StoreOptions:
    """The store a node's store actor creates, and how it watches its Ray job.

    `capacity_tokens`, `page_tokens`, `max_samples`, `spill_dir` (a local disk of each node)
    and `spill_budget` are `RoutingStore.create`'s. `job_watch_s`: how often the actor checks
    that the Ray job that started it is alive (it unlinks and exits when not); None keeps it
    until `shutdown_node_stores`. They apply when the node's actor starts: later callers
    attach to the store as it is.
    """

    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    page_tokens: int = DEFAULT_PAGE_TOKENS
    max_samples: int | None = None
    spill_dir: str | None = None
    spill_budget: int | None = None
    job_watch_s: float | None = DEFAULT_JOB_WATCH_S

    def __post_init__(self) -> None:
        # Refused here, where the caller is, rather than in the actor that creates the store.
        spill_dir = self.spill_dir
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise InvalidArgumentError(f"spill_dir must be a path, got {spill_dir!r}")
        if spill_dir is not None and not os.path.isabs(spill_dir):
            raise InvalidArgumentError(
                f"spill_dir must be an absolute path (each node's store actor creates it on "
                f"that node, in no working directory of yours), got {spill_dir!r}"
            )
        sizes = (self.capacity_tokens, self.page_tokens, self.max_samples, self.spill_budget)
        capacity, page, samples, budget, _ = check_sizes(*sizes, spill_dir=spill_dir)
        for name, value in zip(
            ("capacity_tokens", "page_tokens", "max_samples", "spill_budget"),
            (capacity, page, samples, budget),
            strict=True,
        ):
            object.__setattr__(self, name, value)  # Python ints, as the actor's create needs
        watch = self.job_watch_s
        if watch is not None and (
            type(watch) is bool
            or not isinstance(watch, (int, float))
            or not 0 < watch <= MAX_JOB_WATCH_S
        ):
            raise InvalidArgumentError(
                f"job_watch_s must be seconds in (0, {MAX_JOB_WATCH_S:.0f}], or None to keep the "
                f"store until shutdown_node_stores, got {watch!r}"
            )

    def create_kwargs(self) -> dict[str, Any]:
        """What `RoutingStore.create` takes after the name and layout."""
        kwargs = asdict(self)
        del kwargs["job_watch_s"]
        if self.spill_dir is not None:
            kwargs["spill_dir"] = os.fspath(self.spill_dir)
        return kwargs


def store_options(options: StoreOptions | None) -> StoreOptions:
    """`options`, checked to be a StoreOptions (None: the defaults)."""
    if options is None:
        return StoreOptions()
    if not isinstance(options, StoreOptions):
        raise InvalidArgumentError(
            f"store options must be a routing_replay.ray.StoreOptions, got "
            f"{type(options).__name__}: e.g. StoreOptions(capacity_tokens=1 << 22)"
        )
    return options
