"""The generation buffer a checkpoint keeps: untrained micro-batches and their routes."""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from routing_replay import load_routes, save_routes
from routing_replay.errors import InvalidRoutesError
from routing_replay.integrations import _compat_trl
from routing_replay.integrations._trl_rows import REFS_KEY, _row_masks

BUFFER_FILE, ROUTES_FILE = "routing_replay_buffer", "routing_replay_routes"  # in checkpoints


class CheckpointMixin:
    """`RoutingReplayGRPOTrainer`'s checkpoints: a generation's untrained micro-batches and
    their routes saved beside TRL's, and trained (not regenerated) on resume."""

    def _save_buffer(self, checkpoint_dir: str) -> None:
        """Keep the generation's untrained micro-batches and their routes in the checkpoint."""
        step, inputs = _compat_trl.generation_buffer(self)
        if not inputs or not self._train_refs or step % _compat_trl.steps_per_rollout(self) == 0:
            return  # no generation in flight: resuming generates, as it would have anyway
        rank = self.accelerator.process_index
        save_routes(
            os.path.join(checkpoint_dir, f"{ROUTES_FILE}-{rank}.arrow"),
            self._train_refs,
            read=self._store.read,
        )
        rows = [{**b, REFS_KEY: [r.sample_id for r in b[REFS_KEY]]} for b in inputs]
        torch.save(
            {"step": step, "inputs": rows}, os.path.join(checkpoint_dir, f"{BUFFER_FILE}-{rank}.pt")
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """TRL's `train`; resuming from a checkpoint that kept a generation's untrained
        micro-batches loads them and their routes first, so they are trained, not dropped."""
        path = resume_from_checkpoint
        if path is True:
            from transformers.trainer_utils import get_last_checkpoint

            path = get_last_checkpoint(self.args.output_dir)
        if isinstance(path, (str, os.PathLike)):
            self._load_buffer(os.fspath(path))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_buffer(self, checkpoint_dir: str) -> None:
        rank = self.accelerator.process_index
        buffer = os.path.join(checkpoint_dir, f"{BUFFER_FILE}-{rank}.pt")
        if not os.path.exists(buffer):
            return
        saved = torch.load(buffer, weights_only=False)
        archive = os.path.join(checkpoint_dir, f"{ROUTES_FILE}-{rank}.arrow")
        ids = [sid for b in saved["inputs"] for sid in b[REFS_KEY]]
        lengths = [int(m.sum()) for b in saved["inputs"] for m in _row_masks(b)]
        refs = load_routes(archive, self._store_for(lengths))
        by_id = {r.sample_id: r for r in refs}
        if sorted(by_id) != sorted(ids):
            self._store.release(refs)
            raise InvalidRoutesError(
                f"{archive} holds other samples than the buffered micro-batches of "
                f"{buffer}: the checkpoint's files do not belong together"
            )
        inputs = [{**b, REFS_KEY: [by_id[sid] for sid in b[REFS_KEY]]} for b in saved["inputs"]]
        self._train_refs = refs
        _compat_trl.restore_generation_buffer(self, saved["step"], inputs)


class _SaveBuffer(TrainerCallback):
    """After the Trainer writes a checkpoint, add the generation buffer to it."""

    def __init__(self, trainer: CheckpointMixin) -> None:
        self.trainer = weakref.ref(trainer)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer()
        if trainer is not None:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            trainer._save_buffer(folder)
