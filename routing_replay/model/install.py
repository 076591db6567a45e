"""Installing replay in a model, once and for good: its router forwards and decoder hooks.

`prepare_model` puts a `ReplayingForward` on each MoE router (beneath capture's dispatcher
where one is there, on top of other code's wrappers otherwise), the three decoder hooks
(`decoder_hooks`), the recompute checks of the decoder layers and, for looped layers, the
hook that tells each call its pass. Run again, it adds only what is missing (a stop, or
another model's preparation, may have taken some away).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from routing_replay.compat.torch import remove_hooks
from routing_replay.model.adapters import MoeModel, Router, find_routers
from routing_replay.model.decoder_hooks import _check_all_routed, _check_inputs, _end_forward
from routing_replay.model.forcing import (
    _STATE,
    ReplayingForward,
    ReplayState,
    _reaches_ours,
    wrapped,
)
from routing_replay.model.recompute import check_layer_inputs


def prepare_model(moe: MoeModel) -> ReplayState:
    decoder = moe.decoder
    state = decoder.__dict__.get(_STATE)
    if not isinstance(state, ReplayState) or _router_ids(state.moe) != _router_ids(moe):
        for handle in getattr(state, "handles", ()):  # a state for other routers: replaced
            handle.remove()
        state = ReplayState(moe)
        setattr(decoder, _STATE, state)  # a plain object: not a submodule, not in state_dict
    for router, layers in moe.by_module():
        module = router.module
        installed = module.__dict__.get(router.method)
        if not _reaches_ours(installed, module, state):  # else ours, or other code's on top
            # Under a wrapper that asks for it (capture's), else on top of what is there.
            host = installed if getattr(installed, "replay_beneath", False) else None
            below = installed if host is None else host.inner
            if isinstance(below, ReplayingForward):  # ours for a former state: unwrap it
                below = below.inner
            slot = ReplayingForward(module, state, layers, router, below)
            if host is None:
                setattr(module, router.method, slot)
            else:
                host.inner = slot
        if router.loop is not None:
            _track_passes(
                moe, state, router, wrapped(module.__dict__[router.method], ReplayingForward)
            )
    check_layer_inputs(moe, state)
    live = [h for h in state.handles if _hook_registered(decoder, h)]
    if len(live) != 3:
        for handle in live:
            handle.remove()
        # A registration stopped before its handles were kept (Ctrl-C) left hooks no handle
        # names: a second pair would count every forward twice (and refuse all of them).
        remove_hooks(decoder, (_check_inputs, _check_all_routed, _end_forward))
        state.handles = [  # (in this order: the check reads the note the end takes off)
            decoder.register_forward_pre_hook(_check_inputs, with_kwargs=True),
            decoder.register_forward_hook(_check_all_routed),
            decoder.register_forward_hook(_end_forward, always_call=True),
        ]
    return state


def is_prepared(model: nn.Module) -> bool:
    """Whether `model` carries replay's router forwards and decoder hooks (see prepare_replay)."""
    moe = find_routers(model)
    state = moe.decoder.__dict__.get(_STATE)
    return (
        isinstance(state, ReplayState)
        and all(
            _reaches_ours(r.module.__dict__.get(r.method), r.module, state) for r in moe.all_routers
        )
        and sum(_hook_registered(moe.decoder, h) for h in state.handles) == 3
        and all(
            any(_hook_registered(r.pass_module, h) for h in state.pass_handles)
            for r in moe.all_routers
            if r.loop is not None
        )
    )


class PassTracker:
    """A forward pre-hook on a looped decoder layer's module whose call says its pass
    (`adapters.LoopPass`): sets the pass on the layer's router's forward, before the router
    runs, in the forward and again in a checkpoint's recompute."""

    def __init__(self, slot: ReplayingForward, loop: Any) -> None:
        self.slot = slot
        self.loop = loop

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.slot.current = self.loop.of(kwargs)


def _track_passes(moe: MoeModel, state: ReplayState, router: Router, slot: Any) -> None:
    """Register the PassTracker of a looped router once (kept while it is live)."""
    target = router.pass_module
    for handle in state.pass_handles:
        hook = target._forward_pre_hooks.get(handle.id)
        if isinstance(hook, PassTracker) and hook.slot is slot:
            return
    tracker = PassTracker(slot, router.loop)
    state.pass_handles.append(target.register_forward_pre_hook(tracker, with_kwargs=True))


def _router_ids(moe: MoeModel) -> tuple[int, ...]:
    return tuple(id(r.module) for r in moe.all_routers)


def _hook_registered(module: nn.Module, handle: Any) -> bool:
    return handle.id in module._forward_pre_hooks or handle.id in module._forward_hooks
