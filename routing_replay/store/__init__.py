"""The per-node routing store: paged, prefix-sharing, crash-safe, in one shm segment.

One small object per concept, read in this order:

- `ofd_locks`: leases, the kernel's byte-range locks (free when their holder is gone);
- `libc`: memcmp, a compare numpy lacks (it writes nothing);
- `segment`: the shared-memory file, its trusted creation and attachment, its locks;
- `format`: constants, record types and regions of the segment;
- `tables`: typed views of one segment and their bounds checks;
- `lock`: the commit lock, dirty flag and repair (and the test-only interleaving hook);
- `leases`: writer liveness as kernel byte-range locks, valid across pid namespaces;
- `pages`: the page allocator (free stack, generations, reservations, refcounts);
- `samples`: the sample index (slots, id buckets, checksums, token digests);
- `prefix`: the prefix index and frozen share plans;
- `refs`: `RoutingRef` (names one put), `PutRequest`, and the checks of their arguments;
- `put`: `PutTransaction`, the put protocol (one sample or many, all or none);
- `read`: `ReadPlan`, the read protocol (locate, copy, check, Arrow), and `WireBatch`, a
  read in the form that crosses the network (each stored token once);
- `verify`: every invariant of the tables, checked at once;
- `repair`: what a holder or writer that died half-way left, rolled back or reclaimed;
- `routing_store`: `RoutingStore`, the facade;
- `sweep`: `list_stores`, `sweep_stores`;
- `episode`: `Episode`, a multi-turn episode built from puts;
- `archive`: `save_routes` / `load_routes`, routes in an Arrow IPC file across restarts.
"""

from routing_replay.store.archive import RouteArchive, load_routes, save_routes
from routing_replay.store.episode import Episode
from routing_replay.store.format import DEFAULT_PAGE_TOKENS, DEFAULT_PUT_TIMEOUT_S
from routing_replay.store.read import WireBatch
from routing_replay.store.refs import Part, PutRequest, RoutingRef
from routing_replay.store.routing_store import RoutingStore, StoreStats, default_node_id
from routing_replay.store.samples import token_digest
from routing_replay.store.spill_dirs import sweep_spill_dirs
from routing_replay.store.sweep import StoreInfo, list_stores, sweep_stores

__all__ = [
    "DEFAULT_PAGE_TOKENS",
    "DEFAULT_PUT_TIMEOUT_S",
    "Episode",
    "Part",
    "PutRequest",
    "RouteArchive",
    "RoutingRef",
    "RoutingStore",
    "StoreInfo",
    "StoreStats",
    "WireBatch",
    "default_node_id",
    "list_stores",
    "load_routes",
    "save_routes",
    "sweep_spill_dirs",
    "sweep_stores",
    "token_digest",
]
