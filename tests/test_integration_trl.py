"""TRL's real GRPOTrainer.train() with RoutingReplayGRPOTrainer, on CPU, checked at the experts."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from expert_spy import ExpertSpy
from transformers import TrainerCallback
from trl_setup import config, prompts, reward_len, saved_checkpoint

from routing_replay import MISSING, RoutingStore, capture
from routing_replay.errors import InvalidRoutesError, TokenMismatchError, UnsupportedModelError
from routing_replay.integrations.trl import REFS_KEY, RoutingReplayGRPOTrainer, trl_routes
from routing_replay.model.adapters import find_routers
from routing_replay.model.replay import is_prepared
from routing_replay.testing import tiny_moe, tiny_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint():
    return saved_checkpoint("rr-trl-test-")


class StoreAfterSteps(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.after_step: list[int] = []
        self.after_eval: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step.append(self.trainer.routing_store.stats().samples)

    def on_evaluate(self, args, state, control, **kwargs):
        self.after_eval.append(self.trainer.routing_store.stats().samples)


def adapters_disabled(model):
    """Whether PEFT's LoRA layers are switched off (its disable_adapter() context)."""
    if importlib.util.find_spec("peft") is None:  # the vLLM venv: no PEFT model can exist
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) and m.disable_adapters for m in model.modules())


class Checked(RoutingReplayGRPOTrainer):
    """Records every policy pass (its refs, ids, mask, expert calls) and a native forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = self.accelerator.unwrap_model(self.model)
        self.spy = ExpertSpy(self.policy)
        self.passes: list[dict] = []
        self.loss_refs = None
        self.native: list[list[np.ndarray]] = []  # native routes of each loss micro-batch
        self.native_logps: list[torch.Tensor] = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.loss_refs = list(inputs[REFS_KEY])
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        self.spy.on = False
        with capture(self.policy) as cap, torch.no_grad():  # what the policy would route
            logits = self.policy(input_ids=ids, attention_mask=mask).logits
        self.spy.on = True
        C = inputs["completion_ids"].size(1)
        logps = logits[:, -C - 1 : -1].log_softmax(-1)
        self.native_logps.append(logps.gather(-1, inputs["completion_ids"][..., None])[..., 0])
        self.native.append(cap.routes())
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, width, *a, **k):
        is_policy = model is self.model
        refs = self._rollout_refs if self._rollout_refs is not None else self.loss_refs
        start = len(self.spy.calls)
        adapters_off = adapters_disabled(model)
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, width, *a, **k
        )
        if is_policy:
            self.passes.append(
                dict(
                    kind="old" if self._rollout_refs is not None else "loss",
                    refs=list(refs),
                    input_ids=input_ids.cpu(),
                    mask=attention_mask.cpu(),
                    width=width,
                    calls=self.spy.calls[start:],
                    native_topk=self.spy.native_topk[start:],
                    adapters_off=adapters_off,
                    logps=out[0].detach(),
                    recompute_start=len(self.spy.recomputes),
                )
            )
        return out


def expected_routes(recorded, refs, input_ids, mask, width):
    """[B, S, L, K] from what was put, placed as TRL lays rows out, checked token by token."""
    B, S = input_ids.shape
    P = S - width
    _, L, K = next(iter(recorded.values()))[0].shape
    out = np.full((B, S, L, K), MISSING, dtype=np.int64)
    for b, ref in enumerate(refs):
        routes, tokens, prompt_len = recorded[ref.sample_id]
        cols = np.arange(P - prompt_len, P - prompt_len + len(routes))
        assert input_ids[b, cols].tolist() == tokens.tolist()  # the row is this sample
        out[b, cols] = routes
    out[~mask.bool().numpy()] = MISSING
    return out


def per_layer(pairs, L, shape):
    """[B, S, K] per layer from a pass's (layer, [rows, K]) calls, chunks in row order."""
    got = {j: [] for j in range(L)}
    for j, ids in pairs:
        got[j].append(ids)
    return {j: torch.cat(got[j]).reshape(*shape, -1).numpy() for j in range(L)}


def assert_forced(p, recorded, L):
    """Every row with routes reached exactly the recorded experts, at every MoE layer."""
    want = expected_routes(recorded, p["refs"], p["input_ids"], p["mask"], p["width"])
    got = per_layer(p["calls"], L, p["input_ids"].shape)
    for j in range(L):
        forced = (want[:, :, j] != MISSING).all(-1)
        assert forced.sum() > 0
        np.testing.assert_array_equal(got[j][forced], want[:, :, j][forced])


