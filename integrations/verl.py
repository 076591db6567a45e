"""verl 0.9: routes for `DataProto` batches, kept aligned through verl's own padding,
remove-padding, dynamic micro-batching and Ulysses sequence parallelism, and replayed in
its FSDP engine.

A verl rollout batch lays each row out as the prompt left padded to `prompts.shape[1]`,
then the response right padded (`input_ids = cat(prompts, responses)`, `attention_mask`
1 on both runs: the tokens are one contiguous run). The rollout side puts each sample's
routes into its node's store; only the `RoutingRef`s travel, in
`data.non_tensor_batch["routing_refs"]` (a numpy object array, which verl's `DataProto`
keeps through `union`, `reorder`, `chunk` and `prepare_dynamic_batch`).

On the trainer worker:

- `attach_routes(data)` reads the refs' routes (same-node ones from shared memory) into
  `data.batch["routed_experts"]` `[B, S, L, K]`, -1 where missing: verl's own key, so
  verl's remove-padding (`left_right_2_no_padding`, which indexes it with `unpad_input`'s
  indices) and micro-batching (`rearrange_micro_batches`, `prepare_dynamic_batch`) carry
  it with its rows. Every token is checked against the stored token ids.
- `model_input_routes(micro_batch, ...)` gives the `[1, T_local, L, K]` routes of the
  packed sequence the model sees on this Ulysses rank, padded and sliced by verl's own
  `ulysses_pad` / `slice_input_tensor` (and the engine's bucket pad), -1 on the pads;
  from refs alone, only this rank's tokens are read (a `TokenShard` sliced the same way).
- `replaying_engine(FSDPEngineWithLMHead)` returns a subclass whose `forward_step` runs
  the model under `replay` with those routes, the block kept open through the
  micro-batch's backward (so gradient-checkpoint recomputes replay too), and whose
  `forward_backward_batch` adds the batch's replay metrics to the metrics dict it returns.

Replay metrics (`replay/rows_replayed`, `replay/rows_missing`, `replay/native_agreement`,
`replay/replace_rate`): over one `forward_backward_batch` call (a mini-batch: the update's
micro-batches, or a log-prob pass) this rank's rows are summed and its rates weighted by
rows replayed; each goes into `output["metrics"]` as a one-item list, the form verl's
workers all-gather over data-parallel ranks and flatten, so the trainer's logged value is
the mean over ranks and mini-batches. `replay_tolerance` goes to every `replay` the engine
makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from routing_replay import MISSING, RoutingLayout, RoutingRef, TokenShard, to_torch, with_layout
from routing_replay.errors import InvalidRoutesError
from routing_replay.integrations._reads import Fetch, check_row_tokens, fetch_checked, read_shard
from routing_replay.integrations.replay_metrics import KEYS as REPLAY_KEYS
from routing_replay.integrations.replay_metrics import StepMetrics
from routing_replay.validate import check_tolerance

REFS_KEY = "routing_refs"  # in DataProto.non_tensor_batch
ROUTES_KEY = "routed_experts"  # verl's own key for routes in DataProto.batch
LAYOUT_KEY = "routing_replay_layout"  # in DataProto.meta_info: the attached routes' layout


def attach_routes(
    data: Any,
    *,
    fetch: Fetch | None = None,
    refs_key: str = REFS_KEY,
    key: str = ROUTES_KEY,
) -> Any:
    """Read the refs' routes into `data.batch[key]` `[B, S, L, K]`, aligned with input_ids.

    `data` is a verl `DataProto` with `input_ids`, `attention_mask` and `prompts` in its
    batch and one `RoutingRef` per row in `data.non_tensor_batch[refs_key]`. `fetch` turns
    refs into an Arrow batch (default `routing_replay.ray.fetch_batch`; `store.read`
    in one process). Returns `data`.
    """
    batch = data.batch
    input_ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu()
    prompt_width = batch["prompts"].shape[1]
    refs = list(data.non_tensor_batch[refs_key])
    if len(refs) != len(input_ids) or any(not isinstance(r, RoutingRef) for r in refs):
        raise InvalidRoutesError(
            f"non_tensor_batch[{refs_key!r}] must hold one RoutingRef per row "
            f"({len(input_ids)} rows), got {len(refs)} items"
        )
    prompt_tokens = mask[:, :prompt_width].sum(1).tolist()
    for b, ref in enumerate(refs):
        if ref.prompt_len is not None and ref.prompt_len != prompt_tokens[b]:
            raise InvalidRoutesError(
                f"row {b}: sample {ref.sample_id!r} has a {ref.prompt_len}-token prompt but "
                f"the row's prompt holds {prompt_tokens[b]} tokens: the ref is not this row's"
            )
    table = fetch_checked(refs, fetch)
    routes = to_torch(table, attention_mask=mask, input_ids=input_ids)
    # verl's batch holds plain tensors; the layout rides in meta_info, which verl hands to
    # every micro-batch (`DataProto.to_tensordict`), for the replaying engine to check.
    batch[key] = routes.as_subclass(torch.Tensor).to(batch["input_ids"].device)
    data.meta_info[LAYOUT_KEY] = routes.layout.to_json()
    return data


def model_input_routes(
    micro_batch: Any,
    *,
    sp_size: int = 1,
    static_pad: int = 0,
    fetch: Fetch | None = None,
    key: str = ROUTES_KEY,
    refs_key: str = REFS_KEY,
) -> torch.Tensor:
    """`[1, T_local, L, K]` routes of the packed (remove-padding) sequence this rank's model
    sees: the rows' tokens back to back, `static_pad` -1 rows (the engine's bucket pad),
    then verl's Ulysses pad to a multiple of `sp_size` and this rank's slice; a
    `RoutesTensor` of the rollout's layout (for `replay` to check).

    `micro_batch` is a verl micro-batch (TensorDict) after `left_right_2_no_padding`
    (routes a nested tensor) or still padded (its `attention_mask` picks the tokens). With
    no routes under `key` but refs under `refs_key` (`DataProto.to_tensordict` keeps
    `non_tensor_batch` as per-row data, which remove-padding and micro-batching carry),
    only this rank's tokens are read here (`fetch(refs, ranges=...)`: 1/SP of each sample
    under Ulysses), checked token by token.
    """
    cut = _model_input_cut(sp_size, static_pad)
    if key not in micro_batch:
        return _read_rank_routes(micro_batch, cut, fetch, refs_key)  # carries their layout
    routes = micro_batch[key]
    if routes.is_nested:
        packed_TLK = routes.values()
    else:
        packed_TLK = routes[micro_batch["attention_mask"].bool()]
    from verl.utils import tensordict_utils

    layout = tensordict_utils.get(micro_batch, LAYOUT_KEY)  # attach_routes: in meta_info
    if layout is not None:
        packed_TLK = with_layout(packed_TLK, RoutingLayout.from_json(layout))
    T, L, K = packed_TLK.shape
    rows_NT = cut(packed_TLK.reshape(T, L * K).T)  # verl pads and slices dim 1
    return rows_NT.T.reshape(-1, L, K).unsqueeze(0).contiguous()


def _model_input_cut(sp_size: int, static_pad: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`[N, T]` (the packed tokens along dim 1) -> this rank's `[N, T_local]`: `static_pad`
    positions (the engine's bucket pad), then verl's own Ulysses pad and slice; pads -1."""

    def cut(x_NT: torch.Tensor) -> torch.Tensor:
        if static_pad:
            x_NT = torch.cat([x_NT, x_NT.new_full((len(x_NT), static_pad), MISSING)], 1)
        if sp_size > 1:
            from verl.utils.ulysses import slice_input_tensor, ulysses_pad

            x_NT, _, _ = ulysses_pad(x_NT, sp_size=sp_size, pad_value=MISSING)
            x_NT = slice_input_tensor(x_NT, dim=1, padding=False)
        return x_NT

    return cut


