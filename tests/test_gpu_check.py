"""benchmarks/gpu_check.py on this machine: without CUDA its CUDA parts are skipped, by
name, and the rest (capture on a bf16 engine, replay in the fp32 trainer) runs and passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_runs_and_skips_the_cuda_parts_cleanly(tmp_path):
    import torch

    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["part"].split(" (")[0]: r for r in result["rows"]}
    assert len(rows) == 4
    a = result["agreement"]
    assert a["with_replay"] == 1.0 and a["without_replay"] < 1.0 and a["tokens"] > 0
    cuda_parts = ("CUDA tests", "pinned read + non-blocking copy")
    for part in cuda_parts:
        if torch.cuda.is_available():
            assert rows[part]["ok"] is True, rows[part]
        else:
            assert rows[part]["ok"] is None and rows[part]["result"] == "skipped: no CUDA"
    assert "| skip |" in proc.stdout or torch.cuda.is_available()
