"""patch_bnb: a bitsandbytes 4-bit model (PEFT-wrapped or not) computed by qmm, in place.

patch_bnb leaves a model as it is (its modules, parameters and state-dict names, PEFT's LoRA adapters, accelerate's
hooks) and changes only how the patched modules compute: with qmm wherever the case is one qmm covers, with the
module's own forward everywhere else, decided per call. Four kinds of module are patched (and, on request, a causal
LM's loss, its RMSNorms and its rotary embedding: patch_bnb's options):
- a bitsandbytes NF4 layer: base product and bias as one qmm op (lora_nf4_linear without adapter);
- a PEFT LoRA layer around one: base, bias and its active plain adapter as one op (lora_nf4_linear), PEFT's own
  lora_A/lora_B parameters trained (their products in x's dtype with fp32 sums), its dropout applied by PyTorch;
- a Llama/Qwen/Mistral-style MLP on such layers: gate and up (with their adapters) and the SwiGLU as one op
  (lora_nf4_swiglu), then its down_proj (patched as above);
- a Llama/Qwen2/Qwen3/Mistral attention on such layers: q, k and v as one op (lora_nf4_linears), handed to the
  projections' calls inside the attention's own forward.

Every forward traces under torch.compile without a graph break: while compiling, a layer's NF4 weight reaches qmm's
custom ops as its tensors read from the layer at the call (compile_ops.py), never through a Python-side cache; the
one value not on the layer as a tensor qmm can read without a device synchronization, the double quantization's
offset, is kept on bitsandbytes' QuantState as a CPU tensor, made when the weight is first seen (patch_bnb, or an
eager call after bitsandbytes replaced it)."""
import ast
import collections
import functools
import inspect
import sys
import textwrap
import types
import warnings
import weakref

import torch

from . import _copies, _qmm
from ._base import _check_path, _error, _flag
from ._impl import PendingLabelCheck
from .compile_ops import compiling
from .functional import (Lora, add_rms_norm_autograd, linear_cross_entropy_loss, lora_nf4_linear, lora_nf4_linears,
                         lora_nf4_mlp, lora_nf4_swiglu, nf4_gate_up_linear, rms_norm_autograd,
                         rms_norm_residual_autograd, rope_autograd, swiglu_autograd)
from .layers import _has_bnb_weight, _is_lora_wrapper, _model
from .nf4 import Nf4Weight

_PATCH = "_qmm_patch"  # set on a patched module: its _Patch
_OFFSET = "_qmm_offset"  # set on a bitsandbytes QuantState: its offset as a 0-d float64 CPU tensor
_QMM_DTYPES = (torch.float32, torch.bfloat16)
_nf4_cache = weakref.WeakKeyDictionary()  # bitsandbytes layer -> (its weight's identity, Nf4Weight)


def _is_bnb_nf4_layer(layer):
    """A bitsandbytes 4-bit layer holding NF4 (or not yet quantized: bitsandbytes quantizes on moving to a GPU); not
    a PEFT LoRA layer around one, which shows its base's weight."""
    if not _has_bnb_weight(layer) or _is_lora_wrapper(layer):
        return False
    weight = layer.weight  # before quantization Params4bit holds its quant_type itself
    return getattr(weight.quant_state, "quant_type", getattr(weight, "quant_type", "nf4")) == "nf4"


def _bnb_nf4_base(layer):
    """The bitsandbytes NF4 layer that computes `layer`'s base product (itself or a PEFT wrapper's), or None."""
    base = layer.base_layer if _is_lora_wrapper(layer) else layer
    return base if _is_bnb_nf4_layer(base) else None


def _nf4_state(weight):
    """The weight's QuantState where it holds NF4 in bitsandbytes' layout, else None (not quantized yet, another
    quant type, or repacked for bitsandbytes' CPU inference kernels after an unpatched layer ran inference)."""
    qs = getattr(weight, "quant_state", None)
    if qs is None or qs.quant_type != "nf4" or getattr(qs, "packing_format_for_cpu", False):
        return None
    return qs


def _offset_of(qs):
    """The QuantState's offset as compile_ops takes it, made once per QuantState (a device read: eager only)."""
    offset = qs.__dict__.get(_OFFSET)
    if offset is None:
        value = float(qs.offset) if getattr(qs, "state2", None) is not None else 0.0
        offset = torch.tensor(value, dtype=torch.float64)
        setattr(qs, _OFFSET, offset)
    return offset


def _current_nf4(layer):
    """The Nf4Weight of a bitsandbytes layer's weight as it is now (eager calls), or None where it is not NF4.
    Cached per layer and made again when the weight was replaced or moved (bitsandbytes quantizes on .to(device); a
    PEFT merge quantizes a new weight)."""
    weight = layer.weight
    qs = _nf4_state(weight)
    if qs is None:
        return None
    key = (weight.data_ptr(), id(qs))  # a move or a new quantization changes one of them
    cached = _nf4_cache.get(layer)
    if cached is None or cached[0] != key:
        _offset_of(qs)
        cached = _nf4_cache[layer] = (key, Nf4Weight.from_bnb(weight, qs))
    return cached[1]


