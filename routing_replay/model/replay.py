"""Replay: force recorded expert ids in a transformers MoE model, weights from the live logits.

`replay(model, routes)` is the block; `prepare_replay(model)` installs its code ahead of
`torch.compile` (`forcing` holds that code: router forwards and decoder hooks reading one
per-model state, inactive outside a block; `staging` checks the routes and puts them on the
routers' device once per batch).

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

from routing_replay.errors import RoutingReplayError
from routing_replay.layout import RoutingLayout
from routing_replay.model.adapters import MoeModel, find_routers
from routing_replay.model.forcing import ReplayState, forget_forced
from routing_replay.model.install import is_prepared, prepare_model
from routing_replay.model.owner import Owner, mark, unmark
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
from routing_replay.model.stance import refuse_unguarded, warn_unguarded
from routing_replay.routes import routes_layout
from routing_replay.validate import check_tolerance

__all__ = ["Replay", "is_prepared", "prepare_replay", "replay"]


def prepare_replay(model: nn.Module) -> nn.Module:
    """Install replay's router forwards and decoder hooks in `model` (call before torch.compile).

    Returns `model` itself, prepared: `torch.compile(prepare_replay(model))`. Idempotent (a
    router forward deleted since is installed again); the first `replay` block on a model
    does the same. Outside a `replay` block the installed code routes natively.
    """
    prepare_model(find_routers(model))
    return model


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
        tolerance: float | None = None,
    ) -> None:
        self.tolerance = check_tolerance(tolerance)
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
        self._state: ReplayState | None = None
        self._holding = False  # a claim on the model (`ReplayState.claim`)
        self._owner: Owner | None = None  # the thread and context mark of its entry
        self._grad_forwards = 0
        # Per MoE layer, the checkpoint recomputes it ran: the most of any layer is how many
        # backwards ran in the block (transformers may checkpoint every n-th layer only).
        self._recomputes_L: list[int] = [0] * self.moe.layout.num_moe_layers
        self._layer_inputs: set[tuple] = set()  # the decoder layers' inputs it ran (`LayerInputs`)
        self._tally_L: list[Tensor] = []  # per MoE layer: forced rows, agreed rows, replaced slots

    def __enter__(self) -> Replay:
        refuse_unguarded("replay")
        if self._state is not None:
            raise RoutingReplayError(
                "replay: this block is already active; enter a new replay(model, routes) "
                "instead of the same one twice"
            )
        state = prepare_model(self.moe)
        try:  # whatever stops the entry leaves the model unclaimed and inactive
            if not state.claim(self):
                raise RoutingReplayError(
                    "replay: another replay block is already active on this model; nested "
                    "replay blocks on one model are not supported"
                )
            state.owner, self._owner = self, mark()
            self._fill(state)
            state.turn(True)
            self._state = state
            return self
        except BaseException:
            self._state = None
            unmark(self._owner)
            if state.owner is self:
                state.deactivate()
            state.release(self)
            raise

    def _fill(self, state: ReplayState) -> None:
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
        state.owner_key = self._owner
        state.tolerance = self.tolerance
        if not self._tally_L:
            self._tally_L = [
                torch.zeros(3, dtype=torch.int64, device=device_of_router(r))
                for r in self.moe.routers
            ]
        state.tally_L = self._tally_L

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            # First: native routing from here on, whatever stops the rest.
            if (s := self._state) is not None and s.owner is self: s.active = False  # fmt: skip  # noqa: E701
            self._end()
        finally:  # (stopped in the try, this runs in full; else it finds nothing left)
            self._end()
        warn_unguarded("replay")
        if (
            exc_type is None
            and self._grad_forwards > max(self._recomputes_L, default=0)
            and _checkpointing(self.model)
        ):
            warnings.warn(
                "replay() exited before backward under gradient checkpointing: the recomputed "
                "forward will route natively. Call loss.backward() inside the `with replay(...)`.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _end(self) -> None:
        """Deactivate the model if this block is its owner, then give the claim back: the
        next block fills the state only once this one is done with it."""
        unmark(self._owner)
        state = self._state
        if state is not None:
            if state.owner is self:
                state.deactivate()
            state.release(self)
            self._state = None
        self._on_device.clear()  # the device copy is freed (unless a pending backward holds it)
        forget_forced(self.moe, self._owner)  # ids kept for a capture block
        self._layer_inputs.clear()

    def metrics(self) -> dict[str, float]:
        """What this block replays (a host sync): the batch's forced and missing (-1, routed
        natively) (token, MoE layer) rows, and over its forwards so far the share of forced
        rows whose recorded top-k set is the trainer's own (`native_agreement`) and the share
        of forced slots a `tolerance` refilled (`replace_rate`). Keys carry the `replay/`
        prefix trainers' loggers group by."""
        missing = int((self.routes < 0).all(dim=-1).sum())
        counts = [0, 0, 0]
        if self._tally_L:
            counts = torch.stack([t.cpu() for t in self._tally_L]).sum(0).tolist()
        calls, agreed, replaced = (int(c) for c in counts)
        return {
            "replay/rows_replayed": self.num_rows * self.moe.layout.num_moe_layers - missing,
            "replay/rows_missing": missing,
            "replay/native_agreement": agreed / calls if calls else float("nan"),
            "replay/replace_rate": replaced / (calls * self.moe.layout.top_k) if calls else 0.0,
        }

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

    def _count_recompute(self, j: int) -> None:  # (forwards are counted at the decoder)
        self._recomputes_L[j] += 1


def replay(
    model: nn.Module,
    routes: Any,
    attention_mask: Any = None,
    *,
    layout: RoutingLayout | Literal["unchecked"] | None = None,
    tolerance: float | None = None,
) -> Replay:
    """Force `routes` (input_ids.shape + (L, K), -1 = route natively) in `model`'s MoE routers.

    The routes' layout must be the model's (`LayoutMismatchError` names both): routes from
    `to_torch` carry theirs; a tensor or array built by hand needs `layout=` (the layout it
    was recorded under), or `layout="unchecked"`. With `attention_mask` (input_ids.shape),
    padding positions must hold no routes. `tolerance=r` (0 < r <= 1): a recorded expert the
    trainer scores below r x its weakest own top-k expert is replaced by the trainer's own
    (`Replay.metrics()` reports the replace rate).
    """
    return Replay(model, routes, attention_mask=attention_mask, layout=layout, tolerance=tolerance)


def _checkpointing(model: nn.Module) -> bool:
    # transformers 5.24 renamed is_gradient_checkpointing (deprecated) to is_activation_...
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag) and model.training
