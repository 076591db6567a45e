"""The routing layout: which layers route, how many experts, and how ids are stored.

How a transformers config gives those numbers is `hf_config`'s.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from routing_replay.errors import InvalidArgumentError, InvalidRoutesError
from routing_replay.hf_config import layout_fields
from routing_replay.validate import MISSING, host_array, not_integer, out_of_range, repeated

# MISSING (-1) marks "no routing recorded here" in every signed view of routes (put input,
# get output, torch tensors, replay input). In storage it becomes `layout.missing`.
CHECK_CHUNK_BYTES = 1 << 22  # ids range-checked at a time: a chunk stays in the L3 cache


@functools.cache
def _dtype_max(dtype: np.dtype) -> int:
    return int(np.iinfo(dtype).max)


@dataclass(frozen=True)
class RoutingLayout:
    """Shape of one token's routing: MoE layers (global indices) x top-k expert ids."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...] | None = None
    _moe: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise InvalidArgumentError(
                    f"RoutingLayout.{name} must be a positive int, got {value!r}"
                )
            object.__setattr__(self, name, int(value))  # numpy ints: JSON and equality as int
        if self.top_k > self.num_experts:
            raise InvalidArgumentError(
                f"RoutingLayout.top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )
        if self.num_experts > 2**16 - 1:
            raise InvalidArgumentError(
                f"num_experts={self.num_experts} does not fit 16-bit expert ids"
            )
        moe = tuple(range(self.num_layers)) if self.moe_layers is None else self.moe_layers
        moe = tuple(int(i) for i in moe)
        if not moe or list(moe) != sorted(set(moe)) or moe[0] < 0 or moe[-1] >= self.num_layers:
            raise InvalidArgumentError(
                f"moe_layers must be distinct, increasing layer indices in [0, {self.num_layers}),"
                f" got {self.moe_layers!r}"
            )
        object.__setattr__(self, "moe_layers", moe)
        object.__setattr__(self, "_moe", moe)

    # -- derived facts --------------------------------------------------------------

    @property
    def num_moe_layers(self) -> int:
        """Number of MoE layers, the L of every `[T, L, K]` routes array."""
        return len(self._moe)

    @functools.cached_property
    def dtype(self) -> np.dtype:
        """Narrowest unsigned dtype holding every expert id plus the missing marker."""
        return np.dtype(np.uint8) if self.num_experts <= 2**8 - 1 else np.dtype(np.uint16)

    @functools.cached_property
    def signed_dtype(self) -> np.dtype:
        """Dtype of routes handed back (get, to_torch): signed, -1 missing, ids unchanged.

        The stored width when every id fits as signed (int8 up to 128 experts), so the
        stored bytes are reinterpreted, not converted; one size wider otherwise.
        """
        width = self.dtype.itemsize
        if self.num_experts - 1 > np.iinfo(np.dtype(f"i{width}")).max:
            width *= 2
        return np.dtype(f"i{width}")

    @functools.cached_property
    def missing(self) -> int:
        """Stored value for a missing id: the dtype's maximum (255 for uint8)."""
        return int(np.iinfo(self.dtype).max)

    @property
    def values_per_token(self) -> int:
        """Stored ids per token: MoE layers x top-k."""
        return self.num_moe_layers * self.top_k

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes per token."""
        return self.values_per_token * self.dtype.itemsize

    # -- conversions at the edge ----------------------------------------------------

    def check(self, routes: Any) -> np.ndarray:
        """Validate `[T, L, K]` routes (MoE or all layers, -1 missing); return MoE layers only."""
        arr = self.select_moe(routes)
        self.check_ids(arr)
        return arr

    def select_moe(self, routes: Any) -> np.ndarray:
        """Check dtype and shape of `[T, L, K]` routes and drop dense layers (ids unchecked)."""
        arr = host_array(routes, "routes [num_tokens, num_layers, top_k]", InvalidRoutesError)
        if arr.dtype.kind not in "iu":
            raise not_integer(arr.dtype)
        if arr.ndim != 3 or arr.shape[2] != self.top_k:
            raise InvalidRoutesError(
                f"routes must have shape [num_tokens, num_layers, top_k={self.top_k}] with "
                f"num_layers {self.num_moe_layers} (MoE layers) or {self.num_layers} (all "
                f"layers), got {arr.shape}"
            )
        if arr.shape[1] == self.num_layers and self.num_layers != self.num_moe_layers:
            arr = arr[:, list(self._moe), :]
        elif arr.shape[1] != self.num_moe_layers:
            raise InvalidRoutesError(
                f"routes have {arr.shape[1]} layers; this layout has {self.num_moe_layers} MoE "
                f"layers {list(self._moe)} out of {self.num_layers}: pass either"
            )
        return arr

    def check_ids(self, arr: np.ndarray) -> None:
        """Raise unless every id is in [0, num_experts) or missing (-1, or the stored marker)."""
        if arr.size and not self._in_range(arr):
            if arr.dtype == self.dtype:
                bad = (arr >= self.num_experts) & (arr != self.missing)
            else:
                bad = ((arr < 0) | (arr >= self.num_experts)) & (arr != MISSING)
            if bad.any():
                token, layer, slot = (int(i) for i in np.argwhere(bad)[0])
                where = f"token {token}, MoE layer {layer}, slot {slot}"
                value = int(arr[token, layer, slot])
                raise out_of_range(value, where, self.num_experts, int(bad.sum()))

    def check_distinct(self, arr: np.ndarray) -> None:
        """Raise if a token names one expert twice among a layer's top-k ids (missing aside).

        Engines' top-k never repeats an id; a repeat means the routes were padded or cast
        wrongly (ids past the dtype wrap onto real ones), and replaying it would send one
        token to one expert twice. One contiguous pass per pair of top-k slots, after one
        transpose: 10-17x a copy of the same bytes, so the integrations run it where routes
        leave an engine, not `put` on every sample.
        """
        K = self.top_k
        if K == 1 or arr.size == 0:
            return
        missing = self.missing if arr.dtype == self.dtype else MISSING
        cols_KN = np.ascontiguousarray(arr.reshape(-1, K).T)
        bits_KN = cols_KN.view(f"u{cols_KN.itemsize}")  # xor is 0 exactly where ids match
        least_N = np.full(bits_KN.shape[1], _dtype_max(bits_KN.dtype), dtype=bits_KN.dtype)
        xor_N = np.empty_like(least_N)
        for i in range(K - 1):
            for j in range(i + 1, K):
                np.bitwise_xor(bits_KN[i], bits_KN[j], out=xor_N)
                np.minimum(least_N, xor_N, out=least_N)
        dup_N = least_N == 0
        dup_N &= cols_KN[0] != missing  # all-missing rows repeat the marker by design
        if not dup_N.any():
            return
        for n in np.flatnonzero(dup_N).tolist():  # mixed rows: look at each pair exactly
            ids = cols_KN[:, n]
            real = ids[ids != missing]
            if len(np.unique(real)) < len(real):
                token, layer = divmod(n, self.num_moe_layers)
                raise repeated(f"token {token}, MoE layer {layer}", ids.astype(np.int64), K)

    def _in_range(self, arr: np.ndarray) -> bool:
        """Fast path, chunk by chunk of the tokens (a chunk's second reduction reads it from
        cache, and only chunks holding the marker need one: an engine's last row); no
        temporaries. False means "look closer"."""
        rows = max(1, CHECK_CHUNK_BYTES // max(1, arr[0].nbytes))
        return all(self._chunk_in_range(arr[a : a + rows]) for a in range(0, len(arr), rows))

    def _chunk_in_range(self, arr: np.ndarray) -> bool:
        if arr.dtype == self.dtype:
            # Engines hand over narrow ids already (vLLM: uint8), the marker is the dtype
            # max; read as signed it is -1, like every other input.
            if self.signed_dtype.itemsize != arr.itemsize:
                return False
            if _dtype_max(self.signed_dtype) >= self.num_experts and (arr.max() < self.num_experts):
                return True  # no marker and every id an expert: one pass, not two
            arr = arr.view(self.signed_dtype)
        lo = arr.min()
        if not (lo >= MISSING or arr.dtype.kind == "u"):
            return False
        if arr.dtype.kind == "i" and _dtype_max(arr.dtype) < self.num_experts:
            return True  # every value above -1 is an expert (int8 and 128 experts): no max
        return arr.max() < self.num_experts

    def convert(self, checked: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write routes that passed `check_ids` into `out` in the stored dtype and marker."""
        if checked.dtype == self.dtype:
            np.copyto(out, checked)
        else:
            # Ids fit; -1 of any signed width wraps to all ones, which is the marker.
            np.copyto(out, checked, casting="unsafe")
        return out

    def encode(self, routes: Any) -> np.ndarray:
        """Validate routes and return them in the stored dtype (a new array)."""
        checked = self.check(routes)
        return self.convert(checked, np.empty(checked.shape, dtype=self.dtype))

    def decode(self, stored: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Stored ids as `signed_dtype` with -1 for missing: a view when the width allows."""
        signed = self.signed_dtype
        if signed.itemsize == self.dtype.itemsize:
            view = stored.view(signed)  # the all-ones marker reads as -1
            if out is None:
                return view
            np.copyto(out, view, casting="same_kind")
            return out
        if out is None:
            out = np.empty(stored.shape, dtype=signed)
        np.copyto(out, stored, casting="same_kind")
        out[stored == self.missing] = MISSING
        return out

    def random_routes(
        self, rng: np.random.Generator, num_tokens: int, dtype: Any = np.int64
    ) -> np.ndarray:
        """Random `[T, L, K]` routes shaped like an engine's: ids distinct within each
        token's top-k at a layer (for tests, benchmarks and examples)."""
        L, K, E = self.num_moe_layers, self.top_k, self.num_experts
        first = rng.integers(0, E, (num_tokens, L, 1), dtype=np.int32)
        # 0 < step * (j - i) < E for any two slots i < j: never the same id.
        step = rng.integers(1, E // K + 1, (num_tokens, L, 1), dtype=np.int32)
        return ((first + step * np.arange(K, dtype=np.int32)) % E).astype(dtype)

    # -- (de)serialisation ----------------------------------------------------------

    def to_json(self) -> str:
        """JSON text of the layout, as stored in segment headers and Arrow metadata."""
        return json.dumps(
            {
                "num_layers": self.num_layers,
                "top_k": self.top_k,
                "num_experts": self.num_experts,
                "moe_layers": list(self._moe),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> RoutingLayout:
        """Inverse of `to_json`."""
        d = json.loads(text)
        return cls(d["num_layers"], d["top_k"], d["num_experts"], tuple(d["moe_layers"]))

    @classmethod
    def from_hf_config(cls, config: Any, *, mtp: bool = False) -> RoutingLayout:
        """Layout of a transformers MoE config: the decoder layers whose routers the model builds.

        How each family's config names its layers, top-k and experts: `hf_config.layout_fields`;
        `mtp=True` appends the multi-token-prediction layers engines report.
        """
        total, top_k, experts, moe = layout_fields(config, mtp=mtp)
        return cls(total, top_k, experts, moe)
