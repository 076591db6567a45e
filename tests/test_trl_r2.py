"""R2 in TRL's real GRPOTrainer: the old-logprob pass's own expert ids, put in the store and
replayed in the later mini-batches of the generation, checked at the experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expert_spy import ExpertSpy
from transformers import TrainerCallback
from trl_setup import config, prompts, reward_len, saved_checkpoint

from routing_replay.errors import InvalidArgumentError
from routing_replay.integrations.trl import RoutingReplayGRPOTrainer
from routing_replay.model.replay import is_prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint():
    return saved_checkpoint("rr-trl-r2-")


class Watched(RoutingReplayGRPOTrainer):
    """Records the expert ids of every pass: old-logprob ("old"), reference ("ref"), loss
    ("loss"), and a native forward of the policy just before each loss ("native")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = self.accelerator.unwrap_model(self.model)
        self.spy = ExpertSpy(self.policy)
        self.ref_spy = ExpertSpy(self.ref_model)
        self.passes: list[dict] = []
        self.generating = False

    def _generate_and_score_completions(self, inputs):
        self.generating = True
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.generating = False

    def _watch(self, kind, spy, run, input_ids, mask):
        start, recompute_start = len(spy.calls), len(spy.recomputes)
        out = run()
        calls = spy.calls[start:]
        self.passes.append(
            dict(
                kind=kind,
                input_ids=input_ids.cpu(),
                mask=mask.cpu().bool(),
                calls=calls,
                native_topk=spy.native_topk[start:],
                recompute_start=recompute_start,
            )
        )
        return out

    def compute_loss(self, model, inputs, *args, **kwargs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():  # what the moved policy routes on its own (no replay block yet)
            self._watch(
                "native",
                self.spy,
                lambda: self.policy(input_ids=ids, attention_mask=mask),
                ids,
                mask,
            )
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *a, **k):
        def run():
            return super(Watched, self)._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, *a, **k
            )

        if model is self.ref_model:
            return self._watch("ref", self.ref_spy, run, input_ids, attention_mask)
        kind = "old" if self.generating else "loss"
        return self._watch(kind, self.spy, run, input_ids, attention_mask)


