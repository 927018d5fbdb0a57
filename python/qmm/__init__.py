"""qmm for PyTorch: qmm's GEMMs, SwiGLU and NF4 ops on torch tensors, on the CPU (reference backend) or a GPU.

Ops run on the tensors' device: CPU tensors on qmm's CPU reference backend, CUDA tensors on the GPU backend, in
PyTorch's current stream. Inputs are taken as they are when dense row-major (otherwise as a contiguous copy);
outputs are allocated here unless passed as `out=`, which must be dense row-major (qmm writes it in place). Every
error is a `qmm.Error` (a RuntimeError) whose `code` names the kind ("ShapeMismatch", "Unsupported", ...); no
output is written when an op fails. On the GPU, qmm keeps one context per (device, stream) with its own cuBLASLt
workspace and a CUDA memory pool for scratch (the bf16 copy of the weight that the dequantize-then-GEMM path
writes, for one): memory that PyTorch's allocator does not see.

    import qmm, torch
    w4 = qmm.Nf4Weight.quantize(w.cuda())               # W [out, in] -> NF4, bitsandbytes' layout
    y = qmm.nf4_linear(x, w4)                          # x [..., in] -> [..., out], differentiable in x
    layer = qmm.QLoraLinear(w4, rank=16, alpha=32)     # frozen NF4 base + trainable LoRA adapters
    mlp = qmm.QLoraSwiGluMlp(w4_gate, w4_up, w4_down)  # an MLP block on NF4 weights, LoRA on all three
    qmm.patch_bnb(peft_model)                          # or: a bitsandbytes/PEFT QLoRA model, computed by qmm
"""
import functools
import json
import math
import types
import warnings
import weakref

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _qmm
from ._qmm import Error

__all__ = [
    "Error", "LoraAdapter", "Nf4Weight", "QLoraLinear", "QLoraSwiGluMlp", "batched_gemm", "cuda_device_count", "gemm",
    "gemm_backward_a", "gemm_backward_b", "gemm_bt", "nf4_gate_up", "nf4_gate_up_linear", "nf4_gemm",
    "nf4_gemm_backward_a", "nf4_linear", "nf4_swiglu", "patch_bnb", "replace_bnb_linears", "replace_bnb_mlps", "swiglu",
    "swiglu_autograd", "swiglu_backward", "unpatch_bnb",
]

NF4_NESTED_BLOCK_SIZE = 256  # blocks per absmax2 group when double-quantized (bitsandbytes' nested block size)
NF4_CODEBOOK = tuple(_qmm.nf4_codebook())  # the 16 NF4 values (float32), bitsandbytes' quant_map for nf4


def cuda_device_count():
    """GPUs qmm can use (0 where qmm was built without CUDA or none is usable)."""
    return _qmm.cuda_device_count()


def _error(code, message):
    e = Error(message)
    e.code = code
    return e


def _call(fn, like, *args, **kwargs):
    """Runs a `_qmm` op for tensors on like's device: on a GPU in PyTorch's current stream there, with that GPU
    current for the call only (qmm makes its context's GPU current; PyTorch's choice is restored after). Tensors
    travel as DLPack capsules made by to_dlpack: a tensor's own __dlpack__, which the extension would call
    otherwise, costs ~10x more in recent PyTorch (2.4 vs 0.2 µs in 2.15)."""
    args = [_to_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args]
    if not like.is_cuda:
        return fn(*args, **kwargs, stream=0)
    stream = torch.cuda.current_stream(like.device).cuda_stream
    if like.device.index == torch.cuda.current_device():
        return fn(*args, **kwargs, stream=stream)
    with torch.cuda.device(like.device):
        return fn(*args, **kwargs, stream=stream)


def _in(t):
    """An input as qmm takes it: detached (DLPack refuses tensors that require grad) and dense row-major."""
    if t.requires_grad:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _out(op, out, shape, dtype, like, beta):
    if out is None:
        if beta != 0.0:
            raise _error("InvalidArgument", f"{op}: beta = {beta} needs out= (the tensor to accumulate into)")
        return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
    return out


def _dim(t, i):
    """t's extent i, or 0 where t has no such dimension (qmm then names the bad rank)."""
    return t.shape[i] if -t.dim() <= i < t.dim() else 0


# ---- dense GEMMs ------------------------------------------------------------------------------------------------


def _gemm(fn, op, x, y, shape, out, alpha, beta, math_mode, out_dtype):
    x, y = _in(x), _in(y)
    out = _out(op, out, shape, out_dtype, x, beta)
    _call(fn, x, x, y, out.detach(), alpha=alpha, beta=beta, math=math_mode)
    return out


