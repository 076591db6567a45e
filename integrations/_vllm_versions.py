"""vLLM weight-version labels and spans -> the policy versions a sample is put with."""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import Any

from routing_replay import RoutingRef
from routing_replay.errors import InvalidRoutesError
from routing_replay.integrations import _compat_vllm

# What a put's policy_version is: one int, or (first token, version) spans.
PolicyVersions = int | tuple[tuple[int, int], ...] | None
_DECIMAL = re.compile(r"[0-9]+")  # ASCII only: str.isdecimal() also takes other scripts' digits


def policy_version_of(
    label: Any, versions: Mapping[str, int] | None = None, where: str = ""
) -> int:
    """Our integer policy version of a vLLM weight-version label (a str): `versions[label]`
    if given there, else a decimal string's value; anything else is refused (module doc)."""
    if versions is not None and label in versions:
        value = versions[label]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise InvalidRoutesError(
                f"{where}versions[{label!r}] is {value!r}: map weight-version labels to "
                "policy versions, ints >= 0"
            )
        return int(value)
    if isinstance(label, str) and _DECIMAL.fullmatch(label):
        return int(label)
    raise InvalidRoutesError(
        f"{where}vLLM weight version {label!r} is neither a decimal integer nor in versions="
        f"{dict(versions or {})}: label the engine's weights with the policy version as a "
        "decimal string (AsyncLLM.update_weight_version(str(v)), "
        "LLM.llm_engine.set_weight_version(str(v)), POST /update_weight_version, or "
        f"finish_weight_update(weight_version=str(v))), or pass versions={{{label!r}: v}}"
    )


def policy_versions_of(
    output: Any,
    prompt_len: int,
    num_output: int,
    *,
    policy_version: int | None = None,
    versions: Mapping[str, int] | None = None,
    where: str = "",
) -> PolicyVersions:
    """The policy version(s) to put one sample (prompt + `num_output` output tokens) with.

    `output`: a `CompletionOutput` or an HTTP choice. Its `weight_versions` spans (vLLM
    0.32) become `(first token, version)` spans over the sample, labels mapped by
    `policy_version_of`; without spans (or with vLLM's unset label `"default"` alone)
    `policy_version` applies. Spans must tile the output tokens `[0, num_output)`.
    """
    spans = _compat_vllm.weight_version_spans(output)
    if not spans:
        return policy_version
    covered = 0  # tokens tiled so far; -1 once a span is not where it must be
    for _, first, end in spans:
        ints = all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (first, end)
        )
        covered = end if ints and first == covered and end > first else -1
        if covered < 0:
            break
    if covered != num_output:
        raise InvalidRoutesError(
            f"{where}weight_versions {spans} must tile the {num_output} output tokens: "
            "(version, start, end) spans from 0, each starting where the last ended; pass the "
            "terminal output's weight_versions with its own token_ids"
        )
    labels = {label for label, _, _ in spans}
    unset = _compat_vllm.UNSET_WEIGHT_VERSION
    if labels == {unset} and unset not in (versions or {}):
        return policy_version  # the engine was never told a version
    out: list[tuple[int, int]] = []
    for label, first, _ in spans:
        version = policy_version_of(label, versions, where)
        if not out or out[-1][1] != version:
            out.append((prompt_len + first if out else 0, version))
    return tuple(out)


def join_versions(
    prefix: str | RoutingRef | None,
    start: int,
    turn: PolicyVersions,
    num_tokens: int,
    where: str = "",
) -> PolicyVersions:
    """The policy versions of a turn put with `prefix` (its stored earlier turn, see
    `fill_prefix`): the earlier turn's spans over its tokens, this turn's after them. Both
    turns must carry versions, or neither (as `routing_replay.Episode` requires)."""
    if prefix is None or start == 0:
        return turn
    earlier = tuple(getattr(prefix, "policy_versions", ()))
    if turn is None and not earlier:
        return None
    if turn is None or not earlier:
        name = getattr(prefix, "sample_id", prefix)
        which = "it has policy versions, this turn none" if earlier else "this turn has policy "
        which += "" if earlier else "versions, it none (or it was passed by sample id)"
        raise InvalidRoutesError(
            f"{where}earlier turn {name!r}: {which}; pass the earlier turn's RoutingRef as "
            "prefix, and a policy version (or weight-version labels) for every turn or for none"
        )
    spans = [(0, turn)] if isinstance(turn, numbers.Integral) else list(turn)
    ends = [first for first, _ in spans[1:]] + [num_tokens]
    before = prefix.num_tokens  # the earlier turn's tokens, its last one sampled there
    out = list(earlier)
    for (first, version), end in zip(spans, ends, strict=True):
        if end > before and out[-1][1] != version:
            out.append((max(first, before), int(version)))
    return tuple(out)
