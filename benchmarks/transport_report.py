"""The transport benchmark's report: ratios, the text table, Markdown, the plot, the JSON."""

from __future__ import annotations

from pathlib import Path

from harness import MB, pyplot, save_plot
from transport_ways import WAYS


def add_ratios(rows: dict) -> None:
    """x slower than this project (same node vs same node, 2 nodes vs 2 nodes)."""
    for way, row in rows.items():
        ref = rows.get("store-x" if WAYS[way][0] == "ray-cross" else "store")
        if way == "store-ray":
            ref = rows.get("store-ray")
        row["x_store"] = row["seconds"] / ref["seconds"] if ref else None
        copy = rows.get("copyto-narrow")
        row["x_copyto_narrow"] = row["seconds"] / copy["seconds"] if copy else None
        mem = row["reader_mem"]
        row["reader_private_over_returned"] = mem["private_delta"] / row["returned_bytes"]
        row["reader_peak_over_returned"] = mem["peak_delta"] / row["returned_bytes"]


# -- report ----------------------------------------------------------------------------


def table(results: dict) -> str:
    lines = []
    for key, w in results["workloads"].items():
        lines.append(
            f"\n{key}: {w['name']}, {w['tokens']:,} tokens, "
            f"{w['int32_bytes'] / 1e9:.2f} GB int32, {w['bytes_per_token_stored']} B/token"
            " narrow"
        )
        lines.append(
            f"{'way':<46}{'seconds':>9}{'ns/tok':>9}{'1st':>9}{'GB/s i32':>9}{'x store':>9}"
            f"{'rd MB':>8}{'rd/ret':>7}{'wr MB':>8}{'shm MB':>8}{'x-node MB':>8}  ok"
        )
        for _way, r in w["rows"].items():
            wr = r["writer_mem"]["peak_delta"] / MB if r["writer_mem"] else float("nan")
            label = r["label"] + (f" *{r['measured_tokens']:,}" if r.get("scaled") else "")
            xs = f"{r['x_store']:9.1f}" if r["x_store"] is not None else f"{'-':>9}"
            lines.append(
                f"{label:<46}{r['seconds']:9.3f}{r['ns_per_token']:9.1f}{first_step_ns(r):9.0f}"
                f"{r['GBps_int32']:9.2f}"
                f"{xs}{r['reader_mem']['peak_delta'] / MB:8.0f}"
                f"{r['reader_private_over_returned']:7.2f}{wr:8.0f}"
                f"{r['shm_used_bytes'] / MB:8.0f}{crossing(r):>8}  "
                f"{'yes' if r['identical'] else 'NO'}"
            )
    if results["scaling"]:
        lines.append("\nscaling (Qwen3-30B-A3B shape, samples of 2500 tokens, no sharing)")
        lines.append(f"{'tokens':>10} {'way':<16}{'seconds':>10}{'ns/token':>10}")
        for r in results["scaling"]:
            lines.append(
                f"{r['tokens']:>10} {r['way']:<16}{r['seconds']:10.4f}{r['ns_per_token']:10.1f}"
            )
    return "\n".join(lines)


def first_step_ns(row: dict) -> float:
    """ns/token of step 0 (fresh reader memory), on the tokens actually measured."""
    return row["seconds_first"] / row.get("measured_tokens", row["tokens"]) * 1e9


def markdown(results: dict) -> str:
    """The tables as Markdown (for docs/performance.md)."""
    out = []
    for key, w in results["workloads"].items():
        out.append(
            f"\n**{key}**: {w['name']}, {w['tokens']:,} tokens, {w['int32_bytes'] / 1e9:.2f} GB "
            f"as int32, {w['bytes_per_token_stored']} B/token stored\n"
        )
        out.append(
            "| way | seconds | ns/token | first step ns/token | GB/s (int32-eq.) | "
            "x this project | x copyto narrow | reader peak MB (x returned, private) | "
            "writer peak MB | /dev/shm MB | MB crossing nodes (measured) |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in w["rows"].values():
            label = r["label"] + (
                f" (on {r['measured_tokens']:,} tokens)" if r.get("scaled") else ""
            )
            x = f"{r['x_store']:.1f}" if r["x_store"] is not None else "-"
            wr = f"{r['writer_mem']['peak_delta'] / MB:.0f}" if r["writer_mem"] else "-"
            out.append(
                f"| {label} | {r['seconds']:.3f} | {r['ns_per_token']:,.0f} | "
                f"{first_step_ns(r):,.0f} | {r['GBps_int32']:.2f} | {x} | "
                f"{r['x_copyto_narrow']:.1f} | {r['reader_mem']['peak_delta'] / MB:.0f} "
                f"({r['reader_private_over_returned']:.2f}) | {wr} | "
                f"{r['shm_used_bytes'] / MB:.0f} | {crossing(r)} |"
            )
    if results["scaling"]:
        out.append("\n| routed tokens | way | seconds | ns/token |")
        out.append("|---|---|---|---|")
        for r in results["scaling"]:
            out.append(
                f"| {r['tokens']:,} | {WAYS[r['way']][1]} | {r['seconds']:.4f} | "
                f"{r['ns_per_token']:,.0f} |"
            )
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    keys = list(results["workloads"])
    ncols = 2 if results["scaling"] else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 5.5), squeeze=False)
    ax = axes[0][0]
    ways = list(next(iter(results["workloads"].values()))["rows"])
    height = 0.8 / max(1, len(keys))
    for j, key in enumerate(keys):
        rows = results["workloads"][key]["rows"]
        y = [i + j * height for i in range(len(ways))]
        ax.barh(y, [rows[w]["ns_per_token"] for w in ways], height=height, label=key)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(ways))])
    ax.set_yticklabels([WAYS[w][1] for w in ways], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ns per routed token, writer process -> reader's torch tensor (log)")
    ax.legend(fontsize=7)
    ax.set_title("Moving routes, per token (lower is better)")
    if results["scaling"]:
        ax = axes[0][1]
        by_way: dict[str, list] = {}
        for r in results["scaling"]:
            by_way.setdefault(r["way"], []).append((r["tokens"], r["ns_per_token"]))
        for way, pts in by_way.items():
            ax.plot(*zip(*pts, strict=True), marker="o", label=WAYS[way][1])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("routed tokens in the batch")
        ax.set_ylabel("ns per token")
        ax.set_title("Scaling: per-token cost (Qwen3-30B-A3B shape)")
        ax.legend(fontsize=7)
    save_plot(fig, path)


def strip(results: dict) -> dict:
    """The results without the routes arrays (kept only for the test)."""
    drop = ("routes", "expected_routes")
    out = {k: v for k, v in results.items() if k not in ("workloads", "scaling")}
    out["workloads"] = {
        key: {
            **w,
            "rows": {
                way: {k: v for k, v in r.items() if k not in drop} for way, r in w["rows"].items()
            },
        }
        for key, w in results["workloads"].items()
    }
    out["scaling"] = [{k: v for k, v in r.items() if k not in drop} for r in results["scaling"]]
    return out


def crossing(row: dict) -> str:
    """MB measured crossing nodes; "-" in results from before it was measured."""
    return "-" if "bytes_crossing" not in row else f"{row['bytes_crossing'] / MB:.0f}"