def natively_different(trainer, recorded):
    """Rows with routes whose native top-k set (the policy alone, same weights, just before
    each loss pass) differs from the recorded one, over all loss passes."""
    count = 0
    loss_passes = [p for p in trainer.passes if p["kind"] == "loss"]
    for p, native in zip(loss_passes, trainer.native, strict=True):
        keep = p["mask"].bool().numpy()
        want = expected_routes(recorded, p["refs"], p["input_ids"], p["mask"], p["width"])
        for b, routes in enumerate(native):
            rec = want[b][keep[b]]
            rows = (rec != MISSING).all(-1)
            count += int((np.sort(rec, -1) != np.sort(routes, -1)).any(-1)[rows].sum())
    return count


def run(checkpoint, monkeypatch, trainer_cls=Checked, **overrides):
    recorded = {}
    real_put_many = RoutingStore.put_many

    def put_many(self, requests, **kw):
        requests = list(requests)
        for q in requests:
            recorded[q.sample_id] = (np.array(q.routes), np.array(q.token_ids), q.prompt_len)
        return real_put_many(self, requests, **kw)

    monkeypatch.setattr(RoutingStore, "put_many", put_many)
    steps = StoreAfterSteps()
    eval_dataset = overrides.pop("eval_dataset", None)
    peft_config = overrides.pop("peft_config", None)
    trainer_kwargs = {k: overrides.pop(k) for k in ("replay_tolerance",) if k in overrides}
    trainer = trainer_cls(
        model=checkpoint,
        reward_funcs=reward_len,
        args=config(**overrides),
        train_dataset=prompts(),
        eval_dataset=eval_dataset,
        callbacks=[steps],
        peft_config=peft_config,
        **trainer_kwargs,
    )
    steps.trainer = trainer
    trainer.train()
    return trainer, recorded, steps


def test_grpo_train_forces_the_rollout_experts_where_they_run(checkpoint, monkeypatch):
    # 2 micro-batches per optimizer step, each generation trained twice (num_iterations):
    # the old-logprob pass runs (and replays), and the second iteration's policy has moved.
    trainer, recorded, steps = run(
        checkpoint,
        monkeypatch,
        max_steps=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        gradient_checkpointing=True,
    )
    try:
        kinds = [p["kind"] for p in trainer.passes]
        assert kinds.count("loss") == 8 and kinds.count("old") == 2, kinds
        L = trainer.routing_layout.num_moe_layers
        loss_passes = [p for p in trainer.passes if p["kind"] == "loss"]
        for p in trainer.passes:
            assert_forced(p, recorded, L)
        # Natively the moved policy routes other experts on some forced rows, and its
        # log-probs differ there: without replay the test above would fail.
        assert natively_different(trainer, recorded) > 0
        native_logps = torch.cat(trainer.native_logps)
        replay_logps = torch.cat([p["logps"] for p in loss_passes])
        completion = torch.cat([p["mask"][:, -p["width"] :] for p in loss_passes]).bool()
        assert (native_logps - replay_logps)[completion].abs().max() > 1e-3
        # Gradient checkpointing recomputed each layer in backward, with the forced ids.
        ends = [p["recompute_start"] for p in loss_passes[1:]] + [len(trainer.spy.recomputes)]
        for p, end in zip(loss_passes, ends, strict=True):
            recomputed = trainer.spy.recomputes[p["recompute_start"] : end]
            assert sorted(j for j, _ in recomputed) == list(range(L))
            forward = dict(p["calls"])  # one call per layer: the micro-batch is one chunk
            for j, ids in recomputed:
                assert torch.equal(ids, forward[j]), f"layer {j} recomputed other experts"
        assert trainer.spy.router_grads and min(trainer.spy.router_grads) > 0
        # A generation's refs are released after its last step (num_iterations=2: two).
        assert steps.after_step == [8, 0, 8, 0], steps.after_step
        assert trainer.ref_model is not None and not is_prepared(trainer.ref_model)
    finally:
        trainer.spy.remove()
        trainer.close_routing_store()


def expected_replay_metrics(trainer, recorded, steps):
    """Each optimizer step's `replay/` metrics, from what was put and the policy's own routing
    just before each loss pass (`Checked.native`), independently of replay's tallies: rows
    with a recorded route (every other row of the [B, S] batch is missing), the share of
    them whose native top-k set is the recorded one, and the share of their slots whose
    recorded expert is not in the native top-k (what tolerance 1.0 refills)."""
    loss_passes = [p for p in trainer.passes if p["kind"] == "loss"]
    assert len(loss_passes) == len(trainer.native) and len(loss_passes) % steps == 0
    per_step = len(loss_passes) // steps
    out = []
    for s in range(steps):
        forced = missing = agreed = outside = 0
        for i in range(s * per_step, (s + 1) * per_step):
            p, native = loss_passes[i], trainer.native[i]
            want = expected_routes(recorded, p["refs"], p["input_ids"], p["mask"], p["width"])
            has = (want != MISSING).all(-1)  # [B, S, L]
            forced, missing = forced + int(has.sum()), missing + int((~has).sum())
            keep = p["mask"].bool().numpy()
            for b, routes in enumerate(native):  # [n_b, L, K] at the row's real tokens
                rec, rows = want[b][keep[b]], has[b][keep[b]]
                same = (np.sort(rec, -1) == np.sort(routes, -1)).all(-1)
                agreed += int(same[rows].sum())
                inside = (rec[..., :, None] == routes[..., None, :]).any(-1)  # [n_b, L, K]
                outside += int((~inside)[rows].sum())
        out.append((forced, missing, agreed / forced, outside / (forced * want.shape[-1])))
    return out