def _traced_nf4(layer):
    """The weight as compile_ops' argument tuple, read from the layer while torch.compile traces (attribute reads
    it guards on; no lookup of its own). A QuantState that no eager call or patch_bnb has seen has no offset tensor
    yet: making one reads the device, so that breaks the graph once."""
    weight = layer.weight
    qs = _nf4_state(weight)
    if qs is None:
        return None
    offset = getattr(qs, _OFFSET, None)
    if offset is None:
        offset = _offset_outside_graph(qs)
    codes = weight if weight.dtype == torch.uint8 else weight.view(torch.uint8)
    nested = getattr(qs, "state2", None)
    return (codes, qs.absmax, None if nested is None else nested.absmax, None if nested is None else nested.code,
            offset, qs.shape[0], qs.shape[1], qs.blocksize)


# Called while tracing: a graph break there, since making the offset reads the device.
_offset_outside_graph = torch.compiler.disable(_offset_of) if hasattr(getattr(torch, "compiler", None), "disable") \
    else _offset_of


def _weight_now(layer):
    return _traced_nf4(layer) if compiling() else _current_nf4(layer)


def _lora_plan(layer):
    """How `layer`'s own forward adds LoRA, and so how the patched forwards compute it: "none" (a plain layer;
    adapters disabled, or merged into the base, or none active), ("one", name) (one active plain adapter with linear
    lora_A and lora_B without bias: qmm's fused ops take it), "add" (several, or a lora_B with a bias: qmm's base,
    PEFT's way for the adapters), or None for anything else (DoRA and other variants; a disabled adapter that is
    still merged), which the patched forwards leave to the layer. Each attribute is read once: this runs per call."""
    if not _is_lora_wrapper(layer):
        return "none"
    if layer.disable_adapters:
        return None if layer.merged else "none"
    if layer.merged:
        return "none"
    lora_a = layer.lora_A
    active = [a for a in layer.active_adapters if a in lora_a]
    if not active:
        return "none"
    variants, dora = getattr(layer, "lora_variant", {}), getattr(layer, "use_dora", {})
    if any(a in variants or dora.get(a, False) for a in active):
        return None
    if len(active) > 1:
        return "add"
    a, b = lora_a[active[0]], layer.lora_B[active[0]]
    plain = type(a) is torch.nn.Linear and type(b) is torch.nn.Linear and a.bias is None and b.bias is None
    return ("one", active[0]) if plain else "add"


def _adapter(layer, plan, x):
    """The adapter of a ("one", name) plan as a qmm.Lora for input x, its dropout, where active, applied here; None
    for other plans."""
    if not isinstance(plan, tuple):
        return None
    name = plan[1]
    drop = layer.lora_dropout[name]
    idle = _idle(drop)
    return Lora(layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name], None if idle else drop(x))


def _idle(drop):
    """Whether an adapter's dropout module passes its input through (none, p = 0, or eval mode)."""
    return isinstance(drop, torch.nn.Identity) or \
        (isinstance(drop, torch.nn.Dropout) and (drop.p == 0 or not drop.training))


def _block_down(layer):
    """A down projection that lora_nf4_mlp takes into the block: (its NF4 weight now, its adapter as a qmm.Lora or
    None) where it is a bitsandbytes NF4 layer without a bias whose adapter, if any, is one plain adapter without
    active dropout (its input h is made inside the op); else None (the block then calls the module)."""
    base = _bnb_nf4_base(layer)
    plan = _lora_plan(layer) if base is not None and base.bias is None else None
    if plan is None or plan == "add" or (isinstance(plan, tuple) and not _idle(layer.lora_dropout[plan[1]])):
        return None
    w = _weight_now(base)
    if w is None:
        return None
    return w, (None if plan == "none" else
               Lora(layer.lora_A[plan[1]].weight, layer.lora_B[plan[1]].weight, layer.scaling[plan[1]]))


def _add_lora(layer, x, y):
    """y + layer's active LoRA terms for input x, computed as PEFT's LoRA layer computes them."""
    convert = not torch.is_autocast_enabled()
    for a in layer.active_adapters:
        if a not in layer.lora_A.keys():
            continue
        lora_a = layer.lora_A[a]
        xa = x.to(lora_a.weight.dtype) if convert else x
        term = layer.lora_B[a](lora_a(layer.lora_dropout[a](xa))) * layer.scaling[a]
        y = y + (term.to(y.dtype) if convert else term)
    return y


def _unpatched(module, *args, **kwargs):
    """Calls the forward `module` had before patch_bnb (the class's function called with the module, which
    torch.compile traces where a bound method made here would break its graph)."""
    patch = module.__dict__[_PATCH]
    if patch.attr is None:
        return getattr(type(module), _ORIGINAL)(module, *args, **kwargs)
    if patch.previous is not None:
        return patch.previous(*args, **kwargs)
    return getattr(type(module), patch.attr)(module, *args, **kwargs)


def _fallback(module, why, *args, **kwargs):
    """Runs the module's own forward for a call qmm does not cover, saying why once per reason (Python's warnings
    show each message once), so that a model that stays slow tells its user."""
    warnings.warn(f"qmm.patch_bnb: {why}; the module's own forward runs instead", stacklevel=3)
    return _unpatched(module, *args, **kwargs)


