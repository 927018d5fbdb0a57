#!/usr/bin/env python3
"""The QLoRA training step of a Hugging Face model, as users run it, for every variant in one run:

  bf16         bf16 weights + PEFT LoRA (the speed qmm aims at)
  bnb          bitsandbytes NF4 (double quant, bf16 compute) + PEFT LoRA (what QLoRA users run)
  qmm          the same model after qmm.patch_bnb
  qmm-compile  the same, then torch.compile(model, fullgraph=True); its first step's time is reported apart
  qmm-all      qmm.patch_bnb with every fusion: also the loss from the hidden states (fused_loss: no logits), the
               RMSNorms (fused_norm) and the rotary embeddings (fused_rope)
  qmm-all-compile  the same, compiled
  qmm-all-graph    qmm-all with the whole step (forward, backward, AdamW) replayed as one CUDA graph
                   (qmm.graph_step; AdamW fused and capturable)
  qmm-all-graph3   the same captured as three graphs replayed in turn (graph_step's pieces=3: the first small, so
                   that the GPU starts before the host has launched the whole step)
  qmm-all-reduce-overhead  qmm-all compiled with mode="reduce-overhead" (PyTorch replays the compiled forward and
                   backward as CUDA graphs; AdamW stays eager)
  liger        Liger-Kernel's patches (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) on bnb + PEFT
  unsloth      Unsloth's FastLanguageModel in 4-bit with its LoRA
  fp32-ref     the bnb model's NF4 weights dequantized into float32 layers, the whole model, its activations and
               adapters in float32: the reference every variant's LoRA gradients and losses are also compared with
               (how far each is from the exact step of the same 4-bit weights; its time is not a target)

Models are built from real configs (random weights, no hub): saved once with a tokenizer beside them, then loaded
by each variant in its own process (from_pretrained, with BitsAndBytesConfig for the 4-bit ones). LoRA r 16, alpha
32 on all seven projections, the same nonzero adapter initialisation in every variant (PEFT's B = 0 would leave A's
gradient zero), the same token batch, AdamW on the adapters (fused on a GPU, as transformers' Trainer's default).
Per variant: median and min step time (every timed step's in the JSON report; each step waited for), the step time
pipelined (as many steps back to back, one wait at the end), tokens/s, torch's peak allocated memory (+ qmm's own in
the patched variants: qmm.memory_stats' fixed memory and scratch peak) and the device's used memory
(torch.cuda.mem_get_info, which also sees qmm's pool and CUDA graphs' memory), every step's loss, kernels per step,
GPU busy time, GPU time by kind of kernel and the GPU's idle time between kernels with the largest gaps
(torch.profiler over two steps, --profile), kernels per decoder layer (--per-layer: a profiled step with and without
the last decoder layer), and the LoRA gradients of step 0 against bnb's (relative difference, norm-wise, per tensor:
largest and median). Variants whose packages are missing are reported as skipped.

    PYTHONPATH=build/python python3 bench/train_step.py [--models qwen,llama] [--variants ...] [--steps 10]
        [--checkpointing] [--profile] [--per-layer] [--nf4-path auto] [--json out/train_step.json]
        [--unsloth-path DIR]
--tiny runs a small Llama config on any device (the CPU too): a check of the script, not a benchmark.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

MODELS = {  # name: (config class, config, batch, sequence length)
    "qwen": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True), 2, 1024, "Qwen2.5-1.5B config, 28 layers"),
    "llama": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                  tie_word_embeddings=False), 4, 1024, "Llama-3-8B widths, 4 layers"),
    "tiny": ("LlamaConfig", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=256), 2, 64,
             "tiny Llama (a check of the script)"),
}
VARIANTS = ["bf16", "bnb", "qmm", "qmm-compile", "qmm-all", "qmm-all-compile", "qmm-all-graph", "qmm-all-graph3",
            "qmm-all-reduce-overhead", "liger", "unsloth", "fp32-ref"]
GRAPH_PIECES = {"qmm-all-graph": 1, "qmm-all-graph3": 3}  # the variants that replay graph_step's graphs
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32


# ---- the parent: models, one process per variant, the table ------------------------------------------------------


def save_model(name, folder):
    """A random-init model of MODELS[name] in bf16, and a word-level tokenizer over its vocabulary, in folder."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    cls, config, _, _, _ = MODELS[name]
    config = getattr(transformers, cls)(**config, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder)
    # a pad token of its own: Unsloth rejects one that is the end-of-sequence token
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), config.vocab_size)})
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)


