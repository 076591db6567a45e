"""TRL's batch layout: the key of the refs in its inputs, and routes aligned with its rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from routing_replay import MISSING, RoutingRef, to_torch
from routing_replay.errors import InvalidRoutesError

REFS_KEY = "routing_refs"  # the key of the refs in TRL's inputs dict


def trl_routes(
    batch: Any,
    refs: Sequence[RoutingRef],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
) -> torch.Tensor:
    """Routes `[B, P + C, L, K]` for TRL's layout: prompt left padded to P, completion right
    padded to C = `completion_width`; -1 wherever `attention_mask` is 0.

    `batch` is the refs' Arrow batch (`store.read(refs)`, in the refs' order). Row b's
    routes fill `[P - prompt_len, P + num_tokens - prompt_len)`, and every token there is
    compared with the token ids the routes were put with.
    """
    B, S = input_ids.shape
    P = S - completion_width
    if len(refs) != B or tuple(attention_mask.shape) != (B, S):
        raise InvalidRoutesError(
            f"{len(refs)} refs, input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)}: one ref per row, mask shaped like the ids"
        )
    placement = torch.zeros((B, S), dtype=torch.bool)
    for b, ref in enumerate(refs):
        if ref.prompt_len is None:
            raise InvalidRoutesError(
                f"sample {ref.sample_id!r} was put without prompt_len: TRL's layout needs it"
            )
        prompt, completion = ref.prompt_len, ref.num_tokens - ref.prompt_len
        if prompt > P or completion > completion_width:
            raise InvalidRoutesError(
                f"row {b}: sample {ref.sample_id!r} has {prompt} prompt and {completion} "
                f"completion tokens, but the batch has room for {P} and {completion_width}: "
                "the refs do not belong to this batch's rows"
            )
        placement[b, P - prompt : P + completion] = True
    routes = to_torch(batch, attention_mask=placement, input_ids=input_ids)
    routes[~attention_mask.bool().cpu()] = MISSING  # TRL masks them: padding in this forward
    return routes


def _row_masks(inputs: dict[str, Any]) -> torch.Tensor:
    """Each row's prompt + completion mask, `[B, S]`."""
    return torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