def _uncovered_call(x, args, kwargs):
    """Why qmm does not take this call's arguments, or None."""
    if args or kwargs:
        return "a call with arguments besides the input"
    if x.dtype not in _QMM_DTYPES:
        return f"{x.dtype} activations (qmm takes torch.float32 and torch.bfloat16)"
    return None


_NOT_NF4 = "a weight not in bitsandbytes' NF4 layout (not quantized yet, or repacked for bitsandbytes' CPU kernels)"
_VARIANT = "a LoRA variant (DoRA, ...) or a disabled adapter still merged"


def _path(module):
    return module.__dict__[_PATCH].path


# A projection's output computed ahead by its attention's grouped call (_attention_forward), by the projection
# module's identity: (the input it was computed for, the output), taken by the module's next call on that input.
_precomputed = {}


def _take_precomputed(layer, x, args, kwargs):
    entry = _precomputed.pop(id(layer), None) if _precomputed else None
    return entry[1] if entry is not None and entry[0] is x and not args and not kwargs else None


def _bnb_linear_forward(layer, x, *args, **kwargs):
    y = _take_precomputed(layer, x, args, kwargs)
    if y is not None:
        return y
    why = _uncovered_call(x, args, kwargs)
    w = None if why else _weight_now(layer)
    if w is None:
        return _fallback(layer, why or _NOT_NF4, x, *args, **kwargs)
    return lora_nf4_linear(x, w, None, layer.bias, _path(layer))


def _lora_linear_forward(layer, x, *args, **kwargs):
    """A PEFT LoRA layer on a bitsandbytes NF4 base: one op for base, bias and its one active adapter."""
    y = _take_precomputed(layer, x, args, kwargs)
    if y is not None:
        return y
    why = _uncovered_call(x, args, kwargs)
    plan = _lora_plan(layer) if why is None else None
    why = why or (None if plan is not None else _VARIANT)
    base = layer.base_layer
    w = None if why else _weight_now(base)
    if w is None:
        return _fallback(layer, why or _NOT_NF4, x, *args, **kwargs)
    if plan == "add":  # the base by qmm, the adapters as PEFT adds them
        return _add_lora(layer, x, lora_nf4_linear(x, w, None, base.bias, _path(layer)))
    return lora_nf4_linear(x, w, _adapter(layer, plan, x), base.bias, _path(layer))


def _swiglu_mlp_forward(mlp, x, *args, **kwargs):
    return _swiglu_mlp(mlp, x, args, kwargs, None)


def _plus(residual, y):
    return y if residual is None else residual + y


def _swiglu_mlp(mlp, x, args, kwargs, residual):
    """A patched SwiGLU MLP's output for x, plus residual where given (in the down projection's GEMM where the block
    runs as one op, else added after)."""
    projections = (mlp.gate_proj, mlp.up_proj)
    bases = [_bnb_nf4_base(p) for p in projections]
    plans = [_lora_plan(p) for p in projections]
    why = _uncovered_call(x, args, kwargs)
    if why is None and None in bases:
        why = "gate_proj or up_proj is no longer a bitsandbytes NF4 layer"
    if why is None and None in plans:
        why = _VARIANT + " on gate_proj or up_proj"
    weights = [None] if why else [_weight_now(b) for b in bases]
    if None in weights:
        return _plus(residual, _fallback(mlp, why or _NOT_NF4, x, *args, **kwargs))
    if all(b.bias is None for b in bases) and "add" not in plans:  # gate, up, their adapters and the SwiGLU: one op
        loras = [_adapter(p, plan, x) for p, plan in zip(projections, plans)]
        down = _block_down(mlp.down_proj)
        if down is not None:  # down too: h is not kept for the backward
            return lora_nf4_mlp(x, *weights, down[0], *loras, down[1], _path(mlp), residual=residual)
        return _plus(residual, mlp.down_proj(lora_nf4_swiglu(x, *weights, *loras, _path(mlp))))
    outs = nf4_gate_up_linear(x, *weights, _path(mlp))  # biases, or several adapters: added as PEFT adds them
    gate, up = ((y if b.bias is None else y + b.bias.to(y.dtype)) for y, b in zip(outs, bases))
    gate, up = ((y if plan == "none" else _add_lora(p, x, y)) for p, plan, y in zip(projections, plans, (gate, up)))
    return _plus(residual, mlp.down_proj(swiglu_autograd(gate, up)))


def _mlp_plus(mlp, h, residual):
    """residual + mlp(h), the decoder layer's last add in the MLP's down projection where qmm runs the MLP itself
    (patched by patch_bnb, called without hooks of its own that calling the module would run)."""
    patch = mlp.__dict__.get(_PATCH)
    if patch is not None and patch.fn is _swiglu_mlp_forward and patch.attr is None and \
            not mlp._forward_hooks and not mlp._forward_pre_hooks:
        return _swiglu_mlp(mlp, h, (), {}, residual)
    return residual + mlp(h)


_QKV = ("q_proj", "k_proj", "v_proj")
# The attention classes whose forward calls q_proj, k_proj and v_proj on its hidden states and applies the rotary
# embedding through its modeling module's apply_rotary_pos_emb.
_ATTENTIONS = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention")


