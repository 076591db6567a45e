"""Why replay exists: routing and log-prob mismatch between bf16 rollout and fp32 training.

    python benchmarks/mismatch.py            # 16 prompts x (32 prompt + 64 new) tokens per model
    python benchmarks/mismatch.py --quick    # 4 x (16 + 16); off-policy part: 8 x (16 + 8)

For a tiny Qwen3-MoE and a tiny DeepSeek-V3 (benchmarks/tiny_moe.py), a bfloat16 copy
samples completions under `capture`; the float32 model then forwards the same sequences
without and with `replay` of the captured routes. Reported per model and mode:

- routing agreement (routing_agreement): fraction of (token, MoE layer) top-k sets equal to
  the rollout's, fraction of tokens with at least one differing layer;
- log-prob mismatch on the sampled completion tokens: mean KL(inference || train) over the
  vocabulary, the k3 estimator exp(d) - 1 - d with d = logp_train - logp_inf, and mean
  |logp_train - logp_inf|.

Off-policy (none / R2 / R3 / R3 with a tolerance): the float32 trainer is trained for
several rollouts; each rollout (bf16 engine synced to the trainer's weights, engine routes
captured = R3's routes) is forwarded once by the trainer before any update (the
old-logprob pass, its own routes captured = R2's routes), then split into 2 or 4
mini-batches with an optimizer step after each, so later mini-batches train moved weights
(global batch = 2x or 4x the mini-batch). Before each step the mini-batch is forwarded
six ways on the same weights (natively, replaying R2's routes, replaying R3's, and R3's
with tolerance 0.9, 0.99 and 0.999: a recorded expert the trainer scores below that ratio
of its weakest own top-k expert is replaced by its own) and compared with the rollout: routing
agreement with the engine's routes, the log-prob mismatch above, and the share of slots
the tolerance replaced. The update is a policy-gradient step on a synthetic reward (share
of completion tokens in the lower half of the vocabulary, standardised over the rollout),
taken with the native loss, so all modes see one trajectory.

Prints tables, writes benchmarks/results/mismatch.json and docs/img/mismatch.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import PLOTS, RESULTS, machine, write_json
from mismatch_report import plot, print_off_policy_table, print_table
from tiny_moe import MODELS, VOCAB, build

from routing_replay import MISSING, RoutingLayout, capture, replay
from routing_replay.model.agreement import routing_agreement

# The trainer routes natively; replays its old-logprob pass (R2); the engine's routes (R3);
# the engine's with a tolerance (R3@r: a recorded expert the trainer scores below r x its
# weakest own top-k expert is replaced by its own).
TOLERANCES = (0.9, 0.99, 0.999)
MODES = ("none", "R2", "R3", *(f"R3@{r}" for r in TOLERANCES))
MINIBATCHES = (2, 4)  # mini-batches (optimizer steps) per rollout


def rollout(model_bf16, prompts_BP, mask_BP, new_tokens, seed):
    """Sample with the bf16 model under capture: sequences, per-step logits, per-sample routes."""
    torch.manual_seed(seed)
    with capture(model_bf16) as cap, torch.no_grad():
        out = model_bf16.generate(
            input_ids=prompts_BP,
            attention_mask=mask_BP,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    logits_BNV = torch.stack(out.logits, dim=1).float()
    return out.sequences, logits_BNV, cap.routes()


def left_pad(routes, width, layout):
    """Per-sample [T, L, K] routes into [B, width, L, K], -1 (route natively) on the padding."""
    out = np.full((len(routes), width, layout.num_moe_layers, layout.top_k), MISSING, np.int32)
    for b, r in enumerate(routes):
        out[b, width - len(r) :] = r
    return torch.from_numpy(out)


def train_forward(model, sequences_BT, mask_BT, routes_BTLK=None, grad=False, tolerance=None):
    """float32 forward over the rollout (replaying routes if given): logits, the routes used
    and the share of forced slots a tolerance replaced."""
    replaced = 0.0
    with torch.set_grad_enabled(grad), capture(model) as cap:
        if routes_BTLK is None:
            logits = model(input_ids=sequences_BT, attention_mask=mask_BT).logits
        else:
            with replay(model, routes_BTLK, layout=cap.layout, tolerance=tolerance) as block:
                logits = model(input_ids=sequences_BT, attention_mask=mask_BT).logits
            replaced = block.metrics()["replay/replace_rate"]
    return logits.float(), cap.routes(), replaced


def prompts_for(num_prompts, prompt_len, seed):
    """Random left-padded prompts of prompt_len/2..prompt_len tokens, and their mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (num_prompts,), generator=gen)
    prompts = torch.zeros(num_prompts, prompt_len, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for b, n in enumerate(lengths.tolist()):  # left padding, as an engine batch would have
        prompts[b, prompt_len - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[b, prompt_len - n :] = 1
    return prompts, mask


def advantages(sequences_BT, new_tokens):
    """Synthetic reward (share of completion ids below VOCAB / 2), standardised over the rollout:
    a fixed direction for the policy to move in, as an RL reward gives one."""
    reward = (sequences_BT[:, -new_tokens:] < VOCAB // 2).float().mean(1)
    return (reward - reward.mean()) / (reward.std() + 1e-6)


def pg_loss(logits_BTV, sequences_BT, adv_B, new_tokens):
    """-A * log p(sampled token), averaged over completion tokens (REINFORCE)."""
    logp = logits_BTV[:, -new_tokens - 1 : -1].log_softmax(-1)
    logp = logp.gather(-1, sequences_BT[:, -new_tokens:, None])[..., 0]
    return -(adv_B[:, None] * logp).mean()


def logprob_mismatch(inf_logits_BNV, train_logits_BTV, sequences_BT, new_tokens):
    """KL over the vocab, k3 and |d logp| on the sampled tokens, averaged over completions."""
    predict = train_logits_BTV[:, -new_tokens - 1 : -1]  # positions predicting the new tokens
    sampled_BN = sequences_BT[:, -new_tokens:]
    lp_inf = torch.log_softmax(inf_logits_BNV, dim=-1)
    lp_train = torch.log_softmax(predict, dim=-1)
    kl_full = (lp_inf.exp() * (lp_inf - lp_train)).sum(-1)
    d = (lp_train - lp_inf).gather(-1, sampled_BN[..., None])[..., 0]
    return {
        "kl_vocab": float(kl_full.mean()),
        "kl_k3": float((d.exp() - 1 - d).mean()),
        "abs_logprob_diff": float(d.abs().mean()),
    }


def run_model(name, num_prompts, prompt_len, new_tokens, seed):
    model = build(name, seed)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    layout = RoutingLayout.from_hf_config(model.config)
    prompts, mask = prompts_for(num_prompts, prompt_len, seed)

    start = time.perf_counter()
    sequences, inf_logits, recorded = rollout(model_bf16, prompts, mask, new_tokens, seed)
    full_mask = torch.cat([mask, torch.ones(num_prompts, new_tokens, dtype=torch.long)], 1)
    routes = left_pad(recorded, sequences.shape[1], layout)

    result = {"layout": json.loads(layout.to_json()), "tokens": int(full_mask.sum())}
    for mode, replayed in (("native", None), ("replay", routes)):
        logits, used, _ = train_forward(model, sequences, full_mask, replayed)
        agreement = routing_agreement(recorded, used, layout)
        result[mode] = {
            "agreement": agreement.as_dict(),
            **logprob_mismatch(inf_logits, logits, sequences, new_tokens),
        }
        if mode == "replay":
            # Every replayed row (all but each sample's last, never-forwarded token) must match.
            replayed_rows = sum(int((r != MISSING).all(-1).sum()) for r in recorded)
            assert agreement.num_decisions == replayed_rows, (agreement, replayed_rows)
            assert agreement.router_agreement == 1.0, agreement
    result["seconds"] = time.perf_counter() - start
    return result


def off_policy(name, minibatches, rollouts, num_prompts, prompt_len, new_tokens, lr, seed):
    """none / R2 / R3 over `rollouts` rollouts of `minibatches` optimizer steps each: per
    mini-batch index (0 = the weights that generated the rollout), metrics vs the rollout."""
    model = build(name, seed)
    layout = RoutingLayout.from_hf_config(model.config)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    runs = [[] for _ in range(minibatches)]  # per mini-batch index, one entry per rollout
    start = time.perf_counter()
    for r in range(rollouts):
        engine = copy.deepcopy(model).to(torch.bfloat16)  # weights synced to the engine
        prompts, mask = prompts_for(num_prompts, prompt_len, seed + 1 + r)
        sequences, inf_logits, engine_routes = rollout(engine, prompts, mask, new_tokens, seed + r)
        full_mask = torch.cat([mask, torch.ones(num_prompts, new_tokens, dtype=torch.long)], 1)
        # The old-logprob pass: the trainer's own routes before any update (R2 records them).
        _, old_routes, _ = train_forward(model, sequences, full_mask)
        width = sequences.shape[1]
        routes = {
            "R2": left_pad(old_routes, width, layout),
            "R3": left_pad(engine_routes, width, layout),
        }
        routes.update({f"R3@{r}": routes["R3"] for r in TOLERANCES})
        adv = advantages(sequences, new_tokens)
        for i, rows in enumerate(torch.arange(num_prompts).chunk(minibatches)):
            picked = rows.tolist()
            result, native_logits = {}, None
            for mode in MODES:
                logits, used, replaced = train_forward(
                    model,
                    sequences[rows],
                    full_mask[rows],
                    routes[mode][rows] if mode in routes else None,
                    grad=mode == "none",  # the native forward takes the update
                    tolerance=float(mode.split("@")[1]) if "@" in mode else None,
                )
                if mode == "none":
                    native_logits = logits
                agreement = routing_agreement([engine_routes[b] for b in picked], used, layout)
                result[mode] = {
                    "router_agreement": agreement.router_agreement,
                    "num_decisions": agreement.num_decisions,
                    "replace_rate": replaced,
                    **logprob_mismatch(
                        inf_logits[rows], logits.detach(), sequences[rows], new_tokens
                    ),
                }
                replayed = {"R2": old_routes, "R3": engine_routes}.get(mode)
                if replayed is not None:  # replay forced every recorded row, exactly
                    forced = routing_agreement([replayed[b] for b in picked], used, layout)
                    rows_recorded = sum(int((replayed[b] != MISSING).all(-1).sum()) for b in picked)
                    assert forced.router_agreement == 1.0, (mode, forced)
                    assert forced.num_decisions == rows_recorded, (mode, forced, rows_recorded)
            optimizer.zero_grad()
            pg_loss(native_logits, sequences[rows], adv[rows], new_tokens).backward()
            optimizer.step()
            runs[i].append(result)
    return {
        "per_minibatch": [_pooled(entries) for entries in runs],
        "all": _pooled([e for entries in runs for e in entries]),
        "seconds": time.perf_counter() - start,
    }


def _pooled(entries):
    """Per mode: agreement over all decisions of `entries`, mean of the log-prob metrics."""
    out = {}
    for mode in MODES:
        ms = [e[mode] for e in entries]
        n = sum(m["num_decisions"] for m in ms)
        out[mode] = {
            "router_agreement": sum(m["router_agreement"] * m["num_decisions"] for m in ms) / n,
            "num_decisions": n,
            "replace_rate": sum(m["replace_rate"] * m["num_decisions"] for m in ms) / n,
            **{
                k: float(np.mean([m[k] for m in ms]))
                for k in ("kl_vocab", "kl_k3", "abs_logprob_diff")
            },
        }
    return out


LR = 3e-5  # per-update drift of the tiny models: routing moves, as staleness moves it at scale


def off_policy_setup(quick, lr=LR):
    """The off-policy part's sizes: rollouts, rows and tokens per rollout, optimizer."""
    return {
        "rollouts": 2 if quick else 3,
        "prompts": 8 if quick else 16,
        "prompt_len_max": 16 if quick else 32,
        "new_tokens": 8 if quick else 64,
        "minibatches": list(MINIBATCHES),
        "optimizer": "Adam",
        "lr": lr,
        "update": "REINFORCE on a synthetic reward, native loss, after every mini-batch",
    }


def run(prompts, prompt_len, new, op, seed, models=tuple(MODELS)):
    """Both parts for each model: {name: {..., "off_policy": {"2": ..., "4": ...}}}."""
    results = {}
    for name in models:
        results[name] = run_model(name, prompts, prompt_len, new, seed)
        results[name]["off_policy"] = {
            str(m): off_policy(
                name, m, op["rollouts"], op["prompts"], op["prompt_len_max"], op["new_tokens"],
                op["lr"], seed,
            )
            for m in op["minibatches"]
        }  # fmt: skip
    return results


def main() -> None:
    """Run both models, print the table, write JSON and PNG under benchmarks/results/."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run of the same path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=LR, help="Adam lr of the off-policy part")
    args = parser.parse_args()
    prompts, prompt_len, new = (4, 16, 16) if args.quick else (16, 32, 64)
    op = off_policy_setup(args.quick, args.lr)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = run(prompts, prompt_len, new, op, args.seed)
    print_table(results)
    print()
    print_off_policy_table(results)
    report = {
        "setup": {
            "prompts": prompts,
            "prompt_len_max": prompt_len,
            "new_tokens": new,
            "seed": args.seed,
            "rollout_dtype": "bfloat16",
            "train_dtype": "float32",
            "off_policy": op,
        },
        "machine": machine(),
        "models": results,
    }
    suffix = "-quick" if args.quick else ""
    write_json(RESULTS / f"mismatch{suffix}.json", report, indent=2)
    plot(results, PLOTS / f"mismatch{suffix}.png")
    print(f"wrote {RESULTS / f'mismatch{suffix}.json'} and {PLOTS / f'mismatch{suffix}.png'}")


if __name__ == "__main__":
    main()
