"""The README's API tour runs as written (on the tiny demo model), and does what it says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def block_after(heading: str) -> str:
    """The first Python block after a heading of the README."""
    text = README.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter, outside any Ray cluster of the test process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_api_tour_runs_as_written():
    code = block_after("## API tour")
    name = "readme-tour.node0"
    assert code.count(name) == 2  # create and attach: give this run its own store
    out = run(code.replace(name, f"readme-tour-{uuid.uuid4().hex[:8]}.node0"))
    # 4 samples of 12 + 8 tokens, 4 MoE layers, top-4; all released at the end.
    assert out.stdout.strip().splitlines()[-1] == "(80, 4, 4) torch.int8 [0, 20, 40, 60, 80] 0"


@pytest.mark.ray
def test_ray_tour_runs_as_written():
    code = block_after("## On Ray")
    assert code.count('"readme-ray"') == 2  # put and shutdown: give this run its own job
    out = run(code.replace('"readme-ray"', f'"readme-ray-{uuid.uuid4().hex[:8]}"'))
    # 8 samples of 100..107 tokens; then the dataset in batches of 4 samples, in order.
    assert out.stdout.strip().splitlines()[-3:] == [
        "(828, 4, 4)",
        "(406, 4, 4) s0-p0",
        "(422, 4, 4) s0-p4",
    ]
