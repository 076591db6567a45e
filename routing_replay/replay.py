"""Replay: force recorded expert ids in a transformers MoE model, weights from the live logits."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from routing_replay.adapters import MoeModel, Router, find_routers
from routing_replay.errors import InvalidRoutesError, LayoutMismatchError, UnsupportedModelError
from routing_replay.layout import MISSING, RoutingLayout


@dataclass(frozen=True)
class _DeviceRoutes:
    """A batch's routes on one device, flattened to the rows the routers see."""

    ids_NLK: Tensor  # int64, missing ids replaced by 0 (never used: those rows route natively)
    missing_NL: Tensor  # bool: the (token, layer) routes natively


class Replay:
    """Context manager under which every MoE router of `model` uses the given expert ids."""

    def __init__(self, model: nn.Module, routes: Any) -> None:
        self.model = model
        self.moe: MoeModel = find_routers(model)
        self.routes: Tensor = check_routes_shape(routes, self.moe.layout)
        self.batch_shape: tuple[int, ...] = tuple(self.routes.shape[:-2])
        self.num_rows: int = int(np.prod(self.batch_shape))
        # The batch goes to the routers' device once; it is validated there, and the flags the
        # hooks need (which layers have missing rows) come back in the one host sync.
        device = _device_of(self.moe)
        staged_NLK = _stage(self.routes, device, self.num_rows)
        self._any_missing_L, self._all_missing_L = _check_values(
            staged_NLK, self.moe.layout, self.batch_shape
        )
        self._on_device: dict[torch.device, _DeviceRoutes] = {device: _prepare(staged_NLK)}
        self._handles: list[Any] = []
        self._ran_L = [False] * self.moe.layout.num_moe_layers
        self._grad_forwards = 0
        self._recomputes = 0

    def __enter__(self) -> Replay:
        _refuse_compiled(self.model)
        decoder = self.moe.decoder
        self._handles.append(
            decoder.register_forward_pre_hook(self._check_inputs, with_kwargs=True)
        )
        self._handles.append(decoder.register_forward_hook(self._check_all_routed))
        for j, router in enumerate(self.moe.routers):
            # Prepended: any other hook on the router (a capture) sees the forced ids.
            hook = self._router_hook(j, router)
            self._handles.append(router.module.register_forward_hook(hook, prepend=True))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if (
            exc_type is None
            and self._grad_forwards > self._recomputes
            and _checkpointing(self.model)
        ):
            warnings.warn(
                "replay() exited before backward under gradient checkpointing: the recomputed "
                "forward will route natively. Call loss.backward() inside the `with replay(...)`.",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- hooks --------------------------------------------------------------------------

    def _check_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._ran_L = [False] * len(self._ran_L)
        shape = _input_shape(args, kwargs)
        if shape is not None and shape != self.batch_shape:
            raise InvalidRoutesError(
                f"routes have batch shape {list(self.batch_shape)} but the model is called with "
                f"input shape {list(shape)}: routes must be input_ids.shape + (num_moe_layers, "
                "top_k), aligned with the same padding or packing"
            )

    def _check_all_routed(self, module: nn.Module, args: tuple, output: Any) -> None:
        ran, self._ran_L = self._ran_L, [False] * len(self._ran_L)
        if not all(ran):
            names = [r.name for r, done in zip(self.moe.routers, ran, strict=True) if not done]
            raise UnsupportedModelError(
                f"replay: the forward finished without calling the routers {names}; a fused MoE "
                "kernel (e.g. use_kernels=True) routes on its own and would ignore the routes"
            )

    def _router_hook(self, j: int, router: Router) -> Any:
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            self._ran_L[j] = True
            if j == 0:
                self._count_pass()
            if self._all_missing_L[j]:
                return None
            logits_TE, native_w_TK, native_ids_TK = output
            if native_ids_TK.shape[0] != self.num_rows:
                raise InvalidRoutesError(
                    f"router {router.name!r} sees {native_ids_TK.shape[0]} tokens but the routes "
                    f"have {self.num_rows} rows (batch shape {list(self.batch_shape)})"
                )
            routes = self._device_routes(native_ids_TK.device)
            ids_TK = routes.ids_NLK[:, j]
            weights_TK = router.score(module, logits_TE, ids_TK).to(native_w_TK.dtype)
            if self._any_missing_L[j]:
                missing_T1 = routes.missing_NL[:, j, None]
                ids_TK = torch.where(missing_T1, native_ids_TK, ids_TK)
                weights_TK = torch.where(missing_T1, native_w_TK, weights_TK)
            return (logits_TE, weights_TK, ids_TK, *output[3:])

        return hook

    def _device_routes(self, device: torch.device) -> _DeviceRoutes:
        """The batch's routes on `device`: copied once per device per batch, never per layer."""
        found = self._on_device.get(device)
        if found is None:  # a model spread over devices: one more copy, for this one
            found = _prepare(_stage(self.routes, device, self.num_rows))
            self._on_device[device] = found
        return found

    def _count_pass(self) -> None:
        if _in_backward():  # a checkpoint recompute
            self._recomputes += 1
        elif torch.is_grad_enabled():
            self._grad_forwards += 1


def _refuse_compiled(model: nn.Module) -> None:
    """Raise if Dynamo would run compiled code of `model` that never calls replay's hooks.

    Dynamo does not guard on hooks added after it traced (`skip_nnmodule_hook_guards`), so
    a model compiled and run before `replay` would route natively inside it, silently.
    """
    if "torch._dynamo" not in sys.modules:
        return  # never imported: nothing was compiled (and replay does not import it)
    cache_entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    seen: dict[Any, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or (
            getattr(module, "_compiled_call_impl", None) is not None
        ):
            where = f"module {name or type(module).__name__!r} is compiled"
            break
        seen.setdefault(type(module).forward.__code__, type(module).__name__)
    else:
        compiled = [c for code, c in seen.items() if cache_entries and cache_entries(code)]
        if not compiled:
            return
        where = (
            f"torch.compile holds compiled code of {compiled[0]}.forward (this model, or "
            "another instance of its class, was compiled and run)"
        )
    raise UnsupportedModelError(
        f"replay: {where}; compiled code never calls replay's hooks, so the recorded experts "
        "would be ignored. Replay under torch.compile is not supported yet: run the replayed "
        "forward and backward with an uncompiled model (call torch._dynamo.reset() first if "
        "another instance of the class was compiled)"
    )


def replay(model: nn.Module, routes: Any) -> Replay:
    """Force `routes` (input_ids.shape + (L, K), -1 = route natively) in `model`'s MoE routers."""
    return Replay(model, routes)


def validate_routes(routes: Any, layout: RoutingLayout) -> Tensor:
    """Check routes against the layout (dtype, L, K, id range, duplicates) as a torch tensor.

    L may be the MoE layers (the stored form) or all layers (dense ones are dropped here).
    """
    routes = check_routes_shape(routes, layout)
    num_rows = int(np.prod(routes.shape[:-2]))
    _check_values(routes.reshape(num_rows, *routes.shape[-2:]), layout, tuple(routes.shape[:-2]))
    return routes


def check_routes_shape(routes: Any, layout: RoutingLayout) -> Tensor:
    """Type, dtype and shape checks (no values read); routes over all layers lose the dense ones."""
    if isinstance(routes, np.ndarray):
        routes = torch.from_numpy(routes)
    if not isinstance(routes, Tensor):
        raise InvalidRoutesError(
            f"routes must be a torch tensor or numpy array, got {type(routes)}"
        )
    if routes.dtype.is_floating_point or routes.dtype.is_complex or routes.dtype == torch.bool:
        raise InvalidRoutesError(f"routes must hold integer expert ids, got dtype {routes.dtype}")
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


def _check_values(
    ids_NLK: Tensor, layout: RoutingLayout, batch_shape: tuple[int, ...]
) -> tuple[list[bool], list[bool]]:
    """Range and duplicate checks where the ids are, one host sync; per layer: any/all missing."""
    bad_NLK = (ids_NLK < MISSING) | (ids_NLK >= layout.num_experts)
    low_NLK, high_NLK = _neighbours(ids_NLK.sort(dim=-1).values)
    dup_NL = ((low_NLK == high_NLK) & (high_NLK != MISSING)).any(dim=-1)
    missing_NL = (ids_NLK == MISSING).any(dim=-1)
    flags = torch.cat(
        [bad_NLK.any()[None], dup_NL.any()[None], missing_NL.any(dim=0), missing_NL.all(dim=0)]
    ).tolist()  # the one sync
    if flags[0]:
        n, layer, slot = (int(i) for i in bad_NLK.nonzero()[0])
        raise InvalidRoutesError(
            f"expert id {int(ids_NLK[n, layer, slot])} at index "
            f"{[*_unravel(n, batch_shape), layer, slot]} is out of range: ids must be "
            f"in [0, {layout.num_experts}) or -1 for missing ({int(bad_NLK.sum())} bad ids in all)"
        )
    if flags[1]:
        n, layer = (int(i) for i in dup_NL.nonzero()[0])
        raise InvalidRoutesError(
            f"routes repeat an expert within one token's top-k at index "
            f"{[*_unravel(n, batch_shape), layer]}: {ids_NLK[n, layer].tolist()}"
        )
    num_layers = layout.num_moe_layers
    return flags[2 : 2 + num_layers], flags[2 + num_layers :]


def _unravel(row: int, batch_shape: tuple[int, ...]) -> list[int]:
    return [int(i) for i in np.unravel_index(row, batch_shape)]


def _neighbours(sorted_NLK: Tensor) -> tuple[Tensor, Tensor]:
    return sorted_NLK[..., :-1], sorted_NLK[..., 1:]


def _device_of(moe: MoeModel) -> torch.device:
    """Where the first router computes: its first parameter's device (CPU if it has none)."""
    param = next(moe.routers[0].module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _stage(routes: Tensor, device: torch.device, num_rows: int) -> Tensor:
    """The routes as [N, L, K] on `device`, copied asynchronously (through pinned memory)."""
    if device.type == "cuda" and not routes.is_cuda:
        routes = routes.pin_memory()
    return routes.to(device, non_blocking=True).reshape(num_rows, *routes.shape[-2:])


def _prepare(ids_NLK: Tensor) -> _DeviceRoutes:
    missing_NLK = ids_NLK == MISSING
    return _DeviceRoutes(
        ids_NLK=ids_NLK.masked_fill(missing_NLK, 0).long(), missing_NL=missing_NLK.any(dim=-1)
    )


def _input_shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(input_ids, Tensor):
        return tuple(input_ids.shape)
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, Tensor):
        return tuple(embeds.shape[:-1])
    return None


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)  # private; absent: assume not
    return task is not None and task() != -1


def _checkpointing(model: nn.Module) -> bool:
    # transformers 5.24 renamed is_gradient_checkpointing (deprecated) to is_activation_...
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag) and model.training