def run_worker(script, variant, args, folder, out_json, worker_args):
    """Runs `script --worker variant` (this script's worker, or another bench script's) in its own process for one
    model and returns its JSON result, or a "skipped" entry where it failed: how it ended (exit code, or the signal
    that killed it), the exception's line (else its last line that is not a progress bar) and the output's last
    40 lines (the JSON report keeps them)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1",
               PYTHONUNBUFFERED="1")
    if variant == "unsloth" and args.unsloth_path:  # Unsloth patches transformers on import: its own site first
        env["PYTHONPATH"] = args.unsloth_path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(script), "--worker", variant, "--model-dir", folder, "--out", out_json,
           "--model", args.model_now, "--device", args.device, *worker_args]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    # A progress line per worker, so a run cut short by a time limit still tells how far it got.
    print(f"  {args.model_now} {variant}: exit {done.returncode} after {time.perf_counter() - start:.0f} s",
          file=sys.stderr, flush=True)
    if done.returncode != 0 or not os.path.exists(out_json):
        code = done.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        lines = [ln.strip() for ln in (done.stdout + done.stderr).replace("\r", "\n").splitlines()
                 if ln.strip() and "it/s]" not in ln and "%|" not in ln]
        raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]
        line = (raised or lines or [""])[-1]
        return {"variant": variant, "skipped": how + (": " + line if line else ""), "log_tail": lines[-40:]}
    with open(out_json) as f:
        return json.load(f)


def run_variant(variant, args, folder, out_json):
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    worker_args += ["--checkpointing"] if args.checkpointing else []
    worker_args += ["--profile"] if args.profile else []
    worker_args += ["--per-layer"] if args.per_layer else []
    worker_args += ["--nf4-path", args.nf4_path]
    return run_worker(__file__, variant, args, folder, out_json, worker_args)


def compare_grads(result, reference):
    import torch
    mine, ref = torch.load(result["grads"]), torch.load(reference["grads"])
    rel = sorted(((mine[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref if n in mine)
    return {"grad_rel_max": rel[-1], "grad_rel_median": rel[len(rel) // 2], "grads_compared": len(rel)} if rel else {}


def table(model_label, results):
    by = {r["variant"]: r for r in results}
    bnb = by.get("bnb", {}).get("median_ms")
    lines = [f"### {model_label}", "",
             "| variant | median ms | min ms | pipelined ms | vs bnb | tokens/s | torch peak (+ qmm) GiB | "
             "device used GiB | "
             "kernels/step | kernels/layer | GPU busy ms | LoRA grad rel. diff vs bnb (max / median) | "
             "max loss diff vs bnb | "
             "first step s |",
             "| --- " * 14 + "|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['variant']} | skipped: {r['skipped'][:150]} |" + " |" * 12)
            continue
        ratio = f"{r['median_ms'] / bnb:.2f}x" if bnb else "-"
        grads = f"{r['grad_rel_max']:.3f} / {r['grad_rel_median']:.3f}" if "grad_rel_max" in r else "-"
        losses = by.get("bnb", {}).get("losses")
        loss_diff = f"{max(abs(a - b) for a, b in zip(r['losses'], losses)):.2e}" if losses else "-"
        peak = f"{r['torch_peak_gib']:.2f}" + (f" + {r['qmm_peak_gib']:.2f}" if "qmm_peak_gib" in r else "")
        lines.append(f"| {r['variant']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['pipelined_ms']:.1f} | "
                     f"{ratio} | {r['tokens_per_s']:.0f} | "
                     f"{peak} | {r['device_used_gib']:.2f} | {r.get('kernels_per_step', '-')} | "
                     f"{r.get('kernels_per_layer', '-')} | "
                     f"{r.get('gpu_busy_ms', '-')} | {grads} | {loss_diff} | {r['first_step_s']:.1f} |")
    exact = [r for r in results if "grad_rel_max_vs_fp32" in r]
    if exact:
        lines += ["", "Against fp32-ref (the same 4-bit weights, everything else in float32): LoRA gradients of step "
                      "0, relative difference max / median; max loss difference:"]
        lines += [f"- {r['variant']}: {r['grad_rel_max_vs_fp32']:.3f} / {r['grad_rel_median_vs_fp32']:.3f}; "
                  f"{r['loss_diff_vs_fp32']:.2e}" for r in exact]
    kinds = [r for r in results if r.get("gpu_ms_by_kind")]
    if kinds:
        lines += ["", "GPU time by kind, ms a step:"]
        lines += [f"- {r['variant']}: " + ", ".join(f"{k} {ms:.2f}" for k, ms in r["gpu_ms_by_kind"].items())
                  for r in kinds]
    for r in (r for r in results if r.get("idle")):
        lines += ["", f"GPU idle between kernels, {r['variant']}: {r['idle']['idle_ms']:.2f} ms a step; largest "
                      "(kernel before -> after: times a step, µs a step):"]
        lines += [f"- {a} -> {b}: {n}, {us}" for a, b, n, us in r["idle"]["gaps"]]
    return "\n".join(lines)


def new_report(args):
    """The JSON report's head: PyTorch's version and the device."""
    import torch
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "models": {}}


def run_models(args, run_one):
    """Yields (model, results) for each model of --models: the model saved once to a temporary folder, then
    run_one(variant, args, folder, out_json) for every variant of --variants."""
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            folder = os.path.join(tmp, model)
            save_model(model, folder)
            args.model_now = model
            yield model, [run_one(v, args, folder, os.path.join(tmp, f"{model}-{v}.json"))
                          for v in args.variants.split(",")]


def write_report(report, path):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def parent(args):
    report = new_report(args)
    print(f"train_step: {report['device']}, torch {report['torch']}, {args.steps} steps after {args.warmup} warm-up"
          f"{', gradient checkpointing' if args.checkpointing else ''}"
          f"{'' if args.nf4_path == 'auto' else ', qmm NF4 path ' + args.nf4_path}")
    for model, results in run_models(args, run_variant):
        reference = next((r for r in results if r["variant"] == "bnb" and "skipped" not in r), None)
        exact = next((r for r in results if r["variant"] == "fp32-ref" and "skipped" not in r), None)
        for r in results:
            if reference and "skipped" not in r and r is not reference:
                r.update(compare_grads(r, reference))
            if exact and "skipped" not in r and r is not exact:
                r.update({k + "_vs_fp32": v for k, v in compare_grads(r, exact).items()})
                r["loss_diff_vs_fp32"] = max(abs(a - b) for a, b in zip(r["losses"], exact["losses"]))
        for r in results:
            r.pop("grads", None)
        report["models"][model] = results
        print(table(f"{MODELS[model][4]} ({MODELS[model][2]} x {MODELS[model][3]})", results), flush=True)
    write_report(report, args.json)


# ---- a worker: one variant of one model --------------------------------------------------------------------------


def load(variant, folder, args):
    import torch
    import transformers

    dtype = torch.bfloat16
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    seq = MODELS[args.model][3]
    if variant == "unsloth":
        from unsloth import FastLanguageModel
        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=seq, dtype=dtype, load_in_4bit=True)
        return FastLanguageModel.get_peft_model(
            model, r=RANK, lora_alpha=ALPHA, lora_dropout=0, bias="none", target_modules=PROJECTIONS,
            use_gradient_checkpointing="unsloth" if args.checkpointing else False)
    if variant == "fp32-ref":
        return fp32_reference(folder, quant, args)
    if variant == "liger":
        import liger_kernel.transformers as liger
        {"llama": liger.apply_liger_kernel_to_llama, "tiny": liger.apply_liger_kernel_to_llama,
         "qwen": liger.apply_liger_kernel_to_qwen2}[args.model]()
    import peft
    kwargs = dict(torch_dtype=dtype, device_map={"": args.device})
    if variant != "bf16":
        kwargs["quantization_config"] = quant
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                       target_modules=PROJECTIONS, task_type="CAUSAL_LM"))
    if variant.startswith("qmm"):
        import qmm
        everything = variant.startswith("qmm-all")
        qmm.patch_bnb(model, path=args.nf4_path, fused_loss=everything, fused_norm=everything,
                      fused_rope=everything)
    return model


def fp32_reference(folder, quant, args):
    """The model in float32 with each projection's weight the 4-bit model's NF4 weight dequantized, and PEFT's LoRA in
    float32: the exact step of the 4-bit weights, up to fp32 rounding."""
    import bitsandbytes
    import peft
    import torch
    import transformers

    four_bit = transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.bfloat16, device_map={"": args.device}, quantization_config=quant)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                              device_map={"": args.device})
    dense = dict(model.named_modules())
    with torch.no_grad():
        for name, module in four_bit.named_modules():
            if isinstance(module, bitsandbytes.nn.Linear4bit):
                w = bitsandbytes.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                dense[name].weight.copy_(w.float())
    del four_bit
    return peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                      target_modules=PROJECTIONS, task_type="CAUSAL_LM"))


def lora_params(model):
    """The adapters' parameters by a name common to every variant (from "layers." on)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad and ("lora_A" in name or "lora_B" in name):
            out[name[name.index("layers."):] if "layers." in name else name] = p
    return out


