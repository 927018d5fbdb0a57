#!/usr/bin/env python3
"""Markdown tables for docs/BENCHMARKS.md from one device run: `qmm bench --json` and compare_torch.py --json.
    python3 bench/summarize.py out/bench.json [out/compare.json]
"""
import json
import statistics
import sys


def main(bench_path, compare_path=None):
    d = json.load(open(bench_path))
    res = d["results"]
    for r in res:
        r.setdefault("tokens", r["m"])
    by = {(r["op"], r["mode"], r["shape"], r["tokens"]): r for r in res}
    c = d["ceilings"]
    hold = d.get("hold_ms", 0)
    held = f", each case held {hold} ms before timing (sustained clocks)" if hold else ""
    print(f"Run: {d['device']}, {d['date']}, commit {d['commit']}, {d['repeats']} timed calls per case (median)"
          f"{held}.\n")
    print(f"Ceilings measured at the start: copy {c['copy_GBps']:.0f} GB/s (read + write), bf16 GEMM "
          f"{c['bf16_TFLOPs']:.0f} TFLOP/s, TF32 {c['tf32_TFLOPs']:.0f}, FP32 {c['fp32_TFLOPs']:.1f}.\n")

    if compare_path:
        cmp = json.load(open(compare_path))
        print("### qmm against PyTorch (torch time / qmm time; ≥ 1 means qmm is faster)\n")
        print("| op | mode | cases | min | median | worst case |\n| --- | --- | --- | --- | --- | --- |")
        groups = {}
        for r in cmp:
            groups.setdefault((r["op"], r["mode"]), []).append(r)
        for (op, mode), rows in sorted(groups.items()):
            sp = [x["speedup_vs_torch"] for x in rows]
            w = min(rows, key=lambda x: x["speedup_vs_torch"])
            print(f"| {op} | {mode} | {len(rows)} | {min(sp):.2f} | {statistics.median(sp):.2f} | "
                  f"{w['shape']} M={w['m']} ({w['qmm_us']:.1f} vs {w['torch_us']:.1f} µs) |")
        print()
        with_bnb = [r for r in cmp if "speedup_vs_bnb" in r]
        if with_bnb:  # compare_torch.py timed bitsandbytes too
            print("### qmm against bitsandbytes, same run (bitsandbytes time / qmm time; ≥ 1 means qmm is faster)\n")
            print("| op | mode | shape | M | qmm µs | bitsandbytes µs | bitsandbytes / qmm |\n"
                  "| --- | --- | --- | --- | --- | --- | --- |")
            for r in with_bnb:
                print(f"| {r['op']} | {r['mode']} | {r['shape']} | {r['m']} | {r['bnb_qmm_us']:.1f} | "
                      f"{r['bnb_us']:.1f} | {r['speedup_vs_bnb']:.2f} |")
            print()

    print("### BF16-compute on f32 storage (M ≥ 512): speed against bf16 storage and against TF32\n")
    print("| op | shape | tokens | bf16 µs | f32/bf16 µs | TF32 µs | vs bf16 (≥ 0.75) | vs TF32 (> 1) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (op, mode, shape, m), r in by.items():
        if mode != "f32/bf16" or m < 512 or op.startswith("batched"):
            continue
        b, t = by[(op, "bf16", shape, m)], by[(op, "tf32", shape, m)]
        print(f"| {op} | {shape} | {m} | {b['median_us']:.1f} | {r['median_us']:.1f} | {t['median_us']:.1f} | "
              f"{b['median_us'] / r['median_us']:.2f} | {t['median_us'] / r['median_us']:.2f} |")
    print()

    print("### Memory-bound ops (fraction of the measured copy bandwidth)\n")
    print("| op | mode | shape | µs | GB/s | % of copy |\n| --- | --- | --- | --- | --- | --- |")
    for r in res:
        if r["op"].startswith("swiglu") or r["op"] in ("nf4_dequantize", "nf4_quantize"):
            frac = f"{100 * r['gbps'] / c['copy_GBps']:.0f}%" if c["copy_GBps"] > 0 else "-"
            print(f"| {r['op']} | {r['mode']} | {r['shape']} | {r['median_us']:.1f} | {r['gbps']:.0f} | {frac} |")
    print()

    print("### NF4 GEMMs (double-quantized weights, bf16 activations) against cuBLAS bf16 on the dequantized weight\n")
    print("µs: device time (CUDA-graph replays); eager µs: one call at a time as a program issues it.\n")
    print("| op | path | shape | M | µs | eager µs | GB/s | % roof | × bf16 cuBLAS |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res:
        if not r["op"].startswith("nf4_gemm") and r["op"] != "nf4_gate_up":
            continue
        ratio = r.get("ratio", {})
        roof = f"{100 * r['roofline_fraction']:.0f}%" if "roofline_fraction" in r else "-"
        print(f"| {r['op']} | {r['mode']} | {r['shape']} | {r['m']} | {r['median_us']:.1f} | {r.get('eager_us', 0):.1f} | "
              f"{r['gbps']:.0f} | {roof} | {ratio.get('value', 0):.2f} {ratio.get('vs', '')} |")
    print()

    mlp = [r for r in res if r["op"] == "mlp_block"]
    if mlp:
        torch_eager = {}
        if compare_path:
            for x in json.load(open(compare_path)):
                if x["op"] == "mlp_block":
                    torch_eager[(x["shape"], x["mode"])] = x.get("torch_eager_us")
        print("### LoRA MLP block, forward + backward (rank 16, bf16 activations)\n")
        print("| block | base | tokens | device µs | eager µs | torch eager µs (bf16 base) | torch / qmm eager |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        for r in mlp:
            te = torch_eager.get((r["shape"], r["mode"]))
            vs = f"{te / r['eager_us']:.2f}" if te else "-"
            print(f"| {r['shape']} | {r['mode']} | {r['m']} | {r['median_us']:.1f} | {r.get('eager_us', 0):.1f} | "
                  f"{te or 0:.1f} | {vs} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
