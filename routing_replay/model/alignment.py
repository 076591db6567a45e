"""Alignment: turn the forwards recorded over one batch into one [T, L, K] route array per sample.

Padding columns are dropped. After `generate`, columns below the padded prompt width are prompt
tokens and the rest generated ones; each sample is cut at its first EOS, and rows for tokens
that were never forwarded (the last generated token) are -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from routing_replay.errors import CaptureAlignmentError
from routing_replay.layout import MISSING, RoutingLayout

Sample = tuple[np.ndarray | None, np.ndarray]  # (token ids or None, routes [T, L, K])


@dataclass
class Forward:
    """One forward of the decoder: its tokens, which of them are real, and their routes."""

    shape: tuple[int, int]  # (batch, tokens in this forward)
    input_ids_BS: Tensor | None  # host copy; None when called with inputs_embeds
    valid_BS: Tensor | None  # host copy of the attention-mask columns of these tokens
    past: int  # tokens already in the cache: this forward's first column position
    ids_L: list[Tensor | None]  # per MoE layer, the router's ids [B*S, K], on the device
    routes_BSLK: Tensor | None = None  # host copy, filled at the end of the forward
    canvas: bool = False  # a diffusion decoder's canvas: a sample of its own, never continued
    cache_key: int | None = None  # id() of the cache it was given: only that cache continues
    done: Any = None  # CUDA event recorded after the asynchronous copies


@dataclass
class Group:
    """Forwards over one batch of samples: a plain forward, or one `generate` call."""

    forwards: list[Forward] = field(default_factory=list)
    sequences: Tensor | None = None  # generate's new tokens, [B, new]
    prompt_cols: int = 0  # padded prompt width: positions below it are prompt tokens
    eos: frozenset[int] = frozenset()
    mask: Tensor | None = None  # the 2-D mask generate's last prepare step was given


def group_samples(group: Group, layout: RoutingLayout) -> list[Sample]:
    """Per sample: forwarded tokens without padding, then (after generate) up to the first EOS."""
    forwards = group.forwards
    batch = forwards[0].shape[0]
    if any(f.shape[0] != batch for f in forwards):
        raise CaptureAlignmentError("capture: the batch size changed within one generate call")
    # The whole group at once: [B, columns, L, K] and [B, columns], one slice per sample.
    routes_BTLK = torch.cat([f.routes_BSLK for f in forwards], dim=1).numpy()
    valid_BT = torch.cat([valid_mask(f) for f in forwards], dim=1).numpy()
    has_ids = all(f.input_ids_BS is not None for f in forwards)
    ids_BT = torch.cat([f.input_ids_BS for f in forwards], dim=1).numpy() if has_ids else None
    position_T = np.concatenate([f.past + np.arange(f.shape[1]) for f in forwards])
    prompt_T = position_T < group.prompt_cols
    samples = []
    for b in range(batch):
        keep = valid_BT[b]
        routes = routes_BTLK[b][keep].astype(np.int32)
        tokens = ids_BT[b][keep] if ids_BT is not None else None
        if group.sequences is not None:
            prompt_tokens = int((keep & prompt_T).sum())
            tokens, routes = with_generated(group, b, tokens, routes, prompt_tokens, layout)
        samples.append((tokens, routes))
    return samples


def valid_mask(fwd: Forward) -> Tensor:
    """Which of the forward's [B, S] tokens are real (not padding); all of them without a mask."""
    if fwd.valid_BS is None:
        return torch.ones(fwd.shape, dtype=torch.bool)
    return fwd.valid_BS != 0


def with_generated(
    group: Group,
    b: int,
    tokens: np.ndarray | None,
    routes: np.ndarray,
    prompt_tokens: int,
    layout: RoutingLayout,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Cut at the first EOS of the generated part; rows never forwarded become -1."""
    generated = group.sequences[b].numpy()
    ends = np.flatnonzero(np.isin(generated, list(group.eos))) if group.eos else []
    num_generated = int(ends[0]) + 1 if len(ends) else len(generated)
    total = prompt_tokens + num_generated
    full = np.full((total, layout.num_moe_layers, layout.top_k), MISSING, dtype=np.int32)
    rows = min(total, len(routes))
    full[:rows] = routes[:rows]
    if tokens is not None:
        fed = tokens[prompt_tokens:]  # generated tokens that were fed back as inputs
        if not np.array_equal(fed[: len(generated)], generated[: len(fed)]):
            raise CaptureAlignmentError(
                "capture: the tokens forwarded during generate do not match its output; "
                "routes cannot be aligned (was the batch reordered, e.g. by beam search?)"
            )
        tokens = np.concatenate([tokens[:prompt_tokens], generated[:num_generated]])
    return tokens, full


def continues(last: Forward, fwd: Forward) -> bool:
    """Whether `fwd` takes up where `last` ended, in the same cache, with the same batch."""
    return (
        last.cache_key == fwd.cache_key
        and fwd.past == last.past + last.shape[1]
        and last.shape[0] == fwd.shape[0]
        and not last.canvas
    )
