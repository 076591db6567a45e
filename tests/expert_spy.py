"""Where the experts are called: the ids each MoE layer's experts module receives."""

from __future__ import annotations

import torch

from routing_replay.model.adapters import find_routers


def mlp_of(model: torch.nn.Module, router: torch.nn.Module) -> torch.nn.Module:
    """The MoE block that holds `router` (its `experts` is what the spy watches)."""
    for module in model.modules():
        if any(child is router for child in module.children()) and hasattr(module, "experts"):
            return module
    raise AssertionError("no MoE block holds this router")


class ExpertSpy:
    """Expert ids each MoE layer's experts module is called with, forward and recompute,
    the router's own top-k of the same call, and the routers' gradient norms."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.on = True
        self.calls: list[tuple[int, torch.Tensor]] = []  # (layer, ids [rows, K]) forward
        self.native_topk: list[torch.Tensor] = []  # the router's own top-k, per call
        self.recomputes: list[tuple[int, torch.Tensor]] = []  # the same, during backward
        self.router_grads: list[float] = []
        self._logits: dict[int, torch.Tensor] = {}
        self.handles = []
        for j, router in enumerate(find_routers(model).routers):
            experts = mlp_of(model, router.module).experts
            self.handles.append(experts.register_forward_pre_hook(self._experts(j)))
            self.handles.append(router.module.register_forward_hook(self._router(j)))
            weight = router.module.weight
            if weight.requires_grad:  # frozen under PEFT
                self.handles.append(
                    weight.register_hook(lambda g: self.router_grads.append(float(g.norm())))
                )

    def _experts(self, j: int):
        def hook(module, args):
            if not self.on:
                return
            in_backward = torch._C._current_graph_task_id() != -1
            (self.recomputes if in_backward else self.calls).append((j, args[1].detach().clone()))
            if not in_backward:
                K = args[1].shape[-1]
                self.native_topk.append(self._logits[j].topk(K, dim=-1).indices)

        return hook

    def _router(self, j: int):
        def hook(module, args, output):
            self._logits[j] = output[0].detach()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
