"""transformers' internals that capture and replay read. Checked on transformers 5.0 - 5.25."""

from __future__ import annotations

import sys
from typing import Any


def keeps_no_tokens(cache: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` of `cache` holds no attention tokens, so that its
    `get_seq_length` is not the number of columns forwarded before.

    A `transformers.cache_utils.Cache` holds one layer object per decoder layer; only a
    `CacheLayerMixin` (Dynamic*, Static*, the hybrid LinearAttentionAnd*Attention layers)
    keeps keys and values. The others keep none: a linear-attention layer's recurrent state
    (`LinearAttentionLayer`: transformers <= 5.24 raises for its length, or answers the first
    attention layer's; 5.25 answers its own token counter, a device tensor, reading which is a
    device sync) and 5.25's `DummyLayer` (no length at all). False where the cache has no such
    layer list or transformers' cache module was never imported (no cache of it exists)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    mixin = getattr(cache_utils, "CacheLayerMixin", None)
    layers = getattr(cache, "layers", None)
    if mixin is None or not isinstance(layers, list) or not 0 <= layer_idx < len(layers):
        return False
    return not isinstance(layers[layer_idx], mixin)


def phimoe_multiplier(router: Any) -> Any:
    """PhiMoE's autograd function for its training-time weights (the Heun gradient estimator),
    from the module defining the router: `modeling_phimoe.PhimoeMultiplier`, 5.0 - 5.25."""
    return sys.modules[type(router).__module__].PhimoeMultiplier


def layer_checkpoint_function(layer: Any) -> Any:
    """`layer`'s own checkpoint function, or None. transformers 5 checkpoints a
    `GradientCheckpointingLayer`'s forward (not its `__call__`: its module hooks run once,
    outside) by calling the instance attribute `_gradient_checkpointing_func(function,
    *args)` that `gradient_checkpointing_enable` sets."""
    return vars(layer).get("_gradient_checkpointing_func")


def set_layer_checkpoint_function(layer: Any, function: Any) -> None:
    layer._gradient_checkpointing_func = function
