"""The arithmetic of the differentiable NF4 ops, forward and backward, on qmm's kernels. The eager autograd
functions (functional.py) and the torch.compile custom ops (compile_ops.py) both call these, so compiled and eager
runs launch the same kernels in the same order and agree bit for bit.

An adapter enters as `lora = (xd, a, b, scale)`: xd the adapter's input (x, or dropout(x) computed by PyTorch), a
[r, K] and b [N, r] its trainable matrices (PEFT keeps them in float32). Its products run in x's dtype (bf16 products
with fp32 sums for bf16 activations) on working copies a_w, b_w; y = base + scale * (xd @ a_w^T) @ b_w^T, the LoRA
sum added in the second GEMM's epilogue (beta = 1), after the NF4 base product as the C++ LoraLinear does for NF4
bases. The backward reads dy once for dt = scale * dy @ b_w and grad_b (lora_backward_dy)."""
import torch

from . import _copies, _qmm
from ._base import _call, _in, _rows, _to_dlpack
from .ops import (cast, gemm, gemm_backward_b, gemm_bt, linear_cross_entropy, lora_backward_dy, nf4_gate_up,
                  nf4_gemm_backward_a, swiglu)
from .ops import swiglu_backward as _swiglu_backward


def _flat(t):
    return t.reshape(-1, t.shape[-1])


def param_grad(grad, like):
    """An adapter's float32 gradient in its parameter's dtype (None stays None)."""
    return None if grad is None else grad.to(like.dtype)


def bias_grad(dy, bias):
    """The bias's gradient: dy summed over its rows in fp32, in the bias's dtype."""
    return _flat(dy).sum(0, dtype=torch.float32).to(bias.dtype)


def working_copies(pairs, dtype):
    """Each adapter's (a, b) in dtype, for its products (None, no adapter, stays None): a matrix already in dtype as
    it is, every other one of all the pairs cast in one launch."""
    copies = iter(cast([m for p in pairs if p is not None for m in p if m.dtype != dtype], dtype))
    return [None if p is None else tuple(m if m.dtype == dtype else next(copies) for m in p) for p in pairs]


def _adapter_first(lora, a_w, b_w):
    """An adapter's first product t = xd @ a_w^T (a_w, b_w the working copies of its a and b); returns what the
    backward needs: (xd as rows, t, a_w, b_w)."""
    xd2 = _flat(lora[0])
    return xd2, gemm_bt(xd2, a_w), a_w, b_w


def _adapter_grads(dy2, saved, scale, want_a, want_b):
    """dt = scale * dy @ b_w, and the float32 gradients of a and b (None where not wanted)."""
    xd2, t, a_w, b_w = saved
    grad_b = torch.empty(b_w.shape, dtype=torch.float32, device=dy2.device)
    dt = lora_backward_dy(dy2, b_w, t, grad_b, scale=scale, beta=0.0)
    grad_a = gemm_backward_b(dt, xd2, out_dtype=torch.float32) if want_a else None
    return dt, grad_a, grad_b if want_b else None


def _adapter_input_grad(dt, a_w, dx, dropped, want_dxd, xd_shape):
    """The adapter's term of the input gradient: added into dx (its input is x), or returned apart (its input is
    dropout(x): PyTorch's dropout backward applies the mask)."""
    if not dropped:
        if dx is not None:
            gemm(dt, a_w, out=_flat(dx), beta=1.0)
        return None
    return gemm(dt, a_w).view(xd_shape) if want_dxd else None


def _pairs(loras):
    return [None if lora is None else lora[1:3] for lora in loras]


def _cached(loras, dtype, stacked, cached):
    """The adapters' working copies from _copies (see there) where `cached` (the eager ops), else None."""
    return _copies.get(_pairs(loras), dtype, stacked) if cached else None


def _working(loras, dtype, cached):
    """Each adapter's (a_w, b_w) in dtype (None without one): from _copies where cached, else cast here."""
    return _cached(loras, dtype, False, cached) or working_copies(_pairs(loras), dtype)