def init_adapters(params):
    """The same nonzero adapters in every variant: A ~ U(±1/sqrt(in)), B ~ U(±1/sqrt(r)) / 4, seeded by name."""
    import torch
    with torch.no_grad():
        for name, p in params.items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            bound = (1 / p.shape[1] ** 0.5) * (0.25 if "lora_B" in name else 1.0)
            p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)


# Kinds of kernels by name, first match: qmm's own by family, then cuBLAS, attention, PyTorch's element-wise
# kernels, Triton's (torch.compile's triton_*, Liger's and Unsloth's _*), memory operations; "other" for the rest.
KERNEL_KINDS = [
    ("NF4 dequantize", r"qmm::.*nf4_dequantize"), ("NF4 fused / small-M", r"qmm::.*nf4"),
    ("loss rows", r"qmm::.*(online_rows|cross_entropy)"), ("SwiGLU", r"qmm::.*swiglu"),
    ("lora_backward_dy", r"qmm::.*lora_backward_dy"), ("RMSNorm", r"qmm::.*rms_norm"), ("rope", r"qmm::.*rope"),
    ("qmm other", r"qmm::"), ("cuBLAS GEMM", r"nvjet|gemm|xmma|cublas|cutlass"),
    ("attention", r"sdpa|flash|fmha|attention|cudnn"), ("PyTorch element-wise", r"at::native"),
    ("Triton", r"^(triton_|_)"), ("memset", r"Memset"), ("copy", r"Memcpy")]


