"""The code replay installs in a model's routers (`install` puts it there), and the per-model
state it reads.

The first `replay(model, routes)` block on a model (or `prepare_replay(model)`) installs,
once and for good, a `forward` on each MoE router module (an instance attribute that calls
the class's own forward, then forces the ids) and hooks on the decoder (`decoder_hooks`).
They all read one per-model state object: outside a `replay` block it is inactive and the
model routes natively (one Python call and one flag test per router); `Replay.__enter__`
puts the batch's routes there (on the routers' device, ids in the narrowest integer dtype,
widened per layer to int64 inside the router's forward), `__exit__` deactivates it and
frees them.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from routing_replay.compat.torch import break_graph, in_backward, run_eagerly
from routing_replay.errors import InvalidRoutesError
from routing_replay.model.adapters import MoeModel, Router, rows_of
from routing_replay.model.owner import (
    Owner,
    current_owner,
    in_block_thread,
    owns,
    this_thread,
)
from routing_replay.model.recompute import LayerInputs
from routing_replay.model.scores import ScoreFunction
from routing_replay.model.staging import DeviceRoutes
from routing_replay.model.tolerance import scores_over_all, tally, tolerate

if TYPE_CHECKING:
    from routing_replay.model.replay import Replay

_STATE = "_routing_replay_state"  # on the decoder: the model's ReplayState (also the mark)
_EPOCHS = itertools.count(1)  # (next() on it is atomic: epochs are unique across threads)


_OTHER_THREAD_ONE_GRAPH = (
    "replay: a thread other than the replay block's ran router code compiled with "
    "fullgraph=True while the block was on: whether it is a forward begun before the block "
    "(to route natively) or a checkpoint's recompute in autograd's thread (to be forced) is "
    "told eagerly, a graph break. Compile the layers without fullgraph=True, or put the "
    "checkpoint inside the compiled code (checkpoint_wrapper first, then torch.compile), "
    "and run the model only in the block's thread"
)


class ReplayState:
    """Per-model state read by the persistent router forwards and decoder hooks.

    Inactive outside a `replay` block. Attributes read under torch.compile are the flag
    (guarded) and the tensors of `layer_routes` (graph inputs); the Python lists of flags are
    read in eager mode only, so they never specialise a compiled graph.
    """

    def __init__(self, moe: MoeModel) -> None:
        self.moe = moe
        self.handles: list[Any] = []  # the decoder hooks
        self.pass_handles: list[Any] = []  # looped layers' PassTrackers
        self.active = False
        self.owner: Replay | None = None
        self.claims: list[Replay] = []  # blocks entering or active, in order (`claim`)
        self.owner_key: Owner | None = None  # the active block's thread and context mark
        self.batch_shape: tuple[int, ...] = ()
        self.layer_routes: list[DeviceRoutes] | None = None  # per MoE layer (shared per device)
        self.any_missing_L: list[bool] = []  # eager fast paths only
        self.all_missing_L: list[bool] = []
        self.ran_L: list[bool] = [False] * moe.layout.num_moe_layers
        self.tolerance: float | None = None  # the block's tolerance ratio, if any
        self.tally_L: list[Tensor] = []  # the block's counts per layer (`tolerance.tally`)
        # Where a layer's routers split its tokens by type (ERNIE 4.5 VL): this forward's rows of
        # each part (`adapters.split_rows`, set by the decoder's pre-hook), None: all part 0's.
        self.split: tuple[Tensor, Tensor] | None = None
        self.layer_checks: list[tuple[nn.Module, LayerInputs]] = []  # decoder layers' checks
        # A new value each time a block turns replay on or off (`turn`): a forward that saw
        # another value at its start overlapped a block's entry or exit (`_check_all_routed`).
        self.epoch = 0
        # The model's queue of capture blocks (`blocks`, the decoder's `ACTIVE`), set by each
        # capture block's entry: while it holds a block, forced calls keep their ids.
        self.captures: list = []

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) of a model inside a block comes out inactive, unclaimed."""
        state = self.__dict__.copy()
        state.update(self._inactive(), claims=[])
        return state

    def ours(self) -> bool:
        """Whether the running forward is the active block's: its thread and task (compiled:
        its thread, its task checked at the decoder's start, `owns_compiled`), or a
        checkpoint's recompute in autograd's thread."""
        if torch.compiler.is_compiling():
            if in_block_thread(self.owner_key):
                return True
            # Another thread: a forward resumed after a graph break once a block began
            # (native), or a recompute in autograd's device thread (CUDA): told apart
            # eagerly, a graph break in that thread's variant only (under fullgraph=True an
            # error saying so: even one graph of a layer may run in a forward begun before).
            break_graph(_OTHER_THREAD_ONE_GRAPH)
            return run_eagerly(in_backward)
        return in_backward() or owns(self.owner_key, current_owner())

    def claim(self, block: Replay) -> bool:
        """Queue `block` for the model: True if it is the first block holding a claim (of
        two threads claiming at once, exactly one is). Atomic list appends, no lock a stop
        could leave held; `release` gives the claim back, a claim that lost included."""
        for stale in [b for b in list(self.claims) if not b._holding]:  # a release stopped
            with contextlib.suppress(ValueError):
                self.claims.remove(stale)
        block._holding = True
        self.claims.append(block)
        return next(b for b in list(self.claims) if b._holding) is block

    def release(self, block: Replay) -> None:
        block._holding = False
        with contextlib.suppress(ValueError):  # (released already)
            self.claims.remove(block)

    def deactivate(self) -> None:
        """Back to native routing; drop every reference to the batch's routes (one update,
        the flag first, the owner last: an exit stopped half-way finds itself the owner)."""
        self.__dict__.update(self._inactive())

    def turn(self, active: bool) -> None:
        """Replay on or off for the model: the flag first, then a new epoch (a forward's
        start reads them in the other order: it sees the flag on, or the epoch change)."""
        self.active = active
        self.epoch = next(_EPOCHS)

    def _inactive(self) -> dict[str, Any]:
        return {
            "epoch": next(_EPOCHS),
            "active": False,
            "owner_key": None,
            "layer_routes": None,
            "any_missing_L": [],
            "all_missing_L": [],
            "ran_L": [False] * self.moe.layout.num_moe_layers,
            "tolerance": None,
            "tally_L": [],
            "split": None,
            "owner": None,
        }