def linear_forward(x, w, bias, lora, path, cached=False, residual=None):
    """y = x @ dequant(W)^T (+ bias) (+ the adapter) (+ residual), the NF4 product and the adapter's casts and
    products in one binding call. The bias is written first and the NF4 product accumulates onto it (beta = 1): one
    rounding of base + bias, as a linear layer's bias epilogue. A residual (y's shape and x's dtype) rides in the
    adapter's second product as its GEMM's addend (written into y first where there is no adapter or a bias). Returns
    y and the adapter's saved tensors (None without one). cached: the adapter's working copies come from _copies
    (one cast a forward), not from this call."""
    n, k = w.shape
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if bias is not None:
        y.copy_(bias.to(x.dtype).expand_as(y))
    before = residual is not None and (lora is None or bias is not None)  # written into y, not the addend
    if before and bias is not None:
        y.add_(residual)
    elif before:
        y.copy_(residual)
    op = "lora_nf4_linear"
    x2, y2 = _rows(op, "x", x, k), y.view(-1, n)
    beta = 1.0 if bias is not None or before else 0.0
    if lora is None:
        _call(_qmm.lora_nf4_linear_forward, x2, x2, w._native, y2, beta, path, None, None, None, None, None, None,
              1.0)
        return y, None
    xd, a, b, scale = lora
    copies = _cached([lora], x.dtype, False, cached)
    if copies is not None:
        a, b = copies[0]
    xd2 = None if xd is x else _rows(op, "xd", xd, k)
    a, b = _in(a), _in(b)
    a_w, b_w = ((None, None) if a.dtype == x.dtype else
                (torch.empty(a.shape, dtype=x.dtype, device=x.device), torch.empty(b.shape, dtype=x.dtype,
                                                                                    device=x.device)))
    t = torch.empty((x2.shape[0], a.shape[0]), dtype=x.dtype, device=x.device)
    _call(_qmm.lora_nf4_linear_forward, x2, x2, w._native, y2, beta, path, xd2, a, b, a_w, b_w, t, float(scale),
          None if residual is None or before else _flat(_in(residual)))
    return y, (x2 if xd2 is None else xd2, t, a if a_w is None else a_w, b if b_w is None else b_w)


def linear_backward(dy, w, path, saved, scale, dropped, xd_shape, want, dx=None):
    """Gradients (dx, dxd, da, db) of linear_forward for want = (dx, dxd, da, db) flags, None where not wanted; the
    NF4 input gradient and the adapter's products in one binding call. A given dx (want's dx set) is added into:
    the input gradient of several projections of one input, summed where it is computed."""
    want_dx, want_dxd, want_a, want_b = want
    n, k = w.shape
    dy2 = _flat(dy) if dy.is_contiguous() else _flat(dy.contiguous())
    dx_beta = 0.0 if dx is None else 1.0
    if dx is None and want_dx:
        dx = torch.empty((*dy.shape[:-1], k), dtype=dy.dtype, device=dy.device)
    dx2 = dx.view(-1, k) if want_dx else None
    if saved is None:
        if want_dx:
            _call(_qmm.lora_nf4_linear_backward, dy2, dy2, w._native, path, dx2, None, None, None, None, 1.0, None,
                  None, None, False, None, dx_beta)
        return dx, None, None, None
    xs, t, a_w, b_w = saved
    dt = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    grad_b = torch.empty(b_w.shape, dtype=torch.float32, device=dy.device)  # written by the op
    grad_a = torch.empty(a_w.shape, dtype=torch.float32, device=dy.device) if want_a else None
    dxd = torch.empty(xd_shape, dtype=dy.dtype, device=dy.device) if dropped and want_dxd else None
    _call(_qmm.lora_nf4_linear_backward, dy2, dy2, w._native, path, dx2, xs, t, a_w, b_w, float(scale), dt, grad_a,
          grad_b, dropped, None if dxd is None else dxd.view(-1, k), dx_beta)
    return dx, dxd, grad_a, grad_b if want_b else None


