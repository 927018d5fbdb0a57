"""A pytest plugin for running Liger-Kernel's own tests of the ops qmm also has with qmm in place: RMSNorm, the
residual add with RMSNorm, rotary embedding, SwiGLU and the head's fused linear cross-entropy. At configure time the
`apply` of each of Liger's autograd Functions for them is replaced by one that computes the call with qmm where qmm
covers its arguments, and otherwise calls Liger's own `apply` and counts the reason. Replacing `apply` on the class
reaches every path the tests take to it (liger_kernel.ops, its submodules, the modules and functional wrappers,
Liger's dispatcher), whatever name it was imported under. The session ends with the calls qmm computed per op, the
calls left to Liger by reason, and the failed tests sorted by who computed their calls (qmm alone, both, Liger
alone). scripts/peer-tests loads it (pytest -p qmm_liger_plugin); with QMM_PEER_CONTROL=1 it replaces nothing, for
the control run of the same tests."""
import collections
import inspect
import os
import sys

import torch

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_CASTING_MODES = {-1: "none", 0: "llama", 1: "gemma"}  # Liger's integer codes for casting_mode

_taken = collections.Counter()  # op -> calls qmm computed
_left = collections.Counter()  # (op, reason) -> calls left to Liger
_patched = []  # "module.Class" names whose apply was replaced
_notes = []  # what the summary must say about how the run was set up
_test = collections.Counter()  # the running test's calls: "qmm" / "liger"
_failed = collections.defaultdict(list)  # who computed the calls ("qmm", "both", "liger", "none") -> failed tests
_passed = collections.Counter()  # the same for passed tests


def _active():
    return not os.environ.get("QMM_PEER_CONTROL")


# ---- what qmm covers: each returns None (qmm takes the call) or why it does not --------------------------------


def _is_dtensor(t):
    return type(t).__name__ == "DTensor"


def _tensor_reason(name, t):
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor"
    if _is_dtensor(t):
        return "DTensor input"
    if t.device.type not in ("cpu", "cuda"):
        return f"{t.device.type} tensors"
    if t.dtype not in _DTYPES:
        return f"{str(t.dtype).replace('torch.', '')} (qmm: float32, bfloat16)"
    return None


def _same(name, t, like):
    """Why t cannot go beside `like` in one qmm call (another dtype or device), or None."""
    why = _tensor_reason(name, t)
    if why is None and t.dtype != like.dtype:
        why = f"{name} in {_DTYPES[t.dtype]}, the input in {_DTYPES[like.dtype]}"
    if why is None and t.device != like.device:
        why = f"{name} on another device"
    return why


def _norm_reason(a, inputs):
    """RMSNorm's arguments as qmm computes it: Hugging Face Llama's casting, weight w (not 1 + w), of x's dtype."""
    x = a[inputs[0]]
    why = _tensor_reason(inputs[0], x)
    for name in inputs[1:]:
        why = why or _same(name, a[name], x)
        if why is None and a[name].shape != x.shape:
            why = f"{name} not of the input's shape"
    if why:
        return why
    w = a["W"]
    if w is None:
        return "no weight (elementwise_affine=False)"
    why = _same("W", w, x)
    if why:
        return why
    if tuple(w.shape) != (x.shape[-1],):
        return "weight not [hidden]"
    if a["offset"] != 0:
        return "offset (Gemma's 1 + w)"
    mode = _CASTING_MODES.get(a["casting_mode"], a["casting_mode"])
    # In float32 every casting mode computes the same numbers; in bfloat16 qmm rounds as Llama does.
    if mode != "llama" and x.dtype != torch.float32:
        return f"casting_mode '{mode}' in bfloat16"
    return None


def rms_norm_reason(a):
    # in_place (dY's buffer reused for dX) and row_mode (a launch shape) change no result
    return _norm_reason(a, ("X",))


def add_rms_norm_reason(a):
    return _norm_reason(a, ("X", "R"))


def rope_reason(a):
    q, k, cos, sin = a["q"], a["k"], a["cos"], a["sin"]
    why = _tensor_reason("q", q) or (_same("k", k, q) if k is not None else "no k")
    if why:
        return why
    if q.dim() != 4 or k.dim() != 4:
        return "q or k not 4-D"
    # Liger reads q and k as [B, H, S, D] and ignores position_ids (cos and sin are already per position).
    if a["unsqueeze_dim"] != 1:
        return "unsqueeze_dim != 1"
    for name, t in (("cos", cos), ("sin", sin)):
        why = _tensor_reason(name, t)
        if why:
            return why
        if t.dtype not in (q.dtype, torch.float32):
            return f"{name} in {_DTYPES[t.dtype]}, q in {_DTYPES[q.dtype]}"
        if t.dim() not in (2, 3):
            return f"{name} {t.dim()}-D"
    b, _, s, d = q.shape
    if d % 2:
        return "odd head_dim"
    if a.get("rotary_dim") not in (None, d) or cos.shape[-1] != d:
        return "partial rotary (rotary_dim < head_dim)"
    if cos.shape != sin.shape or cos.shape[-2] != s or (cos.dim() == 3 and cos.shape[0] not in (1, b)):
        return "cos/sin not [B or 1, S, D]"
    return None


