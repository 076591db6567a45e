"""TRL's (and PEFT's) private APIs `RoutingReplayGRPOTrainer` relies on, checked on trl 1.16.0
and peft 0.21.2. `check_trainer` fails at import, naming what is missing, when a TRL
release renamed one, instead of a silently unreplayed training run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

CHECKED_ON = "trl 1.16.0"
# GRPOTrainer's private steps the trainer overrides: rollout, batch scoring, log-probs.
OVERRIDDEN = ("_generate", "_generate_and_score_completions", "_get_per_token_logps_and_entropies")


def check_trainer(cls: type) -> None:
    """Raise ImportError unless `cls` (TRL's GRPOTrainer) has the private steps overridden."""
    missing = [name for name in OVERRIDDEN if not callable(getattr(cls, name, None))]
    if missing:
        import trl

        raise ImportError(
            f"trl {trl.__version__}: GRPOTrainer has no {missing}; "
            f"routing_replay.integrations.trl was checked on {CHECKED_ON}: install that version"
        )


def steps_per_rollout(trainer: Any) -> int:
    """Optimizer steps between two generations: `args.steps_per_generation * num_iterations`."""
    return trainer.args.steps_per_generation * trainer.num_iterations


def computes_old_logps(args: Any) -> bool:
    """Whether TRL runs its old-logprob pass (`_generate_and_score_completions`) under these
    `GRPOConfig` args: when a generation spans optimizer steps (`gradient_accumulation_steps`
    not a multiple of `steps_per_generation * num_iterations`), or for vLLM's importance
    sampling correction."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(
        args.use_vllm and args.vllm_importance_sampling_correction
    )


def global_step(trainer: Any) -> int:
    """GRPOTrainer's micro-step counter (`_step`)."""
    return trainer._step


def generation_buffer(trainer: Any) -> tuple[int, list[dict] | None]:
    """The micro-step counter and the buffered micro-batches of the last generation
    (`_step`, `_buffered_inputs`; TRL regenerates when the buffer is None, as on resume)."""
    return trainer._step, trainer._buffered_inputs


def restore_generation_buffer(trainer: Any, step: int, inputs: list[dict]) -> None:
    """Put a saved buffer back: TRL then trains its remaining micro-batches, not new ones."""
    trainer._step, trainer._buffered_inputs = step, inputs


def colocated_generation(trainer: Any) -> Any:
    """The colocated vLLM generation object (`vllm_generation`: `.llm`, `.sync_weights`)."""
    return trainer.vllm_generation


def named_params(generation: Any) -> Any:
    """The policy's named parameters as the vLLM weight sync yields them (`_iter_named_params`)."""
    return generation._iter_named_params()


@contextlib.contextmanager
def llm_kwargs(**extra: Any) -> Iterator[None]:
    """While TRL builds its colocated `vllm.LLM` (fixed kwargs in
    `trl.generation.vllm_generation.LLM`), add `extra` to them."""
    import trl.generation.vllm_generation as generation

    build = generation.LLM
    generation.LLM = functools.partial(build, **extra)
    try:
        yield
    finally:
        generation.LLM = build


def adapters_disabled(module: Any) -> bool:
    """Whether PEFT's `disable_adapter()` is active on `module` (its tuner layers'
    `_disable_adapters`): TRL's reference pass of a PEFT model."""
    return any(getattr(m, "_disable_adapters", False) for m in module.modules())
