"""Repair and reclaim: how a store recovers from a holder or writer that died half-way.

`repair` runs under the lock whenever the dirty flag is set (a holder killed or raising
mid-change): it rolls back a publish that never reached its commit point, then rebuilds
every derived table from the committed samples. `reclaim_dead` frees the pages of writers
whose kernel lease is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from routing_replay.store.format import LEASE_HELD
from routing_replay.store.lock import Hold

if TYPE_CHECKING:
    from routing_replay.store.core import StoreCore


def repair(core: StoreCore) -> None:
    """Rebuild every derived table from the published samples (under the lock).

    Ground truth: committed slots (each checked against its checksum), page parents,
    generations and reservation tags, and the kernel's leases. Derived: refcounts,
    buckets, free stacks, counters. Pages reserved by live writers stay theirs.
    """
    t = core.tables
    core.samples.finish_release()  # a release holding cut short: all of it goes, or none
    core.samples.roll_back_uncommitted()  # a publish holding cut short: none of it stays
    core.spill.finish()  # a spill holding cut short after its commit point
    published = core.samples.published()
    chains = [core.samples.chain(int(s))[0] for s in published]
    flat = np.concatenate(chains) if chains else np.empty(0, dtype=np.int64)
    referenced = np.bincount(flat, minlength=t.num_pages)
    owners = t.p_owner
    keep = np.zeros(t.num_pages, dtype=bool)
    for owner in np.unique(owners[(owners > 0) & (referenced == 0)]).tolist():
        i = owner - 1
        if i < t.max_writers and t.leases["state"][i] == LEASE_HELD and core.leases.alive(i):
            keep |= (owners == owner) & (t.p_owner_gen == t.leases["gen"][i])
    core.pages.rebuild(referenced, keep)
    core.prefix.rebuild(referenced)
    core.samples.rebuild(published, chains)
    core.spill.rebuild()
    t.mark_spill_garbage()  # a holding cut short may have left files: a release's, a spill's
    for i in core.leases.dead_holders():
        core.leases.mark_free(i)
    t.set_dirty(False)


def reclaim_dead(core: StoreCore, hold: Hold, puts_of_caller: int) -> int:
    """Free pages reserved by writers whose lease the kernel dropped, and this handle's
    orphans (under the lock).

    Orphans are pages of this handle's lease that a put cut short by an async exception
    inside its own clean-up (a second KeyboardInterrupt) could not give back. They are
    freed only while no other put of this handle is in flight (`puts_of_caller`: 1
    from inside a put that holds no pages, 0 from `reclaim`); the count of puts in
    flight can only err high, which skips the clean-up, never frees a live put's pages.
    """
    freed, dead = 0, core.leases.dead_holders()
    for i in dead:
        hold.write()
        freed += core.pages.reclaim_lease(hold, i)
        core.leases.mark_free(i)
    if dead:
        core.tables.mark_spill_garbage()  # a spiller among them may have left files
    mine = core.leases.mine()
    if mine is not None and len(core.puts_running) == puts_of_caller:
        freed += core.pages.reclaim_lease(hold, *mine)
    return freed
