"""Capture: record the top-k expert ids of every MoE layer while a transformers model runs.

(Over 400 lines by design: one block's bookkeeping, from its entry through each forward
and `generate` to its exit; what it follows in generate, how forwards align into samples
and which blocks a model has open live in `generation`, `alignment` and `blocks`.)
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from routing_replay.compat.torch import break_graph, run_eagerly
from routing_replay.errors import (
    RoutingReplayError,
    UnsupportedGenerationError,
    UnsupportedModelError,
)
from routing_replay.layout import RoutingLayout
from routing_replay.model.adapters import (
    MoeModel,
    Router,
    find_routers,
    input_mask,
    input_tokens,
    is_canvas,
    rows_of,
    split_rows,
)
from routing_replay.model.alignment import Forward, Group, Sample, continues, group_samples
from routing_replay.model.blocks import ACTIVE, FULLGRAPH, Entry, Queue, dispatch, drop, recording
from routing_replay.model.forcing import forced_ids, forget_forced
from routing_replay.model.generation import followed_eos
from routing_replay.model.hf_cache import cache_lengths, is_2d_mask, past_columns
from routing_replay.model.install import prepare_model
from routing_replay.model.owner import Owner, current_owner, escaped, mark, owns, unmark
from routing_replay.model.stance import refuse_unguarded, warn_unguarded


class Capture:
    """Records the routes of every forward of `model`; `routes()` gives [T, L, K] per sample."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.moe: MoeModel = find_routers(model)
        self.layout: RoutingLayout = self.moe.layout
        self._groups: list[Group] = []
        self._current: Forward | None = None
        self._generating: Group | None = None
        self._handles: list[Any] = []
        self._actions: dict[int, Any] = {}  # per `_Dispatch` (by id): this block's action
        self._outer_ids: Tensor | None = None  # the token ids a wrapping model was called with
        self._outer_mask: Tensor | None = None  # and its 2-D attention mask, if it had one
        # Layers whose routers split their tokens by type (ERNIE 4.5 VL): this forward's rows of
        # each part (`adapters.split_rows`), and per layer the parts recorded so far.
        self._split: tuple[Tensor, Tensor] | None = None
        self._parts: dict[int, dict[int, Tensor]] = {}
        self._calls: dict[int, int] = {}  # per looped router module: its calls this forward
        # Set while the block is open: every hook and wrapper does nothing once it is not, so
        # an exit stopped after its first line leaves nothing recording.
        self._open = False
        self._owner: Owner | None = None  # the thread and context mark of the block's entry
        self._foreign = 0  # forwards of other threads or tasks seen while open (not recorded)

    # -- context --------------------------------------------------------------------

    def __enter__(self) -> Capture:
        if self._open:
            raise RoutingReplayError(
                "capture: this block is already open; enter a new capture(model) instead of "
                "the same one twice (its exit would end both)"
            )
        refuse_unguarded("capture")
        decoder = self.moe.decoder
        # Blocks of one model queue in one list by atomic appends (no lock a stop could leave
        # held): the first open block's owner has the model; another owner's block refuses.
        # Closed blocks (an exit that was stopped among them) are skipped and dropped.
        blocks = decoder.__dict__.setdefault(ACTIVE, Queue())
        try:  # whatever stops the entry (a refusal, Ctrl-C) leaves the block closed
            self._open, self._owner, self._foreign = True, mark(), 0
            blocks.append(Entry(self._owner, weakref.ref(self)))
            first = next(e for e in list(blocks) if e.is_open())
            if not owns(first.owner, current_owner()):
                raise RoutingReplayError(
                    "capture: another thread or asyncio task has a capture block active on "
                    "this model; each block's hooks would record the other's forwards, mixing "
                    "samples' routes. Capture one model from one thread or task at a time: "
                    "serialize generate calls (a Ray actor with max_concurrency=1, an "
                    "asyncio.Lock around the block), or give each its own model"
                )
            for closed in [e for e in list(blocks) if not e.is_open()]:
                drop(blocks, closed)
            self._install(decoder)
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _install(self, decoder: nn.Module) -> None:
        # Replay's router forwards, once: code compiled before them guards that the routers
        # have none, so it is compiled again, with this block's hooks (else it skips them).
        # Replay's forced calls keep their ids while the queue holds a block (`capturing`).
        prepare_model(self.moe).captures = decoder.__dict__[ACTIVE]
        if decoder is not self.model:  # e.g. a VL model: its text stack gets embeddings only
            self._handles.append(
                self.model.register_forward_pre_hook(self._outer_begin, with_kwargs=True)
            )
            self._handles.append(
                self.model.register_forward_hook(self._outer_end, always_call=True)
            )
        self._handles.append(decoder.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(self._end))
        for router, layers in self.moe.by_module():
            record = _Recorder(self, layers, router)
            if router.method == "forward":
                self._handles.append(router.module.register_forward_hook(record))
            else:  # a block's method that routes (DBRX)
                self._act(router.module, router.method, recording(router.module, record))
        if callable(getattr(self.model, "generate", None)):
            self._act(self.model, "generate", self._generate)
            if callable(getattr(self.model, "prepare_inputs_for_generation", None)):
                self._act(self.model, "prepare_inputs_for_generation", self._prepare)

    def _act(self, target: Any, name: str, action: Any) -> None:
        """Run `action(method, *args, **kwargs)` for `target.name` while the block is open."""
        self._actions[id(dispatch(target, name, self.moe.decoder))] = action

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._open = False  # first: nothing records from here on, whatever stops the rest
            self._close()
        finally:  # (stopped in the try, this runs in full; else it finds nothing left)
            self._close()
        warn_unguarded("capture")
        if self._foreign:
            warnings.warn(
                f"capture: {self._foreign} forward(s) of other threads or asyncio tasks ran on "
                "the model while the block was open and were not recorded (a block records "
                "its own thread, and the tasks started inside it). Run them inside the block, "
                "in its thread (generate with a streamer: enter the block in the generating "
                "thread)",
                RuntimeWarning,
                stacklevel=2,
            )

    def _close(self) -> None:
        """Remove the block's hooks, its place in the model's queue and its actions."""
        self._open = False
        unmark(self._owner)  # (in the context that entered it; elsewhere nothing to take off)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        blocks = self.moe.decoder.__dict__.get(ACTIVE, [])
        for mine in [e for e in list(blocks) if e.capture() is self]:
            drop(blocks, mine)
        forget_forced(self.moe, self._owner)
        self._actions.clear()
        self._current = None

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle: of the model, whose hooks hold the block) is closed."""
        state = self.__dict__.copy()
        state.update(_open=False, _handles=[], _actions={}, _current=None, _generating=None)
        return state

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
        if not self._ours():
            return
        ids = input_tokens(args, kwargs)
        self._outer_ids = ids if isinstance(ids, Tensor) and ids.dim() == 2 else None
        mask = input_mask(kwargs)  # the stack may get it as a dict of 4-D masks only
        self._outer_mask = mask if is_2d_mask(mask) else None

    def _outer_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._ours():  # (also when the forward failed before its stack ran)
            self._outer_ids = self._outer_mask = None

    def _ours(self) -> bool:
        """Whether the running forward is this open block's (its thread and task)."""
        if not self._open:  # (first: a closed block, e.g. a copy's, never breaks a graph)
            return False
        if torch.compiler.is_compiling():  # the bookkeeping runs eagerly, between graphs
            break_graph(FULLGRAPH)
        return owns(self._owner, run_eagerly(current_owner))

    def _refuse_escaped(self) -> None:
        if escaped(self._owner, current_owner()):
            raise RoutingReplayError(
                "capture: a forward started inside the block ran in another thread "
                "(asyncio.to_thread, an executor given the block's context); its routes would "
                "interleave with the block's own. Call the model in the block's thread (await "
                "it in a task: asyncio tasks started inside the block are recorded), or enter "
                "the block in that thread"
            )

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._ours():  # another thread's or task's forward: not this block's
            if self._open:
                self._refuse_escaped()
                self._foreign += 1
            return
        input_ids = input_tokens(args, kwargs)
        outer, self._outer_ids = self._outer_ids, None
        outer_mask, self._outer_mask = self._outer_mask, None
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
        self._parts = {}
        self._calls = {}
        kwarg = self.moe.row_kwarg
        self._split = split_rows(kwargs.get(kwarg)) if kwarg is not None else None
        mask = input_mask(kwargs)
        if not is_2d_mask(mask) and outer_mask is not None and outer_mask.shape == shape:
            mask = outer_mask  # the wrapping model's 2-D mask of the same tokens
        group = self._generating
        if group is not None:  # this forward's 2-D mask, before a compilable cache made it 4-D
            if not is_2d_mask(mask):
                mask = group.mask
            group.mask = None
        mask = mask if is_2d_mask(mask) else None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        width = shape[1]
        # generate's 2-D mask always spans the whole sequence, so its width alone is the answer
        past = past_columns(mask, cache, width, whole=group is not None)
        if past is None:  # only a device tensor knows: counted in generate, else read once
            past = self._counted_past(cache)
        self._current = Forward(
            shape=shape,
            input_ids_BS=_to_host(input_ids, copy=True),  # callers may reuse their buffers
            valid_BS=_to_host(mask[:, -width:] if mask is not None else None, copy=True),
            past=past,
            ids_L=[None] * self.layout.num_moe_layers,
            canvas=is_canvas(kwargs),
            cache_key=None if cache is None else id(cache),
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
        lengths = [t for t in cache_lengths(cache) if isinstance(t, Tensor)]
        device = lengths[0].device
        return int(torch.stack([t.reshape(()).to(device) for t in lengths]).max())  # the read

    def _end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._ours():
            return
        fwd, self._current = self._current, None
        if fwd is None:
            return
        if fwd.cache_key is None:  # a cache the forward made: the one its decode loop passes
            made = getattr(output, "past_key_values", None)
            fwd.cache_key = None if made is None else id(made)
        self._parts = {}
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

    def _group_for(self, fwd: Forward) -> Group:
        group = self._generating
        if group is not None:
            first = group.forwards[0] if group.forwards else None
            keys = (None,) if first is None else (first.cache_key, fwd.cache_key)
            if None not in keys and keys[0] != keys[1]:  # (a logits processor calling it)
                raise UnsupportedGenerationError(
                    "capture: generate ran a forward of the model on a cache other than its "
                    "own (a logits processor or stopping criterion calling the model); its "
                    "routes cannot be told from the generation's: generate without it while "
                    "capturing"
                )
            if fwd.past == 0:  # prefill, or generate(use_cache=False) recomputing everything
                group.forwards.clear()
            return group
        # A hand-written decode loop over a cache continues the samples whose last forward
        # ended where it starts, in that cache (loops over several caches may be stepped in
        # turn); anything else is a new sample: a plain forward, one over positions already
        # forwarded, or a diffusion decoder's canvas (each denoising step its own).
        if fwd.past > 0 and not fwd.canvas:
            for group in reversed(self._groups):
                if not group.forwards:  # (one a forward was stopped before it filled)
                    continue
                last = group.forwards[-1]
                if continues(last, fwd):
                    return group
                if fwd.cache_key is None:  # no cache to tell loops apart: the last only
                    break
        self._groups.append(Group())
        return self._groups[-1]

    def _generate(self, generate: Any, *args: Any, **kwargs: Any) -> Any:
        """`model.generate` while the block is open: one group of samples per call."""
        if not self._ours():  # another thread's or task's call
            return generate(*args, **kwargs)
        group = Group(eos=followed_eos(self.model, kwargs))
        try:  # a call that fails or is stopped anywhere in here leaves no samples behind
            self._groups.append(group)
            self._generating = group
            out = generate(*args, **kwargs)
            self._generating = group.mask = None
            if not self._open:  # closed meanwhile (from another thread): its last steps unseen
                self._groups[:] = [g for g in self._groups if g is not group]
                warnings.warn(
                    "capture: the block was closed while generate ran, so the steps after it "
                    "were not recorded; that generate's samples were dropped, not kept with "
                    "rows of -1. Exit the block after generate returns",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return out
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
        except BaseException:  # (in one line: a second stop finds both done or neither)
            self._generating = group.mask = None; self._groups[:] = [g for g in self._groups if g is not group]  # fmt: skip  # noqa: E501, E702
            raise

    def _prepare(self, prepare: Any, *args: Any, **kwargs: Any) -> Any:
        """`prepare_inputs_for_generation`: keeps the 2-D mask generate holds."""
        group = self._generating
        if group is not None and self._ours():
            mask = kwargs.get("attention_mask")
            group.mask = mask if is_2d_mask(mask) else None
        return prepare(*args, **kwargs)

    # -- alignment ----------------------------------------------------------------------

    def _samples(self) -> list[Sample]:
        out = []
        for group in self._groups:
            if not group.forwards:
                continue
            for fwd in group.forwards:
                if fwd.done is not None:
                    fwd.done.synchronize()  # the only wait: once per forward, at read time
                    fwd.done = None
            out.extend(group_samples(group, self.layout))
        return out


def capture(model: nn.Module) -> Capture:
    """Record the top-k expert ids of every MoE layer of `model` while in the `with` block."""
    return Capture(model)


class _Recorder:
    """A router's forward hook (or routing method's action) of one block: its output's ids
    into the block's current forward. An object holding the block, not a closure, so that a
    copy of the model gets a copy of the (closed) block, never the original."""

    def __init__(self, capture: Capture, layers: tuple[int, ...], router: Router) -> None:
        self.capture, self.layers, self.router = capture, layers, router

    def __call__(self, module: nn.Module, args: tuple, output: tuple) -> None:
        cap, layers, router = self.capture, self.layers, self.router
        read, split = router.output, router.rows
        if cap._current is None or not cap._ours():  # outside its forward
            return
        j = layers[0]
        if len(layers) > 1:  # a looped layer's router: its k-th call is pass k
            calls = cap._calls.get(id(module), 0)
            cap._calls[id(module)] = calls + 1
            if calls >= len(layers):
                raise UnsupportedModelError(
                    f"capture: router {router.name!r} of a looped layer ran more than its "
                    f"{len(layers)} passes in one forward"
                )
            j = layers[calls]
        ids = forced_ids(module, router.method)
        if ids is None:
            ids = read.ids(module, output)
        if split is None:
            cap._current.ids_L[j] = ids
            return
        # One router of a layer that splits its tokens: its rows, merged once all ran.
        rows_of(split, cap._split)  # raises where this part has no rows
        if cap._split is None:
            cap._current.ids_L[j] = ids
            return
        parts = cap._parts.setdefault(j, {})
        parts[split.part] = ids
        if len(parts) == len(cap._split):
            rows = cap._split[0].numel() + cap._split[1].numel()
            merged = ids.new_empty((rows, ids.shape[1]))
            for part, part_ids in parts.items():
                merged.index_copy_(0, cap._split[part].to(ids.device), part_ids)
            cap._current.ids_L[j] = merged


def _to_host(t: Tensor | None, copy: bool = False) -> Tensor | None:
    """Copy to (pinned, on CUDA) host memory without waiting for the device."""
    if t is None:
        return None
    if not t.is_cuda:
        return t.detach().clone() if copy else t.detach()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host
