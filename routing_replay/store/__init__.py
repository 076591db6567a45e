"""The per-node routing store: paged, prefix-sharing, crash-safe, in one shm segment.

One small object per concept, read in this order:

- `format`: constants, record types and regions of the segment;
- `tables`: typed views of one segment and their bounds checks;
- `lock`: the commit lock, dirty flag and repair (and the test-only interleaving hook);
- `leases`: writer liveness as kernel byte-range locks, valid across pid namespaces;
- `pages`: the page allocator (free stack, generations, reservations, refcounts);
- `samples`: the sample index (slots, id buckets, checksums, token digests);
- `prefix`: the prefix index and frozen share plans;
- `routing_store`: `RoutingStore`, the facade;
- `sweep`: `list_stores`, `sweep_stores`.
"""

from routing_replay.store.format import DEFAULT_PAGE_TOKENS, DEFAULT_PUT_TIMEOUT_S
from routing_replay.store.routing_store import (
    Part,
    RoutingRef,
    RoutingStore,
    StoreStats,
    default_node_id,
)
from routing_replay.store.samples import token_digest
from routing_replay.store.sweep import StoreInfo, list_stores, sweep_stores

__all__ = [
    "DEFAULT_PAGE_TOKENS",
    "DEFAULT_PUT_TIMEOUT_S",
    "Part",
    "RoutingRef",
    "RoutingStore",
    "StoreInfo",
    "StoreStats",
    "default_node_id",
    "list_stores",
    "sweep_stores",
    "token_digest",
]
