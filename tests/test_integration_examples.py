"""The integration examples run end to end (they assert their own claims)."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_nemo_rl_style_example(capsys):
    runpy.run_path(str(EXAMPLES / "nemo_rl_style.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "agreement with replay: 1.0000" in out
    assert "CP1/TP0 routes (1, 46, 4, 4)" in out