def _attention_forward(attn, *args, **kwargs):
    """A Llama/Qwen2/Qwen3/Mistral attention whose q_proj, k_proj and v_proj are patched NF4 layers (PEFT-wrapped or
    not): q, k and v (bases, biases and plain adapters) as one op (lora_nf4_linears) on the hidden states, handed to
    the projections, then the attention's own forward, whose q_proj/k_proj/v_proj calls on those hidden states
    return them. Where the grouped op does not cover the projections (several adapters, a LoRA variant, another
    dtype...), the attention's own forward runs and each projection's patch decides for itself."""
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dtype not in _QMM_DTYPES:
        return _unpatched(attn, *args, **kwargs)
    projections = [getattr(attn, name) for name in _QKV]
    bases = [_bnb_nf4_base(p) if _PATCH in p.__dict__ else None for p in projections]
    plans = [_lora_plan(p) for p in projections]
    if None in bases or any(plan is None or plan == "add" for plan in plans):
        return _unpatched(attn, *args, **kwargs)
    weights = [_weight_now(b) for b in bases]
    if None in weights:
        return _unpatched(attn, *args, **kwargs)
    loras = [_adapter(p, plan, x) for p, plan in zip(projections, plans)]
    outputs = lora_nf4_linears(x, weights, loras, [b.bias for b in bases], _path(attn))
    for p, y in zip(projections, outputs):
        _precomputed[id(p)] = (x, y)
    try:
        return _unpatched(attn, *args, **kwargs)
    finally:
        for p in projections:
            _precomputed.pop(id(p), None)


def _is_qkv_attention(module):
    """A Llama/Qwen2/Qwen3/Mistral attention (whose forward calls q_proj, k_proj and v_proj on its hidden states)
    with bitsandbytes NF4 bases under all three."""
    return type(module).__name__ in _ATTENTIONS and \
        all(_bnb_nf4_base(getattr(module, p, None)) is not None for p in _QKV)


def _is_causal_lm(module):
    """A Hugging Face causal LM of the Llama/Qwen2/Mistral kind: a decoder under .model returning hidden states, and
    a linear lm_head without bias or logit soft-capping."""
    config = getattr(module, "config", None)
    transformers_model = any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)  # not PEFT's wrapper
    return transformers_model and type(module).__name__.endswith("ForCausalLM") and hasattr(module, "model") and \
        type(getattr(module, "lm_head", None)) is torch.nn.Linear and module.lm_head.bias is None and \
        getattr(config, "final_logit_softcapping", None) is None


_WRAPS = "_qmm_wrapped_functions"  # on a patched model: the (module, name) pairs of the functions it holds wrapped
_wrapped = {}  # (module, name) -> [the module's own function, the count of models holding the wrap]


def _hold_wrap(model, owner, name, wrap):
    """Points module `owner`'s function `name` at wrap(its own function) while any model holds it, once per model:
    transformers' modules are shared by every model of a family in the process; _release_wraps gives it back."""
    held = model.__dict__.setdefault(_WRAPS, [])
    if (owner, name) in held:
        return
    entry = _wrapped.setdefault((owner, name), [getattr(owner, name), 0])
    if entry[1] == 0:
        setattr(owner, name, wrap(entry[0]))
    entry[1] += 1
    held.append((owner, name))


def _release_wraps(model):
    for owner, name in model.__dict__.pop(_WRAPS, []):
        entry = _wrapped[(owner, name)]
        entry[1] -= 1
        if entry[1] == 0:
            setattr(owner, name, entry[0])
            del _wrapped[(owner, name)]


# transformers builds the causal mask as a tensor (SDPA then takes its masked path: a slower kernel, GQA's K/V repeated
# per query head) wherever it cannot prove it unneeded: it looks for packed sequences (several in one row, told
# apart by their position ids) by reading the device, which it cannot do in a CUDA graph capture or under
# torch.compile, and under torch.compile (PyTorch before 2.14) it never skips the mask. A call with neither
# attention_mask nor position_ids and no cached tokens needs none (transformers numbers every row 0, 1, 2, ...; the
# mask is SDPA's is_causal): while the patched causal LM runs such a call, the two checks say so without looking.
_positions_unpacked = False


def _unpacked_search(original):
    def find_packed_sequence_indices(position_ids):
        return None if _positions_unpacked else original(position_ids)
    return functools.wraps(original)(find_packed_sequence_indices)


def _causal_skip(original):
    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if _positions_unpacked and padding_mask is None and q_length == kv_length and \
                (local_attention_size is None or kv_length < local_attention_size):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
    return functools.wraps(original)(_ignore_causal_mask_sdpa)


# What is wrapped: each function with the parameters its wrapper takes (another transformers keeps its own).
_MASKING_WRAPS = {"find_packed_sequence_indices": (_unpacked_search, ["position_ids"]),
                  "_ignore_causal_mask_sdpa": (_causal_skip, ["padding_mask", "q_length", "kv_length", "q_offset",
                                                              "kv_offset", "local_attention_size"])}


