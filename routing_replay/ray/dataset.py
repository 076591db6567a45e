"""The training side on Ray: refs -> Arrow, each sample read on the node that holds it.

- `fetch_batch(refs)`: inside a trainer worker, one `pa.RecordBatch` in the refs' order.
  Samples on this worker's node are read straight from shared memory; each other node's
  samples come from that node's store actor in a few calls, in their wire form (each stored
  token once), over a direct connection from the actor (`direct`; through Ray's object
  store where none can be made); each row is then copied once, straight to its place
  (`assemble`).
- `read_dataset(refs)`: a `ray.data.Dataset` of the same schema, built from the Arrow
  tables the store actors return (`ray.data.from_arrow_refs`): a plain datasource cannot
  pin its read tasks to the node that holds the data.
- `release_refs(refs)`: drop consumed samples from their stores, so memory stays bounded.
  `fetch_batch(..., release=True)` and `read_dataset(..., release=True)` release only once
  every sample of the call was read: a failed read leaves every sample stored.
- `split_stale(refs, policy_version=, max_staleness=)`: fresh and stale refs by the policy
  version each was generated with. Reads never drop or release anything on their own:
  release the stale ones (`release_refs`), read the fresh ones.

Ray is imported inside the functions: `import routing_replay` works without Ray.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from routing_replay.errors import InvalidArgumentError, RoutingReplayError, StoreUnavailableError
from routing_replay.ray.assemble import assemble
from routing_replay.ray.client import attached
from routing_replay.ray.names import current_node_id
from routing_replay.ray.remote import RECEIVE, RemoteReads, actor_for, pieces, results
from routing_replay.store import Part, RoutingRef, RoutingStore, WireBatch
from routing_replay.store.refs import ranges_per_ref, whole_number

if TYPE_CHECKING:
    import ray.data


def _by_store(refs: Sequence[RoutingRef]) -> dict[tuple[str, str], list[int]]:
    """Indices of `refs` grouped by store (name and node: plain stores of one name may run
    on several nodes), stores in first-seen order."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, ref in enumerate(refs):  # (checked RoutingRefs: `_refs`)
        groups[ref.store, ref.node_id].append(i)
    return groups


def _is_driver() -> bool:
    import ray

    return ray.get_runtime_context().worker.mode == ray.SCRIPT_MODE


def _local(ref: RoutingRef, here: str | None) -> RoutingStore | None:
    """This process's handle of `ref`'s store if it is on this node and its segment is here;
    None otherwise: its store actor serves it (a segment gone from /dev/shm, wiped under
    the live actor, is still the actor's; a dead actor's samples fail there as lost)."""
    if ref.node_id != here:
        return None
    try:
        return attached(ref.store)
    except StoreUnavailableError:
        return None


def split_stale(
    refs: Iterable[RoutingRef], *, policy_version: int, max_staleness: int
) -> tuple[list[RoutingRef], list[RoutingRef]]:
    """(fresh, stale): a ref is stale when any of its tokens came from a policy older than
    `policy_version - max_staleness` (`ref.policy_version`, its oldest). Order is kept."""
    for what, value in (("policy_version", policy_version), ("max_staleness", max_staleness)):
        if not whole_number(value):
            raise InvalidArgumentError(f"{what} must be an int >= 0, got {value!r}")
    fresh, stale = [], []
    for ref in _refs(refs, "split_stale"):
        if ref.policy_version is None:
            raise InvalidArgumentError(
                f"sample {ref.sample_id!r} was put without a policy_version, so its staleness "
                "is unknown: pass policy_version= to put (the rollout workers do with step=)"
            )
        (stale if ref.policy_version < policy_version - max_staleness else fresh).append(ref)
    return fresh, stale


def _no_staleness_args(what: str, policy_version: Any, max_staleness: Any) -> None:
    """Reads no longer drop stale samples (they released them, a side effect of a read)."""
    if policy_version is not None or max_staleness is not None:
        raise InvalidArgumentError(
            f"{what} no longer takes policy_version / max_staleness (it released the stale "
            "samples as a side effect of a read): fresh, stale = split_stale(refs, "
            "policy_version=..., max_staleness=...); release_refs(stale); then read fresh"
        )


def _refs(refs: Iterable[RoutingRef], what: str) -> list[RoutingRef]:
    """`refs` as a list, each a `RoutingRef` (the Ray paths route by a ref's node and store:
    a sample id alone names neither)."""
    refs = list(refs)
    for r in refs:
        if not isinstance(r, RoutingRef):
            raise InvalidArgumentError(
                f"{what} takes the RoutingRefs that put returned, got {type(r).__name__} {r!r}: "
                "a sample id alone does not say which node's store holds it"
            )
    return refs