def _read_rank_routes(
    micro_batch: Any,
    cut: Callable[[torch.Tensor], torch.Tensor],
    fetch: Fetch | None,
    refs_key: str,
) -> torch.Tensor:
    """`[1, T_local, L, K]`: the routes of the tokens this rank's model sees, read by the
    micro-batch's refs as those tokens' ranges only (1/SP of each sample with Ulysses)."""
    if refs_key not in micro_batch:
        raise InvalidRoutesError(
            f"the micro-batch has neither routes ({ROUTES_KEY!r}) nor refs ({refs_key!r}): "
            "put the rollout's refs in DataProto.non_tensor_batch, or call attach_routes"
        )
    refs = list(micro_batch[refs_key])
    ids = micro_batch["input_ids"]
    if ids.is_nested:
        tokens, lengths = ids.values(), ids.offsets().diff().tolist()
    else:
        mask = micro_batch["attention_mask"].bool()
        tokens, lengths = ids[mask], mask.sum(1).tolist()
    check_row_tokens(refs, lengths)
    shard = TokenShard.packed(lengths).map(cut)
    return read_shard(refs, shard, cut(tokens.cpu().unsqueeze(0)), fetch).to(tokens.device)


def replaying_engine(
    base: type,
    *,
    fetch: Fetch | None = None,
    layout: RoutingLayout | None = None,
    replay_tolerance: float | None = None,
) -> type:
    """A subclass of verl's FSDP engine class `base` (e.g. `FSDPEngineWithLMHead`) whose
    micro-batch forwards replay the micro-batch's routes: `routed_experts` (see
    `attach_routes`), or read by the refs the batch carries (`fetch`, default
    `routing_replay.ray.fetch_batch`). Replay checks the routes' layout against the model:
    the batch carries it (`attach_routes`, or the read); `layout` (the rollout model's) is
    for routes put in the batch some other way. `replay_tolerance` (None: exact; r in
    (0, 1]: a recorded expert the trainer scores below r x its weakest own top-k expert is
    replaced by its own) goes to every `replay`. `forward_backward_batch` returns the
    batch's replay metrics in its `metrics` dict (see the module's docstring)."""
    from routing_replay import replay

    tolerance = check_tolerance(replay_tolerance)

    class ReplayingEngine(base):
        _replay_block: Any = None
        _replay_step: StepMetrics | None = None
        _routing_replay = True  # marks the class (register_replaying_engine)
        replay_tolerance = tolerance

        def forward_backward_batch(self, data: Any, loss_function: Any, forward_only=False):
            self._replay_step = step = StepMetrics()
            try:
                output = super().forward_backward_batch(data, loss_function, forward_only)
            finally:
                self._close_replay()  # the last micro-batch's backward has run
                self._replay_step = None
            replayed = step.pop()  # one host sync per micro-batch, after all of them
            metrics = output.get("metrics") if isinstance(output, dict) else None
            if replayed is not None and isinstance(metrics, dict):
                for key in REPLAY_KEYS:  # one item: verl all-gathers and flattens lists
                    metrics[key] = [replayed[key]]
            return output

        def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool):
            self._close_replay()  # the previous micro-batch's backward ran in between
            ids = micro_batch["input_ids"]
            packed = (
                ids.values().numel() if ids.is_nested else int(micro_batch["attention_mask"].sum())
            )
            sp = self.ulysses_sequence_parallel_size if self.use_ulysses_sp else 1
            pad = self._get_packed_pad_size(packed)
            routes = model_input_routes(micro_batch, sp_size=sp, static_pad=pad, fetch=fetch)
            block = replay(self.module, routes, layout=layout, tolerance=tolerance)
            block.__enter__()
            self._replay_block = block
            if self._replay_step is not None:
                self._replay_step.add(block)
            try:
                return super().forward_step(micro_batch, loss_function, forward_only)
            except BaseException:
                self._close_replay()
                raise

        def _close_replay(self) -> None:
            block, self._replay_block = self._replay_block, None
            if block is not None:
                block.__exit__(None, None, None)

    ReplayingEngine.__name__ = ReplayingEngine.__qualname__ = f"Replaying{base.__name__}"
    return ReplayingEngine


