"""Adapters from inference engines and trainer frameworks to routing_replay.

Each submodule imports its engine or framework lazily (vLLM, SGLang, Megatron-core, verl;
`routing_replay.integrations.trl` subclasses TRL's trainer, so it imports TRL), so importing
`integrations` or `routing_replay` never pulls one in:

- `sglang`: SGLang's `meta_info["routed_experts"]` payloads -> store puts.
- `vllm`: vLLM `RequestOutput` / `CompletionOutput` / HTTP payloads -> store
  puts, and a rollout worker hosting a real `vllm.LLM`.
- `vllm_server`: an async rollout server (vLLM's `AsyncLLM` in a Ray actor)
  for multi-turn agentic episodes, with weight updates and policy versions.
- `vllm_middleware`: `vllm serve --middleware ...RoutesToRefs` (routes into
  the node store named by `$RR_STORE_NAME`, refs in the HTTP body).
- `nemo_rl`: routes attached to NeMo-RL-style batches (padding, packing,
  context- and sequence-parallel slicing).
- `trl`: `RoutingReplayGRPOTrainer`, TRL's GRPOTrainer with routing replay.
- `verl`: verl `DataProto` refs, alignment through verl's padding and
  micro-batching and Ulysses SP, and a replaying FSDP engine.
- `megatron`: the feed to Megatron-core's `RouterReplay`.
"""
