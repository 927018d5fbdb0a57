"""The adapters' working copies (their a and b in the activations' dtype), cast for a whole forward at once.

The eager ops compute an adapter's products on copies of its matrices in x's dtype (PEFT keeps them in float32).
Cast by each op, that is a launch per projection group and layer. A model that qmm.patch_bnb patched announces each
of its forwards (a forward pre-hook, `watch`); the first op of such a forward casts every adapter used since the
previous one of its device and dtype, in one launch, into one new buffer, and each op of the forward then takes its
copies from there, once. Any other request (an op outside such a forward, a recomputation under gradient
checkpointing, a module run twice, an adapter first seen) casts that op's copies alone, as the ops did before. So
whatever changed the adapters between two forwards (any optimizer, also one that writes them through raw pointers
without moving their version counters), an op reads them as they are at its forward. Copies serve only
- on the stream the cast ran on, in the same inference mode, while the adapters' version counters stand still;
- under CUDA-graph capture by qmm.graph_step, in the capture that cast them: a replay runs the captured cast again.
Inside any other capture (torch.cuda.graph, torch.compile's CUDA graphs) nothing is cached: each op casts its own.
A cast never writes into an earlier buffer, so a backward reads the copies its forward read. A buffer stays until
the next forward's cast."""
import weakref

import torch

from . import _qmm
from ._base import _call, _in, _to_dlpack

_ALIGN = 64  # elements: each copy starts 128 bytes (bf16) or 256 bytes (f32) into the buffer from a multiple
_FOREIGN = object()  # the token of a capture qmm.graph_step did not start
_capture = None  # qmm.graph_step's token while it captures
_entries = {}  # key -> _Entry
_forwards = 0  # forwards announced by the watched models
_groups = {}  # (device, dtype) -> _Group


class _Group:
    """The entries of one device and dtype: `forward`, the announced forward they were last cast together for;
    `cast`, how many such casts (an entry's copies from an earlier one are not its forward's)."""

    __slots__ = ("forward", "cast")

    def __init__(self):
        self.forward = self.cast = 0


def _announce(module, args):
    global _forwards
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if is_compiling is None or not is_compiling():  # compiled ops cast their own copies
        _forwards += 1


def watch(model):
    """Registers the forward pre-hook that announces model's forwards (once per model); returns its handle."""
    handle = model.__dict__.get("_qmm_copies_hook")
    if handle is None or handle.id not in model._forward_pre_hooks:
        handle = model.register_forward_pre_hook(_announce)
        model.__dict__["_qmm_copies_hook"] = handle
    return handle


def unwatch(model):
    handle = model.__dict__.pop("_qmm_copies_hook", None)
    if handle is not None:
        handle.remove()


class capturing:
    """Context manager qmm.graph_step holds around its capture: copies made inside belong to this capture only."""

    def __enter__(self):
        global _capture
        self._outer, _capture = _capture, object()

    def __exit__(self, *exc):
        global _capture
        _capture = self._outer


def _stream(device):
    if device.type != "cuda":
        return None
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device.index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _token(device):
    """Where and how copies made now may be used: (stream, capture, inference mode); _FOREIGN inside a capture
    qmm did not start."""
    capture = None
    if device.type == "cuda" and _capturing(device):
        if _capture is None:
            return _FOREIGN
        capture = _capture
    return _stream(device), capture, torch.is_inference_mode_enabled()


def _capturing(device):
    """Whether the current stream of `device` (not necessarily the current device: a model spread over GPUs) is
    being captured."""
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


class _Entry:
    """One op's adapters: `pairs` [(a, b) or None] as the op takes them, stacked (one [R, K] a_all, each b apart)
    or not (each adapter's (a_w, b_w)). `copies` holds the cast ones only (None for a matrix already in dtype,
    which the op gets as it is: an entry holds no reference to its adapters, and goes when one of them does)."""

    __slots__ = ("refs", "stacked", "dtype", "device", "token", "cast", "versions", "copies", "used", "served")

    def __init__(self, key, pairs, stacked, dtype, device):
        gone = lambda _: _entries.pop(key, None)  # noqa: E731
        self.refs = [None if p is None else (weakref.ref(p[0], gone), weakref.ref(p[1], gone)) for p in pairs]
        self.stacked, self.dtype, self.device = stacked, dtype, device
        self.token = self.cast = self.versions = self.copies = None
        self.used = self.served = False  # requested since its group's last cast; handed out since its own

    def pairs(self):
        """The adapters' (a, b), or None once one of them is gone."""
        out = []
        for r in self.refs:
            if r is None:
                out.append(None)
                continue
            a, b = r[0](), r[1]()
            if a is None or b is None:
                return None
            out.append((a, b))
        return out

    def fresh(self, pairs, token, group):
        return (self.copies is not None and not self.served and self.cast == group.cast and self.token == token and
                self.versions == _versions(pairs))


