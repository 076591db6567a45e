"""What a put takes and what it returns: `PutRequest`, `RoutingRef`, and their argument checks.

A ref names one *put*, not a sample id: its `serial` is the put's number in the store
(a 64-bit counter in the segment, never reused), kept in the sample's slot under its
checksum. A sample id released and put again (same tokens, other routes: a re-rollout
after a weight update) gets a new serial, so the old ref is refused by every call that
takes refs instead of reading or releasing the new sample.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from routing_replay.errors import (
    InvalidArgumentError,
    SampleNotFoundError,
    SampleReplacedError,
    StoreUnavailableError,
)
from routing_replay.store.format import (
    FORBIDDEN_ID_CHARS,
    MAX_SAMPLE_ID_BYTES,
    MAX_WAIT_S,
    NO_DIGEST,
    NO_PAGE,
    NO_SERIAL,
)
from routing_replay.store.samples import SampleIndex
from routing_replay.store.tables import uid_on_node

Part = Literal["all", "prompt", "completion"]
PARTS = ("all", "prompt", "completion")


@dataclass(frozen=True)
class RoutingRef:
    """Small, picklable handle to one stored sample: what travels through the driver.

    `serial` names the put (a sample id released and put again gets another; 0: not
    checked, for refs made by hand). `store_uid` names the store's incarnation: a ref is
    never read from another store created later under the same name (0: not checked).
    `tokens_digest` is the digest of the token ids the routes were put with (0: put
    without them); trainers check their tokens against the stored ids. `policy_versions`
    says which policy version produced which tokens: `(first token, version)` per span,
    in token order (one span for a one-turn sample; an episode may span versions); empty
    when put without a version.
    """

    sample_id: str
    store: str
    node_id: str
    num_tokens: int
    prompt_len: int | None = None
    store_uid: int = 0
    tokens_digest: int = NO_DIGEST
    policy_versions: tuple[tuple[int, int], ...] = ()
    serial: int = NO_SERIAL

    @property
    def policy_version(self) -> int | None:
        """The oldest policy version among the sample's tokens (None: put without one)."""
        return min(v for _, v in self.policy_versions) if self.policy_versions else None


class PutRequest(NamedTuple):
    """One sample for `RoutingStore.put_many`: the arguments of `RoutingStore.put`."""

    sample_id: str
    routes: Any
    prompt_len: int | None = None
    token_ids: Any = None
    policy_version: int | Sequence[tuple[int, int]] | None = None


_ID_SAFE = frozenset(FORBIDDEN_ID_CHARS)  # (the set is of the forbidden ones)


def sample_id_bytes(sample_id: Any) -> bytes:
    """The UTF-8 id of a sample id or ref, checked."""
    if isinstance(sample_id, RoutingRef):
        sample_id = sample_id.sample_id
    if not isinstance(sample_id, str) or not sample_id:
        raise InvalidArgumentError(f"sample_id must be a non-empty str, got {sample_id!r}")
    try:
        raw = sample_id.encode()
    except UnicodeEncodeError:  # a lone surrogate: not UTF-8
        raw = b""
    if (
        not raw
        or len(raw) > MAX_SAMPLE_ID_BYTES
        or not sample_id.isprintable()
        or not _ID_SAFE.isdisjoint(sample_id)
    ):
        raise InvalidArgumentError(
            f"sample_id {sample_id!r} must be printable, at most {MAX_SAMPLE_ID_BYTES} bytes "
            f"of UTF-8, and free of {FORBIDDEN_ID_CHARS!r} (ids name samples, never paths): "
            "use e.g. 'step12-prompt3-sample5'"
        )
    return raw


def whole_number(x: Any) -> bool:
    """Whether `x` is an int >= 0 (numpy's too; not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) and x >= 0


MAX_POLICY_VERSION = 2**63 - 1  # route archives store versions as int64


def policy_spans(value: Any, num_tokens: int, sample_id: str) -> tuple[tuple[int, int], ...]:
    """`put`'s policy_version as `(first token, version)` spans: an int is one span from 0;
    a sequence of pairs must start at token 0, rise strictly and stay inside the sample.
    A version is at most `MAX_POLICY_VERSION` (2**63 - 1)."""
    if value is None:
        return ()
    if isinstance(value, numbers.Integral):
        pairs = [(0, value)]
    else:
        try:
            pairs = list(value)
        except TypeError:  # a float, a str of one char...: refused below
            pairs = []
    if not pairs or not all(
        isinstance(p, (tuple, list))
        and len(p) == 2
        and whole_number(p[0])
        and whole_number(p[1])
        and p[1] <= MAX_POLICY_VERSION
        for p in pairs
    ):
        raise InvalidArgumentError(
            f"policy_version for sample {sample_id!r} must be an int >= 0 or a sequence of "
            f"(first token, version) pairs of ints >= 0, versions at most 2**63 - 1 (route "
            f"archives store them as int64), got {value!r}"
        )
    spans = tuple((int(start), int(version)) for start, version in pairs)
    starts = [start for start, _ in spans]
    rising = all(b > a for a, b in itertools.pairwise(starts))
    if starts[0] != 0 or not rising or starts[-1] >= num_tokens:
        raise InvalidArgumentError(
            f"policy_version spans {list(spans)} of sample {sample_id!r} must start at token 0 "
            f"and rise strictly below its {num_tokens} tokens"
        )
    return spans


def prompt_len_value(value: Any, num_tokens: int, sample_id: str) -> int:
    """prompt_len as stored: -1 for None, else an int in [0, num_tokens]."""
    if value is None:
        return -1
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(
            f"prompt_len must be an int (the number of prompt tokens) or None, got {value!r} "
            f"({type(value).__name__}) for sample {sample_id!r}"
        )
    if not 0 <= int(value) <= num_tokens:
        raise InvalidArgumentError(
            f"prompt_len={value} is outside [0, {num_tokens}] for sample {sample_id!r}"
        )
    return int(value)


def check_part(part: Any) -> Part:
    """`part` of get/read, checked."""
    if part not in PARTS:
        raise InvalidArgumentError(f"part must be one of {PARTS}, got {part!r}")
    return part


def as_list(sample_ids: Iterable[str | RoutingRef] | str | RoutingRef) -> list[Any]:
    """One id or ref, or many, as a list."""
    if isinstance(sample_ids, (str, RoutingRef)):
        return [sample_ids]
    try:
        return list(sample_ids)
    except TypeError:
        raise InvalidArgumentError(
            f"sample ids must be an id or ref, or an iterable of them, got {sample_ids!r}"
        ) from None


def timeout_seconds(value: Any, what: str = "timeout") -> float:
    """A wait in seconds, checked: a number >= 0; `inf` (or anything longer than
    MAX_WAIT_S) waits MAX_WAIT_S, which is without end in practice."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or math.isnan(value)
        or value < 0
    ):
        raise InvalidArgumentError(
            f"{what} must be a number of seconds >= 0 (inf: no limit), got {value!r}"
        )
    return min(float(value), MAX_WAIT_S)