def _hold_masking_checks(model):
    owner = sys.modules.get("transformers.masking_utils")
    for name, (wrap, params) in _MASKING_WRAPS.items():
        own = getattr(owner, name, None)
        if callable(own) and list(inspect.signature(own).parameters) == params:
            _hold_wrap(model, owner, name, wrap)


def _causal_lm_forward(lm, *args, labels=None, **kwargs):
    """Training with labels: the loss from the hidden states through linear_cross_entropy_loss, as transformers'
    causal-LM loss defines it (labels shifted by one, -100 ignored, the mean, or the sum over num_items_in_batch),
    and no logits; without past_key_values and use_cache, no KV cache is built (as Unsloth does: a training step has
    no use for one, and building it costs each layer a concatenation and its backward). Everything else (no labels,
    eval mode, generation) runs the model's own forward. A call without attention_mask and position_ids keeps
    SDPA's causal path in CUDA graphs and under torch.compile too (transformers' mask checks, above)."""
    global _positions_unpacked
    if labels is None or not lm.training or not torch.is_grad_enabled():
        return _unpatched(lm, *args, labels=labels, **kwargs)
    why = "positional arguments" if args else None
    if why is None and kwargs.get("logits_to_keep", 0) not in (0, None):
        why = "logits_to_keep"
    if why is not None:
        return _fallback(lm, why, *args, labels=labels, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    if kwargs.get("past_key_values") is None and kwargs.get("cache") is None:  # "cache": transformers >= 5.2x
        kwargs.setdefault("use_cache", False)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    # The labels' range check starts before the decoder runs and ends at the loss: the loss's own check would wait
    # there for the whole forward pass, idling the device while the host then queues the backward.
    vocab = lm.lm_head.weight.shape[0]
    early = not compiling() and not (labels.is_cuda and torch.cuda.is_current_stream_capturing())
    pending = PendingLabelCheck(labels[..., 1:], vocab, -100) if early else None
    unpacked = kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None
    previous, _positions_unpacked = _positions_unpacked, unpacked
    try:
        outputs = lm.model(**kwargs)
    finally:
        _positions_unpacked = previous
    hidden = outputs[0]
    bad = None if pending is None else pending.first_bad()
    if bad is not None:  # the index in the caller's labels (the first token's label is never used)
        index = ", ".join(str(i) for i in bad[0][:-1] + (bad[0][-1] + 1,))
        raise _error("InvalidArgument", f"{type(lm).__name__} (qmm fused loss): labels[{index}] is {bad[1]} but "
                                        f"must be in [0, {vocab}) or -100 (ignored)")
    loss = linear_cross_entropy_loss(hidden, lm.lm_head.weight, shifted, -100, check_labels=pending is None)
    if num_items is not None:  # a sum over the tokens of several micro-batches (gradient accumulation)
        loss = loss * (shifted != -100).sum() / num_items
    from transformers.modeling_outputs import CausalLMOutputWithPast
    # newer transformers name the KV cache "cache" (reading "past_key_values" warns there)
    cache = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None),
                                  **{cache: getattr(outputs, cache, None)})


def _is_swiglu_mlp(module):
    """An MLP module in the Hugging Face Llama/Qwen/Mistral form: down_proj(act_fn(gate_proj(x)) * up_proj(x)) with
    a SiLU act_fn and bitsandbytes NF4 bases (PEFT-wrapped or not) under gate_proj and up_proj."""
    act = getattr(module, "act_fn", None)
    return act is not None and "silu" in type(act).__name__.lower() and hasattr(module, "down_proj") and \
        all(_bnb_nf4_base(getattr(module, p, None)) is not None for p in ("gate_proj", "up_proj"))


_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _is_rms_norm(module):
    """Hugging Face's RMSNorm of Llama, Qwen2/3 and Mistral: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)
    (Gemma's, with 1 + weight, is another class and is left alone)."""
    return type(module).__name__ in _RMS_NORMS and isinstance(getattr(module, "weight", None), torch.Tensor) and \
        module.weight.dim() == 1 and isinstance(getattr(module, "variance_epsilon", None), float)


def _rms_norm_forward(norm, x, *args, **kwargs):
    """rms_norm_autograd where x and the weight share a dtype qmm takes; otherwise (a weight upcast to float32 by
    peft's prepare_model_for_kbit_training, float16) the module's own forward."""
    why = _uncovered_call(x, args, kwargs)
    if why is None and norm.weight.dtype != x.dtype:
        why = f"an RMSNorm weight in {norm.weight.dtype} under {x.dtype} activations"
    if why is not None:
        return _fallback(norm, why, x, *args, **kwargs)
    return rms_norm_autograd(x, norm.weight, norm.variance_epsilon)




# ---- decoder layers: the residual adds inside the norms' kernels ----------------------------------------------

_DECODER_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")
_CACHE_NAMES = ("past_key_values", "cache", "layer_past")
# The statements of those layers' forward in transformers 5 (the cache argument named past_key_values, or cache in
# later releases): what _decoder_layer_forward computes, the residual adds inside the norms' passes.
_DECODER_BODY = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
    position_ids=position_ids, {cache}={cache}, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""
