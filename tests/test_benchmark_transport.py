"""benchmarks/transport.py --quick: every way moves the same routes into torch, exactly.

Timings are not asserted (the machine is shared); only that every way, in real processes,
Ray actors on two simulated nodes, and the node store, hands the reader identical routes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("ray")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import transport  # noqa: E402


def test_quick_every_way_returns_identical_routes(tmp_path):
    results = transport.run(quick=True, repeats=1, keep=True, scaling=[10**4], log=lambda _: None)
    workloads = results["workloads"]
    assert set(workloads) == {"qwen3-30b-a3b/grpo", "deepseek-v3/long"}
    for key, w in workloads.items():
        rows = w["rows"]
        assert set(rows) == set(transport.WAYS), key
        expected = rows["store"]["expected_routes"]
        assert expected.shape == (w["tokens"], *rows["store"]["routes"].shape[1:])
        assert (expected == -1).any() and expected.max() > 0
        for way, row in rows.items():
            assert row["routes"] is not None, (key, way)
            assert np.array_equal(row["routes"], expected), (key, way)
            assert row["identical"], (key, way)
        # Narrow ways hand back narrow signed ids; int32 ways int32.
        narrow = "int8" if key.startswith("qwen") else "int16"
        assert rows["store"]["returned_dtype"] == narrow
        assert rows["store-x"]["returned_dtype"] == narrow
        assert rows["ray-i32"]["returned_dtype"] == "int32"
    grpo = workloads["qwen3-30b-a3b/grpo"]["rows"]["store"]
    assert 0 < grpo["shm_used_bytes"] < grpo["returned_bytes"]  # prompt pages shared
    assert {r["way"] for r in results["scaling"]} == {"store", "raw-narrow", "copyto-narrow"}
    assert all(r["identical"] for r in results["scaling"])
    # The report, JSON and plot are produced from these results.
    text = transport.table(results)
    assert "this project: store, same node" in text
    for w in workloads.values():
        for r in w["rows"].values():
            r.pop("routes"), r.pop("expected_routes")
    (tmp_path / "t.json").write_text(json.dumps(results))
    pytest.importorskip("matplotlib")
    transport.plot(results, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000