def check_distinct(raw_ids: list[bytes], action: str) -> None:
    """Raise if an operation names one sample twice."""
    if len(set(raw_ids)) != len(raw_ids):
        seen: set[bytes] = set()
        twice = next(r for r in raw_ids if r in seen or seen.add(r))
        raise InvalidArgumentError(
            f"{action} names sample {twice.decode()!r} more than once: each sample once per call"
        )


def check_store(refs: list[Any], name: str, store_uid: int, node_id: str) -> None:
    """Raise unless every ref belongs to the store `name` of incarnation `store_uid` on
    node `node_id`."""
    for r in refs:
        if not isinstance(r, RoutingRef):
            continue
        if r.store != name or r.node_id != node_id:
            raise SampleNotFoundError(
                f"ref {r.sample_id!r} belongs to store {r.store!r} on node {r.node_id!r}, "
                f"not to {name!r} on node {node_id!r}: read it from that store, on its node"
            )
        if r.store_uid and r.store_uid != store_uid:
            if uid_on_node(name) == r.store_uid:
                raise StoreUnavailableError(
                    f"this handle of store {name!r} is stale: the store was removed and "
                    f"created again after it attached, and ref {r.sample_id!r} is in the new "
                    f"one; close this handle and attach again (RoutingStore.attach({name!r}))"
                )
            raise StoreUnavailableError(
                f"ref {r.sample_id!r} was put in an earlier store named {name!r}, which was "
                "removed and created again since: its routes are gone; re-run the rollout"
            )


def resolve(
    samples: SampleIndex, store: str, refs: list[Any], raw_ids: list[bytes], action: str
) -> list[int]:
    """The slot of each id or ref (under the lock). Raises, changing nothing, if one is not
    stored, or if a ref names a put whose id was released and put again since."""
    slots, missing = [], []
    for ref, raw_id in zip(refs, raw_ids, strict=True):
        slot = samples.find(raw_id)
        if slot == NO_PAGE:
            missing.append(raw_id.decode())
        elif isinstance(ref, RoutingRef) and ref.serial != NO_SERIAL:
            now = samples.serial(slot)
            if now != ref.serial:
                raise SampleReplacedError(
                    f"cannot {action} {ref.sample_id!r} through this ref: it names put "
                    f"#{ref.serial} of that id, which was released; the id was put again "
                    f"since (put #{now}: another rollout's routes). Nothing was changed. A "
                    "ref must not be used after its release; give every rollout sample a "
                    "unique id (e.g. with the step and a retry count)"
                )
        slots.append(slot)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise SampleNotFoundError(
            f"cannot {action} {shown}{more}: not in store {store!r} (never put, already "
            "released, or put on another node's store); nothing was changed"
        )
    return slots


def ranges_per_ref(ranges: Any, count: int) -> list | None:
    """A read's `ranges=` as a list of one entry per ref (any iterable: a generator too)."""
    if ranges is None:
        return None
    try:
        ranges = list(ranges)
    except TypeError:
        raise InvalidArgumentError(
            f"ranges must hold one entry per ref, got {type(ranges).__name__}"
        ) from None
    if len(ranges) != count:
        raise InvalidArgumentError(f"ranges has {len(ranges)} entries for {count} refs: one each")
    return ranges


def token_ranges(value: Any, length: int, sample_id: str) -> list[tuple[int, int]]:
    """One sample's `ranges=` entry as `(start, stop)` pairs over its `length` positions: a
    pair, or a sequence of pairs (context parallel gives a rank two chunks), rising and
    apart; `(s, s)` is an empty range."""

    def pair(x: Any) -> bool:
        return isinstance(x, (tuple, list)) and len(x) == 2 and all(whole_number(v) for v in x)

    pairs = [value] if pair(value) else list(value) if isinstance(value, (tuple, list)) else []
    if not pairs or not all(pair(p) for p in pairs):
        raise InvalidArgumentError(
            f"ranges for sample {sample_id!r} must be a (start, stop) pair of ints >= 0 or a "
            f"list of such pairs, got {value!r}"
        )
    out = [(int(a), int(b)) for a, b in pairs]
    ends = [0, *[x for a, b in out for x in (a, b)]]
    if any(b < a for a, b in itertools.pairwise(ends)) or out[-1][1] > length:
        raise InvalidArgumentError(
            f"ranges {out} of sample {sample_id!r} must rise, not overlap, and stay within its "
            f"{length} tokens (start <= stop, each range after the one before)"
        )
    return out
