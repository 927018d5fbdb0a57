"""The differentiable ops: frozen NF4 bases (no weight gradient), optional LoRA adapters (gradients for A and B),
differentiable in the activations. Eager calls run autograd.Functions; under torch.compile the same arithmetic
(_impl.py) runs as PyTorch custom ops (compile_ops.py), which a compiled graph keeps whole."""
import collections
import math

import torch

from . import _impl, compile_ops
from ._base import _check_path, _error, _flag, _tensors
from .nf4 import Nf4Weight, _nf4
from .ops import (add_rms_norm, nf4_gate_up, nf4_gemm_backward_a, rms_norm, rms_norm_backward, rope, swiglu,
                  swiglu_backward)

_compiling = compile_ops.compiling


class Lora(collections.namedtuple("Lora", ("a", "b", "scale", "x_dropped"), defaults=(None,))):
    """A LoRA adapter's term on a projection, scale * (x_dropped @ a^T) @ b^T: a [r, in] and b [out, r] trainable
    (float32, as PEFT keeps them, or bfloat16; their products run in the activations' dtype with fp32 sums),
    `x_dropped` the adapter's input when it is not x itself (dropout(x), computed by the caller with PyTorch, whose
    backward applies the mask)."""


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _grad_wanted(*inputs):
    """Whether autograd will differentiate through these inputs; where it will not (inference, frozen inputs), the
    differentiable ops call the plain ones and skip what only a backward needs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def _weight(op, name, w):
    """The Nf4Weight to compute with: w itself, or one made from compile_ops' argument tuple (a patched
    bitsandbytes layer's weight)."""
    if isinstance(w, tuple):
        return compile_ops.weight_of(*w)
    _nf4(op, name, w)  # raises unless an Nf4Weight
    return w


def _shape(w):
    return w.shape if isinstance(w, Nf4Weight) else (w[5], w[6])


def _gate_up_shape(op, w_gate, w_up):
    """The [I, H] shape of an MLP's gate and up weights (Nf4Weights or compile_ops' argument tuples), which must
    match."""
    shape = _shape(w_gate) if isinstance(w_gate, tuple) else _nf4(op, "w_gate", w_gate)
    if (_shape(w_up) if isinstance(w_up, tuple) else _nf4(op, "w_up", w_up)) != shape:
        raise _error("ShapeMismatch", f"{op}: w_gate is {list(shape)} but w_up is {list(_shape(w_up))}; they must "
                                      f"match")
    return shape


def _check_x(op, x):
    """The activations: a float32 or bfloat16 tensor (qmm's products take no other dtype)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16):
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise _error("DTypeMismatch", f"{op}: argument 'x' is {what}; it must be torch.float32 or torch.bfloat16")


def _check_bias(op, name, bias, out_features):
    """A bias must be a 1-D floating tensor of the output width (it is added in x's dtype)."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (out_features,):
        what = f"{list(bias.shape)} {bias.dtype}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise _error("ShapeMismatch", f"{op}: argument '{name}' is {what}; it must be a floating tensor "
                                      f"[{out_features}]")


def _check_lora(op, name, lora, x, out_features, in_features):
    """Checks an adapter against x and the weight [out_features, in_features]; returns the _impl tuple or None."""
    if lora is None:
        return None
    if not isinstance(lora, Lora):
        raise _error("InvalidArgument", f"{op}: argument '{name}' must be a qmm.Lora, not {type(lora).__name__}")
    a, b, scale, xd = lora
    for part, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.bfloat16):
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise _error("DTypeMismatch", f"{op}: argument '{name}' has {part} of {what}; it must be a "
                                          f"torch.float32 or torch.bfloat16 tensor")
    if xd is not None and not isinstance(xd, torch.Tensor):
        raise _error("InvalidArgument", f"{op}: argument '{name}' has x_dropped of {type(xd).__name__}, not a "
                                        f"tensor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or \
            abs(scale) > _FLOAT32_MAX:
        raise _error("InvalidArgument", f"{op}: argument '{name}' has scale {scale!r}; it must be a finite number "
                                        f"(within float32's range)")
    rank = a.shape[0] if a.dim() == 2 else -1
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank) or rank < 1:
        raise _error("ShapeMismatch", f"{op}: argument '{name}' has a {list(a.shape)} and b {list(b.shape)}; they "
                                      f"must be [r, {in_features}] and [{out_features}, r]")
    if xd is not None and xd.shape != x.shape:
        raise _error("ShapeMismatch", f"{op}: argument '{name}' has x_dropped {list(xd.shape)}, not x's shape "
                                      f"{list(x.shape)}")
    return (x if xd is None else xd, a, b, float(scale))


