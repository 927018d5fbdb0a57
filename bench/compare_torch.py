#!/usr/bin/env python3
"""Times PyTorch on the cases of a `qmm bench --json` file, in the same process run, and prints qmm/torch.

For each qmm result: the same op, mode and shape through torch.matmul (bf16, TF32, FP32; BF16-compute on f32 storage
as torch users write it: cast to bf16, multiply, cast back), PyTorch's eager SwiGLU (silu(g) * u, and its autograd
backward), and for NF4 GEMMs torch.matmul on the dequantized bf16 weight (timed once per shape, compared with
every NF4 path qmm timed there: auto and the forced ones). Inputs are rotated over more than 4x the
L2 size. Both sides are timed the same way: device time per call from CUDA-graph replays (no host gaps; the
median of 7 replays of one graph of many calls) where the call can be captured, else CUDA events around each of
--repeats calls after warm-up; torch's eager per-call time is printed beside it.
Where bitsandbytes loads (scripts/fetch-wheels brings it to the GPU machine), its NF4 forward (matmul_4bit), input
gradient (its backward: dequantize, then matmul) and NF4 LoRA block are timed on the same cases too: what a 4-bit
user runs today, in the same run.
    python3 bench/compare_torch.py --qmm-json out/bench.json [--json out/compare.json]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

try:
    import bitsandbytes as bnb
except Exception:  # not installed, or not for this PyTorch
    bnb = None

L2_BYTES = 60 << 20


def time_us(fn, sets, repeats, warmup=5):
    for i in range(warmup):
        fn(i % sets)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for r in range(repeats):
        starts[r].record()
        fn(r % sets)
        ends[r].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def time_graph_us(fn, sets, replays=7):
    """Device time per call: one CUDA graph of `calls` calls, replayed; None where fn cannot be captured."""
    calls = max(10, min(30, 2 * sets))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
            for i in range(3):
                fn(i % sets)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % sets)
        graph.replay()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - not capturable: the caller falls back to eager timing
        torch.cuda.synchronize()
        return None
    per_call = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(per_call)


def n_sets(nbytes):
    return max(1, min(32, -(-4 * L2_BYTES // max(int(nbytes), 1))))


def rand(shape, dtype):
    return torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)


def dense_case(r):
    """Returns (fn(i), sets) for a dense or NF4 GEMM result, or None."""
    op, mode, m, n, k = r["op"], r["mode"], r["m"], r["n"], r["k"]
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    store = torch.bfloat16 if mode == "bf16" or mode.startswith("dq") else torch.float32
    bf16_compute = mode == "f32/bf16"
    # (shape of first operand, second operand, how to multiply) per op, in the qmm bench's storage layout
    if op in ("gemm_bt", "nf4_gemm"):
        a_shape, b_shape, mul = (m, k), (n, k), lambda a, b: a @ b.t()
    elif op in ("gemm", "nf4_gemm_backward_a"):
        # for nf4_gemm_backward_a, dA[M,K] = dC[M,N] * W[N,K]: qmm reports the GEMM's m=M, n=K, k=N
        a_shape, b_shape, mul = (m, k), (k, n), lambda a, b: a @ b
    elif op == "gemm_backward_a":
        a_shape, b_shape, mul = (m, k), (n, k), lambda a, b: a @ b.t()
    elif op == "gemm_backward_b":  # dB = A^T dC; qmm reports gemm m, n, k: A [k, m], dC [k, n]
        a_shape, b_shape, mul = (k, m), (k, n), lambda a, b: a.t() @ b
    elif op in ("batched_qk", "batched_pv"):
        bh = r["batch"]
        a_shape, b_shape = (bh, m, k), ((bh, n, k) if op == "batched_qk" else (bh, k, n))
        mul = (lambda a, b: a @ b.transpose(-1, -2)) if op == "batched_qk" else (lambda a, b: a @ b)
    else:
        return None
    esize = 2 if store == torch.bfloat16 else 4
    nbytes = esize * (a_shape_numel(a_shape) + a_shape_numel(b_shape) + m * n * r.get("batch", 1))
    sets = n_sets(nbytes)
    As = [rand(a_shape, store) for _ in range(sets)]
    Bs = [rand(b_shape, store) for _ in range(sets)]
    if bf16_compute:
        return (lambda i: mul(As[i].bfloat16(), Bs[i].bfloat16()).float()), sets
    return (lambda i: mul(As[i], Bs[i])), sets


def a_shape_numel(shape):
    p = 1
    for d in shape:
        p *= d
    return p


def swiglu_case(r):
    n = r["m"]
    dtype = torch.bfloat16 if r["mode"] == "bf16" else torch.float32
    esize = 2 if dtype == torch.bfloat16 else 4
    if r["op"] == "swiglu":
        sets = n_sets(3 * esize * n)
        gs = [rand((n,), dtype) for _ in range(sets)]
        us = [rand((n,), dtype) for _ in range(sets)]
        return (lambda i: F.silu(gs[i]) * us[i]), sets
    sets = n_sets(5 * esize * n)
    gs = [rand((n,), dtype).requires_grad_() for _ in range(sets)]
    us = [rand((n,), dtype).requires_grad_() for _ in range(sets)]
    dhs = [rand((n,), dtype) for _ in range(sets)]
    hs = [F.silu(g) * u for g, u in zip(gs, us)]
    return (lambda i: torch.autograd.grad(hs[i], (gs[i], us[i]), dhs[i], retain_graph=True)), sets


def lora_block(r, base_of):
    """The LoRA SwiGLU MLP block as PyTorch users write it (eager; rank 16, alpha 32, no dropout): forward, then
    backward for x and every adapter. base_of(shape) gives a frozen base weight's product inp -> inp @ W^T."""
    m, i, h, rank, scale = r["m"], r["n"], r["k"], 16, 32 / 16
    dt = torch.bfloat16
    bases = [base_of(shape) for shape in ((i, h), (i, h), (h, i))]
    adapters = [(rand((rank, fan_in), dt).mul_(0.02).requires_grad_(), rand((fan_out, rank), dt).mul_(0.02)
                 .requires_grad_()) for fan_in, fan_out in ((h, i), (h, i), (i, h))]
    x = rand((m, h), dt).requires_grad_()
    dy = rand((m, h), dt)

    def lora(inp, j):
        return bases[j](inp) + scale * F.linear(F.linear(inp, adapters[j][0]), adapters[j][1])

    def fn(_):
        torch.autograd.backward(lora(F.silu(lora(x, 0)) * lora(x, 1), 2), dy)

    return fn, 1


