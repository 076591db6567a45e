"""What a node store actor exports as Ray metrics (`ray.util.metrics`), for Ray's Prometheus
endpoint and dashboards: its store's occupancy, spill, puts and reads of every process on the
node (count and time), and what it served to other nodes. Tagged by job and node.

Ray names them `ray_<name>` on the endpoint; counters end in `_total`. Mean put latency:
`rate(ray_routing_replay_put_seconds_total[1m]) / rate(ray_routing_replay_puts_total[1m])`.
"""

from __future__ import annotations

from typing import Any

# name -> (kind, the store actor's `stats()` field, description); a gauge is set to the
# field, a counter grows by its change.
METRICS: dict[str, tuple[str, str, str]] = {
    "routing_replay_samples": ("gauge", "samples", "samples in the store (memory or spilled)"),
    "routing_replay_pages_used": ("gauge", "pages_used", "pages holding routes"),
    "routing_replay_pages_total": ("gauge", "pages_total", "pages of the store"),
    "routing_replay_shared_bytes_saved": (
        "gauge", "dedup_saved_bytes", "bytes prompt sharing saves"
    ),
    "routing_replay_spilled_samples": (
        "gauge", "samples_spilled", "samples whose routes are in spill files"
    ),
    "routing_replay_spilled_bytes": ("gauge", "spilled_bytes", "bytes of spill files"),
    "routing_replay_spill_budget_bytes": (
        "gauge", "spill_budget", "the most spill files may take (0: no spill)"
    ),
    "routing_replay_puts": ("counter", "puts", "puts of every process on the node"),
    "routing_replay_put_seconds": ("counter", "put_seconds", "their time, call to commit"),
    "routing_replay_reads": ("counter", "reads", "reads of every process on the node"),
    "routing_replay_read_seconds": (
        "counter", "read_seconds", "their time, from locating to checking the copy"
    ),
    "routing_replay_bytes_served": (
        "counter", "bytes_served", "bytes the actor sent to readers on other nodes"
    ),
    "routing_replay_samples_served": (
        "counter", "samples_served", "samples the actor read for other nodes"
    ),
}  # fmt: skip
TAG_KEYS = ("job", "node")
EXPORT_EVERY_S = 2.0  # how often a store actor brings its metrics up to date


class StoreMetrics:
    """One store actor's metrics; `export(stats)` brings them up to date."""

    def __init__(self, job: str, node_id: str) -> None:
        from ray.util import metrics

        self.tags = {"job": job, "node": node_id}
        self._metrics = {
            name: (metrics.Gauge if kind == "gauge" else metrics.Counter)(
                name, description=text, tag_keys=TAG_KEYS
            )
            for name, (kind, _, text) in METRICS.items()
        }
        self._exported: dict[str, float] = {}  # counters: the total already exported

    def export(self, stats: dict[str, Any]) -> None:
        for name, (kind, field, _) in METRICS.items():
            value = float(stats[field])  # Ray's metrics take Python numbers only (not numpy's)
            metric = self._metrics[name]
            if kind == "gauge":
                metric.set(value, tags=self.tags)
            else:
                grown = value - self._exported.get(name, 0)
                if grown > 0:
                    metric.inc(grown, tags=self.tags)
                    self._exported[name] = value