class _LoraNf4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, xd, a, b, bias, w, scale, path):
        lora = None if a is None else (x if xd is None else xd, a, b, scale)
        y, saved = _impl.linear_forward(x, w, bias, lora, path, cached=True)
        ctx.save_for_backward(*(saved or ()), a, b, bias)
        ctx.w, ctx.path, ctx.scale, ctx.dropped, ctx.x_shape = w, path, scale, xd is not None, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        *saved, a, b, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dxd, da, db = _impl.linear_backward(dy, ctx.w, ctx.path, tuple(saved) or None, ctx.scale, ctx.dropped,
                                                ctx.x_shape, need[:4])
        dbias = _impl.bias_grad(dy, bias) if need[4] else None
        return dx, dxd, _impl.param_grad(da, a), _impl.param_grad(db, b), dbias, None, None, None


def lora_nf4_linear(x, w, lora=None, bias=None, path="auto"):
    """y = x @ dequant(W)^T + bias + lora's term, for x [..., in] (float32 or bfloat16; y has x's dtype) and a
    frozen NF4 weight W [out, in]: the base product, the bias (added in the product's sum) and the adapter (its sum
    in its second GEMM's epilogue) as one op. Differentiable in x, the bias and the adapter's a, b and x_dropped;
    the backward reads the output gradient once for both of the adapter's products."""
    op = "lora_nf4_linear"
    _check_x(op, x)
    _check_path(op, path)
    out_features, in_features = _shape(w) if isinstance(w, tuple) else _nf4(op, "w", w)
    lora_args = _check_lora(op, "lora", lora, x, out_features, in_features)
    _check_bias(op, "bias", bias, out_features)
    if _compiling():
        return compile_ops.lora_nf4_linear(x, w, lora_args, bias, path)
    w = _weight(op, "w", w)
    if not _grad_wanted(x, bias, *(lora or ())[:2], lora and lora.x_dropped):
        return _impl.linear_forward(x, w, bias, lora_args, path, cached=True)[0]
    if lora is None:
        return _LoraNf4Linear.apply(x, None, None, None, bias, w, 1.0, path)
    return _LoraNf4Linear.apply(x, lora.x_dropped, lora.a, lora.b, bias, w, lora_args[3], path)


def nf4_linear(x, w, bias=None, path="auto"):
    """y = x @ dequant(W)^T (+ bias) for x [..., in] (float32 or bfloat16; y has x's dtype). Differentiable in x
    and bias; W is frozen (no weight gradient)."""
    return lora_nf4_linear(x, w, None, bias, path)


class _LoraNf4Linears(torch.autograd.Function):
    """Several projections of one x; their per-projection tensors flat, 5 each: xd, a, b, bias and (not a tensor)
    the weight."""

    @staticmethod
    def forward(ctx, x, scales, path, *flat):
        xds, as_, bs, biases, ws = (flat[i::5] for i in range(5))
        loras = [None if a is None else (x if xd is None else xd, a, b, scale)
                 for xd, a, b, scale in zip(xds, as_, bs, scales)]
        ys, saved = _impl.linears_forward(x, ws, biases, loras, path, cached=True)
        ctx.grouped = isinstance(saved, _impl.Grouped)
        ctx.counts = [len(saved)] if ctx.grouped else [len(s or ()) for s in saved]
        flat = saved if ctx.grouped else [t for s in saved for t in (s or ())]
        ctx.save_for_backward(*flat, *as_, *bs, *biases)
        ctx.ws, ctx.path, ctx.scales, ctx.x_shape = ws, path, scales, x.shape
        ctx.dropped = [xd is not None for xd in xds]
        ctx.set_materialize_grads(False)  # an unused output (v in a KV-free attention...) costs no product
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        tensors, n = ctx.saved_tensors, len(ctx.ws)
        saved, at = [], 0
        for c in ctx.counts:
            saved.append(tuple(tensors[at:at + c]) or None)
            at += c
        if ctx.grouped:
            saved = _impl.Grouped(saved[0])
        as_, bs, biases = tensors[at:at + n], tensors[at + n:at + 2 * n], tensors[at + 2 * n:]
        need = ctx.needs_input_grad  # x, scales, path, then 5 per projection
        wants = [(need[3 + 5 * i], need[4 + 5 * i], need[5 + 5 * i]) for i in range(n)]
        dx, grads = _impl.linears_backward(dys, ctx.ws, ctx.path, saved, ctx.scales, ctx.dropped, ctx.x_shape,
                                           wants, need[0])
        flat = []
        for (dxd, da, db), a, b, bias, dy, i in zip(grads, as_, bs, biases, dys, range(n)):
            dbias = _impl.bias_grad(dy, bias) if need[6 + 5 * i] and dy is not None else None
            flat += [dxd, _impl.param_grad(da, a), _impl.param_grad(db, b), dbias, None]
        return (dx, None, None, *flat)


