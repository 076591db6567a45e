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
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from routing_replay.compat.torch import in_backward, skips_guards
from routing_replay.errors import (
    InvalidRoutesError,
    RoutingReplayError,
    UnsupportedModelError,
)
from routing_replay.layout import RoutingLayout
from routing_replay.model.adapters import MoeModel, Router, ScoreFunction, find_routers
from routing_replay.model.staging import (
    DeviceRoutes,
    check_mask_shape,
    check_routes_shape,
    check_values,
    device_of,
    device_of_router,
    stage,
    stage_mask,
    to_device_routes,
)
from routing_replay.routes import routes_layout

_STATE = "_routing_replay_state"  # on the decoder: the model's _ReplayState (also the mark)


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
        self.layer_routes: list[DeviceRoutes] | None = None  # per MoE layer (shared per device)
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
    routes (all -1); real tokens may (prefix-cache gaps route natively). `layout`: for routes
    that carry none (see `replay`).
    """

    def __init__(
        self,
        model: nn.Module,
        routes: Any,
        attention_mask: Any = None,
        *,
        layout: RoutingLayout | Literal["unchecked"] | None = None,
    ) -> None:
        self.model = model
        self.moe: MoeModel = find_routers(model)
        routes = routes_layout(routes, layout, self.moe.layout)  # the layout travels here
        self.routes: Tensor = check_routes_shape(routes, self.moe.layout)
        self.batch_shape: tuple[int, ...] = tuple(self.routes.shape[:-2])
        self.num_rows: int = int(np.prod(self.batch_shape))
        mask = check_mask_shape(attention_mask, self.batch_shape)
        # The batch goes to the routers' device once; it is validated there, and the flags the
        # hooks need (which layers have missing rows) come back in the one host sync.
        device = device_of(self.moe)
        staged_NLK = stage(self.routes, device, self.num_rows)
        staged_mask_N = None if mask is None else stage_mask(mask, device)
        self._any_missing_L, self._all_missing_L = check_values(
            staged_NLK, self.moe.layout, self.batch_shape, staged_mask_N
        )
        self._on_device: dict[torch.device, DeviceRoutes] = {
            device: to_device_routes(staged_NLK, self.moe.layout, self.batch_shape)
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
            device = device_of(self.moe)
            self._on_device[device] = to_device_routes(
                stage(self.routes, device, self.num_rows), self.moe.layout, self.batch_shape
            )
        state.layer_routes = [self._device_routes(device_of_router(r)) for r in self.moe.routers]
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

    def _device_routes(self, device: torch.device) -> DeviceRoutes:
        """The batch's routes on `device`: copied once per device per batch, never per layer."""
        found = self._on_device.get(device)
        if found is None:  # a model spread over devices: one more copy, for this one
            staged_NLK = stage(self.routes, device, self.num_rows)
            found = to_device_routes(staged_NLK, self.moe.layout, self.batch_shape)
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


def replay(
    model: nn.Module,
    routes: Any,
    attention_mask: Any = None,
    *,
    layout: RoutingLayout | Literal["unchecked"] | None = None,
) -> Replay:
    """Force `routes` (input_ids.shape + (L, K), -1 = route natively) in `model`'s MoE routers.

    The routes' layout must be the model's (`LayoutMismatchError` names both): routes from
    `to_torch` carry theirs; a tensor or array built by hand needs `layout=` (the layout it
    was recorded under), or `layout="unchecked"`. With `attention_mask` (input_ids.shape),
    padding positions must hold no routes.
    """
    return Replay(model, routes, attention_mask=attention_mask, layout=layout)


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
