"""Operators see the node stores: each store actor's Ray metrics on the Prometheus endpoint
of a real local Ray node, with the values the store holds, and `routing-replay ls` alike."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

# Run apart: its own Ray node with a known metrics port and a fast report interval.
SCRIPT = r"""
import json, subprocess, sys, time, urllib.request
import numpy as np, ray
from routing_replay import RoutingLayout
from routing_replay.ray import StoreOptions, node_store, read_dataset, shutdown_node_stores

port = int(sys.argv[1])
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
         _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 500})
layout = RoutingLayout(num_layers=4, top_k=2, num_experts=8)  # 8 bytes a token

@ray.remote(num_cpus=0)
def rollout_and_read():
    store = node_store("metrics-test", layout, StoreOptions(capacity_tokens=4096, page_tokens=16))
    routes = layout.random_routes(np.random.default_rng(0), 40)
    refs = [store.put(f"s{i}", routes, token_ids=np.arange(40)) for i in range(3)]
    store.read(refs)
    ls = subprocess.run([sys.executable, "-m", "routing_replay.cli", "ls"], capture_output=True,
                        text=True, check=True).stdout
    return refs, store.node_id, [line for line in ls.splitlines() if line.startswith("metrics-")]

refs, node, rows = ray.get(rollout_and_read.remote())
read_dataset(refs)  # from the driver: read by the store actor, as for another node
found, deadline = {}, time.time() + 90
while time.time() < deadline:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("ray_routing_replay_") and 'job="metrics-test"' in line:
            name, value = line.rsplit(" ", 1)
            found[name.split("{")[0]] = (float(value), f'node="{node}"' in name)
    samples = found.get("ray_routing_replay_samples", (0,))[0]
    if samples == 3 and "ray_routing_replay_samples_served_total" in found:
        break
    time.sleep(1)
shutdown_node_stores("metrics-test")
print(json.dumps({"metrics": found, "ls": rows}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_store_actor_metrics_reach_the_prometheus_endpoint_and_ls():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    metrics = got["metrics"]
    page = 16 * 8  # bytes of one page of routes
    # 3 samples of the same 40 tokens and routes: 2 full pages shared, 3 last pages apart.
    want = {
        "ray_routing_replay_samples": 3,
        "ray_routing_replay_pages_used": 5,
        "ray_routing_replay_pages_total": 256,
        "ray_routing_replay_shared_bytes_saved": 4 * page,
        "ray_routing_replay_spilled_samples": 0,
        "ray_routing_replay_spill_budget_bytes": 0,
        "ray_routing_replay_puts_total": 3,
        "ray_routing_replay_reads_total": 2,  # the task's, and the actor's for the dataset
    }
    assert {k: metrics[k][0] for k in want} == want, metrics
    assert all(tagged for _, tagged in metrics.values())  # every one tagged with its node
    assert metrics["ray_routing_replay_samples_served_total"][0] == 3
    assert metrics["ray_routing_replay_bytes_served_total"][0] > 0
    assert metrics["ray_routing_replay_put_seconds_total"][0] > 0
    assert metrics["ray_routing_replay_read_seconds_total"][0] > 0
    [row] = got["ls"]
    assert "3 samples, 5/256 pages" in row and "3 puts (" in row and "1 read (" in row, row