def lora_nf4_linears(x, weights, loras=None, biases=None, path="auto"):
    """Several projections of one input as one op: (x @ dequant(W_i)^T + biases[i] + loras[i]'s term for each i),
    e.g. an attention's q, k and v. Each output is what lora_nf4_linear(x, weights[i], loras[i], biases[i]) gives;
    together they cost one autograd node, their adapters' working copies one launch, and their input gradients no
    separate sum (each projection's product adds into the one dx). loras and biases are lists as long as weights
    (None entries: no adapter, no bias) or None. Returns a tuple of outputs."""
    op = "lora_nf4_linears"
    _check_x(op, x)
    _check_path(op, path)
    if not isinstance(weights, (list, tuple)) or not weights:
        raise _error("InvalidArgument", f"{op}: argument 'weights' must be a non-empty list of NF4 weights")
    n = len(weights)
    loras, biases = [None] * n if loras is None else list(loras), [None] * n if biases is None else list(biases)
    for name, given in (("loras", loras), ("biases", biases)):
        if len(given) != n:
            raise _error("InvalidArgument", f"{op}: argument '{name}' has {len(given)} entries for {n} weights")
    shapes = [_shape(w) if isinstance(w, tuple) else _nf4(op, f"weights[{i}]", w) for i, w in enumerate(weights)]
    if len({k for _, k in shapes}) != 1:
        raise _error("ShapeMismatch", f"{op}: the weights are {[list(s) for s in shapes]}; they must share their "
                                      f"input width")
    lora_args = [_check_lora(op, f"loras[{i}]", lora, x, *shape) for i, (lora, shape) in enumerate(zip(loras, shapes))]
    for i, (bias, (out_features, _)) in enumerate(zip(biases, shapes)):
        _check_bias(op, f"biases[{i}]", bias, out_features)
    if _compiling():  # three (q, k, v) as one custom op, as eager; other counts one op per projection
        if n == 3:
            return compile_ops.lora_nf4_qkv(x, weights, lora_args, biases, path)
        return tuple(compile_ops.lora_nf4_linear(x, w, la, bias, path)
                     for w, la, bias in zip(weights, lora_args, biases))
    ws = [_weight(op, f"weights[{i}]", w) for i, w in enumerate(weights)]
    tensors = [t for lora in loras if lora is not None for t in (lora.a, lora.b, lora.x_dropped)]
    if not _grad_wanted(x, *biases, *tensors):
        return tuple(_impl.linears_forward(x, ws, biases, lora_args, path, cached=True)[0])
    flat = []
    for lora, bias, w in zip(loras, biases, ws):
        flat += [None, None, None] if lora is None else [lora.x_dropped, lora.a, lora.b]
        flat += [bias, w]
    scales = tuple(1.0 if la is None else la[3] for la in lora_args)
    return _LoraNf4Linears.apply(x, scales, path, *flat)