class ReplayingForward:
    """A prepared router's `forward` (an instance attribute): the module's own forward (its
    class's, or one that other code had set on the instance, e.g. accelerate's hooks), then
    the forced ids while replay is active. A plain object, not a closure, so that
    `copy.deepcopy` and pickling carry it over to the copied module."""

    def __init__(
        self,
        module: nn.Module,
        state: ReplayState,
        layers: tuple[int, ...],
        router: Router,
        inner: Any,
    ) -> None:
        self.module = module
        self.state = state
        # Index among the MoE layers (the L of the routes) of each of its calls in a forward:
        # one, or one per pass of a looped layer (`current`, set by its PassTracker).
        self.layers = layers
        self.layer = layers[0]
        self.current = 0
        self.name = router.name
        self.score: ScoreFunction = router.score
        self.output = router.output
        self.method = router.method  # "forward", or the block's method that routes (DBRX)
        self.rows = router.rows  # its part of the layer's tokens, where it routes a part
        self.inner = inner  # an instance forward found when installing, or None
        # Per thread, the ids this call's experts got, while capture blocks are queued on the
        # model (its router's output may not carry them: `forced_ids`).
        self.chosen: dict[object, Tensor] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if capturing(self.state):  # (a former call's, left by a capture that did not read it)
            self.chosen.pop(this_thread(), None)
        if self.inner is None:
            output = getattr(type(module), self.method)(module, *args, **kwargs)
        else:
            output = self.inner(*args, **kwargs)
        if not self.state.active or not self.state.ours():  # (another thread's forward)
            return output
        return _force(self, module, output, args)

    def __repr__(self) -> str:
        return f"<routing_replay forward of {self.name!r}>"


def wrapped(forward: Any, kind: type) -> Any:
    """The `kind` object at or under `forward`, following `__wrapped__` (as
    functools.update_wrapper and accelerate's hooks set it), or None."""
    for _ in range(16):
        if isinstance(forward, kind):
            return forward
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return None
    return None


def _reaches_ours(forward: Any, module: nn.Module, state: ReplayState) -> bool:
    """Whether `forward` is this state's replaying forward of `module`, or wraps it."""
    ours = wrapped(forward, ReplayingForward)
    return ours is not None and ours.module is module and ours.state is state


