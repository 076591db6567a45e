"""What the TRL tests share: a saved tiny checkpoint, prompts, a reward, a GRPOConfig."""

from __future__ import annotations

import tempfile

from datasets import Dataset
from trl import GRPOConfig

from routing_replay.testing import tiny_moe, tiny_tokenizer


def saved_checkpoint(prefix: str) -> str:
    """The tiny Qwen3-MoE and its tokenizer, saved in a new temporary directory."""
    path = tempfile.mkdtemp(prefix=prefix)
    tiny_moe(seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def prompts(n: int = 8) -> Dataset:
    words = ["sky", "sea", "sun", "moon", "star", "rain", "wind", "snow"]
    return Dataset.from_dict({"prompt": [f"the {w} is" for w in words][:n] * 4})


def reward_len(completions, **_):
    return [float(len(c)) for c in completions]


def config(**overrides) -> GRPOConfig:
    """A small CPU GRPOConfig with a reference model (beta > 0), `overrides` applied."""
    base = dict(
        output_dir=tempfile.mkdtemp(prefix="rr-trl-out-"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        beta=0.04,  # a reference model: its pass must route natively
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    return GRPOConfig(**{**base, **overrides})
