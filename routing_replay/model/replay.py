"""Replay: force recorded expert ids in a transformers MoE model, weights from the live logits.

How it works. The first `replay(model, routes)` block on a model (or `prepare_replay(model)`)
installs, once and for good, a `forward` on each MoE router module (an instance attribute
that calls the class's own forward, then forces the ids) and two hooks on the decoder (the
batch-shape check before it runs, the "every router was called" check after). They all
read one per-model state object: outside a `replay` block it is inactive and the model
routes natively (one Python call and one flag test per router); `Replay.__enter__` puts the
batch's routes there (on the routers' device, ids in the narrowest integer dtype, widened
per layer to int64 inside the router's forward), `__exit__` deactivates it and frees them.

torch.compile. Call `prepare_replay(model)` before `torch.compile` (whole model,
`model.compile()`, or each decoder layer on its own as torchtitan does), or compile inside
the first `replay` block: either way Dynamo traces replay's code, guards on the state's
`active` flag and lifts its tensors as graph inputs. One compiled variant replays and one
routes natively (one recompile when the flag first flips, then both are reused), a new
batch of the same shape reuses the replaying variant (the forced ids are merged with uniform
tensor ops, never with a Python flag that depends on the batch), and a new shape recompiles
as the model alone would (dynamic after the second). The whole tiny models compile to one
graph. A model compiled and run *before* it was prepared needs nothing either: its compiled
code guards that the router modules have no instance `forward`, so Dynamo compiles it again
with replay's code on the first replayed forward (code compiled for another, never prepared
instance of the class is told apart the same way). Run backward inside the block, as in
eager. Refused with `UnsupportedModelError` when the block is entered: the stance
`torch.compiler.set_stance(..., skip_guard_eval_unsafe=True)` (compiled code would run
without the guards that say whether replay is active). A `forward` that other code set on
a router instance (accelerate's hooks) is called by replay's; one set on top of replay's
later is expected to call it (functools.update_wrapper's `__wrapped__` says so), else the
next block wraps it again. Under `fullgraph=True` a failed check (batch shape, routers not
called) surfaces as Dynamo's `Unsupported` error carrying replay's message.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from routing_replay.compat.torch import in_backward, skips_guards
from routing_replay.errors import (
    InvalidRoutesError,
    LayoutMismatchError,
    RoutingReplayError,
    UnsupportedModelError,
)
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.model.adapters import MoeModel, Router, ScoreFunction, find_routers

_STATE = "_routing_replay_state"  # on the decoder: the model's _ReplayState (also the mark)


@dataclass(frozen=True)
class _DeviceRoutes:
    """A batch's routes on one device."""

    # [*batch, L, K], the narrowest dtype (`_id_dtype`); missing ids are 0 there (never used).
    # Batch-shaped, so that under torch.compile the shape check compares sizes symbolically.
    ids: Tensor
    missing: Tensor  # [*batch, L] bool: the (token, layer) routes natively

    @property
    def nbytes(self) -> int:
        """Device bytes held for the batch (ids and missing mask)."""
        return sum(t.numel() * t.element_size() for t in (self.ids, self.missing))


class _ReplayState:
    """Per-model state read by the persistent router forwards and decoder hooks.

    Inactive outside a `replay` block. Attributes read under torch.compile are the flag
    (guarded) and the tensors of `layer_routes` (graph inputs); the Python lists of flags are
    read in eager mode only, so they never specialise a compiled graph.
    """

    def __init__(self, moe: MoeModel) -> None:
        self.moe = moe
        self.handles: list[Any] = []  # the decoder hooks
        self.active = False
        self.owner: Replay | None = None
        self.batch_shape: tuple[int, ...] = ()
        self.layer_routes: list[_DeviceRoutes] | None = None  # per MoE layer (shared per device)
        self.any_missing_L: list[bool] = []  # eager fast paths only
        self.all_missing_L: list[bool] = []
        self.ran_L: list[bool] = [False] * moe.layout.num_moe_layers

    def deactivate(self) -> None:
        """Back to native routing; drop every reference to the batch's routes."""
        self.active = False
        self.owner = None
        self.layer_routes = None
        self.any_missing_L = []
        self.all_missing_L = []
        self.ran_L = [False] * self.moe.layout.num_moe_layers


