"""What every module of the package shares: the extension, qmm.Error, and how tensors reach qmm's C++ ops."""
import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _qmm
from ._qmm import Error


def _error(code, message):
    e = Error(message)
    e.code = code
    return e


# PyTorch's own fast lookups of the current CUDA stream and device (what torch.compile's generated code uses): a
# fraction of a microsecond where torch.cuda.current_stream() builds a Stream object per call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _capsule(a):
    """A tensor as a DLPack capsule, a list or tuple of them (None kept) as a list, anything else as it is."""
    if isinstance(a, torch.Tensor):
        return _to_dlpack(a)
    if isinstance(a, (list, tuple)) and a and any(isinstance(t, torch.Tensor) for t in a):
        return [_to_dlpack(t) if isinstance(t, torch.Tensor) else t for t in a]
    return a


# Called before every qmm op on a GPU where set: qmm.graph_step counts the step's calls with it and cuts its capture
# into several graphs between them.
_on_cuda_call = None


def _call(fn, like, *args, **kwargs):
    """Runs a `_qmm` op for tensors on like's device: on a GPU in PyTorch's current stream there, with that GPU
    current for the call only (qmm makes its context's GPU current; PyTorch's choice is restored after). Tensors,
    also those in list arguments, travel as DLPack capsules made by to_dlpack: a tensor's own __dlpack__, which the
    extension would call otherwise, costs ~10x more in recent PyTorch (2.4 vs 0.2 µs in 2.15)."""
    # `args` stays referenced until the op returns: the extension releases a capsule of an optional argument as soon
    # as it has read its address, and a tensor made for the call (a contiguous copy) would be freed with it.
    try:
        capsules = [_capsule(a) for a in args]
    except (BufferError, RuntimeError) as e:  # DLPack refuses the tensor: on a device qmm does not run on (meta)
        raise _error("DeviceMismatch", f"{getattr(fn, '__name__', 'qmm')}: {e}") from None
    if not like.is_cuda:
        return fn(*capsules, **kwargs, stream=0)
    if _on_cuda_call is not None:
        _on_cuda_call()
    index = like.device.index
    if _raw_stream is not None and _current_device is not None:
        stream, current = _raw_stream(index), _current_device()
    else:
        stream, current = torch.cuda.current_stream(like.device).cuda_stream, torch.cuda.current_device()
    if index == current:
        return fn(*capsules, **kwargs, stream=stream)
    with torch.cuda.device(like.device):
        return fn(*capsules, **kwargs, stream=stream)


def _flag(op, name, value):
    """value where it is a bool; otherwise a qmm.Error naming the op and the argument."""
    if not isinstance(value, bool):
        raise _error("InvalidArgument", f"{op}: {name} must be True or False, got {value!r}")
    return value


def _check_path(op, path):
    """path names qmm's NF4 implementation ("auto", ...: nf4_gemm's); the name itself is checked by the op."""
    if not isinstance(path, str):
        raise _error("InvalidArgument", f"{op}: path must be a str such as 'auto', got {path!r}")


def _tensors(op, **named):
    """Each named argument a torch.Tensor; otherwise a qmm.Error naming the op and the argument."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise _error("InvalidArgument", f"{op}: argument '{name}' must be a torch.Tensor, got a "
                                            f"{type(t).__name__}")


def _int(op, name, value, low, high):
    """value where it is an int in [low, high]; otherwise a qmm.Error naming the op and the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _error("InvalidArgument", f"{op}: {name} must be an int in [{low}, {high}], got {value!r}")
    return value


def _any_tensor(t):
    """The check of ops whose arguments are not named at the call (those that are: _tensors)."""
    if not isinstance(t, torch.Tensor):
        raise _error("InvalidArgument", f"qmm: a tensor argument is a {type(t).__name__}, not a torch.Tensor")


def _in(t):
    """An input as qmm takes it: detached (DLPack refuses tensors that require grad) and dense row-major."""
    _any_tensor(t)
    if t.requires_grad:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


_increment_version = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)  # PyTorch >= 2.1


def _written(op, name, t):
    """t, a tensor of the caller's that the op writes in place, as PyTorch's in-place ops treat theirs: refused where
    it requires grad in grad mode (autograd would not see the write: PyTorch refuses out= there too), and marked
    written (its version bumped) so that a backward that saved it fails instead of reading the new values."""
    _tensors(op, **{name: t})
    if t.requires_grad and torch.is_grad_enabled():
        raise _error("InvalidArgument", f"{op}: argument '{name}' requires grad; the op writes it in place, which "
                                        "autograd does not record (write into a tensor without grad, or use the "
                                        "op's differentiable form)")
    if _increment_version is not None and not t.is_inference():
        _increment_version(t)
    return t


def _out(op, out, shape, dtype, like, beta):
    if out is None:
        if beta != 0.0:
            raise _error("InvalidArgument", f"{op}: beta = {beta} needs out= (the tensor to accumulate into)")
        return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
    return _written(op, "out", out)


def _dim(t, i):
    """t's extent i, or 0 where t has no such dimension (qmm then names the bad rank)."""
    _any_tensor(t)
    return t.shape[i] if -t.dim() <= i < t.dim() else 0


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
