"""qmm against the real bitsandbytes, PEFT and Hugging Face transformers: what test_qmm.py checks with look-alike
layers, checked here with the libraries themselves. Skipped where they are not installed (CI's Debian PyTorch has
none of them); run with a Python that has torch, bitsandbytes, peft and transformers from PyPI (README.md,
"From PyTorch"). bitsandbytes quantizes on the CPU too, so these run without a GPU.
"""
import pytest
import torch

import qmm

try:
    import bitsandbytes as bnb
except Exception as e:  # not installed, or not for this PyTorch (bitsandbytes 0.50 needs PyTorch >= 2.4)
    pytest.skip(f"bitsandbytes unavailable: {type(e).__name__}: {e}", allow_module_level=True)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and qmm.cuda_device_count() > 0 else [])


def bnb_linear(weight, device, nested=True, blocksize=64, bias=None):
    """A bitsandbytes Linear4bit (NF4, bf16 compute) holding `weight` [out, in], quantized by bitsandbytes."""
    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=torch.bfloat16,
                              compress_statistics=nested, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=nested,
                                     blocksize=blocksize)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer.to(device)  # bitsandbytes quantizes here


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_from_bnb_dequantizes_as_bitsandbytes(device, nested, blocksize):
    """Nf4Weight.from_bnb on bitsandbytes' own quantization: float32 dequantization equal bit for bit. (Rows are a
    whole number of blocks here: bitsandbytes 0.50's CPU dequantize_4bit goes wrong where they are not, e.g. 100 x 192
    in blocks of 128, off by up to 1.9 from the weight it quantized where qmm's dequantization is off by 0.52.)"""
    layer = bnb_linear(randn((100, 256), 1), device, nested, blocksize)
    w = layer.weight
    w4 = qmm.Nf4Weight.from_bnb(w, w.quant_state)
    assert w4.double_quant == nested and w4.codes.data_ptr() == w.data_ptr()  # no copy
    assert torch.equal(w4.dequantize(torch.float32), bnb.functional.dequantize_4bit(w.data, w.quant_state).float())


@pytest.mark.parametrize("device", DEVICES)
def test_to_bnb_state_dict_loads_into_bitsandbytes(device):
    """qmm's quantization saved as a bitsandbytes checkpoint and loaded by bitsandbytes (Params4bit.from_prequantized,
    as transformers loads one) dequantizes to qmm's values."""
    w4 = qmm.Nf4Weight.quantize(randn((48, 320), 2).to(device))
    sd = w4.to_bnb_state_dict(dtype=torch.float32)
    stats = {k: v for k, v in sd.items() if k != "weight"}
    w = bnb.nn.Params4bit.from_prequantized(sd["weight"], stats, requires_grad=False, device=device)
    assert torch.equal(bnb.functional.dequantize_4bit(w.data, w.quant_state).float(), w4.dequantize(torch.float32))


