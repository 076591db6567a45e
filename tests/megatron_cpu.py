"""Megatron-core on CPU for the tests: the adjustments, a config, MoE layers, an EP rank.

`run` is one rank of a two-rank expert-parallel MoE layer (spawned by a test): each rank
builds the same three `MoELayer`s (allgather dispatcher, `SequentialMLP`: rank r holds
experts [4r, 4r + 4)), feeds its own routes through `MegatronRouterFeed`, and reports which
rows each of its experts received, and what they should have been: the rows of both
ranks' inputs whose forced ids name that expert, in the dispatcher's order.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

WORLD, B, S, H, E, K = 2, 3, 5, 16, 8, 2


def cpu_gating(self, input: torch.Tensor) -> torch.Tensor:
    """`TopKRouter.gating`, minus Megatron's move of the weights to CUDA."""
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.router_gating_linear(input, self.weight, self.bias, torch.float32)


def config(**overrides: Any) -> Any:
    """The `TransformerConfig` of the tests: 4 layers, top-2 of 8 experts, hidden 16, replay."""
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    return TransformerConfig(**{**kw, **overrides})


def allgather_moe_layers(**overrides: Any) -> tuple[Any, torch.nn.ModuleList]:
    """Config and three real `MoELayer`s (allgather dispatcher, `SequentialMLP` experts)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.spec_utils import ModuleSpec

    cfg = config(
        ffn_hidden_size=32,
        moe_token_dispatcher_type="allgather",
        add_bias_linear=False,
        moe_grouped_gemm=False,
        **overrides,
    )
    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    spec = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=mlp))
    pg = ProcessGroupCollection.use_mpu_process_groups()
    layers = torch.nn.ModuleList(
        MoELayer(cfg, submodules=spec, layer_number=i + 1, pg_collection=pg) for i in range(3)
    )
    return cfg, layers


def routes_of(rank: int) -> torch.Tensor:
    """Rank `rank`'s `[B, S, L=3, K]` routes: distinct ids per row."""
    g = torch.Generator().manual_seed(100 + rank)
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(B * S * 3)]
    return torch.stack(rows).view(B, S, 3, K)


def run(rank: int, init: str, results) -> None:
    """Forward and backward one MoE layer under replay on this rank; put what was seen."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    from routing_replay import RoutingLayout
    from routing_replay.integrations.megatron import MegatronRouterFeed

    # CPU: no Transformer Engine, no CUDA (Megatron's all-gather allocates on the current
    # CUDA device; this process has none).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    TopKRouter.gating = cpu_gating
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=init, world_size=WORLD, rank=rank)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=WORLD)
    cfg, layers = allgather_moe_layers(expert_model_parallel_size=WORLD)
    layout = RoutingLayout(num_layers=4, top_k=K, num_experts=E, moe_layers=(0, 2, 3))
    feed = MegatronRouterFeed(layout, cfg, model=layers)
    feed.set(routes_of(rank))
    received: dict[int, torch.Tensor] = {}
    for e, expert in enumerate(layers[1].experts.local_experts):
        expert.register_forward_hook(
            lambda m, args, out, e=e: received.__setitem__(e, args[0].detach().clone())
        )
    torch.manual_seed(1000 + rank)
    x = torch.randn(S, B, H, requires_grad=True)
    out, _ = layers[1](x)  # global layer 2: routes column 1
    out.sum().backward()
    # Expected: all ranks' tokens (rank order, seq-major within a rank) sent to each expert.
    x_all = [torch.empty(S * B, H) for _ in range(WORLD)]
    dist.all_gather(x_all, x.detach().reshape(S * B, H))
    # Token (s, b) of x [S, B, H] carries routes[b, s]; layer 2 is routes column 1.
    ids_all = torch.cat(
        [routes_of(r)[:, :, 1].transpose(0, 1).reshape(S * B, K) for r in range(WORLD)]
    )
    rows_all = torch.cat(x_all)
    expected = {
        e: rows_all[(ids_all == g).any(dim=1)] for e, g in enumerate(layers[1].local_expert_indices)
    }
    results.put(
        {
            "rank": rank,
            "experts": list(layers[1].local_expert_indices),
            "rows_match": {
                e: bool(torch.equal(received.get(e, torch.empty(0, H)), expected[e]))
                for e in expected
            },
            "counts": {e: len(expected[e]) for e in expected},
            "router_grad": float(layers[1].router.weight.grad.abs().sum()),
            "x_grad": x.grad is not None,
        }
    )
    feed.close()
    dist.destroy_process_group()
