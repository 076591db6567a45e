"""Ray Train: `examples/ray_train.py` run with its own local Ray, checked exactly.

Two `TorchTrainer` workers (gloo, CPU) each read their data-parallel shard of one rollout's
routes, by refs (`fetch_batch(refs[rank::world], ranges=)`) and through a Ray Data shard
(`get_dataset_shard` + `routes_collate_fn`), replay and step. For both read paths: every
sample was trained by exactly one worker, replay reproduced every recorded route at the
experts on each worker, the losses are finite, the checkpoint that `ray.train.report`
persisted holds the model (loadable, trained) and each rank's samples, Ray Train's logger
callback got every step's replay metrics, and the node stores end empty. The pytest process
never starts Ray itself. (The example's `--replay-tolerance`: replay's tolerance and its
replace rate in a trainer's logger are checked in-process, `test_tolerance.py` and the TRL,
verl and NeMo-RL integration tests.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.ray

pytest.importorskip("ray.train")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ray_train.py")


def _run(tmp_path, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--storage", str(tmp_path / "runs"), "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc


def _check_path(m: dict, read: str, seed: int = 0) -> None:
    from routing_replay.testing import tiny_moe

    p = m["paths"][read]
    workers = p["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    # Every sample trained by exactly one worker: disjoint shards whose union is the rollout.
    shards = [w["sample_ids"] for w in workers]
    assert all(shards) and all(len(w["sample_ids"]) == w["num_samples"] for w in workers)
    assert not set(shards[0]) & set(shards[1]), (read, shards)
    assert sorted(shards[0] + shards[1]) == sorted(m["sample_ids"]), (read, shards)
    assert p["samples"] == m["samples"] == len(m["sample_ids"])
    # Each worker trained exactly the tokens within max_seq_len of its samples.
    assert sum(w["tokens"] for w in workers) == m["trained_tokens"]
    for w in workers:
        # Replay: every recorded (token, layer) route reached the experts, on each worker.
        assert w["agreement_with_replay"] == 1.0, (read, w)
        assert w["decisions"] > 0 and w["per_layer_with_replay"] == [1.0] * 4
        assert all(a < 1.0 for a in w["agreement_without_replay"])  # replay changed something
        assert w["losses"] and all(math.isfinite(x) for x in w["losses"]), (read, w)
        # Replay's own metrics, per step: its forced rows are the (token, layer) decisions
        # compared at the experts (rows with a recorded route), nothing replaced.
        steps = w["replay_steps"]
        assert len(steps) == len(w["losses"])
        assert sum(x["replay/rows_replayed"] for x in steps) == w["decisions"]
        assert all(x["replay/replace_rate"] == 0.0 for x in steps)
        assert all(0.0 < x["replay/native_agreement"] < 1.0 for x in steps)  # bf16 rollout
    # Ray Train's per-step reports, as its logger (the run's UserCallback) got them: each
    # step of every worker, combined.
    assert [row["step"] for row in p["steps"]] == list(range(1, len(workers[0]["losses"]) + 1))
    for i, row in enumerate(p["steps"]):
        at = [w["replay_steps"][i] for w in workers]
        assert row["replay/rows_replayed"] == sum(x["replay/rows_replayed"] for x in at)
        assert row["replay/rows_missing"] == sum(x["replay/rows_missing"] for x in at)
        agreed = sum(x["replay/native_agreement"] * x["replay/rows_replayed"] for x in at)
        assert row["replay/native_agreement"] == pytest.approx(agreed / row["replay/rows_replayed"])
        assert row["loss"] == pytest.approx(np.mean([w["losses"][i] for w in workers]))
    # The last report (Result.metrics) carries them combined over every worker's steps.
    assert p["replay/rows_replayed"] == sum(w["decisions"] for w in workers)
    steps = [x for w in workers for x in w["replay_steps"]]
    assert p["replay/rows_missing"] == sum(x["replay/rows_missing"] for x in steps)
    weighted = sum(x["replay/native_agreement"] * x["replay/rows_replayed"] for x in steps)
    assert p["replay/native_agreement"] == pytest.approx(weighted / p["replay/rows_replayed"])
    assert p["replay/replace_rate"] == 0.0
    # The checkpoint ray.train.report persisted: rank 0's model, every rank's samples.
    ckpt = p["checkpoint"]
    assert sorted(os.listdir(ckpt)) == ["model.pt", "samples-rank0.json", "samples-rank1.json"]
    for w in workers:
        with open(os.path.join(ckpt, f"samples-rank{w['rank']}.json")) as f:
            assert json.load(f) == w["sample_ids"]
    state = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
    model = tiny_moe(seed, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    assert all(torch.isfinite(v).all() for v in state.values())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("mlp.gate" in k for k in changed), "the routers did not learn"


def test_ray_train_both_read_paths_fsdp2(tmp_path):
    m, proc = _run(tmp_path, "--read", "both")
    assert m["samples"] == 16
    for read in ("refs", "dataset"):
        _check_path(m, read)
    # The refs path read the routes of exactly the tokens each worker trains (ranges= cut
    # each sample to max_seq_len); the dataset path read whole samples and cut them after.
    assert m["trained_tokens"] < m["sample_tokens"]
    for w in m["paths"]["refs"]["workers"]:
        assert w["read_tokens"] == w["tokens"], w
    data = m["paths"]["dataset"]["workers"]
    assert sum(w["read_tokens"] for w in data) == m["sample_tokens"]
    assert m["stored_after"] == 0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout
