#!/usr/bin/env python3
"""The decoder's small ops and the loss, forward + backward, qmm against what users run today, in one run:

  rms_norm      Hugging Face's LlamaRMSNorm arithmetic in PyTorch eager, Liger-Kernel's LigerRMSNorm, qmm
  rope          Hugging Face's apply_rotary_pos_emb in PyTorch eager, Liger's liger_rotary_pos_emb, qmm
  cross_entropy the head's logits in bf16 upcast to fp32 and F.cross_entropy (what a Hugging Face causal LM does),
                Liger's LigerFusedLinearCrossEntropyLoss, qmm.linear_cross_entropy_loss; with a frozen head (LoRA
                training: the gradient in the hidden states only) and with the head's gradient too

at the shapes of the train-step benchmark (Llama-3-8B widths, 4 x 1024 tokens; Qwen2.5-1.5B, 2 x 1024 tokens).
Per case: the median time of forward + backward (CUDA events, after warm-up), the bandwidth against a device copy
measured in the same run (the norm and the rotation move memory; the loss is GEMM-bound and is compared with the
head's bf16 GEMMs alone), the extra memory above the inputs (PyTorch's peak, and the device's used memory, which also
sees qmm's pool), and each result's largest difference from an fp32 (fp64 on the CPU) reference of the same inputs.
Liger is skipped where it is not installed or on the CPU (Triton).

    PYTHONPATH=build/python python3 bench/peer_ops.py [--models llama,qwen] [--ops rms_norm,rope,cross_entropy]
        [--ce-chunks 256,512,1536x25984] [--json out/peer_ops.json]
--tiny runs small shapes on any device (the CPU too): a check of the script, not a benchmark. --ce-chunks adds qmm's
loss with those chunks beside its default: tokens per chunk (whole rows of the vocabulary where the memory budget
allows), or TOKENSxCOLUMNS (that many of the vocabulary's columns too; the split applies where w takes no gradient).
"""
import argparse
import functools
import json
import os
import statistics
import time

import torch

MODELS = {  # name: tokens (batch x seq), hidden, query heads, key/value heads, head dim, vocab
    "llama": dict(batch=4, seq=1024, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                  label="Llama-3-8B widths, 4 x 1024 tokens"),
    "qwen": dict(batch=2, seq=1024, hidden=1536, heads=12, kv_heads=2, head_dim=128, vocab=151936,
                 label="Qwen2.5-1.5B, 2 x 1024 tokens"),
    "tiny": dict(batch=2, seq=16, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=300, label="tiny (a check)"),
}


def liger():
    try:
        import liger_kernel.transformers as lk
        return lk
    except Exception:  # not installed, or Triton missing
        return None


def timed(fn, device, repeats):
    """Median milliseconds of fn() over `repeats` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def memory_of(fn, device):
    """(torch's peak above what was allocated before, the device's used memory growth) in MiB for one call."""
    if device != "cuda":
        return 0.0, 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    free0, _ = torch.cuda.mem_get_info()
    fn()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20, max(0, free0 - free1) / 2 ** 20


def copy_gbps(device):
    """The device's copy bandwidth (read + write), measured here: the ceiling of the memory-bound ops."""
    if device != "cuda":
        return 0.0
    a = torch.empty(256 * 2 ** 20, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), device, 20)
    return 2 * a.numel() * 4 / (ms * 1e-3) / 1e9


# ---- the implementations: each returns a function running forward + backward, and the results to compare -------


