"""The mismatch benchmark's report: its two tables and the plot the docs show."""

from __future__ import annotations

import numpy as np
from harness import pyplot, save_plot


def print_off_policy_table(results):
    header = (
        f"{'model':12} {'mini-batches':>12} {'mode':7} {'router agr':>10} {'last mb agr':>11} "
        f"{'KL vocab':>10} {'last mb KL':>10} {'|dlogp|':>9} {'replaced':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        for m, part in res["off_policy"].items():
            for mode in part["all"]:  # none, R2, R3, R3@r
                a, last = part["all"][mode], part["per_minibatch"][-1][mode]
                print(
                    f"{name:12} {m:>12} {mode:7} {a['router_agreement']:>10.2%} "
                    f"{last['router_agreement']:>11.2%} {a['kl_vocab']:>10.2e} "
                    f"{last['kl_vocab']:>10.2e} {a['abs_logprob_diff']:>9.2e} "
                    f"{a['replace_rate']:>9.2%}"
                )


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


COLORS = {
    "native": "#d95f02",
    "replay": "#1b9e77",
    "none": "#d95f02",
    "R2": "#7570b3",
    "R3": "#1b9e77",
    "R3@0.9": "#66a61e",
    "R3@0.99": "#e7298a",
    "R3@0.999": "#a6761d",
}


def plot(results, path):
    from matplotlib.ticker import PercentFormatter

    plt = pyplot()
    names = list(results)
    x = np.arange(len(names))
    width = 0.38
    fig = plt.figure(figsize=(13, 7.8))
    grid = fig.add_gridspec(2, 12)
    axes = [fig.add_subplot(grid[0, 4 * i : 4 * i + 4]) for i in range(3)]
    panels = [
        ("router decisions that differ", lambda r: 1 - r["agreement"]["router_agreement"], False),
        ("tokens with a differing layer", lambda r: r["agreement"]["token_disagreement"], False),
        ("KL(inference || train), per token", lambda r: r["kl_vocab"], True),
    ]
    for ax, (title, value, log) in zip(axes, panels, strict=True):
        for i, mode in enumerate(("native", "replay")):
            vals = [value(results[n][mode]) for n in names]
            label = "fp32 trainer routes natively" if mode == "native" else "with replay"
            bars = ax.bar(x + (i - 0.5) * width, vals, width, label=label, color=COLORS[mode])
            fmt = "{:.1e}" if log else "{:.1%}"
            ax.bar_label(bars, [fmt.format(v) for v in vals], fontsize=8)
        ax.set_xticks(x, names)
        ax.set_title(title, fontsize=10)
        if log:  # bars start a decade below the smallest, so heights are not exaggerated
            ax.set_yscale("log")
            low = min(value(results[n][m]) for n in names for m in ("native", "replay"))
            ax.set_ylim(bottom=low / 10)
        else:
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    axes[0].legend(fontsize=8)
    # Off-policy: per model, agreement and KL with the rollout by mini-batch of the rollout.
    for col, name in enumerate(names):
        agr = fig.add_subplot(grid[1, 6 * col : 6 * col + 3])
        kl = fig.add_subplot(grid[1, 6 * col + 3 : 6 * col + 6])
        for m, part in results[name]["off_policy"].items():
            style = "-o" if m == max(results[name]["off_policy"], key=int) else "--s"
            steps = np.arange(1, len(part["per_minibatch"]) + 1)
            for mode in part["all"]:
                rows = [e[mode] for e in part["per_minibatch"]]
                label = f"{mode}, {m} mini-batches"
                agr.plot(
                    steps,
                    [r["router_agreement"] for r in rows],
                    style,
                    color=COLORS[mode],
                    label=label,
                    ms=4,
                )
                kl.plot(steps, [r["kl_vocab"] for r in rows], style, color=COLORS[mode], ms=4)
        agr.set_title(f"{name}: router agreement with rollout", fontsize=10)
        agr.yaxis.set_major_formatter(PercentFormatter(1.0))
        kl.set_title(f"{name}: KL(inference || train)", fontsize=10)
        kl.set_yscale("log")
        for ax in (agr, kl):
            ax.set_xlabel("mini-batch of the rollout (1 = on-policy)", fontsize=8)
            ax.set_xticks(steps)
        if col == 0:
            agr.legend(fontsize=7)
    fig.suptitle(
        "bf16 rollout vs fp32 training forward, tiny random-init MoE models; "
        "below: later mini-batches train moved weights (none / R2 / R3)",
        fontsize=11,
    )
    save_plot(fig, path)