class _LoraNf4SwiGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, xd_g, a_g, b_g, xd_u, a_u, b_u, w_gate, w_up, scales, path):
        loras = tuple(None if a is None else (x if xd is None else xd, a, b, s)
                      for xd, a, b, s in ((xd_g, a_g, b_g, scales[0]), (xd_u, a_u, b_u, scales[1])))
        h, gate, up, saved = _impl.swiglu_forward(x, w_gate, w_up, loras, path, keep=True, cached=True)
        ctx.grouped = isinstance(saved, _impl.Grouped)
        flat = saved if ctx.grouped else [t for s in saved for t in (s or (None,) * 4)]
        ctx.save_for_backward(gate, up, *flat, a_g, b_g, a_u, b_u)
        ctx.weights, ctx.path, ctx.scales, ctx.x_shape = (w_gate, w_up), path, scales, x.shape
        ctx.has, ctx.dropped = tuple(lora is not None for lora in loras), (xd_g is not None, xd_u is not None)
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up, *rest = ctx.saved_tensors
        if ctx.grouped:
            saved, params = _impl.Grouped(rest[:5]), rest[5:]
        else:
            saved = tuple(tuple(rest[4 * i:4 * i + 4]) if ctx.has[i] else None for i in range(2))
            params = rest[8:]
        n = ctx.needs_input_grad  # x, xd_g, a_g, b_g, xd_u, a_u, b_u
        dx, dxd_g, dxd_u, da_g, db_g, da_u, db_u = _impl.swiglu_backward(
            dh, gate, up, *ctx.weights, ctx.path, saved, ctx.scales, ctx.dropped, ctx.x_shape,
            (n[0], n[1], n[4], n[2], n[3], n[5], n[6]))
        grads = [_impl.param_grad(g, p) for g, p in zip((da_g, db_g, da_u, db_u), params)]
        return dx, dxd_g, grads[0], grads[1], dxd_u, grads[2], grads[3], None, None, None, None


def lora_nf4_swiglu(x, w_gate, w_up, gate_lora=None, up_lora=None, path="auto"):
    """h = silu(gate) * up with gate = x @ dequant(Wg)^T + gate_lora's term and up = x @ dequant(Wu)^T + up_lora's
    term: an MLP's input half with frozen NF4 weights [I, H], both base products from one read of x (nf4_gate_up),
    the adapters' sums in their GEMMs' epilogues, then the SwiGLU. Differentiable in x and the adapters; keeps gate
    and up for the backward. Without adapters the SwiGLU runs in the gate/up kernel's epilogue."""
    op = "lora_nf4_swiglu"
    _check_x(op, x)
    _check_path(op, path)
    shape = _gate_up_shape(op, w_gate, w_up)
    loras = (_check_lora(op, "gate_lora", gate_lora, x, *shape), _check_lora(op, "up_lora", up_lora, x, *shape))
    if _compiling():
        return compile_ops.lora_nf4_swiglu(x, w_gate, w_up, loras, path)
    w_gate, w_up = _weight(op, "w_gate", w_gate), _weight(op, "w_up", w_up)
    tensors = [t for lora in (gate_lora, up_lora) if lora is not None for t in (lora.a, lora.b, lora.x_dropped)]
    if not _grad_wanted(x, *tensors):
        return _impl.swiglu_forward(x, w_gate, w_up, loras, path, keep=False, cached=True)[0]
    args = []
    for lora, lora_args in zip((gate_lora, up_lora), loras):
        args += [None, None, None] if lora is None else [lora.x_dropped, lora.a, lora.b]
    scales = tuple(1.0 if lora_args is None else lora_args[3] for lora_args in loras)
    return _LoraNf4SwiGlu.apply(x, *args, w_gate, w_up, scales, path)


