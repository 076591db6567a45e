"""Capture: record the top-k expert ids of every MoE layer while a transformers model runs."""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from routing_replay.errors import RoutingReplayError, UnsupportedModelError
from routing_replay.layout import MISSING, RoutingLayout
from routing_replay.model.adapters import MoeModel, find_routers

_Sample = tuple[np.ndarray | None, np.ndarray]  # (token ids or None, routes [T, L, K])
_ACTIVE = "_routing_replay_capture"  # on the decoder: (thread, open blocks) recording it
_ACTIVE_LOCK = threading.Lock()


@dataclass
class _Forward:
    """One forward of the decoder: its tokens, which of them are real, and their routes."""

    shape: tuple[int, int]  # (batch, tokens in this forward)
    input_ids_BS: Tensor | None  # host copy; None when called with inputs_embeds
    valid_BS: Tensor | None  # host copy of the attention-mask columns of these tokens
    past: int  # tokens already in the cache: this forward's first column position
    ids_L: list[Tensor | None]  # per MoE layer, the router's ids [B*S, K], on the device
    routes_BSLK: Tensor | None = None  # host copy, filled at the end of the forward
    done: Any = None  # CUDA event recorded after the asynchronous copies


@dataclass
class _Group:
    """Forwards over one batch of samples: a plain forward, or one `generate` call."""

    forwards: list[_Forward] = field(default_factory=list)
    sequences: Tensor | None = None  # generate's new tokens, [B, new]
    prompt_cols: int = 0  # padded prompt width: positions below it are prompt tokens
    eos: frozenset[int] = frozenset()
    mask: Tensor | None = None  # the 2-D mask generate's last prepare step was given


