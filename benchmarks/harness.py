"""What every benchmark shares: paths, model shapes, memory probes, a simulated Ray cluster,
the machine's description and the results file. Each benchmark says only what it measures."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "docs" / "img"  # plots the docs show
MB = 2**20
# Every process allocates with the system allocator, Arrow included: a pool that keeps freed
# pages would hand later repeats pre-faulted memory that the numpy-based ways do not get.
ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system"}

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {"num_layers": 48, "top_k": 8, "num_experts": 128, "moe_layers": None},
    "deepseek-v3": {
        "num_layers": 61,
        "top_k": 8,
        "num_experts": 256,
        "moe_layers": list(range(3, 61)),
    },
}


def layout_of_model(model: str) -> Any:
    from routing_replay import RoutingLayout

    m = MODELS[model]
    return RoutingLayout(m["num_layers"], m["top_k"], m["num_experts"], moe_layers=m["moe_layers"])


# -- memory ----------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in keys}


def mem_start() -> dict[str, int]:
    """Reset this process's peak RSS (Linux clear_refs 5) and return the baseline."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return proc_status()


def mem_end(base: dict[str, int]) -> dict[str, int]:
    """Peak since `mem_start`, over its baseline; shared mappings (shm, files) apart."""
    now = proc_status()
    shared = (now["RssShmem"] + now["RssFile"]) - (base["RssShmem"] + base["RssFile"])
    return {
        "peak_rss": now["VmHWM"],
        "base_rss": base["VmRSS"],
        "peak_delta": now["VmHWM"] - base["VmRSS"],
        "shared_delta": shared,
        "private_delta": now["VmHWM"] - base["VmRSS"] - max(shared, 0),
    }


# -- a simulated cluster ----------------------------------------------------------------


class SimCluster:
    """`nodes` simulated Ray nodes on this machine (the head first), a driver attached, the
    calling benchmark's module shipped by value to its actors."""

    def __init__(self, nodes: int, object_store_bytes: int, module: str) -> None:
        import ray
        from ray.cluster_utils import Cluster

        args = {"num_cpus": 2, "object_store_memory": object_store_bytes}
        self.cluster = Cluster(initialize_head=True, head_node_args=args)
        for _ in range(nodes - 1):
            self.cluster.add_node(**args)
        self.cluster.wait_for_nodes()
        here = [str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]
        path = os.pathsep.join(here)  # the package and the benchmarks' own modules
        ray.init(
            address=self.cluster.address,
            include_dashboard=False,
            log_to_driver=os.environ.get("RR_LOG") == "1",
            runtime_env={"env_vars": {**ENV, "PYTHONPATH": path}},
        )
        if module != "__main__":  # imported (a test): ship the benchmark's code by value
            ray.cloudpickle.register_pickle_by_value(sys.modules[module])
        head = ray.get_runtime_context().get_node_id()
        others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
        self.nodes = [head, *sorted(others)]

    def actor(self, cls: type, node: str, *args: Any, **options: Any) -> Any:
        """An actor of `cls` pinned to `node` (no CPU reserved: the benchmark decides)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        opts = {"num_cpus": 0, "scheduling_strategy": strategy, **options}
        return ray.remote(cls).options(**opts).remote(*args)

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


# -- the record ---------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What ran it: platform, cores, memory, /dev/shm and the library versions."""
    import numpy as np
    import pyarrow
    import ray
    import torch

    mem = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
    shm = os.statvfs("/dev/shm")
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mem_total_bytes": int(mem.group(1)) * 1024 if mem else None,
        "dev_shm_bytes": shm.f_blocks * shm.f_frsize,
        "versions": {
            "ray": ray.__version__,
            "torch": torch.__version__,
            "pyarrow": pyarrow.__version__,
            "numpy": np.__version__,
        },
    }


def write_json(path: Path, results: dict[str, Any]) -> None:
    """The results file, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
