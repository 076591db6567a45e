"""`RoutesTensor`: routes that carry the layout they were recorded under to the point of use.

`to_torch` returns one; `replay` compares its layout with the model's routers, so routes of
MoE layers (0, 1, 2) never replay silently onto a model whose MoE layers are (1, 2, 3). The
layout survives what trainers do to routes on the way (views, slices, `unsqueeze`, `.to()`,
`pin_memory()`, `torch.cat` of one layout, pickling); an op that mixes layouts drops it.
A tensor built by hand carries none: `with_layout(tensor, layout)` tags it, or pass
`replay(..., layout=)`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from routing_replay.errors import InvalidArgumentError, LayoutMismatchError
from routing_replay.layout import RoutingLayout

UNCHECKED = "unchecked"  # replay(..., layout=UNCHECKED): the caller vouches for the routes
_LAYOUT = "_routing_replay_layout"  # where a RoutesTensor keeps its layout (its __dict__)
_MIXED = object()


class RoutesTensor(torch.Tensor):
    """A torch tensor of routes `[..., L, K]` (-1 missing) that knows its `layout`."""

    @property
    def layout(self) -> RoutingLayout | None:
        """The layout the routes were recorded under (None: lost by mixing layouts)."""
        return self.__dict__.get(_LAYOUT)

    def __deepcopy__(self, memo: dict) -> RoutesTensor:
        copied = self.as_subclass(torch.Tensor).clone().as_subclass(RoutesTensor)
        copied.__dict__[_LAYOUT] = self.layout
        memo[id(self)] = copied
        return copied

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        layout = _layout_in((args, kwargs), None)
        return _tag(out, None if layout is _MIXED else layout)


def with_layout(routes: torch.Tensor, layout: RoutingLayout) -> RoutesTensor:
    """`routes` (no copy) as a `RoutesTensor` of `layout`."""
    if not isinstance(layout, RoutingLayout):
        raise InvalidArgumentError(f"layout must be a RoutingLayout, got {type(layout).__name__}")
    tagged = routes.as_subclass(RoutesTensor)
    tagged.__dict__[_LAYOUT] = layout
    return tagged


def routes_layout(
    routes: Any, layout: RoutingLayout | Literal["unchecked"] | None, model: RoutingLayout
) -> torch.Tensor | Any:
    """`routes` without their tag, after checking their layout against the model's.

    The layout is the one `routes` carry, or `layout` for routes that carry none; both must
    agree when both are given. `layout=UNCHECKED` skips the comparison. Raises
    `LayoutMismatchError` naming both layouts, or `InvalidArgumentError` when the routes
    carry no layout and none was given.
    """
    carried = routes.layout if isinstance(routes, RoutesTensor) else None
    if isinstance(routes, RoutesTensor):
        routes = routes.as_subclass(torch.Tensor)
    if layout is not None and layout != UNCHECKED and not isinstance(layout, RoutingLayout):
        raise InvalidArgumentError(
            f"layout must be a RoutingLayout or {UNCHECKED!r}, got {type(layout).__name__}"
        )
    if carried is not None and isinstance(layout, RoutingLayout) and layout != carried:
        raise LayoutMismatchError(
            f"the routes carry layout {carried} but layout={layout} was passed: drop the "
            "argument, or pass the routes of that layout"
        )
    recorded = carried if layout is None or layout == UNCHECKED else layout
    if recorded is None and layout != UNCHECKED:
        raise InvalidArgumentError(
            "these routes carry no layout (a tensor or array built by hand, or ops that mixed "
            "layouts): pass replay(..., layout=) the layout they were recorded under "
            "(routing_replay.schema.layout_of(batch), or RoutingLayout.from_hf_config of the "
            f"rollout model), or layout={UNCHECKED!r} to replay them unchecked"
        )
    if recorded is not None and layout != UNCHECKED and recorded != model:
        raise LayoutMismatchError(
            f"the routes were recorded under {recorded}, but the model's routers are "
            f"{model}: MoE layers, top-k or expert count differ, so replay would force "
            "another layer's (or another model's) experts. Replay them on the model they "
            "were recorded for"
        )
    return routes


def _layout_in(obj: Any, found: Any, depth: int = 0) -> Any:
    """The one layout of the RoutesTensors in an op's arguments; _MIXED if several."""
    if isinstance(obj, RoutesTensor):
        layout = obj.layout
        if found is None:
            return layout if layout is not None else _MIXED
        return found if layout == found else _MIXED
    if depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            found = _layout_in(item, found, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            found = _layout_in(item, found, depth + 1)
    return found


def _tag(out: Any, layout: RoutingLayout | None) -> Any:
    if isinstance(out, RoutesTensor):
        out.__dict__[_LAYOUT] = layout
    elif isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, RoutesTensor):
                item.__dict__[_LAYOUT] = layout
    return out