def gpu_time_by_kind(kernels, steps):
    """Device time per step (ms) by KERNEL_KINDS, largest first: {kind: ms}."""
    totals = {}
    for e in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, e.name)), "other")
        totals[kind] = totals.get(kind, 0.0) + (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0))
    return {k: round(us / steps / 1e3, 2) for k, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def top_kernels(kernels, steps, count=25):
    """The kernels that took the most device time, per step: [name (cut to 90 characters), launches, ms]."""
    by_name = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:count]
    return [[name, round(n / steps, 1), round(us / steps / 1e3, 3)] for name, (n, us) in ranked]


def idle_gaps(kernels, steps, count=12):
    """Where the GPU idles between kernels: {"idle_ms": per step, "gaps": [[kernel before (cut to 60 characters),
    kernel after, times a step, µs a step], ...] largest first}. A gap is the time from the last end so far to the
    next kernel's start (events with time_range in µs, as torch.profiler gives them; a graph's replays included)."""
    events = sorted(kernels, key=lambda e: e.time_range.start)
    by_pair, idle, covered, before = {}, 0.0, None, None
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if covered is not None and start > covered:
            entry = by_pair.setdefault((before.name[:60], e.name[:60]), [0, 0.0])
            entry[0] += 1
            entry[1] += start - covered
            idle += start - covered
        if covered is None or end >= covered:
            covered, before = end, e
    ranked = sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:count]
    return {"idle_ms": round(idle / steps / 1e3, 2),
            "gaps": [[a, b, round(n / steps, 1), round(us / steps, 1)] for (a, b), (n, us) in ranked]}


