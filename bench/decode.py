#!/usr/bin/env python3
"""Greedy decoding through Hugging Face `generate` with the LoRA adapters unmerged, for every variant in one run:

  bf16         bf16 weights + PEFT LoRA
  bnb          bitsandbytes NF4 (double quant, bf16 compute) + PEFT LoRA
  qmm          the same model after qmm.patch_bnb
  qmm-static   the same through qmm.static_decoder: a static KV cache and the decode step compiled with
               mode="reduce-overhead" (CUDA graphs replay each decode step; the prefill runs eagerly)
  unsloth      Unsloth's FastLanguageModel in 4-bit with its LoRA, in its inference mode

The models, adapters and processes are bench/train_step.py's (random weights from real configs, LoRA r 16 on all
seven projections, the same nonzero adapters everywhere). Per variant: tokens/s over `--new-tokens` greedy tokens
after the prompt (median of `--repeats` timed calls after one warm-up), and the first generated token that differs
from bnb's, with the gap between bnb's two largest logits at that step (from one more, untimed call that keeps the
scores) against the median gap: the qmm variants compute bnb's products, but keep each projection's sums in fp32
where bitsandbytes rounds them to bf16, and a random-weight model's logits are close enough to ties that greedy
decoding parts after a few tokens (Unsloth's too); a gap far below the median there says a near tie decided it.

    PYTHONPATH=build/python python3 bench/decode.py [--models qwen,llama] [--variants ...] [--json out/decode.json]
--tiny runs a small Llama config on any device (the CPU too): a check of the script, not a benchmark.
"""
import argparse
import json
import statistics
import time

import train_step  # the models, their saving and loading, the adapters' initialisation

VARIANTS = ["bf16", "bnb", "qmm", "qmm-static", "unsloth"]


def worker(args):
    import torch
    variant = "qmm" if args.worker == "qmm-static" else args.worker
    model = train_step.load(variant, args.model_dir, args).eval()
    train_step.init_adapters(train_step.lora_params(model))
    if args.worker == "unsloth":
        from unsloth import FastLanguageModel
        FastLanguageModel.for_inference(model)
    _, config, _, _, _ = train_step.MODELS[args.model]
    ids = torch.randint(3, config["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(2))
    ids = ids.to(args.device)
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=2)
    generate = model.generate
    if args.worker == "qmm-static":
        import qmm
        compile_kwargs = dict(mode="reduce-overhead") if args.device == "cuda" else dict(backend="aot_eager")
        decoder = qmm.static_decoder(model, args.prompt + args.new_tokens, compile_kwargs=compile_kwargs)
        generate = decoder.generate
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times, out = [], None
    with torch.no_grad():
        for i in range(1 + args.repeats):
            sync()
            start = time.perf_counter()
            out = generate(input_ids=ids, **kwargs)
            sync()
            if i > 0:
                times.append(time.perf_counter() - start)
        # One more call, untimed, for the logits: how close each step's choice was (the top two logits' gap)
        scored = generate(input_ids=ids, output_scores=True, return_dict_in_generate=True, **kwargs)
    new = out[0, ids.shape[1]:].tolist()
    top2 = torch.stack(scored.scores)[:, 0].float().topk(2, dim=-1).values
    result = {"variant": args.worker, "tokens_per_s": len(new) / statistics.median(times),
              "median_s": statistics.median(times), "new_tokens": len(new), "ids": new,
              "rescored_ids_equal": scored.sequences[0, ids.shape[1]:].tolist() == new,
              "top2_gaps": (top2[:, 0] - top2[:, 1]).tolist()}
    with open(args.out, "w") as f:
        json.dump(result, f)


def run_variant(variant, args, folder, out_json):
    return train_step.run_worker(__file__, variant, args, folder, out_json,
                                 ["--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
                                  "--repeats", str(args.repeats)])


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(r, ref):
    """Whether r's greedy ids are bnb's (ref), and where they part, how close bnb's own choice was there: the gap
    between bnb's two largest logits at that step (both models saw the same tokens up to it), against the median
    gap of bnb's steps."""
    if ref is None:
        return "-"
    if r["ids"] == ref["ids"]:
        return "yes"
    at = first_difference(r["ids"], ref["ids"])
    gaps = ref.get("top2_gaps", [])
    if at >= len(gaps):
        return f"no (from token {at})"
    return f"no (from token {at}; bnb's top-2 logit gap there {gaps[at]:.3g}, median {statistics.median(gaps):.3g})"


def table(label, results):
    by = {r["variant"]: r for r in results}
    ref = by.get("bnb")
    lines = [f"### {label}", "", "| variant | tokens/s | vs bnb | s per call | ids equal bnb's |", "| --- " * 5 + "|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['variant']} | skipped: {r['skipped'][:150]} | | | |")
            continue
        base = by.get("bnb", {}).get("tokens_per_s")
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        same = agreement(r, ref)
        if not r.get("rescored_ids_equal", True):
            same += "; its untimed call with scores gave other ids"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:.1f} | {ratio} | {r['median_s']:.3f} | {same} |")
    return "\n".join(lines)


def parent(args):
    report = train_step.new_report(args)
    print(f"decode: {report['device']}, torch {report['torch']}, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"median of {args.repeats}")
    for model, results in train_step.run_models(args, run_variant):
        report["models"][model] = results
        print(table(train_step.MODELS[model][4], results), flush=True)
    train_step.write_report(report, args.json)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen,llama")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny config only (any device): checks the script")
    ap.add_argument("--json")
    ap.add_argument("--unsloth-path", help="a folder with Unsloth's packages, put first on its worker's path")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.checkpointing, args.nf4_path = False, "auto"  # train_step.load's options
    if args.worker:
        return worker(args)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if args.tiny:
        args.models = "tiny"
    elif set(args.models.split(",")) - {"qwen", "llama"}:
        ap.error("--models takes qwen and llama (or --tiny)")
    if args.prompt < 1 or args.new_tokens < 1 or args.repeats < 1:
        ap.error("--prompt, --new-tokens and --repeats must be at least 1")
    parent(args)


if __name__ == "__main__":
    main()
