#!/usr/bin/env python3
"""Draws the roofline chart of a `qmm bench --json` file: achieved TFLOP/s against arithmetic intensity,
under the copy-bandwidth and GEMM ceilings measured at the start of that run.
    python3 bench/plot_roofline.py out/bench.json out/roofline.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    data = json.load(open(src))
    c = data["ceilings"]
    bw = c["copy_GBps"] * 1e9
    fig, ax = plt.subplots(figsize=(10, 6.5))
    xs = [10 ** (i / 20) for i in range(-40, 100)]
    for name, key, style in (("bf16", "bf16_TFLOPs", "-"), ("tf32", "tf32_TFLOPs", "--"), ("fp32", "fp32_TFLOPs", ":")):
        peak = c[key] * 1e12
        ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], "k" + style, lw=1, label=f"{name} ceiling {c[key]:.0f}")
    groups = {}
    for r in data["results"]:
        if r["flops"] <= 0:
            continue
        groups.setdefault(f"{r['op']} {r['mode']}", []).append((r["flops"] / r["bytes"], r["tflops"]))
    for label, pts in sorted(groups.items()):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"qmm on {data['device']} ({data['date']}, commit {data['commit']}); copy {c['copy_GBps']:.0f} GB/s")
    ax.legend(fontsize=6, ncol=2, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=130)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
