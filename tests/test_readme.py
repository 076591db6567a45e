"""The README's API tour runs as written (on the tiny demo model), and does what it says."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def api_tour() -> str:
    """The first Python block after the README's "## API tour" heading."""
    text = README.read_text()
    section = text[text.index("## API tour") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_api_tour_runs_as_written():
    code = api_tour()
    name = "readme-tour.node0"
    assert code.count(name) == 2  # create and attach: give this run its own store
    code = code.replace(name, f"readme-tour-{uuid.uuid4().hex[:8]}.node0")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # 4 samples of 12 + 8 tokens, 4 MoE layers, top-4; all released at the end.
    assert out.stdout.strip().splitlines()[-1] == "(80, 4, 4) torch.int8 [0, 20, 40, 60, 80] 0"
