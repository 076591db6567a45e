"""Old import paths kept for one release: each name resolves to its new home with a warning."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forwarder(old: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `old` that serves `homes[name]` ("new.module:new_name")."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module, _, new_name = home.partition(":")
        warnings.warn(
            f"{old}.{name} moved to {module}.{new_name}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), new_name)

    return __getattr__
