"""verl 0.9's own DataProto, padding, micro-batching, Ulysses and FSDP-engine code, with routes.

Optional group: skipped unless verl is importable; `integrations/ci_group.sh verl` makes its own
venv (verl pins transformers < 5.11) and runs this file there, failing if verl is missing.
Every expected route is computed per token, independently of the code under test: a row's
sample is named by its token id (`verl_ranks.sample_token`), its position by verl's
position ids.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl group: run integrations/ci_group.sh verl")

import torch.distributed as dist
from expert_spy import ExpertSpy
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import prepare_dynamic_batch, rearrange_micro_batches
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding
from verl_ranks import (
    ROWS,
    P,
    bare_engine,
    expected_for_tokens,
    on_cpu,
    put_samples,
    sp_rank,
    verl_batch,
)

from routing_replay import MISSING, RoutingStore
from routing_replay.errors import InvalidRoutesError, TokenMismatchError
from routing_replay.integrations.verl import (
    attach_routes,
    model_input_routes,
    register_replaying_engine,
    replaying_engine,
)
from routing_replay.model.adapters import find_routers
from routing_replay.testing import tiny_moe

pytestmark = pytest.mark.verl


@pytest.fixture
def model():
    return tiny_moe(seed=0)


@pytest.fixture
def store(model):
    layout = find_routers(model).layout
    with RoutingStore.create(f"rr-verl-{uuid.uuid4().hex[:8]}", layout, 1 << 14) as s:
        yield s


def padded_expected(data, routes):
    """[B, S, L, K] per token: row b's sample route at its position, -1 on padding."""
    ids, pos = data.batch["input_ids"], data.batch["position_ids"]
    L, K = routes[0].shape[1:]
    flat = expected_for_tokens(ids.reshape(-1), pos.reshape(-1), routes, L, K)
    return flat.reshape(*ids.shape, L, K)


def test_attach_routes_follows_verl_layout_and_reorder(store):
    refs, routes = put_samples(store, store.layout)
    data = verl_batch(refs)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    data.reorder(perm)  # verl's balance_batch reorders rows, non_tensor_batch included
    attach_routes(data, fetch=store.read)
    got = data.batch["routed_experts"]
    assert got.shape == (6, P + 5, store.layout.num_moe_layers, store.layout.top_k)
    assert torch.equal(got.long(), padded_expected(data, routes))
    b = 0  # row 0 is sample 3: prompt 4 tokens left padded to 6, response 4
    p, r = ROWS[3]
    assert (got[b, : P - p] == MISSING).all() and (got[b, P + r :] == MISSING).all()


def test_routes_stay_aligned_through_remove_padding_and_dynamic_micro_batches(store):
    refs, routes = put_samples(store, store.layout)
    data = attach_routes(verl_batch(refs), fetch=store.read)
    L, K = store.layout.num_moe_layers, store.layout.top_k
    # The engine path: verl's remove-padding (nested tensors), then its token-balanced
    # micro-batches (rows reordered and regrouped).
    td = left_right_2_no_padding(TensorDict(dict(data.batch), batch_size=[len(data)]))
    micro, index = rearrange_micro_batches(td, max_token_len=12)
    assert len(micro) > 2 and sorted(i for part in index for i in part) == list(range(6))
    for mb in micro:
        got = model_input_routes(mb)[0].long()
        ids, pos = mb["input_ids"].values(), mb["position_ids"].values()
        assert torch.equal(got, expected_for_tokens(ids, pos, routes, L, K))
    # The DataProto path: prepare_dynamic_batch moves the refs with their rows, so a
    # micro-batch can attach its own routes.
    plain = verl_batch(refs)
    micro_protos, index = prepare_dynamic_batch(plain, max_token_len=12)
    for part, mb in zip(index, micro_protos, strict=True):
        assert [r.sample_id for r in mb.non_tensor_batch["routing_refs"]] == [
            refs[i].sample_id for i in part
        ]
        attach_routes(mb, fetch=store.read)
        assert torch.equal(mb.batch["routed_experts"].long(), padded_expected(mb, routes))


