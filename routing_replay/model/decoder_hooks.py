"""The decoder's three hooks (`install` registers them): who runs a forward and what it
must match before its layers run, whether every router was called after, and its note
off the thread's stack however it ended.

A forward of a block's own thread and task is checked against the block's routes (batch
shape) and counted; another thread's, begun while a block is on, is refused at its start.
Each forward notes per thread how it began (`owner.admit`): one begun with replay off that
ends after a block began or ended on the model is refused, as its layers may have run
under that block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from routing_replay.compat.torch import in_backward
from routing_replay.errors import InvalidRoutesError, RoutingReplayError, UnsupportedModelError
from routing_replay.model.adapters import input_tokens, split_rows
from routing_replay.model.forcing import _STATE, ReplayState, _reaches_ours, forget_forced
from routing_replay.model.owner import (
    admit,
    admitted,
    current_owner,
    in_block_thread,
    leave,
    owns,
    owns_compiled,
)
from routing_replay.model.recompute import wrap_checkpointing

_TASK_COMPILED = (
    "replay: a block entered inside an asyncio task checks which task runs each forward of "
    "the model eagerly, between compiled graphs; compile without fullgraph=True, or enter "
    "the block outside the event loop"
)


def _check_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    state: ReplayState = module.__dict__[_STATE]
    compiling = torch.compiler.is_compiling()
    # Before anything can refuse: `_end_forward` takes it off however the forward ends.
    # (Compiled as a whole, the frame guards that replay is on or off: no note.)
    note = None if compiling else admit(state, state.epoch)
    if not state.active:
        if torch.is_grad_enabled() and not compiling:
            wrap_checkpointing(state)  # a forward outside blocks: its recompute checked too
        return
    if not (
        owns_compiled(state.owner_key, _TASK_COMPILED)
        if compiling
        else owns(state.owner_key, current_owner())
    ):
        raise RoutingReplayError(
            "replay: the model was called from a thread or asyncio task other than the one "
            "whose replay block is active on it; its forwards would be forced with that "
            "block's routes. Call the model inside the block, in the thread and task that "
            "entered it (not through an executor), or give each thread its own model"
        )
    if note is not None:
        note[0] = True
    state.ran_L = [False] * len(state.ran_L)
    kwarg = state.moe.row_kwarg
    if kwarg is not None:  # this forward's tokens of each type (ERNIE 4.5 VL)
        state.split = split_rows(kwargs.get(kwarg))
    shape = _input_shape(args, kwargs)
    # Against the routes tensor's own sizes, not a tuple of ints: compiled with dynamic
    # shapes, a new batch shape then needs no recompile for this check.
    if shape is not None and shape != tuple(state.layer_routes[0].ids.shape[:-2]):
        raise InvalidRoutesError(
            f"routes have batch shape {list(state.batch_shape)} but the model is called with "
            f"input shape {list(shape)}: routes must be input_ids.shape + (num_moe_layers, "
            "top_k), aligned with the same padding or packing"
        )
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, Tensor) and not compiling:
        # The block's own copy of embeddings a caller may pass again outside it: the first
        # layer's input then tells this forward's recompute apart (`LayerInputs`).
        return args, {**kwargs, "inputs_embeds": embeds.clone()}
    return None


def _check_all_routed(module: nn.Module, args: tuple, output: Any) -> None:
    state: ReplayState = module.__dict__[_STATE]
    compiling = torch.compiler.is_compiling()
    note = None if compiling else admitted(state)
    if note is not None and not note[0]:  # begun with replay off (else refused at its start)
        if note[1] != state.epoch:  # and a block entered or exited while it ran
            _refuse_overlapped(state)
        return
    if not state.active:
        return
    if compiling and not in_block_thread(state.owner_key):
        # Compiled as a whole (refused at its start if replay was on then): another thread's
        # forward resumed after a graph break once a block began, routed natively
        # (`ReplayState.ours`). Not the block's forward: its checks are not this one's.
        return
    if not compiling and torch.is_grad_enabled() and not in_backward():
        # A forward done (one that fails has no backward to wait for), counted where the
        # caller's grad mode holds: reentrant checkpointing runs the layers under no_grad.
        state.owner._grad_forwards += 1
    ran, state.ran_L = state.ran_L, [False] * len(state.ran_L)
    if not all(ran):
        names = [r.name for r, done in zip(state.moe.routers, ran, strict=True) if not done]
        taken = [
            r.name
            for r in state.moe.routers
            if not _reaches_ours(r.module.__dict__.get(r.method), r.module, state)
        ]
        if taken:
            raise UnsupportedModelError(
                f"replay: the routers {taken} were prepared for replay by another model since "
                "this block began (the two models share these modules); their forwards went "
                "to that model's block. Replay one of the models at a time"
            )
        raise UnsupportedModelError(
            f"replay: the forward finished without calling the routers {names}; a fused MoE "
            "kernel (e.g. use_kernels=True) routes on its own and would ignore the routes"
        )


def _refuse_overlapped(state: ReplayState) -> None:
    forget_forced(state.moe, None)  # (what its forced layers kept for a capture)
    raise RoutingReplayError(
        "replay: a forward of this model ran while another thread entered or exited a "
        "replay block on it: its layers may have run under that block. Run it again, not "
        "while another thread's replay block begins or ends on the model, or give each "
        "thread its own model"
    )


def _end_forward(module: nn.Module, args: tuple, output: Any) -> None:
    """The decoder's last hook, called however its forward ended (`always_call`): its note
    off this thread's stack (`admit`)."""
    state = module.__dict__.get(_STATE)
    if state is not None and not torch.compiler.is_compiling():
        leave(state)


def _input_shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    input_ids = input_tokens(args, kwargs)
    if isinstance(input_ids, Tensor):
        return tuple(input_ids.shape)
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, Tensor):
        return tuple(embeds.shape[:-1])
    return None