@pytest.mark.parametrize("tolerance", [None, 1.0])
def test_replay_metrics_reach_trls_logs_every_step(checkpoint, monkeypatch, tolerance):
    # 2 micro-batches per optimizer step; the generation is trained twice (num_iterations),
    # the second time by a policy a large step moved: step 1 replays the routes the policy
    # itself made, step 2 routes that it no longer picks everywhere. Tolerance 1.0 keeps a
    # recorded expert only where it is in the trainer's own top-k: the others are replaced.
    trainer, recorded, _ = run(
        checkpoint,
        monkeypatch,
        max_steps=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        learning_rate=0.05,
        replay_tolerance=tolerance,
    )
    try:
        assert trainer.replay_tolerance == tolerance
        logged = [h for h in trainer.state.log_history if "replay/rows_replayed" in h]
        assert [h["step"] for h in logged] == [1, 2]
        expected = expected_replay_metrics(trainer, recorded, steps=2)
        for h, (forced, missing, agreement, outside) in zip(logged, expected, strict=True):
            assert h["replay/rows_replayed"] == forced
            assert h["replay/rows_missing"] == missing
            assert h["replay/native_agreement"] == pytest.approx(agreement, rel=1e-12)
            want_replaced = outside if tolerance == 1.0 else 0.0
            assert h["replay/replace_rate"] == pytest.approx(want_replaced, rel=1e-12, abs=0)
        (_, _, first, _), (_, _, second, moved) = expected
        # Step 1: the rollout's routes are the policy's own (generation's cached decode and
        # the full forward pick the same top-k on all but a row or so, in float32).
        assert first > 0.99
        assert second < 1.0 and moved > 0  # the moved policy picks others on some rows
        if tolerance == 1.0:  # the experts got the policy's own top-k on every forced row
            loss_passes = [p for p in trainer.passes if p["kind"] == "loss"]
            for p in loss_passes:
                for (_, ids), own in zip(p["calls"], p["native_topk"], strict=True):
                    assert torch.equal(ids.sort(-1).values, own.sort(-1).values)
    finally:
        trainer.spy.remove()
        trainer.close_routing_store()


def test_store_is_empty_after_every_step_and_evaluation(checkpoint, monkeypatch):
    trainer, recorded, steps = run(
        checkpoint,
        monkeypatch,
        trainer_cls=RoutingReplayGRPOTrainer,
        max_steps=3,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
        eval_dataset=prompts(2),
    )
    try:
        assert steps.after_step == [0, 0, 0]
        assert steps.after_eval == [0, 0, 0]
        # 4 rows a training step; an evaluation: 8 prompts x num_generations (4)
        assert len(recorded) == 3 * 4 + 3 * 8 * 4
    finally:
        trainer.close_routing_store()
    assert trainer.routing_store is None


def test_rollout_func_is_refused(checkpoint):
    def rollout_func(prompts, trainer):
        raise AssertionError("never called")

    trainer = RoutingReplayGRPOTrainer(
        model=checkpoint,
        reward_funcs=reward_len,
        args=config(max_steps=1),
        train_dataset=prompts(),
        rollout_func=rollout_func,
    )
    with pytest.raises(UnsupportedModelError, match="rollout_func"):
        trainer.train()