def register_replaying_engine(
    *,
    device: str = "cuda",
    vendor: str = "nvidia",
    fetch: Fetch | None = None,
    layout: RoutingLayout | None = None,
    replay_tolerance: float | None = None,
) -> type:
    """Make verl build the replaying FSDP engine for language models in this process.

    Registers `replaying_engine(FSDPEngineWithLMHead)` in verl's `EngineRegistry` under
    `(device, vendor)`, which verl looks up before the plain device entry its own engine
    holds. Run it in every trainer worker process before verl builds its engines (e.g.
    Ray's `runtime_env={"worker_process_setup_hook": ...}`). `replay_tolerance`: see
    `replaying_engine`. Idempotent (with the same tolerance); returns the class.
    """
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    registry = EngineRegistry._engines.setdefault("language_model", {})
    found = [registry.get(b, {}).get((device, vendor)) for b in ("fsdp", "fsdp2")]
    if all(getattr(c, "_routing_replay", False) for c in found):
        tolerance = check_tolerance(replay_tolerance)
        if any(c.replay_tolerance != tolerance for c in found):
            raise RuntimeError(
                f"verl's replaying engine for {(device, vendor)} is registered with "
                f"replay_tolerance={found[0].replay_tolerance}, not {tolerance}: register it "
                "once per process, with the tolerance the run uses"
            )
        return found[0]
    if any(c is not None for c in found):
        raise RuntimeError(
            f"verl already has an engine registered for {(device, vendor)}: {found}; "
            "routing replay's would shadow it"
        )
    engine = replaying_engine(
        FSDPEngineWithLMHead, fetch=fetch, layout=layout, replay_tolerance=replay_tolerance
    )
    EngineRegistry.register(
        model_type="language_model", backend=["fsdp", "fsdp2"], device=device, vendor=vendor
    )(engine)
    return engine


def refs_array(refs: list[RoutingRef]) -> np.ndarray:
    """The refs as the numpy object array `DataProto.non_tensor_batch` holds."""
    out = np.empty(len(refs), dtype=object)
    out[:] = refs
    return out