def hf_rms_norm(x, w, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rms_norm_cases(m, device, dtype, lk):
    import qmm
    t, hidden, eps = m["batch"] * m["seq"], m["hidden"], 1e-6
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(t, hidden, generator=g) * 2).to(device, dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
    dy = torch.randn(t, hidden, generator=g).to(device, dtype)
    impls = {"torch": lambda xi, wi: hf_rms_norm(xi, wi, eps), "qmm": lambda xi, wi: qmm.rms_norm_autograd(xi, wi, eps)}
    if lk is not None and device == "cuda":  # LigerRMSNorm's function, Llama casting, not in place
        from liger_kernel.ops import LigerRMSNormFunction
        impls["liger"] = lambda xi, wi: LigerRMSNormFunction.apply(xi, wi, eps, 0.0, "llama", False, None)
    ref = _fwd_bwd(lambda xi, wi: hf_rms_norm(xi, wi, eps), x.double(), w.double(), dy.double())
    nbytes = x.numel() * x.element_size() * 5  # forward: x in, y out; backward: x, dy in, dx out
    return impls, (x, w, dy), ref, nbytes


def hf_rope(q, k, cos, sin):
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_cases(m, device, dtype, lk):
    import qmm
    b, s, hq, hk, d = m["batch"], m["seq"], m["heads"], m["kv_heads"], m["head_dim"]
    g = torch.Generator(device="cpu").manual_seed(1)
    # As Hugging Face's attention makes them: projection outputs viewed per head and transposed.
    q = torch.randn(b, s, hq * d, generator=g).to(device, dtype).view(b, s, hq, d).transpose(1, 2)
    k = torch.randn(b, s, hk * d, generator=g).to(device, dtype).view(b, s, hk, d).transpose(1, 2)
    inv = 1.0 / 500000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat((torch.arange(s, dtype=torch.float64)[:, None] * inv,) * 2, dim=-1)[None]
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    dq, dk = torch.randn(q.shape, generator=g).to(device, dtype), torch.randn(k.shape, generator=g).to(device, dtype)
    impls = {"torch": lambda qi, ki: hf_rope(qi, ki, cos, sin), "qmm": lambda qi, ki: qmm.rope_autograd(qi, ki, cos, sin)}
    if lk is not None and device == "cuda":
        impls["liger"] = lambda qi, ki: lk.liger_rotary_pos_emb(qi, ki, cos, sin)
    ref = _fwd_bwd(lambda qi, ki: hf_rope(qi, ki, cos.double(), sin.double()), q.double(), k.double(),
                   (dq.double(), dk.double()))
    nbytes = (q.numel() + k.numel()) * q.element_size() * 4  # forward and backward: each reads and writes q and k
    return impls, (q, k, (dq, dk)), ref, nbytes


def hf_loss(h, w, labels):
    """A Hugging Face causal LM's loss from its hidden states: the head's logits in h's dtype, upcast to fp32."""
    return torch.nn.functional.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100)


def loss_cases(m, device, dtype, lk, head_grad, chunks=()):
    import qmm
    t, hidden, vocab = m["batch"] * m["seq"], m["hidden"], m["vocab"]
    g = torch.Generator(device="cpu").manual_seed(2)
    h = torch.randn(t, hidden, generator=g).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (t,), generator=g).to(device)
    labels[::7] = -100
    impls = {"torch": hf_loss, "qmm": qmm.linear_cross_entropy_loss}
    for c, cols in chunks:
        impls[f"qmm, chunks of {c}" + (f" x {cols}" if cols else "")] = functools.partial(
            qmm.linear_cross_entropy_loss, chunk_tokens=c, chunk_vocab=cols)
    if lk is not None and device == "cuda":
        flce = lk.LigerFusedLinearCrossEntropyLoss()

        def liger_loss(hi, wi, li):
            out = flce(wi, hi, li)
            return out if isinstance(out, torch.Tensor) else out[0]
        impls["liger"] = liger_loss
    if device == "cpu":
        ref = _fwd_bwd(lambda hi, wi: hf_loss(hi, wi, labels), h.double(), w.double(), None, head_grad)
    else:  # fp32 logits on the GPU: an fp64 [T, V] reference would not fit the point of the exercise
        ref = _fwd_bwd(lambda hi, wi: hf_loss(hi, wi, labels), h.float(), w.float(), None, head_grad)
    return {k: (lambda f: lambda hi, wi: f(hi, wi, labels))(f) for k, f in impls.items()}, (h, w, None), ref, 0


def _fwd_bwd(fn, a, b, grad, b_grad=True):
    """fn(a, b)'s outputs and the gradients of a (and b) under `grad` (a loss's own gradient where None), on fresh
    leaves over a's and b's memory (no copy: the timed step runs this too)."""
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_(b_grad)
    out = fn(a, b)
    outs = out if isinstance(out, tuple) else (out,)
    if grad is None:
        outs[0].backward()
    else:
        torch.autograd.backward(outs, grad if isinstance(grad, tuple) else (grad,))
    return [o.detach() for o in outs] + [a.grad] + ([b.grad] if b_grad else [])


