"""The stance that skips Dynamo's guards, which is what tells compiled code a block is open.

`torch.compiler.set_stance(..., skip_guard_eval_unsafe=True)` runs compiled code without
its guards: code compiled outside a block would run inside one (routes not recorded, not
forced). Blocks refuse it at entry and warn at exit when it was set inside them.
"""

from __future__ import annotations

import warnings

from routing_replay.compat.torch import skips_guards
from routing_replay.errors import UnsupportedModelError


def refuse_unguarded(block: str) -> None:
    """Raise if compiled code would run without Dynamo's guards (which see the blocks'
    state: whether replay is active, which routers carry its code, which hooks are on)."""
    if skips_guards():
        raise UnsupportedModelError(
            f"{block}: torch.compiler.set_stance(skip_guard_eval_unsafe=True) is in effect; "
            "compiled code would run without the guards that tell it whether a block is "
            "active (and whether the model was compiled with its routers' code and hooks), so "
            "recorded experts could be ignored or stale ones replayed. Use the default stance "
            f"inside {block} blocks"
        )


def warn_unguarded(block: str) -> None:
    """Warn at a block's exit if the stance that skips guards was set inside it: compiled
    code run under it saw no block (not recorded, or not forced)."""
    if skips_guards():
        warnings.warn(
            f"{block}: torch.compiler.set_stance(skip_guard_eval_unsafe=True) is in effect at "
            "the block's exit: compiled forwards run under it inside the block skipped the "
            "guards that see the block (routes not recorded, not forced). Set that stance "
            "outside the block only",
            RuntimeWarning,
            stacklevel=3,
        )
