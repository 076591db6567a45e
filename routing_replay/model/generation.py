"""What `capture` can follow inside `generate`: one token per step per sample.

Beam search, classifier-free guidance and assisted decoding reorder samples or forward the
model on drafts and caches of their own: refused before generate starts, with why.
Settings are looked up the way generate does (its kwargs, then its config, then the model's).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from routing_replay.errors import UnsupportedGenerationError

# generate settings that turn on assisted (speculative) decoding: refused while capturing
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def followed_eos(model: nn.Module, kwargs: dict) -> frozenset[int]:
    """The eos ids of a `generate(**kwargs)` capture can follow; raises if it cannot."""
    settings = _generation_setting(model, kwargs)
    if (settings("num_beams") or 1) > 1:
        raise UnsupportedGenerationError(
            "capture() follows one token per step per sample: beam search reorders "
            "samples, use greedy or sampling"
        )
    guidance = settings("guidance_scale")
    if guidance is not None and guidance != 1:
        raise UnsupportedGenerationError(
            "capture() follows one token per step per sample: classifier-free guidance "
            f"(guidance_scale={guidance}) runs extra forwards of the model inside generate, "
            "on a cache of their own; generate without it while capturing"
        )
    assisted = [n for n in _ASSISTED if settings(n) is not None]
    if assisted:
        raise UnsupportedGenerationError(
            f"capture() follows one token per step per sample: assisted decoding "
            f"({', '.join(assisted)}) forwards drafts it then rejects, so routes cannot "
            "be aligned with the output; generate without it while capturing"
        )
    return _eos_ids(settings("eos_token_id"))


def _generation_setting(model: nn.Module, kwargs: dict) -> Any:
    """Look up a generate setting the way generate does: kwargs, then its config, then model's."""

    def setting(name: str) -> Any:
        if name in kwargs:  # an explicit None (eos_token_id=None) disables it
            return kwargs[name]
        for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
            value = getattr(config, name, None)
            if value is not None:
                return value
        return None

    return setting


def _eos_ids(eos: Any) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, Tensor):
        eos = eos.tolist()
    return frozenset([eos] if isinstance(eos, int) else eos)