def test_trl_routes_checks_each_row_against_its_sample(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_moe(seed=0)
    layout = find_routers(model).layout
    rows = [("ab", "cde"), ("abcd", "e")]
    with RoutingStore.create(f"rr-trl-{tmp_path.name}", layout, 4096) as store:
        refs, width, P = [], 3, 4
        input_ids = torch.zeros((2, P + width), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        rng = np.random.default_rng(0)
        for b, (prompt, completion) in enumerate(rows):
            p = tokenizer(prompt)["input_ids"]
            c = tokenizer(completion)["input_ids"]
            ids = p + c
            routes = layout.random_routes(rng, len(ids))
            refs.append(store.put(f"s{b}", routes, prompt_len=len(p), token_ids=ids))
            input_ids[b, P - len(p) : P + len(c)] = torch.tensor(ids)
            mask[b, P - len(p) : P + len(c)] = 1
        batch = store.read(refs)
        out = trl_routes(batch, refs, input_ids, mask, width)
        assert out.shape == (2, P + width, layout.num_moe_layers, layout.top_k)
        first = store.get("s0")
        np.testing.assert_array_equal(out[0, 2:7].numpy(), layout.decode(first))
        assert (out[0, :2] == MISSING).all() and (out[1, 5:] == MISSING).all()
        masked = mask.clone()
        masked[0, P:] = 0  # TRL's mask_truncated_completions: routes there become -1
        assert (trl_routes(batch, refs, input_ids, masked, width)[0, P:] == MISSING).all()
        swapped = input_ids.clone()
        swapped[1, P] = swapped[1, P] + 1  # a re-tokenised completion
        with pytest.raises(TokenMismatchError, match=r"sample 's1'.*position 4"):
            trl_routes(batch, refs, swapped, mask, width)
        with pytest.raises(InvalidRoutesError, match="room for 4 and 2"):
            trl_routes(batch, refs, input_ids[:, 1:], mask[:, 1:], width - 1)


def test_peft_reference_pass_routes_natively(checkpoint, monkeypatch):
    import peft

    # LoRA on attention; beta > 0 without a ref model: TRL's reference log-probs are the
    # policy with its adapter disabled, which must route natively; the old-logprob pass
    # (steps_per_generation 4 > 2 micro-batches) and the loss replay.
    trainer, recorded, _ = run(
        checkpoint,
        monkeypatch,
        max_steps=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    try:
        assert trainer.ref_model is None
        L = trainer.routing_layout.num_moe_layers
        ref = [p for p in trainer.passes if p["adapters_off"]]
        policy = [p for p in trainer.passes if not p["adapters_off"]]
        assert len(ref) == 1 and [p["kind"] for p in policy] == ["old"] + ["loss"] * 4
        for p in policy:
            assert_forced(p, recorded, L)
        shape = ref[0]["input_ids"].shape
        got = per_layer(ref[0]["calls"], L, shape)
        layers = [j for j, _ in ref[0]["calls"]]
        native = per_layer(zip(layers, ref[0]["native_topk"], strict=True), L, shape)
        for j in range(L):  # the experts got the router's own top-k
            np.testing.assert_array_equal(np.sort(got[j], -1), np.sort(native[j], -1))
    finally:
        trainer.spy.remove()
        trainer.close_routing_store()


def test_resume_trains_the_generation_buffer_the_checkpoint_kept(checkpoint, monkeypatch, tmp_path):
    # One generation every 2 optimizer steps, a checkpoint every step: checkpoint-1 falls
    # inside a generation. Resumed from it, step 2 trains the kept micro-batch with its
    # routes, as the uninterrupted run did, and generates nothing (TRL alone would
    # regenerate, and the routes of the kept rows would be gone with the first process).
    a, recorded, _ = run(
        checkpoint, monkeypatch, output_dir=str(tmp_path / "a"), steps_per_generation=2,
        max_steps=2, save_strategy="steps", save_steps=1,
    )  # fmt: skip
    kept = tmp_path / "a" / "checkpoint-1"
    assert (kept / "routing_replay_buffer-0.pt").exists()
    assert (kept / "routing_replay_routes-0.arrow").exists()
    assert not (tmp_path / "a" / "checkpoint-2" / "routing_replay_buffer-0.pt").exists()
    step2 = [p for p in a.passes if p["kind"] == "loss"][1]
    recorded = dict(recorded)  # run A's puts (the loads below are recorded too, narrow)
    a.close_routing_store()

    generated = []
    real_generate = RoutingReplayGRPOTrainer._generate
    monkeypatch.setattr(
        RoutingReplayGRPOTrainer,
        "_generate",
        lambda self, p: generated.append(p) or real_generate(self, p),
    )
    b = Checked(
        model=checkpoint, reward_funcs=reward_len, train_dataset=prompts(),
        args=config(output_dir=str(tmp_path / "b"), steps_per_generation=2, max_steps=2),
    )  # fmt: skip
    b.train(resume_from_checkpoint=str(kept))
    assert generated == []  # nothing regenerated
    (resumed,) = [p for p in b.passes if p["kind"] == "loss"]
    assert [r.sample_id for r in resumed["refs"]] == [r.sample_id for r in step2["refs"]]
    assert torch.equal(resumed["input_ids"], step2["input_ids"])
    L = b.routing_layout.num_moe_layers
    assert_forced(resumed, recorded, L)  # the experts got the routes run A recorded
    # (The log-probs are not compared: transformers' resume of this Qwen3-MoE checkpoint
    # reports its per-expert weights as unexpected keys and leaves the experts as built.)
    assert b.routing_store.stats().samples == 0  # released after its last micro-step
    b.close_routing_store()