def test_ulysses_sp2_slices_routes_like_verl_slices_the_tokens(store):
    refs, _ = put_samples(store, store.layout)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [
            ctx.Process(target=sp_rank, args=(r, 2, port, store.name, refs, results))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(180)
        assert [proc.exitcode for proc in procs] == [0, 0]
        results = dict(results)
    total = sum(p + r for p, r in ROWS)  # 42 tokens: even, so the SP pad is 0 ...
    for bucket, padded in ((None, total), (8, 48)):  # ... and the bucket pads to 48
        ranks = [results[r][bucket] for r in range(2)]
        assert [x["tokens"] for x in ranks] == [padded // 2] * 2
        assert all(x["equal"] for x in ranks), ranks
        assert all(x["equal_by_refs"] for x in ranks), ranks
        # Each rank read the real tokens of its half, nothing more: together each token once.
        assert all(x["read"] == [x["shape"][1] - x["pads"]] for x in ranks), ranks
        assert sum(x["read"][0] for x in ranks) == total
        assert all(x["shape"][1] == padded // 2 for x in ranks)
        assert sum(x["pads"] for x in ranks) == padded - total


def test_attach_routes_refuses_another_rows_tokens_or_refs(store):
    refs, _ = put_samples(store, store.layout)
    data = verl_batch(refs)
    data.batch["input_ids"][1, P + 1] += 1  # a re-tokenised response token
    with pytest.raises(TokenMismatchError, match=r"sample 'verl-0-1'.*position 7"):
        attach_routes(data, fetch=store.read)
    swapped = verl_batch([refs[1], refs[0], *refs[2:]])  # refs in the wrong rows
    with pytest.raises(InvalidRoutesError, match="row 0: sample 'verl-0-1' has a 6-token"):
        attach_routes(swapped, fetch=store.read)


@pytest.fixture
def one_rank():
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    on_cpu()
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("source", ["attached", "refs", "native", "tolerance"])
def test_replaying_fsdp_engine_forces_the_experts(store, model, one_rank, source):
    # attached: routes in the batch (attach_routes); refs: only the refs ride, as
    # DataProto.to_tensordict keeps non_tensor_batch, and each micro-batch reads its own;
    # native: verl's engine without replay (so the checks below can fail); tolerance: refs,
    # replay_tolerance=1.0 (a recorded expert is kept only where it is in the trainer's own
    # top-k, so the experts get the router's own top-k sets). The replay metrics in the
    # metrics dict the engine returns are counted here at the experts.
    refs, routes = put_samples(store, store.layout)
    data = verl_batch(refs)
    if source == "attached":
        attach_routes(data, fetch=store.read)
    replaying = source != "native"
    tolerance = 1.0 if source == "tolerance" else None
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base = FSDPEngineWithLMHead
    if replaying:
        base = replaying_engine(base, fetch=store.read, replay_tolerance=tolerance)
        assert base.replay_tolerance == tolerance
    engine = bare_engine(base)
    engine.module = model
    td = left_right_2_no_padding(data.to_tensordict())
    td["temperature"] = torch.ones(len(data))
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=16)
    assert ("routed_experts" in td) == (source == "attached")
    spy = ExpertSpy(model)
    seen: list[TensorDict] = []

    def loss_fn(model_output, data, dp_group=None):
        seen.append(data)
        return model_output["log_probs"].values().sum(), {}

    output = engine.forward_backward_batch(td, loss_fn)
    spy.remove()
    L, K = store.layout.num_moe_layers, store.layout.top_k
    assert len(seen) >= 3  # token-balanced micro-batches, each forward + backward
    per_layer = {j: [ids for jj, ids in spy.calls if jj == j] for j in range(L)}
    calls = list(zip(spy.calls, spy.native_topk, strict=True))
    own = {j: [t for (jj, _), t in calls if jj == j] for j in range(L)}  # the router's top-k
    recomputed = {j: [ids for jj, ids in spy.recomputes if jj == j] for j in range(L)}
    forced = differing = agreed = outside = 0
    for i, mb in enumerate(seen):
        want = expected_for_tokens(
            mb["input_ids"].values(), mb["position_ids"].values(), routes, L, K
        )
        for j in range(L):
            got, native, rec = per_layer[j][i], own[j][i], want[:, j]
            if tolerance == 1.0:  # the router's own top-k sets reach the experts
                assert torch.equal(got.sort(-1).values, native.sort(-1).values)
            elif replaying:
                assert torch.equal(got, rec), f"micro-batch {i}, layer {j}"
                assert torch.equal(recomputed[j][i], got)  # its backward, before the next
            else:
                differing += int((got.sort(-1).values != rec.sort(-1).values).any(-1).sum())
            forced += len(got)
            agreed += int((rec.sort(-1).values == native.sort(-1).values).all(-1).sum())
            outside += int((~(rec[:, :, None] == native[:, None, :]).any(-1)).sum())
    assert forced == sum(p + r for p, r in ROWS) * L
    if not replaying:
        assert differing > forced // 2  # native routing is not the recorded one
        assert not [k for k in output["metrics"] if k.startswith("replay/")]
    assert spy.router_grads and min(spy.router_grads) > 0
    assert np.isfinite(spy.router_grads).all()
    if not replaying:
        return
    # The metrics dict verl's forward_backward_batch returns: one item per key (this rank,
    # all micro-batches: rows summed, rates weighted by rows).
    metrics = output["metrics"]
    assert metrics["replay/rows_replayed"] == [forced]
    assert metrics["replay/rows_missing"] == [0]  # packed: no padding, every token routed
    assert metrics["replay/native_agreement"] == [pytest.approx(agreed / forced)]
    replaced = outside / (forced * K) if tolerance else 0.0
    assert metrics["replay/replace_rate"] == [pytest.approx(replaced, abs=0)]
    assert (replaced > 0.25) == (tolerance == 1.0)  # random routes: mostly not its own
    # verl's worker post-processing keeps them: TrainingWorker._postprocess_output
    # all-gathers the metrics over the data-parallel group (verl's allgather_dict_into_dict;
    # the worker module itself needs verl's rollout server packages), train_mini_batch
    # flattens the lists, and the trainer logs their mean.
    from itertools import chain

    from verl.utils.torch_functional import allgather_dict_into_dict

    gathered = allgather_dict_into_dict(metrics, group=engine.get_data_parallel_group())
    for key in [k for k in metrics if k.startswith("replay/")]:
        assert list(chain.from_iterable(gathered[key])) == metrics[key], key


def test_register_replaying_engine_is_what_verl_builds(monkeypatch):
    from verl.workers.engine.base import EngineRegistry

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # as on an NVIDIA GPU worker
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "nvidia")
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    engine = register_replaying_engine()
    assert register_replaying_engine() is engine  # idempotent
    assert engine.replay_tolerance is None
    with pytest.raises(RuntimeError, match=r"replay_tolerance=None, not 0\.5"):
        register_replaying_engine(replay_tolerance=0.5)  # another run's: refused, not ignored
    for backend in ("fsdp", "fsdp2"):
        built = EngineRegistry.get_engine_cls("language_model", backend)
        assert built is engine and issubclass(built, FSDPEngineWithLMHead)
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "amd")  # other vendors keep verl's engine
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
