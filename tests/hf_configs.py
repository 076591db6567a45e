"""Tiny transformers configs and models of MoE families, for layout tests.

`tiny(name, **fields)` builds the config class `transformers.<name>` with small sizes (hidden
64, 4 heads, vocab 256, experts 8, top-2) applied to the fields that class has, then `fields`.
`routers(model, class_name)` lists `(layer index, module name)` of a model's router modules.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import transformers
from tiny_families import SIZES

# tiny_families' sizes, with one expert group (the layout tests build grouped routers too).
SMALL: dict[str, Any] = {**SIZES, "n_group": 1, "topk_group": 1, "mamba_num_heads": 8}


def tiny(name: str, **fields: Any) -> Any:
    """A small `transformers.<name>` config: SMALL where the class has the field, then fields."""
    cls = getattr(transformers, name)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in SMALL.items() if k in known}, **fields})


def build(model_class: str, config: Any) -> torch.nn.Module:
    """`transformers.<model_class>(config)` with fixed initial weights."""
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config)


_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")


def routers(model: torch.nn.Module, class_name: str) -> list[tuple[int, str]]:
    """(layer index, module name) of every `class_name` module, in module order."""
    return [
        (int(_LAYER.search(name).group(1)), name)
        for name, module in model.named_modules()
        if type(module).__name__ == class_name
    ]