class Capture:
    """Records the routes of every forward of `model`; `routes()` gives [T, L, K] per sample."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.moe: MoeModel = find_routers(model)
        self.layout: RoutingLayout = self.moe.layout
        self._groups: list[_Group] = []
        self._current: _Forward | None = None
        self._generating: _Group | None = None
        self._handles: list[Any] = []
        self._own: dict[str, Any] = {}  # instance overrides of the wrapped methods, if any
        self._outer_ids: Tensor | None = None  # the token ids a wrapping model was called with

    # -- context --------------------------------------------------------------------

    def __enter__(self) -> Capture:
        decoder = self.moe.decoder
        with _ACTIVE_LOCK:  # check and mark at once: two threads may enter together
            thread, blocks = decoder.__dict__.get(_ACTIVE, (threading.get_ident(), 0))
            if thread != threading.get_ident():
                raise RoutingReplayError(
                    "capture: another thread has a capture block active on this model; each "
                    "block's hooks would record the other's forwards, mixing samples' routes. "
                    "Capture one model from one thread at a time: serialize generate calls "
                    "(a Ray actor with max_concurrency=1), or give each thread its own model"
                )
            decoder.__dict__[_ACTIVE] = (thread, blocks + 1)  # nested blocks: one thread
        try:
            self._install(decoder)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _install(self, decoder: nn.Module) -> None:
        if decoder is not self.model:  # e.g. a VL model: its text stack gets embeddings only
            self._handles.append(
                self.model.register_forward_pre_hook(self._outer_begin, with_kwargs=True)
            )
        self._handles.append(decoder.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(self._end))
        for j, router in enumerate(self.moe.routers):
            self._handles.append(router.module.register_forward_hook(self._recorder(j)))
        if callable(getattr(self.model, "generate", None)):
            self._wrap("generate", self._wrap_generate)
            if callable(getattr(self.model, "prepare_inputs_for_generation", None)):
                self._wrap("prepare_inputs_for_generation", self._wrap_prepare)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        with _ACTIVE_LOCK:
            decoder = self.moe.decoder.__dict__
            if _ACTIVE in decoder:
                thread, blocks = decoder[_ACTIVE]
                if blocks > 1:
                    decoder[_ACTIVE] = (thread, blocks - 1)
                else:
                    del decoder[_ACTIVE]
        for name, own in self._own.items():
            if own is not None:
                setattr(self.model, name, own)
            elif name in vars(self.model):
                delattr(self.model, name)
        self._own.clear()
        self._current = None

    def _wrap(self, name: str, wrapper: Any) -> None:
        self._own[name] = vars(self.model).get(name)  # an instance override, if any
        setattr(self.model, name, wrapper(getattr(self.model, name)))

    # -- results ----------------------------------------------------------------------

    def routes(self) -> list[np.ndarray]:
        """One int32 [T, L, K] array per sample, in call order; -1 rows were never forwarded."""
        return [routes for _, routes in self._samples()]

    def token_ids(self) -> list[np.ndarray | None]:
        """The token ids each `routes()` array is aligned with (None after inputs_embeds)."""
        return [tokens for tokens, _ in self._samples()]

    def clear(self) -> None:
        """Forget everything recorded so far."""
        self._groups.clear()

    # -- hooks ------------------------------------------------------------------------

    def _outer_begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._outer_ids = ids if isinstance(ids, Tensor) and ids.dim() == 2 else None

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        outer, self._outer_ids = self._outer_ids, None
        if isinstance(input_ids, Tensor):
            shape = tuple(input_ids.shape)
        else:
            input_ids = None
            embeds = kwargs.get("inputs_embeds")
            shape = tuple(embeds.shape[:-1]) if isinstance(embeds, Tensor) else None
            if outer is not None and tuple(outer.shape) == shape:
                input_ids = outer  # the tokens the wrapping model embedded (images included)
        if shape is None or len(shape) != 2:
            self._current = None  # not a token batch we can align; routers are ignored
            return
        mask = kwargs.get("attention_mask")
        group = self._generating
        if group is not None:  # this forward's 2-D mask, before a compilable cache made it 4-D
            if not _is_2d(mask):
                mask = group.mask
            group.mask = None
        mask = mask if _is_2d(mask) else None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        width = shape[1]
        # generate's 2-D mask always spans the whole sequence, so its width alone is the answer
        past = _past_columns(mask, cache, width, whole=group is not None)
        if past is None:  # only a device tensor knows: counted in generate, else read once
            past = self._counted_past(cache)
        self._current = _Forward(
            shape=shape,
            input_ids_BS=_to_host(input_ids, copy=True),  # callers may reuse their buffers
            valid_BS=_to_host(mask[:, -width:] if mask is not None else None, copy=True),
            past=past,
            ids_L=[None] * self.layout.num_moe_layers,
        )

    def _counted_past(self, cache: Any) -> int:
        """This forward's first column when the cache only knows it on the device.

        Inside generate, after its first forward: the previous forward's end (generate appends
        every forward's columns to the cache, nothing else changes it). Otherwise (the first
        forward on a StaticCache that already holds state: one passed in, or initialized early
        for chunked prefill; a hand-written loop over one without a 2-D mask of the whole
        sequence, where it may have been reset or cropped in place) its length is read: one
        read, a device sync on CUDA, for the forward, never per layer and never per decode
        step of generate.
        """
        group = self._generating
        if group is not None and group.forwards:
            last = group.forwards[-1]
            return last.past + last.shape[1]
        lengths = [t for t in _cache_lengths(cache) if isinstance(t, Tensor)]
        device = lengths[0].device
        return int(torch.stack([t.reshape(()).to(device) for t in lengths]).max())  # the read

    def _recorder(self, j: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            if self._current is not None:  # None: outside a forward (e.g. a checkpoint recompute)
                self._current.ids_L[j] = output[2]

        return hook

    def _end(self, module: nn.Module, args: tuple, output: Any) -> None:
        fwd, self._current = self._current, None
        if fwd is None:
            return
        if any(ids is None for ids in fwd.ids_L):
            names = [
                r.name for r, ids in zip(self.moe.routers, fwd.ids_L, strict=True) if ids is None
            ]
            raise UnsupportedModelError(
                f"capture: the forward finished without calling the routers {names}; a fused "
                "MoE kernel (e.g. use_kernels=True) routes on its own and cannot be captured"
            )
        # One stack and one asynchronous device-to-host copy per forward; no per-layer sync.
        ids_NLK = torch.stack(fwd.ids_L, dim=1)
        fwd.ids_L = []
        if ids_NLK.is_cuda:  # fewer bytes over PCIe; on the host, narrowing waits for routes()
            ids_NLK = ids_NLK.to(torch.int16 if self.layout.num_experts < 2**15 else torch.int32)
        fwd.routes_BSLK = _to_host(ids_NLK.reshape(*fwd.shape, *ids_NLK.shape[1:]))
        if ids_NLK.is_cuda:
            fwd.done = torch.cuda.Event()
            fwd.done.record()
        self._group_for(fwd).forwards.append(fwd)

    def _group_for(self, fwd: _Forward) -> _Group:
        group = self._generating
        if group is not None:
            if fwd.past == 0:  # prefill, or generate(use_cache=False) recomputing everything
                group.forwards.clear()
            return group
        last = self._groups[-1] if self._groups else None
        if fwd.past > 0 and last is not None and last.forwards[-1].shape[0] == fwd.shape[0]:
            return last  # a hand-written decode loop over a cache
        self._groups.append(_Group())
        return self._groups[-1]

    def _wrap_generate(self, generate: Any) -> Any:
        def capturing_generate(*args: Any, **kwargs: Any) -> Any:
            settings = _generation_setting(self.model, kwargs)
            if (settings("num_beams") or 1) > 1:
                raise NotImplementedError(
                    "capture() follows one token per step per sample: beam search reorders "
                    "samples, use greedy or sampling"
                )
            group = _Group(eos=_eos_ids(settings("eos_token_id")))
            self._groups.append(group)
            self._generating = group
            try:
                out = generate(*args, **kwargs)
            finally:
                self._generating = None
                group.mask = None
            prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            sequences = (out if isinstance(out, Tensor) else out.sequences).detach().cpu()
            embeds = kwargs.get("inputs_embeds")
            if isinstance(prompt, Tensor):
                group.prompt_cols = prompt.shape[1]
                group.sequences = sequences[:, group.prompt_cols :]
            elif isinstance(embeds, Tensor):  # generate returns the new tokens alone
                group.prompt_cols = embeds.shape[1]
                group.sequences = sequences
            elif group.forwards:  # no prompt: generate started from its own BOS column(s)
                group.prompt_cols = group.forwards[0].shape[1]
                group.sequences = sequences[:, group.prompt_cols :]
            return out

        return capturing_generate

    def _wrap_prepare(self, prepare: Any) -> Any:
        @functools.wraps(prepare)  # generate inspects its signature (e.g. for inputs_embeds)
        def capturing_prepare(*args: Any, **kwargs: Any) -> Any:
            group = self._generating
            if group is not None:  # the 2-D mask generate keeps, whatever the forward gets
                mask = kwargs.get("attention_mask")
                group.mask = mask if _is_2d(mask) else None
            return prepare(*args, **kwargs)

        return capturing_prepare

    # -- alignment ----------------------------------------------------------------------

    def _samples(self) -> list[_Sample]:
        out = []
        for group in self._groups:
            if not group.forwards:
                continue
            for fwd in group.forwards:
                if fwd.done is not None:
                    fwd.done.synchronize()  # the only wait: once per forward, at read time
                    fwd.done = None
            out.extend(_group_samples(group, self.layout))
        return out


def _is_2d(mask: Any) -> bool:
    return isinstance(mask, Tensor) and mask.dim() == 2


def _past_columns(mask: Tensor | None, cache: Any, width: int, whole: bool = False) -> int | None:
    """Columns forwarded before this one, from python ints only: never a device read.

    From the 2-D attention mask (generate's covers the whole sequence) and every cache layer
    whose length is a python int (DynamicCache, sliding-window layers, a StaticCache before
    its first update). A hybrid model's cache reports 0 for layers that keep no tokens
    (MiniMax: linear attention in layer 0), so every layer is asked. A StaticCache layer
    keeps its length in a device tensor, which is not read: None when only such a tensor
    could say the answer is not 0. `whole`: the mask is known to span the whole sequence.
    """
    past = mask.shape[1] - width if mask is not None else 0
    if whole and mask is not None:
        return past
    on_device = False
    for length in _cache_lengths(cache):
        if isinstance(length, Tensor):
            on_device = True
        else:
            past = max(past, int(length))
    return None if on_device and past == 0 else past


def _cache_lengths(cache: Any) -> list[Any]:
    """Each layer's `get_seq_length`, as the cache returns it (an int or a tensor, unread)."""
    if not hasattr(cache, "get_seq_length"):
        return []
    lengths = []
    for layer in range(max(len(cache), 1) if hasattr(cache, "__len__") else 1):
        with contextlib.suppress(ValueError, IndexError):  # a layer that tracks no length
            lengths.append(cache.get_seq_length(layer))
    return lengths


def capture(model: nn.Module) -> Capture:
    """Record the top-k expert ids of every MoE layer of `model` while in the `with` block."""
    return Capture(model)


def _group_samples(group: _Group, layout: RoutingLayout) -> list[_Sample]:
    """Per sample: forwarded tokens without padding, then (after generate) up to the first EOS."""
    forwards = group.forwards
    batch = forwards[0].shape[0]
    if any(f.shape[0] != batch for f in forwards):
        raise RuntimeError("capture: the batch size changed within one generate call")
    # The whole group at once: [B, columns, L, K] and [B, columns], one slice per sample.
    routes_BTLK = torch.cat([f.routes_BSLK for f in forwards], dim=1).numpy()
    valid_BT = torch.cat([_valid(f) for f in forwards], dim=1).numpy()
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
            tokens, routes = _with_generated(group, b, tokens, routes, prompt_tokens, layout)
        samples.append((tokens, routes))
    return samples


def _valid(fwd: _Forward) -> Tensor:
    if fwd.valid_BS is None:
        return torch.ones(fwd.shape, dtype=torch.bool)
    return fwd.valid_BS != 0


def _with_generated(
    group: _Group,
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
            raise RuntimeError(
                "capture: the tokens forwarded during generate do not match its output; "
                "routes cannot be aligned (was the batch reordered, e.g. by beam search?)"
            )
        tokens = np.concatenate([tokens[:prompt_tokens], generated[:num_generated]])
    return tokens, full


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


def _to_host(t: Tensor | None, copy: bool = False) -> Tensor | None:
    """Copy to (pinned, on CUDA) host memory without waiting for the device."""
    if t is None:
        return None
    if not t.is_cuda:
        return t.detach().clone() if copy else t.detach()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host
