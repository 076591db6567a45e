"""Routes on their way into a replay block: shape checks, value checks, device copies.

`Replay` stages a batch once: the routes go to the routers' device (through pinned memory
on CUDA), are checked there (`validate.RowFlags`: range, repeated ids, partly missing rows,
routes on padding) with the per-layer missing flags in one host sync, and are kept narrow
(`DeviceRoutes`) until the block exits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from routing_replay.errors import InvalidRoutesError, LayoutMismatchError
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.model.adapters import MoeModel, Router
from routing_replay.validate import RowFlags, check_integer, routes_on_padding


@dataclass(frozen=True)
class DeviceRoutes:
    """A batch's routes on one device."""

    # [*batch, L, K], the narrowest dtype (`id_dtype`); missing ids are 0 there (never used).
    # Batch-shaped, so that under torch.compile the shape check compares sizes symbolically.
    ids: Tensor
    missing: Tensor  # [*batch, L] bool: the (token, layer) routes natively

    @property
    def nbytes(self) -> int:
        """Device bytes held for the batch (ids and missing mask)."""
        return sum(t.numel() * t.element_size() for t in (self.ids, self.missing))


def check_routes_shape(routes: Any, layout: RoutingLayout) -> Tensor:
    """Type, dtype and shape checks (no values read); routes over all layers lose the dense ones."""
    if isinstance(routes, np.ndarray):
        routes = torch.from_numpy(routes)
    if not isinstance(routes, Tensor):
        raise InvalidRoutesError(
            f"routes must be a torch tensor or numpy array, got {type(routes)}"
        )
    check_integer(routes)
    if routes.dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        raise InvalidRoutesError(
            f"routes have the stored dtype {routes.dtype}: decode them first (layout.decode) so "
            "missing rows read -1"
        )
    if routes.dim() < 3:
        raise InvalidRoutesError(
            f"routes must have shape input_ids.shape + (num_moe_layers, top_k), got "
            f"{list(routes.shape)}"
        )
    layers, top_k = routes.shape[-2:]
    if layers == layout.num_layers != layout.num_moe_layers:  # all layers, as vLLM reports them
        routes = routes[..., list(layout.moe_layers), :]
        layers = layout.num_moe_layers
    if layers != layout.num_moe_layers or top_k != layout.top_k:
        raise LayoutMismatchError(
            f"routes end in (layers={layers}, top_k={top_k}) but the model routes "
            f"{layout.num_moe_layers} MoE layers {list(layout.moe_layers)} of "
            f"{layout.num_layers} with top_k={layout.top_k}: pass MoE layers only, in layer "
            "order (or all layers)"
        )
    return routes


def check_mask_shape(attention_mask: Any, batch_shape: tuple[int, ...]) -> Tensor | None:
    if attention_mask is None:
        return None
    if isinstance(attention_mask, np.ndarray):
        attention_mask = torch.from_numpy(attention_mask)
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype.is_complex:
        raise InvalidRoutesError(
            f"attention_mask must be a real torch tensor or numpy array, got "
            f"{getattr(attention_mask, 'dtype', type(attention_mask))}"
        )
    if tuple(attention_mask.shape) != batch_shape:
        raise InvalidRoutesError(
            f"attention_mask has shape {list(attention_mask.shape)} but the routes have batch "
            f"shape {list(batch_shape)}: pass the mask of the batch the routes are aligned with"
        )
    return attention_mask


def check_values(
    ids_NLK: Tensor,
    layout: RoutingLayout,
    batch_shape: tuple[int, ...],
    mask_N: Tensor | None = None,
) -> tuple[list[bool], list[bool]]:
    """The rules of `validate.RowFlags` where the ids are, and per layer whether any / all
    rows are missing, in one host sync. `mask_N` (flattened attention mask, optional):
    padding rows must be all -1."""
    rows = RowFlags(ids_NLK, layout.num_experts, mask_N)
    checks = rows.flags()
    found = torch.cat([*checks, rows.missing_NL.any(dim=0), rows.missing_NL.all(dim=0)]).tolist()

    def where(n: int, layer: int) -> str:
        return f"index {[*unravel(n, batch_shape), layer]}"

    rows.raise_first(found, where)
    if rows.padded_N is not None and found[3]:
        raise _padding_error(ids_NLK, mask_N, rows.padded_N, batch_shape)
    num_layers, start = layout.num_moe_layers, len(checks)
    return found[start : start + num_layers], found[start + num_layers :]


