"""Stopping a job's node stores, and sweeping the segments their dead actors left.

A store actor unlinks its own segment at `shutdown`; one that died unannounced (killed,
out of memory, not answering) leaves it, and no later actor of the job starts on that node
to sweep it: `shutdown_node_stores` runs a sweep on every live node.
"""

from __future__ import annotations

import time

from routing_replay.errors import RoutingReplayError
from routing_replay.ray.names import NODE_PREFIX, current_ray_job, store_actors, store_prefix
from routing_replay.store import list_stores, sweep_stores

KILL_GRACE_S = 10.0  # Ray force-kills a worker that did not exit a few seconds after ray.kill


def sweep_dead_segments(job: str, ray_job: str, node_id: str) -> list[str]:
    """Unlink this job's segments on this node whose owning process is dead; returns them."""
    return [info.name for info in sweep_stores(prefix=store_prefix(job, ray_job, node_id))]


def shutdown_node_stores(job: str, timeout: float = 30.0) -> int:
    """Unlink every node's segment of `job` in this Ray job and stop its store actors;
    returns how many."""
    import ray

    actors = store_actors(job)
    pending = {name: a.shutdown.remote() for name, a in actors.items()}
    killed = set()  # nodes (id[:12]) whose actor did not unlink its segment itself
    for name, ref in pending.items():
        try:
            ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayError, RoutingReplayError):
            killed.add(name.rsplit(".", 1)[-1])
        ray.kill(actors[name])
    _sweep_every_node(job, killed, timeout)
    return len(actors)


def _sweep_node(job: str, ray_job: str, node_id: str, wait_s: float) -> list[str]:
    """`sweep_dead_segments`, again for up to `wait_s` while a segment of the job is left
    there (its actor was just killed: its process, and so its owner lease, still going)."""
    deadline = time.monotonic() + wait_s
    swept = sweep_dead_segments(job, ray_job, node_id)
    while list_stores(store_prefix(job, ray_job, node_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
        swept += sweep_dead_segments(job, ray_job, node_id)
    return swept


def _sweep_every_node(job: str, killed: set[str], timeout: float) -> None:
    """Unlink the job's segments whose store actor died unannounced (killed, out of memory,
    or just now for not answering) on every live node: no later actor of the job starts
    there to sweep them."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    sweep = ray.remote(num_cpus=0, max_retries=0)(_sweep_node)
    ray_job = current_ray_job()
    calls = []
    for node in (n["NodeID"] for n in ray.nodes() if n["Alive"]):
        wait_s = timeout + KILL_GRACE_S if node[:NODE_PREFIX] in killed else 0.0
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        calls.append(sweep.options(scheduling_strategy=strategy).remote(job, ray_job, node, wait_s))
    ray.wait(calls, num_returns=len(calls), timeout=timeout + KILL_GRACE_S + 5)  # or next time