def test_bitsandbytes_cpu_inference_layout_is_refused_not_misread():
    """bitsandbytes repacks a layer's weight for its AVX512-BF16 CPU kernels when the layer runs inference (its
    own code order, bf16 scales): from_bnb refuses that layout by name, and a patched layer leaves such a weight to
    bitsandbytes (where this CPU has the kernels), with bitsandbytes' own result."""
    convert = getattr(bnb.functional, "_convert_weight_packed_for_cpu", None)
    if convert is None:
        pytest.skip("this bitsandbytes has no CPU inference layout")
    layer = bnb_linear(randn((64, 128), 7), "cpu")
    layer.weight.data, layer.weight.quant_state = convert(layer.weight.data, layer.weight.quant_state)
    with pytest.raises(qmm.Error) as e:
        qmm.Nf4Weight.from_bnb(layer.weight, layer.weight.quant_state)
    assert e.value.code == "Unsupported" and "packing_format_for_cpu" in str(e.value)
    if getattr(layer, "support_avx512bf16_for_cpu", False):
        x = randn((3, 128), 8).to(torch.bfloat16)
        with torch.no_grad():
            expected = layer.eval()(x)
            qmm.patch_bnb(layer)
            with pytest.warns(UserWarning, match="NF4 layout"):
                assert torch.equal(layer(x), expected)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qlora_llama(device, task_type=None, nf4=True):
    """A tiny Llama from transformers with bitsandbytes NF4 projections (the layout from_pretrained with
    load_in_4bit gives) and PEFT LoRA adapters on all seven, B random so that the adapters count. Every weight row
    is a whole number of blocks, as in real models (and as bitsandbytes' CPU dequantization needs, see above).
    nf4=False: the same model without bitsandbytes, in bf16."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if nf4:
        for name, module in list(model.named_modules()):
            if name.rpartition(".")[2] in PROJECTIONS:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, bnb_linear(module.weight.data, device))
    model = model.to(device) if nf4 else model.to(device, torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), init_lora_weights=False,
                             task_type=task_type)
    return peft.get_peft_model(model, config)


def loss_and_grads(model, ids, labels=None):
    loss = model(input_ids=ids, labels=ids if labels is None else labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_on_a_peft_llama(device, monkeypatch):
    """patch_bnb on a PEFT QLoRA Llama: the same loss and LoRA gradients as bitsandbytes computes, with no 4-bit
    product left to bitsandbytes, the adapters' names unchanged (PEFT saves them as before); PEFT's disable_adapter
    and (on a GPU) merge_adapter still work on the patched model. bitsandbytes rounds each projection's output to
    bf16 and qmm keeps it in fp32 (the model runs in fp32): the loss agrees to 1e-3, each gradient to 2^-5 of its
    largest value (both are within 1% of the model on the exactly dequantized weights)."""
    peft = pytest.importorskip("peft")
    model = qlora_llama(device)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    names = qmm.patch_bnb(model)
    assert len(names) == 2 * (7 * 2 + 2)  # each layer's seven LoRA layers, their bases, its attention and its MLP
    bnb_calls, adapter_calls, grouped = [], [], []
    matmul_4bit, linears = bnb.matmul_4bit, qmm.patch.lora_nf4_linears
    monkeypatch.setattr(bnb, "matmul_4bit", lambda *a, **k: bnb_calls.append(1) or matmul_4bit(*a, **k))
    monkeypatch.setattr(qmm.patch, "lora_nf4_linears", lambda *a, **k: grouped.append(1) or linears(*a, **k))
    hooks = [m.register_forward_hook(lambda *a: adapter_calls.append(1))
             for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    loss, grads = loss_and_grads(model, ids)
    for h in hooks:
        h.remove()
    assert bnb_calls == [], "a 4-bit product ran in bitsandbytes"
    assert adapter_calls == [], "an adapter ran as PEFT's modules, not in qmm's fused op"
    assert len(grouped) == 2, "q, k and v did not run as one op"
    assert abs(loss - ref_loss) <= 1e-3 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    for n, g in grads.items():
        r = ref_grads[n]
        assert (g - r).abs().max().item() <= 2.0 ** -5 * r.abs().max().item(), n
    assert set(peft.get_peft_model_state_dict(model)) == {n.replace(".default", "") for n in grads}

    # PEFT merges into bitsandbytes weights only with its bitsandbytes-aware LoRA layers, which it uses on a GPU.
    down_proj = model.get_submodule("base_model.model.model.layers.0.mlp.down_proj")
    mergeable = type(down_proj).__module__.endswith(".bnb")
    with torch.no_grad():
        got = [model(input_ids=ids).logits]
        with model.disable_adapter():
            got.append(model(input_ids=ids).logits)
        if mergeable:
            model.merge_adapter()  # bitsandbytes quantizes W + BA into a new weight: the patched layers must read it
            got.append(model(input_ids=ids).logits)
            model.unmerge_adapter()
        qmm.unpatch_bnb(model)
        ref = [model(input_ids=ids).logits]
        with model.disable_adapter():
            ref.append(model(input_ids=ids).logits)
        if mergeable:
            model.merge_adapter()
            ref.append(model(input_ids=ids).logits)
    for g, r in zip(got, ref):
        assert (g - r).abs().max().item() <= 2.0 ** -6 * r.abs().max().item()
    assert (ref[0] - ref[1]).abs().max().item() > 2.0 ** -4 * ref[0].abs().max().item()  # the adapters count


@pytest.mark.parametrize("device", DEVICES)
def test_patched_model_casts_its_adapters_once_a_forward(device, monkeypatch):
    """A patched PEFT model announces its forwards to qmm (a forward pre-hook): after the first, each forward copies
    every adapter's matrices for its ops in one cast launch (here the stacked a's of q/k/v and gate/up: the model
    runs in float32); adapters written without their version counters moving (as bitsandbytes' optimizers write
    them) are read as they are at the next forward, whose loss is the unpatched model's. unpatch_bnb removes the
    hook."""
    model = qlora_llama(device)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    qmm.patch_bnb(model)
    loss_and_grads(model, ids)
    casts = []
    real = qmm._qmm.cast
    monkeypatch.setattr(qmm._qmm, "cast", lambda *a, **k: casts.append(len(a[0])) or real(*a, **k))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.data.mul_(1.5)
    loss, _ = loss_and_grads(model, ids)
    assert casts == [2 * 5], casts  # per layer q, k, v's and gate's and up's a into their stacks
    qmm.unpatch_bnb(model)
    assert not model._forward_pre_hooks
    ref, _ = loss_and_grads(model, ids)
    assert abs(loss - ref) <= 1e-3 * abs(ref)


def test_adapters_trained_patched_save_and_load_with_peft(tmp_path):
    """The adapters of a patched model, trained a few AdamW steps, saved by PEFT (save_pretrained) under PEFT's own
    names and loaded into a fresh model, as a state dict or as a second named adapter made active (load_adapter,
    set_adapter): the fresh patched model gives the trained one's loss bit for bit."""
    peft = pytest.importorskip("peft")
    safetensors = pytest.importorskip("safetensors.torch")
    model = qlora_llama("cpu")
    qmm.patch_bnb(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        trained = model(input_ids=ids, labels=ids).loss.item()
    model.save_pretrained(tmp_path)
    saved = safetensors.load_file(str(tmp_path / "adapter_model.safetensors"))
    assert set(saved) == set(peft.get_peft_model_state_dict(model))
    assert not any("qmm" in k for k in saved)

    fresh = qlora_llama("cpu")
    qmm.patch_bnb(fresh)
    with torch.no_grad():
        untrained = fresh(input_ids=ids, labels=ids).loss.item()
        peft.set_peft_model_state_dict(fresh, saved)
        loaded = fresh(input_ids=ids, labels=ids).loss.item()
    assert loaded == trained != untrained

    other = qlora_llama("cpu")
    qmm.patch_bnb(other)
    other.load_adapter(str(tmp_path), adapter_name="trained")
    other.set_adapter("trained")
    with torch.no_grad():
        assert other(input_ids=ids, labels=ids).loss.item() == trained
        other.set_adapter("default")
        assert other(input_ids=ids, labels=ids).loss.item() == untrained


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True])
def test_patch_bnb_with_gradient_checkpointing(device, reentrant):
    """transformers' gradient checkpointing (both of PyTorch's modes) on a patched PEFT model: the layers run again
    in the backward, through qmm, and the loss and gradients are those without checkpointing, bit for bit."""
    model = qlora_llama(device)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    qmm.patch_bnb(model)
    loss, grads = loss_and_grads(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()  # what PEFT's prepare_model_for_kbit_training does for the reentrant mode
    model.train()
    loss_ckpt, grads_ckpt = loss_and_grads(model, ids)
    assert loss_ckpt == loss and all(torch.equal(grads_ckpt[n], g) for n, g in grads.items())


def test_patch_bnb_under_accelerate_hooks(monkeypatch):
    """A layer with accelerate's hooks (as from_pretrained with a device_map may leave them): patched, the hook
    still runs and qmm computes; unpatched, accelerate removes its hook as usual."""
    hooks = pytest.importorskip("accelerate.hooks")
    layer = bnb_linear(randn((48, 64), 5), "cpu")
    x = randn((3, 64), 6)
    expected = layer(x)
    seen = []

    class Seen(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(module)
            return args, kwargs

    hooks.add_hook_to_module(layer, Seen())
    assert qmm.patch_bnb(layer) == [""]
    monkeypatch.setattr(bnb, "matmul_4bit", None)  # bitsandbytes must not compute
    y = layer(x)
    assert seen == [layer] and (y - expected).abs().max().item() <= 2.0 ** -7 * expected.abs().max().item()
    monkeypatch.undo()
    qmm.unpatch_bnb(layer)
    hooks.remove_hook_from_module(layer)
    assert "_qmm_patch" not in layer.__dict__ and torch.equal(layer(x), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_inference_and_generate(device, monkeypatch):
    """A patched PEFT model in eval mode: its logits are bitsandbytes' (2^-6 of the largest, as above) and
    transformers' generate runs on it with every 4-bit product by qmm (decode steps are one-row products)."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    reference, model = qlora_llama(device).eval(), qlora_llama(device).eval()  # the same seeded weights
    qmm.patch_bnb(model)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        bnb_calls = []
        matmul_4bit = bnb.matmul_4bit
        monkeypatch.setattr(bnb, "matmul_4bit", lambda *a, **k: bnb_calls.append(1) or matmul_4bit(*a, **k))
        got = model(input_ids=ids).logits
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                do_sample=False, pad_token_id=0)
    assert bnb_calls == [] and tokens.shape == (2, 9)
    assert (got - expected).abs().max().item() <= 2.0 ** -6 * expected.abs().max().item()


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
@pytest.mark.parametrize("device", DEVICES)
def test_static_decoder_on_a_bf16_lora_model(device):
    """qmm.static_decoder serves a bf16 LoRA model without bitsandbytes too (patched for its norms and rotary
    embedding): the eager model's greedy tokens, twice."""
    model = qlora_llama(device, "CAUSAL_LM", nf4=False).eval()
    qmm.patch_bnb(model, fused_norm=True, fused_rope=True)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(input_ids=ids, **kw)
    try:
        decoder = qmm.static_decoder(model, max_cache_len=10, compile_kwargs=dict(backend="aot_eager"))
        for _ in range(2):
            assert torch.equal(decoder.generate(ids, **kw), eager)
    finally:
        qmm.unpatch_bnb(model)  # gives transformers its rotary function back for the tests after this one


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
@pytest.mark.parametrize("device", DEVICES)
def test_static_decoder_generates_the_eager_tokens_with_a_compiled_decode_step(device):
    """qmm.static_decoder (bench/decode.py's qmm-static): greedy generate of a patched PEFT QLoRA Llama with a
    static KV cache and its one-token decode step compiled with fullgraph=True (aot_eager here; on a GPU by default
    mode="reduce-overhead", which replays CUDA graphs) gives the eager patched model's tokens, adapters unmerged,
    with no graph break, over calls with other prompt lengths (one token too: the prefill stays eager); the
    model's forward is its own again after each call; too long a call and a cache of the caller's are qmm.Errors."""
    from torch._dynamo.utils import counters
    model = qlora_llama(device, "CAUSAL_LM").eval()
    qmm.patch_bnb(model)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    counters.clear()
    decoder = qmm.static_decoder(model, max_cache_len=16, compile_kwargs=dict(backend="aot_eager"))
    for length, seed in ((7, 1), (10, 2), (1, 3), (7, 4)):
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)
        with torch.no_grad():
            eager = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        static = decoder.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(static, eager), (length, static.tolist(), eager.tolist())
        assert "forward" not in model.get_base_model().__dict__
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    ids = torch.zeros((1, 11), dtype=torch.long, device=device)
    with pytest.raises(qmm.Error, match="11 prompt tokens and max_new_tokens 6 exceed max_cache_len 16"):
        decoder.generate(ids, **kw)
    with pytest.raises(qmm.Error, match="3 prompt tokens and max_length 20 exceed max_cache_len 16"):
        decoder.generate(ids[:, :3], max_length=20, **dict(kw, max_new_tokens=None))
    with pytest.raises(qmm.Error, match="16 prompt tokens and max_new_tokens 0 exceed max_cache_len 16"):
        decoder.generate(torch.zeros((1, 16), dtype=torch.long, device=device), do_sample=False, pad_token_id=0)
    # No length set: generate runs to the end of the cache at most
    out = decoder.generate(ids[:, :3], do_sample=False, pad_token_id=0, min_new_tokens=13)
    assert out.shape == (1, 16)
    qmm.unpatch_bnb(model)
    with pytest.raises(qmm.Error, match="cache_implementation is the decoder's own"):
        decoder.generate(ids[:, :3], cache_implementation="static", **kw)
    with pytest.raises(qmm.Error, match="a batch of 2 where the decoder's cache holds 1"):
        decoder.generate(torch.zeros((2, 3), dtype=torch.long, device=device), **kw)
    with pytest.raises(qmm.Error, match="input_ids must be a \\[batch, tokens\\] tensor"):
        decoder.generate([[1, 2]], **kw)
    with pytest.raises(qmm.Error, match="max_cache_len must be a positive int"):
        qmm.static_decoder(model, max_cache_len=0)
    for bad, fragment in (("model", "generative model"), (torch.nn.Linear(2, 2), "generative model")):
        with pytest.raises(qmm.Error, match=fragment):
            qmm.static_decoder(bad, max_cache_len=8)


def _with_dropout(model, p):
    for name, module in model.named_modules():
        if name.endswith("lora_dropout"):
            module["default"] = torch.nn.Dropout(p)
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_bf16_gradients_as_close_to_fp32_as_bitsandbytes(device):
    """A bf16 PEFT QLoRA Llama (the usual setup): patched, the adapters' products run in bf16 with fp32 sums where
    PEFT runs them in fp32. Against the same model in fp32 (bitsandbytes' products, PEFT's adapters), qmm's loss is
    as close as bitsandbytes' bf16 loss (2e-3 relative) and its LoRA gradients no further than bitsandbytes' own bf16
    gradients are (1.25 times their largest relative error, norm-wise)."""
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1)).to(device)
    truth_loss, truth = loss_and_grads(qlora_llama(device), ids)
    model = qlora_llama(device).to(torch.bfloat16)
    bnb_loss, bnb_grads = loss_and_grads(model, ids)
    qmm.patch_bnb(model)
    loss, grads = loss_and_grads(model, ids)

    def worst(g):
        return max(((g[n].double() - truth[n].double()).norm() / truth[n].double().norm()).item() for n in truth)
    assert abs(loss - truth_loss) <= max(2e-3 * abs(truth_loss), 2 * abs(bnb_loss - truth_loss))
    assert worst(grads) <= 1.25 * worst(bnb_grads), (worst(grads), worst(bnb_grads))


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_with_lora_dropout(device, monkeypatch):
    """LoRA dropout (0.1, as QLoRA recipes use): the patched model draws the same masks from PyTorch's generator as
    PEFT does (the loss agrees to 1e-3, as test_patch_bnb_on_a_peft_llama's) and gives its gradients, with every
    adapter in qmm's fused op. Gradients to 2^-4 of their largest value: dropout's 1/(1-p) scaling widens the gap
    between bitsandbytes' bf16 outputs and qmm's fp32 ones past 2^-5 on a GPU (docs/BENCHMARKS.md has the figure)."""
    model = _with_dropout(qlora_llama(device), 0.1).train()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(0)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    qmm.patch_bnb(model)
    adapter_calls = []
    hooks = [m.register_forward_hook(lambda *a: adapter_calls.append(1))
             for n, m in model.named_modules() if n.endswith("lora_A.default")]
    torch.manual_seed(0)
    loss, grads = loss_and_grads(model, ids)
    for h in hooks:
        h.remove()
    assert adapter_calls == [] and abs(loss - ref_loss) <= 1e-3 * abs(ref_loss)
    for n, g in grads.items():
        assert (g - ref_grads[n]).abs().max().item() <= 2.0 ** -4 * ref_grads[n].abs().max().item(), n


