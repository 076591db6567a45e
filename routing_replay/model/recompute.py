"""Gradient checkpointing under replay: a layer's recompute must be of a forward the block ran.

A checkpoint's recompute (in a backward) re-runs a decoder layer's forward, routers and
all, and replay forces whatever block is active then. Each decoder layer holding a router
notes the inputs of the forwards the active block runs (`LayerInputs`, as a forward
pre-hook and around transformers' checkpoint function), and a recompute of any other input
is refused instead of being forced with the wrong routes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from routing_replay.compat.torch import graph_task_id, unwrapped
from routing_replay.compat.transformers import (
    layer_checkpoint_function,
    set_layer_checkpoint_function,
)
from routing_replay.errors import RoutingReplayError

if TYPE_CHECKING:
    from routing_replay.model.adapters import MoeModel
    from routing_replay.model.forcing import ReplayState

_LAYER_LISTS = ("layers", "blocks")  # where decoders keep their layers (DBRX: blocks)


class LayerInputs:
    """A decoder layer's check of its inputs, run as its forward pre-hook and inside
    transformers' checkpointing of its forward (`CheckpointedInputs`): the inputs of the
    layer's forwards the active block runs are noted, and a checkpoint's recompute (in a
    backward) of an input it did not run (a forward from before the block, or another
    thread's) is refused instead of being forced with the block's routes. A recompute sees
    the forward's own input (reentrant: a detached view of it): the key is its storage and
    shape."""

    def __init__(self, state: ReplayState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        state = self.state
        # In eval mode too: torch's checkpoint recomputes whatever the mode (compiled code is
        # not checked: its recompute replays the graph's inputs).
        if not state.active or torch.compiler.is_compiling():
            return
        hidden = next((a for a in args if isinstance(a, Tensor)), kwargs.get("hidden_states"))
        owner = state.owner
        if not isinstance(hidden, Tensor) or owner is None:
            return
        key = (id(module), hidden.data_ptr(), tuple(hidden.shape))
        if graph_task_id() == -1:  # not in a backward (no frame: see `graph_task_id`)
            if state.ours():  # (reentrant checkpointing runs it under no_grad: noted anyway)
                owner._layer_inputs.add(key)
        elif key not in owner._layer_inputs:
            raise RoutingReplayError(
                "replay: a backward recomputed (gradient checkpointing) a decoder layer's "
                "forward that did not run in the active replay block (a forward from before "
                "the block, or another thread's): it would be forced with this block's routes "
                "instead of routed as it ran. Run the forward and its backward inside one block"
            )


class CheckpointedInputs:
    """A layer's transformers checkpoint function, wrapped: the checkpointed forward runs
    the layer's `LayerInputs` check first, in the forward and again in the recompute."""

    def __init__(self, check: LayerInputs, layer: nn.Module, inner: Any) -> None:
        self.check, self.layer, self.inner = check, layer, inner

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        return self.inner(_Checked(self.check, self.layer, function), *args, **kwargs)


class _Checked:
    def __init__(self, check: LayerInputs, layer: nn.Module, function: Any) -> None:
        self.check, self.layer, self.function = check, layer, function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.check(self.layer, args, kwargs)
        return self.function(*args, **kwargs)


def check_layer_inputs(moe: MoeModel, state: ReplayState) -> None:
    """Give each decoder layer holding a router its `LayerInputs` check (once): as a forward
    pre-hook of the layer under torch's wrappers (their recompute runs its hooks) and around
    transformers' checkpoint function (which recomputes the forward alone)."""
    routers = {id(r.module) for r in moe.all_routers}
    checks = []
    for name, module in moe.decoder.named_modules():
        if not (isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in _LAYER_LISTS):
            continue
        for listed in module:
            layer = unwrapped(listed)  # compiled on its own (torchtitan), checkpoint-wrapped
            if not any(id(m) in routers for m in layer.modules()):
                continue
            check = next((h for h in layer._forward_pre_hooks.values() if _checks(h, state)), None)
            if check is None:
                check = LayerInputs(state)
                layer.register_forward_pre_hook(check, with_kwargs=True)
            checks.append((layer, check))
    state.layer_checks = checks
    wrap_checkpointing(state)


def _checks(hook: Any, state: ReplayState) -> bool:
    return isinstance(hook, LayerInputs) and hook.state is state


def wrap_checkpointing(state: ReplayState) -> None:
    """Wrap the layers' transformers checkpoint functions (set since, by
    `gradient_checkpointing_enable`): at preparing and before every forward with grad."""
    for layer, check in state.layer_checks:
        inner = layer_checkpoint_function(layer)
        if inner is not None and not isinstance(inner, CheckpointedInputs):
            set_layer_checkpoint_function(layer, CheckpointedInputs(check, layer, inner))


_LAYER_LISTS = ("layers", "blocks")  # where decoders keep their layers (DBRX: blocks)