_KEYWORDS = {"attention_mask", "position_ids", "use_cache", "position_embeddings"}
_fused_layers = {}  # decoder layer class -> its subclass computing the fused forward, or None where it can't


def _statements(source):
    """A function's or a block's statements as ast.unparse writes them (no comments, docstring or layout)."""
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body if len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef) else tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.unparse(s) for s in body]


def _make_fused_layer(cls):
    """cls's subclass whose forward is _decoder_layer_forward, where cls's own forward (unwrapped) is the known
    one: its statements _DECODER_BODY's, its parameters (self, hidden_states, the five keywords with defaults,
    **kwargs). A subclass rather than a patched forward: transformers' gradient checkpointing wraps a layer class's
    forward (5.2x) or its __call__ (earlier), and checkpoints the subclass's the same way. It keeps cls's name (model
    parallel plans and _no_split_modules name the class) and pickles as a function of cls (_fused_layer)."""
    forward = inspect.unwrap(cls.forward)
    try:
        statements = _statements(inspect.getsource(forward))
        params = list(inspect.signature(forward).parameters.values())
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    names = [p.name for p in params]
    cache = next((n for n in names if n in _CACHE_NAMES), None)
    if cache is None or statements != _statements(_DECODER_BODY.format(cache=cache)) or \
            names[:2] != ["self", "hidden_states"] or set(names[2:-1]) != _KEYWORDS | {cache} or \
            params[-1].kind is not inspect.Parameter.VAR_KEYWORD or \
            any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or p.default is inspect.Parameter.empty
                for p in params[2:-1]):
        return None
    keywords = {p.name: p.default for p in params[2:-1]}
    return type(cls.__name__, (cls,), {"forward": _decoder_layer_forward, "__reduce_ex__": _reduce_fused_layer,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "_qmm_decoder": (cls, keywords)})


def _fused_layer_class(cls):
    if cls not in _fused_layers:
        _fused_layers[cls] = _make_fused_layer(cls)
    return _fused_layers[cls]


def _fused_layer(cls):
    """An empty instance of cls's fused subclass (cls's where there is none), for pickle and copy.deepcopy."""
    fused = _fused_layer_class(cls)
    return object.__new__(fused or cls)


def _reduce_fused_layer(self, protocol):
    return _fused_layer, (type(self)._qmm_decoder[0],), self.__dict__


def _is_decoder_layer(module):
    """A Llama/Qwen2/Qwen3/Mistral decoder layer whose forward is the known one, its norms RMSNorms qmm takes, and
    no forward of the instance's own (accelerate's hooks: the class's forward would not run)."""
    return type(module).__name__ in _DECODER_LAYERS and not hasattr(type(module), "_qmm_decoder") and \
        "forward" not in module.__dict__ and "_old_forward" not in module.__dict__ and \
        all(_is_rms_norm(getattr(module, n, None)) for n in ("input_layernorm", "post_attention_layernorm")) and \
        _fused_layer_class(type(module)) is not None


def _decoder_uncovered(layer, x, args, kwargs, keywords):
    """Why the fused forward does not take this call, or None."""
    if args:
        return "a decoder layer called with positional arguments besides the hidden states"
    if any(k in _CACHE_NAMES and k not in keywords for k in kwargs):
        return "a decoder layer called with the KV cache under another name"
    if not isinstance(x, torch.Tensor) or x.dtype not in _QMM_DTYPES or x.device.type not in ("cpu", "cuda"):
        return "decoder layer activations qmm does not take (torch.float32 or torch.bfloat16, CPU or CUDA)"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if norm.weight.dtype != x.dtype:
            return f"an RMSNorm weight in {norm.weight.dtype} under {x.dtype} activations"
    return None


def _decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """The layer's own forward (_DECODER_BODY) with its residual adds inside the norms' kernels: the attention's
    add and the post-attention norm as one op (add_rms_norm), whose backward adds the residual's gradient to the
    norm's; the input norm's backward likewise takes the gradient of the residual it starts (so that the layer's
    two gradient sums take no launch); the MLP's add in its down projection's GEMM where qmm runs the MLP."""
    cls, keywords = type(self)._qmm_decoder
    why = _decoder_uncovered(self, hidden_states, args, kwargs, keywords)
    if why is not None:
        warnings.warn(f"qmm.patch_bnb: {why}; the layer's own forward runs instead", stacklevel=2)
        return cls.forward(self, hidden_states, *args, **kwargs)
    named = {name: kwargs.pop(name, default) for name, default in keywords.items()}
    norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
    residual, h = rms_norm_residual_autograd(hidden_states, norm1.weight, norm1.variance_epsilon)
    h, _ = self.self_attn(hidden_states=h, **named, **kwargs)
    if h.dtype != residual.dtype or h.shape != residual.shape:  # the layer's own add would promote or broadcast
        h = residual + h
        return h + self.mlp(self.post_attention_layernorm(h))
    residual, h = add_rms_norm_autograd(residual, h, norm2.weight, norm2.variance_epsilon)
    return _mlp_plus(self.mlp, h, residual)


def _patch_decoder_layer(module, path):
    """Gives a decoder layer its fused subclass; unpatch_bnb sets its class back."""
    cls = type(module)
    module.__dict__[_PATCH] = _Patch(None, path, "__class__", cls)
    module.__class__ = _fused_layer_class(cls)


