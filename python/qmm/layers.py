"""Modules on NF4 weights with LoRA adapters (QLoraLinear, QLoraSwiGluMlp), and the calls that put them into a
bitsandbytes 4-bit model in place of its layers (replace_bnb_mlps, replace_bnb_linears)."""
import math

import torch

from . import _qmm
from ._base import _check_path, _error, _int
from .functional import Lora, lora_nf4_linear, lora_nf4_mlp, lora_nf4_swiglu
from .nf4 import Nf4Weight, _nf4


class LoraAdapter(torch.nn.Module):
    """(alpha / rank) * dropout(x) @ A^T @ B^T with A [rank, in] (Kaiming-uniform) and B [out, rank] (zeros), both
    trainable and held in `dtype`: LoRA's low-rank update, as PEFT initializes it. Returns x's dtype."""

    def __init__(self, in_features, out_features, rank=16, alpha=32.0, dropout=0.0, dtype=torch.float32,
                 device=None):
        super().__init__()
        op = "LoraAdapter"
        _int(op, "rank", rank, 1, 2 ** 31 - 1)
        for name, v in (("alpha", alpha), ("dropout", dropout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise _error("InvalidArgument", f"{op}: {name} must be a finite number, got {v!r}")
        if not 0 <= dropout < 1:
            raise _error("InvalidArgument", f"{op}: dropout must be in [0, 1), got {dropout}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise _error("DTypeMismatch", f"{op}: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        self.scale = alpha / rank
        self.lora_a = torch.nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

    def forward(self, x):
        t = self.dropout(x).to(self.lora_a.dtype) @ self.lora_a.t()
        return (self.scale * (t @ self.lora_b.t())).to(x.dtype)

    def term(self, x):
        """The adapter as the fused ops take it (qmm.Lora), for input x: its dropout, where active, applied here."""
        dropped = None if isinstance(self.dropout, torch.nn.Identity) else self.dropout(x)
        return Lora(self.lora_a, self.lora_b, self.scale, dropped)


class _Nf4Module(torch.nn.Module):
    """A module whose Nf4Weight attributes move with it: .to(device), .cuda() and .cpu() move them too, while dtype
    casts (.half(), .to(torch.bfloat16)) leave them as the format has them."""

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        for name, w in list(vars(self).items()):
            if isinstance(w, Nf4Weight):
                device = fn(torch.empty(0, device=w.device)).device  # where fn sends a tensor from w's device
                if device != w.device:
                    setattr(self, name, w.to(device))
        return out


class QLoraLinear(_Nf4Module):
    """y = x @ dequant(W)^T + bias + lora(x): a frozen NF4 base and bias and a trainable LoraAdapter (`.lora`,
    created on the base's device), computed as one op (lora_nf4_linear: the adapter's products in x's dtype with fp32
    sums, its sum in its GEMM's epilogue). The base moves with the module (.to(device), .cuda()) and is not in the
    state dict, which holds the adapter and the bias; Nf4Weight.to_bnb_state_dict saves the base."""

    def __init__(self, weight, rank=16, alpha=32.0, dropout=0.0, bias=None, adapter_dtype=torch.float32, path="auto"):
        super().__init__()
        out_features, in_features = _nf4("QLoraLinear", "weight", weight)
        _check_path("QLoraLinear", path)
        _qmm.check_nf4_path(path, "QLoraLinear")
        self.weight, self.path = weight, path
        self.lora = LoraAdapter(in_features, out_features, rank, alpha, dropout, adapter_dtype, weight.device)
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (out_features,)):
            what = list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise _error("ShapeMismatch", f"QLoraLinear: bias is {what}; it must be [{out_features}]")
        # The bias belongs to the frozen base (PEFT's bias="none"): kept, shared with the given tensor, not trained.
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x):
        return lora_nf4_linear(x, self.weight, self.lora.term(x), self.bias, self.path)

    @classmethod
    def from_bnb(cls, layer, **lora):
        """The same layer on the NF4 weight (shared, not copied) and bias of a bitsandbytes 4-bit linear layer;
        `lora` as for the constructor (rank, alpha, dropout, adapter_dtype, path)."""
        return cls(_bnb_weight(layer, "QLoraLinear.from_bnb", bias_ok=True), bias=getattr(layer, "bias", None),
                   **lora)


class QLoraSwiGluMlp(_Nf4Module):
    """y = down(silu(gate(x)) * up(x)): an LLM's MLP block on frozen NF4 weights W_gate, W_up [I, H] and W_down
    [H, I], with a LoraAdapter on each projection (`gate_lora`, `up_lora`, `down.lora`). Both input projections'
    base products come from one read of x (nf4_gate_up) and the block runs as one op (lora_nf4_mlp: the adapters'
    terms summed in the SwiGLU kernels, h not kept); with dropout on the down projection's input in training,
    lora_nf4_swiglu and then the down projection (lora_nf4_linear)."""

    def __init__(self, w_gate, w_up, w_down, rank=16, alpha=32.0, dropout=0.0, adapter_dtype=torch.float32,
                 path="auto"):
        super().__init__()
        inter, hidden = _nf4("QLoraSwiGluMlp", "w_gate", w_gate)
        _check_path("QLoraSwiGluMlp", path)
        _qmm.check_nf4_path(path, "QLoraSwiGluMlp")
        if _nf4("QLoraSwiGluMlp", "w_up", w_up) != (inter, hidden) or \
                _nf4("QLoraSwiGluMlp", "w_down", w_down) != (hidden, inter):
            raise _error("ShapeMismatch", f"QLoraSwiGluMlp: w_gate and w_up must be [I, H] and w_down [H, I]; got "
                                          f"{w_gate.shape}, {w_up.shape}, {w_down.shape}")
        self.w_gate, self.w_up, self.path = w_gate, w_up, path
        lora = lambda: LoraAdapter(hidden, inter, rank, alpha, dropout, adapter_dtype, w_gate.device)  # noqa: E731
        self.gate_lora, self.up_lora = lora(), lora()
        self.down = QLoraLinear(w_down, rank, alpha, dropout, None, adapter_dtype, path)

    def forward(self, x):
        gate, up, down = self.gate_lora.term(x), self.up_lora.term(x), self.down.lora
        if isinstance(down.dropout, torch.nn.Dropout) and down.dropout.training:
            return self.down(lora_nf4_swiglu(x, self.w_gate, self.w_up, gate, up, self.path))
        return lora_nf4_mlp(x, self.w_gate, self.w_up, self.down.weight, gate, up,
                            Lora(down.lora_a, down.lora_b, down.scale), self.path)

    @classmethod
    def from_bnb(cls, mlp, **lora):
        """The same block on the NF4 weights of a Llama/Qwen/Mistral-style MLP module whose gate_proj, up_proj and
        down_proj are bitsandbytes 4-bit layers without bias (shared, not copied); `lora` as for the constructor."""
        act = getattr(mlp, "act_fn", None)
        if act is not None and "silu" not in type(act).__name__.lower():
            raise _error("Unsupported", f"QLoraSwiGluMlp.from_bnb: activation {type(act).__name__} (SwiGLU needs SiLU)")
        return cls(*(_bnb_weight(getattr(mlp, p), p) for p in ("gate_proj", "up_proj", "down_proj")), **lora)


def _is_lora_wrapper(layer):
    """A PEFT LoRA layer (a base_layer with lora_A/lora_B adapters), told by its attributes (no PEFT import): its
    submodules and its scaling dict, looked up in the module's own dicts (the patched forwards ask per call, and
    hasattr through nn.Module's __getattr__ costs several times more)."""
    modules, attrs = getattr(layer, "_modules", None), getattr(layer, "__dict__", {})
    return modules is not None and "base_layer" in modules and "lora_A" in modules and "lora_B" in modules and \
        "lora_dropout" in modules and "scaling" in attrs


def _bnb_weight(layer, name, bias_ok=False):
    """The Nf4Weight of a bitsandbytes Linear4bit-like layer (a weight carrying its quant_state), without a copy."""
    weight = getattr(layer, "weight", None)
    if getattr(weight, "quant_state", None) is None:
        raise _error("InvalidArgument", f"{name}: not a bitsandbytes 4-bit layer (its weight has no quant_state)")
    if _is_lora_wrapper(layer):  # replacing it would drop its adapters
        raise _error("Unsupported", f"{name}: a PEFT LoRA layer (patch_bnb runs a PEFT model with qmm)")
    if not bias_ok and getattr(layer, "bias", None) is not None:
        raise _error("Unsupported", f"{name}: has a bias (the MLP block's projections take none)")
    return Nf4Weight.from_bnb(weight, weight.quant_state)


def _has_bnb_weight(module):
    """A bitsandbytes 4-bit layer, or something that shows one's weight (a PEFT LoRA layer): its weight carries a
    quant_state attribute."""
    return hasattr(getattr(module, "weight", None), "quant_state")


def _is_bnb_mlp(module):
    return all(_has_bnb_weight(getattr(module, p, None)) for p in ("gate_proj", "up_proj", "down_proj"))


def _model(op, model):
    if not isinstance(model, torch.nn.Module):
        raise _error("InvalidArgument", f"{op}: argument 'model' must be a torch.nn.Module, not {type(model).__name__}")


def _replace_modules(op, model, matches, make):
    """Replaces every module of `model` (not the model itself) that `matches(name, module)` by `make(module)`;
    returns the replaced names."""
    _model(op, model)
    replaced = []
    for name, module in list(model.named_modules()):
        if name and matches(name, module):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, make(module))
            replaced.append(name)
    return replaced


