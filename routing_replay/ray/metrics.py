"""What a node store actor exports as Ray metrics (`ray.util.metrics`), for Ray's Prometheus
endpoint and dashboards: its store's occupancy, spill, puts and reads of every process on the
node (count and time), and what it served to other nodes. Tagged by job and node.

Ray names them `ray_<name>` on the endpoint; counters end in `_total`. Mean put latency:
`rate(ray_routing_replay_put_seconds_total[1m]) / rate(ray_routing_replay_puts_total[1m])`.
"""

from __future__ import annotations

from typing import Any

# name -> (kind, description); kind "gauge" is set to the value, "counter" grows by its change.
METRICS: dict[str, tuple[str, str]] = {
    "routing_replay_samples": ("gauge", "samples in the node's store (in memory or spilled)"),
    "routing_replay_pages_used": ("gauge", "pages holding routes"),
    "routing_replay_pages_total": ("gauge", "pages of the store"),
    "routing_replay_shared_bytes_saved": ("gauge", "bytes prompt sharing saves"),
    "routing_replay_spilled_samples": ("gauge", "samples whose routes are in spill files"),
    "routing_replay_spilled_bytes": ("gauge", "bytes of spill files"),
    "routing_replay_spill_budget_bytes": ("gauge", "the most spill files may take (0: no spill)"),
    "routing_replay_puts": ("counter", "puts of every process on the node"),
    "routing_replay_put_seconds": ("counter", "their time, from the call to the commit"),
    "routing_replay_reads": ("counter", "reads of every process on the node"),
    "routing_replay_read_seconds": ("counter", "their time, from locating to checking the copy"),
    "routing_replay_bytes_served": ("counter", "bytes the actor sent to readers on other nodes"),
    "routing_replay_samples_served": ("counter", "samples the actor read for other nodes"),
}
TAG_KEYS = ("job", "node")
EXPORT_EVERY_S = 2.0  # how often a store actor brings its metrics up to date


def values(stats: dict[str, Any]) -> dict[str, float]:
    """The metrics' values from a store actor's `stats()`."""
    return {
        "routing_replay_samples": stats["samples"],
        "routing_replay_pages_used": stats["pages_used"],
        "routing_replay_pages_total": stats["pages_total"],
        "routing_replay_shared_bytes_saved": stats["dedup_saved_bytes"],
        "routing_replay_spilled_samples": stats["samples_spilled"],
        "routing_replay_spilled_bytes": stats["spilled_bytes"],
        "routing_replay_spill_budget_bytes": stats["spill_budget"],
        "routing_replay_puts": stats["puts"],
        "routing_replay_put_seconds": stats["put_seconds"],
        "routing_replay_reads": stats["reads"],
        "routing_replay_read_seconds": stats["read_seconds"],
        "routing_replay_bytes_served": stats["bytes_served"],
        "routing_replay_samples_served": stats["samples_served"],
    }


class StoreMetrics:
    """One store actor's metrics; `export(stats)` brings them up to date."""

    def __init__(self, job: str, node_id: str) -> None:
        from ray.util import metrics

        self.tags = {"job": job, "node": node_id}
        self._metrics = {
            name: (metrics.Gauge if kind == "gauge" else metrics.Counter)(
                name, description=text, tag_keys=TAG_KEYS
            )
            for name, (kind, text) in METRICS.items()
        }
        self._exported: dict[str, float] = {}  # counters: the total already exported

    def export(self, stats: dict[str, Any]) -> None:
        for name, value in values(stats).items():
            value = float(value)  # Ray's metrics take Python numbers only (not numpy's)
            metric = self._metrics[name]
            if METRICS[name][0] == "gauge":
                metric.set(value, tags=self.tags)
            else:
                grown = value - self._exported.get(name, 0)
                if grown > 0:
                    metric.inc(grown, tags=self.tags)
                    self._exported[name] = value