needs_compile = pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")


def _assert_updates_agree(params, ref_params, initial):
    """Each trained tensor moved from its initial value as the reference did, to 1% of the reference's move (in
    norm). Elementwise tolerances do not fit AdamW: an element whose gradient is near zero moves by up to the learning
    rate either way on a last-bit difference of its gradient, while a wrong backward moves whole tensors elsewhere."""
    for i, (p, q, p0) in enumerate(zip(params, ref_params, initial)):
        moved = (q.float() - p0.float()).norm()
        off = (p.float() - q.float()).norm()
        assert moved > 0 and off <= 1e-2 * moved, (i, tuple(p.shape), off.item(), moved.item())


@needs_compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_patched_peft_llama_trains_under_torch_compile_fullgraph(device, checkpointing):
    """torch.compile(fullgraph=True) of a patched PEFT QLoRA Llama (all seven projections and the MLP patched), with
    and without transformers' gradient checkpointing: no graph break, and three AdamW steps give the eager patched
    model's losses and trained LoRA weights. On the CPU with LoRA dropout on, exactly (aot_eager runs PyTorch's own
    ops as eager does, dropout draws the same masks; qmm's ops are the same kernels). On a GPU aot_eager's dropout
    draws other masks than eager's fused kernel and its decompositions change PyTorch's own kernels (the first loss
    already differs in its last bits), so there dropout is off, the losses agree to 1e-4 relative and the weights
    moved alike (_assert_updates_agree)."""
    from torch._dynamo.utils import counters
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)

    exact = device == "cpu"

    def train(compiled):
        model = _with_dropout(qlora_llama(device), 0.1 if exact else 0.0).train()
        qmm.patch_bnb(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # transformers' own graph breaks, not qmm's (bitsandbytes' model has them too): the warning that
            # use_cache is on, the hook that makes the embeddings' output require grad (which only the reentrant
            # mode needs), and a context variable it sets inside each checkpointed layer (dynamo's config below)
            model.config.use_cache = False
            model.disable_input_require_grads()
        params = [p for p in model.parameters() if p.requires_grad]
        initial = [p.detach().clone() for p in params]
        opt = torch.optim.AdamW(params, lr=1e-2)
        step = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        torch.manual_seed(0)
        losses = []
        for _ in range(3):
            loss = step(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in params], initial

    eager = train(False)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointing):
        compiled = train(True)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    if exact:
        assert compiled[0] == eager[0]
        assert all(torch.equal(c, e) for c, e in zip(compiled[1], eager[1]))
    else:
        assert compiled[0] == pytest.approx(eager[0], rel=1e-4)
        _assert_updates_agree(compiled[1], eager[1], eager[2])


