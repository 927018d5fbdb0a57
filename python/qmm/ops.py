"""qmm's ops on torch tensors, as they are (no autograd): dense GEMMs, SwiGLU, NF4 GEMMs and LoRA's backward
products. Outputs are allocated here unless passed as `out=`."""
import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _qmm
from ._base import _call, _check_path, _dim, _error, _flag, _in, _int, _out, _rows, _tensors, _written
from .nf4 import _nf4


def cuda_device_count():
    """GPUs qmm can use (0 where qmm was built without CUDA or none is usable)."""
    return _qmm.cuda_device_count()


def _cuda_index(op, device):
    """The index of the CUDA device that `device` (None: PyTorch's current one; an int, "cuda:1", a torch.device)
    names; a qmm.Error where it names none that qmm can use."""
    try:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    except (RuntimeError, TypeError) as e:
        raise _error("InvalidArgument", f"{op}: device {device!r} is not a device ({e})") from None
    if d.type != "cuda":
        raise _error("InvalidArgument", f"{op}: device {device!r} is not a CUDA device (qmm keeps no memory of its "
                                        "own on the CPU)")
    if isinstance(device, int) and d.index != device:  # torch.device keeps a small index, which wraps
        raise _error("InvalidArgument", f"{op}: there is no CUDA device {device}")
    if d.index is not None:
        index = d.index
    else:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    count = _qmm.cuda_device_count()
    if not 0 <= index < count:
        raise _error("InvalidArgument", f"{op}: there is no CUDA device {index} (qmm sees {count})")
    return index


def memory_stats(device=None):
    """The device memory qmm holds on a GPU beyond the tensors it is given, which PyTorch's allocator does not see
    (torch.cuda.max_memory_allocated leaves it out): a dict of bytes, summed over this process's qmm contexts on
    the device (one per stream that ran qmm ops there). "fixed": cuBLASLt workspaces and tables, for the process's
    life; "scratch_reserved" (and "scratch_reserved_peak"): the scratch pools' memory, which ops take their
    temporaries from (an NF4 weight's bf16 copy, a loss's chunk of logits) and which keeps what it reserved between
    calls; "scratch_in_use" (and its peak): what ops in flight hold of it. Peaks count since the contexts were made
    or reset_peak_memory_stats, each context's own, summed (where several streams ran qmm ops, an upper bound).
    Memory held by CUDA graphs captured with qmm ops is the graphs' own. Zeros where qmm has run nothing on the
    device."""
    values = _qmm.memory_stats(_cuda_index("memory_stats", device))
    keys = ("fixed", "scratch_reserved", "scratch_reserved_peak", "scratch_in_use", "scratch_in_use_peak")
    return dict(zip(keys, values))


def reset_peak_memory_stats(device=None):
    """Starts memory_stats' peaks again from the current values."""
    _qmm.reset_peak_memory_stats(_cuda_index("reset_peak_memory_stats", device))


def release_cached_memory(device=None):
    """Gives qmm's unused scratch memory on the device back to CUDA (as torch.cuda.empty_cache does for PyTorch's
    cache), after waiting for the streams qmm ran on there; the next op that needs scratch reserves it again."""
    _qmm.release_cached_memory(_cuda_index("release_cached_memory", device))


def cast(tensors, dtype):
    """Copies of `tensors` (float32 or bfloat16, on one device) in `dtype` (rounded to nearest even), float32 ->
    bfloat16 ones in one launch on a GPU: a layer's LoRA matrices cast for a bf16 product cost one launch."""
    srcs = [_in(t) for t in tensors]
    outs = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in srcs]
    if srcs:
        _call(_qmm.cast, srcs[0], [_to_dlpack(t) for t in srcs], [_to_dlpack(o) for o in outs])
    return outs


# ---- dense GEMMs ------------------------------------------------------------------------------------------------


def _gemm(fn, op, x, y, shape, out, alpha, beta, math_mode, out_dtype):
    x, y = _in(x), _in(y)
    out = _out(op, out, shape, out_dtype, x, beta)
    _call(fn, x, x, y, out.detach(), alpha=alpha, beta=beta, math=math_mode)
    return out


