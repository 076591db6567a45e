"""Every private API of a dependency that routing_replay calls, one module per dependency.

Each function names the versions it was checked on; an upgrade that breaks one breaks
here, not wherever it was needed. vLLM's and TRL's live in `routing_replay.integrations`
(`_compat_vllm`, `_compat_trl`): the core never imports them.
"""