class Grouped(tuple):
    """What the backward of projections computed as one lora_nf4_linears op takes: (x as rows, t [M, R], a stacked
    [R, K], then each projection's b in x's dtype, None without an adapter)."""


def _grouped(x, loras):
    """Whether lora_nf4_linears takes these projections as one op: some have an adapter and every adapter reads x
    itself (no dropout: a dropped-out input differs per projection)."""
    return any(lora is not None for lora in loras) and all(lora is None or lora[0] is x for lora in loras)


def linears_forward(x, ws, biases, loras, path, cached=False):
    """linear_forward for several projections of one input (an attention's q, k and v). Where every adapter reads x
    itself, one lora_nf4_linears call: the adapters' working copies in one launch, a's stacked, their first
    products as one GEMM, and every base product's dequantization in one launch; the saved tensors a Grouped.
    Otherwise every adapter's working copies in one launch, then each projection as linear_forward computes it,
    and a list of each projection's saved tensors. Returns the outputs and the saved tensors. cached as
    linear_forward takes it."""
    if _grouped(x, loras):
        return _grouped_forward(x, ws, biases, loras, path, cached)
    working = _working(loras, x.dtype, cached)
    done = [linear_forward(x, w, bias, None if lora is None else (lora[0], *copies, lora[3]), path)
            for w, bias, lora, copies in zip(ws, biases, loras, working)]
    return [y for y, _ in done], [saved for _, saved in done]