def gemm(a, b, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """out[M,N] = alpha * a[M,K] @ b[K,N] + beta * out. a and b share a dtype (float32 or bfloat16); out is that
    dtype or float32. math ("fp32", "tf32", "bf16") sets how float32 operands multiply (bf16 truncates them)."""
    _tensors("gemm", a=a, b=b)
    return _gemm(_qmm.gemm, "gemm", a, b, (_dim(a, 0), _dim(b, 1)), out, alpha, beta, math, out_dtype)


def gemm_bt(a, b, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """out[M,N] = alpha * a[M,K] @ b[N,K]^T + beta * out (a linear layer's forward)."""
    _tensors("gemm_bt", a=a, b=b)
    return _gemm(_qmm.gemm_bt, "gemm_bt", a, b, (_dim(a, 0), _dim(b, 0)), out, alpha, beta, math, out_dtype)


def gemm_backward_a(dc, b, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """da[M,K] = alpha * dc[M,N] @ b[K,N]^T + beta * da (gemm's input gradient)."""
    _tensors("gemm_backward_a", dc=dc, b=b)
    return _gemm(_qmm.gemm_backward_a, "gemm_backward_a", dc, b, (_dim(dc, 0), _dim(b, 0)), out, alpha, beta, math,
                 out_dtype)


def gemm_backward_b(a, dc, *, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """db[K,N] = alpha * a[M,K]^T @ dc[M,N] + beta * db (gemm's weight gradient)."""
    _tensors("gemm_backward_b", a=a, dc=dc)
    return _gemm(_qmm.gemm_backward_b, "gemm_backward_b", a, dc, (_dim(a, 1), _dim(dc, 1)), out, alpha, beta, math,
                 out_dtype)


def batched_gemm(a, b, *, transpose_b=False, out=None, alpha=1.0, beta=0.0, math="fp32", out_dtype=None):
    """out[B,H,M,N] = alpha * a[B,H,M,K] @ b[B,H,K,N] (or b[B,H,N,K]^T with transpose_b) + beta * out."""
    _tensors("batched_gemm", a=a, b=b)
    _flag("batched_gemm", "transpose_b", transpose_b)
    a, b = _in(a), _in(b)
    shape = (_dim(a, 0), _dim(a, 1), _dim(a, 2), _dim(b, 2) if transpose_b else _dim(b, 3))
    out = _out("batched_gemm", out, shape, out_dtype, a, beta)
    _call(_qmm.batched_gemm, a, a, b, out.detach(), transpose_b=transpose_b, alpha=alpha, beta=beta, math=math)
    return out


# ---- SwiGLU -----------------------------------------------------------------------------------------------------


def _swiglu_adapters(adapters, dh_term=None):
    args = {}
    if adapters is not None:
        t, b_gate, gate_scale, b_up, up_scale = adapters
        args = dict(t=_in(t), b_gate=None if b_gate is None else _in(b_gate), gate_scale=float(gate_scale),
                    b_up=None if b_up is None else _in(b_up), up_scale=float(up_scale))
    if dh_term is not None:
        args.update(dh_t=_in(dh_term[0]), dh_a=_in(dh_term[1]))
    return args


def swiglu(gate, up, *, out=None, adapters=None):
    """h = silu(gate) * up (float32 or bfloat16, one shape and dtype for all three). adapters = (t, b_gate,
    gate_scale, b_up, up_scale) adds LoRA terms to the inputs inside the kernel, never stored: gate + gate_scale *
    t[:, :r_g] @ b_gate^T and up + up_scale * t[:, r_g:r_g + r_u] @ b_up^T for gate and up [M, N], t [M, R] and
    b_gate [N, r_g], b_up [N, r_u] (either None for no term), all of gate's dtype."""
    _tensors("swiglu", gate=gate, up=up)
    gate, up = _in(gate), _in(up)
    out = _out("swiglu", out, gate.shape, None, gate, 0.0)
    _call(_qmm.swiglu, gate, gate, up, out.detach(), **_swiglu_adapters(adapters))
    return out


def swiglu_backward(gate, up, dh, *, adapters=None, dh_term=None, out=None, h=None):
    """(dgate, dup) = (dh * up * silu'(gate), dh * silu(gate)), with swiglu's adapters at gate's and up's sums with
    their terms, and with dh_term = (dt, a) at dh + dt @ a (a down projection's adapter share of its input gradient:
    dt [M, r], a [r, N]). out = (dgate, dup) may be (gate, up) themselves (in place); h, where given, receives
    swiglu's h again."""
    _tensors("swiglu_backward", gate=gate, up=up, dh=dh)
    gate, up, dh = _in(gate), _in(up), _in(dh)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise _error("InvalidArgument", "swiglu_backward: out must be a pair (dgate, dup) of tensors")
        out = tuple(_written("swiglu_backward", name, t) for name, t in zip(("out[0]", "out[1]"), out))
    if h is not None:
        _written("swiglu_backward", "h", h)
    dgate, dup = out if out is not None else (torch.empty_like(gate), torch.empty_like(up))
    _call(_qmm.swiglu_backward, gate, gate, up, dh, dgate, dup, **_swiglu_adapters(adapters, dh_term), h=h)
    return dgate, dup


# ---- NF4 --------------------------------------------------------------------------------------------------------
def _nf4_gemm(fn, op, x, x_name, out_name, in_cols, out_cols, w, out, alpha, beta, path, out_dtype):
    _check_path(op, path)
    x2 = _rows(op, x_name, x, in_cols)
    out = _out(op, out, (*x.shape[:-1], out_cols), out_dtype, x, beta)
    out2 = _rows(op, out_name, out, out_cols, output=True)
    _call(fn, x2, x2, w._native, out2, alpha=alpha, beta=beta, path=path)
    return out


def nf4_gemm(a, w, *, out=None, alpha=1.0, beta=0.0, path="auto", out_dtype=None):
    """out[..., N] = alpha * a[..., K] @ dequant(W)^T + beta * out for W [N, K]: bf16 products, fp32 sums (the one
    numerical contract of every path: include/qmm/ops.h). path: "auto" (the planner chooses), "dequant_gemm",
    "fused", or a kernel forced for tests and benchmarks: "small_m", "small_m_slice", "fused_shared" and
    "fused_mma" (these two only in builds with the development kernels, -DQMM_DEV_KERNELS=ON), "reference"
    (CPU)."""
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
    _check_path("nf4_gate_up", path)
    n, k = _nf4("nf4_gate_up", "w_gate", w_gate)
    _nf4("nf4_gate_up", "w_up", w_up)
    a2 = _rows("nf4_gate_up", "a", a, k)
    shape = (*a.shape[:-1], n)
    outs = [torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device) if want else None
            for want in (gate, up, h)]
    views = [None if t is None else t.view(-1, n) for t in outs]
    _call(_qmm.nf4_gate_up, a2, a2, w_gate._native, w_up._native, *views, path=path)
    return tuple(outs)




# ---- LoRA -------------------------------------------------------------------------------------------------------


def lora_backward_dy(dy, b, t, grad_b, *, scale=1.0, beta=1.0, out=None, math="fp32"):
    """LoRA's two products of the output gradient dy [M, N] for an adapter B [N, r] and the saved t = x @ A^T
    [M, r]: returns dt = scale * dy @ B [M, r] (into `out` where given) and sets grad_b [N, r] (float32) to
    scale * dy^T @ t + beta * grad_b (beta = 1 accumulates; beta = 0 overwrites, grad_b not read), in one read of
    dy where the GPU kernel applies (bf16, r 8/16/32, N a multiple of 8)."""
    dy, b, t = _in(dy), _in(b), _in(t)
    _tensors("lora_backward_dy", dy=dy, b=b, t=t, grad_b=grad_b)
    out = _out("lora_backward_dy", out, (_dim(dy, 0), _dim(b, 1)), None, dy, 0.0)
    _written("lora_backward_dy", "grad_b", grad_b)
    _call(_qmm.lora_backward_dy, dy, dy, b, t, out.detach(), grad_b.detach(), scale=scale, beta=beta, math=math)
    return out


# ---- loss -------------------------------------------------------------------------------------------------------


def linear_cross_entropy(h, w, labels, *, ignore_index=-100, dh=False, dw=None, chunk_tokens=0, check_labels=True,
                         accumulate_dw=True, chunk_vocab=0):
    """The mean cross-entropy of the logits h @ w^T against labels, for h [T, H] (float32 or bfloat16), w [V, H] of
    h's dtype and labels [T] (int32, or int64 converted), each in [0, V) or ignore_index; the [T, V] logits are never
    held whole; they are rounded to h's dtype (as a bf16 model's head writes them) and their log-sum-exp taken in
    fp32. Returns (loss, dh): loss a float32 scalar tensor (0 when every token is ignored), dh the loss's
    gradient in h (where dh=True, else None); `dw` (float32 [V, H]) accumulates the gradient in w where given, or
    with accumulate_dw=False takes it without its old contents being read (a fresh torch.empty will do).
    check_labels=True reads the labels first (on a GPU the call waits for it) and raises qmm.Error naming the first
    out of range; check_labels=False waits for nothing (a CUDA graph can capture it), and a label out of range then
    makes the loss NaN, its token's dh row NaN and, where computed, all of dw NaN (every row of w meets that token).
    chunk_tokens and chunk_vocab (0: qmm's choice, within 5% of the fp32 logits' bytes without dw) split the logits
    on a GPU as the C++ linear_cross_entropy_chunks says."""
    op = "linear_cross_entropy"
    _tensors(op, h=h, w=w, labels=labels)
    _flag(op, "check_labels", check_labels)
    _flag(op, "accumulate_dw", accumulate_dw)
    _int(op, "ignore_index", ignore_index, -2 ** 31, 2 ** 31 - 1)
    _int(op, "chunk_tokens", chunk_tokens, -2 ** 63, 2 ** 63 - 1)  # the sign is qmm's check, with the others
    _int(op, "chunk_vocab", chunk_vocab, -2 ** 63, 2 ** 63 - 1)
    h, w = _in(h), _in(w)
    labels = _in(labels)
    if labels.dtype == torch.int64:  # int32 for qmm; a value past int32 stays out of range, never wraps into it
        low, high = -2 ** 31, 2 ** 31 - 1
        labels = labels.clamp(low + (ignore_index == low), high - (ignore_index == high)).to(torch.int32)
    if dw is not None:
        _written(op, "dw", dw)
    loss = torch.empty((), dtype=torch.float32, device=h.device).reshape(1)
    dh_out = torch.empty_like(h) if dh else None
    _call(_qmm.linear_cross_entropy, h, h, w, labels, loss, None if dh_out is None else dh_out,
          None if dw is None else dw.detach(), ignore_index=ignore_index, chunk_tokens=chunk_tokens,
          check_labels=check_labels, accumulate_dw=accumulate_dw, chunk_vocab=chunk_vocab)
    return loss.reshape(()), dh_out


# ---- normalization ----------------------------------------------------------------------------------------------


def rms_norm(x, w, eps, *, rstd=False):
    """RMSNorm over the last dimension as Hugging Face's Llama/Qwen2 modules compute it: y = w * (x * rstd rounded
    to x's dtype), rstd = 1 / sqrt(mean(x^2) + eps) in fp32. x [..., H] float32 or bfloat16, w [H] of x's dtype.
    Returns (y, rstd [rows] float32 where rstd=True, else None)."""
    _tensors("rms_norm", x=x, w=w)
    x2 = _in(x).reshape(-1, _dim(x, -1)) if x.dim() >= 1 else _in(x)
    y = torch.empty_like(x2)
    r = torch.empty((x2.shape[0],), dtype=torch.float32, device=x.device) if rstd else None
    _call(_qmm.rms_norm, x2, x2, _in(w), y, r, eps=float(eps))
    return y.view(x.shape), r


def add_rms_norm(x, r, w, eps, *, rstd=False):
    """A decoder layer's residual add and the RMSNorm after it in one pass: h = x + r (rounded to x's dtype, as
    the tensor add), y = rms_norm(h, w, eps). x and r of one shape [..., H] and dtype. Returns (h, y, rstd [rows]
    float32 where rstd=True, else None)."""
    _tensors("add_rms_norm", x=x, r=r, w=w)
    if tuple(r.shape) != tuple(x.shape):
        raise _error("ShapeMismatch", f"add_rms_norm: r has shape {list(r.shape)} but must have x's {list(x.shape)}")
    hidden = _dim(x, -1)
    x2, r2 = _in(x).reshape(-1, hidden), _in(r).reshape(-1, hidden)
    h, y = torch.empty_like(x2), torch.empty_like(x2)
    rs = torch.empty((x2.shape[0],), dtype=torch.float32, device=x.device) if rstd else None
    _call(_qmm.add_rms_norm, x2, x2, r2, _in(w), h, y, rs, eps=float(eps))
    return h.view(x.shape), y.view(x.shape), rs


def rms_norm_backward(x, w, rstd, dy, *, dx=True, dw=None, dres=None):
    """rms_norm's gradients from its rstd: returns dx (x's dtype; None where dx=False) and accumulates the float32
    gradient of w into `dw` where given. `dres` (x's shape and dtype), a gradient that reaches x by another path
    (the residual stream), is added to dx in the same pass."""
    _tensors("rms_norm_backward", x=x, w=w, rstd=rstd, dy=dy)
    hidden = _dim(x, -1)
    for name, t in (("dy", dy), ("dres", dres)):
        if t is not None and tuple(t.shape) != tuple(x.shape):
            raise _error("ShapeMismatch", f"rms_norm_backward: {name} has shape {list(t.shape)} but must have x's "
                                          f"{list(x.shape)}")
    if dw is not None:
        _written("rms_norm_backward", "dw", dw)
    x2, dy2 = _in(x).reshape(-1, hidden), _in(dy).reshape(-1, hidden)
    dres2 = None if dres is None else _in(dres).reshape(-1, hidden)
    dx_out = torch.empty_like(x2) if dx else None
    _call(_qmm.rms_norm_backward, x2, x2, _in(w), _in(rstd), dy2, dx_out, None if dw is None else dw.detach(), dres2)
    return None if dx_out is None else dx_out.view(x.shape)


# ---- rotary position embedding ----------------------------------------------------------------------------------


def _cos_batch(cos):
    return cos.shape[0] if cos.dim() == 3 else 1


def _require_heads(op, name, t):
    if t.dim() != 4:
        raise _error("ShapeMismatch", f"{op}: argument '{name}' has shape {list(t.shape)}; it must be [B, H, S, D]")


def _token_major(op, name, t, cos_batch):
    """t [B, H, S, D] (Hugging Face's shape) as a [B', S, H', D] tensor for qmm, whether that is a copy, and how to
    view a result of its shape as [B, H, S, D]. Hugging Face's own layout (the projection output [B, S, H, D],
    transposed) is taken as it is; a contiguous [B, H, S, D] as [B·H, S, 1, D] where cos and sin are broadcast over
    the batch (each (b, h) then a sequence of its own); anything else as a [B, S, H, D] copy."""
    _require_heads(op, name, t)
    b, h, s, d = t.shape
    if t.transpose(1, 2).is_contiguous():
        return _in(t.transpose(1, 2)), False, lambda y: y.transpose(1, 2)
    if t.is_contiguous() and cos_batch == 1:
        return _in(t).view(b * h, s, 1, d), False, lambda y: y.view(b, h, s, d)
    return _in(t.transpose(1, 2)), True, lambda y: y.transpose(1, 2)


def _span(t):
    """The byte range t's elements lie in."""
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _check_pair(op, q, k, cos, sin, inplace):
    """What qmm checks of q and k together, checked here in Hugging Face's shapes and before either is written: they
    may reach qmm in two calls, or in shapes it cannot tell apart (contiguous [B, H, S, D] as [B·H, S, 1, D])."""
    _require_heads(op, "q", q)
    _require_heads(op, "k", k)
    names = {torch.float32: "f32", torch.bfloat16: "bf16"}
    if k.dtype != q.dtype:
        raise _error("DTypeMismatch", f"{op}: k is {names.get(k.dtype, k.dtype)} but q is "
                                      f"{names.get(q.dtype, q.dtype)}")
    if k.device != q.device:
        raise _error("DeviceMismatch", f"{op}: k is on {k.device} but q is on {q.device}")
    if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise _error("ShapeMismatch", f"{op}: k has shape {list(k.shape)} but q has {list(q.shape)}: k must be "
                                      f"[B, Hk, S, D] with q's B, S, D")
    if not inplace:
        return  # the outputs are new tensors
    spans = {name: _span(t) for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin))}
    for a, b in (("q", "k"), ("q", "cos"), ("q", "sin"), ("k", "cos"), ("k", "sin")):
        (a0, a1), (b0, b1) = spans[a], spans[b]
        if a0 < b1 and b0 < a1:
            raise _error("InvalidArgument", f"{op}: {a} and {b} overlap in memory (rotated in place, {a} must be "
                                            f"disjoint from every other argument)")


def rope_like(x, cos):
    """An uninitialised result of rope for x: x's shape, dtype and device, and the strides rope gives it."""
    x2, _, back = _token_major("rope", "x", x, _cos_batch(cos))
    return back(torch.empty_like(x2, memory_format=torch.contiguous_format))


def rope(q, k, cos, sin, *, inverse=False, inplace=False):
    """Hugging Face's apply_rotary_pos_emb(q, k, cos, sin) (Llama, Qwen2, Mistral): q·cos + rotate_half(q)·sin and
    the same for k, computed in fp32 and rounded once to q's dtype (Hugging Face rounds each product and the sum, so
    bf16 results may differ from its by an ulp). q [B, Hq, S, D] and k [B, Hk, S, D] (or None) in Hugging Face's
    shapes, float32 or bfloat16, D even: taken without a copy where their memory is [B, S, H, D] (the projection's
    output viewed per head and transposed, as Hugging Face's attention makes them) or, with cos and sin broadcast
    over the batch, contiguous [B, H, S, D]; copied otherwise. cos, sin [B or 1, S, D] (or [S, D]) as Hugging Face's
    rotary embedding returns them, q's dtype or float32. inverse=True applies the transpose (the backward, on
    gradients). Returns (q_embed, k_embed) of q's and k's shapes (k_embed None without k); with inplace=True, q and
    k themselves, rotated in place (refused where they would be copied). qmm's messages name the shapes it takes:
    [B, S, H, D], or [B·H, S, 1, D] for contiguous inputs."""
    op = "rope"
    _tensors(op, q=q, cos=cos, sin=sin)
    _flag(op, "inverse", inverse)
    _flag(op, "inplace", inplace)
    cos, sin = _in(cos), _in(sin)
    if cos.dim() == 2:
        cos = cos.unsqueeze(0)
    if sin.dim() == 2:
        sin = sin.unsqueeze(0)
    if k is not None:
        _check_pair(op, q, k, cos, sin, inplace)
    pairs = []
    for name, t in (("q", q), ("k", k)):
        if t is None:
            continue
        t2, copied, back = _token_major(op, name, t, _cos_batch(cos))
        if inplace and copied:
            raise _error("InvalidArgument", f"{op}: argument '{name}' cannot be rotated in place: its memory is "
                                            f"neither [B, S, H, D] nor (cos broadcast over the batch) [B, H, S, D]")
        if inplace:
            _written(op, name, t)
        pairs.append((t, t2, t2 if inplace else torch.empty_like(t2), back))
    # One launch for both where q and k share qmm's [B, S] (Hugging Face's layout); else one each.
    groups = [pairs] if len(pairs) < 2 or pairs[0][1].shape[:2] == pairs[1][1].shape[:2] else [[p] for p in pairs]
    for g in groups:
        (_, x, y, _), rest = g[0], g[1:]
        kx, ky = (rest[0][1], rest[0][2]) if rest else (None, None)
        _call(_qmm.rope, x, x, kx, cos, sin, y, ky, inverse=inverse)
    outs = [t if inplace else back(y) for t, _, y, back in pairs]
    return outs[0], outs[1] if k is not None else None
