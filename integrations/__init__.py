"""Adapters from inference engines and trainer frameworks to routing_replay.

Each submodule imports its engine or framework lazily (vLLM, SGLang, Megatron-core), so
importing `integrations` or `routing_replay` never pulls one in:

- `integrations.sglang`: SGLang's `meta_info["routed_experts"]` payloads -> store puts.
- `integrations.vllm`: vLLM `RequestOutput` / `CompletionOutput` / HTTP payloads -> store
  puts, and a rollout worker hosting a real `vllm.LLM`.
- `integrations.nemo_rl`: routes attached to NeMo-RL-style batches (padding, packing,
  context- and sequence-parallel slicing).
- `integrations.megatron`: the feed to Megatron-core's `RouterReplay`.
"""
