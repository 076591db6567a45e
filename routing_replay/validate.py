"""Route checks: one function per condition and one wording per condition, for every place
that takes routes (`put` and the layout's edge checks in numpy; replay, the Megatron feed
and the aux loss in torch, where the routes are).

The conditions: ids that are not integers; an id out of `[0, num_experts)` (-1 is
"missing"); one expert twice in a token's top-k; a row that holds some but not all of its
k ids; padding positions that hold routes. Each caller says *where* (its own index words:
"token 5, MoE layer 2", "batch 1, position 3, MoE layer 4"); the rest of every message is
written here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from routing_replay.errors import InvalidArgumentError, InvalidRoutesError

MISSING = -1  # a (token, layer) row with no recorded route: routed natively under replay

# where(row, layer) -> "batch 1, position 3, MoE layer 4": a caller's words for a position
Where = Callable[[int, int], str]


# What turning a value into a numpy array may raise: ragged lists (ValueError), a tensor of
# a dtype numpy lacks (bf16: TypeError), a meta or device tensor (TypeError,
# NotImplementedError), a dict or a string of digits' worth of nonsense.
UNCONVERTIBLE = (ValueError, TypeError, NotImplementedError, RuntimeError)


def host_array(value: Any, what: str, error: type[Exception] = InvalidArgumentError) -> Any:
    """`value` as a numpy array (a tensor detached and brought to the host), or `error`
    saying what `what` must be."""
    import numpy as np

    try:
        if hasattr(value, "detach"):  # a torch tensor, maybe on a device
            value = value.detach().cpu().numpy()
        return np.asarray(value)
    except UNCONVERTIBLE as e:
        raise error(
            f"{what} must be a host array (or CPU tensor) of integers, got "
            f"{type(value).__name__}: {type(e).__name__}: {e}"
        ) from None


def not_integer(dtype: object) -> InvalidRoutesError:
    """Routes of a non-integer dtype."""
    return InvalidRoutesError(
        f"routes must hold integer expert ids, got dtype {dtype}; cast expert ids to int"
    )


def out_of_range(value: int, where: str, num_experts: int, count: int) -> InvalidRoutesError:
    """An expert id outside `[0, num_experts)` that is not the missing marker."""
    return InvalidRoutesError(
        f"expert id {value} at {where} is out of range: ids must be in [0, {num_experts}) "
        f"or -1 for missing ({count} bad ids in all)"
    )


def repeated(where: str, ids: Sequence[int], top_k: int) -> InvalidRoutesError:
    """One expert named twice in a token's top-k at one layer."""
    return InvalidRoutesError(
        f"{where} names an expert twice in its top-{top_k}: {[int(i) for i in ids]}. A "
        "router's top-k "
        "never repeats an id: the routes were padded with expert 0 instead of -1, or cast to "
        "a dtype too narrow for the expert count"
    )


def partial_row(where: str, ids: Sequence[int], top_k: int, count: int) -> InvalidRoutesError:
    """A (token, layer) row with some of its k ids missing but not all."""
    return InvalidRoutesError(
        f"{where} holds some but not all of its top-{top_k} ids: {[int(i) for i in ids]} "
        f"({count} such "
        f"rows). A row is all {top_k} recorded ids, or all -1 (route natively); a partly -1 "
        "row means routes of another top_k were padded or truncated: re-collect them with "
        "this model's top_k"
    )


def routes_on_padding(where: str, count: int, likely: str) -> InvalidRoutesError:
    """Padding positions (attention mask 0) that hold expert ids."""
    return InvalidRoutesError(
        f"routes hold expert ids at padding position {where} (attention_mask is 0 there; "
        f"{count} padding positions hold routes): routes are misaligned with the batch, "
        f"{likely}. Routes must be aligned with input_ids position by position "
        "(to_torch(batch, attention_mask=mask) pads them like the batch)"
    )