def swiglu_reason(a):
    x = a["a"]
    why = _tensor_reason("a", x) or _same("b", a["b"], x)
    if why:
        return why
    if a["b"].shape != x.shape:
        return "a and b of different shapes"
    if float(a["gate_multiplier"]) != 1.0 or float(a["down_multiplier"]) != 1.0:
        return "gate/down multipliers (Falcon-H1)"
    return None


def cross_entropy_reason(a):
    h, w, target = a["_input"], a["weight"], a["target"]
    why = _tensor_reason("input", h) or _same("weight", w, h)
    if why:
        return why
    if w.dim() != 2 or w.shape[1] != h.shape[-1]:
        return "weight not [V, H]"
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int32, torch.int64):
        return "target not int32/int64"
    if target.numel() != h.numel() // h.shape[-1]:
        return "target not one per row"
    if a["bias"] is not None:
        return "bias"
    if a["ce_weight"] is not None:
        return "class weights (ce_weight)"
    if a["label_smoothing"]:
        return "label smoothing"
    if a["lse_square_scale"] or a["return_z_loss"]:
        return "z-loss"
    if a["softcap"] is not None:
        return "softcap"
    if a["reduction"] != "mean":
        return f"reduction '{a['reduction']}'"
    for flag, why in (("use_token_scaling", "token scaling"), ("return_token_accuracy", "token accuracy"),
                      ("return_predicted_tokens", "predicted tokens")):
        if a.get(flag):
            return why
    # accum_dtype: qmm accumulates the weight's gradient in float32 whatever is asked; ce_impl, ce_mode and
    # chunk_mem_const pick among Liger's own kernels and chunk sizes.
    return None


# ---- the same calls computed by qmm --------------------------------------------------------------------------


def _rms_norm(a):
    import qmm
    return qmm.rms_norm_autograd(a["X"], a["W"], a["eps"])


def _add_rms_norm(a):
    import qmm
    s, y = qmm.add_rms_norm_autograd(a["X"], a["R"], a["W"], a["eps"])
    return y, s  # Liger's order: (the norm, the sum going on as the residual)


def _rope(a):
    import qmm
    return qmm.rope_autograd(a["q"], a["k"], a["cos"], a["sin"])


def _swiglu(a):
    import qmm
    return qmm.swiglu_autograd(a["a"], a["b"])


def _cross_entropy(a):
    import qmm
    loss = qmm.linear_cross_entropy_loss(a["_input"], a["weight"], a["target"], ignore_index=a["ignore_index"])
    return loss, None, None, None  # no z-loss, token accuracy or predicted tokens: those calls stay Liger's


# op, Liger's module and Function, the arguments qmm reads or knows to change no result, the reason, qmm's call
OPS = (
    ("rms_norm", "liger_kernel.ops.rms_norm", "LigerRMSNormFunction",
     {"X", "W", "eps", "offset", "casting_mode", "in_place", "row_mode"}, rms_norm_reason, _rms_norm),
    ("add_rms_norm", "liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction",
     {"X", "R", "W", "eps", "offset", "casting_mode", "in_place"}, add_rms_norm_reason, _add_rms_norm),
    ("rope", "liger_kernel.ops.rope", "LigerRopeFunction",
     {"q", "k", "cos", "sin", "position_ids", "unsqueeze_dim", "rotary_dim"}, rope_reason, _rope),
    ("swiglu", "liger_kernel.ops.swiglu", "LigerSiLUMulFunction",
     {"a", "b", "gate_multiplier", "down_multiplier"}, swiglu_reason, _swiglu),
    ("linear_cross_entropy", "liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction",
     {"_input", "weight", "target", "bias", "ce_weight", "ignore_index", "lse_square_scale", "label_smoothing",
      "reduction", "softcap", "return_z_loss", "accum_dtype", "use_token_scaling", "return_token_accuracy",
      "return_predicted_tokens", "ce_impl", "ce_mode", "chunk_mem_const"}, cross_entropy_reason, _cross_entropy),
)


def bind(cls, known, args, kwargs):
    """The call's arguments by the names of cls.forward (ctx left out, defaults filled in), and why qmm cannot take
    it if it sets an argument this plugin does not know (a Liger newer than it) to other than its default."""
    sig = inspect.signature(cls.forward)
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    a = dict(list(bound.arguments.items())[1:])
    for name, value in a.items():
        default = sig.parameters[name].default
        if name not in known and not (value is default or (not isinstance(value, torch.Tensor) and value == default)):
            return a, f"argument '{name}' (unknown to the plugin)"
    return a, None


