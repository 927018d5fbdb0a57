#!/usr/bin/env python3
"""What qmm's Python calls cost the host, per call, at a size where the device work is negligible (one token,
64 x 64 weight, LoRA r 4): the raw binding of a patched projection's forward with its outputs preallocated (DLPack
conversion, validation, context lookup, the launches), the same call on zero rows with a bf16 adapter (qmm's own
host work alone: it launches nothing), the same through the package with its allocations, and the
differentiable op's forward alone and its forward + backward under autograd, and for scale PyTorch's own
forward + backward of the same layer in bf16 (a dense 64 x 64 weight and a PEFT-style adapter); both again as one of
16 projections chained in one forward and one backward, as a model's layers share a step's backward (whose own cost,
on a GPU waking autograd's device thread, a lone layer's backward pays alone); and where bitsandbytes and PEFT are
installed, a PEFT LoRA layer's module call, forward + backward, patched by qmm.patch_bnb (the patch's own per-call
work included) and unpatched. On a GPU the calls
are enqueued back to back and the device is synchronized once at the end, so the figure is the host's enqueue cost
while the GPU keeps up; on the CPU it includes the CPU backend's own work.

    PYTHONPATH=build/python python3 bench/host_cost.py [--device cuda] [--calls 2000] [--json out/host_cost.json]
                                                       [--profile]

--profile adds torch.profiler's table of the autograd case (host time by op, the backward's thread included).
"""
import argparse
import json
import statistics
import time

import torch

import qmm
from qmm import _impl, _qmm
from qmm._base import _call


def per_call_us(fn, calls, sync, rounds=5):
    """The median over `rounds` of the mean host time per call of `calls` back-to-back calls (µs)."""
    for _ in range(50):
        fn()
    sync()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(means)


def peft_projections(dev, gen):
    """(patched, unpatched): the same PEFT LoRA layer (r 4, alpha 8) on a bitsandbytes NF4 64 x 64 weight, one
    patched by qmm.patch_bnb, as a user's model holds them; None without bitsandbytes and PEFT."""
    try:
        import bitsandbytes as bnb
        import peft
    except ImportError:
        return None
    weight = torch.randn((64, 64), generator=gen)
    layers = []
    for patched in (True, False):
        model = torch.nn.Module()
        model.proj = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        model.proj.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
        model = peft.get_peft_model(model.to(dev), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"],
                                                                  init_lora_weights=False))
        if patched:
            qmm.patch_bnb(model)
        layers.append(model.get_submodule("base_model.model.proj"))
    return layers


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's host table of the autograd case")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error("--calls must be at least 1")
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    w = qmm.Nf4Weight.quantize(torch.randn((64, 64), generator=gen).to(dev))
    x = torch.randn((1, 64), generator=gen).to(dev, torch.bfloat16)
    a = (torch.randn((4, 64), generator=gen) * 0.1).to(dev).requires_grad_()
    b = (torch.randn((64, 4), generator=gen) * 0.1).to(dev).requires_grad_()
    y, t = torch.empty((1, 64), dtype=torch.bfloat16, device=dev), torch.empty((1, 4), dtype=torch.bfloat16, device=dev)
    a_w, b_w = torch.empty(a.shape, dtype=torch.bfloat16, device=dev), torch.empty(b.shape, dtype=torch.bfloat16,
                                                                                    device=dev)
    ad, bd = a.detach(), b.detach()
    lora = qmm.Lora(a, b, 2.0)
    xg = x.clone().requires_grad_()

    def raw():
        _call(_qmm.lora_nf4_linear_forward, x, x, w._native, y, 0.0, "auto", None, ad, bd, a_w, b_w, t, 2.0)

    x0, y0, t0 = x[:0], y[:0], t[:0]
    a16d, b16d = ad.to(torch.bfloat16), bd.to(torch.bfloat16)

    def raw_no_rows():  # no launch: zero rows, and adapters already in x's dtype need no working copies
        _call(_qmm.lora_nf4_linear_forward, x0, x0, w._native, y0, 0.0, "auto", None, a16d, b16d, None, None, t0, 2.0)

    def package():
        _impl.linear_forward(x, w, None, (x, ad, bd, 2.0), "auto")

    def autograd_forward():
        qmm.lora_nf4_linear(xg, w, lora)

    def autograd():
        qmm.lora_nf4_linear(xg, w, lora).sum().backward()

    dense = torch.randn((64, 64), generator=gen).to(dev, torch.bfloat16)
    a16 = a.detach().to(torch.bfloat16).requires_grad_()
    b16 = b.detach().to(torch.bfloat16).requires_grad_()

    def torch_layer():
        y = torch.nn.functional.linear(xg, dense)
        (y + torch.nn.functional.linear(torch.nn.functional.linear(xg, a16), b16) * 2.0).sum().backward()

    chain = 16  # projections in one forward and one backward: a model's step, where the engine's per-backward cost

    def autograd_chained():  # (waking its device thread, on a GPU) is shared by every layer
        h = xg
        for _ in range(chain):
            h = qmm.lora_nf4_linear(h, w, lora)
        h.sum().backward()

    def torch_chained():
        h = xg
        for _ in range(chain):
            h = torch.nn.functional.linear(h, dense) + \
                torch.nn.functional.linear(torch.nn.functional.linear(h, a16), b16) * 2.0
        h.sum().backward()

    rows = {"raw binding, outputs given": per_call_us(raw, args.calls, sync),
            "raw binding, 0 rows (no launch)": per_call_us(raw_no_rows, args.calls, sync),
            "package forward (allocates)": per_call_us(package, args.calls, sync),
            "autograd forward alone": per_call_us(autograd_forward, args.calls, sync),
            "autograd forward + backward": per_call_us(autograd, max(1, args.calls // 4), sync),
            "torch bf16 layer, fwd + bwd": per_call_us(torch_layer, max(1, args.calls // 4), sync),
            f"autograd fwd + bwd, 1 of {chain} chained": per_call_us(autograd_chained, max(1, args.calls // 64),
                                                                      sync) / chain,
            f"torch bf16 layer, 1 of {chain} chained": per_call_us(torch_chained, max(1, args.calls // 64),
                                                                    sync) / chain}
    projections = peft_projections(dev, gen)
    if projections is not None:  # what a patched model's projection call costs, the patch's own work included
        patched, unpatched = projections
        xp = x.clone().requires_grad_()

        def module_call(layer):
            return lambda: layer(xp).sum().backward()
        rows["patched PEFT layer, fwd + bwd"] = per_call_us(module_call(patched), max(1, args.calls // 4), sync)
        rows["bitsandbytes + PEFT layer, fwd + bwd"] = per_call_us(module_call(unpatched), max(1, args.calls // 4),
                                                                   sync)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"host cost per call, {device}, torch {torch.__version__}, 1 x 64 @ NF4 64 x 64, LoRA r 4")
    for name, us in rows.items():
        print(f"  {name:36s} {us:8.1f} µs")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                autograd()
            sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