def _refs_list(refs: Sequence[RoutingRef], what: str) -> list[RoutingRef]:
    refs = _refs(refs, what)
    if not refs:
        raise InvalidArgumentError(f"{what} needs at least one ref")
    return refs


def fetch_batch(
    refs: Sequence[RoutingRef],
    *,
    part: Part = "all",
    release: bool = False,
    out: Any = None,
    ranges: Sequence[Any] | None = None,
    policy_version: None = None,
    max_staleness: None = None,
) -> pa.RecordBatch:
    """The refs' routes as one Arrow batch, in order: local ones from shm, others via actors.

    `ranges` (one entry per ref, as in `RoutingStore.read`): only those tokens of each
    sample are read, and only they cross the network from another node. What crosses is
    the stored (narrow) ids of the tokens read, each stored token once: samples that share
    pages (a GRPO group's prompt, an episode's turns) send those pages once per call.
    With `out` (reused memory, as in `RoutingStore.read`) the batch is built there: refs of
    one same-node store are read straight into it, anything else is copied in once built.
    With `release=True` the samples are released once *all* of them were read: a read that
    fails (a lost store, a released sample) raises and leaves every sample stored, and a
    sample named twice is refused before anything is read. A store that then fails to
    release costs no sample: the batch is returned, with a RuntimeWarning naming what stays.
    """
    _no_staleness_args("fetch_batch", policy_version, max_staleness)
    refs = _refs_list(refs, "fetch_batch")
    if release:
        _check_once(refs, "fetch_batch")
    ranges = ranges_per_ref(ranges, len(refs))
    here = current_node_id()
    groups = _by_store(refs)

    def ranges_of(indices: list[int]) -> list | None:
        return None if ranges is None else [ranges[i] for i in indices]

    local = {s: _local(refs[groups[s][0]], here) for s in groups}
    # A remote store's samples in a few pieces, one call each: the pull of one overlaps
    # the store actor's work on the next.
    parts_at = [p for s in groups if local[s] is None for p in pieces(groups[s], refs)]
    parts: list[tuple[list[int], pa.RecordBatch | WireBatch]] = []
    direct = out if len(groups) == 1 else None  # one store: its rows go straight into `out`
    with RECEIVE.lease() as take:  # (what direct reads receive: kept for the next call)
        remote = None
        try:  # every remote read is in flight before the local ones run
            remote = RemoteReads(
                [[refs[i] for i in piece] for piece in parts_at],
                part,
                [ranges_of(piece) for piece in parts_at],
                take,
            )
            for store, indices in groups.items():
                if local[store] is not None:
                    group = [refs[i] for i in indices]
                    batch = local[store].read(  # type: ignore[union-attr]
                        group, part=part, out=direct, ranges=ranges_of(indices)
                    )
                    parts.append((indices, batch))
        finally:
            # Collected (or raised) even if a local read failed.
            wires = remote.wires() if remote is not None else []
        parts += zip(parts_at, wires, strict=True)
        if len(parts) > 1:  # each row copied once, straight to its place (in `out` if given)
            batch = assemble(len(refs), parts, out)
        else:
            ((_, batch),) = parts
            if isinstance(batch, WireBatch):
                batch = batch.batch(out)  # the rows rebuilt here, in this process's memory
    if release:
        _release_read(refs, "fetch_batch")  # every sample was read: now, and only now, they go
    return batch


