"""torch's private APIs that replay reads. Checked on torch 2.4 - 2.13 (CPU and CUDA builds)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

# The id of the backward autograd's engine runs in this thread, -1 outside one:
# `torch._C._current_graph_task_id` (torch 2.4 - 2.13; absent: always -1). A builtin: called
# from eager code under a compiled region, it starts no Python frame for Dynamo to compile.
graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", None) or (
    functools.partial(int, -1)
)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward in this thread (a checkpoint recompute
    runs the forward inside one)."""
    return graph_task_id() != -1


def skips_guards() -> bool:
    """Whether `torch.compiler.set_stance(..., skip_guard_eval_unsafe=True)` is in effect:
    compiled code then runs without Dynamo's guards. Read from
    `torch._dynamo.eval_frame._stance` (no public getter); False if Dynamo was never imported
    (nothing is compiled) or the attribute is gone."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    stance = getattr(eval_frame, "_stance", None)
    return bool(stance is not None and getattr(stance, "skip_guard_eval_unsafe", False))


def break_graph(msg: str) -> None:
    """End the graph Dynamo is tracing here (the code after it runs eagerly), or under
    `fullgraph=True` fail with `msg`: `torch._dynamo.graph_break` (torch 2.4 - 2.13; its
    `msg` since 2.7, left out where it is not taken)."""
    import torch._dynamo

    try:
        torch._dynamo.graph_break(msg=msg)
    except TypeError:  # (before msg=)
        torch._dynamo.graph_break()


def run_eagerly(fn: Callable[[], Any]) -> Any:
    """`fn()`; while Dynamo traces, outside the trace (`torch._dynamo.disable`), so it does
    not warn about what it cannot trace (`ContextVar.get`)."""
    if not torch.compiler.is_compiling():
        return fn()
    import torch._dynamo as dynamo

    return dynamo.disable(fn)()


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module under torch's wrappers of a layer: `torch.compile`'s `OptimizedModule`
    (`_orig_mod`) and `checkpoint_wrapper`'s `CheckpointWrapper` (`_checkpoint_wrapped_module`,
    whose recompute calls that module, hooks and all), in any nesting (torch 2.4 - 2.13)."""
    for _ in range(8):
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(module, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner
    return module


def remove_hooks(module: torch.nn.Module, hooks: tuple[Any, ...]) -> None:
    """Remove `module`'s forward (pre-)hooks that are one of `hooks`, handles or not: from
    `Module._forward_pre_hooks` / `_forward_hooks` and their flag dicts (torch 2.0 - 2.13)."""
    for table, flags in (
        ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
        ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ):
        found = getattr(module, table)
        for key in [k for k, hook in found.items() if any(hook is h for h in hooks)]:
            found.pop(key, None)
            for flag in flags:
                getattr(module, flag, {}).pop(key, None)
