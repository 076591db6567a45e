"""Capture: record the top-k expert ids of every MoE layer while a transformers model runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from routing_replay.adapters import MoeModel, find_routers
from routing_replay.layout import MISSING, RoutingLayout


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
        self._had_generate = "generate" in vars(model)

    # -- context --------------------------------------------------------------------

    def __enter__(self) -> Capture:
        decoder = self.moe.decoder
        self._handles.append(decoder.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(self._end))
        for j, router in enumerate(self.moe.routers):
            self._handles.append(router.module.register_forward_hook(self._recorder(j)))
        if callable(getattr(self.model, "generate", None)):
            self.model.generate = self._wrap_generate(self.model.generate)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if "generate" in vars(self.model) and not self._had_generate:
            del self.model.generate
        self._current = None

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

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(input_ids, Tensor):
            shape = tuple(input_ids.shape)
        else:
            input_ids = None
            embeds = kwargs.get("inputs_embeds")
            shape = tuple(embeds.shape[:-1]) if isinstance(embeds, Tensor) else None
        if shape is None or len(shape) != 2:
            self._current = None  # not a token batch we can align; routers are ignored
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        mask = kwargs.get("attention_mask")
        valid = mask[:, -shape[1] :] if isinstance(mask, Tensor) and mask.dim() == 2 else None
        self._current = _Forward(
            shape=shape,
            input_ids_BS=_to_host(input_ids),
            valid_BS=_to_host(valid),
            past=past,
            ids_L=[None] * self.layout.num_moe_layers,
        )

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
            raise RuntimeError("capture: a MoE router did not run during the forward")
        # One stack and one asynchronous device-to-host copy per forward; no per-layer sync.
        ids_NLK = torch.stack(fwd.ids_L, dim=1)
        fwd.ids_L = []
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
            config = kwargs.get("generation_config") or getattr(
                self.model, "generation_config", None
            )
            if max(kwargs.get("num_beams") or 1, getattr(config, "num_beams", 1) or 1) > 1:
                raise NotImplementedError(
                    "capture() follows one token per step per sample: beam search reorders "
                    "samples, use greedy or sampling"
                )
            group = _Group(eos=_eos_ids(kwargs.get("eos_token_id"), config))
            self._groups.append(group)
            self._generating = group
            try:
                out = generate(*args, **kwargs)
            finally:
                self._generating = None
            prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            sequences = (out if isinstance(out, Tensor) else out.sequences).detach().cpu()
            if isinstance(prompt, Tensor):
                group.prompt_cols = prompt.shape[1]
                group.sequences = sequences[:, group.prompt_cols :]
            else:  # inputs_embeds only: generate returns the new tokens alone
                group.prompt_cols = kwargs["inputs_embeds"].shape[1]
                group.sequences = sequences
            return out

        return capturing_generate

    # -- alignment ----------------------------------------------------------------------

    def _samples(self) -> list[tuple[np.ndarray | None, np.ndarray]]:
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


def capture(model: nn.Module) -> Capture:
    """Record the top-k expert ids of every MoE layer of `model` while in the `with` block."""
    return Capture(model)


def _group_samples(
    group: _Group, layout: RoutingLayout
) -> list[tuple[np.ndarray | None, np.ndarray]]:
    """Per sample: forwarded tokens without padding, then (after generate) up to the first EOS."""
    batch = group.forwards[0].shape[0]
    if any(f.shape[0] != batch for f in group.forwards):
        raise RuntimeError("capture: the batch size changed within one generate call")
    samples = []
    for b in range(batch):
        tokens, routes, prompt_tokens = _forwarded(group, b)
        if group.sequences is not None:
            tokens, routes = _with_generated(group, b, tokens, routes, prompt_tokens, layout)
        samples.append((tokens, routes))
    return samples


def _forwarded(group: _Group, b: int) -> tuple[np.ndarray | None, np.ndarray, int]:
    """Sample b's forwarded tokens and routes, padding dropped, and how many are prompt."""
    tokens, routes, prompt_tokens = [], [], 0
    for fwd in group.forwards:
        num = fwd.shape[1]
        keep = np.ones(num, bool) if fwd.valid_BS is None else fwd.valid_BS[b].numpy() != 0
        routes.append(fwd.routes_BSLK[b].numpy()[keep])
        if fwd.input_ids_BS is not None:
            tokens.append(fwd.input_ids_BS[b].numpy()[keep])
        prompt_tokens += int(keep[: max(0, group.prompt_cols - fwd.past)].sum())
    token_ids = np.concatenate(tokens) if len(tokens) == len(routes) else None
    return token_ids, np.concatenate(routes).astype(np.int32), prompt_tokens


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
        tokens = np.concatenate([tokens[:prompt_tokens], generated[:num_generated]])
    return tokens, full


def _eos_ids(explicit: Any, config: Any) -> frozenset[int]:
    eos = explicit if explicit is not None else getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    if isinstance(eos, Tensor):
        eos = eos.tolist()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _to_host(t: Tensor | None) -> Tensor | None:
    """Copy to (pinned, on CUDA) host memory without waiting for the device."""
    if t is None:
        return None
    if not t.is_cuda:
        return t.detach()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host
