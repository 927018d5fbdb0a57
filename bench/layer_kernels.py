#!/usr/bin/env python3
"""Kernels per decoder layer of a training step (issue 41's measure): one profiled step (forward, backward, fused
AdamW) of a variant of bench/train_step.py built with L and with L + 1 decoder layers; the difference is one layer's
kernels, listed by name with its count; then what each device memset comes before, and (--order) the step's
kernels in launch order.

    PYTHONPATH=build/python python3 bench/layer_kernels.py [--model qwen] [--variant qmm-all] [--layers 1]
--tiny runs the small Llama config on --device cpu, counting profiled CPU events instead of kernels: a check of the
script, not a measurement.
"""
import argparse
import collections
import os
import sys
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as ts  # noqa: E402


def step_events(model_name, variant, layers, device):
    """The names of one profiled training step's kernels (CPU events on the CPU), in launch order."""
    cls, config, batch, seq, label = ts.MODELS[model_name]
    ts.MODELS["layers"] = (cls, dict(config, num_hidden_layers=layers), batch, seq, label)
    with tempfile.TemporaryDirectory() as tmp:
        ts.save_model("layers", tmp)
        args = types.SimpleNamespace(model="layers", checkpointing=False, nf4_path="auto", device=device)
        return _profiled_step(ts.load(variant, tmp, args).train(), config, batch, seq, device)


def _profiled_step(model, config, batch, seq, device):
    import torch

    params = ts.lora_params(model)
    ts.init_adapters(params)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(4, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ts.profiled_step_events(step, ids, device, warmup=3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen", choices=[m for m in ts.MODELS if m != "layers"])
    ap.add_argument("--variant", default="qmm-all", help="a variant of bench/train_step.py (eager ones)")
    ap.add_argument("--layers", type=int, default=1, help="L: the smaller model's decoder layers")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny Llama config (with --device cpu: a script check)")
    ap.add_argument("--order", action="store_true", help="also list the larger model's step in launch order")
    args = ap.parse_args()
    model = "tiny" if args.tiny else args.model
    unit = "kernels" if args.device == "cuda" else "CPU events"
    small = step_events(model, args.variant, args.layers, args.device)
    large = step_events(model, args.variant, args.layers + 1, args.device)
    print(f"{args.variant} {model}: {len(small)} {unit} a step with {args.layers} layer(s), {len(large)} with "
          f"{args.layers + 1}: {len(large) - len(small)} per layer")
    a, b = collections.Counter(small), collections.Counter(large)
    for name in sorted(set(a) | set(b), key=lambda n: (a[n] - b[n], n)):
        if a[name] != b[name]:
            print(f"{b[name] - a[name]:4d}  {name}")
    # What each device memset of the larger step comes before (cuBLASLt zeroes a workspace or an output before
    # some algorithms): launches that are not kernels, attributed to the kernel that follows them.
    follows = collections.Counter(large[i + 1] for i, name in enumerate(large[:-1]) if name.startswith("Memset"))
    if follows:
        print(f"---- device memsets of the step with {args.layers + 1} layer(s), by the launch after each")
        for name, n in follows.most_common():
            print(f"{n:4d}  {name}")
    if args.order:
        print(f"---- the step with {args.layers + 1} layer(s), in launch order")
        for i, name in enumerate(large):
            print(i, name)


if __name__ == "__main__":
    main()
