"""benchmarks/cluster.py --quick, on 2 rollout nodes and 4 ranks on a trainer node (the
committed run: 4 and 8 on 2): every rank's routes exact on both ways, every rank reading
from both rollout nodes' store actors, and the bytes crossing nodes are what they counted.

Run as users run it (a subprocess with its own Ray cluster); timings are not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from routing_replay import RoutingLayout

pytestmark = pytest.mark.slow

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
QWEN = RoutingLayout(num_layers=48, top_k=8, num_experts=128)


def test_quick_cluster_every_rank_reads_its_share_exactly(tmp_path):
    out = tmp_path / "cluster.json"
    script = str(ROOT / "benchmarks" / "cluster.py")
    cmd = [sys.executable, script, "--quick", "--repeats", "1", "--out", str(out)]
    cmd += ["--rollout-nodes", "2", "--trainer-nodes", "1", "--ranks", "4"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(out.read_text())
    w, ways = res["workload"], res["ways"]
    assert (w["rollout_nodes"], w["trainer_nodes"], w["ranks"]) == (2, 1, 4)
    tokens = 2 * w["groups"] * w["n"] * (w["prompt"] + w["completion"])
    assert w["tokens"] == tokens
    for way, r in ways.items():
        assert r["identical"], way
        assert len(r["peak_private_mb_per_rank"]) == 4
    # Ray's int32: every rank received its share of dense int32, all of it across nodes.
    assert ways["ray-int32"]["bytes_crossing"] == tokens * QWEN.values_per_token * 4
    # The store actors served the narrow ids and int32 token ids of every token once (the
    # quick prompt, 96 tokens, fills no 128-token page: nothing shared), plus the copies.
    served = ways["store"]["bytes_crossing"]
    assert (
        tokens * (QWEN.bytes_per_token + 4) <= served < tokens * (QWEN.bytes_per_token + 4) * 1.01
    )
    assert len(ways["store"]["per_actor_MBps"]) == 2
    assert "Ray int32 / this project, slowest rank" in done.stdout
