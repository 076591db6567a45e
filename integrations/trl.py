"""TRL's `GRPOTrainer` with routing replay: change `GRPOTrainer(` to `RoutingReplayGRPOTrainer(`.

What the subclass does, in TRL's own steps (trl 1.16):

- **Rollout** (`_generate`): transformers generation runs under `capture` (or, with
  `use_vllm=True, vllm_mode="colocate"`, vLLM returns the routed experts: the trainer
  asks TRL's `vllm.LLM` for them and keeps each request's output); each sample's routes
  (prompt + completion, exactly the tokens TRL trains) go into a `RoutingStore` with
  their token ids, and its `RoutingRef` rides in TRL's inputs dict under
  `routing_refs`, so TRL's own shuffle and split of the generation batch carry it with
  its row.
- **Old-logprob pass** (during generation, when TRL computes `old_per_token_logps`): the
  policy forwards under `replay`, chunk by chunk as TRL chunks. The reference model, and
  the PEFT pass with the adapter disabled (or the `ref` adapter), route natively.
- **Loss** (`compute_loss`, inside `training_step`): each micro-batch's routes are read
  from the store, aligned with TRL's layout (prompt left padded, completion right padded:
  the tokens are one run in the middle), checked token by token (`TokenMismatchError`),
  and the forward *and* backward run inside one `replay` block, so a gradient-checkpoint
  recompute replays too. Positions TRL masks (padding, and completions it masks with
  `mask_truncated_completions`) route natively.
- **Release**: a generation's refs are released right after the last micro-step that uses
  them (`steps_per_generation x num_iterations` steps), and evaluation refs right after
  their loss: the store is empty between optimizer steps and nothing grows across steps.
- **Checkpoints**: a checkpoint saved while a generation still has micro-batches to train
  (`steps_per_generation` or `num_iterations` > 1) keeps them and their routes
  (`routing_replay_buffer-<process>.pt`, `routing_replay_routes-<process>.arrow`); on
  `train(resume_from_checkpoint=...)` they are loaded back and trained, where TRL alone
  would drop them and generate again.

**R2** (`routing_mode="R2"`, for engines that return no routes): generation runs as TRL
runs it, without capture. The generation's old-logprob pass (the policy, chunk by chunk)
runs natively under `capture`, and those routes go into the same store with their token
ids, as a rollout's would; from there on it is the R3 path (refs in `routing_refs`, read,
checked against the rows' tokens, replayed in every loss micro-batch and checkpoint
recompute of the generation; the reference model native). TRL runs that pass only when a
generation is trained over more than one optimizer step (`gradient_accumulation_steps` not
a multiple of `steps_per_generation * num_iterations`) or for vLLM's importance sampling;
R2 is refused otherwise (every micro-batch is on-policy: nothing to record or replay). As
generation's routes are not needed, R2 takes any generation TRL offers (server mode,
`rollout_func`, tools), but only transformers generation is tested.

The store defaults to one this trainer owns (per process: TRL's processes each generate
and train their own rows), sized at the first rollout and grown while empty; pass
`routing_store=` to use another one (e.g. `node_store(...)` on a Ray node). Not covered:
TRL's vLLM server mode and colocated tensor parallelism, `use_transformers_continuous_batching`,
tools and `rollout_func` (each raises `UnsupportedModelError` saying so), and vision inputs.

The trainer's parts live in one module per concept, re-exported here (import from this
module): `_trl_rollout` (the store, rollouts and R2's recorded pass), `_trl_checkpoints`
(the generation buffer a checkpoint keeps) and `_trl_rows` (TRL's batch layout).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from trl import GRPOTrainer

from routing_replay import RoutingLayout, RoutingRef, RoutingStore, capture, replay
from routing_replay.errors import InvalidArgumentError, InvalidRoutesError, UnsupportedModelError
from routing_replay.integrations import _compat_trl
from routing_replay.integrations._trl_checkpoints import (
    BUFFER_FILE,
    ROUTES_FILE,
    CheckpointMixin,
    _SaveBuffer,
)
from routing_replay.integrations._trl_rollout import (
    RolloutMixin,
    _check_r2_config,
    _vllm_returning_routes,
)
from routing_replay.integrations._trl_rows import REFS_KEY, trl_routes
from routing_replay.integrations.replay_metrics import KEYS as REPLAY_KEYS
from routing_replay.integrations.replay_metrics import StepMetrics
from routing_replay.integrations.vllm import check_family
from routing_replay.model.agreement import routing_agreement
from routing_replay.model.replay import prepare_replay
from routing_replay.validate import check_tolerance

__all__ = [
    "BUFFER_FILE",
    "MODES",
    "REFS_KEY",
    "ROUTES_FILE",
    "RoutingReplayGRPOTrainer",
    "trl_routes",
]

MODES = ("R3", "R2")  # engine routes replayed; routes of the trainer's old-logprob pass replayed
_MM_KEYS = (  # vision inputs of _get_per_token_logps_and_entropies: not replayed here
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


_compat_trl.check_trainer(GRPOTrainer)  # a TRL that renamed a step fails here, by name


class RoutingReplayGRPOTrainer(RolloutMixin, CheckpointMixin, GRPOTrainer):
    """`trl.GRPOTrainer` whose policy forwards replay the experts its rollouts used.

    Same arguments as `GRPOTrainer`, plus `routing_mode` ("R3", default: replay the rollout
    engine's routes; "R2": record them in TRL's old-logprob pass and replay those, for
    engines that return none), `routing_store` (a `RoutingStore` to put routes
    in; default: one this trainer creates, owns and sizes) and `store_capacity_tokens`
    (the size of that default store; default: twice the first rollout's tokens, grown
    while empty). `replay_tolerance` (None: replay exactly; a ratio r in (0, 1]: a recorded
    expert the trainer scores below r x its weakest own top-k expert is replaced by its own)
    goes to every `replay` the trainer makes.

    Logged per step, in TRL's metrics: `replay/rows_replayed`, `replay/rows_missing` (the
    step's loss micro-batches' (token, MoE layer) rows, summed), `replay/native_agreement`
    and `replay/replace_rate` (weighted by rows replayed; `Replay.metrics()`, read once per
    micro-batch after the step's backward); `routing/store_samples` (the store's occupancy
    during the loss) and, with `log_agreement=True` (two more no-grad forwards per
    micro-batch), `routing/agreement_native` and `routing/agreement_replayed`: the fraction
    of (token, layer) top-k sets equal to the rollout's, natively and under replay.
    Evaluation logs the `replay/` metrics of each batch (as `eval_replay/...`).
    """

    def __init__(
        self,
        *args: Any,
        routing_store: RoutingStore | None = None,
        store_capacity_tokens: int | None = None,
        log_agreement: bool = False,
        routing_mode: str = "R3",
        replay_tolerance: float | None = None,
        **kwargs: Any,
    ) -> None:
        replay_tolerance = check_tolerance(replay_tolerance)  # before TRL builds anything
        if routing_mode not in MODES:
            raise InvalidArgumentError(
                f"routing_mode={routing_mode!r}: use 'R3' (replay the routes the rollout engine "
                "returned) or 'R2' (replay those of the trainer's own old-logprob pass)"
            )
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if routing_mode == "R2":  # before TRL builds anything (a colocated vLLM engine)
            _check_r2_config(config)
        asks_engine = routing_mode == "R3"  # R2 needs no routes from vLLM
        with _vllm_returning_routes(config) if asks_engine else contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        self.routing_mode = routing_mode
        self.log_agreement = log_agreement
        self.replay_tolerance = replay_tolerance
        self._replay_step = StepMetrics()  # the optimizer step's loss blocks
        self._vllm_outputs: list | None = None
        if self.use_vllm:
            self._keep_vllm_outputs()
        policy = prepare_replay(self._policy(self.model))  # refuses a model it cannot replay
        if self.use_vllm and routing_mode == "R3":
            check_family(policy.config)  # vLLM's routes of some families lose choices
        self.routing_layout = RoutingLayout.from_hf_config(policy.config)
        self._store = routing_store
        self._own_store = routing_store is None
        self._capacity = store_capacity_tokens
        self._rollout_refs: list[RoutingRef] | None = None  # of the generation in flight
        self._train_refs: list[RoutingRef] = []  # the buffered generation's
        self._eval_refs: list[RoutingRef] = []
        self._step_blocks: contextlib.ExitStack | None = None  # open during training_step
        self._replaying = False
        self._recording = False  # R2: the generation's old-logprob pass is still to come
        self._run = f"trl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.add_callback(_SaveBuffer(self))

    # -- forwards that replay -----------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's pass; during generation the policy's old-logprob pass replays, per chunk
        (R2: it routes natively and its routes are recorded and put)."""
        refs = self._rollout_refs
        if (
            self._replaying
            or not self._is_policy_pass(model)
            or (refs is None and not self._recording)
        ):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs
            )
        if args or any(kwargs.get(k) is not None for k in _MM_KEYS):
            raise UnsupportedModelError("RoutingReplayGRPOTrainer does not replay vision inputs")
        if self._recording:
            with capture(self._policy(model)) as cap:
                out = super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs
                )
            self._recording = False
            self._rollout_refs = self._put_recorded(cap, input_ids, attention_mask, logits_to_keep)
            return out
        chunk = batch_size or input_ids.size(0)
        parts = []
        for start in range(0, input_ids.size(0), chunk):
            rows = slice(start, start + chunk)
            routes = self._routes_for(
                refs[rows], input_ids[rows], attention_mask[rows], logits_to_keep
            )
            block = replay(
                self._policy(model),
                routes,
                attention_mask=attention_mask[rows],
                tolerance=self.replay_tolerance,
            )
            with self._replaying_in(block):
                parts.append(
                    super()._get_per_token_logps_and_entropies(
                        model,
                        input_ids[rows],
                        attention_mask[rows],
                        logits_to_keep,
                        chunk,
                        **kwargs,
                    )
                )
        logps = torch.cat([p[0] for p in parts])
        entropies = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
        aux = None if parts[0][2] is None else torch.stack([p[2] for p in parts]).mean()
        return logps, entropies, aux

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """TRL's loss with the micro-batch's routes replayed (backward too, in training_step)."""
        refs = inputs.get(REFS_KEY)
        if refs is None:
            raise InvalidRoutesError(
                f"inputs carry no {REFS_KEY!r}: they were not made by this trainer's rollout"
            )
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        routes = self._routes_for(list(refs), input_ids, mask, inputs["completion_ids"].size(1))
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["routing/store_samples"].append(float(self._store.stats().samples))
        if self.log_agreement:
            native, replayed = self._agreement(model, input_ids, mask, routes)
            metrics["routing/agreement_native"].append(native)
            metrics["routing/agreement_replayed"].append(replayed)
        block = replay(
            self._policy(model), routes, attention_mask=mask, tolerance=self.replay_tolerance
        )
        if self._step_blocks is not None:  # training: the block closes after backward
            self._step_blocks.enter_context(self._replaying_in(block))
            self._replay_step.add(block)  # read once the optimizer step's backward has run
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self._replaying_in(block):  # evaluation: no backward
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._log_replay(metrics, block.metrics())
        return out

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """TRL's step with forward and backward inside the micro-batch's replay block."""
        with contextlib.ExitStack() as blocks:
            self._step_blocks = blocks
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._step_blocks = None
        step = _compat_trl.global_step(self)  # TRL's training_step counted this micro-step
        accumulation = getattr(
            self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps
        )
        if step % accumulation == 0:  # the optimizer step's last micro-batch, as TRL counts
            self._log_replay(self._metrics["train"], self._replay_step.pop())
        if step % _compat_trl.steps_per_rollout(self) == 0:
            self._release(self._train_refs)  # that was the generation's last micro-step
        return loss

    @staticmethod
    def _log_replay(metrics: dict[str, list[float]], replayed: dict[str, float] | None) -> None:
        """Append the `replay/` metrics to TRL's per-mode lists (averaged when TRL logs)."""
        if replayed is not None:
            for key in REPLAY_KEYS:
                metrics[key].append(float(replayed[key]))

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's evaluation step; its rollout's refs are released after it."""
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self._release(self._eval_refs)

    def _routes_for(
        self,
        refs: list[RoutingRef],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_width: int,
    ) -> torch.Tensor:
        if self._store is None:
            raise InvalidRoutesError("no rollout was put yet: the store is empty")
        batch = self._store.read(refs)
        return trl_routes(batch, refs, input_ids.cpu(), attention_mask.cpu(), completion_width)

    def _agreement(
        self, model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, routes: torch.Tensor
    ) -> tuple[float, float]:
        """Router agreement with the rollout: the policy's own routing, and under replay."""
        policy = self._policy(model)
        keep = mask.bool().cpu()
        recorded = [routes[b][keep[b]].numpy() for b in range(len(routes))]

        def routed() -> list[np.ndarray]:
            with capture(policy) as cap, torch.no_grad():
                policy(input_ids=input_ids, attention_mask=mask, logits_to_keep=1)
            return cap.routes()

        native = routed()
        with replay(policy, routes, attention_mask=mask, tolerance=self.replay_tolerance):
            replayed = routed()
        return (
            routing_agreement(recorded, native).router_agreement,
            routing_agreement(recorded, replayed).router_agreement,
        )

    @contextlib.contextmanager
    def _replaying_in(self, block: contextlib.AbstractContextManager) -> Iterator[None]:
        with block:
            self._replaying = True
            try:
                yield
            finally:
                self._replaying = False

    def _policy(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model)

    def _is_policy_pass(self, model: nn.Module) -> bool:
        """The policy with its own weights: not the reference model, nor PEFT's ref pass."""
        if model is self.ref_model or self._policy(model) is not self._policy(self.model):
            return False
        policy = self._policy(model)
        if getattr(policy, "active_adapter", None) == "ref":  # TRL's use_adapter(model, "ref")
            return False
        return not _compat_trl.adapters_disabled(policy)  # PEFT's disable_adapter()
