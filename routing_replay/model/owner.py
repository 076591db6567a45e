"""Who runs a forward: a thread, and the asyncio task it runs if any.

A `capture` or `replay` block belongs to the thread and task that entered it: forwards of
any other (a thread without a block, a coroutine interleaved on the same event loop) are
not the block's, whatever the model's hooks see. A block entered outside any task (plain
code that then calls `asyncio.run`) owns every task its thread runs inside it.
"""

from __future__ import annotations

import sys
import threading

Owner = tuple[int, int | None]


def current_owner() -> Owner:
    """This thread's id, and the id of the asyncio task it runs (None outside one)."""
    asyncio = sys.modules.get("asyncio")  # (never imported: no task runs)
    try:
        task = asyncio.current_task() if asyncio is not None else None
    except RuntimeError:  # no running event loop in this thread
        task = None
    return threading.get_ident(), None if task is None else id(task)


def owns(block: Owner | None, now: Owner) -> bool:
    """Whether a block entered by `block` owns a forward run by `now`: the same thread, and
    the same task, unless the block was entered outside any (then each task of its thread)."""
    return block is not None and block[0] == now[0] and block[1] in (None, now[1])
