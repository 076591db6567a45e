"""verl batches for the tests, and the Ulysses SP ranks (spawned by test_integration_verl)."""

from __future__ import annotations

import os
import types

import numpy as np
import torch
import torch.distributed as dist

from routing_replay import MISSING, RoutingStore
from routing_replay.integrations.verl import model_input_routes, refs_array

P, R = 6, 5  # prompt and response widths of the batch
# (prompt tokens, response tokens) per row: full, short, one-token rows
ROWS = [(3, 5), (6, 2), (1, 1), (4, 4), (6, 5), (2, 3)]


def sample_token(b: int) -> int:
    """Every token of row b's sample: the token id names the sample wherever it ends up."""
    return 3 + b


def put_samples(store: RoutingStore, layout, rows=ROWS, seed: int = 0):
    """Put each row's sample (random routes, its tokens) into `store`: refs and routes."""
    routes = sample_routes(layout, rows, seed)
    refs = [
        store.put(
            f"verl-{seed}-{b}", routes[b], prompt_len=p, token_ids=[sample_token(b)] * (p + r)
        )
        for b, (p, r) in enumerate(rows)
    ]
    return refs, routes


def sample_routes(layout, rows=ROWS, seed: int = 0) -> list[np.ndarray]:
    """Each row's sample's routes [T, L, K], the same for a seed in every process."""
    rng = np.random.default_rng(seed)
    return [layout.random_routes(rng, p + r) for p, r in rows]


def verl_batch(refs, rows=ROWS):
    """A verl rollout DataProto: prompt left padded to P, response right padded to R, one
    ref per row in non_tensor_batch."""
    from verl import DataProto

    B = len(rows)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        prompts[b, P - p :] = sample_token(b)
        prompt_mask[b, P - p :] = 1
        responses[b, :r] = sample_token(b)
        response_mask[b, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
        },
        non_tensors={"routing_refs": refs_array(refs)},
    )


def expected_for_tokens(tokens, positions, routes, L, K) -> torch.Tensor:
    """Per token, independently: the route of (sample named by its token id, its position);
    -1 for pad tokens (id 0)."""
    out = torch.full((len(tokens), L, K), MISSING, dtype=torch.int64)
    for i, (tok, pos) in enumerate(zip(tokens.tolist(), positions.tolist(), strict=True)):
        if tok:
            out[i] = torch.as_tensor(routes[tok - 3][pos])
    return out


def bare_engine(base, *, sp_size: int = 1, bucket: int | None = None):
    """verl's FSDP engine class without its __init__ (no CUDA, no FSDP wrap): the attributes
    its prepare_model_inputs / forward_step / forward_backward_batch read."""
    engine = object.__new__(base)
    engine.use_ulysses_sp = sp_size > 1
    engine.ulysses_sequence_parallel_size = sp_size
    engine.pad_to_length = bucket is not None
    engine.pad_to_length_bucket = bucket
    engine.module = None  # set by the caller
    engine.ulysses_device_mesh = None
    engine.device_mesh = None
    engine._autocast_dtype = torch.float32
    engine.engine_config = types.SimpleNamespace(use_no_sync_for_gradient_accumulation=False)
    return engine


def on_cpu() -> None:
    """Point verl's device lookup at the CPU (it asks CUDA otherwise)."""
    import verl.utils.seqlen_balancing as balancing
    import verl.workers.engine.fsdp.transformer_impl as impl
    import verl.workers.engine.utils as engine_utils

    for module in (impl, engine_utils, balancing):
        if hasattr(module, "get_device_id"):
            module.get_device_id = lambda: "cpu"
        if hasattr(module, "get_device_name"):
            module.get_device_name = lambda: "cpu"


def sp_rank(rank: int, world: int, port: int, store_name: str, refs, results) -> None:
    """One Ulysses rank: verl's prepare_model_inputs and model_input_routes on its slice."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from tensordict import TensorDict
        from verl.utils.ulysses import set_ulysses_sequence_parallel_group
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
        from verl.workers.utils.padding import left_right_2_no_padding

        from routing_replay.integrations.verl import attach_routes
        from routing_replay.testing import tiny_moe

        set_ulysses_sequence_parallel_group(dist.group.WORLD)
        store = RoutingStore.attach(store_name)
        layout = store.layout
        data = attach_routes(verl_batch(refs), fetch=store.read)
        routes = sample_routes(layout)
        td = left_right_2_no_padding(TensorDict(dict(data.batch), batch_size=[len(data)]))
        td["temperature"] = torch.ones(len(data))
        td_refs = left_right_2_no_padding(verl_batch(refs).to_tensordict())
        out = {}
        for bucket in (None, 8):
            engine = bare_engine(FSDPEngineWithLMHead, sp_size=world, bucket=bucket)
            engine.module = tiny_moe()
            inputs, _ = engine.prepare_model_inputs(td)
            packed = td["input_ids"].values().numel()
            pad = engine._get_packed_pad_size(packed)
            local = model_input_routes(td, sp_size=world, static_pad=pad)
            # Only the refs ride (no attach_routes): this rank reads its tokens' ranges.
            read = []

            def fetch(refs, ranges, read=read):
                table = store.read(refs, ranges=ranges)
                read.append(sum(table.column("num_tokens").to_pylist()))
                return table

            by_refs = model_input_routes(td_refs, sp_size=world, static_pad=pad, fetch=fetch)
            ids, pos = inputs["input_ids"][0], inputs["position_ids"][0]
            want = expected_for_tokens(ids, pos, routes, layout.num_moe_layers, layout.top_k)
            out[bucket] = dict(
                shape=tuple(local.shape),
                tokens=len(ids),
                equal=bool(torch.equal(local[0].long(), want)),
                equal_by_refs=bool(torch.equal(by_refs[0].long(), want)),
                read=read,
                pads=int((ids == 0).sum()),
            )
        store.close()
        results[rank] = out
    finally:
        dist.destroy_process_group()