def gemm(a, b, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """out[M,N] = alpha * a[M,K] @ b[K,N] + beta * out. a and b share a dtype (float32 or bfloat16); out is that
    dtype or float32. math ("fp32", "tf32", "bf16") sets how float32 operands multiply (bf16 truncates them)."""
    return _gemm(_qmm.gemm, "gemm", a, b, (_dim(a, 0), _dim(b, 1)), out, alpha, beta, math, out_dtype)


def gemm_bt(a, b, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """out[M,N] = alpha * a[M,K] @ b[N,K]^T + beta * out (a linear layer's forward)."""
    return _gemm(_qmm.gemm_bt, "gemm_bt", a, b, (_dim(a, 0), _dim(b, 0)), out, alpha, beta, math, out_dtype)


def gemm_backward_a(dc, b, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """da[M,K] = alpha * dc[M,N] @ b[K,N]^T + beta * da (gemm's input gradient)."""
    return _gemm(_qmm.gemm_backward_a, "gemm_backward_a", dc, b, (_dim(dc, 0), _dim(b, 0)), out, alpha, beta, math,
                 out_dtype)


def gemm_backward_b(a, dc, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """db[K,N] = alpha * a[M,K]^T @ dc[M,N] + beta * db (gemm's weight gradient)."""
    return _gemm(_qmm.gemm_backward_b, "gemm_backward_b", a, dc, (_dim(a, 1), _dim(dc, 1)), out, alpha, beta, math,
                 out_dtype)


def batched_gemm(a, b, *, transpose_b=False, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """out[B,H,M,N] = alpha * a[B,H,M,K] @ b[B,H,K,N] (or b[B,H,N,K]^T with transpose_b) + beta * out."""
    a, b = _in(a), _in(b)
    shape = (_dim(a, 0), _dim(a, 1), _dim(a, 2), _dim(b, 2) if transpose_b else _dim(b, 3))
    out = _out("batched_gemm", out, shape, out_dtype, a, beta)
    _call(_qmm.batched_gemm, a, a, b, out.detach(), transpose_b=transpose_b, alpha=alpha, beta=beta, math=math)
    return out


# ---- SwiGLU -----------------------------------------------------------------------------------------------------


def swiglu(gate, up, *, out=None):
    """h = silu(gate) * up (float32 or bfloat16, one shape and dtype for all three)."""
    gate, up = _in(gate), _in(up)
    out = _out("swiglu", out, gate.shape, None, gate, 0.0)
    _call(_qmm.swiglu, gate, gate, up, out.detach())
    return out


def swiglu_backward(gate, up, dh):
    """(dgate, dup) = (dh * up * silu'(gate), dh * silu(gate))."""
    gate, up, dh = _in(gate), _in(up), _in(dh)
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    _call(_qmm.swiglu_backward, gate, gate, up, dh, dgate, dup)
    return dgate, dup


# ---- NF4 --------------------------------------------------------------------------------------------------------


def _as_bytes(packed):
    """Packed NF4 codes as uint8: bitsandbytes may store them in another dtype (quant_storage, e.g. bfloat16 for
    FSDP), the same bytes."""
    return packed if packed.dtype == torch.uint8 else packed.detach().contiguous().view(torch.uint8)


class Nf4Weight:
    """A frozen weight W [rows, cols] = [out_features, in_features] in NF4, bitsandbytes' layout (docs/FORMAT.md):
    codes uint8 [ceil(rows*cols/2)] (element 2i in the high nibble of byte i) and one scale per block of
    block_size elements: absmax float32 [nblocks] (plain), or absmax uint8 [nblocks] indexing code2 float32 [256],
    scaled by absmax2 float32 [ceil(nblocks/256)] plus offset (double-quantized). All tensors on one device."""

    def __init__(self, codes, absmax, shape, block_size=64, absmax2=None, code2=None, offset=0.0):
        # Kept as qmm takes them, once: detached, dense and flat (views of the given tensors where they are dense),
        # and converted for the ops once (`_native`, which checks dtypes and devices). Treat it as immutable.
        flat = lambda t: None if t is None else _in(t).reshape(-1)  # noqa: E731
        self.codes, self.absmax, self.absmax2, self.code2 = flat(codes), flat(absmax), flat(absmax2), flat(code2)
        self.shape = (int(shape[0]), int(shape[1]))
        self.block_size = int(block_size)
        self.offset = float(offset)
        # The offset for the custom ops (torch.compile): a float argument would compile one graph per value (per
        # layer), a tensor only per shape and dtype.
        self._offset_arg = torch.tensor(self.offset, dtype=torch.float64)
        self._native = _qmm.nf4_handle(self)

    # Copies and pickles (copy.deepcopy, torch.save of a module holding one) take the tensors; the native handle,
    # which views them, is made again.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_native"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._native = _qmm.nf4_handle(self)

    @property
    def double_quant(self):
        return self.absmax.dtype == torch.uint8

    @property
    def device(self):
        return self.codes.device

    @property
    def nbytes(self):
        """Bytes the weight occupies (codes and scales): about 0.52 per element double-quantized, 0.56 plain."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.absmax, self.absmax2, self.code2)
                   if t is not None)

    def __repr__(self):
        scales = "double-quantized" if self.double_quant else "plain"
        return (f"Nf4Weight(shape={self.shape}, block_size={self.block_size}, {scales}, device={self.device}, "
                f"{self.nbytes} bytes)")

    @classmethod
    def quantize(cls, w, double_quant=True, block_size=64):
        """NF4 of w [rows, cols] (float32, bfloat16 or float16), byte-identical to bitsandbytes' quantize_4bit."""
        w = _in(w)
        rows, cols = _dim(w, 0), _dim(w, 1)
        n = rows * cols
        nblocks = -(-n // block_size) if block_size > 0 else 0
        alloc = lambda count, dtype: torch.empty(count, dtype=dtype, device=w.device)  # noqa: E731
        out = types.SimpleNamespace(
            codes=alloc(-(-n // 2), torch.uint8), absmax=alloc(nblocks, torch.uint8 if double_quant else torch.float32),
            absmax2=alloc(-(-nblocks // NF4_NESTED_BLOCK_SIZE), torch.float32) if double_quant else None,
            code2=alloc(256, torch.float32) if double_quant else None, offset=0.0, shape=(rows, cols),
            block_size=block_size)
        offset = _call(_qmm.nf4_quantize, w, w, out)
        return cls(out.codes, out.absmax, (rows, cols), block_size, out.absmax2, out.code2, offset)

    def dequantize(self, dtype=torch.bfloat16):
        """W [rows, cols] = codebook[code] * scale, in float32 or bfloat16 (rounded to nearest even)."""
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        _call(_qmm.nf4_dequantize, out, self._native, out)
        return out

    def to(self, device):
        t = lambda x: None if x is None else x.to(device)  # noqa: E731
        return Nf4Weight(t(self.codes), t(self.absmax), self.shape, self.block_size, t(self.absmax2), t(self.code2),
                         self.offset)

    @classmethod
    def from_bnb(cls, data, quant_state):
        """Wraps a bitsandbytes 4-bit weight without copying: `data` is Params4bit's packed uint8 tensor and
        `quant_state` its QuantState (quant_type "nf4"; plain or nested scales)."""
        qs = quant_state
        data = _as_bytes(data)
        if qs.quant_type != "nf4":
            raise _error("Unsupported", f"Nf4Weight.from_bnb: quant_type '{qs.quant_type}' (qmm takes nf4)")
        if getattr(qs, "packing_format_for_cpu", False):  # bitsandbytes repacks for its CPU kernels at inference
            raise _error("Unsupported", "Nf4Weight.from_bnb: the weight is in bitsandbytes' CPU inference layout "
                                        "(packing_format_for_cpu), not bitsandbytes' NF4 layout")
        if getattr(qs, "state2", None) is None:
            return cls(data, qs.absmax, tuple(qs.shape), qs.blocksize)
        if qs.state2.blocksize != NF4_NESTED_BLOCK_SIZE:
            raise _error("Unsupported", f"Nf4Weight.from_bnb: nested block size {qs.state2.blocksize} "
                                        f"(qmm takes {NF4_NESTED_BLOCK_SIZE})")
        return cls(data, qs.absmax, tuple(qs.shape), qs.blocksize, qs.state2.absmax, qs.state2.code, float(qs.offset))

    @classmethod
    def from_bnb_state_dict(cls, state_dict, prefix="weight"):
        """The weight `prefix` of a bitsandbytes 4-bit checkpoint's state dict: `prefix` (packed codes),
        `prefix.absmax`, `prefix.quant_state.bitsandbytes__nf4` (JSON: shape, blocksize, nested_offset, ...), and
        when double-quantized `prefix.nested_absmax` and `prefix.nested_quant_map`."""
        key = f"{prefix}.quant_state.bitsandbytes__nf4"
        if key not in state_dict:
            found = [k for k in state_dict if k.startswith(f"{prefix}.quant_state.")]
            raise _error("Unsupported" if found else "InvalidArgument",
                         f"Nf4Weight.from_bnb_state_dict: no '{key}'" + (f" (found {found[0]})" if found else ""))
        meta = json.loads(bytes(state_dict[key].cpu().to(torch.uint8).tolist()).decode("utf-8"))
        shape, block_size = tuple(meta["shape"]), int(meta["blocksize"])
        codes, absmax = _as_bytes(state_dict[prefix]), state_dict[f"{prefix}.absmax"]
        if f"{prefix}.nested_absmax" not in state_dict:
            return cls(codes, absmax, shape, block_size)
        if int(meta.get("nested_blocksize", NF4_NESTED_BLOCK_SIZE)) != NF4_NESTED_BLOCK_SIZE:
            raise _error("Unsupported", f"Nf4Weight.from_bnb_state_dict: nested block size "
                                        f"{meta['nested_blocksize']} (qmm takes {NF4_NESTED_BLOCK_SIZE})")
        return cls(codes, absmax, shape, block_size, state_dict[f"{prefix}.nested_absmax"],
                   state_dict[f"{prefix}.nested_quant_map"], float(meta["nested_offset"]))

    def to_bnb_state_dict(self, prefix="weight", dtype=torch.bfloat16):
        """The weight as a bitsandbytes 4-bit checkpoint stores it (the keys from_bnb_state_dict reads, plus
        `prefix.quant_map`); `dtype` is the layer's weight dtype that bitsandbytes records."""
        meta = {"quant_type": "nf4", "blocksize": self.block_size, "dtype": str(dtype).replace("torch.", ""),
                "shape": list(self.shape)}
        sd = {prefix: self.codes.reshape(-1, 1), f"{prefix}.absmax": self.absmax,
              f"{prefix}.quant_map": torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=self.device)}
        if self.double_quant:
            meta.update(nested_blocksize=NF4_NESTED_BLOCK_SIZE, nested_dtype="float32", nested_offset=self.offset)
            sd[f"{prefix}.nested_absmax"] = self.absmax2
            sd[f"{prefix}.nested_quant_map"] = self.code2
        sd[f"{prefix}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(meta).encode("utf-8")),
                                                                     dtype=torch.uint8)
        return sd


def _rows(op, name, t, cols, output=False):
    """t [..., cols] as the [rows, cols] matrix qmm takes: a view, never a copy for an output."""
    shape = t.shape
    if not shape or shape[-1] != cols:
        raise _error("ShapeMismatch", f"{op}: argument '{name}' has shape {list(shape)}; its last dimension "
                                      f"must be {cols} (the weight's)")
    if output and not t.is_contiguous():
        raise _error("InvalidArgument", f"{op}: argument '{name}' is not contiguous (qmm writes outputs in place)")
    t = _in(t)
    return t if len(shape) == 2 else t.reshape(-1, cols)


def _nf4(op, name, w):
    if not isinstance(w, Nf4Weight):
        raise _error("InvalidArgument", f"{op}: argument '{name}' must be a qmm.Nf4Weight, not {type(w).__name__}")
    return w.shape


def _nf4_gemm(fn, op, x, x_name, out_name, in_cols, out_cols, w, out, alpha, beta, path, out_dtype):
    x2 = _rows(op, x_name, x, in_cols)
    out = _out(op, out, (*x.shape[:-1], out_cols), out_dtype, x, beta)
    out2 = _rows(op, out_name, out, out_cols, output=True)
    _call(fn, x2, x2, w._native, out2, alpha=alpha, beta=beta, path=path)
    return out


def nf4_gemm(a, w, *, out=None, alpha=1.0, beta=0.0, path="auto", out_dtype=None):
    """out[..., N] = alpha * a[..., K] @ dequant(W)^T + beta * out for W [N, K]: bf16 products, fp32 sums (see
    include/qmm/ops.h for the small-M kernels' scale-after contract). path forces an implementation: "auto",
    "dequant_gemm", "small_m", "fused", "fused_shared", "fused_mma", or "reference" (CPU)."""
    n, k = _nf4("nf4_gemm", "w", w)
    return _nf4_gemm(_qmm.nf4_gemm, "nf4_gemm", a, "a", "c", k, n, w, out, alpha, beta, path, out_dtype)


def nf4_gemm_backward_a(dc, w, *, out=None, alpha=1.0, beta=0.0, path="auto", out_dtype=None):
    """da[..., K] = alpha * dc[..., N] @ dequant(W) + beta * da for W [N, K] (nf4_gemm's input gradient)."""
    n, k = _nf4("nf4_gemm_backward_a", "w", w)
    return _nf4_gemm(_qmm.nf4_gemm_backward_a, "nf4_gemm_backward_a", dc, "dc", "da", n, k, w, out, alpha, beta,
                     path, out_dtype)


def nf4_gate_up(a, w_gate, w_up, *, gate=True, up=True, h=True, path="auto", out_dtype=None):
    """Both MLP input projections from one read of a [..., K]: gate = a @ dequant(Wg)^T, up = a @ dequant(Wu)^T
    and h = silu(gate) * up. Returns (gate, up, h), each None where not asked for."""
    n, k = _nf4("nf4_gate_up", "w_gate", w_gate)
    _nf4("nf4_gate_up", "w_up", w_up)
    a2 = _rows("nf4_gate_up", "a", a, k)
    shape = (*a.shape[:-1], n)
    outs = [torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device) if want else None
            for want in (gate, up, h)]
    views = [None if t is None else t.view(-1, n) for t in outs]
    _call(_qmm.nf4_gate_up, a2, a2, w_gate._native, w_up._native, *views, path=path)
    return tuple(outs)


# ---- autograd: frozen NF4 bases, differentiable in the activations ------------------------------------------------


class _Nf4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, path):
        ctx.w, ctx.path, ctx.x_dtype = w, path, x.dtype
        return nf4_gemm(x, w, path=path)

    @staticmethod
    def backward(ctx, dy):
        dx = nf4_gemm_backward_a(dy, ctx.w, path=ctx.path, out_dtype=ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None


def _grad_wanted(*inputs):
    """Whether autograd will differentiate through these inputs; where it will not (inference, frozen inputs), the
    differentiable ops call the plain ones and skip what only a backward needs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def nf4_linear(x, w, bias=None, path="auto"):
    """y = x @ dequant(W)^T (+ bias) for x [..., in] (float32 or bfloat16; y has x's dtype). Differentiable in x
    and bias; W is frozen (no weight gradient)."""
    if _compiling():
        y = _ops.nf4_linear(x, *_w_args("nf4_linear", "w", w), path)
    else:
        y = _Nf4Linear.apply(x, w, path) if _grad_wanted(x) else nf4_gemm(x, w, path=path)
    return y if bias is None else y + bias.to(y.dtype)


class _SwiGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu(gate, up)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        return swiglu_backward(gate, up, dh)


def swiglu_autograd(gate, up):
    """h = silu(gate) * up, differentiable in gate and up (qmm's forward and backward kernels)."""
    if _compiling():
        return _ops.swiglu(gate, up)
    return _SwiGlu.apply(gate, up) if _grad_wanted(gate, up) else swiglu(gate, up)


def _gate_up_input_grad(dgate, dup, w_gate, w_up, path, x_dtype):
    """dx = dgate @ dequant(Wg) + dup @ dequant(Wu), either gradient possibly None (an output not used; None when
    both are, which autograd takes as no gradient)."""
    dx = None
    for d, w in ((dgate, w_gate), (dup, w_up)):
        if d is not None:
            dx = nf4_gemm_backward_a(d, w, path=path, out_dtype=x_dtype) if dx is None else \
                nf4_gemm_backward_a(d, w, out=dx, beta=1.0, path=path)
    return dx


class _Nf4GateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, path):
        gate, up, _ = nf4_gate_up(x, w_gate, w_up, h=False, path=path)
        ctx.weights, ctx.path, ctx.x_dtype = (w_gate, w_up), path, x.dtype
        return gate, up

    @staticmethod
    def backward(ctx, dgate, dup):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _gate_up_input_grad(dgate, dup, *ctx.weights, ctx.path, ctx.x_dtype), None, None, None


def nf4_gate_up_linear(x, w_gate, w_up, path="auto"):
    """(x @ dequant(Wg)^T, x @ dequant(Wu)^T) from one read of x, differentiable in x (frozen NF4 weights)."""
    if _compiling():
        op = "nf4_gate_up_linear"
        return _ops.nf4_gate_up(x, *_w_args(op, "w_gate", w_gate), *_w_args(op, "w_up", w_up), path)
    if _grad_wanted(x):
        return _Nf4GateUp.apply(x, w_gate, w_up, path)
    return nf4_gate_up(x, w_gate, w_up, h=False, path=path)[:2]


class _Nf4SwiGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, path):
        gate, up, h = nf4_gate_up(x, w_gate, w_up, path=path)
        ctx.save_for_backward(gate, up)
        ctx.weights, ctx.path, ctx.x_dtype = (w_gate, w_up), path, x.dtype
        return h

    @staticmethod
    def backward(ctx, dh):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        gate, up = ctx.saved_tensors
        dgate, dup = swiglu_backward(gate, up, dh)
        return _gate_up_input_grad(dgate, dup, *ctx.weights, ctx.path, ctx.x_dtype), None, None, None


def nf4_swiglu(x, w_gate, w_up, path="auto"):
    """h = silu(x @ dequant(Wg)^T) * (x @ dequant(Wu)^T): an MLP's input half with frozen NF4 weights, both
    projections from one read of x (nf4_gate_up). Differentiable in x; keeps gate and up for the backward."""
    if _compiling():  # the compiled graph takes the projections and the SwiGLU as two ops
        return swiglu_autograd(*nf4_gate_up_linear(x, w_gate, w_up, path))
    if _grad_wanted(x):
        return _Nf4SwiGlu.apply(x, w_gate, w_up, path)
    return nf4_gate_up(x, w_gate, w_up, gate=False, up=False, path=path)[2]  # inference: h only


class LoraAdapter(torch.nn.Module):
    """(alpha / rank) * dropout(x) @ A^T @ B^T with A [rank, in] (Kaiming-uniform) and B [out, rank] (zeros), both
    trainable and held in `dtype`: LoRA's low-rank update, as PEFT initializes it. Returns x's dtype."""

    def __init__(self, in_features, out_features, rank=16, alpha=32.0, dropout=0.0, dtype=torch.float32,
                 device=None):
        super().__init__()
        if rank <= 0:
            raise _error("InvalidArgument", f"LoraAdapter: rank must be positive, got {rank}")
        self.scale = alpha / rank
        self.lora_a = torch.nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

    def forward(self, x):
        t = self.dropout(x).to(self.lora_a.dtype) @ self.lora_a.t()
        return (self.scale * (t @ self.lora_b.t())).to(x.dtype)


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
    """y = x @ dequant(W)^T + bias + lora(x): a frozen NF4 base and bias run by qmm, and a trainable LoraAdapter
    (`.lora`, created on the base's device). The base moves with the module (.to(device), .cuda()) and is not in the
    state dict, which holds the adapter and the bias; Nf4Weight.to_bnb_state_dict saves the base."""

    def __init__(self, weight, rank=16, alpha=32.0, dropout=0.0, bias=None, adapter_dtype=torch.float32, path="auto"):
        super().__init__()
        out_features, in_features = _nf4("QLoraLinear", "weight", weight)
        _qmm.check_nf4_path(path, "QLoraLinear")
        self.weight, self.path = weight, path
        self.lora = LoraAdapter(in_features, out_features, rank, alpha, dropout, adapter_dtype, weight.device)
        # The bias belongs to the frozen base (PEFT's bias="none"): kept, shared with the given tensor, not trained.
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x):
        return nf4_linear(x, self.weight, self.bias, self.path) + self.lora(x)

    @classmethod
    def from_bnb(cls, layer, **lora):
        """The same layer on the NF4 weight (shared, not copied) and bias of a bitsandbytes 4-bit linear layer;
        `lora` as for the constructor (rank, alpha, dropout, adapter_dtype, path)."""
        return cls(_bnb_weight(layer, "QLoraLinear.from_bnb", bias_ok=True), bias=getattr(layer, "bias", None),
                   **lora)


class QLoraSwiGluMlp(_Nf4Module):
    """y = down(silu(gate(x)) * up(x)): an LLM's MLP block on frozen NF4 weights W_gate, W_up [I, H] and W_down
    [H, I], with a LoraAdapter on each projection (`gate_lora`, `up_lora`, `down.lora`). Both input projections'
    base products come from one read of x (nf4_gate_up); the SwiGLU and its gradient are qmm's kernels."""

    def __init__(self, w_gate, w_up, w_down, rank=16, alpha=32.0, dropout=0.0, adapter_dtype=torch.float32,
                 path="auto"):
        super().__init__()
        inter, hidden = _nf4("QLoraSwiGluMlp", "w_gate", w_gate)
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
        gate, up = nf4_gate_up_linear(x, self.w_gate, self.w_up, self.path)
        return self.down(swiglu_autograd(gate + self.gate_lora(x), up + self.up_lora(x)))

    @classmethod
    def from_bnb(cls, mlp, **lora):
        """The same block on the NF4 weights of a Llama/Qwen/Mistral-style MLP module whose gate_proj, up_proj and
        down_proj are bitsandbytes 4-bit layers without bias (shared, not copied); `lora` as for the constructor."""
        act = getattr(mlp, "act_fn", None)
        if act is not None and "silu" not in type(act).__name__.lower():
            raise _error("Unsupported", f"QLoraSwiGluMlp.from_bnb: activation {type(act).__name__} (SwiGLU needs SiLU)")
        return cls(*(_bnb_weight(getattr(mlp, p), p) for p in ("gate_proj", "up_proj", "down_proj")), **lora)


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
    def matches(name, module):
        return name.rpartition(".")[2] in names and _has_bnb_weight(module)
    return _replace_modules("replace_bnb_linears", model, matches, lambda m: QLoraLinear.from_bnb(m, **lora))


# ---- bitsandbytes and PEFT models patched in place ---------------------------------------------------------------
# patch_bnb leaves a model as it is (its modules, parameters and state-dict names, PEFT's LoRA adapters, accelerate's
# hooks) and changes only how the patched modules compute: with qmm wherever the case is one qmm covers, with the
# module's own forward everywhere else, decided per call.

_PATCH = "_qmm_patch"  # set on a patched module: (the attribute patched, its previous instance value or None)
_QMM_DTYPES = (torch.float32, torch.bfloat16)
_nf4_cache = weakref.WeakKeyDictionary()  # bitsandbytes layer -> (its weight's identity, Nf4Weight)


def _is_lora_wrapper(layer):
    """A PEFT LoRA layer (a base_layer with lora_A/lora_B adapters), told by its attributes (no PEFT import)."""
    return all(hasattr(layer, a) for a in ("base_layer", "lora_A", "lora_B", "scaling", "lora_dropout"))


def _is_bnb_nf4_layer(layer):
    """A bitsandbytes 4-bit layer holding NF4 (or not yet quantized: bitsandbytes quantizes on moving to a GPU); not
    a PEFT LoRA layer around one, which shows its base's weight."""
    return _has_bnb_weight(layer) and getattr(layer.weight.quant_state, "quant_type", "nf4") == "nf4" and \
        not _is_lora_wrapper(layer)


def _bnb_nf4_base(layer):
    """The bitsandbytes NF4 layer that computes `layer`'s base product (itself or a PEFT wrapper's), or None."""
    base = layer.base_layer if _is_lora_wrapper(layer) else layer
    return base if _is_bnb_nf4_layer(base) else None


def _eager(fn):
    """fn run by Python under torch.compile too (a graph break), where tracing it would gain nothing."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)  # PyTorch >= 2.1
    return disable(fn) if disable else fn


@_eager  # its data-pointer checks cannot be traced, and each weight's shapes would compile it anew
def _current_nf4(layer):
    """The Nf4Weight of a bitsandbytes layer's weight as it is now, or None where it is not quantized NF4 (or not
    in NF4's layout: bitsandbytes repacks weights for its CPU kernels when an unpatched layer ran inference). Cached
    per layer and made again when the weight was replaced or moved (bitsandbytes quantizes on .to(device); a PEFT
    merge quantizes a new weight)."""
    weight = layer.weight
    qs = getattr(weight, "quant_state", None)
    if qs is None or qs.quant_type != "nf4" or getattr(qs, "packing_format_for_cpu", False):
        return None
    key = (weight.data_ptr(), weight.device, id(qs), qs.absmax.data_ptr())
    cached = _nf4_cache.get(layer)
    if cached is None or cached[0] != key:
        cached = _nf4_cache[layer] = (key, Nf4Weight.from_bnb(weight, qs))
    return cached[1]


def _lora_terms(layer):
    """How `layer`'s own forward adds LoRA: "none" (a plain layer; adapters disabled, or merged into the base),
    "add" (each active adapter's dropout/lora_A/lora_B/scaling term, PEFT's plain LoRA), or None for anything else
    (DoRA and other variants; a disabled adapter that is still merged), which the patched forwards leave to it."""
    if not _is_lora_wrapper(layer):
        return "none"
    if layer.disable_adapters:
        return None if layer.merged else "none"
    if layer.merged:
        return "none"
    variants, dora = getattr(layer, "lora_variant", {}), getattr(layer, "use_dora", {})
    active = [a for a in layer.active_adapters if a in layer.lora_A.keys()]
    return None if any(a in variants or dora.get(a, False) for a in active) else "add"


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


def _unpatched(module):
    """The forward `module` had before patch_bnb."""
    attr, previous = module.__dict__[_PATCH]
    return previous if previous is not None else getattr(type(module), attr).__get__(module)


def _fallback(module, why, x, *args, **kwargs):
    """Runs the module's own forward for a call qmm does not cover, saying why once per reason (Python's warnings
    show each message once), so that a model that stays slow tells its user."""
    warnings.warn(f"qmm.patch_bnb: {why}; the module's own forward runs instead", stacklevel=3)
    return _unpatched(module)(x, *args, **kwargs)


def _uncovered_call(x, args, kwargs):
    """Why qmm does not take this call's arguments, or None."""
    if args or kwargs:
        return "a call with arguments besides the input"
    if x.dtype not in _QMM_DTYPES:
        return f"{x.dtype} activations (qmm takes torch.float32 and torch.bfloat16)"
    return None


_NOT_NF4 = "a weight not in bitsandbytes' NF4 layout (not quantized yet, or repacked for bitsandbytes' CPU kernels)"


def _bnb_linear_forward(layer, path, x, *args, **kwargs):
    why = _uncovered_call(x, args, kwargs)
    w = None if why else _current_nf4(layer)
    if w is None:
        return _fallback(layer, why or _NOT_NF4, x, *args, **kwargs)
    return nf4_linear(x, w, layer.bias, path)


def _swiglu_mlp_forward(mlp, path, x, *args, **kwargs):
    projections = (mlp.gate_proj, mlp.up_proj)
    bases = [_bnb_nf4_base(p) for p in projections]
    terms = [_lora_terms(p) for p in projections]
    why = _uncovered_call(x, args, kwargs)
    if why is None and None in bases:
        why = "gate_proj or up_proj is no longer a bitsandbytes NF4 layer"
    if why is None and None in terms:
        why = "a LoRA variant (DoRA, ...) or a disabled adapter still merged on gate_proj or up_proj"
    weights = [None] if why else [_current_nf4(b) for b in bases]
    if None in weights:
        return _fallback(mlp, why or _NOT_NF4, x, *args, **kwargs)
    if terms == ["none", "none"] and bases[0].bias is None and bases[1].bias is None:  # the SwiGLU in the kernel
        return mlp.down_proj(nf4_swiglu(x, *weights, path))
    outs = nf4_gate_up_linear(x, *weights, path)
    gate, up = ((y if b.bias is None else y + b.bias.to(y.dtype)) for y, b in zip(outs, bases))
    gate, up = ((_add_lora(p, x, y) if t == "add" else y) for p, t, y in zip(projections, terms, (gate, up)))
    return mlp.down_proj(swiglu_autograd(gate, up))


def _is_swiglu_mlp(module):
    """An MLP module in the Hugging Face Llama/Qwen/Mistral form: down_proj(act_fn(gate_proj(x)) * up_proj(x)) with
    a SiLU act_fn and bitsandbytes NF4 bases (PEFT-wrapped or not) under gate_proj and up_proj."""
    act = getattr(module, "act_fn", None)
    return act is not None and "silu" in type(act).__name__.lower() and hasattr(module, "down_proj") and \
        all(_bnb_nf4_base(getattr(module, p, None)) is not None for p in ("gate_proj", "up_proj"))


def _patch(module, forward, path):
    # accelerate's hooks (device_map) wrap a module's forward and call the original as _old_forward: patch that one.
    attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    module.__dict__[_PATCH] = (attr, module.__dict__.get(attr))
    setattr(module, attr, functools.partial(forward, module, path))


def patch_bnb(model, path="auto", fuse_mlp=True):
    """Runs a bitsandbytes 4-bit model's NF4 layers with qmm, in place, and changes nothing else: modules,
    parameters, state-dict names and PEFT's LoRA adapters stay (PEFT trains, saves and merges them as before). Every
    bitsandbytes NF4 linear layer then computes with qmm.nf4_linear (bf16 products, fp32 sums, whatever its
    compute_dtype); with `fuse_mlp`, every MLP of Hugging Face's Llama/Qwen/Mistral form
    (down_proj(silu(gate_proj(x)) * up_proj(x)), gate_proj and up_proj NF4, PEFT-wrapped or not) computes both input
    projections from one read of x (qmm.nf4_gate_up) and the SwiGLU with qmm, adding plain LoRA adapters as PEFT
    does. A call that qmm does not cover (float16 activations, DoRA or other LoRA variants, extra arguments, a
    weight not yet quantized) runs the module's own forward, with a warning that says why (once per reason). `path`
    forces qmm's NF4 implementation (see nf4_gemm). Returns the patched modules' names; unpatch_bnb undoes it."""
    _model("patch_bnb", model)
    _qmm.check_nf4_path(path, "patch_bnb")
    patched = []
    for name, module in model.named_modules():
        if _PATCH in module.__dict__:
            continue
        if _is_bnb_nf4_layer(module):
            _patch(module, _bnb_linear_forward, path)
        elif fuse_mlp and _is_swiglu_mlp(module):
            _patch(module, _swiglu_mlp_forward, path)
        else:
            continue
        patched.append(name)
    return patched


def unpatch_bnb(model):
    """Gives every module that patch_bnb patched inside `model` its previous forward back; returns their names."""
    _model("unpatch_bnb", model)
    restored = []
    for name, module in model.named_modules():
        if _PATCH in module.__dict__:
            attr, previous = module.__dict__.pop(_PATCH)
            if previous is None:
                delattr(module, attr)
            else:
                setattr(module, attr, previous)
            _nf4_cache.pop(module, None)
            restored.append(name)
    return restored


# ---- torch.compile: the differentiable ops as PyTorch custom ops (PyTorch >= 2.4) ------------------------------
# torch.compile cannot trace into qmm's C++ calls. As custom ops with shape-only ("fake") implementations and their
# backward registered, they stay whole in a compiled graph (fullgraph=True works). Eager calls keep the
# autograd.Functions above: a custom op's dispatch costs more per call. An NF4 weight enters a custom op as its
# tensors and fields (_w_args), since an op's arguments must be tensors and scalars.


def _w_args(op, name, w):
    _nf4(op, name, w)
    return w.codes, w.absmax, w.absmax2, w.code2, w._offset_arg, w.shape[0], w.shape[1], w.block_size


def _w_of(codes, absmax, absmax2, code2, offset, rows, cols, block_size):
    return Nf4Weight(codes, absmax, (rows, cols), block_size, absmax2, code2, offset.item())


def _register_compile_ops():
    from typing import Optional, Tuple  # noqa: F401 (the custom ops' annotations name them)

    Tensor = torch.Tensor  # noqa: N806
    op = torch.library.custom_op

    @op("qmm::nf4_linear", mutates_args=())
    def nf4_linear_op(x: Tensor, codes: Tensor, absmax: Tensor, absmax2: Optional[Tensor], code2: Optional[Tensor],
                      offset: Tensor, rows: int, cols: int, block_size: int, path: str) -> Tensor:
        return nf4_gemm(x, _w_of(codes, absmax, absmax2, code2, offset, rows, cols, block_size), path=path)

    @nf4_linear_op.register_fake
    def _(x, codes, absmax, absmax2, code2, offset, rows, cols, block_size, path):
        return x.new_empty((*x.shape[:-1], rows))

    @op("qmm::nf4_input_grad", mutates_args=())
    def nf4_input_grad_op(dy: Tensor, codes: Tensor, absmax: Tensor, absmax2: Optional[Tensor],
                          code2: Optional[Tensor], offset: Tensor, rows: int, cols: int, block_size: int,
                          path: str) -> Tensor:
        return nf4_gemm_backward_a(dy, _w_of(codes, absmax, absmax2, code2, offset, rows, cols, block_size),
                                   path=path)

    @nf4_input_grad_op.register_fake
    def _(dy, codes, absmax, absmax2, code2, offset, rows, cols, block_size, path):
        return dy.new_empty((*dy.shape[:-1], cols))

    def input_grad(dy, w_args, path, dtype):
        return None if dy is None else nf4_input_grad_op(dy, *w_args, path).to(dtype)

    # Tensors are kept with save_for_backward, the rest on ctx: a weight's args are 5 tensors (the codes, the
    # scales' three, the offset), then 3 integers.
    def setup_linear(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:6])
        ctx.w_scalars, ctx.path, ctx.x_dtype = inputs[6:9], inputs[9], inputs[0].dtype

    def linear_grad(ctx, dy):
        return (input_grad(dy, (*ctx.saved_tensors, *ctx.w_scalars), ctx.path, ctx.x_dtype),) + (None,) * 9

    nf4_linear_op.register_autograd(linear_grad, setup_context=setup_linear)

    @op("qmm::nf4_gate_up", mutates_args=())
    def nf4_gate_up_op(x: Tensor, g_codes: Tensor, g_absmax: Tensor, g_absmax2: Optional[Tensor],
                       g_code2: Optional[Tensor], g_offset: Tensor, g_rows: int, g_cols: int, g_block_size: int,
                       u_codes: Tensor, u_absmax: Tensor, u_absmax2: Optional[Tensor], u_code2: Optional[Tensor],
                       u_offset: Tensor, u_rows: int, u_cols: int, u_block_size: int,
                       path: str) -> Tuple[Tensor, Tensor]:
        w_gate = _w_of(g_codes, g_absmax, g_absmax2, g_code2, g_offset, g_rows, g_cols, g_block_size)
        w_up = _w_of(u_codes, u_absmax, u_absmax2, u_code2, u_offset, u_rows, u_cols, u_block_size)
        gate, up, _ = nf4_gate_up(x, w_gate, w_up, h=False, path=path)
        return gate, up

    @nf4_gate_up_op.register_fake
    def _(x, *args):
        rows = args[5]  # g_rows
        return x.new_empty((*x.shape[:-1], rows)), x.new_empty((*x.shape[:-1], rows))

    def setup_gate_up(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:6], *inputs[9:14])
        ctx.g_scalars, ctx.u_scalars, ctx.path, ctx.x_dtype = inputs[6:9], inputs[14:17], inputs[17], inputs[0].dtype

    def gate_up_grad(ctx, dgate, dup):
        saved = ctx.saved_tensors
        g_args, u_args = (*saved[:5], *ctx.g_scalars), (*saved[5:], *ctx.u_scalars)
        grads = [g for g in (input_grad(dgate, g_args, ctx.path, ctx.x_dtype),
                             input_grad(dup, u_args, ctx.path, ctx.x_dtype)) if g is not None]
        return (sum(grads[1:], grads[0]) if grads else None,) + (None,) * 17

    nf4_gate_up_op.register_autograd(gate_up_grad, setup_context=setup_gate_up)

    @op("qmm::swiglu", mutates_args=())
    def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
        return swiglu(gate, up)

    @swiglu_op.register_fake
    def _(gate, up):
        return torch.empty_like(gate)

    @op("qmm::swiglu_backward", mutates_args=())
    def swiglu_backward_op(gate: Tensor, up: Tensor, dh: Tensor) -> Tuple[Tensor, Tensor]:
        return swiglu_backward(gate, up, dh)

    @swiglu_backward_op.register_fake
    def _(gate, up, dh):
        return torch.empty_like(gate), torch.empty_like(up)

    def setup_swiglu(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def swiglu_grad(ctx, dh):
        return swiglu_backward_op(*ctx.saved_tensors, dh)

    swiglu_op.register_autograd(swiglu_grad, setup_context=setup_swiglu)
    return types.SimpleNamespace(nf4_linear=nf4_linear_op, nf4_gate_up=nf4_gate_up_op, swiglu=swiglu_op)


if hasattr(torch.library, "custom_op") and hasattr(torch.compiler, "is_compiling"):
    _ops = _register_compile_ops()
    _compiling = torch.compiler.is_compiling
else:  # older PyTorch: eager only (torch.compile breaks the graph at qmm's calls)
    _ops = None

    def _compiling():
        return False