class _ReplayingForward:
    """A prepared router's `forward` (an instance attribute): the module's own forward (its
    class's, or one that other code had set on the instance, e.g. accelerate's hooks), then
    the forced ids while replay is active. A plain object, not a closure, so that
    `copy.deepcopy` and pickling carry it over to the copied module."""

    def __init__(
        self, module: nn.Module, state: _ReplayState, layer: int, router: Router, inner: Any
    ) -> None:
        self.module = module
        self.state = state
        self.layer = layer  # index among the MoE layers (the L of the routes)
        self.name = router.name
        self.score: ScoreFunction = router.score
        self.inner = inner  # an instance forward found when installing, or None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if self.inner is None:
            output = type(module).forward(module, *args, **kwargs)
        else:
            output = self.inner(*args, **kwargs)
        if not self.state.active:
            return output
        return _force(self, module, output)

    def __repr__(self) -> str:
        return f"<routing_replay forward of {self.name!r}>"


def prepare_replay(model: nn.Module) -> nn.Module:
    """Install replay's router forwards and decoder hooks in `model` (call before torch.compile).

    Returns `model` itself, prepared: `torch.compile(prepare_replay(model))`. Idempotent (a
    router forward deleted since is installed again); the first `replay` block on a model
    does the same. Outside a `replay` block the installed code routes natively.
    """
    _prepare_model(find_routers(model))
    return model


def _prepare_model(moe: MoeModel) -> _ReplayState:
    decoder = moe.decoder
    state = decoder.__dict__.get(_STATE)
    if not isinstance(state, _ReplayState) or _router_ids(state.moe) != _router_ids(moe):
        for handle in getattr(state, "handles", ()):  # a state for other routers: replaced
            handle.remove()
        state = _ReplayState(moe)
        setattr(decoder, _STATE, state)  # a plain object: not a submodule, not in state_dict
    for j, router in enumerate(moe.routers):
        module = router.module
        installed = module.__dict__.get("forward")
        if _reaches_ours(installed, module, state):
            continue  # ours, or other code's forward set on top of ours (it calls ours)
        if isinstance(installed, _ReplayingForward):  # ours for a former state: unwrap it
            installed = installed.inner
        module.forward = _ReplayingForward(module, state, j, router, installed)
    live = [h for h in state.handles if _hook_registered(decoder, h)]
    if len(live) != 2:
        for handle in live:
            handle.remove()
        state.handles = [
            decoder.register_forward_pre_hook(_check_inputs, with_kwargs=True),
            decoder.register_forward_hook(_check_all_routed),
        ]
    return state


def is_prepared(model: nn.Module) -> bool:
    """Whether `model` carries replay's router forwards and decoder hooks (see prepare_replay)."""
    moe = find_routers(model)
    state = moe.decoder.__dict__.get(_STATE)
    return (
        isinstance(state, _ReplayState)
        and all(
            _reaches_ours(r.module.__dict__.get("forward"), r.module, state) for r in moe.routers
        )
        and sum(_hook_registered(moe.decoder, h) for h in state.handles) == 2
    )


def _router_ids(moe: MoeModel) -> tuple[int, ...]:
    return tuple(id(r.module) for r in moe.routers)


def _reaches_ours(forward: Any, module: nn.Module, state: _ReplayState) -> bool:
    """Whether `forward` is this state's replaying forward of `module`, or wraps it (following
    `__wrapped__`, as functools.update_wrapper and accelerate's hooks set it)."""
    for _ in range(16):
        if isinstance(forward, _ReplayingForward):
            return forward.module is module and forward.state is state
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return False
    return False


def _hook_registered(module: nn.Module, handle: Any) -> bool:
    return handle.id in module._forward_pre_hooks or handle.id in module._forward_hooks


# -- the installed code: runs on every forward of a prepared model -----------------------------