class _LoraNf4Mlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, xd_g, a_g, b_g, xd_u, a_u, b_u, a_d, b_d, residual, w_gate, w_up, w_down, scales, path):
        loras = tuple(None if a is None else (x if xd is None else xd, a, b, s)
                      for xd, a, b, s in ((xd_g, a_g, b_g, scales[0]), (xd_u, a_u, b_u, scales[1])))
        down = None if a_d is None else (a_d, b_d, scales[2])
        y, (gate, up, saved, saved_d) = _impl.mlp_forward(x, w_gate, w_up, w_down, loras, down, path, keep=True,
                                                           cached=True, residual=residual)
        ctx.grouped = isinstance(saved, _impl.Grouped)
        flat = saved if ctx.grouped else [t for s in saved for t in (s or (None,) * 4)]
        ctx.n_saved = len(flat)
        ctx.save_for_backward(gate, up, *flat, *(saved_d or (None,) * 3), a_g, b_g, a_u, b_u, a_d, b_d)
        ctx.weights, ctx.path, ctx.scales, ctx.x_shape = (w_gate, w_up, w_down), path, scales, x.shape
        ctx.has = tuple(lora is not None for lora in loras)
        ctx.dropped = (xd_g is not None, xd_u is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, *rest = ctx.saved_tensors
        flat, rest = rest[:ctx.n_saved], rest[ctx.n_saved:]
        saved_d, params = (None if rest[0] is None else tuple(rest[:3])), rest[3:]
        if ctx.grouped:
            saved = _impl.Grouped(flat)
        else:
            saved = tuple(tuple(flat[4 * i:4 * i + 4]) if ctx.has[i] else None for i in range(2))
        n = ctx.needs_input_grad  # x, xd_g, a_g, b_g, xd_u, a_u, b_u, a_d, b_d, residual
        grads = _impl.mlp_backward(dy, gate, up, *ctx.weights, ctx.path, saved, saved_d, ctx.scales, ctx.dropped,
                                   ctx.x_shape, (n[0], n[1], n[4], n[2], n[3], n[5], n[6], n[7], n[8]))
        dx, dxd_g, dxd_u, *param_grads = grads
        da_g, db_g, da_u, db_u, da_d, db_d = (_impl.param_grad(g, p) for g, p in zip(param_grads, params))
        return (dx, dxd_g, da_g, db_g, dxd_u, da_u, db_u, da_d, db_d, dy if n[9] else None,
                None, None, None, None, None)


def lora_nf4_mlp(x, w_gate, w_up, w_down, gate_lora=None, up_lora=None, down_lora=None, path="auto",
                 residual=None):
    """y = down(silu(gate) * up) (+ residual): a whole SwiGLU MLP block with frozen NF4 weights (w_gate and w_up
    [I, H], w_down [H, I]) and LoRA adapters on any of the three, as one op (lora_nf4_swiglu, then the down
    projection). The intermediate h is not kept for the backward, whose SwiGLU kernel writes it again (where
    down_lora's gradient needs it) and adds down_lora's share of h's gradient itself: the block keeps gate and up,
    x and the adapters' small products. down_lora reads h itself (no x_dropped: dropout on the down projection's
    input needs lora_nf4_swiglu and lora_nf4_linear). residual (x's shape, dtype and device: a decoder layer's
    residual stream) is added in the down adapter's GEMM (its epilogue's addend: no pass of its own) and gets y's
    gradient."""
    op = "lora_nf4_mlp"
    _check_x(op, x)
    _check_path(op, path)
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != x.shape or
                                 residual.dtype != x.dtype or residual.device != x.device):
        what = f"{list(residual.shape)} {residual.dtype} on {residual.device}" \
            if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise _error("InvalidArgument", f"{op}: residual is {what}; it must have x's shape, dtype and device "
                                        f"({list(x.shape)} {x.dtype} on {x.device})")
    shape = _gate_up_shape(op, w_gate, w_up)
    down_shape = _shape(w_down) if isinstance(w_down, tuple) else _nf4(op, "w_down", w_down)
    if tuple(down_shape) != (shape[1], shape[0]):
        raise _error("ShapeMismatch", f"{op}: w_down is {list(down_shape)} but must be [{shape[1]}, {shape[0]}] for "
                                      f"w_gate {list(shape)}")
    loras = (_check_lora(op, "gate_lora", gate_lora, x, *shape), _check_lora(op, "up_lora", up_lora, x, *shape))
    if isinstance(down_lora, Lora) and down_lora.x_dropped is not None:
        raise _error("InvalidArgument", f"{op}: down_lora has x_dropped, but its input h is made inside the op; "
                                        f"use lora_nf4_swiglu and lora_nf4_linear for dropout on the down projection")
    down = _check_lora(op, "down_lora", down_lora, None, *down_shape)  # (None, a, b, scale): h is made inside
    if _compiling():
        return compile_ops.lora_nf4_mlp(x, w_gate, w_up, w_down, loras, None if down is None else down[1:], path,
                                        residual)
    w_gate, w_up, w_down = (_weight(op, n, w) for n, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)))
    tensors = [t for lora in (gate_lora, up_lora, down_lora) if lora is not None
               for t in (lora.a, lora.b, lora.x_dropped)]
    down_args = None if down is None else down[1:]
    if not _grad_wanted(x, residual, *tensors):
        return _impl.mlp_forward(x, w_gate, w_up, w_down, loras, down_args, path, keep=False, cached=True,
                                 residual=residual)[0]
    args = []
    for lora in (gate_lora, up_lora):
        args += [None, None, None] if lora is None else [lora.x_dropped, lora.a, lora.b]
    args += [None, None] if down_lora is None else [down_lora.a, down_lora.b]
    scales = tuple(1.0 if la is None else la[3] for la in (*loras, down))
    return _LoraNf4Mlp.apply(x, *args, residual, w_gate, w_up, w_down, scales, path)


