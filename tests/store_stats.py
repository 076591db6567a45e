"""Comparing store stats across calls that must change nothing a store holds."""

from __future__ import annotations

import dataclasses

from routing_replay.store import StoreStats


def held(stats: StoreStats) -> StoreStats:
    """What a store holds, without its activity counters (puts, reads and their time)."""
    return dataclasses.replace(stats, puts=0, put_seconds=0.0, reads=0, read_seconds=0.0)