def capturing(state: ReplayState) -> bool:
    """Whether capture blocks are queued on the model (`blocks`): forced calls then keep the
    ids their experts got. Read from the queue each call, never from a flag one block's exit
    could clear while another block enters (compiled code guards the queue's length)."""
    return bool(state.captures)


def forget_forced(moe: MoeModel, owner: Owner | None) -> None:
    """Drop the ids kept by the forced calls of `owner`'s thread (a block's exit, maybe from
    another thread; the other threads' blocks keep theirs)."""
    thread = this_thread() if owner is None else owner.thread
    for router in moe.all_routers:
        slot = wrapped(router.module.__dict__.get(router.method), ReplayingForward)
        if slot is not None:
            slot.chosen.pop(thread, None)


def forced_ids(module: nn.Module, method: str) -> Tensor | None:
    """The ids the experts got from this thread's running call of `module.method`, if replay
    forced it (the forced ids, the router's own on missing rows), else None. Some outputs do
    not carry them: Llama 4's and JetMoE's ids are the top-k of the logits, Doge's its
    product-key choice, Zaya's skip expert is rewritten to id 0."""
    slot = wrapped(module.__dict__.get(method), ReplayingForward)
    if slot is None or not slot.chosen:
        return None
    return slot.chosen.pop(this_thread(), None)


# -- the installed code: runs on every forward of a prepared model -----------------------------


def _force(slot: ReplayingForward, module: nn.Module, output: tuple, args: tuple) -> tuple:
    """The router's output with the forced ids and the family's weights at them, merged with
    the native missing rows."""
    state, j = slot.state, slot.layers[slot.current]
    state.ran_L[j] = True
    compiling = torch.compiler.is_compiling()
    # A checkpoint's recompute (eager: compiled recomputes replay graph inputs): counted
    # per layer, not tallied, nothing kept for capture.
    recompute = not compiling and in_backward()
    if not compiling:
        if recompute and (slot.rows is None or slot.rows.part == 0):
            state.owner._count_recompute(j)
        if state.all_missing_L[j]:
            return output
    rows_T = slot.output.rows(output)
    routes = state.layer_routes[j]
    ids_NLK = routes.ids.flatten(0, -3)  # the rows the routers see (a view)
    rows_N = rows_of(slot.rows, state.split)  # this router's rows, where it routes a part
    count = ids_NLK.shape[0] if rows_N is None else rows_N.shape[0]
    if rows_T.shape[0] != count:
        raise InvalidRoutesError(
            f"router {slot.name!r} sees {rows_T.shape[0]} tokens but the routes "
            f"have {count} rows for it (batch shape {list(state.batch_shape)})"
        )
    if not compiling and ids_NLK.device != rows_T.device:  # a model moved since
        routes = state.owner._device_routes(rows_T.device)
        ids_NLK = routes.ids.flatten(0, -3)
    ids_TK = ids_NLK[:, j].long()  # widened per layer: the batch stays narrow
    if rows_N is not None:
        ids_TK = ids_TK.index_select(0, rows_N.to(ids_TK.device))
    # Compiled: always merge (uniform ops, so the graph does not depend on which layers have
    # missing rows in this batch). Eager: only where a row is missing (the same values).
    missing_T1 = None
    if compiling or state.any_missing_L[j]:
        missing_T1 = routes.missing.flatten(0, -2)[:, j, None]
        if rows_N is not None:
            missing_T1 = missing_T1.index_select(0, rows_N.to(missing_T1.device))
    scores_TE, native_TK = slot.output.native(module, output, args)
    replaced_TK = None
    recorded_TK = ids_TK
    if state.tolerance is not None:
        all_TE = scores_over_all(slot.score, module, scores_TE)
        ids_TK, replaced_TK = tolerate(all_TE, native_TK, ids_TK, state.tolerance)
    with torch.no_grad():
        if not recompute:
            tally(state.tally_L[j], recorded_TK, native_TK, replaced_TK, missing_T1)
        if capturing(state) and not recompute:  # (capture records no recompute)
            chosen_TK = ids_TK if missing_T1 is None else torch.where(missing_T1, native_TK, ids_TK)
            slot.chosen[this_thread()] = chosen_TK
    return slot.output.force(module, output, slot.score, ids_TK, missing_T1, args)
