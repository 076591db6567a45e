"""Why replay exists: routing and log-prob mismatch between bf16 rollout and fp32 training.

    python benchmarks/mismatch.py            # 16 prompts x (32 prompt + 64 new) tokens per model
    python benchmarks/mismatch.py --quick    # 4 x (16 + 16)

For a tiny Qwen3-MoE and a tiny DeepSeek-V3 (benchmarks/tiny_moe.py), a bfloat16 copy
samples completions under `capture`; the float32 model then forwards the same sequences
without and with `replay` of the captured routes. Reported per model and mode:

- routing agreement (routing_agreement): fraction of (token, MoE layer) top-k sets equal to
  the rollout's, fraction of tokens with at least one differing layer;
- log-prob mismatch on the sampled completion tokens: mean KL(inference || train) over the
  vocabulary, the k3 estimator exp(d) - 1 - d with d = logp_train - logp_inf, and mean
  |logp_train - logp_inf|.

Prints a table, writes benchmarks/results/mismatch.json and benchmarks/results/mismatch.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_moe import MODELS, VOCAB, build

from routing_replay import (
    MISSING,
    RoutingLayout,
    capture,
    replay,
    routing_agreement,
)

RESULTS = Path(__file__).parent / "results"


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


def train_forward(model, sequences_BT, mask_BT, routes_BTLK=None):
    """float32 forward over the rollout (replaying routes if given): logits and native routes."""
    with torch.no_grad(), capture(model) as cap:
        if routes_BTLK is None:
            logits = model(input_ids=sequences_BT, attention_mask=mask_BT).logits
        else:
            with replay(model, routes_BTLK, layout=cap.layout):
                logits = model(input_ids=sequences_BT, attention_mask=mask_BT).logits
    return logits.float(), cap.routes()


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
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (num_prompts,), generator=gen)
    prompts = torch.zeros(num_prompts, prompt_len, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for b, n in enumerate(lengths.tolist()):  # left padding, as an engine batch would have
        prompts[b, prompt_len - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[b, prompt_len - n :] = 1

    start = time.perf_counter()
    sequences, inf_logits, recorded = rollout(model_bf16, prompts, mask, new_tokens, seed)
    full_mask = torch.cat([mask, torch.ones(num_prompts, new_tokens, dtype=torch.long)], 1)
    routes = left_pad(recorded, sequences.shape[1], layout)

    result = {"layout": json.loads(layout.to_json()), "tokens": int(full_mask.sum())}
    for mode, replayed in (("native", None), ("replay", routes)):
        logits, used = train_forward(model, sequences, full_mask, replayed)
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


def print_table(results):
    header = (
        f"{'model':12} {'mode':7} {'router agr':>10} {'tokens w/ diff':>14} {'KL vocab':>10} "
        f"{'KL k3':>10} {'|dlogp|':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        for mode in ("native", "replay"):
            r = res[mode]
            a = r["agreement"]
            print(
                f"{name:12} {mode:7} {a['router_agreement']:>10.2%} "
                f"{a['token_disagreement']:>14.2%} {r['kl_vocab']:>10.2e} {r['kl_k3']:>10.2e} "
                f"{r['abs_logprob_diff']:>9.2e}"
            )


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = np.arange(len(names))
    width = 0.38
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("router decisions that differ", lambda r: 1 - r["agreement"]["router_agreement"], False),
        ("tokens with a differing layer", lambda r: r["agreement"]["token_disagreement"], False),
        ("KL(inference || train), per token", lambda r: r["kl_vocab"], True),
    ]
    for ax, (title, value, log) in zip(axes, panels, strict=True):
        for i, (mode, color) in enumerate((("native", "#d95f02"), ("replay", "#1b9e77"))):
            vals = [value(results[n][mode]) for n in names]
            label = "fp32 trainer routes natively" if mode == "native" else "with replay"
            bars = ax.bar(x + (i - 0.5) * width, vals, width, label=label, color=color)
            fmt = "{:.1e}" if log else "{:.1%}"
            ax.bar_label(bars, [fmt.format(v) for v in vals], fontsize=8)
        ax.set_xticks(x, names)
        ax.set_title(title, fontsize=10)
        if log:  # bars start a decade below the smallest, so heights are not exaggerated
            ax.set_yscale("log")
            low = min(value(results[n][m]) for n in names for m in ("native", "replay"))
            ax.set_ylim(bottom=low / 10)
        else:
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    axes[0].legend(fontsize=8)
    fig.suptitle("bf16 rollout vs fp32 training forward, tiny random-init MoE models", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    """Run both models, print the table, write JSON and PNG under benchmarks/results/."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run of the same path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts, prompt_len, new = (4, 16, 16) if args.quick else (16, 32, 64)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {name: run_model(name, prompts, prompt_len, new, args.seed) for name in MODELS}
    print_table(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        "setup": {
            "prompts": prompts,
            "prompt_len_max": prompt_len,
            "new_tokens": new,
            "seed": args.seed,
            "rollout_dtype": "bfloat16",
            "train_dtype": "float32",
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
        },
        "models": results,
    }
    suffix = "-quick" if args.quick else ""
    (RESULTS / f"mismatch{suffix}.json").write_text(json.dumps(report, indent=2))
    plot(results, RESULTS / f"mismatch{suffix}.png")
    print(f"wrote {RESULTS / f'mismatch{suffix}.json'} and .png")


if __name__ == "__main__":
    main()
