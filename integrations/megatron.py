"""Megatron-core: feed routing_replay routes to `RouterReplay` (megatron-core 0.16 - 0.19).

Megatron-core replays routes when `TransformerConfig(moe_enable_routing_replay=True)`:
every `TopKRouter` appends a `RouterReplay` to a class-level list in build order (the list
is never pruned), `RouterReplay.set_replay_data(list)` takes one `[seq * batch, top_k]`
int64 tensor per router of this rank (rows seq-major, as the router flattens its
`[S, B, H]` input), and `REPLAY_FORWARD` / `REPLAY_BACKWARD` pick the ids; every
`set_replay_data` also queues the tensors for the recompute in backward, a queue that only
`clear_global_indices()` empties. Megatron checks none of it: a wrong k, int32 ids, a
batch-major order or too few rows replay silently wrong, and with `moe_router_fusion`, or
the sinkhorn or quantile-balancing routing types, replay is skipped without a word.

`MegatronRouterFeed` does the conversion and the checks: routes `[B, S, L, K]` (or packed
`[1, T, L, K]`, a rank's CP / SP slice: `nemo_rl.read_rank_routes` reads just its tokens)
over all MoE layers of
the model -> this pipeline stage's (or model chunk's) MoE layers (dense layers have no
router) -> one int64 `[S * B, K]` tensor per router, set on exactly the routers of the
model it was given (each chunk of a virtual pipeline gets its own feed, set when that
chunk runs a micro-batch); shape, dtype, top-k, id range, each router's layer and row
count (checked when it runs) are validated, fusion and routing that bypasses replay are
refused, the backward queue is
cleared at step boundaries. Megatron is imported lazily.

Rows without routes: `RouterReplay` has no per-row native routing (`REPLAY_FORWARD` gathers
the target ids of every row), so every row needs ids. A `replay_mask` (`replay_mask()`
builds it) says which rows those may be: padding, and each sequence's final token (a
rollout never forwards it, so it has no routes; no loss term and no other token reads its
output). Those get filler ids (`_rows.fill_missing`); a token the mask marks
as replayed that has no routes (a prefix-cache gap, an SGLang suffix) is refused, since
filler experts would change its output and the loss, unless `fill_real="filler"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from routing_replay import MISSING, RoutesTensor, RoutingLayout
from routing_replay.errors import InvalidArgumentError, InvalidRoutesError, LayoutMismatchError
from routing_replay.integrations._rows import fill_missing
from routing_replay.validate import check_integer, check_rows


def _replay_module() -> Any:
    from megatron.core.transformer.moe import router_replay

    return router_replay


def stage_moe_layers(
    layout: RoutingLayout, layer_offset: int = 0, num_local_layers: int | None = None
) -> list[int]:
    """Global indices of the MoE layers built on a pipeline stage, in build order.

    `layer_offset` is the stage's first global layer (Megatron's
    `get_transformer_layer_offset`), `num_local_layers` its layer count (default: to the end).
    """
    end = layout.num_layers if num_local_layers is None else layer_offset + num_local_layers
    if not 0 <= layer_offset < end <= layout.num_layers:
        raise LayoutMismatchError(
            f"layers [{layer_offset}, {end}) are not inside the model's {layout.num_layers} layers"
        )
    return [i for i in layout.moe_layers if layer_offset <= i < end]


def replay_mask(
    input_lengths: torch.Tensor | Sequence[int],
    seq_len: int | None = None,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    replay_final: bool = False,
) -> torch.Tensor:
    """Bool mask of the rows whose routes must be replayed: True for each real token except
    (unless `replay_final`) a sequence's final one; False for padding and that final token.

    Padded batch `[B, S]`: `replay_mask(input_lengths, S)` (right padding, as
    `nemo_rl`). Packed `[1, T]`: `replay_mask(lengths, cu_seqlens=cu)` with the
    unpadded lengths (`cu_seqlens_unpadded.diff()`) and the padded boundaries `cu_seqlens`
    that `nemo_rl.pack` returns. Slice it exactly as the routes (`nemo_rl.cp_slice`,
    `sp_slice`, or `routes_for_rank(..., key=)`) and pass it to `MegatronRouterFeed.set`.

    The final token is False by default: a rollout records no routes for it (the engine
    never forwards the last token it samples), and filler ids there change nothing the loss
    sees (its logits predict past the sequence; causal attention lets no token read it).
    """
    lengths = torch.as_tensor(input_lengths, dtype=torch.int64).reshape(-1)
    keep = lengths if replay_final else (lengths - 1).clamp(min=0)
    if cu_seqlens is None:
        if seq_len is None:
            raise InvalidArgumentError(
                "replay_mask: pass seq_len (padded [B, S]) or cu_seqlens (packed)"
            )
        if (lengths < 0).any() or (lengths > seq_len).any():
            raise InvalidRoutesError(
                f"input_lengths must be in [0, {seq_len}], got {lengths.tolist()}"
            )
        return torch.arange(seq_len) < keep[:, None]
    bounds = torch.as_tensor(cu_seqlens, dtype=torch.int64).reshape(-1)
    if len(bounds) != len(lengths) + 1 or ((bounds[1:] - bounds[:-1]) < lengths).any():
        raise InvalidRoutesError(
            f"cu_seqlens {bounds.tolist()} must hold one padded boundary per sequence around "
            f"the input lengths {lengths.tolist()} (nemo_rl.pack's cu_seqlens)"
        )
    if seq_len is not None and seq_len != int(bounds[-1]):
        raise InvalidRoutesError(f"seq_len={seq_len} but cu_seqlens ends at {int(bounds[-1])}")
    mask = torch.zeros(1, int(bounds[-1]), dtype=torch.bool)
    for start, n in zip(bounds[:-1].tolist(), keep.tolist(), strict=True):
        mask[0, start : start + n] = True
    return mask


class MegatronRouterFeed:
    """Validated feed from routes to Megatron-core's `RouterReplay` for one pipeline stage.

    With `model=` (a stage, or one model chunk of a virtual pipeline) it drives exactly that
    model's routers; without, every registered `RouterReplay` instance of the process.
    """

    def __init__(
        self,
        layout: RoutingLayout,
        config: Any,
        *,
        layer_offset: int = 0,
        num_local_layers: int | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        _check_config(layout, config)
        self.layout = layout
        self.layers = stage_moe_layers(layout, layer_offset, num_local_layers)
        self._columns = [layout.moe_layers.index(i) for i in self.layers]
        self._rows: list[int] = []
        self._handles = []
        if model is None:
            instances = _replay_module().RouterReplay.global_router_replay_instances
            if len(instances) != len(self.layers):
                raise LayoutMismatchError(
                    f"RouterReplay has {len(instances)} router instances but this stage builds "
                    f"{len(self.layers)} MoE layers {self.layers}: instances of an earlier model "
                    "stay registered; call RouterReplay.clear_global_router_replay_instances() "
                    "before building the model (or pass model=), and check layer_offset / "
                    "num_local_layers"
                )
            self._instances = list(instances)
        else:
            routers = self._routers_of(model)
            self._instances = [r.router_replay for r in routers]
            for j, router in enumerate(routers):
                self._handles.append(router.register_forward_pre_hook(self._row_check(j)))

    def _routers_of(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's routers in build order, checked against this feed's MoE layers."""
        routers = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
        if len(routers) != len(self.layers):
            raise LayoutMismatchError(
                f"the model has {len(routers)} replaying routers but the feed's layers hold "
                f"{len(self.layers)} MoE layers {self.layers}: pass the layer_offset and "
                "num_local_layers of exactly this pipeline stage (or model chunk)"
            )
        for router, layer in zip(routers, self.layers, strict=True):
            number = getattr(router, "layer_number", None)  # global, 1-based, once built
            if number is not None and number != layer + 1:
                raise LayoutMismatchError(
                    f"the model's router of layer {number - 1} would be fed the routes of "
                    f"layer {layer}: check layer_offset / num_local_layers"
                )
        return routers

    def _row_check(self, j: int) -> Any:
        rr = _replay_module()

        def hook(module: torch.nn.Module, args: tuple) -> None:
            action = module.router_replay.router_replay_action
            if action is None or action == rr.RouterReplayAction.RECORD or not self._rows:
                return
            tokens = args[0].numel() // args[0].shape[-1]
            if tokens != self._rows[j]:
                raise InvalidRoutesError(
                    f"the router of layer {self.layers[j]} sees {tokens} tokens but was fed "
                    f"{self._rows[j]} rows: feed the routes of exactly this micro-batch, after "
                    "the same CP / SP slicing as its input_ids"
                )

        return hook

    def tensors(
        self,
        routes: torch.Tensor,
        *,
        replay_mask: torch.Tensor | None = None,
        fill_real: Literal["error", "filler"] = "error",
    ) -> list[torch.Tensor]:
        """One int64 `[S * B, K]` tensor per router of this stage (seq-major), validated.

        `routes` is `[B, S, L, K]` (a packed batch is `[1, T, L, K]`) over all MoE layers,
        -1 missing. Megatron's `RouterReplay` cannot route some rows natively (it gathers
        the target ids of every row), so every row gets ids:

        - routes given: those ids, wherever the row is;
        - missing where `replay_mask` (`[B, S]`, sliced like the routes; `replay_mask()`) is
          False (padding, each sequence's final token): filler ids from
          `routing_replay.integrations.nemo_rl.fill_missing`, distinct and spread over every
          expert;
        - missing where it is True, or anywhere without a mask: `InvalidRoutesError`,
          naming the row, because filler experts would change that token's output. With
          `fill_real="filler"` such rows get filler ids too: only for tokens whose outputs
          you know do not matter.
        """
        if fill_real not in ("error", "filler"):
            raise InvalidArgumentError(
                f"fill_real must be 'error' or 'filler', got {fill_real!r} (Megatron's "
                "RouterReplay has no per-row native routing)"
            )
        routes = torch.as_tensor(routes)
        if isinstance(routes, RoutesTensor) and routes.layout not in (None, self.layout):
            raise LayoutMismatchError(
                f"the routes were recorded under {routes.layout}, but this feed replays "
                f"{self.layout}: feed the routes of the model the feed was built for"
            )
        L, K = self.layout.num_moe_layers, self.layout.top_k
        check_integer(routes)
        if routes.ndim != 4 or routes.shape[2:] != (L, K):
            raise InvalidRoutesError(
                f"routes must be [batch, seq, {L} MoE layers, top_k={K}] (packed: [1, T, L, K]), "
                f"got {tuple(routes.shape)}: pass the routes of every MoE layer of the model; "
                "the feed picks this stage's"
            )
        replayed = self._replay_rows(replay_mask, tuple(routes.shape[:2]))
        ids = routes.as_subclass(torch.Tensor).long()
        local = ids[:, :, self._columns]  # [B, S, L_local, K]
        S = local.shape[1]

        def where(n: int, j: int) -> str:
            return f"batch {n // S}, position {n % S}, MoE layer {self.layers[j]}"

        # Out of range, repeated (Megatron would send a token to one expert twice), partly
        # missing (filler would replace a row's recorded ids): refused, row named.
        check_rows(local.reshape(-1, *local.shape[2:]), self.layout.num_experts, where)
        missing = (local == MISSING).any(-1)  # [B, S, L_local]
        if fill_real == "error":
            refused = missing if replayed is None else missing & replayed[..., None]
            if refused.any():
                b, s, j = (int(i) for i in refused.nonzero()[0])
                raise InvalidRoutesError(self._refusal(b, s, self.layers[j], replayed is None))
        local, _ = fill_missing(local, self.layout.num_experts)
        seq_major = local.transpose(0, 1)  # [S, B, L, K]: the router flattens [S, B, H]
        return [seq_major[:, :, j].reshape(-1, K).contiguous() for j in range(len(self.layers))]

    @staticmethod
    def _replay_rows(mask: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
        if mask is None:
            return None
        mask = torch.as_tensor(mask)
        if mask.is_floating_point() or mask.is_complex():
            raise InvalidRoutesError(f"replay_mask must be bool or 0/1 integers, got {mask.dtype}")
        if tuple(mask.shape) != shape:
            raise InvalidRoutesError(
                f"replay_mask is {tuple(mask.shape)} but the routes are {shape} (batch, seq): "
                "slice the mask exactly as the routes (same CP / SP slicing)"
            )
        if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
            raise InvalidRoutesError("replay_mask must hold only 0 and 1 (or bool)")
        return mask.bool()

    @staticmethod
    def _refusal(b: int, s: int, layer: int, no_mask: bool) -> str:
        where = f"batch {b}, position {s} has no route for layer {layer}"
        if no_mask:
            return (
                f"{where} and the feed got no replay_mask, so it cannot tell padding from a "
                "real token (Megatron's RouterReplay has no per-row native routing; filler "
                "experts would change a real token's output): pass replay_mask= (e.g. "
                "replay_mask(input_lengths, S), sliced like the routes) so that padding and "
                "each sequence's final token get filler ids, or fill_real='filler' to give "
                "every missing row filler ids"
            )
        return (
            f"{where}, but replay_mask marks it as a real token to replay: its routes were "
            "not recorded (a prefix-cache gap, an engine that reports a suffix only?). "
            "Megatron's RouterReplay has no per-row native routing and filler experts would "
            "change its output: re-collect the routes of this sample, drop it from the "
            "batch, or pass fill_real='filler' to accept filler experts for such tokens"
        )

    def set(
        self,
        routes: torch.Tensor,
        *,
        replay_mask: torch.Tensor | None = None,
        fill_real: Literal["error", "filler"] = "error",
    ) -> None:
        """Hand one micro-batch's routes to every router of this feed and replay them.

        `replay_mask`, `fill_real`: as in `tensors` (rows without routes).
        """
        per_router = self.tensors(routes, replay_mask=replay_mask, fill_real=fill_real)
        forward = _replay_module().RouterReplayAction.REPLAY_FORWARD
        for instance, ids in zip(self._instances, per_router, strict=True):
            instance.set_target_indices(ids)  # also queued for the recompute in backward
            instance.set_router_replay_action(forward)
        self._rows = [len(t) for t in per_router]

    def backward(self) -> None:
        """Switch to replaying the queued routes for activation recompute in backward."""
        backward = _replay_module().RouterReplayAction.REPLAY_BACKWARD
        for instance in self._instances:
            instance.set_router_replay_action(backward)

    def end_step(self) -> None:
        """Step boundary: drop targets and the recompute queue; routers route natively."""
        for instance in self._instances:
            instance.clear_indices()
            instance.clear_router_replay_action()
        self._rows = []

    def close(self) -> None:
        """End the step and remove the row-count hooks."""
        self.end_step()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# TopKRouter routing types that never call RouterReplay (`sinkhorn_load_balancing`, and
# `quantile_balancing` from megatron-core 0.17): replay would be skipped without a word.
_BYPASSING_ROUTING = ("sinkhorn", "quantile_balancing")


def _check_config(layout: RoutingLayout, config: Any) -> None:
    if getattr(config, "moe_router_fusion", False):
        raise LayoutMismatchError(
            "moe_router_fusion=True: Megatron's fused top-k kernel skips RouterReplay "
            "silently, so nothing would be replayed; set moe_router_fusion=False"
        )
    kind = getattr(config, "moe_router_load_balancing_type", None)
    if isinstance(kind, str) and kind in _BYPASSING_ROUTING:
        raise LayoutMismatchError(
            f"moe_router_load_balancing_type={kind!r}: Megatron's {kind} routing picks the "
            "experts without asking RouterReplay (megatron-core 0.16 - 0.19), so nothing would "
            "be replayed; use 'aux_loss', 'seq_aux_loss', 'global_aux_loss' or 'none'"
        )
    if not getattr(config, "moe_enable_routing_replay", False):
        raise LayoutMismatchError(
            "the TransformerConfig has moe_enable_routing_replay=False: its routers have no "
            "RouterReplay; build the model with moe_enable_routing_replay=True"
        )
    checks: Sequence[tuple[str, int, int]] = [
        ("moe_router_topk", config.moe_router_topk, layout.top_k),
        ("num_moe_experts", config.num_moe_experts, layout.num_experts),
        ("num_layers", config.num_layers, layout.num_layers),
    ]
    for name, theirs, ours in checks:
        if theirs != ours:
            raise LayoutMismatchError(
                f"TransformerConfig.{name}={theirs} but the routes' layout has {ours}: the "
                "routes were recorded for another model"
            )
