"""What every benchmark shares: paths, model shapes, generated workloads, timing, memory
probes, a simulated Ray cluster, the machine's description, the results file, tables and
plots. Each benchmark says only what it measures."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

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


# -- generated workloads ------------------------------------------------------------------
# A spec is a dict whose "samples" are (tokens T, prompt tokens P, group seed, sample seed):
# the samples of a group share their prompt's tokens and routes (GRPO).


def total_tokens(spec: dict) -> int:
    return sum(s[0] for s in spec["samples"])


def capacity(spec: dict, page_tokens: int = 128) -> int:
    """Store tokens for the whole batch unshared: every sample rounded up to whole pages."""
    return sum(-(-s[0] // page_tokens) * page_tokens for s in spec["samples"]) + page_tokens


def sample_routes(spec: dict, i: int, layout: Any, cache: dict | None = None) -> np.ndarray:
    """Sample i's routes `[T, L, K]` in the narrow dtype, its group's prompt routes first; the
    last row missing (the last sampled token is never forwarded). `cache`: the last prompt."""
    T, P, group, seed = spec["samples"][i]
    L, K = layout.num_moe_layers, layout.top_k
    cache = {} if cache is None else cache
    out = np.empty((T, L, K), dtype=layout.dtype)
    if P:
        key = ("prompt", group, P)
        if key not in cache:
            cache.clear()
            rng = np.random.default_rng([group, 1])
            cache[key] = layout.random_routes(rng, P, layout.dtype)
        out[:P] = cache[key]
    rng = np.random.default_rng([seed, 2])
    out[P:] = layout.random_routes(rng, T - P, layout.dtype)
    out[-1] = layout.missing
    return out


def sample_tokens(spec: dict, i: int) -> np.ndarray:
    """Sample i's token ids (int32); a group's samples share the prompt's."""
    T, P, group, seed = spec["samples"][i]
    prompt = np.random.default_rng([group, 3]).integers(0, 150_000, P, dtype=np.int32)
    rest = np.random.default_rng([seed, 4]).integers(0, 150_000, T - P, dtype=np.int32)
    return np.concatenate([prompt, rest])


def to_int32(narrow: np.ndarray, layout: Any) -> np.ndarray:
    """Narrow stored ids as int32, the missing marker as -1 (the form engines hand out)."""
    out = narrow.astype(np.int32)
    out[narrow == layout.missing] = -1
    return out


# -- timing ------------------------------------------------------------------------------


def timed(
    fn: Callable[[], Any], repeat: int = 1, setup: Callable[[], Any] | None = None
) -> list[float]:
    """Seconds of each of `repeat` calls of fn(), with setup() (untimed) before each; the caller
    takes the best (min) or the median."""
    times: list[float] = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def paired(
    a: Callable[[], Any], b: Callable[[], Any], repeat: int
) -> tuple[list[float], list[float]]:
    """Seconds of a() and of b() in `repeat` adjacent pairs (a first, then b first, ...) after
    one untimed call of each, so that drift and other load hit both: compare per-pair ratios."""
    a()
    b()
    times_a: list[float] = []
    times_b: list[float] = []
    for i in range(repeat):
        if i % 2 == 0:
            times_a += timed(a)
            times_b += timed(b)
        else:
            times_b += timed(b)
            times_a += timed(a)
    return times_a, times_b


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

    def __init__(
        self,
        nodes: int,
        object_store_bytes: int,
        module: str | tuple[str, ...],
        env: dict[str, str] | None = None,
    ) -> None:
        """`module`: the benchmark's module, or the modules its actors use; `env`: the
        actors' environment variables (default ENV)."""
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
            log_to_driver=False,
            runtime_env={"env_vars": {**(ENV if env is None else env), "PYTHONPATH": path}},
        )
        for name in (module,) if isinstance(module, str) else module:
            if name != "__main__":  # imported (a test): ship the benchmark's code by value
                ray.cloudpickle.register_pickle_by_value(sys.modules[name])
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


def write_json(path: Path, results: dict[str, Any], indent: int = 1) -> None:
    """The results file, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=indent, default=str) + "\n")
    os.replace(tmp, path)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing into files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, path: Path) -> None:
    """Lay the figure out, write it (120 dpi, as the docs show them) and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
