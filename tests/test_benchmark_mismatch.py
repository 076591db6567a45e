"""benchmarks/mismatch.py, off-policy part (none / R2 / R3), on quick sizes for DeepSeek-V3.

The numbers are measured, so only what must hold is asserted: the report's structure, the
exact decision counts, R3's agreement 1.0, and orderings with a reason (and a wide margin).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import mismatch  # noqa: E402
from tiny_moe import deepseek_v3_config  # noqa: E402

METRICS = {
    "router_agreement",
    "num_decisions",
    "replace_rate",
    "kl_vocab",
    "kl_k3",
    "abs_logprob_diff",
}


def test_quick_off_policy_columns(tmp_path, one_thread):
    op = mismatch.off_policy_setup(quick=True)
    assert op["minibatches"] == [2, 4] and op["rollouts"] == 2 and op["prompts"] == 8
    results = mismatch.run(4, 16, 8, op, seed=0, models=("deepseek_v3",))
    (res,) = results.values()
    assert set(res) == {"layout", "tokens", "native", "replay", "seconds", "off_policy"}
    assert set(res["off_policy"]) == {"2", "4"}
    # Decisions compared per rollout: every token but each row's last (the engine never
    # forwarded it), at every MoE layer; the prompts are the seeded inputs of each rollout.
    config = deepseek_v3_config()
    L = config.num_hidden_layers - config.first_k_dense_replace  # MoE layers: 5 - 1 dense
    rollout_rows = [
        int(mismatch.prompts_for(op["prompts"], op["prompt_len_max"], 1 + r)[1].sum())
        + op["prompts"] * (op["new_tokens"] - 1)
        for r in range(op["rollouts"])
    ]
    for m, part in res["off_policy"].items():
        per = part["per_minibatch"]
        assert set(part) == {"per_minibatch", "all", "seconds"} and len(per) == int(m)
        for entry in [*per, part["all"]]:
            assert set(entry) == set(mismatch.MODES)
            for mode in mismatch.MODES:
                assert set(entry[mode]) == METRICS
                # bf16 vs fp32 never give identical log-probs; the updates are small (lr 3e-5).
                assert 0 < entry[mode]["kl_vocab"] < 1e-2, (m, mode, entry[mode])
                assert 0 < entry[mode]["abs_logprob_diff"] < 0.1, (m, mode, entry[mode])
            # R3 forces the engine's own routes: every decision agrees, nothing is replaced;
            # with a tolerance, a replaced slot is a decision that differs from the rollout.
            assert entry["R3"]["router_agreement"] == 1.0
            assert entry["R3"]["replace_rate"] == entry["R2"]["replace_rate"] == 0.0
            for r in mismatch.TOLERANCES:
                tolerant = entry[f"R3@{r}"]
                assert 0.0 <= tolerant["replace_rate"] < 0.5
                assert (tolerant["router_agreement"] < 1.0) == (tolerant["replace_rate"] > 0)
        assert part["all"]["R3"]["num_decisions"] == L * sum(rollout_rows), m
        assert part["all"]["none"]["num_decisions"] == L * sum(rollout_rows), m
        assert part["all"]["R2"]["num_decisions"] == L * sum(rollout_rows), m
        first, last = per[0], per[-1]
        # Mini-batch 1 trains the weights that generated the rollout: R2 replays exactly the
        # routes the trainer takes natively there (1% slack: a batch of other rows may flip a tie).
        assert abs(first["R2"]["router_agreement"] - first["none"]["router_agreement"]) < 0.01
        # The fp32 trainer routes otherwise than the bf16 engine for some decisions
        # (DeepSeek-V3's group-limited top-k flips several percent), and that costs KL.
        assert first["none"]["router_agreement"] < 0.99
        assert first["R3"]["kl_vocab"] < first["none"]["kl_vocab"] / 2
        # After 3 updates the policy has moved: natively it routes further from the rollout,
        # while R2 still replays the pre-update routes.
        if m == "4":
            assert last["none"]["router_agreement"] < last["R2"]["router_agreement"] - 0.05
    text = _table(results)
    assert "deepseek_v3" in text and " R2 " in text
    (tmp_path / "m.json").write_text(json.dumps(results))
    pytest.importorskip("matplotlib")
    mismatch.plot(results, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 10_000


def _table(results):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        mismatch.print_off_policy_table(results)
    return out.getvalue()