def profiled_step_events(train_step, ids, device, warmup=2):
    """The names of one profiled training step's kernels (CPU events on the CPU), in launch order, after `warmup`
    steps (plans, compiles and the optimizer's state made before it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        train_step(ids)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        train_step(ids)
        sync()
    kind = "CUDA" if cuda else "CPU"
    events = sorted((e for e in prof.events() if str(e.device_type).endswith(kind)), key=lambda e: e.time_range.start)
    return [e.name[:110] for e in events]


def kernels_per_layer(model, train_step, ids, device):
    """One decoder layer's kernels (CPU events on the CPU): a profiled training step, then the same without the
    model's last decoder layer (removed for good: this runs last), the difference. The eager step serves every
    variant but the compiled ones, which recompile for the shorter model."""
    import torch

    config = model.config
    n = config.num_hidden_layers
    whole = len(profiled_step_events(train_step, ids, device))
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    del layers[n - 1]
    config.num_hidden_layers = n - 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n - 1]
    return whole - len(profiled_step_events(train_step, ids, device))


def worker(args):
    import torch
    device = args.device
    _, config, batch, seq, _ = MODELS[args.model]
    model = load(args.worker, args.model_dir, args).train()
    params = lora_params(model)
    init_adapters(params)
    graphed = args.worker in GRAPH_PIECES
    # On a GPU PyTorch's fused AdamW (transformers' Trainer's default optimizer): one kernel for every adapter,
    # where the capturable multi-tensor one would replay a few small kernels per tensor.
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, fused=device == "cuda",
                            capturable=graphed and device == "cuda")
    ids = torch.randint(4, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    step_fn = model
    if args.worker.endswith("-compile"):
        step_fn = torch.compile(model, fullgraph=True)
    elif args.worker.endswith("-reduce-overhead"):
        step_fn = torch.compile(model, fullgraph=True, mode="reduce-overhead")

    def train_step(ids):
        loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run = train_step
    if graphed:
        import qmm
        # step 0 below is eager too: the optimizer has its state
        run = qmm.graph_step(train_step, warmup=1, pieces=GRAPH_PIECES[args.worker])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times, used, grads = [], [], [], None
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        if i == 0:  # eager in every variant, to compare the LoRA gradients before the optimizer clears them
            loss = step_fn(input_ids=ids, labels=ids).loss
            loss.backward()
            loss = loss.detach()  # its graph would keep this default-stream step's gradient accumulators alive
            grads = {n: p.grad.detach().float().cpu() for n, p in params.items()}
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            loss = run(ids)
        sync()
        elapsed = time.perf_counter() - start
        if i == 0:
            first = elapsed
        if i >= args.warmup:
            times.append(elapsed * 1e3)
        losses.append(loss.item())
        if device == "cuda":
            free, total = torch.cuda.mem_get_info()
            used.append((total - free) / 2 ** 30)
    median = statistics.median(times)
    # The same steps back to back with one wait at the end, as a training loop that reads its loss only now and
    # then (transformers' Trainer) runs them: the host's work on a step overlaps the GPU's on the one before.
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        run(ids)
    sync()
    pipelined = (time.perf_counter() - start) * 1e3 / args.steps
    result = {"variant": args.worker, "median_ms": median, "min_ms": min(times), "step_ms": times,
              "pipelined_ms": pipelined,
              "tokens_per_s": batch * seq / (median / 1e3), "losses": losses, "first_step_s": first,
              "torch_peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else 0.0,
              "device_used_gib": max(used) if used else 0.0}
    qmm = sys.modules.get("qmm")
    if qmm is not None and device == "cuda":  # the patched variants: qmm's own memory, which torch does not count
        stats = qmm.memory_stats()
        result["qmm_peak_gib"] = (stats["fixed"] + stats["scratch_reserved_peak"]) / 2 ** 30
    if args.profile and device == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                run(ids)
            sync()
        kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
        busy_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) for e in kernels)
        result["kernels_per_step"] = len(kernels) // 2
        result["gpu_busy_ms"] = round(busy_us / 2 / 1e3, 1)
        result["top_kernels"] = top_kernels(kernels, steps=2)
        result["gpu_ms_by_kind"] = gpu_time_by_kind(kernels, steps=2)
        result["idle"] = idle_gaps(kernels, steps=2)
    if args.per_layer:
        result["kernels_per_layer"] = kernels_per_layer(model, train_step, ids, device)
    grads_path = args.out + ".grads.pt"
    torch.save(grads, grads_path)
    result["grads"] = grads_path
    with open(args.out, "w") as f:
        json.dump(result, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen,llama")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true", help="transformers' gradient checkpointing")
    ap.add_argument("--profile", action="store_true", help="kernels per step and GPU busy time (torch.profiler)")
    ap.add_argument("--per-layer", action="store_true",
                    help="kernels per decoder layer: one profiled step, then one without the last decoder layer (the "
                         "eager step for -graph variants; profiled CPU events on the CPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nf4-path", default="auto",
                    help="the qmm variants' NF4 path (patch_bnb's path: auto, dequant_gemm, fused, ...), to time one "
                         "kernel choice inside the step")
    ap.add_argument("--tiny", action="store_true", help="the tiny config only (any device): checks the script")
    ap.add_argument("--json")
    ap.add_argument("--unsloth-path", help="a folder with Unsloth's packages, put first on its worker's path")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if args.tiny:
        args.models = "tiny"
    elif set(args.models.split(",")) - {"qwen", "llama"}:
        ap.error("--models takes qwen and llama (or --tiny)")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    if set(GRAPH_PIECES) & set(args.variants.split(",")) and args.warmup < 3:
        ap.error("--warmup must be at least 3 with qmm-all-graph (step 1 warms it up, step 2 captures its graph)")
    parent(args)


if __name__ == "__main__":
    main()
