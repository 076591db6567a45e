"""What the trainer integrations (TRL, verl, NeMo-RL-style loops, Ray Train) log each step:
`Replay.metrics()` of the step's replay blocks, combined. For a loop of your own, keep a
`StepMetrics`, `add` each micro-batch's `replay(...)` block, and log `pop()` after the step.

A step is usually several blocks (one per micro-batch, or per chunk); `StepMetrics` keeps
them and, when read (after the step's backward: one host sync per block), sums the rows and
weights the rates by the rows each block replayed:

- `replay/rows_replayed`: (token, MoE layer) rows forced to their recorded experts;
- `replay/rows_missing`: rows with no recorded route (padding, tokens the engine never
  forwarded, prefix-cache gaps), routed natively;
- `replay/native_agreement`: the share of forced rows whose recorded top-k set is the one
  the trainer's router picks itself (1.0: the rollout and the trainer route alike);
- `replay/replace_rate`: the share of forced (row, slot) ids that `replay_tolerance`
  refilled from the trainer's own top-k (0.0 without a tolerance).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

ROWS_REPLAYED = "replay/rows_replayed"
ROWS_MISSING = "replay/rows_missing"
NATIVE_AGREEMENT = "replay/native_agreement"
REPLACE_RATE = "replay/replace_rate"
KEYS = (ROWS_REPLAYED, ROWS_MISSING, NATIVE_AGREEMENT, REPLACE_RATE)


def combine(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Several blocks' `metrics()` as one: rows summed, rates weighted by rows replayed.

    A block that ran no forward (agreement NaN) adds its rows but no rate; with no forced
    row at all the agreement is NaN and the replace rate 0.0, as `Replay.metrics()` says.
    """
    replayed = missing = 0
    agreed = replaced = weight = 0.0
    for m in parts:
        rows = int(m[ROWS_REPLAYED])
        replayed += rows
        missing += int(m[ROWS_MISSING])
        if rows and not math.isnan(m[NATIVE_AGREEMENT]):
            agreed += m[NATIVE_AGREEMENT] * rows
            replaced += m[REPLACE_RATE] * rows
            weight += rows
    return {
        ROWS_REPLAYED: replayed,
        ROWS_MISSING: missing,
        NATIVE_AGREEMENT: agreed / weight if weight else float("nan"),
        REPLACE_RATE: replaced / weight if weight else 0.0,
    }


class StepMetrics:
    """The replay blocks of one training step, read and combined when the step is done.

    `add(block)` keeps a `Replay` (read later, so the step's micro-batches run without a
    host sync in between) or an already read `metrics()` dict; `pop()` returns the combined
    dict (None if nothing was added) and starts the next step.
    """

    def __init__(self) -> None:
        self._parts: list[Any] = []

    def add(self, block: Any) -> None:
        self._parts.append(block)

    def __len__(self) -> int:
        return len(self._parts)

    def peek(self) -> dict[str, float] | None:
        """The combined metrics of the blocks added so far (None if none)."""
        if not self._parts:
            return None
        return combine(p if isinstance(p, Mapping) else p.metrics() for p in self._parts)

    def pop(self) -> dict[str, float] | None:
        """`peek()`, then forget the blocks."""
        out = self.peek()
        self._parts.clear()
        return out