def run_case(name, fn, inputs, ref, device, repeats, b_grad=True):
    a, b, grad = inputs

    def step():
        return _fwd_bwd(fn, a, b, grad, b_grad)

    got = step()
    diffs = [((x.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)).item()
             for x, r in zip(got, ref)]
    ms = timed(step, device, repeats)
    peak, used = memory_of(step, device)
    return {"impl": name, "ms": ms, "torch_extra_mib": peak, "device_extra_mib": used, "max_rel_diff": max(diffs)}


def head_gemms_ms(m, device, dtype, repeats, head_grad):
    """The head's bf16 GEMMs alone (logits, the input gradient, and the weight gradient where asked)."""
    t, hidden, vocab = m["batch"] * m["seq"], m["hidden"], m["vocab"]
    h = torch.randn(t, hidden, device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype)

    def gemms():
        z = h @ w.t()
        z @ w
        if head_grad:
            z.t() @ h
    return timed(gemms, device, repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,qwen")
    ap.add_argument("--ops", default="rms_norm,rope,cross_entropy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="small shapes on any device: a check of the script")
    ap.add_argument("--ce-chunks", default="",
                    help="qmm's loss also with these chunks (TOKENS or TOKENSxCOLUMNS, comma-separated)")
    ap.add_argument("--json")
    args = ap.parse_args()
    fields = [c.strip().split("x") for c in args.ce_chunks.split(",") if c.strip()]
    if not all(1 <= len(f) <= 2 and all(p.isdigit() and int(p) > 0 for p in f) for f in fields):
        ap.error(f"--ce-chunks takes positive TOKENS or TOKENSxCOLUMNS, got {args.ce_chunks!r}")
    chunks = [(int(f[0]), int(f[1]) if len(f) == 2 else 0) for f in fields]
    device, dtype = args.device, torch.bfloat16
    models = ["tiny"] if args.tiny else args.models.split(",")
    lk = liger() if device == "cuda" else None
    gbps = copy_gbps(device)
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "copy_gbps": gbps, "liger": lk is not None, "cases": []}
    print(f"peer_ops: {report['device']}, torch {torch.__version__}, copy {gbps:.0f} GB/s, "
          f"Liger {'present' if lk is not None else 'absent'}")
    print("| model | op | impl | fwd+bwd ms | GB/s (% of copy) | vs torch | torch extra MiB | device extra MiB | "
          "max rel. diff |\n" + "| --- " * 9 + "|")
    for model in models:
        m = MODELS[model]
        for op in args.ops.split(","):
            variants = [(op, None)] if op != "cross_entropy" else [("cross_entropy dh", False),
                                                                    ("cross_entropy dh+dW", True)]
            for label, head_grad in variants:
                if op == "rms_norm":
                    impls, inputs, ref, nbytes = rms_norm_cases(m, device, dtype, lk)
                elif op == "rope":
                    impls, inputs, ref, nbytes = rope_cases(m, device, dtype, lk)
                else:
                    impls, inputs, ref, nbytes = loss_cases(m, device, dtype, lk, head_grad, chunks)
                b_grad = head_grad is not False
                rows = [run_case(n, f, inputs, ref, device, args.repeats, b_grad) for n, f in impls.items()]
                base = next(r["ms"] for r in rows if r["impl"] == "torch")
                gemm_ms = head_gemms_ms(m, device, dtype, args.repeats, head_grad) if op == "cross_entropy" else None
                for r in rows:
                    r.update(model=model, op=label)
                    rate = "-"
                    if nbytes and device == "cuda":
                        r["gbps"] = nbytes / (r["ms"] * 1e-3) / 1e9
                        rate = f"{r['gbps']:.0f} ({100 * r['gbps'] / gbps:.0f}%)"
                    elif gemm_ms:
                        r["vs_head_gemms"] = r["ms"] / gemm_ms
                        rate = f"{r['vs_head_gemms']:.2f}x the bf16 head GEMMs ({gemm_ms:.2f} ms)"
                    print(f"| {model} | {label} | {r['impl']} | {r['ms']:.3f} | {rate} | {r['ms'] / base:.2f}x | "
                          f"{r['torch_extra_mib']:.0f} | {r['device_extra_mib']:.0f} | {r['max_rel_diff']:.2e} |",
                          flush=True)
                    report["cases"].append(r)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