def nf4_swiglu(x, w_gate, w_up, path="auto"):
    """h = silu(x @ dequant(Wg)^T) * (x @ dequant(Wu)^T): an MLP's input half with frozen NF4 weights, both
    projections from one read of x (nf4_gate_up). Differentiable in x; keeps gate and up for the backward."""
    return lora_nf4_swiglu(x, w_gate, w_up, path=path)


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
        return compile_ops.swiglu(gate, up)
    return _SwiGlu.apply(gate, up) if _grad_wanted(gate, up) else swiglu(gate, up)


def _gate_up_input_grad(dgate, dup, w_gate, w_up, path):
    """dx = dgate @ dequant(Wg) + dup @ dequant(Wu), either gradient possibly None (an output not used; None when
    both are, which autograd takes as no gradient)."""
    dx = None
    for d, w in ((dgate, w_gate), (dup, w_up)):
        if d is not None:
            dx = nf4_gemm_backward_a(d, w, path=path) if dx is None else \
                nf4_gemm_backward_a(d, w, out=dx, beta=1.0, path=path)
    return dx


class _Nf4GateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, path):
        gate, up, _ = nf4_gate_up(x, w_gate, w_up, h=False, path=path)
        ctx.weights, ctx.path = (w_gate, w_up), path
        return gate, up

    @staticmethod
    def backward(ctx, dgate, dup):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _gate_up_input_grad(dgate, dup, *ctx.weights, ctx.path), None, None, None


def nf4_gate_up_linear(x, w_gate, w_up, path="auto"):
    """(x @ dequant(Wg)^T, x @ dequant(Wu)^T) from one read of x, differentiable in x (frozen NF4 weights)."""
    _check_path("nf4_gate_up_linear", path)
    if _compiling():
        return compile_ops.nf4_gate_up(x, w_gate, w_up, path)
    if _grad_wanted(x):
        return _Nf4GateUp.apply(x, w_gate, w_up, path)
    return nf4_gate_up(x, w_gate, w_up, h=False, path=path)[:2]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, ignore_index, chunk_tokens, check_labels, chunk_vocab):
        loss, dh, dw = _impl.cross_entropy(h, w, labels, ignore_index, ctx.needs_input_grad[0],
                                           ctx.needs_input_grad[1], chunk_tokens, check_labels, chunk_vocab)
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        return (*_impl.cross_entropy_grads(*ctx.saved_tensors, grad, ctx.w_dtype), None, None, None, None, None)


def linear_cross_entropy_loss(h, w, labels, ignore_index=-100, chunk_tokens=0, check_labels=True, chunk_vocab=0):
    """A causal LM's loss from its hidden states: the mean cross-entropy of h @ w^T against labels (ignore_index
    skipped; 0 when every token is), for h [..., H] (float32 or bfloat16), w [V, H] (the head or the tied embedding)
    and labels [...] (int32 or int64), without the [tokens, V] logits ever held whole; the gradients are computed in
    the same pass and kept for the backward. Differentiable in h and w. On a GPU the logits go through in chunks of
    tokens and of the vocabulary (qmm's choice: within 5% of the fp32 logits' bytes where w takes no gradient, 1 GiB
    of whole rows where it does; chunk_tokens and chunk_vocab, where positive, set the tokens and the vocabulary
    columns per chunk, as ops.linear_cross_entropy takes them).
    check_labels as linear_cross_entropy takes it (True: a label out of range is a qmm.Error, and on a GPU the call
    waits for the device to read them; False: nothing waits, and such a label makes the loss NaN)."""
    op = "linear_cross_entropy_loss"
    _flag(op, "check_labels", check_labels)
    _tensors(op, h=h, labels=labels)
    if h.dim() < 1:
        raise _error("InvalidArgument", f"{op}: h must be [..., H], got a 0-d tensor")
    # One label per row of h, in h's order: labels of h's leading shape, or flattened
    if tuple(labels.shape) != tuple(h.shape[:-1]) and not (labels.dim() == 1 and labels.numel() == h.numel() //
                                                           max(h.shape[-1], 1)):
        raise _error("ShapeMismatch", f"{op}: labels have shape {list(labels.shape)} but must have h's leading "
                                      f"shape {list(h.shape[:-1])} (or be those rows flattened)")
    hidden = h.shape[-1]
    h2, labels = h.reshape(-1, hidden), labels.reshape(-1)
    if _compiling():
        return compile_ops.linear_cross_entropy(h2, w, labels, ignore_index, chunk_tokens, check_labels, chunk_vocab)
    if not _grad_wanted(h, w):
        return _impl.cross_entropy(h2, w, labels, ignore_index, False, False, chunk_tokens, check_labels,
                                   chunk_vocab)[0]
    return _LinearCrossEntropy.apply(h2, w, labels, ignore_index, chunk_tokens, check_labels, chunk_vocab)