def _rope_module_of(module):
    """The transformers modeling module whose apply_rotary_pos_emb a Llama/Qwen2/Qwen3/Mistral attention calls."""
    if type(module).__name__ not in _ATTENTIONS:
        return None
    owner = sys.modules.get(type(module).__module__)
    return owner if callable(getattr(owner, "apply_rotary_pos_emb", None)) else None


def _rope_takes(q, k, cos, sin, args, kwargs):
    """Whether qmm's rope takes an apply_rotary_pos_emb call: Hugging Face's [B, H, S, D] q and k (float32 or
    bfloat16), cos and sin [B or 1, S, D] in q's dtype or float32, unsqueezed at dimension 1 (the default)."""
    rest = list(args) + [v for key, v in kwargs.items() if key == "unsqueeze_dim"]
    if len(rest) != len(args) + len(kwargs) or len(rest) > 1 or rest and not (type(rest[0]) is int and rest[0] == 1):
        return False
    return k is not None and q.dim() == 4 and k.dim() == 4 and q.dtype in _QMM_DTYPES and k.dtype == q.dtype and \
        cos.dim() == 3 and cos.shape == sin.shape and cos.dtype in (q.dtype, torch.float32) and \
        sin.dtype == cos.dtype and cos.shape[1:] == q.shape[2:] and k.shape[2:] == q.shape[2:] and \
        k.shape[0] == q.shape[0] and cos.shape[0] in (1, q.shape[0])


def _qmm_rotary(original):
    """apply_rotary_pos_emb by qmm's rope where it takes the call, otherwise the original."""
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _rope_takes(q, k, cos, sin, args, kwargs):
            return rope_autograd(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)
    return functools.wraps(original)(apply_rotary_pos_emb)


def _patch_rope(model):
    """Points the modeling modules of the model's attention layers at qmm's rope."""
    for module in model.modules():
        owner = _rope_module_of(module)
        if owner is not None:
            _hold_wrap(model, owner, "apply_rotary_pos_emb", _qmm_rotary)


_Patch = collections.namedtuple("_Patch", ("fn", "path", "attr", "previous"))
_Patch.__doc__ = """What patch_bnb sets on a module (as _qmm_patch): its forward fn(module, x, ...) and NF4 path,
and where an instance attribute was patched (attr "forward" or accelerate's "_old_forward", and its previous value;
"__class__" and the class for a decoder layer, whose fn is None), else attr None: the class's forward dispatches."""
_ORIGINAL = "_qmm_original_forward"  # on a class whose forward dispatches: its own forward


def _dispatching_forward(cls, original):
    """cls's forward, dispatching on the instance: patched instances of cls itself run their patch, everything
    else (unpatched instances, subclasses reaching it through super()) cls's own forward."""
    def forward(self, *args, **kwargs):
        patch = self.__dict__.get(_PATCH)
        if patch is None or type(self) is not cls:
            return original(self, *args, **kwargs)
        return patch.fn(self, *args, **kwargs)
    return functools.wraps(original)(forward)


def _instance_forward(self, *args, **kwargs):
    return self.__dict__[_PATCH].fn(self, *args, **kwargs)


def _patch(module, forward, path):
    """Patches one module. Its class's forward dispatches on the instance's _qmm_patch (installed once per class; an
    instance that patch_bnb did not patch runs the class's own forward): one function for all modules of a class,
    so that torch.compile compiles a region once for every layer of a kind (a forward per module is guarded by
    identity: one graph per layer), and torch.save of a patched module pickles its patch with it. Where the
    instance has a forward of its own (accelerate's hooks wrap it and call the original as _old_forward), that
    attribute is patched instead."""
    attr = next((a for a in ("_old_forward", "forward") if a in module.__dict__), None)
    module.__dict__[_PATCH] = _Patch(forward, path, attr, module.__dict__.get(attr) if attr else None)
    if attr is not None:
        setattr(module, attr, types.MethodType(_instance_forward, module))
        return
    cls = type(module)
    if _ORIGINAL not in cls.__dict__:
        original = cls.forward
        setattr(cls, _ORIGINAL, original)
        cls.forward = _dispatching_forward(cls, original)