class StoreAfterSteps(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.samples: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.samples.append(self.trainer.routing_store.stats().samples)


def per_row(p, L):
    """A pass's expert ids per row: `[T, L, K]` over the row's unpadded tokens, and the tokens.

    The experts see every column (padding too), one call per layer per forward chunk, the
    chunks in row order."""
    B, S = p["input_ids"].shape
    layers = {j: [] for j in range(L)}
    for j, ids in p["calls"]:
        layers[j].append(ids)
    ids_BSLK = torch.stack([torch.cat(layers[j]).reshape(B, S, -1) for j in range(L)], dim=2)
    return [
        (tuple(p["input_ids"][b][p["mask"][b]].tolist()), ids_BSLK[b][p["mask"][b]].numpy())
        for b in range(B)
    ]


def by_tokens(rows):
    """{tokens: ids}; rows with equal tokens must have had equal ids (one forward, same rows)."""
    out = {}
    for tokens, ids in rows:
        if tokens in out:
            np.testing.assert_array_equal(out[tokens], ids)
        out[tokens] = ids
    return out


def sorted_equal(got, own):
    """Each call's experts got the router's own top-k set (a nonempty list of calls)."""
    assert len(got) == len(own) > 0
    return all(
        torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(got, own, strict=True)
    )


@pytest.mark.slow  # the fast tier stays under a minute
def test_r2_replays_the_old_logprob_pass_experts_in_later_mini_batches(checkpoint):
    # A generation of 8 rows, 2 micro-batches (steps_per_generation=2), an optimizer step
    # after each (gradient_accumulation_steps=1): the second trains moved weights. TRL runs
    # its old-logprob pass; R2 records its routes there. 4 steps: two generations.
    steps = StoreAfterSteps()
    trainer = Watched(
        model=checkpoint,
        reward_funcs=reward_len,
        args=config(max_steps=4, steps_per_generation=2, gradient_checkpointing=True),
        train_dataset=prompts(),
        callbacks=[steps],
        routing_mode="R2",
    )
    steps.trainer = trainer
    try:
        trainer.train()
        L = trainer.routing_layout.num_moe_layers
        kinds = [p["kind"] for p in trainer.passes]
        gen = ["old", "ref"] + ["native", "loss"] * 2  # per generation, in TRL's order
        assert kinds == gen * 2, kinds
        for g in range(2):
            old, ref, _, loss_0, native_1, loss_1 = trainer.passes[6 * g : 6 * g + 6]
            recorded = by_tokens(per_row(old, L))
            assert len(recorded) > 1
            # The old-logprob pass itself routes natively: R2 records the policy's own choice.
            assert sorted_equal([ids for _, ids in old["calls"]], old["native_topk"])
            # Both micro-batches hand the experts exactly the old pass's ids, every
            # unpadded token, every layer, in order (the rows are TRL's shuffle of them).
            for loss in (loss_0, loss_1):
                for tokens, ids in per_row(loss, L):
                    np.testing.assert_array_equal(ids, recorded[tokens])
            # The second micro-batch is off-policy: natively the moved policy routes other
            # experts for some (token, layer), which replay overrode.
            moved = sum(
                int((ids != recorded[tokens]).any(-1).sum()) for tokens, ids in per_row(native_1, L)
            )
            assert moved > 0, "the policy did not move: the test would prove nothing"
            # Gradient checkpointing recomputed each layer in backward with the same ids
            # (a loss's backward ends before the policy's next pass starts).
            after = trainer.passes[6 * g + 6]["recompute_start"] if g == 0 else None
            for loss, end in ((loss_0, native_1["recompute_start"]), (loss_1, after)):
                recomputed = trainer.spy.recomputes[loss["recompute_start"] : end]
                assert sorted(j for j, _ in recomputed) == list(range(L))
                forward = dict(loss["calls"])  # one call per layer: one chunk
                for j, ids in recomputed:
                    assert torch.equal(ids, forward[j]), f"layer {j} recomputed other experts"
            # The reference model routes natively: its experts got its routers' own top-k.
            assert sorted_equal([ids for _, ids in ref["calls"]], ref["native_topk"])
        # In the second generation the reference (initial weights) routes otherwise than the
        # policy's recorded ids: a replayed reference pass would have been caught above.
        old, ref = trainer.passes[6], trainer.passes[7]
        differ = sum(
            int((a[1] != b[1]).any(-1).sum())
            for a, b in zip(per_row(ref, L), per_row(old, L), strict=True)
        )
        assert differ > 0
        assert not is_prepared(trainer.ref_model)
        # A generation's refs are released after its last micro-step.
        assert steps.samples == [8, 0, 8, 0], steps.samples
    finally:
        trainer.spy.remove()
        trainer.ref_spy.remove()
        trainer.close_routing_store()


def test_r2_is_refused_where_trl_runs_no_old_logprob_pass(checkpoint):
    # One generation per optimizer step (2 micro-batches, accumulated): TRL skips the
    # old-logprob pass, so R2 would have nothing to record.
    args = config(max_steps=1, steps_per_generation=2, gradient_accumulation_steps=2)
    with pytest.raises(
        InvalidArgumentError,
        match=r"routing_mode='R2' records routes in TRL's old-logprob pass, which TRL skips "
        r"here: gradient_accumulation_steps=2 is a multiple of steps_per_generation \(2\) x "
        r"num_iterations \(1\)",
    ):
        RoutingReplayGRPOTrainer(
            model=checkpoint,
            reward_funcs=reward_len,
            args=args,
            train_dataset=prompts(),
            routing_mode="R2",
        )
    with pytest.raises(InvalidArgumentError, match=r"TRL's default GRPOConfig skips"):
        RoutingReplayGRPOTrainer(
            model=checkpoint, reward_funcs=reward_len, train_dataset=prompts(), routing_mode="R2"
        )
    with pytest.raises(InvalidArgumentError, match=r"routing_mode='R1': use 'R3' .* or 'R2'"):
        RoutingReplayGRPOTrainer(
            model=checkpoint,
            reward_funcs=reward_len,
            args=args,
            train_dataset=prompts(),
            routing_mode="R1",
        )


@pytest.mark.slow  # the fast tier stays under a minute
def test_r2_resume_replays_the_routes_the_checkpoint_kept(checkpoint, tmp_path, monkeypatch):
    # checkpoint-1 falls inside a generation (2 micro-batches, a step after each): it keeps
    # the second micro-batch and the routes R2 recorded for it. Resumed, that micro-batch
    # hands the experts run A's old-logprob ids, and nothing is generated again.
    def trainer(out, **kw):
        return Watched(
            model=checkpoint,
            reward_funcs=reward_len,
            args=config(output_dir=str(tmp_path / out), steps_per_generation=2, max_steps=2, **kw),
            train_dataset=prompts(),
            routing_mode="R2",
        )

    a = trainer("a", save_strategy="steps", save_steps=1)
    try:
        a.train()
        L = a.routing_layout.num_moe_layers
        old, _, _, _, _, second = a.passes
        recorded = by_tokens(per_row(old, L))
    finally:
        a.spy.remove()
        a.ref_spy.remove()
        a.close_routing_store()
    kept = tmp_path / "a" / "checkpoint-1"
    assert (kept / "routing_replay_routes-0.arrow").exists()

    generated = []
    real_generate = RoutingReplayGRPOTrainer._generate
    monkeypatch.setattr(
        RoutingReplayGRPOTrainer,
        "_generate",
        lambda self, p: generated.append(p) or real_generate(self, p),
    )
    b = trainer("b")
    try:
        b.train(resume_from_checkpoint=str(kept))
        assert generated == [] and [p["kind"] for p in b.passes] == ["native", "loss"]
        native, resumed = b.passes
        assert torch.equal(resumed["input_ids"], second["input_ids"])
        for tokens, ids in per_row(resumed, L):
            np.testing.assert_array_equal(ids, recorded[tokens])
        moved = sum(
            int((ids != recorded[tokens]).any(-1).sum()) for tokens, ids in per_row(native, L)
        )
        assert moved > 0, "natively the resumed policy routes as recorded: nothing was shown"
        assert b.routing_store.stats().samples == 0  # released after its last micro-step
    finally:
        b.spy.remove()
        b.ref_spy.remove()
        b.close_routing_store()
