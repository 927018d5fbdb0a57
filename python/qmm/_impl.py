"""The arithmetic of the differentiable NF4 ops, forward and backward, on qmm's kernels. The eager autograd
functions (functional.py) and the torch.compile custom ops (compile_ops.py) both call these, so compiled and eager
runs launch the same kernels in the same order and agree bit for bit.

An adapter enters as `lora = (xd, a, b, scale)`: xd the adapter's input (x, or dropout(x) computed by PyTorch), a
[r, K] and b [N, r] its trainable matrices (PEFT keeps them in float32). Its products run in x's dtype (bf16 products
with fp32 sums for bf16 activations) on working copies a_w, b_w; y = base + scale * (xd @ a_w^T) @ b_w^T, the LoRA
sum added in the second GEMM's epilogue (beta = 1), after the NF4 base product as the C++ LoraLinear does for NF4
bases. The backward reads dy once for dt = scale * dy @ b_w and grad_b (lora_backward_dy)."""
import torch

from . import _qmm
from ._base import _call, _in, _rows
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


def _adapter_into(y, lora, a_w, b_w):
    """y += scale * (xd @ a_w^T) @ b_w^T in place (y [..., N] dense; a_w, b_w the working copies of the adapter's
    a and b); returns what the backward needs: (xd as rows, t, a_w, b_w)."""
    xd, _, _, scale = lora
    xd2 = _flat(xd)
    t = gemm_bt(xd2, a_w)
    gemm_bt(t, b_w, out=_flat(y), alpha=scale, beta=1.0)
    return xd2, t, a_w, b_w


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


def linear_forward(x, w, bias, lora, path):
    """y = x @ dequant(W)^T (+ bias) (+ the adapter), the NF4 product and the adapter's casts and products in one
    binding call. The bias is written first and the NF4 product accumulates onto it (beta = 1): one rounding of
    base + bias, as a linear layer's bias epilogue. Returns y and the adapter's saved tensors (None without one)."""
    n, k = w.shape
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if bias is not None:
        y.copy_(bias.to(x.dtype).expand_as(y))
    op = "lora_nf4_linear"
    x2, y2, beta = _rows(op, "x", x, k), y.view(-1, n), 0.0 if bias is None else 1.0
    if lora is None:
        _call(_qmm.lora_nf4_linear_forward, x2, x2, w._native, y2, beta, path, None, None, None, None, None, None,
              1.0)
        return y, None
    xd, a, b, scale = lora
    xd2 = None if xd is x else _rows(op, "xd", xd, k)
    a, b = _in(a), _in(b)
    a_w, b_w = ((None, None) if a.dtype == x.dtype else
                (torch.empty(a.shape, dtype=x.dtype, device=x.device), torch.empty(b.shape, dtype=x.dtype,
                                                                                    device=x.device)))
    t = torch.empty((x2.shape[0], a.shape[0]), dtype=x.dtype, device=x.device)
    _call(_qmm.lora_nf4_linear_forward, x2, x2, w._native, y2, beta, path, xd2, a, b, a_w, b_w, t, float(scale))
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


def linears_forward(x, ws, biases, loras, path):
    """linear_forward for several projections of one input (an attention's q, k and v): every adapter's working
    copies made in one launch, then each projection as linear_forward computes it. Returns the outputs and each
    projection's saved tensors."""
    working = working_copies([None if lora is None else lora[1:3] for lora in loras], x.dtype)
    done = [linear_forward(x, w, bias, None if lora is None else (lora[0], *copies, lora[3]), path)
            for w, bias, lora, copies in zip(ws, biases, loras, working)]
    return [y for y, _ in done], [saved for _, saved in done]


def linears_backward(dys, ws, path, saved, scales, dropped, x_shape, wants, want_dx):
    """Gradients of linears_forward: dx (the projections' input gradients summed into one tensor, each added by its
    own NF4 product: no separate sum), then per projection (dxd, da, db) for its wants = (dxd, da, db) flags. A
    projection whose output has no gradient (dy None) adds nothing."""
    dx, grads = None, []
    for dy, w, s, scale, drop, want in zip(dys, ws, saved, scales, dropped, wants):
        if dy is None:
            grads.append((None, None, None))
            continue
        dx, dxd, da, db = linear_backward(dy, w, path, s, scale, drop, x_shape, (want_dx, *want), dx)
        grads.append((dxd, da, db))
    return dx, grads


def swiglu_forward(x, w_gate, w_up, loras, path, keep):
    """h = silu(gate) * up, gate = x @ dequant(Wg)^T (+ its adapter), up likewise, both base products from one read
    of x (nf4_gate_up). Returns h, gate and up (kept for the backward: None unless `keep` or an adapter needs
    them) and each adapter's saved tensors. Without adapters the SwiGLU runs in the gate/up kernel's epilogue."""
    if loras[0] is None and loras[1] is None:
        gate, up, h = nf4_gate_up(x, w_gate, w_up, gate=keep, up=keep, path=path)
        return h, gate, up, (None, None)
    gate, up, _ = nf4_gate_up(x, w_gate, w_up, h=False, path=path)
    working = working_copies([None if lora is None else lora[1:3] for lora in loras], x.dtype)
    saved = tuple(None if lora is None else _adapter_into(y, lora, *w)
                  for y, lora, w in zip((gate, up), loras, working))
    return swiglu(gate, up), gate, up, saved


def swiglu_backward(dh, gate, up, w_gate, w_up, path, saved, scales, dropped, xd_shape, want):
    """Gradients of swiglu_forward: (dx, dxd_gate, dxd_up, da_gate, db_gate, da_up, db_up), for want = the same
    seven flags."""
    want_dx = want[0]
    dgate, dup = _swiglu_backward(gate, up, dh)
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
