"""A real TRL GRPO run with routing replay, on the tiny demo MoE model, on CPU.

    python examples/trl_grpo.py

The only change to a TRL script is the trainer class: `RoutingReplayGRPOTrainer` instead
of `GRPOTrainer`. TRL rolls out with transformers generation; each sample's routes go into
a shared-memory store and its ref rides in TRL's batch; the loss forward and backward
replay them (gradient checkpointing on). Each generation is trained on for two optimizer
steps (`steps_per_generation=2`), so on the second the policy has moved and its own routing
drifts from the rollout's: that is what replay removes. Printed per step: the reward, the
share of (token, layer) expert sets equal to the rollout's without replay and with it, and
the samples in the store during the loss; a generation's samples are released after its
last step, so the store never holds more than one generation.
"""

from __future__ import annotations

import tempfile

from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

from routing_replay.integrations.trl import RoutingReplayGRPOTrainer
from routing_replay.testing import tiny_moe, tiny_tokenizer

STEPS = 6


def reward_vowels(completions: list[str], **_: object) -> list[float]:
    """A toy reward: the share of vowels in the completion."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


class Steps(TrainerCallback):
    """Keeps the trainer's logs and the store's occupancy after every optimizer step."""

    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.stored_after: list[int] = []
        self.trainer: RoutingReplayGRPOTrainer | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))

    def on_step_end(self, args, state, control, **kwargs):
        self.stored_after.append(self.trainer.routing_store.stats().samples)


def main() -> dict:
    """Train a few GRPO steps with replay; print and return the per-step figures."""
    checkpoint = tempfile.mkdtemp(prefix="rr-trl-model-")
    tiny_moe(seed=0).save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    prompts = Dataset.from_dict({"prompt": [f"{w} is" for w in ["sky", "sea", "sun", "moon"] * 8]})
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rr-trl-out-"),
        per_device_train_batch_size=8,
        num_generations=4,
        steps_per_generation=2,  # each generation trains two optimizer steps
        max_completion_length=12,
        max_steps=STEPS,
        learning_rate=2e-4,
        beta=0.04,  # a reference model: it routes natively
        gradient_checkpointing=True,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    steps = Steps()
    trainer = RoutingReplayGRPOTrainer(
        model=checkpoint,
        reward_funcs=reward_vowels,
        args=args,
        train_dataset=prompts,
        callbacks=[steps],
        log_agreement=True,
    )
    steps.trainer = trainer
    trainer.train()
    trainer.close_routing_store()

    print(f"{'step':>4} {'reward':>7} {'agree native':>13} {'agree replay':>13} {'stored':>7}")
    for i, log in enumerate(steps.logs):
        reward = f"{log['reward']:.3f}" if "reward" in log else "-"  # logged when generating
        print(
            f"{i + 1:>4} {reward:>7} {log['routing/agreement_native']:>13.2%} "
            f"{log['routing/agreement_replayed']:>13.2%} {log['routing/store_samples']:>7.0f}"
        )
    print(f"samples in the store after each step: {steps.stored_after}")
    replayed = [log["routing/agreement_replayed"] for log in steps.logs]
    assert len(steps.logs) == STEPS and all(a == 1.0 for a in replayed), replayed
    # a generation's 16 samples live for its two steps, then are released: nothing grows
    assert steps.stored_after == [16, 0] * (STEPS // 2), steps.stored_after
    return {"logs": steps.logs, "stored_after": steps.stored_after}


if __name__ == "__main__":
    main()
