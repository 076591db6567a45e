"""The integration examples run end to end (they assert their own claims)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_nemo_rl_style_example(capsys):
    runpy.run_path(str(EXAMPLES / "nemo_rl_style.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "agreement with replay: 1.0000" in out
    assert "CP1/TP0 routes (1, 46, 4, 4)" in out


def test_trl_grpo_example(capsys):
    runpy.run_path(str(EXAMPLES / "trl_grpo.py"), run_name="__main__")
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5", "6"]
    assert all(r[3] == "100.00%" for r in rows)  # under replay: the rollout's experts
    # the second step of each generation runs on a moved policy: native routing drifts
    assert all(float(r[2].rstrip("%")) < 99.0 for r in rows[1::2])
    assert "samples in the store after each step: [16, 0, 16, 0, 16, 0]" in out


@pytest.mark.ray
def test_agentic_ray_job_example():
    # In its own process, as a user runs it: Ray in the pytest process would leave its
    # state (and RAY_AUTH_MODE in os.environ) to the clusters later tests start.
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # a fresh Ray
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "agentic_ray_job.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("6 episodes x 3 turns" in s for s in steps)
    assert all("with 1.0000" in s and "samples stored 6 -> 0" in s for s in steps)
    shared = [int(m) for s in steps for m in re.findall(r"up to (\d+) B shared", s)]
    assert len(shared) == 2 and min(shared) > 0