def patch_bnb(model, path="auto", fuse_mlp=True, fused_loss=False, fused_norm=False, fused_rope=False,
              fuse_qkv=True):
    """Runs a bitsandbytes 4-bit model's NF4 layers with qmm, in place, and changes nothing else: modules, parameters,
    state-dict names and PEFT's LoRA adapters stay (PEFT trains, saves and merges them as before). Every
    bitsandbytes NF4 linear layer then computes with qmm (bf16 products, fp32 sums, whatever its compute_dtype); a
    PEFT LoRA layer around one computes base, bias and its plain adapter as one op (lora_nf4_linear: PEFT's lora_A
    and lora_B trained, their products in the activations' dtype with fp32 sums, LoRA dropout by PyTorch); with
    `fuse_mlp`, every MLP of Hugging Face's Llama/Qwen/Mistral form (down_proj(silu(gate_proj(x)) * up_proj(x)),
    gate_proj and up_proj NF4, PEFT-wrapped or not) computes both input projections from one read of x, their
    adapters and the SwiGLU as one op (lora_nf4_swiglu); with `fuse_qkv`, every Llama/Qwen2/Qwen3/Mistral attention
    on NF4 q_proj, k_proj and v_proj computes the three (with their biases and adapters) as one op
    (lora_nf4_linears: one autograd node, their input gradients summed in their products). A call that qmm does not
    cover (float16 activations, DoRA or other LoRA variants, extra arguments, a weight not yet quantized) runs the
    module's own forward, with a warning that says why (once per reason). The patched model traces whole under
    torch.compile (fullgraph=True); after bitsandbytes replaces weights (merge_adapter, a move to another device),
    one eager call or another patch_bnb(model) reads the new weights' offsets, which a compiled step cannot without
    breaking its graph.
    With `fused_loss`, a Hugging Face causal LM (Llama, Qwen2, Mistral) trained with labels returns its loss from
    the hidden states through linear_cross_entropy_loss, never holding the [tokens, vocab] logits, and no logits
    (eval mode, generation and calls without labels run the model's own forward) and, unless use_cache or
    past_key_values is passed, builds no KV cache; a label out of range is a qmm.Error, checked without a wait for
    the device in the step (started before the decoder, read at the loss); while it runs a call without
    attention_mask and position_ids, transformers' mask checks (masking_utils' packed-sequence search and causal-
    mask skip, wrapped while such a model is patched) know there is nothing to mask beyond causality, so that in
    CUDA graphs and under torch.compile the attention keeps SDPA's causal kernel instead of an explicit mask. With
    `fused_norm`, the RMSNorm modules of Llama, Qwen2/3 and Mistral run qmm's rms_norm forward and backward kernels
    (bitsandbytes or not), and their decoder layers (where the forward is transformers' known one) compute the
    residual adds inside the norms' kernels: the attention's add and the post-attention norm as one op
    (add_rms_norm), both of the layer's gradient sums inside the norms' backward kernels; such a layer gets a
    subclass of its class, of the same name (unpatch_bnb gives its class back), and its norms' forward hooks do not
    run. With `fused_rope`, their attention's rotary embedding runs qmm's rope (q and k in one launch, forward and
    backward): as Liger-Kernel does, this points the model family's `apply_rotary_pos_emb` (in transformers'
    modeling module) at qmm's while any model patched so remains, so other models of that family in the process use
    it too; unpatch_bnb of the last such model restores it. `path` forces qmm's NF4 implementation (see nf4_gemm).
    Returns the patched modules' names; unpatch_bnb undoes it."""
    _model("patch_bnb", model)
    _check_path("patch_bnb", path)
    _qmm.check_nf4_path(path, "patch_bnb")
    for flag, value in (("fuse_mlp", fuse_mlp), ("fused_loss", fused_loss), ("fused_norm", fused_norm),
                        ("fused_rope", fused_rope), ("fuse_qkv", fuse_qkv)):
        _flag("patch_bnb", flag, value)
    patched = []
    for name, module in model.named_modules():
        if _is_bnb_nf4_layer(module):
            qs = _nf4_state(module.weight)
            if qs is not None:  # read now (also for a layer patched before), so that a compiled step never needs to
                _offset_of(qs)
        if _PATCH in module.__dict__:
            continue
        if _is_bnb_nf4_layer(module):
            _patch(module, _bnb_linear_forward, path)
        elif _is_lora_wrapper(module) and _bnb_nf4_base(module) is not None:
            _patch(module, _lora_linear_forward, path)
        elif fuse_mlp and _is_swiglu_mlp(module):
            _patch(module, _swiglu_mlp_forward, path)
        elif fuse_qkv and _is_qkv_attention(module):
            _patch(module, _attention_forward, path)
        elif fused_loss and _is_causal_lm(module):
            _patch(module, _causal_lm_forward, path)
            _hold_masking_checks(model)
        elif fused_norm and _is_rms_norm(module):
            _patch(module, _rms_norm_forward, path)
        elif fused_norm and _is_decoder_layer(module):
            _patch_decoder_layer(module, path)
        else:
            continue
        patched.append(name)
    if fused_rope:
        _patch_rope(model)
    # Each forward of the model (and of a causal LM inside, which generate() calls directly) casts the adapters'
    # working copies for all its ops in one launch (qmm._copies).
    for module in model.modules():
        if module is model or _is_causal_lm(module):
            _copies.watch(module)
    return patched


def unpatch_bnb(model):
    """Gives every module that patch_bnb patched inside `model` its previous forward back; returns their names."""
    _model("unpatch_bnb", model)
    restored = []
    for name, module in model.named_modules():
        if _PATCH in module.__dict__:
            patch = module.__dict__.pop(_PATCH)
            if patch.attr is not None and patch.previous is None:
                delattr(module, patch.attr)
            elif patch.attr is not None:
                setattr(module, patch.attr, patch.previous)
            _nf4_cache.pop(module, None)
            restored.append(name)
    _release_wraps(model)
    for module in model.modules():
        _copies.unwatch(module)
    return restored