def _force(slot: _ReplayingForward, module: nn.Module, output: tuple) -> tuple:
    """The forced ids and the family's weights at them, merged with the native missing rows."""
    state, j = slot.state, slot.layer
    state.ran_L[j] = True
    compiling = torch.compiler.is_compiling()
    if not compiling:
        if j == 0:
            state.owner._count_pass()
        if state.all_missing_L[j]:
            return output
    logits_TE, native_w_TK, native_ids_TK = output[:3]
    routes = state.layer_routes[j]
    ids_NLK = routes.ids.flatten(0, -3)  # the rows the routers see (a view)
    if native_ids_TK.shape[0] != ids_NLK.shape[0]:
        raise InvalidRoutesError(
            f"router {slot.name!r} sees {native_ids_TK.shape[0]} tokens but the routes "
            f"have {ids_NLK.shape[0]} rows (batch shape {list(state.batch_shape)})"
        )
    if not compiling and ids_NLK.device != native_ids_TK.device:  # a model moved since
        routes = state.owner._device_routes(native_ids_TK.device)
        ids_NLK = routes.ids.flatten(0, -3)
    ids_TK = ids_NLK[:, j].long()  # widened per layer: the batch stays narrow
    weights_TK = slot.score(module, logits_TE, ids_TK).to(native_w_TK.dtype)
    # Compiled: always merge (uniform ops, so the graph does not depend on which layers have
    # missing rows in this batch). Eager: only where a row is missing (the same values).
    if compiling or state.any_missing_L[j]:
        missing_T1 = routes.missing.flatten(0, -2)[:, j, None]
        ids_TK = torch.where(missing_T1, native_ids_TK, ids_TK)
        weights_TK = torch.where(missing_T1, native_w_TK, weights_TK)
    return (logits_TE, weights_TK, ids_TK, *output[3:])


def _check_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    state: _ReplayState = module.__dict__[_STATE]
    if not state.active:
        return
    state.ran_L = [False] * len(state.ran_L)
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and not in_backward():
        # Counted here, where the caller's grad mode holds: reentrant checkpointing runs
        # the layers (and so the routers) under no_grad in the forward.
        state.owner._grad_forwards += 1
    shape = _input_shape(args, kwargs)
    # Against the routes tensor's own sizes, not a tuple of ints: compiled with dynamic
    # shapes, a new batch shape then needs no recompile for this check.
    if shape is not None and shape != tuple(state.layer_routes[0].ids.shape[:-2]):
        raise InvalidRoutesError(
            f"routes have batch shape {list(state.batch_shape)} but the model is called with "
            f"input shape {list(shape)}: routes must be input_ids.shape + (num_moe_layers, "
            "top_k), aligned with the same padding or packing"
        )


def _check_all_routed(module: nn.Module, args: tuple, output: Any) -> None:
    state: _ReplayState = module.__dict__[_STATE]
    if not state.active:
        return
    ran, state.ran_L = state.ran_L, [False] * len(state.ran_L)
    if not all(ran):
        names = [r.name for r, done in zip(state.moe.routers, ran, strict=True) if not done]
        raise UnsupportedModelError(
            f"replay: the forward finished without calling the routers {names}; a fused MoE "
            "kernel (e.g. use_kernels=True) routes on its own and would ignore the routes"
        )


# -- the block ---------------------------------------------------------------------------------


class Replay:
    """Context manager under which every MoE router of `model` uses the given expert ids.

    `attention_mask` (optional, the routes' batch shape): padding positions (0) must hold no
    routes (all -1); real tokens may (prefix-cache gaps route natively).
    """

    def __init__(self, model: nn.Module, routes: Any, attention_mask: Any = None) -> None:
        self.model = model
        self.moe: MoeModel = find_routers(model)
        self.routes: Tensor = check_routes_shape(routes, self.moe.layout)
        self.batch_shape: tuple[int, ...] = tuple(self.routes.shape[:-2])
        self.num_rows: int = int(np.prod(self.batch_shape))
        mask = _check_mask_shape(attention_mask, self.batch_shape)
        # The batch goes to the routers' device once; it is validated there, and the flags the
        # hooks need (which layers have missing rows) come back in the one host sync.
        device = _device_of(self.moe)
        staged_NLK = _stage(self.routes, device, self.num_rows)
        staged_mask_N = None if mask is None else _stage_mask(mask, device)
        self._any_missing_L, self._all_missing_L = _check_values(
            staged_NLK, self.moe.layout, self.batch_shape, staged_mask_N
        )
        self._on_device: dict[torch.device, _DeviceRoutes] = {
            device: _prepare(staged_NLK, self.moe.layout, self.batch_shape)
        }
        del staged_NLK, staged_mask_N
        self._state: _ReplayState | None = None
        self._grad_forwards = 0
        self._recomputes = 0

    def __enter__(self) -> Replay:
        _refuse_unguarded()
        state = _prepare_model(self.moe)
        if state.active:
            raise RoutingReplayError(
                "replay: another replay block is already active on this model; nested replay "
                "blocks on one model are not supported"
            )
        if not self._on_device:  # entered again after an exit freed the device copy
            device = _device_of(self.moe)
            self._on_device[device] = _prepare(
                _stage(self.routes, device, self.num_rows), self.moe.layout, self.batch_shape
            )
        state.layer_routes = [self._device_routes(_device_of_router(r)) for r in self.moe.routers]
        state.batch_shape = self.batch_shape
        state.any_missing_L = list(self._any_missing_L)
        state.all_missing_L = list(self._all_missing_L)
        state.ran_L = [False] * self.moe.layout.num_moe_layers
        state.owner = self
        state.active = True
        self._state = state
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._state is not None:
            self._state.deactivate()
            self._state = None
        self._on_device.clear()  # the device copy is freed (unless a pending backward holds it)
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

    @property
    def device_bytes(self) -> int:
        """Device bytes this block holds for the batch's routes (0 after exit)."""
        return sum(r.nbytes for r in self._on_device.values())

    def _device_routes(self, device: torch.device) -> _DeviceRoutes:
        """The batch's routes on `device`: copied once per device per batch, never per layer."""
        found = self._on_device.get(device)
        if found is None:  # a model spread over devices: one more copy, for this one
            staged_NLK = _stage(self.routes, device, self.num_rows)
            found = _prepare(staged_NLK, self.moe.layout, self.batch_shape)
            self._on_device[device] = found
        return found

    def _count_pass(self) -> None:  # eager only: under compile, recompute replays graph inputs
        if in_backward():  # a checkpoint recompute (forwards are counted at the decoder)
            self._recomputes += 1