@needs_compile
def test_patched_peft_llama_under_transformers_trainer_with_torch_compile(tmp_path):
    """transformers' Trainer with torch_compile=True (as its users switch compilation on), gradient checkpointing
    on, on a patched PEFT QLoRA Llama: it trains (the loss of a repeated batch falls), with no graph break at qmm's
    layers."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters
    model = qlora_llama("cpu")
    qmm.patch_bnb(model)
    ids = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids}] * 16
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=2, learning_rate=3e-2, logging_steps=1,
        torch_compile=True, torch_compile_backend="aot_eager", gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[], save_strategy="no", use_cpu=True)
    model.config.use_cache = False
    torch._dynamo.reset()
    counters.clear()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        trainer.train()
    # The one graph break is transformers': the hook the Trainer adds for checkpointing, making the embeddings'
    # output require grad.
    assert all("requires_grad_" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled,task_type", [(False, None), (True, None), (False, "CAUSAL_LM")])
def test_patch_bnb_fused_loss_on_a_peft_llama(compiled, task_type, device):
    """patch_bnb(fused_loss=True, fused_norm=True, fused_rope=True): a PEFT QLoRA Llama (its RMSNorms and rotary
    embeddings by qmm too; the rotary function restored by unpatch_bnb) trained with labels returns transformers'
    causal-LM loss (shift by one, -100 ignored; the sum over num_items_in_batch too) computed from the hidden states by
    linear_cross_entropy_loss, and no logits; its LoRA gradients are the unpatched model's; eval mode, calls without
    labels and generate are unchanged; training builds no KV cache unless asked (use_cache=True). Compiled
    (aot_eager, fullgraph) it gives the same loss with no graph break.
    The model is float32: the loss within fp32 sums' reordering (1e-5 relative on the CPU's fp64 oracle, 1e-4 on a
    GPU's fp32 log-sum-exp)."""
    if compiled and not qmm.compile_ops.AVAILABLE:
        pytest.skip("needs PyTorch >= 2.4")
    from torch._dynamo.utils import counters
    model = qlora_llama(device, task_type).train()  # CAUSAL_LM: PEFT's PeftModelForCausalLM around it
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    tol = 1e-5 if device == "cpu" else 1e-4
    labels = ids.clone()
    labels[0, :3] = -100
    ref_loss, ref_grads = loss_and_grads(model, ids, labels)
    ref_sum = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40, device=device)).loss.item()
    from transformers.models.llama import modeling_llama
    own_rotary = modeling_llama.apply_rotary_pos_emb
    patched = qmm.patch_bnb(model, fused_loss=True, fused_norm=True, fused_rope=True)
    assert sum(n.endswith("norm") for n in patched) == 5, patched  # 2 layers x 2, and the final one
    assert modeling_llama.apply_rotary_pos_emb is not own_rotary
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    out = step(input_ids=ids, labels=labels)
    assert out.logits is None and out.past_key_values is None
    assert abs(out.loss.item() - ref_loss) <= tol * abs(ref_loss)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    for n, g in grads.items():
        assert (g - ref_grads[n]).abs().max().item() <= 2.0 ** -5 * ref_grads[n].abs().max().item(), n
    if compiled:
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        qmm.unpatch_bnb(model)
        assert modeling_llama.apply_rotary_pos_emb is own_rotary
        return
    summed = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40, device=device)).loss.item()
    assert abs(summed - ref_sum) <= tol * abs(ref_sum)
    cached = model(input_ids=ids, labels=labels, use_cache=True)
    assert cached.past_key_values is not None and abs(cached.loss.item() - ref_loss) <= tol * abs(ref_loss)
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels).logits is not None
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                                pad_token_id=0)
    assert tokens.shape == (2, 11)
    qmm.unpatch_bnb(model)
    assert modeling_llama.apply_rotary_pos_emb is own_rotary