def validate_routes(routes: Any, layout: RoutingLayout, attention_mask: Any = None) -> Tensor:
    """Check routes against the layout (dtype, L, K, id range, duplicates) as a torch tensor.

    L may be the MoE layers (the stored form) or all layers (dense ones are dropped here).
    With `attention_mask` (the routes' batch shape), padding positions must hold no routes.
    """
    routes = check_routes_shape(routes, layout)
    batch_shape = tuple(routes.shape[:-2])
    mask = check_mask_shape(attention_mask, batch_shape)
    if mask is not None:
        mask = stage_mask(mask, routes.device)
    num_rows = int(np.prod(batch_shape))
    check_values(routes.reshape(num_rows, *routes.shape[-2:]), layout, batch_shape, mask)
    return routes


def _padding_error(
    ids_NLK: Tensor, mask_N: Tensor, padded_N: Tensor, batch_shape: tuple[int, ...]
) -> InvalidRoutesError:
    n = int(padded_N.nonzero()[0, 0])
    seq = batch_shape[-1]
    start = n - n % seq  # the row of the batch (the last batch dim is the sequence)
    mask_row = (mask_N[start : start + seq] != 0).cpu().numpy()
    routed_row = (ids_NLK[start : start + seq] != MISSING).flatten(1).any(dim=1).cpu().numpy()
    likely = _misalignment_hint(mask_row, routed_row)
    return routes_on_padding(str(unravel(n, batch_shape)), int(padded_N.sum()), likely)


def _misalignment_hint(mask_row: np.ndarray, routed_row: np.ndarray) -> str:
    """The likely cause, from one row's real-token mask and which positions hold routes."""
    real, routed = np.flatnonzero(mask_row), np.flatnonzero(routed_row)
    if len(real) == 0:
        return "likely routes for a row that is all padding"
    left_padded = not mask_row[0] and mask_row[-1]
    right_padded = mask_row[0] and not mask_row[-1]
    if left_padded and routed[0] < real[0] and routed[0] == 0:
        return (
            "likely right-padded routes for a left-padded batch (this row's routes start at "
            f"position 0, its tokens start at {int(real[0])})"
        )
    if right_padded and routed[-1] > real[-1] and routed[-1] == len(mask_row) - 1:
        return (
            "likely left-padded routes for a right-padded batch (this row's routes end at the "
            f"last position, its tokens end at {int(real[-1])})"
        )
    for shift in (routed[0] - real[0], routed[-1] - real[-1]):
        if shift in (1, -1):
            return (
                f"likely shifted by one position ({'later' if shift > 0 else 'earlier'} "
                "than the tokens: an off-by-one)"
            )
    return "likely left vs right padding, or a shift by some positions"


def unravel(row: int, batch_shape: tuple[int, ...]) -> list[int]:
    """The batch index of flat row `row`."""
    return [int(i) for i in np.unravel_index(row, batch_shape)]


def device_of(moe: MoeModel) -> torch.device:
    """Where the first router computes: its first parameter's device (CPU if it has none)."""
    return device_of_router(moe.routers[0])


def device_of_router(router: Router) -> torch.device:
    param = next(router.module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def stage(routes: Tensor, device: torch.device, num_rows: int) -> Tensor:
    """The routes as [N, L, K] on `device`, copied asynchronously (through pinned memory)."""
    if device.type == "cuda" and not routes.is_cuda:
        routes = routes.pin_memory()
    return routes.to(device, non_blocking=True).reshape(num_rows, *routes.shape[-2:])


def stage_mask(mask: Tensor, device: torch.device) -> Tensor:
    if device.type == "cuda" and not mask.is_cuda:
        mask = mask.pin_memory()
    return mask.to(device, non_blocking=True).reshape(-1)


def id_dtype(num_experts: int) -> torch.dtype:
    """Narrowest dtype for ids in [0, num_experts) (missing ids are 0 there, masked apart)."""
    if num_experts <= 2**8:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


def to_device_routes(
    ids_NLK: Tensor, layout: RoutingLayout, batch_shape: tuple[int, ...]
) -> DeviceRoutes:
    """The held device copy: narrow ids (missing ones 0) and the missing mask, batch-shaped."""
    missing_NLK = ids_NLK == MISSING
    ids = ids_NLK.masked_fill(missing_NLK, 0).to(id_dtype(layout.num_experts))
    missing = missing_NLK.any(dim=-1)
    return DeviceRoutes(
        ids=ids.reshape(*batch_shape, *ids.shape[-2:]),
        missing=missing.reshape(*batch_shape, missing.shape[-1]),
    )
