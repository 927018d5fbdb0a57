#!/usr/bin/env python3
"""Times qmm from PyTorch, as a PyTorch user runs it (eager, one process, one GPU):

1. The QLoRA MLP block, forward + backward (SwiGLU; LoRA rank 16 on gate, up and down; bf16 activations and
   adapters): qmm.QLoraSwiGluMlp on NF4 weights against the same block with bf16 base weights in PyTorch, the
   "bf16-LoRA" block of ../shared/BASELINES.md (mission: NF4 at that block's speed or better).
   Where bitsandbytes and PEFT are installed, also the block as users run QLoRA today (bitsandbytes Linear4bit
   layers with PEFT LoRA adapters in a Llama-style MLP module) and that same model after qmm.patch_bnb.
2. One NF4 linear at M = 1 and 16 (decode), qmm.nf4_linear against torch.matmul on the bf16 weight: per-call time
   in a loop of eager calls, so the Python and launch overhead counts as a user sees it.

Medians of CUDA-event times over --repeats iterations after warm-up; ratios from the same run.
    PYTHONPATH=build/python python3 bench/python_mlp.py [--json out/python_mlp.json]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import qmm

BLOCKS = [("qwen2.5-1.5b", 1536, 8960, 2048), ("llama3-8b", 4096, 14336, 4096)]
DECODE = [("llama3-8b gate", 14336, 4096)]


def time_ms(fn, repeats, warmup=5, inner=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


class Bf16LoraMlp(torch.nn.Module):
    """The baseline: frozen bf16 weights, PyTorch matmuls, the same adapters."""

    def __init__(self, w_gate, w_up, w_down, rank):
        super().__init__()
        self.w = [w.to(torch.bfloat16) for w in (w_gate, w_up, w_down)]
        self.lora = torch.nn.ModuleList(
            qmm.LoraAdapter(w.shape[1], w.shape[0], rank, 2.0 * rank, 0.0, torch.bfloat16, w.device) for w in self.w)

    def forward(self, x):
        gate = x @ self.w[0].t() + self.lora[0](x)
        up = x @ self.w[1].t() + self.lora[1](x)
        h = F.silu(gate) * up
        return h @ self.w[2].t() + self.lora[2](h)


def block_case(name, hidden, inter, tokens, rank, repeats):
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(shape, device="cuda", generator=gen) * 0.02
               for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    nf4 = qmm.QLoraSwiGluMlp(*(qmm.Nf4Weight.quantize(w.to(torch.bfloat16)) for w in weights), rank=rank,
                             alpha=2.0 * rank, adapter_dtype=torch.bfloat16)
    bf16 = Bf16LoraMlp(*weights, rank)
    x = torch.randn((tokens, hidden), device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn((tokens, hidden), device="cuda", generator=gen).to(torch.bfloat16)

    def step(mlp):
        def run():
            x.grad = None
            mlp.zero_grad(set_to_none=True)
            mlp(x).backward(dy)
        return run

    t_nf4, t_bf16 = time_ms(step(nf4), repeats), time_ms(step(bf16), repeats)
    return {"case": f"mlp block {name} H={hidden} I={inter} tokens={tokens} rank={rank}",
            "nf4_us": 1e3 * t_nf4, "torch_bf16_us": 1e3 * t_bf16, "ratio": t_nf4 / t_bf16}


class HfMlp(torch.nn.Module):
    """A Hugging Face Llama/Qwen MLP module: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, gate_proj, up_proj, down_proj):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate_proj, up_proj, down_proj, torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def peft_block_cases(name, hidden, inter, tokens, rank, repeats, t_bf16):
    """The block as bitsandbytes + PEFT run it, then patched by qmm.patch_bnb; [] where either is not installed."""
    try:
        import bitsandbytes as bnb
        import peft
    except Exception as e:  # not installed, or not for this PyTorch
        print(f"python_mlp.py: no bitsandbytes/PEFT cases ({type(e).__name__}: {e})")
        return []
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for out_f, in_f in ((inter, hidden), (inter, hidden), (hidden, inter)):
        layer = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                                  quant_type="nf4")
        w = (torch.randn((out_f, in_f), device="cuda", generator=gen) * 0.02).to(torch.bfloat16).cpu()
        layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True)
        layers.append(layer.cuda())
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(HfMlp(*layers), config)
    x = torch.randn((tokens, hidden), device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn((tokens, hidden), device="cuda", generator=gen).to(torch.bfloat16)

    def run():
        x.grad = None
        model.zero_grad(set_to_none=True)
        model(x).backward(dy)

    case = f"mlp block {name} H={hidden} I={inter} tokens={tokens} rank={rank}"
    t_bnb = time_ms(run, repeats)
    qmm.patch_bnb(model)
    t_patched = time_ms(run, repeats)
    return [{"case": f"{case}, bitsandbytes + PEFT (its fp32 adapters)", "nf4_us": 1e3 * t_bnb,
             "torch_bf16_us": 1e3 * t_bf16, "ratio": t_bnb / t_bf16},
            {"case": f"{case}, the same after qmm.patch_bnb", "nf4_us": 1e3 * t_patched,
             "torch_bf16_us": 1e3 * t_bf16, "ratio": t_patched / t_bf16}]


def decode_case(name, n, k, m, repeats):
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w4 = qmm.Nf4Weight.quantize(w)
    x = torch.randn((m, k), device="cuda", generator=gen).to(torch.bfloat16)
    t_nf4 = time_ms(lambda: qmm.nf4_linear(x, w4), repeats, inner=50)
    t_bf16 = time_ms(lambda: x @ w.t(), repeats, inner=50)
    return {"case": f"linear {name} N={n} K={k} M={m} (eager loop)", "nf4_us": 1e3 * t_nf4,
            "torch_bf16_us": 1e3 * t_bf16, "ratio": t_nf4 / t_bf16}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available() or qmm.cuda_device_count() == 0:
        raise SystemExit("python_mlp.py: needs a GPU (torch and qmm both see none)")
    results = []
    for b in BLOCKS:
        results.append(block_case(*b, args.rank, args.repeats))
        results += peft_block_cases(*b, args.rank, args.repeats, results[-1]["torch_bf16_us"] / 1e3)
    results += [decode_case(name, n, k, m, args.repeats) for name, n, k in DECODE for m in (1, 16)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':<100} {'NF4 µs':>9} {'torch bf16 µs':>14} {'ratio':>6}")
    for r in results:
        print(f"{r['case']:<100} {r['nf4_us']:>9.1f} {r['torch_bf16_us']:>14.1f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