def _record(op, why):
    if why is None:
        _taken[op] += 1
        _test["qmm"] += 1
    else:
        _left[(op, why)] += 1
        _test["liger"] += 1


def _replace_apply(op, cls, known, reason, compute):
    original = cls.apply  # Liger's own, bound to its class

    def apply(*args, **kwargs):
        try:
            a, why = bind(cls, known, args, kwargs)
        except TypeError:
            a, why = None, "arguments the plugin cannot bind"
        why = why or reason(a)
        _record(op, why)
        return original(*args, **kwargs) if why else compute(a)

    cls.apply = staticmethod(apply)
    _patched.append(f"{cls.__module__}.{cls.__qualname__}")


def _rotary_embedding_takes_device():
    """Liger's test_rope builds LlamaRotaryEmbedding(config=..., device=...); transformers 5.25 takes no device=.
    Where it does not, device= is taken and the module moved there after it is built (its buffers are all that
    device= placed), so that the tests reach the rope calls they check. Both runs get it."""
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:
        return
    cls = modeling_llama.LlamaRotaryEmbedding
    if "device" in inspect.signature(cls.__init__).parameters:
        return
    init = cls.__init__

    def init_on(self, *args, device=None, **kwargs):
        init(self, *args, **kwargs)
        if device is not None:
            self.to(device)

    cls.__init__ = init_on
    _notes.append("harness: LlamaRotaryEmbedding takes device= again (Liger's test_rope passes it)")


def pytest_configure(config):
    # Liger marks some tests flaky(reruns=...) for pytest-rerunfailures; without that plugin the mark does nothing.
    if not config.pluginmanager.hasplugin("rerunfailures"):
        config.addinivalue_line("markers", "flaky(reruns, reruns_delay): pytest-rerunfailures' mark (not installed)")
    _rotary_embedding_takes_device()
    if not _active():
        return
    import importlib

    import liger_kernel
    import liger_kernel.ops

    _notes.append(f"Liger-Kernel from {os.path.dirname(liger_kernel.__file__)}")
    for op, module, name, known, reason, compute in OPS:
        default = getattr(importlib.import_module(module), name)
        exported = getattr(liger_kernel.ops, name, default)  # another where LIGER_KERNEL_IMPL picks one
        for cls in dict.fromkeys((default, exported)):
            _replace_apply(op, cls, known, reason, compute)
    try:  # Liger's dispatcher, where it has one, may send rope past LigerRopeFunction to another kernel set
        chosen = importlib.import_module("liger_kernel.backends.dispatch").resolve_impl("rope").impl_name
    except (ImportError, AttributeError, RuntimeError):
        chosen = None
    if chosen not in (None, "nvidia-triton") and not os.environ.get("LIGER_KERNEL_IMPL_ROPE"):
        os.environ["LIGER_KERNEL_IMPL_ROPE"] = "nvidia-triton"  # the one that calls LigerRopeFunction
        _notes.append(f"rope's dispatch pinned to nvidia-triton (it picked {chosen}) so that it reaches qmm")


def pytest_runtest_logstart(nodeid, location):
    _test.clear()


def pytest_runtest_logreport(report):
    if not _active():
        return
    if report.failed:
        _test["failed"] = 1
    elif report.skipped:  # skipped or xfailed
        _test["skipped"] = 1
    if report.when != "teardown":
        return
    who = "both" if _test["qmm"] and _test["liger"] else "qmm" if _test["qmm"] else \
        "liger" if _test["liger"] else "none"
    if _test["failed"]:
        _failed[who].append(report.nodeid)
    elif not _test["skipped"]:
        _passed[who] += 1


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    for note in _notes:
        write(f"qmm: {note}")
    if not _active():
        write("qmm: control run (QMM_PEER_CONTROL set), nothing replaced")
        return
    write(f"qmm: replaced the apply of {', '.join(_patched)}")
    for op, *_ in OPS:
        left = sum(n for (o, _), n in _left.items() if o == op)
        write(f"qmm: {op}: {_taken[op]} calls computed by qmm, {left} left to Liger")
        for (o, why), n in _left.most_common():
            if o == op:
                write(f"qmm:   {n} x {why}")
    kinds = {"qmm": "every call by qmm", "both": "calls by qmm and by Liger", "liger": "every call by Liger",
             "none": "no call through a replaced Function"}
    for who, what in kinds.items():
        write(f"qmm: tests with {what}: {_passed[who]} passed, {len(_failed[who])} failed")
    for nodeid in _failed["qmm"][:100]:
        write(f"qmm:   failed with every call by qmm: {nodeid}")
    sys.stdout.flush()