def mlp_case(r):
    """The bf16-base block (lora_block); qmm's NF4 and bf16 blocks are both compared against it."""
    def dense(shape):
        w = rand(shape, torch.bfloat16) * 0.02
        return lambda inp: F.linear(inp, w)
    return lora_block(r, dense)


def bnb_nf4(shape):
    """bitsandbytes' NF4 quantization (blocks of 64, double-quantized) of a random bf16 weight: (packed, state)."""
    return bnb.functional.quantize_4bit(rand(shape, torch.bfloat16) * 0.02, blocksize=64, compress_statistics=True,
                                        quant_type="nf4")


def bnb_base(shape):
    """inp -> inp @ W^T for a bitsandbytes NF4 weight, as its Linear4bit computes it (a GEMV kernel at one row)."""
    q, state = bnb_nf4(shape)
    return lambda inp: bnb.matmul_4bit(inp, q.t(), quant_state=state)


def bnb_case(r):
    """bitsandbytes on an NF4 GEMM or MLP-block result, as its Linear4bit runs it: (fn(i), sets), or None."""
    op, m, n, k = r["op"], r["m"], r["n"], r["k"]
    if op == "nf4_gemm":  # C[M,N] = A[M,K] W[N,K]^T
        base = bnb_base((n, k))
        sets = n_sets(2 * m * (k + n) + n * k // 2)
        As = [rand((m, k), torch.bfloat16) for _ in range(sets)]
        return (lambda i: base(As[i])), sets
    if op == "nf4_gemm_backward_a":  # qmm reports m = M, n = K, k = N: dA[M,K] = dC[M,N] W[N,K]
        q, state = bnb_nf4((k, n))
        sets = n_sets(2 * m * (k + n) + n * k // 2)
        dCs = [rand((m, k), torch.bfloat16) for _ in range(sets)]
        return (lambda i: dCs[i] @ bnb.functional.dequantize_4bit(q, state).to(torch.bfloat16)), sets
    if op == "mlp_block":
        return lora_block(r, bnb_base)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qmm-json", required=True)
    ap.add_argument("--json", help="write the comparison here")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    data = json.load(open(args.qmm_json))
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; qmm results from {data.get('date')}"
          f" (commit {data.get('commit')})")
    print(f"{'op':<20} {'mode':<9} {'shape':<22} {'M':>5} {'N':>6} {'K':>6} {'qmm us':>9} {'torch us':>9}"
          f" {'torch/qmm':>9}")
    rows = []
    nf4_baselines = {}  # every NF4 path of one op and shape (auto and the forced ones) against one torch timing
    bnb_times = {}  # bitsandbytes per NF4 op and shape, and per block shape: (eager, graph)
    for r in data["results"]:
        nf4_key = (r["op"], r["shape"], r["m"], r["n"], r["k"]) if r["op"].startswith("nf4_gemm") else None
        if nf4_key in nf4_baselines:
            eager, graph = nf4_baselines[nf4_key]
        else:
            if r["op"] == "mlp_block":
                case = mlp_case(r)
            elif r["op"].startswith("swiglu"):
                case = swiglu_case(r)
            else:
                case = dense_case(r)
            if case is None:
                continue
            fn, sets = case
            eager = time_us(fn, sets, args.repeats)
            # Autograd cases are not captured: a failed capture leaves torch's RNG in capture mode for later cases.
            autograd = r["op"] in ("swiglu_backward", "mlp_block")
            graph = time_graph_us(fn, sets) if r.get("graph") and not autograd else None
            if nf4_key is not None:
                nf4_baselines[nf4_key] = (eager, graph)
        # Like with like: graph against graph where qmm was timed in a graph, eager against eager otherwise.
        t = graph if graph is not None else eager
        q = r["median_us"] if graph is not None or not r.get("graph") else r.get("eager_us", r["median_us"])
        speed = t / q
        row = {**{k: r[k] for k in ("op", "mode", "shape", "m", "n", "k")}, "qmm_us": q,
               "torch_us": t, "torch_eager_us": eager, "qmm_eager_us": r.get("eager_us"),
               "timing": "graph" if graph is not None else "eager", "speedup_vs_torch": speed}
        bnb_note = ""
        bnb_key = (r["op"], r["shape"], r["m"], r["n"], r["k"])
        if bnb is not None and bnb_key not in bnb_times:
            bcase = bnb_case(r)
            if bcase is not None:
                b_eager = time_us(bcase[0], bcase[1], args.repeats)
                b_graph = time_graph_us(*bcase) if r.get("graph") and r["op"] != "mlp_block" else None
                bnb_times[bnb_key] = (b_eager, b_graph)
        if bnb_key in bnb_times:  # like with like, as for torch
            b_eager, b_graph = bnb_times[bnb_key]
            b_t, b_q = (b_graph, r["median_us"]) if b_graph is not None else \
                (b_eager, r.get("eager_us", r["median_us"]) if r.get("graph") else r["median_us"])
            row.update(bnb_us=b_t, bnb_qmm_us=b_q, bnb_eager_us=b_eager, speedup_vs_bnb=b_t / b_q)
            bnb_note = f"; bitsandbytes {b_t:.1f} ({b_t / b_q:.2f}x qmm's {b_q:.1f})"
        rows.append(row)
        print(f"{r['op']:<20} {r['mode']:<9} {r['shape']:<22} {r['m']:>5} {r['n']:>6} {r['k']:>6}"
              f" {q:>9.1f} {t:>9.1f} {speed:>9.2f} {'graph' if graph is not None else 'eager'}"
              f" (eager: qmm {r.get('eager_us', 0):.1f}, torch {eager:.1f}{bnb_note})", flush=True)
        torch.cuda.empty_cache()
    if rows:
        worst = min(rows, key=lambda x: x["speedup_vs_torch"])
        print(f"\n{len(rows)} cases; slowest relative to torch: {worst['op']} {worst['mode']} {worst['shape']} "
              f"M={worst['m']}: {worst['speedup_vs_torch']:.2f}x")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
