"""benchmarks/fanout.py --quick: every trainer rank gets the same routes from whole samples and
from its token ranges, and the ranged reads read and ship exactly the rank's share.

The benchmark runs in a subprocess (it starts its own two-node Ray cluster; no Ray runtime
in this process). Timings and memory are not asserted (the machine is shared); bytes are,
exactly, against a context-parallel split computed here again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent


def zigzag_share(n: int, cp: int, rank: int) -> int:
    """Tokens of an n-token sample that CP rank `rank` holds: the sample padded to a
    multiple of 2 * cp, chunks rank and 2 * cp - 1 - rank of 2 * cp, padding not counted."""
    chunk = -(-n // (2 * cp))
    held = 0
    for c in (rank, 2 * cp - 1 - rank):
        held += max(0, min((c + 1) * chunk, n) - min(c * chunk, n))
    return held


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fanout") / "fanout.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fanout.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), f"no results (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    data = json.loads(out.read_text())
    data["_proc"] = (proc.returncode, proc.stdout, proc.stderr)
    return data


def test_both_paths_give_every_rank_the_same_routes(results):
    for key, w in results["workloads"].items():
        assert len(w["ranks"]) == results["config"]["dp"] * results["config"]["cp"] == 8
        for r in w["ranks"]:
            rank = (key, r["dp_rank"], r["cp_rank"])
            # whole samples then cp_slice == ranges then place == a zigzag done by hand
            assert r["whole_crc"] == r["ranges_crc"] == r["expected_crc"], rank
            assert r["whole_shape"] == r["ranges_shape"], rank
            assert r["whole_dtype"] == r["ranges_dtype"] == "int8", rank
            assert r["identical"], rank
        assert w["identical"], key
    assert results["identical"]
    code, out, err = results["_proc"]
    assert code == 0, f"{out}\n{err}"
    assert "| long | dp0 cp0 |" in out and "same routes" in out  # the table was printed


def test_ranged_reads_hold_exactly_the_ranks_share_and_whole_reads_whole_samples(results):
    cp, dp = results["config"]["cp"], results["config"]["dp"]
    empty_shares = 0
    for key, w in results["workloads"].items():
        bpt, lengths = w["bytes_per_token"], w["lengths"]
        assert bpt == 48 * 8  # Qwen3-30B-A3B, uint8 ids
        n = len(lengths)
        for r in w["ranks"]:
            d, c = r["dp_rank"], r["cp_rank"]
            mine = lengths[d * n // dp : (d + 1) * n // dp]
            share = sum(zigzag_share(t, cp, c) for t in mine)
            empty_shares += sum(zigzag_share(t, cp, c) == 0 for t in mine)
            assert r["share_tokens"] == share, (key, d, c)
            assert r["ranges_tokens_read"] == share, (key, d, c)
            assert r["ranges_bytes_read"] == share * bpt, (key, d, c)
            assert r["ranges_read_is_exact_share"] and r["ranges_within_page_per_range"]
            assert r["whole_tokens_read"] == sum(mine), (key, d, c)
            assert r["whole_bytes_read"] == sum(mine) * bpt, (key, d, c)
            # what crossed to this rank: less on the ranges path
            assert 0 < r["ranges_cross_node_bytes"] < r["whole_cross_node_bytes"], (key, d, c)
        p = w["paths"]
        assert p["ranges"]["bytes_read"] * cp == p["whole"]["bytes_read"]
        for path in ("whole", "ranges"):
            # the per-rank counts add up to the path's, and every step ships the same bytes
            assert p[path]["cross_node_bytes_ranks_sum"] == p[path]["cross_node_bytes"]
            assert len(set(p[path]["cross_node_bytes_every_step"])) == 1
            assert p[path]["read_calls"] == 8  # one call to the rollout node per rank
        assert 0 < p["ranges"]["cross_node_bytes"] < p["whole"]["cross_node_bytes"], key
    assert empty_shares > 0  # the quick workload leaves some rank an empty (0, 0) range


def test_grpo_prompt_pages_are_stored_once(results):
    grpo = results["workloads"]["grpo"]["store"]
    assert grpo["pages_used"] == grpo["pages_expected"]["shared"]
    assert grpo["pages_used"] < grpo["pages_expected"]["unshared"]
    long = results["workloads"]["long"]["store"]
    assert long["pages_used"] == long["pages_expected"]["unshared"]  # nothing to share


def test_micro_reads_the_ranges_it_asks_for(results):
    m = results["micro"]
    T = m["tokens_per_sample"]
    assert T == 32768
    rows = m["rows"]
    for into in ("", ", out="):
        assert rows[f"full{into}"]["tokens_read"] == T
        assert rows[f"contiguous 1/8{into}"]["tokens_read"] == T // 8
        assert rows[f"zigzag 1/8 (CP=8, rank 1: 2 chunks){into}"]["tokens_read"] == T // 8
        assert rows[f"one token{into}"]["tokens_read"] == 1
        assert all(r["median_seconds"] > 0 for r in rows.values())