def _norm_grads(x, w, rstd, dy, want_dx, want_dw, dres=None):
    """rms_norm_backward's dx (dres added; None unless wanted) and dw in w's dtype (None unless wanted)."""
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_dw else None
    dx = rms_norm_backward(x, w, rstd, dy, dx=want_dx, dw=dw, dres=dres if want_dx else None)
    return dx, None if dw is None else dw.to(w.dtype)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = rms_norm(x, w, eps, rstd=True)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        return *_norm_grads(x, w, rstd, dy, *ctx.needs_input_grad[:2]), None


def rms_norm_autograd(x, w, eps):
    """y = rms_norm(x, w, eps) (see qmm.rms_norm), differentiable in x and w (qmm's backward kernel)."""
    if _compiling():
        return compile_ops.rms_norm(x, w, eps)
    if not _grad_wanted(x, w):
        return rms_norm(x, w, eps)[0]
    return _RmsNorm.apply(x, w, float(eps))


class _AddRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, w, eps):
        h, y, rstd = add_rms_norm(x, r, w, eps, rstd=True)
        ctx.save_for_backward(h, w, rstd)
        ctx.set_materialize_grads(False)
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        h, w, rstd = ctx.saved_tensors
        want_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if dy is None:
            dx, dw = dh if want_x else None, None
        else:
            dx, dw = _norm_grads(h, w, rstd, dy, want_x, ctx.needs_input_grad[2], dh)
        return dx if ctx.needs_input_grad[0] else None, dx if ctx.needs_input_grad[1] else None, dw, None


def add_rms_norm_autograd(x, r, w, eps):
    """(h, y) = (x + r, rms_norm(x + r, w, eps)) in one pass (see qmm.add_rms_norm), differentiable in x, r and w:
    the gradient reaching h and the norm's meet in one backward kernel, which gives x and r their (one) gradient."""
    if _compiling():
        return compile_ops.add_rms_norm(x, r, w, eps)
    if not _grad_wanted(x, r, w):
        return add_rms_norm(x, r, w, eps)[:2]
    return _AddRmsNorm.apply(x, r, w, float(eps))


class _RmsNormResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = rms_norm(x, w, eps, rstd=True)
        ctx.save_for_backward(x, w, rstd)
        ctx.set_materialize_grads(False)
        return x.view_as(x), y

    @staticmethod
    def backward(ctx, dres, dy):
        x, w, rstd = ctx.saved_tensors
        if dy is None:
            return dres if ctx.needs_input_grad[0] else None, None, None
        return *_norm_grads(x, w, rstd, dy, *ctx.needs_input_grad[:2], dres), None


def rms_norm_residual_autograd(x, w, eps):
    """(x, rms_norm(x, w, eps)) where x goes on as the residual stream beside its norm: the first output is x (a
    view), whose gradient is added to the norm's input gradient in the norm's backward kernel instead of a sum of
    its own. Under torch.compile, x itself and qmm's rms_norm (the compiler fuses the sum)."""
    if _compiling():
        return x, compile_ops.rms_norm(x, w, eps)
    if not _grad_wanted(x, w):
        return x, rms_norm(x, w, eps)[0]
    return _RmsNormResidual.apply(x, w, float(eps))


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)
        return rope(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return (*_impl.rope_grads(lambda a, b: rope(a, b, cos, sin, inverse=True), dq, dk), None, None)


def rope_autograd(q, k, cos, sin):
    """(q_embed, k_embed) = rope(q, k, cos, sin) (see qmm.rope: Hugging Face's apply_rotary_pos_emb), differentiable
    in q and k: the backward rotates the gradients back (the inverse rotation, one launch for both). cos and sin get
    no gradient (Hugging Face's rotary embedding computes them without one). k may be None."""
    if _compiling():
        return compile_ops.rope(q, k, cos, sin)
    if not _grad_wanted(q, k):
        return rope(q, k, cos, sin)
    return _Rope.apply(q, k, cos, sin)
