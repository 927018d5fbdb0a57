"""torch.compile: the differentiable ops as PyTorch custom ops (PyTorch >= 2.4).

torch.compile cannot trace into qmm's C++ calls. As custom ops with shape-only ("fake") implementations and their
backward registered (the backward itself a custom op), they stay whole in a compiled graph: fullgraph=True works,
and the forward and backward run _impl.py's arithmetic, the same kernels as eager calls. Eager calls keep the
autograd.Functions of functional.py: a custom op's dispatch costs several times an autograd.Function's per call.

An NF4 weight enters an op as 8 arguments, its "op args": codes, absmax, absmax2, code2 (None where plain), the
double quantization's offset as a 0-d float64 CPU tensor (a float argument would compile one graph per value, i.e.
per layer; a CPU tensor is read without a device synchronization), rows, cols and block size. Nf4Weight.op_args()
gives them, and patch.py takes them from a bitsandbytes layer directly, so no Python-side lookup runs inside a
traced region. A backward op takes the weight without its offset (saved_weight_of finds the forward's Nf4Weight):
a saved CPU tensor would be an output of the compiled forward, which mode="reduce-overhead" (CUDA graphs) refuses.
An adapter enters as its x_dropped (None: x itself), a and b (None: no adapter) and scale."""
import math
import weakref
from typing import List, Optional, Tuple

import torch

from . import _impl
from ._base import _error
from .nf4 import Nf4Weight
from .ops import nf4_gate_up as _nf4_gate_up
from .ops import nf4_gemm_backward_a, rope_like, swiglu_backward as _swiglu_backward
from .ops import add_rms_norm as _add_rms_norm
from .ops import rms_norm as _rms_norm
from .ops import rms_norm_backward as _rms_norm_backward
from .ops import rope as _rope
from .ops import swiglu as _swiglu

Tensor = torch.Tensor
AVAILABLE = hasattr(torch.library, "custom_op") and hasattr(getattr(torch, "compiler", None), "is_compiling")


def compiling():
    """Whether torch.compile is tracing the caller (never on PyTorch without custom ops: there qmm's calls break
    the graph and run eagerly)."""
    return AVAILABLE and torch.compiler.is_compiling()


# The Nf4Weights of the tensors the custom ops are called with, by the identity of the codes tensor (a compiled
# graph passes a layer's same tensors at every call): making one converts and checks its tensors, which would cost
# more than the call itself. An entry holds a view of the codes, not the tensor it is keyed by, and goes with it.
_weights = {}


def _layout(codes, absmax, absmax2, code2, rows, cols, block_size):
    """What identifies a weight's tensors besides its offset: their data and its shape and block size."""
    return (codes.data_ptr(), *(None if t is None else t.data_ptr() for t in (absmax, absmax2, code2)), rows, cols,
            block_size)


def weight_of(codes, absmax, absmax2, code2, offset, rows, cols, block_size):
    """The Nf4Weight of an op's 8 weight arguments."""
    layout, value = _layout(codes, absmax, absmax2, code2, rows, cols, block_size), offset.item()
    cached = _weights.get(id(codes))
    if cached is not None and cached[0]() is codes and cached[1] == layout and cached[2].offset == value:
        return cached[2]
    w = Nf4Weight(codes.view(codes.shape), absmax, (rows, cols), block_size, absmax2, code2, value)
    key = id(codes)
    try:
        ref = weakref.ref(codes, lambda _, key=key: _weights.pop(key, None))
    except TypeError:  # a tensor type that takes no weak reference: made at every call
        return w
    _weights[key] = (ref, layout, w)
    return w


def saved_weight_of(codes, absmax, absmax2, code2, rows, cols, block_size):
    """The Nf4Weight that weight_of made for these tensors in the forward (a backward op's weight arguments carry no
    offset): by the codes tensor, else by its data (a compiled graph may pass the saved codes as another view)."""
    layout = _layout(codes, absmax, absmax2, code2, rows, cols, block_size)
    cached = _weights.get(id(codes))
    if cached is not None and cached[0]() is codes and cached[1] == layout:
        return cached[2]
    for ref, cached_layout, w in list(_weights.values()):
        if ref() is not None and cached_layout == layout:
            return w
    raise _error("InvalidArgument", "qmm's backward got an NF4 weight whose forward did not run in this process (its "
                                    "tensors were replaced between the forward and the backward?)")


def _op_args(w):
    return w.op_args() if isinstance(w, Nf4Weight) else w


def _or_empty(t, like):
    """An op's optional result: custom ops return tensors, so an absent one travels as an empty tensor."""
    return like.new_empty(0) if t is None else t


def _or_none(t):
    return None if t is None or t.numel() == 0 and t.dim() == 1 else t


def _lora(x, xd, a, b, scale):
    return None if a is None else (x if xd is None else xd, a, b, scale)


def _saved(*adapters, dtype):
    """The tensors _impl's backward takes for each adapter (xs, t, a, b), None where a is None: its working copies
    cast again from a and b, every adapter's in one launch."""
    working = _impl.working_copies([None if a is None else (a, b) for _, _, a, b in adapters], dtype)
    return tuple(None if w is None else (xs.reshape(-1, xs.shape[-1]), t, *w)
                 for (xs, t, _, _), w in zip(adapters, working))


def _grouped(adapters):
    """Whether _impl.linears_forward computes these (xd, a) adapters as one lora_nf4_linears op (its _grouped):
    some a given, and no xd (every adapter reads x)."""
    return any(a is not None for _, a in adapters) and all(xd is None for xd, a in adapters if a is not None)


_WEIGHT_ARGS = ("codes", "absmax", "absmax2", "code2", "offset", "rows", "cols", "block_size")


def _rows_of(x):
    return math.prod(x.shape[:-1])