def test_patched_causal_lm_keeps_the_causal_attention_where_transformers_cannot_look(monkeypatch):
    """In a CUDA graph capture transformers cannot read the position ids to rule out packed sequences (it looks
    where no KV cache is built, as the fused loss's training calls build none), so it builds the causal mask as a
    tensor (SDPA's masked path). Made to believe it is capturing, the unpatched model's decoder layers get a mask
    without a cache, and the model patched with fused_loss, called without attention_mask and position_ids, gets
    none (SDPA's causal kernel), with the same loss; called with position ids, the checks run as transformers' own.
    unpatch_bnb gives transformers its functions back."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    own = (masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa)
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *a, **k: True)
    model = qlora_llama("cpu").train()
    masks = []
    for layer in model.base_model.model.model.layers:
        layer.register_forward_pre_hook(lambda mod, args, kwargs: masks.append(kwargs.get("attention_mask")),
                                        with_kwargs=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    assert masks and all(isinstance(m, torch.Tensor) for m in masks), masks  # the premise: a mask while tracing
    qmm.patch_bnb(model, fused_loss=True)
    assert masking_utils.find_packed_sequence_indices is not own[0]
    masks.clear()
    loss = model(input_ids=ids, labels=ids).loss.item()
    assert masks and all(m is None for m in masks), masks
    assert abs(loss - ref) <= 1e-5 * abs(ref)
    masks.clear()
    positions = torch.arange(9).expand(2, 9)
    model(input_ids=ids, labels=ids, position_ids=positions)
    assert masks and all(isinstance(m, torch.Tensor) for m in masks), masks
    qmm.unpatch_bnb(model)
    assert (masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa) == own


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
def test_patched_causal_lm_compiles_without_a_causal_mask(monkeypatch):
    """Under torch.compile (aot_eager, fullgraph) transformers builds the causal mask as a tensor whatever the
    inputs (its skip needs PyTorch 2.14's export check); the model patched with fused_loss, called without
    attention_mask and position_ids, compiles without one: SDPA's mask function returns None while tracing."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    made = []
    own_sdpa_mask = masking_utils.sdpa_mask

    def sdpa_mask(*args, **kwargs):
        mask = own_sdpa_mask(*args, **kwargs)
        made.append(mask)
        return mask

    mapping = getattr(getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None), "_global_mapping", {})
    if "sdpa" not in mapping:
        pytest.skip("a transformers without its mask functions' registry")
    monkeypatch.setattr(masking_utils, "sdpa_mask", sdpa_mask)
    monkeypatch.setitem(mapping, "sdpa", sdpa_mask)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    for fused in (False, True):
        model = qlora_llama("cpu").train()
        if fused:
            qmm.patch_bnb(model, fused_loss=True)
        torch._dynamo.reset()
        made.clear()
        torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids, use_cache=False)
        assert made, "sdpa_mask was not called"
        assert all((m is None) == fused for m in made), (fused, [None if m is None else m.shape for m in made])
        qmm.unpatch_bnb(model)


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_fused_loss_refuses_a_label_out_of_range(device):
    """The patched causal LM checks its labels without waiting for the forward pass (the check starts with the
    labels and ends at the loss): a label out of [0, vocab) that the loss would use is a qmm.Error naming its index
    in the caller's labels, before any gradient exists; the first token's label, which the shifted loss never
    uses, is not checked (as transformers' own loss does not); fixed labels then train."""
    model = qlora_llama(device).train()
    qmm.patch_bnb(model, fused_loss=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    labels = ids.clone()
    labels[1, 5], labels[1, 7], labels[0, 0] = 128, -5, 1000
    with pytest.raises(qmm.Error) as e:
        model(input_ids=ids, labels=labels)
    assert e.value.code == "InvalidArgument" and "labels[1, 5] is 128" in str(e.value) and "[0, 128)" in str(e.value)
    assert all(p.grad is None for p in model.parameters())
    labels[1, 5] = -100
    with pytest.raises(qmm.Error, match=r"labels\[1, 7\] is -5"):
        model(input_ids=ids, labels=labels)
    labels[1, 7] = 3
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_loss_norm_and_rope_on_a_bf16_lora_model_without_bitsandbytes(device):
    """A bf16 Llama with PEFT LoRA and no bitsandbytes (a plain LoRA run) patched with fused_loss, fused_norm and
    fused_rope: only the loss, the RMSNorms (with the decoder layers' residual adds) and the rotary embedding change
    hands (no NF4 layer to patch), the loss is the unpatched model's within 2^-8 relative (qmm's fp32 logits against
    bf16 logits upcast, the norms' and rotations' bf16 roundings in another order; 7e-6 seen on the CPU), the LoRA
    gradients within 2^-4 of their largest value (bf16 throughout; 0.035 seen), and unpatch_bnb restores
    everything."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers.models.llama import modeling_llama
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS),
                                                       init_lora_weights=False, task_type="CAUSAL_LM")).train()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    own_rotary = modeling_llama.apply_rotary_pos_emb
    patched = qmm.patch_bnb(model, fused_loss=True, fused_norm=True, fused_rope=True)
    assert sorted(n.rpartition(".")[2] for n in patched) == sorted(["model"] + ["norm", "0", "1"] + [
        "input_layernorm", "post_attention_layernorm"] * 2), patched
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss - ref_loss) <= 2.0 ** -8 * abs(ref_loss)
    for n, g in grads.items():
        assert (g.float() - ref_grads[n].float()).abs().max() <= 2.0 ** -4 * ref_grads[n].float().abs().max(), n
    qmm.unpatch_bnb(model)
    assert modeling_llama.apply_rotary_pos_emb is own_rotary
    assert loss_and_grads(model, ids)[0] == ref_loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_decoder_layers_of_transformers_models(device, family, checkpointing, monkeypatch):
    """patch_bnb(fused_norm=True) on transformers' own Llama and Qwen2 (bf16, PEFT LoRA, no bitsandbytes), with and
    without gradient checkpointing: every decoder layer gets the fused forward (transformers' forward is the known
    one in this release), which runs once a layer forward and again in each checkpointed recompute; the loss is the
    unpatched model's within 2^-8 relative and the LoRA gradients within 2^-4 of their largest value
    (test_fused_loss_norm_and_rope_on_a_bf16_lora_model_without_bitsandbytes's tolerances)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config_cls, lm_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    config = config_cls(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    model = lm_cls(config).to(device, torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS),
                                                       init_lora_weights=False, task_type="CAUSAL_LM")).train()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    patched = qmm.patch_bnb(model, fused_norm=True)
    assert sum(n.rpartition(".")[2] in ("0", "1") for n in patched) == 2, patched
    calls = []
    fused = qmm.patch.add_rms_norm_autograd
    monkeypatch.setattr(qmm.patch, "add_rms_norm_autograd", lambda *a: calls.append(1) or fused(*a))
    loss, grads = loss_and_grads(model, ids)
    assert len(calls) == (4 if checkpointing else 2)
    assert abs(loss - ref_loss) <= 2.0 ** -8 * abs(ref_loss)
    for n, g in grads.items():
        assert (g.float() - ref_grads[n].float()).abs().max() <= 2.0 ** -4 * ref_grads[n].float().abs().max(), n
    qmm.unpatch_bnb(model)
    assert loss_and_grads(model, ids)[0] == ref_loss


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_patched_peft_llama_step_replays_as_a_cuda_graph(fused):
    """qmm.graph_step on a patched PEFT QLoRA Llama's whole step (forward, backward, capturable AdamW), with and
    without the fused loss, norms and rotary embeddings: ten steps on changing batches give the eager patched
    step's losses and trained LoRA weights, with one capture. Not bit for bit: PyTorch's own ops may round
    differently under capture (qmm's kernels and plans do not change), so the losses agree to 1e-4 relative and
    the weights moved alike (_assert_updates_agree)."""
    def trainer():
        model = qlora_llama("cuda").train()
        qmm.patch_bnb(model, fused_loss=fused, fused_norm=fused, fused_rope=fused)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2, capturable=True)

        def step(ids, labels):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return model, params, step

    batches = [torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(s)).cuda() for s in range(10)]
    eager_model, eager_params, eager_step = trainer()
    initial = [p.detach().clone() for p in eager_params]
    eager = [eager_step(ids, ids).item() for ids in batches]
    qmm.unpatch_bnb(eager_model)
    model, params, step = trainer()
    graphed = qmm.graph_step(step, warmup=2)
    replayed = [graphed(ids, ids).item() for ids in batches]
    qmm.unpatch_bnb(model)
    assert graphed.captured == 1
    assert replayed == pytest.approx(eager, rel=1e-4)
    _assert_updates_agree(params, eager_params, initial)


