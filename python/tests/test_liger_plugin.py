"""The Liger-Kernel peer plugin's decisions (python/tests/peers/qmm_liger_plugin.py, which scripts/peer-tests loads
to run Liger's own tests with qmm in place): which of Liger's calls qmm takes and why the others are left to Liger,
and that a replaced apply computes with qmm or calls the original. Liger itself is not needed (CI has none): a
stand-in Function with Liger's signature is patched; the last test binds Liger's real Functions where installed."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
import qmm_liger_plugin as plugin  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


def norm_args(dtype=F32, w=True, offset=0.0, casting_mode="llama", hidden=12):
    x = torch.randn(2, 3, hidden, dtype=dtype)
    return dict(X=x, W=torch.randn(hidden, dtype=dtype) if w else None, eps=1e-6, offset=offset,
                casting_mode=casting_mode, in_place=True, row_mode=None)


def test_rms_norm_taken_where_qmm_computes_it():
    assert plugin.rms_norm_reason(norm_args()) is None
    assert plugin.rms_norm_reason(norm_args(BF16, hidden=41)) is None  # odd hidden sizes too
    assert plugin.rms_norm_reason(norm_args(casting_mode="gemma")) is None  # float32: every mode computes alike
    assert plugin.rms_norm_reason(norm_args(casting_mode=-1)) is None  # Liger's integer code for "none"
    assert plugin.rms_norm_reason(norm_args(w=False)) == "no weight (elementwise_affine=False)"
    assert plugin.rms_norm_reason(norm_args(offset=1.0)) == "offset (Gemma's 1 + w)"
    assert plugin.rms_norm_reason(norm_args(BF16, casting_mode="gemma")) == "casting_mode 'gemma' in bfloat16"
    assert plugin.rms_norm_reason(norm_args(torch.float16)) == "float16 (qmm: float32, bfloat16)"
    mixed = norm_args(BF16)
    mixed["W"] = mixed["W"].float()
    assert plugin.rms_norm_reason(mixed) == "W in float32, the input in bfloat16"
    added = dict(norm_args(), R=torch.randn(2, 3, 11))
    assert plugin.add_rms_norm_reason(added) == "R not of the input's shape"


def rope_args(dtype=F32, d=8, cos_dims=3, rotary_dim=None, unsqueeze_dim=1):
    q = torch.randn(2, 5, 4, d, dtype=dtype).transpose(1, 2)  # Hugging Face's [B, H, S, D] view
    k = torch.randn(2, 5, 2, d, dtype=dtype).transpose(1, 2)
    cos = torch.randn(*((1,) if cos_dims == 3 else ()), 5, d, dtype=dtype)
    return dict(q=q, k=k, cos=cos, sin=cos.clone(), position_ids=None, unsqueeze_dim=unsqueeze_dim,
                rotary_dim=rotary_dim)


def test_rope_taken_in_hugging_faces_layout():
    assert plugin.rope_reason(rope_args()) is None
    assert plugin.rope_reason(rope_args(BF16, cos_dims=2)) is None
    assert plugin.rope_reason(rope_args(rotary_dim=8)) is None
    assert plugin.rope_reason(rope_args(rotary_dim=4)) == "partial rotary (rotary_dim < head_dim)"
    assert plugin.rope_reason(rope_args(d=7)) == "odd head_dim"
    assert plugin.rope_reason(rope_args(unsqueeze_dim=2)) == "unsqueeze_dim != 1"
    assert plugin.rope_reason(rope_args(torch.float16)) == "float16 (qmm: float32, bfloat16)"


def test_swiglu_and_cross_entropy_left_where_liger_adds_a_feature():
    a = torch.randn(3, 6)
    swiglu = dict(a=a, b=a.clone(), gate_multiplier=1.0, down_multiplier=1.0)
    assert plugin.swiglu_reason(swiglu) is None
    assert plugin.swiglu_reason(dict(swiglu, gate_multiplier=0.7)) == "gate/down multipliers (Falcon-H1)"
    h, w, target = torch.randn(4, 6), torch.randn(10, 6), torch.randint(0, 10, (4,))
    ce = dict(_input=h, weight=w, target=target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
              label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=F32,
              use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False)
    assert plugin.cross_entropy_reason(ce) is None
    for change, why in ((dict(bias=torch.zeros(10)), "bias"), (dict(ce_weight=torch.ones(10)), "class weights "
                        "(ce_weight)"), (dict(label_smoothing=0.1), "label smoothing"), (dict(return_z_loss=True),
                        "z-loss"), (dict(softcap=30.0), "softcap"), (dict(reduction="sum"), "reduction 'sum'"),
                        (dict(return_predicted_tokens=True), "predicted tokens")):
        assert plugin.cross_entropy_reason(dict(ce, **change)) == why


class StandIn(torch.autograd.Function):
    """Liger's RMSNorm signature, with a newer argument the plugin does not know, computed by PyTorch."""
    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None, new_flag=False):
        y = X * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + eps)
        return y if W is None else y * (offset + W)

    @staticmethod
    def backward(ctx, dy):
        raise NotImplementedError


def test_replaced_apply_computes_with_qmm_or_calls_liger():
    known = {"X", "W", "eps", "offset", "casting_mode", "in_place", "row_mode"}
    taken, left = plugin._taken["rms_norm"], sum(plugin._left.values())
    plugin._replace_apply("rms_norm", StandIn, known, plugin.rms_norm_reason, plugin._rms_norm)
    x, w = torch.randn(3, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    y = StandIn.apply(x, w, 1e-6, 0.0, "llama", True)
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(y, expected)
    y.sum().backward()  # qmm's backward: the stand-in has none
    assert x.grad is not None and w.grad is not None
    assert plugin._taken["rms_norm"] == taken + 1
    with torch.no_grad():
        StandIn.apply(x, None, 1e-6)  # no weight: the stand-in's own forward
        StandIn.apply(x, w, 1e-6, 0.0, "llama", True, None, True)
    assert plugin._left[("rms_norm", "no weight (elementwise_affine=False)")] >= 1
    assert plugin._left[("rms_norm", "argument 'new_flag' (unknown to the plugin)")] >= 1
    assert sum(plugin._left.values()) == left + 2


def test_binds_ligers_own_functions():
    ops = pytest.importorskip("liger_kernel.ops")
    for op, _, name, known, _, _ in plugin.OPS:
        params = plugin.inspect.signature(getattr(ops, name).forward).parameters
        assert set(list(params)[1:]) <= known, (op, set(params) - known)