def read_dataset(
    refs: Sequence[RoutingRef],
    *,
    part: Part = "all",
    release: bool = False,
    samples_per_block: int = 256,
    ranges: Sequence[Any] | None = None,
    policy_version: None = None,
    max_staleness: None = None,
) -> ray.data.Dataset:
    """A `ray.data.Dataset` of the refs' routes (Arrow schema), each sample read on its node.

    Each node's samples are read by that node's store actor into Arrow tables that stay in
    that node's object store until a consumer pulls them (once). Called in a worker rather
    than the driver, samples on the caller's node are read straight from shm and `ray.put`
    here. Rows are grouped by store (order within a store kept): align on `sample_id`, which must
    tell the refs apart (one id in two stores is refused).
    With `release=True` the samples are released from their stores once every one of them
    was read (the dataset holds copies); a failed read leaves all of them stored. The copies
    are Ray objects owned by the calling process (Ray's ownership): if it may die before the
    dataset is consumed elsewhere, read with `release=False` and `release_refs` once
    consumed, or the samples are lost with it. `ranges`
    (one entry per ref, as in `fetch_batch`): only those tokens of each sample (e.g. cut
    to the trainer's maximum length) are read into the dataset.
    """
    import ray

    _no_staleness_args("read_dataset", policy_version, max_staleness)
    if not whole_number(samples_per_block) or samples_per_block < 1:
        raise InvalidArgumentError(
            f"samples_per_block must be an int >= 1 (samples per dataset block), got "
            f"{samples_per_block!r}"
        )
    samples_per_block = int(samples_per_block)
    refs = _refs_list(refs, "read_dataset")
    _check_ids_tell_rows_apart(refs)
    ranges = ranges_per_ref(ranges, len(refs))
    if release:
        _check_once(refs, "read_dataset")
    here = None if _is_driver() else current_node_id()
    blocks, block_groups = [], []
    local_tables = []
    for indices in _by_store(refs).values():
        store = _local(refs[indices[0]], here)
        for lo in range(0, len(indices), samples_per_block):
            block = indices[lo : lo + samples_per_block]
            chunk = [refs[i] for i in block]
            spans = None if ranges is None else [ranges[i] for i in block]
            if store is not None:
                batch = store.read(chunk, part=part, ranges=spans)
                local_tables.append(ray.put(pa.Table.from_batches([batch])))
            else:
                actor = actor_for(chunk).read_block.options(num_returns=2)
                blocks.append(actor.remote(chunk, part=part, ranges=spans))
                block_groups.append(chunk)
    # Surface a lost store here, not at the first iteration: wait for the small second
    # return of each read (its row count), not for the table, which stays on its node.
    results([m for _, m in blocks], block_groups)
    if release:
        _release_read(refs, "read_dataset")  # every block was read into the object store
    return ray.data.from_arrow_refs(local_tables + [b for b, _ in blocks])


def release_refs(refs: Iterable[RoutingRef]) -> int:
    """Release consumed samples from their stores (local ones directly); returns how many.

    Each store releases its samples all or none; every store is asked, and the first
    store's error is raised after the others released theirs."""
    refs = _refs(refs, "release_refs")
    failed = _release_each_store(refs)
    if failed:
        raise failed[0][1]
    return len(refs)


def _release_each_store(refs: list[RoutingRef]) -> list[tuple[list[RoutingRef], Exception]]:
    """Release `refs` store by store (remote stores at once); the stores that failed, and why."""
    if not refs:
        return []
    here = None if _is_driver() else current_node_id()
    failed: list[tuple[list[RoutingRef], Exception]] = []
    pending, pending_groups = [], []
    for indices in _by_store(refs).values():
        group = [refs[i] for i in indices]
        try:
            store = _local(group[0], here)
            if store is not None:
                store.release(group)
            else:
                pending.append(actor_for(group).release.remote(group))
                pending_groups.append(group)
        except RoutingReplayError as e:
            failed.append((group, e))
    for obj, group in zip(pending, pending_groups, strict=True):
        try:
            results([obj], [group])
        except Exception as e:  # whatever a store actor raised: the others still release
            failed.append((group, e))
    return failed


def _check_once(refs: list[RoutingRef], caller: str) -> None:
    """`release=True` releases every sample read: each may be named once only."""
    seen = Counter((r.store, r.sample_id) for r in refs)
    twice = sorted(sid for (_, sid), n in seen.items() if n > 1)
    if twice:
        raise InvalidArgumentError(
            f"{caller}(..., release=True) names samples {twice[:5]} more than once: a sample "
            "is released once; pass each ref once (nothing was read or released)"
        )


def _check_ids_tell_rows_apart(refs: list[RoutingRef]) -> None:
    """A dataset's rows carry their sample id only: one id in two stores is refused."""
    stores: dict[str, set[str]] = defaultdict(set)
    for r in refs:
        stores[r.sample_id].add(r.store)
    shared = sorted(sid for sid, names in stores.items() if len(names) > 1)
    if shared:
        raise InvalidArgumentError(
            f"read_dataset: sample ids {shared[:5]} are in more than one store, and a "
            "dataset's rows name their sample by id only: give samples ids unique across "
            "the job (e.g. with the worker's rank), or read each store's refs with its own "
            "call (nothing was read)"
        )


def _release_read(refs: list[RoutingRef], caller: str) -> None:
    """Release what a call read whole. A store that fails costs no sample: the read is
    returned, and a RuntimeWarning names the samples left stored and why."""
    failed = _release_each_store(refs)
    if failed:
        kept = [r.sample_id for group, _ in failed for r in group]
        why = "; ".join(f"{group[0].store}: {e}" for group, e in failed)
        warnings.warn(
            f"{caller}(..., release=True) read all {len(refs)} samples but could not release "
            f"{len(kept)} of them (first {kept[:5]}): {why}. The batch is whole; release those "
            "with release_refs once their stores answer",
            RuntimeWarning,
            stacklevel=3,
        )