if AVAILABLE:
    op = torch.library.custom_op

    # ---- one projection: base + bias + adapter -------------------------------------------------------------------

    @op("qmm::lora_nf4_linear", mutates_args=())
    def lora_nf4_linear_op(x: Tensor, xd: Optional[Tensor], a: Optional[Tensor], b: Optional[Tensor],
                           bias: Optional[Tensor], codes: Tensor, absmax: Tensor, absmax2: Optional[Tensor],
                           code2: Optional[Tensor], offset: Tensor, rows: int, cols: int, block_size: int,
                           scale: float, path: str) -> Tuple[Tensor, Tensor]:
        w = weight_of(codes, absmax, absmax2, code2, offset, rows, cols, block_size)
        y, saved = _impl.linear_forward(x, w, bias, _lora(x, xd, a, b, scale), path)
        return y, _or_empty(saved and saved[1], x)

    @lora_nf4_linear_op.register_fake
    def _(x, xd, a, b, bias, codes, absmax, absmax2, code2, offset, rows, cols, block_size, scale, path):
        t = x.new_empty(0) if a is None else x.new_empty((_rows_of(x), a.shape[0]))
        return x.new_empty((*x.shape[:-1], rows)), t

    @op("qmm::lora_nf4_linear_backward", mutates_args=())
    def lora_nf4_linear_backward_op(dy: Tensor, xs: Optional[Tensor], t: Optional[Tensor], a: Optional[Tensor],
                                    b: Optional[Tensor], codes: Tensor, absmax: Tensor, absmax2: Optional[Tensor],
                                    code2: Optional[Tensor], rows: int, cols: int, block_size: int,
                                    scale: float, path: str, dropped: bool, want_dx: bool, want_dxd: bool,
                                    want_da: bool, want_db: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        w = saved_weight_of(codes, absmax, absmax2, code2, rows, cols, block_size)
        x_shape = (*dy.shape[:-1], cols) if xs is None else xs.shape
        grads = _impl.linear_backward(dy, w, path, _saved((xs, t, a, b), dtype=dy.dtype)[0], scale, dropped, x_shape,
                                (want_dx, want_dxd, want_da, want_db))
        return tuple(_or_empty(g, dy) for g in grads)

    @lora_nf4_linear_backward_op.register_fake
    def _(dy, xs, t, a, b, codes, absmax, absmax2, code2, rows, cols, block_size, scale, path, dropped,
          want_dx, want_dxd, want_da, want_db):
        empty = dy.new_empty(0)
        return (dy.new_empty((*dy.shape[:-1], cols)) if want_dx else empty,
                xs.new_empty(xs.shape) if want_dxd and dropped and a is not None else empty,
                a.new_empty(a.shape, dtype=torch.float32) if want_da and a is not None else empty,
                b.new_empty(b.shape, dtype=torch.float32) if want_db and a is not None else empty)

    def _setup_linear(ctx, inputs, output):
        x, xd, a, b, bias = inputs[:5]
        ctx.save_for_backward(None if a is None else x if xd is None else xd, output[1], a, b, bias, *inputs[5:9])
        ctx.w_scalars, ctx.scale, ctx.path, ctx.dropped = inputs[10:13], inputs[13], inputs[14], xd is not None
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def _linear_grad(ctx, dy, _):
        xs, t, a, b, bias, *w_tensors = ctx.saved_tensors
        need = ctx.needs_input_grad
        if dy is None:
            return (None,) * 15
        dx, dxd, da, db = lora_nf4_linear_backward_op(dy, xs, t, a, b, *w_tensors, *ctx.w_scalars, ctx.scale,
                                                      ctx.path, ctx.dropped, *need[:4])
        dbias = _impl.bias_grad(dy, bias) if need[4] else None
        return (_or_none(dx) if need[0] else None, _or_none(dxd) if need[1] else None,
                _impl.param_grad(_or_none(da), a) if need[2] else None,
                _impl.param_grad(_or_none(db), b) if need[3] else None,
                dbias) + (None,) * 10

    lora_nf4_linear_op.register_autograd(_linear_grad, setup_context=_setup_linear)

    # ---- an attention's q, k and v: three projections of one x -----------------------------------------------------

    @op("qmm::lora_nf4_qkv", mutates_args=())
    def lora_nf4_qkv_op(x: Tensor,
                        xd_q: Optional[Tensor], a_q: Optional[Tensor], b_q: Optional[Tensor], bias_q: Optional[Tensor],
                        xd_k: Optional[Tensor], a_k: Optional[Tensor], b_k: Optional[Tensor], bias_k: Optional[Tensor],
                        xd_v: Optional[Tensor], a_v: Optional[Tensor], b_v: Optional[Tensor], bias_v: Optional[Tensor],
                        q_codes: Tensor, q_absmax: Tensor, q_absmax2: Optional[Tensor], q_code2: Optional[Tensor],
                        q_offset: Tensor, q_rows: int, q_cols: int, q_block_size: int,
                        k_codes: Tensor, k_absmax: Tensor, k_absmax2: Optional[Tensor], k_code2: Optional[Tensor],
                        k_offset: Tensor, k_rows: int, k_cols: int, k_block_size: int,
                        v_codes: Tensor, v_absmax: Tensor, v_absmax2: Optional[Tensor], v_code2: Optional[Tensor],
                        v_offset: Tensor, v_rows: int, v_cols: int, v_block_size: int,
                        scale_q: float, scale_k: float, scale_v: float,
                        path: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        args = locals()
        ws = [weight_of(*(args[f"{p}_{n}"] for n in _WEIGHT_ARGS)) for p in "qkv"]
        loras = [_lora(x, args[f"xd_{p}"], args[f"a_{p}"], args[f"b_{p}"], args[f"scale_{p}"]) for p in "qkv"]
        ys, saved = _impl.linears_forward(x, ws, [args[f"bias_{p}"] for p in "qkv"], loras, path)
        if isinstance(saved, _impl.Grouped):  # one t for all three (the backward casts the working copies again)
            return (*ys, saved[1], x.new_empty(0), x.new_empty(0))
        return (*ys, *(_or_empty(s and s[1], x) for s in saved))

    @lora_nf4_qkv_op.register_fake
    def _(x, *args):
        ys = [x.new_empty((*x.shape[:-1], args[17 + 8 * p])) for p in range(3)]
        adapters = [(args[4 * p], args[1 + 4 * p]) for p in range(3)]  # (xd, a)
        if _grouped(adapters):
            rank = sum(a.shape[0] for _, a in adapters if a is not None)
            return (*ys, x.new_empty((_rows_of(x), rank)), x.new_empty(0), x.new_empty(0))
        ts = [x.new_empty(0) if a is None else x.new_empty((_rows_of(x), a.shape[0])) for _, a in adapters]
        return (*ys, *ts)

    @op("qmm::lora_nf4_qkv_backward", mutates_args=())
    def lora_nf4_qkv_backward_op(dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor],
                                 xs_q: Optional[Tensor], xs_k: Optional[Tensor], xs_v: Optional[Tensor],
                                 t_q: Optional[Tensor], t_k: Optional[Tensor], t_v: Optional[Tensor],
                                 a_q: Optional[Tensor], b_q: Optional[Tensor], a_k: Optional[Tensor],
                                 b_k: Optional[Tensor], a_v: Optional[Tensor], b_v: Optional[Tensor],
                                 q_codes: Tensor, q_absmax: Tensor, q_absmax2: Optional[Tensor],
                                 q_code2: Optional[Tensor], q_rows: int, q_cols: int, q_block_size: int,
                                 k_codes: Tensor, k_absmax: Tensor, k_absmax2: Optional[Tensor],
                                 k_code2: Optional[Tensor], k_rows: int, k_cols: int, k_block_size: int,
                                 v_codes: Tensor, v_absmax: Tensor, v_absmax2: Optional[Tensor],
                                 v_code2: Optional[Tensor], v_rows: int, v_cols: int, v_block_size: int,
                                 scale_q: float, scale_k: float, scale_v: float, path: str, dropped: List[bool],
                                 want: List[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                            Tensor, Tensor, Tensor]:
        args = locals()
        ws = [saved_weight_of(*(args[f"{p}_{n}"] for n in _WEIGHT_ARGS if n != "offset")) for p in "qkv"]
        dtype = next(d for d in (dq, dk, dv) if d is not None).dtype
        if _grouped([(dropped[i] or None, args[f"a_{p}"]) for i, p in enumerate("qkv")]):
            xs = next(args[f"xs_{p}"] for p in "qkv" if args[f"xs_{p}"] is not None)
            saved = _impl.regrouped(xs.reshape(-1, xs.shape[-1]), t_q, [
                None if args[f"a_{p}"] is None else (args[f"a_{p}"], args[f"b_{p}"]) for p in "qkv"], dtype)
        else:
            saved = _saved(*((args[f"xs_{p}"], args[f"t_{p}"], args[f"a_{p}"], args[f"b_{p}"]) for p in "qkv"),
                           dtype=dtype)
        dys = (dq, dk, dv)
        like = next(d for d in dys if d is not None)
        dx, grads = _impl.linears_backward(dys, ws, path, saved, (scale_q, scale_k, scale_v), dropped,
                                           (*like.shape[:-1], q_cols), [want[1 + 3 * p:4 + 3 * p] for p in range(3)],
                                           want[0])
        # A custom op's outputs may not alias each other: the grouped backward's da are row blocks of one tensor.
        return (_or_empty(dx, like), *(_or_empty(g if g is None or g._base is None else g.clone(), like)
                                        for projection in grads for g in projection))

    @lora_nf4_qkv_backward_op.register_fake
    def _(dq, dk, dv, xs_q, xs_k, xs_v, t_q, t_k, t_v, a_q, b_q, a_k, b_k, a_v, b_v, *args):
        like = next(d for d in (dq, dk, dv) if d is not None)
        dropped, want, cols = args[-2], args[-1], args[5]
        empty = like.new_empty(0)
        out = [like.new_empty((*like.shape[:-1], cols)) if want[0] else empty]
        for p, (dy, a, b) in enumerate(((dq, a_q, b_q), (dk, a_k, b_k), (dv, a_v, b_v))):
            live = dy is not None and a is not None
            out += [like.new_empty((*like.shape[:-1], cols)) if live and dropped[p] and want[1 + 3 * p] else empty,
                    a.new_empty(a.shape, dtype=torch.float32) if live and want[2 + 3 * p] else empty,
                    b.new_empty(b.shape, dtype=torch.float32) if live and want[3 + 3 * p] else empty]
        return tuple(out)

    def _setup_qkv(ctx, inputs, output):
        x = inputs[0]
        adapters = [inputs[1 + 4 * p:5 + 4 * p] for p in range(3)]  # (xd, a, b, bias) each
        xs = [None if a is None else x if xd is None else xd for xd, a, _, _ in adapters]
        w_tensors = [t for p in range(3) for t in inputs[13 + 8 * p:17 + 8 * p]]
        ctx.save_for_backward(*xs, *output[3:6], *(t for xd, a, b, bias in adapters for t in (a, b, bias)),
                              *w_tensors)
        ctx.w_scalars = [inputs[18 + 8 * p:21 + 8 * p] for p in range(3)]
        ctx.scales, ctx.path = inputs[37:40], inputs[40]
        ctx.dropped = [xd is not None for xd, _, _, _ in adapters]
        ctx.mark_non_differentiable(*output[3:6])
        ctx.set_materialize_grads(False)

    def _qkv_grad(ctx, dq, dk, dv, *_):
        saved = ctx.saved_tensors
        xs, ts, params, w_tensors = saved[0:3], saved[3:6], saved[6:15], saved[15:]
        need = ctx.needs_input_grad
        if dq is None and dk is None and dv is None:
            return (None,) * 41
        want = [need[0]] + [need[i + 4 * p] for p in range(3) for i in (1, 2, 3)]
        weight_args = [a for p in range(3) for a in (*w_tensors[4 * p:4 * p + 4], *ctx.w_scalars[p])]
        ab = [t for p in range(3) for t in params[3 * p:3 * p + 2]]
        grads = [_or_none(g) for g in lora_nf4_qkv_backward_op(dq, dk, dv, *xs, *(_or_none(t) for t in ts), *ab,
                                                               *weight_args, *ctx.scales, ctx.path, ctx.dropped,
                                                               want)]
        out = [grads[0] if need[0] else None]
        for p, dy in enumerate((dq, dk, dv)):
            a, b, bias = params[3 * p:3 * p + 3]
            dxd, da, db = grads[1 + 3 * p:4 + 3 * p]
            out += [dxd if need[1 + 4 * p] else None, _impl.param_grad(da, a) if need[2 + 4 * p] else None,
                    _impl.param_grad(db, b) if need[3 + 4 * p] else None,
                    _impl.bias_grad(dy, bias) if need[4 + 4 * p] and dy is not None else None]
        return tuple(out) + (None,) * 28

    lora_nf4_qkv_op.register_autograd(_qkv_grad, setup_context=_setup_qkv)

    # ---- an MLP's input half: gate and up (+ adapters), SwiGLU ----------------------------------------------------

    @op("qmm::lora_nf4_swiglu", mutates_args=())
    def lora_nf4_swiglu_op(x: Tensor, xd_g: Optional[Tensor], a_g: Optional[Tensor], b_g: Optional[Tensor],
                           xd_u: Optional[Tensor], a_u: Optional[Tensor], b_u: Optional[Tensor],
                           g_codes: Tensor, g_absmax: Tensor, g_absmax2: Optional[Tensor], g_code2: Optional[Tensor],
                           g_offset: Tensor, g_rows: int, g_cols: int, g_block_size: int,
                           u_codes: Tensor, u_absmax: Tensor, u_absmax2: Optional[Tensor], u_code2: Optional[Tensor],
                           u_offset: Tensor, u_rows: int, u_cols: int, u_block_size: int,
                           scale_g: float, scale_u: float, path: str,
                           keep: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        w_gate = weight_of(g_codes, g_absmax, g_absmax2, g_code2, g_offset, g_rows, g_cols, g_block_size)
        w_up = weight_of(u_codes, u_absmax, u_absmax2, u_code2, u_offset, u_rows, u_cols, u_block_size)
        loras = (_lora(x, xd_g, a_g, b_g, scale_g), _lora(x, xd_u, a_u, b_u, scale_u))
        h, gate, up, saved = _impl.swiglu_forward(x, w_gate, w_up, loras, path, keep)
        if isinstance(saved, _impl.Grouped):  # one t for both (the backward casts the working copies again)
            return h, _or_empty(gate, x), _or_empty(up, x), saved[1], x.new_empty(0)
        return (h, _or_empty(gate, x), _or_empty(up, x)) + tuple(_or_empty(s and s[1], x) for s in saved)

    @lora_nf4_swiglu_op.register_fake
    def _(x, xd_g, a_g, b_g, xd_u, a_u, b_u, *args):
        rows, keep = args[5], args[-1]
        h = x.new_empty((*x.shape[:-1], rows))
        kept = [x.new_empty(h.shape) if keep or a_g is not None or a_u is not None else x.new_empty(0)] * 2
        if _grouped(((xd_g, a_g), (xd_u, a_u))):
            rank = sum(a.shape[0] for a in (a_g, a_u) if a is not None)
            ts = [x.new_empty((_rows_of(x), rank)), x.new_empty(0)]
        else:
            ts = [x.new_empty(0) if a is None else x.new_empty((_rows_of(x), a.shape[0])) for a in (a_g, a_u)]
        return (h, x.new_empty(kept[0].shape), x.new_empty(kept[1].shape), *ts)

    @op("qmm::lora_nf4_swiglu_backward", mutates_args=())
    def lora_nf4_swiglu_backward_op(dh: Tensor, gate: Tensor, up: Tensor, xs_g: Optional[Tensor],
                                    xs_u: Optional[Tensor], t_g: Optional[Tensor], t_u: Optional[Tensor],
                                    a_g: Optional[Tensor], b_g: Optional[Tensor], a_u: Optional[Tensor],
                                    b_u: Optional[Tensor],
                                    g_codes: Tensor, g_absmax: Tensor, g_absmax2: Optional[Tensor],
                                    g_code2: Optional[Tensor], g_rows: int, g_cols: int, g_block_size: int,
                                    u_codes: Tensor, u_absmax: Tensor, u_absmax2: Optional[Tensor],
                                    u_code2: Optional[Tensor], u_rows: int, u_cols: int,
                                    u_block_size: int, scale_g: float, scale_u: float, path: str,
                                    dropped_g: bool, dropped_u: bool, want: List[bool]
                                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        w_gate = saved_weight_of(g_codes, g_absmax, g_absmax2, g_code2, g_rows, g_cols, g_block_size)
        w_up = saved_weight_of(u_codes, u_absmax, u_absmax2, u_code2, u_rows, u_cols, u_block_size)
        if _grouped(((dropped_g or None, a_g), (dropped_u or None, a_u))):
            xs = xs_g if xs_g is not None else xs_u
            saved = _impl.regrouped(xs.reshape(-1, xs.shape[-1]), t_g, [
                None if a is None else (a, b) for a, b in ((a_g, b_g), (a_u, b_u))], dh.dtype)
        else:
            saved = _saved((xs_g, t_g, a_g, b_g), (xs_u, t_u, a_u, b_u), dtype=dh.dtype)
        grads = _impl.swiglu_backward(dh, gate, up, w_gate, w_up, path, saved, (scale_g, scale_u),
                                (dropped_g, dropped_u), (*dh.shape[:-1], g_cols), tuple(want))
        return tuple(_or_empty(g if g is None or g._base is None else g.clone(), dh) for g in grads)

    @lora_nf4_swiglu_backward_op.register_fake
    def _(dh, gate, up, xs_g, xs_u, t_g, t_u, a_g, b_g, a_u, b_u, *args):
        cols, dropped, want = args[5], args[-3:-1], args[-1]
        empty = dh.new_empty(0)
        x_shape = (*dh.shape[:-1], cols)

        def param(p, wanted):
            return p.new_empty(p.shape, dtype=torch.float32) if wanted and p is not None else empty
        return (dh.new_empty(x_shape) if want[0] else empty,
                dh.new_empty(x_shape) if want[1] and dropped[0] and a_g is not None else empty,
                dh.new_empty(x_shape) if want[2] and dropped[1] and a_u is not None else empty,
                param(a_g, want[3]), param(b_g, want[4]), param(a_u, want[5]), param(b_u, want[6]))

    def _setup_swiglu_block(ctx, inputs, output):
        x, xd_g, a_g, b_g, xd_u, a_u, b_u = inputs[:7]
        xs = [None if a is None else x if xd is None else xd for xd, a in ((xd_g, a_g), (xd_u, a_u))]
        ctx.save_for_backward(output[1], output[2], *xs, output[3], output[4], a_g, b_g, a_u, b_u,
                              *inputs[7:11], *inputs[15:19])
        ctx.g_scalars, ctx.u_scalars = inputs[12:15], inputs[20:23]
        ctx.scales, ctx.path = inputs[23:25], inputs[25]
        ctx.dropped = (xd_g is not None, xd_u is not None)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    def _swiglu_block_grad(ctx, dh, *_):
        gate, up, xs_g, xs_u, t_g, t_u, a_g, b_g, a_u, b_u, *w_tensors = ctx.saved_tensors
        n = ctx.needs_input_grad  # x, xd_g, a_g, b_g, xd_u, a_u, b_u
        if dh is None:
            return (None,) * 27
        want = (n[0], n[1], n[4], n[2], n[3], n[5], n[6])
        dx, dxd_g, dxd_u, da_g, db_g, da_u, db_u = (_or_none(g) for g in lora_nf4_swiglu_backward_op(
            dh, gate, up, xs_g, xs_u, _or_none(t_g), _or_none(t_u), a_g, b_g, a_u, b_u, *w_tensors[:4],
            *ctx.g_scalars, *w_tensors[4:], *ctx.u_scalars, *ctx.scales, ctx.path, *ctx.dropped, list(want)))
        grads = (dx, dxd_g, _impl.param_grad(da_g, a_g), _impl.param_grad(db_g, b_g), dxd_u,
                 _impl.param_grad(da_u, a_u), _impl.param_grad(db_u, b_u))
        return tuple(g if wanted else None for g, wanted in zip(grads, n[:7])) + (None,) * 20

    lora_nf4_swiglu_op.register_autograd(_swiglu_block_grad, setup_context=_setup_swiglu_block)

    # ---- a whole MLP block: gate and up (+ adapters), SwiGLU, down (+ adapter); h not kept ------------------------

    @op("qmm::lora_nf4_mlp", mutates_args=())
    def lora_nf4_mlp_op(x: Tensor, xd_g: Optional[Tensor], a_g: Optional[Tensor], b_g: Optional[Tensor],
                        xd_u: Optional[Tensor], a_u: Optional[Tensor], b_u: Optional[Tensor],
                        a_d: Optional[Tensor], b_d: Optional[Tensor],
                        g_codes: Tensor, g_absmax: Tensor, g_absmax2: Optional[Tensor], g_code2: Optional[Tensor],
                        g_offset: Tensor, g_rows: int, g_cols: int, g_block_size: int,
                        u_codes: Tensor, u_absmax: Tensor, u_absmax2: Optional[Tensor], u_code2: Optional[Tensor],
                        u_offset: Tensor, u_rows: int, u_cols: int, u_block_size: int,
                        d_codes: Tensor, d_absmax: Tensor, d_absmax2: Optional[Tensor], d_code2: Optional[Tensor],
                        d_offset: Tensor, d_rows: int, d_cols: int, d_block_size: int,
                        scale_g: float, scale_u: float, scale_d: float, path: str,
                        keep: bool, residual: Optional[Tensor]
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        w_gate = weight_of(g_codes, g_absmax, g_absmax2, g_code2, g_offset, g_rows, g_cols, g_block_size)
        w_up = weight_of(u_codes, u_absmax, u_absmax2, u_code2, u_offset, u_rows, u_cols, u_block_size)
        w_down = weight_of(d_codes, d_absmax, d_absmax2, d_code2, d_offset, d_rows, d_cols, d_block_size)
        loras = (_lora(x, xd_g, a_g, b_g, scale_g), _lora(x, xd_u, a_u, b_u, scale_u))
        down = None if a_d is None else (a_d, b_d, scale_d)
        y, kept = _impl.mlp_forward(x, w_gate, w_up, w_down, loras, down, path, keep, residual=residual)
        if kept is None:
            return (y,) + tuple(x.new_empty(0) for _ in range(5))
        gate, up, saved, saved_d = kept
        t_d = _or_empty(saved_d and saved_d[0], x)
        if isinstance(saved, _impl.Grouped):  # one t for both (the backward casts the working copies again)
            return y, _or_empty(gate, x), _or_empty(up, x), saved[1], x.new_empty(0), t_d
        return (y, _or_empty(gate, x), _or_empty(up, x)) + tuple(_or_empty(s and s[1], x) for s in saved) + (t_d,)

    @lora_nf4_mlp_op.register_fake
    def _(x, xd_g, a_g, b_g, xd_u, a_u, b_u, a_d, b_d, *args):
        rows, keep = args[5], args[-2]
        if not keep:
            return (x.new_empty(x.shape),) + tuple(x.new_empty(0) for _ in range(5))
        kept = x.new_empty((*x.shape[:-1], rows))  # keep: gate and up, with or without adapters
        if _grouped(((xd_g, a_g), (xd_u, a_u))):
            rank = sum(a.shape[0] for a in (a_g, a_u) if a is not None)
            ts = [x.new_empty((_rows_of(x), rank)), x.new_empty(0)]
        else:
            ts = [x.new_empty(0) if a is None else x.new_empty((_rows_of(x), a.shape[0])) for a in (a_g, a_u)]
        t_d = x.new_empty(0) if a_d is None else x.new_empty((_rows_of(x), a_d.shape[0]))
        return (x.new_empty(x.shape), kept, x.new_empty(kept.shape), *ts, t_d)

    @op("qmm::lora_nf4_mlp_backward", mutates_args=())
    def lora_nf4_mlp_backward_op(dy: Tensor, gate: Tensor, up: Tensor, xs_g: Optional[Tensor],
                                 xs_u: Optional[Tensor], t_g: Optional[Tensor], t_u: Optional[Tensor],
                                 t_d: Optional[Tensor], a_g: Optional[Tensor], b_g: Optional[Tensor],
                                 a_u: Optional[Tensor], b_u: Optional[Tensor], a_d: Optional[Tensor],
                                 b_d: Optional[Tensor],
                                 g_codes: Tensor, g_absmax: Tensor, g_absmax2: Optional[Tensor],
                                 g_code2: Optional[Tensor], g_rows: int, g_cols: int, g_block_size: int,
                                 u_codes: Tensor, u_absmax: Tensor, u_absmax2: Optional[Tensor],
                                 u_code2: Optional[Tensor], u_rows: int, u_cols: int, u_block_size: int,
                                 d_codes: Tensor, d_absmax: Tensor, d_absmax2: Optional[Tensor],
                                 d_code2: Optional[Tensor], d_rows: int, d_cols: int, d_block_size: int,
                                 scale_g: float, scale_u: float, scale_d: float, path: str,
                                 dropped_g: bool, dropped_u: bool, want: List[bool]
                                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        w_gate = saved_weight_of(g_codes, g_absmax, g_absmax2, g_code2, g_rows, g_cols, g_block_size)
        w_up = saved_weight_of(u_codes, u_absmax, u_absmax2, u_code2, u_rows, u_cols, u_block_size)
        w_down = saved_weight_of(d_codes, d_absmax, d_absmax2, d_code2, d_rows, d_cols, d_block_size)
        if _grouped(((dropped_g or None, a_g), (dropped_u or None, a_u))):
            xs = xs_g if xs_g is not None else xs_u
            saved = _impl.regrouped(xs.reshape(-1, xs.shape[-1]), t_g, [
                None if a is None else (a, b) for a, b in ((a_g, b_g), (a_u, b_u))], dy.dtype)
        else:
            saved = _saved((xs_g, t_g, a_g, b_g), (xs_u, t_u, a_u, b_u), dtype=dy.dtype)
        saved_d = None if a_d is None else (t_d, *_impl.working_copies([(a_d, b_d)], dy.dtype)[0])
        grads = _impl.mlp_backward(dy, gate, up, w_gate, w_up, w_down, path, saved, saved_d,
                                   (scale_g, scale_u, scale_d), (dropped_g, dropped_u), (*dy.shape[:-1], g_cols),
                                   tuple(want))
        return tuple(_or_empty(g if g is None or g._base is None else g.clone(), dy) for g in grads)

    @lora_nf4_mlp_backward_op.register_fake
    def _(dy, gate, up, xs_g, xs_u, t_g, t_u, t_d, a_g, b_g, a_u, b_u, a_d, b_d, *args):
        dropped, want = args[-3:-1], args[-1]
        empty = dy.new_empty(0)

        def param(p, wanted):
            return p.new_empty(p.shape, dtype=torch.float32) if wanted and p is not None else empty
        return (dy.new_empty(dy.shape) if want[0] else empty,
                dy.new_empty(dy.shape) if want[1] and dropped[0] and a_g is not None else empty,
                dy.new_empty(dy.shape) if want[2] and dropped[1] and a_u is not None else empty,
                param(a_g, want[3]), param(b_g, want[4]), param(a_u, want[5]), param(b_u, want[6]),
                param(a_d, want[7]), param(b_d, want[8]))

    def _setup_mlp_block(ctx, inputs, output):
        x, xd_g, a_g, b_g, xd_u, a_u, b_u, a_d, b_d = inputs[:9]
        xs = [None if a is None else x if xd is None else xd for xd, a in ((xd_g, a_g), (xd_u, a_u))]
        ctx.save_for_backward(output[1], output[2], *xs, output[3], output[4], output[5], a_g, b_g, a_u, b_u, a_d,
                              b_d, *inputs[9:13], *inputs[17:21], *inputs[25:29])
        ctx.g_scalars, ctx.u_scalars, ctx.d_scalars = inputs[14:17], inputs[22:25], inputs[30:33]
        ctx.scales, ctx.path = inputs[33:36], inputs[36]
        ctx.dropped = (xd_g is not None, xd_u is not None)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    def _mlp_block_grad(ctx, dy, *_):
        gate, up, xs_g, xs_u, t_g, t_u, t_d, a_g, b_g, a_u, b_u, a_d, b_d, *w = ctx.saved_tensors
        n = ctx.needs_input_grad  # x, xd_g, a_g, b_g, xd_u, a_u, b_u, a_d, b_d, ..., residual (the last)
        if dy is None:
            return (None,) * 39
        want = (n[0], n[1], n[4], n[2], n[3], n[5], n[6], n[7], n[8])
        dx, dxd_g, dxd_u, da_g, db_g, da_u, db_u, da_d, db_d = (_or_none(g) for g in lora_nf4_mlp_backward_op(
            dy, gate, up, xs_g, xs_u, _or_none(t_g), _or_none(t_u), _or_none(t_d), a_g, b_g, a_u, b_u, a_d, b_d,
            *w[:4], *ctx.g_scalars, *w[4:8], *ctx.u_scalars, *w[8:], *ctx.d_scalars, *ctx.scales, ctx.path,
            *ctx.dropped, list(want)))
        grads = (dx, dxd_g, _impl.param_grad(da_g, a_g), _impl.param_grad(db_g, b_g), dxd_u,
                 _impl.param_grad(da_u, a_u), _impl.param_grad(db_u, b_u), _impl.param_grad(da_d, a_d),
                 _impl.param_grad(db_d, b_d))
        return tuple(g if wanted else None for g, wanted in zip(grads, n[:9])) + (None,) * 29 + \
            (dy if n[38] else None,)

    lora_nf4_mlp_op.register_autograd(_mlp_block_grad, setup_context=_setup_mlp_block)

    # ---- the head and its cross-entropy ---------------------------------------------------------------------------

    @op("qmm::linear_cross_entropy", mutates_args=())
    def linear_cross_entropy_op(h: Tensor, w: Tensor, labels: Tensor, ignore_index: int, want_dh: bool,
                                want_dw: bool, chunk_tokens: int, check_labels: bool,
                                chunk_vocab: int) -> Tuple[Tensor, Tensor, Tensor]:
        loss, dh, dw = _impl.cross_entropy(h, w, labels, ignore_index, want_dh, want_dw, chunk_tokens, check_labels,
                                           chunk_vocab)
        return loss, _or_empty(dh, h), _or_empty(dw, h)

    @linear_cross_entropy_op.register_fake
    def _(h, w, labels, ignore_index, want_dh, want_dw, chunk_tokens, check_labels, chunk_vocab):
        return (h.new_empty((), dtype=torch.float32), h.new_empty(h.shape) if want_dh else h.new_empty(0),
                w.new_empty(w.shape, dtype=torch.float32) if want_dw else h.new_empty(0))

    def _setup_cross_entropy(ctx, inputs, output):
        ctx.save_for_backward(output[1], output[2])
        ctx.want, ctx.w_dtype = inputs[4:6], inputs[1].dtype
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.set_materialize_grads(False)

    def _cross_entropy_grad(ctx, grad, *_):
        dh, dw = ctx.saved_tensors
        if grad is None:
            return (None,) * 9
        return _impl.cross_entropy_grads(dh if ctx.want[0] else None, dw if ctx.want[1] else None, grad,
                                         ctx.w_dtype) + (None,) * 7

    linear_cross_entropy_op.register_autograd(_cross_entropy_grad, setup_context=_setup_cross_entropy)

    # ---- RMSNorm ----------------------------------------------------------------------------------------------------

    @op("qmm::rms_norm", mutates_args=())
    def rms_norm_op(x: Tensor, w: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
        return _rms_norm(x, w, eps, rstd=True)

    @rms_norm_op.register_fake
    def _(x, w, eps):
        return x.new_empty(x.shape), x.new_empty((_rows_of(x),), dtype=torch.float32)

    @op("qmm::rms_norm_backward", mutates_args=())
    def rms_norm_backward_op(x: Tensor, w: Tensor, rstd: Tensor, dy: Tensor, dres: Optional[Tensor], want_dx: bool,
                             want_dw: bool) -> Tuple[Tensor, Tensor]:
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_dw else None
        dx = _rms_norm_backward(x, w, rstd, dy, dx=want_dx, dw=dw, dres=dres if want_dx else None)
        return _or_empty(dx, x), x.new_empty(0) if dw is None else dw.to(w.dtype)

    @rms_norm_backward_op.register_fake
    def _(x, w, rstd, dy, dres, want_dx, want_dw):
        return x.new_empty(x.shape) if want_dx else x.new_empty(0), w.new_empty(w.shape) if want_dw else x.new_empty(0)

    def _setup_rms_norm(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def _rms_norm_grad(ctx, dy, _):
        x, w, rstd = ctx.saved_tensors
        want = ctx.needs_input_grad[:2]
        if dy is None or not any(want):
            return None, None, None
        dx, dw = rms_norm_backward_op(x, w, rstd, dy, None, want[0], want[1])
        return _or_none(dx) if want[0] else None, _or_none(dw) if want[1] else None, None

    rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_setup_rms_norm)

    @op("qmm::add_rms_norm", mutates_args=())
    def add_rms_norm_op(x: Tensor, r: Tensor, w: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
        return _add_rms_norm(x, r, w, eps, rstd=True)

    @add_rms_norm_op.register_fake
    def _(x, r, w, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty((_rows_of(x),), dtype=torch.float32)

    def _setup_add_rms_norm(ctx, inputs, output):
        ctx.save_for_backward(output[0], inputs[2], output[2])
        ctx.mark_non_differentiable(output[2])
        ctx.set_materialize_grads(False)

    def _add_rms_norm_grad(ctx, dh, dy, _):
        h, w, rstd = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0] or ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx = dw = None
        if dy is None:
            dx = dh if want_x else None
        elif want_x or want_w:
            dx, dw = rms_norm_backward_op(h, w, rstd, dy, dh, want_x, want_w)
            dx, dw = _or_none(dx) if want_x else None, _or_none(dw) if want_w else None
        return dx if ctx.needs_input_grad[0] else None, dx if ctx.needs_input_grad[1] else None, dw, None

    add_rms_norm_op.register_autograd(_add_rms_norm_grad, setup_context=_setup_add_rms_norm)

    # ---- gate and up alone, and the SwiGLU alone ------------------------------------------------------------------

    @op("qmm::nf4_gate_up", mutates_args=())
    def nf4_gate_up_op(x: Tensor, g_codes: Tensor, g_absmax: Tensor, g_absmax2: Optional[Tensor],
                       g_code2: Optional[Tensor], g_offset: Tensor, g_rows: int, g_cols: int, g_block_size: int,
                       u_codes: Tensor, u_absmax: Tensor, u_absmax2: Optional[Tensor], u_code2: Optional[Tensor],
                       u_offset: Tensor, u_rows: int, u_cols: int, u_block_size: int,
                       path: str) -> Tuple[Tensor, Tensor]:
        w_gate = weight_of(g_codes, g_absmax, g_absmax2, g_code2, g_offset, g_rows, g_cols, g_block_size)
        w_up = weight_of(u_codes, u_absmax, u_absmax2, u_code2, u_offset, u_rows, u_cols, u_block_size)
        gate, up, _ = _nf4_gate_up(x, w_gate, w_up, h=False, path=path)
        return gate, up

    @nf4_gate_up_op.register_fake
    def _(x, *args):
        rows = args[5]  # g_rows
        return x.new_empty((*x.shape[:-1], rows)), x.new_empty((*x.shape[:-1], rows))

    @op("qmm::nf4_input_grad", mutates_args=())
    def nf4_input_grad_op(dy: Tensor, codes: Tensor, absmax: Tensor, absmax2: Optional[Tensor],
                          code2: Optional[Tensor], rows: int, cols: int, block_size: int, path: str) -> Tensor:
        return nf4_gemm_backward_a(dy, saved_weight_of(codes, absmax, absmax2, code2, rows, cols, block_size),
                                   path=path)

    @nf4_input_grad_op.register_fake
    def _(dy, codes, absmax, absmax2, code2, rows, cols, block_size, path):
        return dy.new_empty((*dy.shape[:-1], cols))

    def _setup_gate_up(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:5], *inputs[9:13])
        ctx.g_scalars, ctx.u_scalars, ctx.path = inputs[6:9], inputs[14:17], inputs[17]

    def _gate_up_grad(ctx, dgate, dup):
        saved = ctx.saved_tensors
        g_args, u_args = (*saved[:4], *ctx.g_scalars), (*saved[4:], *ctx.u_scalars)
        grads = [nf4_input_grad_op(d, *w_args, ctx.path) for d, w_args in ((dgate, g_args), (dup, u_args))
                 if d is not None]
        return (sum(grads[1:], grads[0]) if grads else None,) + (None,) * 17

    nf4_gate_up_op.register_autograd(_gate_up_grad, setup_context=_setup_gate_up)

    @op("qmm::swiglu", mutates_args=())
    def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
        return _swiglu(gate, up)

    @swiglu_op.register_fake
    def _(gate, up):
        return torch.empty_like(gate)

    @op("qmm::swiglu_backward", mutates_args=())
    def swiglu_backward_op(gate: Tensor, up: Tensor, dh: Tensor) -> Tuple[Tensor, Tensor]:
        return _swiglu_backward(gate, up, dh)

    @swiglu_backward_op.register_fake
    def _(gate, up, dh):
        return torch.empty_like(gate), torch.empty_like(up)

    def _setup_swiglu(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _swiglu_grad(ctx, dh):
        return swiglu_backward_op(*ctx.saved_tensors, dh)

    swiglu_op.register_autograd(_swiglu_grad, setup_context=_setup_swiglu)

    # ---- rotary position embedding ------------------------------------------------------------------------------

    @op("qmm::rope", mutates_args=())
    def rope_op(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, inverse: bool) -> Tuple[Tensor, Tensor]:
        q_embed, k_embed = _rope(q, k, cos, sin, inverse=inverse)
        return q_embed, _or_empty(k_embed, q)

    @rope_op.register_fake
    def _(q, k, cos, sin, inverse):
        return rope_like(q, cos), q.new_empty(0) if k is None else rope_like(k, cos)

    def _setup_rope(ctx, inputs, output):
        ctx.save_for_backward(inputs[2], inputs[3])
        ctx.has_k = inputs[1] is not None
        ctx.set_materialize_grads(False)

    def _rope_grad(ctx, dq, dk):
        cos, sin = ctx.saved_tensors

        def rotate_back(a, b):
            da, db = rope_op(a, b, cos, sin, True)
            return da, _or_none(db)
        return (*_impl.rope_grads(rotate_back, dq, dk if ctx.has_k else None), None, None, None)

    rope_op.register_autograd(_rope_grad, setup_context=_setup_rope)


# ---- what functional.py calls while torch.compile traces ------------------------------------------------------


def lora_nf4_linear(x, w, lora, bias, path):
    """lora: the (x_dropped or x, a, b, scale) of functional._check_lora, or None."""
    xd, a, b, scale = (None, None, None, 1.0) if lora is None else lora
    return lora_nf4_linear_op(x, None if xd is x else xd, a, b, bias, *_op_args(w), scale, path)[0]


def lora_nf4_qkv(x, weights, loras, biases, path):
    """Three projections of x (an attention's q, k and v) as one op: loras as lora_nf4_linear's, biases or None."""
    args = []
    for lora, bias in zip(loras, biases):
        xd, a, b, _ = (None, None, None, 1.0) if lora is None else lora
        args += [None if xd is x else xd, a, b, bias]
    weight_args = [a for w in weights for a in _op_args(w)]
    scales = [1.0 if lora is None else lora[3] for lora in loras]
    return lora_nf4_qkv_op(x, *args, *weight_args, *scales, path)[:3]


def lora_nf4_swiglu(x, w_gate, w_up, loras, path):
    args, scales = [], []
    for lora in loras:
        xd, a, b, scale = (None, None, None, 1.0) if lora is None else lora
        args += [None if xd is x else xd, a, b]
        scales.append(scale)
    keep = torch.is_grad_enabled()
    return lora_nf4_swiglu_op(x, *args, *_op_args(w_gate), *_op_args(w_up), *scales, path, keep)[0]


def lora_nf4_mlp(x, w_gate, w_up, w_down, loras, down, path, residual=None):
    """loras as lora_nf4_swiglu's; down: (a, b, scale) of the down projection's adapter (reading h), or None;
    residual: added to the block's output (its gradient is the output's)."""
    args, scales = [], []
    for lora in loras:
        xd, a, b, scale = (None, None, None, 1.0) if lora is None else lora
        args += [None if xd is x else xd, a, b]
        scales.append(scale)
    a_d, b_d, scale_d = (None, None, 1.0) if down is None else down
    keep = torch.is_grad_enabled()
    return lora_nf4_mlp_op(x, *args, a_d, b_d, *_op_args(w_gate), *_op_args(w_up), *_op_args(w_down), *scales,
                           scale_d, path, keep, residual)[0]


def linear_cross_entropy(h, w, labels, ignore_index, chunk_tokens=0, check_labels=True, chunk_vocab=0):
    want = torch.is_grad_enabled()
    return linear_cross_entropy_op(h, w, labels, ignore_index, want and h.requires_grad,
                                   want and w.requires_grad, chunk_tokens, check_labels, chunk_vocab)[0]


def rms_norm(x, w, eps):
    return rms_norm_op(x, w, float(eps))[0]


def add_rms_norm(x, r, w, eps):
    h, y, _ = add_rms_norm_op(x, r, w, float(eps))
    return h, y


def nf4_gate_up(x, w_gate, w_up, path):
    return nf4_gate_up_op(x, *_op_args(w_gate), *_op_args(w_up), path)


def swiglu(gate, up):
    return swiglu_op(gate, up)


def rope(q, k, cos, sin):
    q_embed, k_embed = rope_op(q, k, cos, sin, False)
    return q_embed, None if k is None else k_embed