def _refuse_unguarded() -> None:
    """Raise if compiled code would run without Dynamo's guards (which see replay's state)."""
    if skips_guards():
        raise UnsupportedModelError(
            "replay: torch.compiler.set_stance(skip_guard_eval_unsafe=True) is in effect; "
            "compiled code would run without the guards that tell it whether replay is active "
            "(and whether the model was compiled with replay's routers), so the recorded "
            "experts could be ignored or stale ones replayed. Use the default stance in replay"
        )


def replay(model: nn.Module, routes: Any, attention_mask: Any = None) -> Replay:
    """Force `routes` (input_ids.shape + (L, K), -1 = route natively) in `model`'s MoE routers.

    With `attention_mask` (input_ids.shape), padding positions must hold no routes.
    """
    return Replay(model, routes, attention_mask=attention_mask)


def validate_routes(routes: Any, layout: RoutingLayout, attention_mask: Any = None) -> Tensor:
    """Check routes against the layout (dtype, L, K, id range, duplicates) as a torch tensor.

    L may be the MoE layers (the stored form) or all layers (dense ones are dropped here).
    With `attention_mask` (the routes' batch shape), padding positions must hold no routes.
    """
    routes = check_routes_shape(routes, layout)
    batch_shape = tuple(routes.shape[:-2])
    mask = _check_mask_shape(attention_mask, batch_shape)
    if mask is not None:
        mask = _stage_mask(mask, routes.device)
    num_rows = int(np.prod(batch_shape))
    _check_values(routes.reshape(num_rows, *routes.shape[-2:]), layout, batch_shape, mask)
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


def _check_mask_shape(attention_mask: Any, batch_shape: tuple[int, ...]) -> Tensor | None:
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


def _check_values(
    ids_NLK: Tensor,
    layout: RoutingLayout,
    batch_shape: tuple[int, ...],
    mask_N: Tensor | None = None,
) -> tuple[list[bool], list[bool]]:
    """Range, duplicate, whole-row and padding checks where the ids are, one host sync; per
    layer: any/all missing. `mask_N` (flattened attention mask, optional): padding rows must
    be all -1."""
    bad_NLK = (ids_NLK < MISSING) | (ids_NLK >= layout.num_experts)
    dup_NL = _repeats(ids_NLK)
    missing_NLK = ids_NLK == MISSING
    missing_NL = missing_NLK.any(dim=-1)
    partial_NL = missing_NL & ~missing_NLK.all(dim=-1)  # some of a row's K ids, not all
    checks = [bad_NLK.any()[None], dup_NL.any()[None], partial_NL.any()[None]]
    if mask_N is not None:
        padded_routed_N = (mask_N == 0) & (ids_NLK != MISSING).flatten(1).any(dim=1)
        checks.append(padded_routed_N.any()[None])
    flags = torch.cat([*checks, missing_NL.any(dim=0), missing_NL.all(dim=0)]).tolist()  # sync
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
    if flags[2]:
        n, layer = (int(i) for i in partial_NL.nonzero()[0])
        raise InvalidRoutesError(
            f"routes at index {[*_unravel(n, batch_shape), layer]} hold some but not all of "
            f"a token's top-{layout.top_k} ids: {ids_NLK[n, layer].tolist()} "
            f"({int(partial_NL.sum())} such rows). A row is all {layout.top_k} recorded ids, "
            "or all -1 (route natively); a partly -1 row means routes of another top_k were "
            "padded or truncated: re-collect them with this model's top_k"
        )
    if mask_N is not None and flags[3]:
        _raise_padding_with_routes(ids_NLK, mask_N, padded_routed_N, batch_shape)
    num_layers = layout.num_moe_layers
    start = len(checks)
    return flags[start : start + num_layers], flags[start + num_layers :]


