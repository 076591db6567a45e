"""One rank of two-rank FSDP2 training steps under replay (spawned by tests/test_replay_fsdp.py).

Per case, each rank trains its own data shard: MICRO micro-batches of gradient accumulation,
each one `with replay(model, routes): loss = ...; (loss / MICRO).backward()`, on a tiny
transformers MoE model (float32) with activation checkpointing, `fully_shard` on each
decoder layer and then on the root. The rank returns its losses, the ids each MoE layer's
experts module was called with (forward and checkpoint recompute) and, on rank 0, the full
gradients; the test compares them with an unsharded model in the parent process. All cases
run in one pair of processes (one process group), so the imports are paid once.
"""

from __future__ import annotations

import datetime
import functools
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist

WORLD = 2  # data-parallel ranks
MICRO = 2  # micro-batches per rank (gradient accumulation)
B, S = 2, 16  # one micro-batch
MISSING_FRACTION = 0.25  # (token, MoE layer) rows without routes: they route natively
WRAPPED = "_checkpoint_wrapped_module."  # the name torch's checkpoint_wrapper inserts


def micro_batch(rank: int, mb: int, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch `mb`: input ids [B, S] and routes [B, S, L, K].

    Routes differ from native routing: distinct random top-k ids per (token, MoE layer) from
    a seeded generator, MISSING_FRACTION of the rows -1 (those route natively).
    """
    seed = 100 + rank * MICRO + mb
    input_ids = torch.randint(3, 97, (B, S), generator=torch.Generator().manual_seed(seed))
    rng = np.random.default_rng(seed)
    n, layers, k = B * S, layout.num_moe_layers, layout.top_k
    ids = np.argsort(rng.random((n, layers, layout.num_experts)), axis=-1)[..., :k]
    ids = ids.astype(np.int32)
    ids[rng.random((n, layers)) < MISSING_FRACTION] = -1
    return input_ids, torch.from_numpy(ids.reshape(B, S, layers, k))


def moe_blocks(model) -> list[torch.nn.Module]:
    """The MoE block (router + experts) of each MoE layer, in layer order."""
    from routing_replay.model.adapters import find_routers

    return [model.get_submodule(r.name.rsplit(".", 1)[0]) for r in find_routers(model).routers]


def run(rank: int, init: str, cases: dict[str, dict], results) -> None:
    """Run every case on this rank, in order; put {"rank", "cases": {name: result}}.

    A case: family (tests/moe_models.py); ckpt ("transformers": the model's
    activation_checkpointing_enable, "torch": apply_activation_checkpointing with
    checkpoint_wrapper); ckpt_kwargs (torch.utils.checkpoint's: use_reentrant, ...);
    backward ("inside" the replay block, the supported pattern, or "outside": after the block
    exits, when the checkpoint recompute routes natively). A case that fails stops the rank
    (the other rank's collectives would no longer match); its result is {"error": traceback}.
    Tensors travel as numpy arrays (by value: torch's shared-memory handles die with this
    process).
    """
    done: dict[str, dict] = {}
    try:
        torch.set_num_threads(1)  # two ranks on two cores; the reference runs single-threaded
        warnings.filterwarnings("ignore", message=".*use_cache=True.*")
        dist.init_process_group(
            "gloo",
            init_method=init,
            world_size=WORLD,
            rank=rank,
            timeout=datetime.timedelta(seconds=60),  # a failed rank must not hang the other
        )
        for name, case in cases.items():
            try:
                done[name] = _run_case(rank, case)
            except BaseException:
                done[name] = {"error": traceback.format_exc()}
                raise
    finally:
        results.put({"rank": rank, "cases": done})
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_case(rank: int, case: dict) -> dict:
    from moe_models import tiny_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from routing_replay import RoutingLayout, replay

    model = tiny_model(case["family"]).train()  # the same seeded init on every rank
    layout = RoutingLayout.from_hf_config(model.config)
    _enable_checkpointing(model, case["ckpt"], case.get("ckpt_kwargs", {}))
    # The usual FSDP2 pattern: each decoder layer (inside its checkpoint wrapper, for torch's
    # checkpointing), then the root (embeddings, final norm, head).
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())

    # The ids each MoE layer's experts module receives, call by call: per micro-batch the
    # forward, then the recompute in backward.
    calls: list[list[np.ndarray]] = [[] for _ in range(layout.num_moe_layers)]
    for j, block in enumerate(moe_blocks(model)):
        block.experts.register_forward_pre_hook(
            lambda m, args, j=j: calls[j].append(args[1].detach().numpy().copy())
        )

    losses, caught, checkpoint_error = [], [], None
    for mb in range(MICRO):
        input_ids, routes = micro_batch(rank, mb, layout)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RuntimeWarning)
            with replay(model, routes, layout=layout):
                loss = model(input_ids=input_ids, labels=input_ids).loss
                if case["backward"] == "inside":
                    (loss / MICRO).backward()
        caught += [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        losses.append(loss.detach().numpy())
        if case["backward"] == "outside":
            try:
                (loss / MICRO).backward()
            except torch.utils.checkpoint.CheckpointError as err:
                # Every rank stops here alike (the recompute saves other tensors there).
                checkpoint_error = str(err)
                break
    grads = {}
    if checkpoint_error is None:
        for name, param in model.named_parameters():
            if param.grad is not None:
                full = param.grad.full_tensor()  # a collective: every rank calls it
                if rank == 0:
                    grads[name.replace(WRAPPED, "")] = full.numpy()
    return {
        "rank": rank,
        "losses": losses,
        "calls": calls,
        "warnings": caught,
        "grads": grads,
        "checkpoint_error": checkpoint_error,
    }


def _enable_checkpointing(model, ckpt: str, kwargs: dict) -> None:
    if ckpt == "transformers":
        model.activation_checkpointing_enable({"use_reentrant": False, **kwargs})
        return
    assert ckpt == "torch", ckpt
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = functools.partial(
        checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs
    )
    layers = set(model.model.layers)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: m in layers
    )