def _versions(pairs):
    return tuple(m._version for p in pairs if p is not None for m in p)


def _elements(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _size(entry, pairs):
    """The buffer elements an entry's copies take: a_all and the b's not in dtype where stacked, else every matrix
    not in dtype."""
    present = [p for p in pairs if p is not None]
    if entry.stacked:
        return (_elements(sum(a.numel() for a, _ in present)) +
                sum(_elements(b.numel()) for _, b in present if b.dtype != entry.dtype))
    return sum(_elements(m.numel()) for p in present for m in p if m.dtype != entry.dtype)


def _recast(token, group, trigger, whole):
    """Casts `trigger`'s copies, and where `whole` those of every entry of its device and dtype used since the
    group's last such cast, into one new buffer, in one launch."""
    device, dtype = trigger.device, trigger.dtype
    if whole:
        group.cast += 1
    todo = []
    for key, e in list(_entries.items()):
        pairs = e.pairs()
        if pairs is None:
            del _entries[key]
        elif e is trigger or (whole and e.used and e.device == device and e.dtype == dtype):
            todo.append((e, pairs))
    buf = torch.empty(sum(_size(e, pairs) for e, pairs in todo), dtype=dtype, device=device)
    srcs, dsts, at = [], [], 0

    def copy_of(m, shape=None):
        """A view of the buffer's next free elements, shaped as m (or `shape`), that the launch fills from m."""
        nonlocal at
        shape = tuple(m.shape) if shape is None else shape
        n = 1
        for d in shape:
            n *= d
        view = buf[at:at + n].view(shape)
        at += _elements(n)
        if m is not None:
            srcs.append(_in(m))
            dsts.append(view)
        return view

    for e, pairs in todo:
        if e.stacked:
            present = [p for p in pairs if p is not None]
            a_all = copy_of(None, (sum(a.shape[0] for a, _ in present), present[0][0].shape[1]))
            row = 0
            for a, _ in present:
                srcs.append(_in(a))
                dsts.append(a_all[row:row + a.shape[0]])
                row += a.shape[0]
            e.copies = (a_all, [None if p is None or p[1].dtype == dtype else copy_of(p[1]) for p in pairs])
        else:
            e.copies = [None if p is None else tuple(None if m.dtype == dtype else copy_of(m) for m in p)
                        for p in pairs]
        e.token, e.cast, e.versions, e.served = token, group.cast, _versions(pairs), False
    if whole:
        for e in _entries.values():
            if e.device == device and e.dtype == dtype:
                e.used = False
    if srcs:
        _call(_qmm.cast, srcs[0], [_to_dlpack(s) for s in srcs], [_to_dlpack(d) for d in dsts])


def get(pairs, dtype, stacked):
    """The working copies of an op's adapters `pairs` [(a, b) or None] in dtype: stacked, (a_all [R, K] with every a
    in order, [b or its copy per adapter, None where none]); else [(a_w, b_w) or None per adapter]. None where
    nothing is cached (another capture's ops cast their own) or nothing needs a copy."""
    present = [p for p in pairs if p is not None]
    if not present or (not stacked and all(m.dtype == dtype for p in present for m in p)):
        return None
    device = present[0][0].device
    token = _token(device)
    if token is _FOREIGN:
        return None
    # The device is part of the key: Module.to() moves a parameter (the same object) to another device.
    key = (stacked, dtype, device, *(id(m) for p in pairs for m in (p if p is not None else (None, None))))
    e = _entries.get(key)
    if e is None or e.pairs() is None:
        e = _entries[key] = _Entry(key, pairs, stacked, dtype, device)
    group = _groups.setdefault((device, dtype), _Group())
    if group.forward != _forwards:  # the first op of an announced forward: every adapter's copies at once
        group.forward = _forwards
        _recast(token, group, e, whole=True)
    elif not e.fresh(pairs, token, group):
        _recast(token, group, e, whole=False)
    e.used = e.served = True
    if stacked:
        a_all, b_ws = e.copies
        return a_all, [None if p is None else p[1] if w is None else w for p, w in zip(pairs, b_ws)]
    return [None if p is None else tuple(m if c is None else c for m, c in zip(p, cs))
            for p, cs in zip(pairs, e.copies)]
