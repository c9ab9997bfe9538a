"""Plots of benchmarks/serving_gpu.py's rows: throughput and latency percentiles against concurrency.

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python benchmarks/plot_serving.py [--results benchmarks/results/serving_gpu.jsonl] [--out docs]

Uses the newest (date, device, model) group of `throughput_vs_concurrency` rows; writes
serving_throughput.png and serving_latency.png.
"""

from __future__ import annotations

import argparse
import json
import os


def newest_sweep(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r["benchmark"] == "throughput_vs_concurrency"]
    if not rows:
        raise SystemExit(f"{path} has no throughput_vs_concurrency rows: run benchmarks/serving_gpu.py first")
    key = max((r["date"], r["device"], r["config"]["model"]) for r in rows)
    group = [r for r in rows if (r["date"], r["device"], r["config"]["model"]) == key]
    latest = {}
    for r in group:  # a concurrency measured twice that day: the later row
        latest[r["config"]["concurrency"]] = r
    return [latest[c] for c in sorted(latest)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="benchmarks/results/serving_gpu.jsonl")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = newest_sweep(args.results)
    c = [r["config"]["concurrency"] for r in rows]
    first = rows[0]
    title = (f"{first['config']['model']} {first['config']['dtype']}, {first['config']['input_len']} in / "
             f"{first['config']['output_len']} out, {first['device']}, {first['date']}")
    os.makedirs(args.out, exist_ok=True)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(c, [r["value"] for r in rows], "o-")
    ax.set(xscale="log", xlabel="requests at once", ylabel="output tokens / s", title=title, xticks=c, xticklabels=c)
    ax.title.set_fontsize(8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "serving_throughput.png"), dpi=120)

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for q in ("p50", "p90", "p99"):
        left.plot(c, [r["config"][f"ttft_{q}_s"] for r in rows], "o-", label=q)
        right.plot(c, [1e3 * r["config"][f"itl_{q}_s"] for r in rows], "o-", label=q)
    left.set(xscale="log", xlabel="requests at once", ylabel="time to first token (s)")
    right.set(xscale="log", xlabel="requests at once", ylabel="inter-token latency (ms)")
    for ax in (left, right):
        ax.set(xticks=c, xticklabels=c)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "serving_latency.png"), dpi=120)
    print(f"wrote {args.out}/serving_throughput.png and serving_latency.png from {len(rows)} rows")


if __name__ == "__main__":
    main()