def _repeats(ids_NLK: Tensor) -> Tensor:
    """[N, L] bool: an id other than -1 appears twice in the row (no sort: no int64 indices)."""
    dup_NL = torch.zeros(ids_NLK.shape[:-1], dtype=torch.bool, device=ids_NLK.device)
    for k in range(ids_NLK.shape[-1] - 1):
        first_NL1 = ids_NLK[..., k : k + 1]
        dup_NL |= ((first_NL1 == ids_NLK[..., k + 1 :]) & (first_NL1 != MISSING)).any(dim=-1)
    return dup_NL


def _raise_padding_with_routes(
    ids_NLK: Tensor, mask_N: Tensor, padded_routed_N: Tensor, batch_shape: tuple[int, ...]
) -> None:
    n = int(padded_routed_N.nonzero()[0, 0])
    index = _unravel(n, batch_shape)
    seq = batch_shape[-1]
    start = n - n % seq  # the row of the batch (the last batch dim is the sequence)
    mask_row = (mask_N[start : start + seq] != 0).cpu().numpy()
    routed_row = (ids_NLK[start : start + seq] != MISSING).flatten(1).any(dim=1).cpu().numpy()
    raise InvalidRoutesError(
        f"routes hold expert ids at padding position {index} (attention_mask is 0 there; "
        f"{int(padded_routed_N.sum())} padding positions hold routes): routes are misaligned "
        f"with the batch, {_misalignment_hint(mask_row, routed_row)}. Routes must be aligned "
        "with input_ids position by position (to_torch(batch, attention_mask=mask) pads "
        "them like the batch)"
    )


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


def _unravel(row: int, batch_shape: tuple[int, ...]) -> list[int]:
    return [int(i) for i in np.unravel_index(row, batch_shape)]


def _device_of(moe: MoeModel) -> torch.device:
    """Where the first router computes: its first parameter's device (CPU if it has none)."""
    return _device_of_router(moe.routers[0])


def _device_of_router(router: Router) -> torch.device:
    param = next(router.module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _stage(routes: Tensor, device: torch.device, num_rows: int) -> Tensor:
    """The routes as [N, L, K] on `device`, copied asynchronously (through pinned memory)."""
    if device.type == "cuda" and not routes.is_cuda:
        routes = routes.pin_memory()
    return routes.to(device, non_blocking=True).reshape(num_rows, *routes.shape[-2:])


def _stage_mask(mask: Tensor, device: torch.device) -> Tensor:
    if device.type == "cuda" and not mask.is_cuda:
        mask = mask.pin_memory()
    return mask.to(device, non_blocking=True).reshape(-1)


def _id_dtype(num_experts: int) -> torch.dtype:
    """Narrowest dtype for ids in [0, num_experts) (missing ids are 0 there, masked apart)."""
    if num_experts <= 2**8:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


def _prepare(ids_NLK: Tensor, layout: RoutingLayout, batch_shape: tuple[int, ...]) -> _DeviceRoutes:
    """The held device copy: narrow ids (missing ones 0) and the missing mask, batch-shaped."""
    missing_NLK = ids_NLK == MISSING
    ids = ids_NLK.masked_fill(missing_NLK, 0).to(_id_dtype(layout.num_experts))
    missing = missing_NLK.any(dim=-1)
    return _DeviceRoutes(
        ids=ids.reshape(*batch_shape, *ids.shape[-2:]),
        missing=missing.reshape(*batch_shape, missing.shape[-1]),
    )


def _input_shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(input_ids, Tensor):
        return tuple(input_ids.shape)
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, Tensor):
        return tuple(embeds.shape[:-1])
    return None


def _checkpointing(model: nn.Module) -> bool:
    # transformers 5.24 renamed is_gradient_checkpointing (deprecated) to is_activation_...
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag) and model.training