def _ddp_rank(rank, world, port, folder, fused):
    """One rank of test_patch_bnb_under_distributed_data_parallel: the patched model in DDP (gloo, CPU) on its half
    of the batch; its LoRA gradients (averaged by DDP) and loss saved for the parent."""
    import os

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = qlora_llama("cpu", "CAUSAL_LM")
        qmm.patch_bnb(model, fused_loss=fused, fused_norm=fused, fused_rope=fused)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ids = torch.randint(0, 128, (2 * world, 9), generator=torch.Generator().manual_seed(1))[2 * rank:2 * rank + 2]
        for _ in range(2):  # the second step: after the first's gradients, as training does
            model.zero_grad(set_to_none=True)
            loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save((loss.item(), grads), f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fused", [False, True])
def test_patch_bnb_under_distributed_data_parallel(tmp_path, fused):
    """A patched PEFT QLoRA Llama trained with DistributedDataParallel (accelerate's multi-GPU default), two ranks on
    the CPU: each rank's LoRA gradients are the average DDP makes of the ranks' gradients, equal to one process's
    gradients of the mean loss over the whole batch (the ranks' halves have equal token counts)."""
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as mp
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(2, port, str(tmp_path), fused), nprocs=2, join=True)
    model = qlora_llama("cpu", "CAUSAL_LM")
    qmm.patch_bnb(model, fused_loss=fused, fused_norm=fused, fused_rope=fused)
    ids = torch.randint(0, 128, (4, 9), generator=torch.Generator().manual_seed(1))
    _, want = loss_and_grads(model, ids)
    for rank in range(2):
        _, got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got) == set(want)
        for name, g in got.items():
            err = (g - want[name]).abs().max() / want[name].abs().max()
            assert err < 1e-4, (rank, name, float(err))