def replace_bnb_mlps(model, **lora):
    """Replaces, inside `model`, every MLP module whose gate_proj, up_proj and down_proj are bitsandbytes 4-bit
    layers (a Hugging Face Llama/Qwen/Mistral model loaded in 4-bit) by a QLoraSwiGluMlp on the same NF4 weights,
    with fresh LoRA adapters (`lora`: rank, alpha, dropout, adapter_dtype, path). Returns the replaced modules'
    names; the model's other parameters are left as they are (freeze them as usual)."""
    return _replace_modules("replace_bnb_mlps", model, lambda name, m: _is_bnb_mlp(m),
                            lambda m: QLoraSwiGluMlp.from_bnb(m, **lora))


def replace_bnb_linears(model, names=("q_proj", "k_proj", "v_proj", "o_proj"), **lora):
    """Replaces, inside `model`, every bitsandbytes 4-bit linear layer whose attribute name is in `names` (by
    default a Hugging Face model's attention projections) by a QLoraLinear on the same NF4 weight and bias, with
    fresh LoRA adapters (`lora` as for QLoraLinear). Returns the replaced modules' names. With replace_bnb_mlps
    this puts LoRA on every projection of a 4-bit Llama/Qwen/Mistral model, as QLoRA does."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise _error("InvalidArgument", f"replace_bnb_linears: names must be a tuple or list of attribute names, got "
                                        f"{names!r}")

    def matches(name, module):
        return name.rpartition(".")[2] in names and _has_bnb_weight(module)
    return _replace_modules("replace_bnb_linears", model, matches, lambda m: QLoraLinear.from_bnb(m, **lora))