def _stacking(x, loras, cached=False):
    """The binding arguments that stack these adapters of x (lora_nf4_linears_forward, lora_adapters_forward): each
    a and b as qmm takes them, b's working copy where b is not in x's dtype (else None), a_all [R, K] and t [M, R]
    to be written. Returns (as_, bs, b_ws, a_all, t, scales). With copies from _copies (cached), a_all holds every
    a already and each a is its rows there (which the binding's cast skips), each b its copy."""
    copies = _cached(loras, x.dtype, True, cached)
    if copies is None:
        as_ = [None if lora is None else _in(lora[1]) for lora in loras]
        bs = [None if lora is None else _in(lora[2]) for lora in loras]
        b_ws = [None if b is None or b.dtype == x.dtype else torch.empty(b.shape, dtype=x.dtype, device=x.device)
                for b in bs]
        rank = sum(a.shape[0] for a in as_ if a is not None)
        a_all = torch.empty((rank, x.shape[-1]), dtype=x.dtype, device=x.device)
    else:
        a_all, bs = copies[0], [None if b is None else _in(b) for b in copies[1]]
        as_, row = [], 0
        for lora in loras:
            as_.append(None if lora is None else a_all[row:row + lora[1].shape[0]])
            row += 0 if lora is None else lora[1].shape[0]
        b_ws = [None] * len(loras)
    t = torch.empty((x.numel() // x.shape[-1], a_all.shape[0]), dtype=x.dtype, device=x.device)
    scales = [1.0 if lora is None else float(lora[3]) for lora in loras]
    return as_, bs, b_ws, a_all, t, scales


def _grouped_saved(x2, stacking):
    as_, bs, b_ws, a_all, t, _ = stacking
    return Grouped((x2, t, a_all, *(b if bw is None else bw for b, bw in zip(bs, b_ws))))


def _grouped_forward(x, ws, biases, loras, path, cached):
    op = "lora_nf4_linears"
    x2 = _rows(op, "x", x, ws[0].shape[1])
    ys = [torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device) for w in ws]
    # The biases go to the op, whose GEMMs add them before they round (a linear layer's bias epilogue).
    biases = [None if bias is None else _in(bias.to(x.dtype)) for bias in biases]
    stacking = _stacking(x, loras, cached)
    _call(_qmm.lora_nf4_linears_forward, x2, x2, [w._native for w in ws], [y.view(-1, y.shape[-1]) for y in ys],
          [0.0] * len(ws), biases, *stacking[:3], stacking[5], *stacking[3:5], path)
    return ys, _grouped_saved(x2, stacking)


def _per_adapter(bs, grad_a, grad_bs, wants, skip):
    """Each adapter's (da, db) from the stacked grad_a (its rows, in order) and its grad_b; (None, None) without an
    adapter, None where not wanted (wants: (want_da, want_db) each) or skipped."""
    out, row = [], 0
    for b, gb, (want_da, want_db), s in zip(bs, grad_bs, wants, skip):
        if b is None:
            out.append((None, None))
            continue
        out.append((grad_a[row:row + b.shape[1]] if want_da and not s else None, gb if want_db and not s else None))
        row += b.shape[1]
    return out


def regrouped(x2, t, pairs, dtype):
    """The Grouped saved tensors of a grouped forward from its x rows, its t and the adapters' (a, b) pairs (None:
    no adapter): the working copies made again as the forward made them, every one in one launch."""
    srcs, dsts, bs = [], [], []
    rank = sum(p[0].shape[0] for p in pairs if p is not None)
    a_all = torch.empty((rank, x2.shape[1]), dtype=dtype, device=x2.device)
    row = 0
    for p in pairs:
        if p is None:
            bs.append(None)
            continue
        a, b = _in(p[0]), _in(p[1])
        srcs.append(a)
        dsts.append(a_all[row:row + a.shape[0]])
        row += a.shape[0]
        if b.dtype != dtype:
            srcs.append(b)
            dsts.append(torch.empty(b.shape, dtype=dtype, device=b.device))
            b = dsts[-1]
        bs.append(b)
    _call(_qmm.cast, x2, [_to_dlpack(m) for m in srcs], [_to_dlpack(m) for m in dsts])
    return Grouped((x2, t, a_all, *bs))


def linears_backward(dys, ws, path, saved, scales, dropped, x_shape, wants, want_dx):
    """Gradients of linears_forward: dx (the projections' input gradients summed into one tensor, each added by its
    own NF4 product: no separate sum), then per projection (dxd, da, db) for its wants = (dxd, da, db) flags. A
    projection whose output has no gradient (dy None) adds nothing."""
    if isinstance(saved, Grouped):
        return _grouped_backward(dys, ws, path, saved, scales, x_shape, wants, want_dx)
    dx, grads = None, []
    for dy, w, s, scale, drop, want in zip(dys, ws, saved, scales, dropped, wants):
        if dy is None:
            grads.append((None, None, None))
            continue
        dx, dxd, da, db = linear_backward(dy, w, path, s, scale, drop, x_shape, (want_dx, *want), dx)
        grads.append((dxd, da, db))
    return dx, grads


def _grouped_backward(dys, ws, path, saved, scales, x_shape, wants, want_dx):
    x2, t, a_all, *bs = saved
    like = next(dy for dy in dys if dy is not None)
    adapters = [b is not None for b in bs]
    # An adapter whose output had no gradient: zeros for the stacked products, and no gradient for its parameters
    # (None, as the per-projection path returns: an optimizer then leaves them alone).
    unused = [have and dy is None for have, dy in zip(adapters, dys)]
    if any(unused):
        dys = [torch.zeros((*like.shape[:-1], w.shape[0]), dtype=like.dtype, device=like.device) if skip else dy
               for dy, w, skip in zip(dys, ws, unused)]
    dys = [None if dy is None else _flat(dy if dy.is_contiguous() else dy.contiguous()) for dy in dys]
    dev = like.device
    dx = torch.empty(x_shape, dtype=like.dtype, device=dev) if want_dx else None
    dt = torch.empty(t.shape, dtype=t.dtype, device=dev)
    want_a = any(want[1] for want, have in zip(wants, adapters) if have)
    grad_a = torch.empty(a_all.shape, dtype=torch.float32, device=dev) if want_a else None
    grad_bs = [torch.empty(b.shape, dtype=torch.float32, device=dev) if b is not None else None for b in bs]
    _call(_qmm.lora_nf4_linears_backward, x2, x2, [w._native for w in ws], dys, bs, [float(s) for s in scales],
          grad_bs, a_all, t, dt, grad_a, None if dx is None else dx.view(-1, x_shape[-1]), 0.0, path)
    pairs = _per_adapter(bs, grad_a, grad_bs, [want[1:] for want in wants], unused)
    return dx, [(None, da, db) for da, db in pairs]


# Ranks up to this go through swiglu's adapters on a GPU (the tensor-core kernel; larger ones would take its
# element-a-thread kernel, slower than the second products' GEMMs).
SWIGLU_TERMS_MAX_RANK = 32


def _swiglu_terms(saved, scales):
    """swiglu's adapters for a gate/up pair's saved tensors (a Grouped, or each adapter's (xd, t, a_w, b_w) or
    None), where the adapters' second products are left to the SwiGLU kernel (gate and up then hold the base
    products only): on the CPU always, on a GPU for bf16 with ranks up to SWIGLU_TERMS_MAX_RANK. None where the
    second products run as GEMMs (or there is no adapter). The forward and the backward decide alike from the same
    saved tensors. Separate adapters' t (dropout gives each its own input) are joined into one [M, r_g + r_u]."""
    if isinstance(saved, Grouped):
        _, t, _, b_gate, b_up = saved
    else:
        if all(s is None for s in saved):
            return None
        ts = [s[1] for s in saved if s is not None]
        t = ts[0] if len(ts) == 1 else None
        b_gate, b_up = (None if s is None else s[3] for s in saved)
    like = t if t is not None else saved[0][1]
    if like.is_cuda and (like.dtype != torch.bfloat16 or
                         any(b is not None and b.shape[1] > SWIGLU_TERMS_MAX_RANK for b in (b_gate, b_up))):
        return None
    if t is None:
        t = torch.cat([saved[0][1], saved[1][1]], dim=1)
    return (t, b_gate, float(scales[0]), b_up, float(scales[1]))


def swiglu_forward(x, w_gate, w_up, loras, path, keep, cached=False):
    """h = silu(gate) * up, gate = x @ dequant(Wg)^T (+ its adapter), up likewise, both base products from one read
    of x (nf4_gate_up). Returns h, gate and up (kept for the backward: None unless `keep` or an adapter needs
    them) and the adapters' saved tensors: a Grouped where every adapter reads x (their first products then run as
    one GEMM, lora_adapters), else each adapter's. Without adapters the SwiGLU runs in the gate/up kernel's
    epilogue. cached as linear_forward takes it."""
    if loras[0] is None and loras[1] is None:
        gate, up, h = nf4_gate_up(x, w_gate, w_up, gate=keep, up=keep, path=path)
        return h, gate, up, (None, None)
    gate, up, _ = nf4_gate_up(x, w_gate, w_up, h=False, path=path)
    if _grouped(x, loras):  # both adapters' first products as one GEMM (lora_adapters)
        x2 = _flat(x)
        stacking = _stacking(x, loras, cached)
        saved = _grouped_saved(x2, stacking)
        terms = _swiglu_terms(saved, stacking[5])
        _call(_qmm.lora_adapters_forward, x2, x2, [_flat(gate), _flat(up)], *stacking[:3], stacking[5],
              *stacking[3:5], second_products=terms is None)
        if terms is None:
            return swiglu(gate, up), gate, up, saved
        return swiglu(_flat(gate), _flat(up), adapters=terms).view(gate.shape), gate, up, saved
    working = _working(loras, x.dtype, cached)
    saved = tuple(None if lora is None else _adapter_first(lora, *w) for lora, w in zip(loras, working))
    terms = _swiglu_terms(saved, [1.0 if lora is None else lora[3] for lora in loras])
    if terms is None:
        for y, lora, s in zip((gate, up), loras, saved):
            if s is not None:
                gemm_bt(s[1], s[3], out=_flat(y), alpha=lora[3], beta=1.0)
        return swiglu(gate, up), gate, up, saved
    return swiglu(_flat(gate), _flat(up), adapters=terms).view(gate.shape), gate, up, saved


def swiglu_backward(dh, gate, up, w_gate, w_up, path, saved, scales, dropped, xd_shape, want, dh_term=None,
                    h=None):
    """Gradients of swiglu_forward: (dx, dxd_gate, dxd_up, da_gate, db_gate, da_up, db_up), for want = the same
    seven flags. dh_term = (dt, a) adds dt @ a to dh inside the SwiGLU kernel (the down projection's adapter share
    of its input gradient); h [M, I], where given, receives the forward's h again."""
    want_dx = want[0]
    terms = _swiglu_terms(saved, scales)
    if terms is None and dh_term is None and h is None:
        dgate, dup = _swiglu_backward(gate, up, dh)
    else:  # gate and up hold the base products only: the kernel adds the terms again
        dgate, dup = (d.view(gate.shape) for d in _swiglu_backward(_flat(gate), _flat(up), _flat(dh), adapters=terms,
                                                                     dh_term=dh_term, h=h))
    if isinstance(saved, Grouped):  # dx's two NF4 products (both weights dequantized at once) and the adapters'
        dx, ((_, da_g, db_g), (_, da_u, db_u)) = _grouped_backward(
            (dgate, dup), (w_gate, w_up), path, saved, scales, xd_shape, ((False, *want[3:5]), (False, *want[5:7])),
            want_dx)
        return dx, None, None, da_g, db_g, da_u, db_u
    dts, grads = [], []
    for d, s, scale, (want_a, want_b) in zip((dgate, dup), saved, scales, (want[3:5], want[5:7])):
        dt, grad_a, grad_b = (None, None, None) if s is None else _adapter_grads(_flat(d), s, scale, want_a, want_b)
        dts.append(dt)
        grads += [grad_a, grad_b]
    dx = None
    if want_dx:
        dx = nf4_gemm_backward_a(dgate, w_gate, path=path)
        nf4_gemm_backward_a(dup, w_up, out=dx, beta=1.0, path=path)
    dxds = [None if s is None else _adapter_input_grad(dt, s[2], dx, drop, want_dxd, xd_shape)
            for dt, s, drop, want_dxd in zip(dts, saved, dropped, want[1:3])]
    return (dx, *dxds, *grads)


def mlp_forward(x, w_gate, w_up, w_down, loras, down_lora, path, keep, cached=False, residual=None):
    """An MLP block as one op: swiglu_forward, then the down projection of h (down_lora = (a, b, scale) reads h
    itself: no dropout), plus residual where given (in the down GEMMs' epilogue: a decoder layer's last add). h is
    not kept: the backward's SwiGLU kernel writes it again where the down adapter's gradient needs it, which saves
    the block's largest activation. Returns y and what mlp_backward takes (None without keep). cached as
    linear_forward takes it."""
    h, gate, up, saved = swiglu_forward(x, w_gate, w_up, loras, path, keep, cached)
    y, saved_d = linear_forward(h, w_down, None, None if down_lora is None else (h, *down_lora), path, cached,
                                residual)
    return y, ((gate, up, saved, None if saved_d is None else saved_d[1:]) if keep else None)


def mlp_backward(dy, gate, up, w_gate, w_up, w_down, path, saved, saved_d, scales, dropped, xd_shape, want):
    """Gradients of mlp_forward: (dx, dxd_gate, dxd_up, da_gate, db_gate, da_up, db_up, da_down, db_down) for want
    = the same nine flags. dh = dy @ dequant(W_down) is the NF4 product alone: the down adapter's share (dt @ a_w)
    is added inside the SwiGLU backward's kernel, which also writes h again for the adapter's a gradient."""
    dy2 = _flat(dy) if dy.is_contiguous() else _flat(dy.contiguous())
    dh = nf4_gemm_backward_a(dy2, w_down, path=path)
    dh_term, h, da_d, db_d, dt_d = None, None, None, None, None
    if saved_d is not None:
        t_d, a_dw, b_dw = saved_d
        db_d = torch.empty(b_dw.shape, dtype=torch.float32, device=dy.device)
        dt_d = lora_backward_dy(dy2, b_dw, t_d, db_d, scale=scales[2], beta=0.0)
        if dh.is_cuda and (dh.dtype != torch.bfloat16 or a_dw.shape[0] > SWIGLU_TERMS_MAX_RANK):
            gemm(dt_d, a_dw, out=dh, beta=1.0)  # where the SwiGLU kernel would take its slow path
        else:
            dh_term = (dt_d, a_dw)
        if want[7]:
            h = torch.empty(dh.shape, dtype=dh.dtype, device=dh.device)
    grads = swiglu_backward(dh.view(gate.shape), gate, up, w_gate, w_up, path, saved, scales[:2], dropped, xd_shape,
                            want[:7], dh_term=dh_term, h=h)
    if h is not None:
        da_d = gemm_backward_b(dt_d, h, out_dtype=torch.float32)
    return (*grads, da_d, db_d if want[8] else None)


def cross_entropy(h, w, labels, ignore_index, want_dh, want_dw, chunk_tokens=0, check_labels=True, chunk_vocab=0):
    """The mean cross-entropy of h [T, H] @ w^T against labels [T], with its gradients computed in the same pass
    (the logits are never held whole; chunk_tokens and chunk_vocab as ops.linear_cross_entropy takes them): (loss,
    dh or None, dw float32 or None). With check_labels the labels are range-checked (a qmm.Error names the first
    out of range) except while a CUDA graph is being captured, where the check's wait for the device is not
    allowed; unchecked, a label out of range gives a NaN loss."""
    dw = torch.empty(w.shape, dtype=torch.float32, device=w.device) if want_dw else None  # written, not added to
    check = check_labels and not (h.is_cuda and torch.cuda.is_current_stream_capturing())
    loss, dh = linear_cross_entropy(h, w, labels, ignore_index=ignore_index, dh=want_dh, dw=dw,
                                    chunk_tokens=chunk_tokens, check_labels=check, accumulate_dw=False,
                                    chunk_vocab=chunk_vocab)
    return loss, dh, dw


def cross_entropy_grads(dh, dw, grad, w_dtype):
    """cross_entropy's saved gradients scaled by the loss's gradient `grad` (either may be None). dw is the size of
    the head: it is cast first, then the copy scaled in place, without a float32 product of that size (with a bf16
    head dw is rounded before the product, not after: no difference where grad is 1, as loss.backward() gives)."""
    return (None if dh is None else dh * grad.to(dh.dtype),
            None if dw is None else dw.to(w_dtype, copy=True).mul_(grad))


class PendingLabelCheck:
    """A label range check without a wait in the middle of a step: made when the labels are (on a GPU, a copy to
    pinned host memory and an event, queued on the current stream), read by `first_bad` when the loss needs them,
    by which time the device is long past the copy (where linear_cross_entropy's own check would wait for the
    whole forward pass)."""

    def __init__(self, labels, vocab, ignore_index):
        self.vocab, self.ignore_index, self.event = vocab, ignore_index, None
        if labels.is_cuda:
            self.labels = torch.empty(labels.shape, dtype=labels.dtype, pin_memory=True)
            self.labels.copy_(labels, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.labels = labels.detach().clone()

    def first_bad(self):
        """(index, value) of the first label (in row-major order) neither in [0, vocab) nor ignore_index, or None."""
        if self.event is not None:
            self.event.synchronize()
        bad = (self.labels != self.ignore_index) & ((self.labels < 0) | (self.labels >= self.vocab))
        if not bool(bad.any()):
            return None
        index = tuple(int(i) for i in bad.nonzero()[0])
        return index, int(self.labels[index])


def rope_grads(rotate_back, dq, dk):
    """rope's input gradients from its outputs' (dq, dk), either possibly None (an output not used; it stays None):
    rotate_back(x, y) applies the inverse rotation to x and y (or None) in one call and returns both."""
    if dq is None:
        return None, None if dk is None else rotate_back(dk, None)[0]
    return rotate_back(dq, dk)