def check_integer(routes: Tensor) -> None:
    """Raise unless `routes` holds integers (a bool is not an expert id)."""
    if routes.dtype.is_floating_point or routes.dtype.is_complex or routes.dtype == torch.bool:
        raise not_integer(routes.dtype)


class RowFlags:
    """Where a `[N, L, K]` batch of ids breaks a rule, computed on the ids' device without a
    host sync; `any()` reads all the flags back in one."""

    def __init__(self, ids_NLK: Tensor, num_experts: int, mask_N: Tensor | None = None) -> None:
        self.ids_NLK = ids_NLK
        self.num_experts = num_experts
        self.bad_NLK = (ids_NLK < MISSING) | (ids_NLK >= num_experts)
        self.repeat_NL = _repeats(ids_NLK)
        missing_NLK = ids_NLK == MISSING
        self.missing_NL = missing_NLK.any(dim=-1)
        self.partial_NL = self.missing_NL & ~missing_NLK.all(dim=-1)
        self.padded_N = None
        if mask_N is not None:  # padding positions that hold any id
            self.padded_N = (mask_N == 0) & (ids_NLK != MISSING).flatten(1).any(dim=1)

    def flags(self) -> list[Tensor]:
        """One-element bool tensors: bad id, repeated id, partial row, routes on padding."""
        out = [self.bad_NLK.any()[None], self.repeat_NL.any()[None], self.partial_NL.any()[None]]
        if self.padded_N is not None:
            out.append(self.padded_N.any()[None])
        return out

    def raise_first(self, found: Sequence[bool], where: Where) -> None:
        """Raise the error of the first rule `found` (as `flags()` read back) says broke."""
        ids, K = self.ids_NLK, self.ids_NLK.shape[-1]
        if found[0]:
            n, layer, slot = (int(i) for i in self.bad_NLK.nonzero()[0])
            value, count = int(ids[n, layer, slot]), int(self.bad_NLK.sum())
            raise out_of_range(value, f"{where(n, layer)}, slot {slot}", self.num_experts, count)
        if found[1]:
            n, layer = (int(i) for i in self.repeat_NL.nonzero()[0])
            raise repeated(where(n, layer), ids[n, layer].tolist(), K)
        if found[2]:
            n, layer = (int(i) for i in self.partial_NL.nonzero()[0])
            raise partial_row(
                where(n, layer), ids[n, layer].tolist(), K, int(self.partial_NL.sum())
            )

    def check(self, where: Where) -> None:
        """Raise for the first broken rule (one host sync); padding is the caller's to word."""
        self.raise_first(torch.cat(self.flags()).tolist(), where)


def check_rows(ids_NLK: Tensor, num_experts: int, where: Where) -> None:
    """Raise `InvalidRoutesError` for the first id out of range, repeated id, or partly
    missing row of `[N, L, K]` integer ids (one host sync)."""
    RowFlags(ids_NLK, num_experts).check(where)


def _repeats(ids_NLK: Tensor) -> Tensor:
    """[N, L] bool: an id other than -1 appears twice in the row (no sort: no int64 indices)."""
    dup_NL = torch.zeros(ids_NLK.shape[:-1], dtype=torch.bool, device=ids_NLK.device)
    for k in range(ids_NLK.shape[-1] - 1):
        first_NL1 = ids_NLK[..., k : k + 1]
        dup_NL |= ((first_NL1 == ids_NLK[..., k + 1 :]) & (first_NL1 != MISSING)).any(dim=-1)
    return dup_NL


def check_tolerance(tolerance: Any) -> float | None:
    """`replay`'s tolerance: None (exact replay) or a ratio in (0, 1]."""
    if tolerance is None:
        return None
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not 0.0 < tolerance <= 1.0
    ):
        raise InvalidArgumentError(
            f"tolerance must be None (replay exactly) or a ratio in (0, 1], got {tolerance!r}: "
            "a recorded expert is kept where the trainer scores it at least that ratio of its "
            "weakest own top-k expert"
        )
    return float(tolerance)
