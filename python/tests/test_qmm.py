"""The Python package against fp64 references computed here with PyTorch, on every device qmm can use (the CPU
always, CUDA where a GPU is present). The C++ suites test the kernels path by path; these test what the package
adds: argument passing, allocation, leading dimensions, errors, bitsandbytes interop and autograd.

Tolerances (written per case below) follow the contracts of include/qmm/ops.h: fp64 sums on the CPU, fp32 sums of
bf16 products on the GPU, and the small-M kernels' scale-after contract (a weight within 2^-9 of its bf16 value).
"""
import copy
import functools
import gc
import io
import json
import os
import struct
import types

import pytest
import torch

import qmm

DATA = os.environ.get("QMM_TEST_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data"))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and qmm.cuda_device_count() > 0 else [])
NF4_CODEBOOK = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def load_safetensors(path):
    """A safetensors file as a dict of CPU tensors (the format: u64 header length, JSON header, raw data)."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8}
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(blob[8 + n + begin:8 + n + end])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtypes[info["dtype"]]).reshape(info["shape"]).clone()
    return out


def nf4_reference_dequant(w4):
    """dequant(W) in float32 from the format's definition (docs/FORMAT.md), computed here with PyTorch."""
    rows, cols = w4.shape
    n = rows * cols
    codes = w4.codes.cpu().long()
    nibbles = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1)[:n]
    block = torch.arange(n) // w4.block_size
    if w4.double_quant:
        q = w4.absmax.cpu().long()
        scales = (w4.code2.cpu()[q] * w4.absmax2.cpu()[torch.arange(q.numel()) // 256]) + w4.offset
    else:
        scales = w4.absmax.cpu()
    return (torch.tensor(NF4_CODEBOOK)[nibbles] * scales[block]).reshape(rows, cols)


def bf16(t):
    return t.to(torch.bfloat16).double()


def trunc_bf16(t):
    """float32 with the low 16 bits cleared: the BF16-compute contract's operands."""
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).double()


def assert_close(got, ref, bound, what):
    """|got - ref| <= bound element-wise (bound a tensor of ref's shape, or a number)."""
    err = (got.double().cpu() - ref.double().cpu()).abs()
    excess = err - (bound.cpu() if torch.is_tensor(bound) else bound)
    assert torch.isfinite(got.double()).all(), f"{what}: non-finite values"
    assert excess.max().item() <= 0, f"{what}: max error {err.max().item():.3g} over its bound"


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, seed, device, dtype=torch.float32):
    return torch.randn(shape, generator=gen(seed)).to(dtype).to(device)


# ---- NF4 format and bitsandbytes interop ----------------------------------------------------------------------


GOLDEN = ["case0_64x64_f32", "case1_128x320_bf16", "case2_7x100_f32", "case3_96x1536_bf16", "case4_33x130_f16"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GOLDEN)
@pytest.mark.parametrize("dq", [False, True])
def test_quantize_matches_bitsandbytes_bytes(device, case, dq):
    g = load_safetensors(os.path.join(DATA, "nf4-bnb", case + ("_dq" if dq else "") + ".safetensors"))
    w4 = qmm.Nf4Weight.quantize(g["input"].to(device), double_quant=dq)
    assert w4.shape == tuple(g["input"].shape) and w4.double_quant == dq
    assert torch.equal(w4.codes.cpu(), g["codes"].reshape(-1))
    if dq:
        assert torch.equal(w4.absmax.cpu(), g["absmax_q"].reshape(-1))
        assert torch.equal(w4.absmax2.cpu(), g["absmax2"].reshape(-1))
        assert torch.equal(w4.code2.cpu(), g["code2"].reshape(-1))
        assert w4.offset == g["offset"].reshape(-1)[0].item()
    else:
        assert torch.equal(w4.absmax.cpu(), g["absmax"].reshape(-1))
    ref = nf4_reference_dequant(w4)
    assert torch.equal(w4.dequantize(torch.float32).cpu(), ref)
    assert torch.equal(w4.dequantize(torch.bfloat16).cpu(), ref.to(torch.bfloat16))
    if g["dequant"].dtype != torch.float16:  # bitsandbytes' own output, in the input's dtype
        assert torch.equal(w4.dequantize(g["dequant"].dtype).cpu(), g["dequant"])


@pytest.mark.parametrize("device", DEVICES)
def test_bnb_linear4bit_checkpoint(device):
    sd = {k: v.to(device) for k, v in load_safetensors(os.path.join(DATA, "nf4-bnb",
                                                                      "linear4bit_state_dict.safetensors")).items()}
    w4 = qmm.Nf4Weight.from_bnb_state_dict(sd, "weight")
    assert w4.shape == (256, 512) and w4.double_quant
    # 65536 code bytes, 2048 q bytes, 8 absmax2 and 256 code2 floats.
    assert w4.nbytes == 65536 + 2048 + 4 * 8 + 4 * 256 and "double-quantized" in repr(w4)
    assert torch.equal(w4.dequantize(torch.float32), sd["_ref.weight_dequant"])
    x = sd["_ref.x"]  # bf16 [3, 512]
    y = qmm.nf4_linear(x, w4, bias=sd["bias"])
    xw = bf16(x) @ bf16(sd["_ref.weight_dequant"]).t()
    bias = sd["bias"].double()
    mag = bf16(x).abs() @ sd["_ref.weight_dequant"].double().abs().t()
    # On the GPU these 3 rows take the small-M pair kernel and its scale-after contract (ops.h): each weight within
    # 2^-9 of its bf16 value, 2^-8 of sum |x||w| with room (without it the first GPU run failed: errors up to
    # 0.0063 where the sum cancels).
    contract = 2.0 ** -8 * mag if device == "cuda" else 0.0
    # Against the exact product of the bf16 operands (the NF4 GEMM contract): y is bf16 like x, so x @ W^T, the bias
    # and their sum are each rounded to bf16 (2^-8 relative; fp32 sums below that), with room.
    y_exact = xw + bias
    assert_close(y, y_exact, 2.0 ** -7 * (xw.abs() + bias.abs() + y_exact.abs()) + contract + 1e-5,
                 "Linear4bit forward, exact")
    # Against bitsandbytes' layer output (bf16 compute): the same three roundings on its side, and its sums are not
    # fp32 throughout: measured 2^-10 of sum |x||w| off the exact product on this file; bound 2^-9.
    ref = sd["_ref.y"].double()
    assert_close(y, ref, 2.0 ** -7 * (xw.abs() + bias.abs() + ref.abs()) + 2.0 ** -9 * mag + contract,
                 "Linear4bit forward")
    # The same weight through the QuantState-like object a live bitsandbytes layer carries.
    state2 = types.SimpleNamespace(absmax=sd["weight.nested_absmax"], code=sd["weight.nested_quant_map"],
                                   blocksize=256)
    qs = types.SimpleNamespace(quant_type="nf4", absmax=sd["weight.absmax"], shape=torch.Size([256, 512]),
                               blocksize=64, state2=state2, offset=torch.tensor(w4.offset))
    assert torch.equal(qmm.Nf4Weight.from_bnb(sd["weight"], qs).dequantize(torch.float32), sd["_ref.weight_dequant"])
    qs.quant_type = "fp4"
    with pytest.raises(qmm.Error) as e:
        qmm.Nf4Weight.from_bnb(sd["weight"], qs)
    assert e.value.code == "Unsupported" and "fp4" in str(e.value)
    # Back to a checkpoint: the same tensors and the same metadata bitsandbytes wrote.
    out = w4.to_bnb_state_dict("weight", dtype=torch.float32)
    for key, value in out.items():
        if key.endswith("bitsandbytes__nf4"):
            meta = lambda t: json.loads(bytes(t.cpu().tolist()).decode("utf-8"))  # noqa: E731
            assert meta(value) == meta(sd[key])
        else:
            assert torch.equal(value.cpu(), sd[key].cpu()), key
    assert set(out) == {k for k in sd if k.startswith("weight")}
    plain = qmm.Nf4Weight.quantize(sd["_ref.weight_dequant"], double_quant=False)
    again = qmm.Nf4Weight.from_bnb_state_dict(plain.to_bnb_state_dict("w"), "w")
    assert torch.equal(again.dequantize(torch.float32), plain.dequantize(torch.float32)) and not again.double_quant
    fp4 = {k.replace("bitsandbytes__nf4", "bitsandbytes__fp4"): v for k, v in sd.items()}
    with pytest.raises(qmm.Error) as e:
        qmm.Nf4Weight.from_bnb_state_dict(fp4, "weight")
    assert e.value.code == "Unsupported"


# ---- NF4 GEMMs --------------------------------------------------------------------------------------------------


def nf4_bound(a, wd, device, out_dtype):
    """Error bound of an NF4 GEMM against the fp64 product of bf16(a) and the bf16 dequantized weight: the CPU sums
    in fp64 (1e-6 of sum |a||w| for the fp32 output's rounding, with room); the GPU sums in fp32 and its small-M
    kernels may use bf16(code) * scale for the weight (2^-9 relative to it): 2^-8 of sum |a||w|. A bf16 output adds
    its rounding, 2^-8 of the result."""
    mag = bf16(a).abs() @ wd.abs().t()
    bound = mag * (1e-6 if device == "cpu" else 2.0 ** -8)
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (bf16(a) @ wd.t()).abs()
    return bound + 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k", [(1, 7, 64), (7, 63, 128), (65, 65, 100), (16, 96, 512), (3, 33, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dq", [False, True])
def test_nf4_gemm_and_input_gradient(device, m, n, k, dtype, dq):
    seed = m * 1000 + n * 10 + k
    w4 = qmm.Nf4Weight.quantize(randn((n, k), seed, device), double_quant=dq)
    wd = w4.dequantize(torch.bfloat16).double().cpu()
    a = randn((m, k), seed + 1, device, dtype)
    c = qmm.nf4_gemm(a, w4)
    assert c.shape == (m, n) and c.dtype == dtype and c.device.type == device
    assert_close(c, bf16(a.cpu()) @ wd.t(), nf4_bound(a.cpu(), wd, device, dtype), "nf4_gemm")
    dc = randn((m, n), seed + 2, device, dtype)
    da = qmm.nf4_gemm_backward_a(dc, w4)
    assert da.shape == (m, k) and da.dtype == dtype
    assert_close(da, bf16(dc.cpu()) @ wd, nf4_bound(dc.cpu(), wd.t(), device, dtype), "nf4_gemm_backward_a")


@pytest.mark.parametrize("device", DEVICES)
def test_nf4_gemm_leading_dims_alpha_beta_and_out(device):
    w4 = qmm.Nf4Weight.quantize(randn((40, 128), 1, device), double_quant=True)
    wd = w4.dequantize(torch.bfloat16).double().cpu()
    a = randn((2, 3, 128), 2, device)
    prior = randn((2, 3, 40), 3, device)
    out = prior.clone()
    got = qmm.nf4_gemm(a, w4, out=out, alpha=0.5, beta=2.0, out_dtype=torch.float32)
    assert got is out
    ref = 0.5 * (bf16(a.cpu()) @ wd.t()) + 2.0 * prior.cpu().double()
    assert_close(out, ref, 0.5 * nf4_bound(a.cpu(), wd, device, torch.float32) + 1e-5, "alpha/beta nf4_gemm")
    # bf16 output from f32 activations.
    c = qmm.nf4_gemm(a, w4, out_dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16 and c.shape == (2, 3, 40)
    assert_close(c, bf16(a.cpu()) @ wd.t(), nf4_bound(a.cpu(), wd, device, torch.bfloat16), "bf16 out")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_nf4_gate_up(device, m):
    k, n = 256, 72
    wg = qmm.Nf4Weight.quantize(randn((n, k), 10 + m, device, torch.bfloat16))
    wu = qmm.Nf4Weight.quantize(randn((n, k), 20 + m, device, torch.bfloat16))
    a = randn((m, k), 30 + m, device, torch.bfloat16)
    gate, up, h = qmm.nf4_gate_up(a, wg, wu)
    for got, w in ((gate, wg), (up, wu)):
        wd = w.dequantize(torch.bfloat16).double().cpu()
        assert_close(got, bf16(a.cpu()) @ wd.t(), nf4_bound(a.cpu(), wd, device, torch.bfloat16), "gate/up")
    # h comes from the fp32 gate and up, the reference from their bf16 roundings (2^-8 relative each), and h is
    # rounded once more: 2^-8 of |h| + |silu'(g) g u| + |silu(g) u|, doubled for room.
    g, u = gate.double().cpu(), up.double().cpu()
    s = torch.sigmoid(g)
    ref = g * s * u
    assert_close(h, ref, 2.0 ** -7 * (2 * ref.abs() + (s * (1 + g * (1 - s)) * g * u).abs()) + 1e-6, "h")
    only_h = qmm.nf4_gate_up(a, wg, wu, gate=False, up=False)
    assert only_h[0] is None and only_h[1] is None
    assert_close(only_h[2], h, 2.0 ** -7 * h.double().abs() + 1e-6, "h alone")


# ---- dense GEMMs and SwiGLU ---------------------------------------------------------------------------------------


def operand(t, math, dtype):
    if dtype == torch.bfloat16:
        return t.double()
    return trunc_bf16(t) if math == "bf16" else t.double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,math", [(torch.float32, "fp32"), (torch.float32, "bf16"), (torch.bfloat16, "fp32")])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 63, 65), (65, 7, 1000)])
def test_dense_gemm_family(device, dtype, math, m, n, k):
    seed = m + 10 * n + 100 * k
    x = lambda shape, s: randn(shape, seed + s, device, dtype)  # noqa: E731
    a, b, bt, dc = x((m, k), 1), x((k, n), 2), x((n, k), 3), x((m, n), 4)
    op = lambda t: operand(t.cpu(), math, dtype)  # noqa: E731
    # Sums of k products: fp64 on the CPU, fp32 on the GPU (k * 2^-24 of sum |x||y|, with room); a bf16 output
    # rounds once more (2^-8 of the result).
    rel = 1e-6 if device == "cpu" else 4 * k * 2.0 ** -24
    cases = [
        ("gemm", qmm.gemm(a, b, math=math), op(a) @ op(b), op(a).abs() @ op(b).abs()),
        ("gemm_bt", qmm.gemm_bt(a, bt, math=math), op(a) @ op(bt).t(), op(a).abs() @ op(bt).abs().t()),
        ("gemm_backward_a", qmm.gemm_backward_a(dc, b, math=math), op(dc) @ op(b).t(), op(dc).abs() @ op(b).abs().t()),
        ("gemm_backward_b", qmm.gemm_backward_b(a, dc, math=math), op(a).t() @ op(dc), op(a).abs().t() @ op(dc).abs()),
    ]
    for name, got, ref, mag in cases:
        assert got.dtype == dtype and got.shape == ref.shape, name
        bound = rel * mag + 1e-6 + (2.0 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)
        assert_close(got, ref, bound, f"{name} {math}")
    # Accumulation into an f32 output.
    prior = randn((m, n), seed + 5, device)
    out = prior.clone()
    qmm.gemm(a, b, out=out, alpha=2.0, beta=1.0, math=math)
    ref = 2.0 * (op(a) @ op(b)) + prior.double().cpu()
    assert_close(out, ref, 2 * rel * (op(a).abs() @ op(b).abs()) + 1e-5, "gemm beta = 1")


@pytest.mark.parametrize("device", DEVICES)
def test_views_with_offsets_are_read_and_written_in_place(device):
    """Row slices of larger tensors (dense, at a storage offset) as inputs and as out=: qmm must use the offset."""
    big_a, b = randn((9, 65), 1, device), randn((65, 7), 2, device)
    big_c = poisoned((10, 7), torch.float32, device)
    qmm.gemm(big_a[3:6], b, out=big_c[4:7])
    ref = big_a[3:6].cpu().double() @ b.cpu().double()
    rel = 1e-6 if device == "cpu" else 4 * 65 * 2.0 ** -24
    assert_close(big_c[4:7], ref, rel * (big_a[3:6].cpu().double().abs() @ b.cpu().double().abs()) + 1e-6, "slice")
    assert torch.isnan(big_c[:4]).all() and torch.isnan(big_c[7:]).all()
    w4 = qmm.Nf4Weight.quantize(randn((16, 64), 3, device))
    big_x = randn((5, 64), 4, device, torch.bfloat16)
    wd = w4.dequantize(torch.bfloat16).double().cpu()
    assert_close(qmm.nf4_gemm(big_x[2:4], w4), bf16(big_x[2:4].cpu()) @ wd.t(),
                 nf4_bound(big_x[2:4].cpu(), wd, device, torch.bfloat16), "nf4 slice")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose_b", [False, True])
def test_batched_gemm(device, transpose_b):
    a = randn((2, 3, 7, 33), 1, device)
    b = randn((2, 3, 9, 33) if transpose_b else (2, 3, 33, 9), 2, device)
    c = qmm.batched_gemm(a, b, transpose_b=transpose_b)
    bb = b.cpu().double().transpose(-1, -2) if transpose_b else b.cpu().double()
    ref = a.cpu().double() @ bb
    rel = 1e-6 if device == "cpu" else 4 * 33 * 2.0 ** -24
    assert c.shape == (2, 3, 7, 9)
    assert_close(c, ref, rel * (a.cpu().double().abs() @ bb.abs()) + 1e-6, "batched_gemm")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_forward_and_backward(device, dtype):
    shape = (7, 65)
    g, u, dh = (randn(shape, s, device, dtype) * 3 for s in (1, 2, 3))
    gd, ud, dhd = (t.cpu().double() for t in (g, u, dh))
    s = torch.sigmoid(gd)
    # f32: a few fp32 roundings (1e-5 relative, with room); bf16: the result's rounding (2^-8) and the inputs' f32
    # math in between.
    rel = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    h = qmm.swiglu(g, u)
    assert_close(h, gd * s * ud, rel * (gd * s * ud).abs() + 1e-6, "swiglu")
    dgate, dup = qmm.swiglu_backward(g, u, dh)
    ref_dg = dhd * ud * s * (1 + gd * (1 - s))
    ref_du = dhd * gd * s
    assert_close(dgate, ref_dg, rel * (dhd * ud).abs() * (s * (1 + gd.abs() * (1 - s))) + 1e-6, "dgate")
    assert_close(dup, ref_du, rel * ref_du.abs() + 1e-6, "dup")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,rg,ru", [(7, 65, 16, 16), (65, 136, 8, 0), (1, 24, 0, 32), (33, 520, 40, 3)])
def test_swiglu_adapters_forward_and_backward(device, dtype, m, n, rg, ru):
    """swiglu's adapters (LoRA terms added to gate and up inside the kernel) against fp64 formulas: t [M, R] with
    gate's columns first, then up's (R one wider than both: a column nobody reads), absent terms as None."""
    g, u, dh = (randn((m, n), s, device, dtype) * 3 for s in (11, 12, 13))
    t = randn((m, rg + ru + 1), 14, device, dtype)
    bg = randn((n, rg), 15, device, dtype) * 0.3 if rg else None
    bu = randn((n, ru), 16, device, dtype) * 0.3 if ru else None
    td = t.cpu().double()
    gd = g.cpu().double() + (1.5 * td[:, :rg] @ bg.cpu().double().T if rg else 0)
    ud = u.cpu().double() + (-0.5 * td[:, rg:rg + ru] @ bu.cpu().double().T if ru else 0)
    dhd, s = dh.cpu().double(), torch.sigmoid(gd)
    adapters = (t, bg, 1.5, bu, -0.5)
    # As test_swiglu_forward_and_backward, plus the terms' fp32 sums (a few ulps of |t| |b| summed over the rank).
    rel = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    term = 1e-5 * (1 + (td.abs()[:, :rg] @ bg.cpu().double().abs().T if rg else 0) +
                   (td.abs()[:, rg:rg + ru] @ bu.cpu().double().abs().T if ru else 0))
    h = qmm.swiglu(g, u, adapters=adapters)
    ref = gd * s * ud
    assert_close(h, ref, rel * ref.abs() + term * (gd.abs() + ud.abs() + 1) + 1e-6, "swiglu adapters")
    dgate, dup = qmm.swiglu_backward(g, u, dh, adapters=adapters)
    ref_dg, ref_du = dhd * ud * s * (1 + gd * (1 - s)), dhd * gd * s
    bound = (rel + term) * (dhd.abs() * (ud.abs() + gd.abs() + 1) * 2) + 1e-6
    assert_close(dgate, ref_dg, bound, "dgate adapters")
    assert_close(dup, ref_du, bound, "dup adapters")
    # In place over gate and up: the same values.
    g2, u2 = g.clone(), u.clone()
    qmm.swiglu_backward(g2, u2, dh, adapters=adapters, out=(g2, u2))
    assert torch.equal(g2, dgate) and torch.equal(u2, dup)


# ---- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_op_and_leave_outputs_untouched(device):
    a, b = randn((4, 8), 1, device), randn((9, 5), 2, device)
    out = poisoned((4, 5), torch.float32, device)

    def expect(code, fragment, fn):
        with pytest.raises(qmm.Error) as e:
            fn()
        assert e.value.code == code, str(e.value)
        assert fragment in str(e.value), str(e.value)
        assert isinstance(e.value, RuntimeError)

    expect("ShapeMismatch", "gemm", lambda: qmm.gemm(a, b, out=out))
    strided = poisoned((5, 4), torch.float32, device).t()
    expect("InvalidArgument", "'c' is not contiguous", lambda: qmm.gemm(a, randn((8, 5), 3, device), out=strided))
    expect("DTypeMismatch", "'a'", lambda: qmm.gemm(a.double(), b.double()))
    expect("InvalidArgument", "beta", lambda: qmm.gemm(a, randn((8, 5), 3, device), beta=1.0))
    expect("InvalidArgument", "math", lambda: qmm.gemm(a, randn((8, 5), 3, device), out=out, math="fp8"))
    assert torch.isnan(out).all() and torch.isnan(strided).all()

    w4 = qmm.Nf4Weight.quantize(randn((16, 64), 4, device))
    expect("ShapeMismatch", "nf4_gemm: argument 'a'", lambda: qmm.nf4_gemm(randn((3, 32), 5, device), w4))
    dense_weight = randn((16, 64), 6, device)
    expect("InvalidArgument", "qmm.Nf4Weight", lambda: qmm.nf4_gemm(randn((3, 64), 5, device), dense_weight))
    expect("InvalidArgument", "path", lambda: qmm.nf4_gemm(randn((3, 64), 5, device), w4, path="fastest"))
    nf4_out = poisoned((3, 16), torch.float32, device)
    wrong_rows = poisoned((4, 16), torch.float32, device)
    expect("ShapeMismatch", "nf4_gemm", lambda: qmm.nf4_gemm(randn((3, 64), 5, device), w4, out=wrong_rows))
    if device == "cpu":
        expect("Unsupported", "fused", lambda: qmm.nf4_gemm(randn((3, 64), 5, device), w4, out=nf4_out,
                                                            path="fused"))
    else:
        expect("Unsupported", "CPU backend only", lambda: qmm.nf4_gemm(randn((3, 64), 5, device), w4, out=nf4_out,
                                                                       path="reference"))
        expect("DeviceMismatch", "nf4_gemm", lambda: qmm.nf4_gemm(randn((3, 64), 5, "cpu"), w4))
    assert torch.isnan(nf4_out).all() and torch.isnan(wrong_rows).all()
    with pytest.raises(qmm.Error) as e:
        qmm.QLoraLinear(w4, rank=0)
    assert e.value.code == "InvalidArgument"


def _expect_error(code, fragment, fn):
    with pytest.raises(qmm.Error) as e:
        fn()
    assert e.value.code == code and fragment in str(e.value), (e.value.code, str(e.value))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_cast_and_an_overwritten_lora_grad_b(device):
    """qmm.ops.cast (the adapters' working copies, one launch on a GPU) rounds each tensor as torch's .to() does,
    empty ones and an empty list included; lora_backward_dy with beta=0 writes grad_b without reading it (a NaN
    there stays out) and gives what beta=1 gives on zeros."""
    from qmm.ops import cast
    shapes = [(16, 4096), (7,), (0, 3), (65, 63), (1000,)]
    ts = [randn(shape, 40 + i, device) for i, shape in enumerate(shapes)] + [randn((9, 5), 50, device, torch.bfloat16)]
    outs = cast(ts, torch.bfloat16)
    for t, o in zip(ts, outs):
        assert o.dtype == torch.bfloat16 and o.shape == t.shape and torch.equal(o, t.to(torch.bfloat16))
    assert torch.equal(cast([outs[0]], torch.float32)[0], outs[0].float())
    assert cast([], torch.bfloat16) == []
    if device == "cuda":
        _expect_error("DeviceMismatch", "cast", lambda: cast([ts[0], ts[1].cpu()], torch.bfloat16))
    bf16 = torch.bfloat16
    dy, b, t = randn((65, 136), 60, device, bf16), randn((136, 16), 61, device, bf16), randn((65, 16), 62, device, bf16)
    written = torch.full((136, 16), float("nan"), device=device)
    accumulated = torch.zeros((136, 16), device=device)
    dt_w = qmm.lora_backward_dy(dy, b, t, written, scale=0.5, beta=0.0)
    dt_a = qmm.lora_backward_dy(dy, b, t, accumulated, scale=0.5)
    assert torch.isfinite(written).all() and torch.equal(written, accumulated) and torch.equal(dt_w, dt_a)


@pytest.mark.parametrize("device", DEVICES)
def test_gemms_with_an_empty_dimension_and_wrong_ranks(device):
    """A zero dimension is valid: M or N = 0 gives an empty output, K = 0 gives C = beta * C (zeros for beta = 0),
    as PyTorch's matmul; an operand of the wrong rank says "rank", naming it."""
    zero_k = qmm.gemm(randn((3, 0), 1, device), randn((0, 4), 2, device))
    assert zero_k.shape == (3, 4) and (zero_k == 0).all()
    out = torch.full((3, 4), 2.0, device=device)
    qmm.gemm_bt(randn((3, 0), 1, device), randn((4, 0), 2, device), out=out, beta=0.5)
    assert (out == 1.0).all()
    assert qmm.gemm(randn((3, 5), 1, device), randn((5, 0), 2, device)).shape == (3, 0)
    assert qmm.gemm(randn((0, 5), 1, device), randn((5, 4), 2, device)).shape == (0, 4)
    _expect_error("ShapeMismatch", "B must have rank 2", lambda: qmm.gemm(randn((3, 5), 1, device),
                                                                          randn((5,), 2, device)))
    _expect_error("ShapeMismatch", "A must have rank 2", lambda: qmm.gemm(randn((5,), 1, device),
                                                                          randn((5, 2), 2, device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rejects_non_finite_weights(device, bad, dtype):
    """NF4 has no code for NaN or infinity: quantize names the first bad element instead of turning it into
    -absmax (NaN) or an infinite scale (Inf)."""
    w = randn((8, 192), 1, device)
    w[5, 77], w[6, 3] = bad, bad
    _expect_error("InvalidArgument", "index 1037 (row 5, column 77)",
                  lambda: qmm.Nf4Weight.quantize(w.to(dtype), double_quant=True))
    _expect_error("InvalidArgument", "NaN or infinity", lambda: qmm.Nf4Weight.quantize(w.to(dtype), double_quant=False))


def _bnb_state_dict(device="cpu", double_quant=True):
    return qmm.Nf4Weight.quantize(randn((32, 128), 1, device), double_quant=double_quant).to_bnb_state_dict("w")


def _with_meta(sd, **changes):
    key = "w.quant_state.bitsandbytes__nf4"
    meta = json.loads(bytes(sd[key].tolist()).decode("utf-8"))
    meta.update(changes)
    out = dict(sd)
    out[key] = torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)
    return out


def test_from_bnb_state_dict_is_as_strict_as_the_checkpoint_loader():
    """from_bnb_state_dict runs qmm's checkpoint loader's checks (the ones `qmm finetune` runs on a file): every
    malformed field is a qmm.Error naming its key, code Io; a valid format qmm does not take is Unsupported; no raw
    KeyError, JSONDecodeError or TypeError, and nothing that fails only at the first GEMM."""
    sd = _bnb_state_dict()
    assert qmm.Nf4Weight.from_bnb_state_dict(sd, "w").shape == (32, 128)
    without = lambda k: {key: v for key, v in sd.items() if key != k}  # noqa: E731
    nan_absmax2 = dict(sd, **{"w.nested_absmax": sd["w.nested_absmax"].clone().fill_(float("nan"))})
    cases = [
        (_with_meta(sd, quant_type="fp4"), "Unsupported", "quant_type \"fp4\""),
        (dict(sd, **{"w.quant_map": sd["w.quant_map"][:15]}), "Io", "'w.quant_map' has 15 elements"),
        (dict(sd, **{"w.quant_map": torch.zeros(16)}), "Unsupported", "'w.quant_map' differs from the NF4 codebook"),
        (nan_absmax2, "Io", "'w.nested_absmax' holds a non-finite value"),
        (without("w.absmax"), "Io", "the state dict has no tensor 'w.absmax'"),
        (without("w.nested_absmax"), "Io", "no tensor 'w.nested_absmax'"),
        (without("w"), "Io", "no tensor 'w'"),
        (without("w.quant_state.bitsandbytes__nf4"), "Io", "not a bitsandbytes 4-bit weight under the prefix 'w'"),
        (dict(sd, **{"w.quant_state.bitsandbytes__nf4": torch.tensor(list(b"{not json"), dtype=torch.uint8)}), "Io",
         "is not valid JSON"),
        (_with_meta(sd, shape=[32, -128]), "Io", "must be [N, K] with N, K >= 1"),
        (_with_meta(sd, shape=[2 ** 62, 2 ** 62]), "Io", "overflows"),
        (_with_meta(sd, shape=[32, 64]), "Io", "'w' has 2048 elements but a packed [32,64] weight"),
        (_with_meta(sd, blocksize="64"), "Io", "no integer \"blocksize\""),
        (_with_meta(sd, blocksize=96), "Io", "power of two"),
        (_with_meta(sd, nested_offset=float("inf")), "Io", "nested_offset"),
        (_with_meta(sd, nested_blocksize=128), "Unsupported", "nested_blocksize 128"),
        (dict(sd, **{"w.absmax": sd["w.absmax"].float()}), "Io", "has a nested_offset but 'w.absmax' is F32"),
        (dict(sd, **{"w.absmax": "not a tensor"}), "Io", "'w.absmax' is a str, not a tensor"),
    ]
    for bad, code, words in cases:
        _expect_error(code, words, lambda: qmm.Nf4Weight.from_bnb_state_dict(bad, "w"))
        assert str(_error_of(lambda: qmm.Nf4Weight.from_bnb_state_dict(bad, "w"))).startswith(
            "Nf4Weight.from_bnb_state_dict: ")
    plain = _bnb_state_dict(double_quant=False)
    inf_absmax = dict(plain, **{"w.absmax": plain["w.absmax"].clone()})
    inf_absmax["w.absmax"][3] = float("inf")
    _expect_error("Io", "'w.absmax' holds a non-finite value (inf) at index 3",
                  lambda: qmm.Nf4Weight.from_bnb_state_dict(inf_absmax, "w"))
    _expect_error("InvalidArgument", "argument 'state_dict'", lambda: qmm.Nf4Weight.from_bnb_state_dict([], "w"))


def _error_of(fn):
    with pytest.raises(qmm.Error) as e:
        fn()
    return e.value


def test_nf4_weight_checks_its_parts_when_built():
    """Nf4Weight(...) from inconsistent parts is refused when built, naming the field, not at its first use; a
    negative or huge shape is a qmm.Error, not a torch error."""
    w4 = qmm.Nf4Weight.quantize(randn((32, 128), 1, "cpu"))
    parts = dict(codes=w4.codes, absmax=w4.absmax, shape=w4.shape, block_size=64, absmax2=w4.absmax2,
                 code2=w4.code2, offset=w4.offset)
    assert qmm.Nf4Weight(**parts).shape == (32, 128)
    cases = [
        (dict(codes=w4.codes[:-1]), "ShapeMismatch", "codes has 2047 bytes"),
        (dict(absmax=w4.absmax[:-1]), "ShapeMismatch", "absmax has 63 elements"),
        (dict(absmax2=None), "InvalidArgument", "absmax2 is missing"),
        (dict(code2=w4.code2[:100]), "ShapeMismatch", "code2 has 100 elements"),
        (dict(offset=float("nan")), "InvalidArgument", "offset is nan"),
        (dict(block_size=48), "InvalidArgument", "block size 48"),
        (dict(shape=(-32, 128)), "InvalidArgument", "rows and cols must be >= 1"),
        (dict(shape=(2 ** 62, 2 ** 62)), "InvalidArgument", "overflows"),
        (dict(shape=(2 ** 70, 2)), "InvalidArgument", "Nf4Weight"),
        (dict(codes=w4.codes.float()), "DTypeMismatch", "codes"),
        (dict(codes=[1, 2]), "InvalidArgument", "argument 'codes' must be a torch.Tensor"),
        (dict(shape=(32,)), "InvalidArgument", "shape (rows, cols)"),
    ]
    for change, code, words in cases:
        _expect_error(code, words, lambda: qmm.Nf4Weight(**dict(parts, **change)))


def test_memory_stats_follow_the_scratch_pools():
    """qmm.memory_stats reports the scratch that an op took (the dequantize-then-GEMM path's bf16 copy of the
    weight, N x K x 2 bytes) and keeps, reset_peak_memory_stats restarts the peaks, release_cached_memory gives the
    memory back; a device that is not a GPU is a qmm.Error."""
    _expect_error("InvalidArgument", "not a CUDA device", lambda: qmm.memory_stats("cpu"))
    _expect_error("InvalidArgument", "is not a device", lambda: qmm.memory_stats("nowhere"))
    _expect_error("InvalidArgument", "reset_peak_memory_stats", lambda: qmm.reset_peak_memory_stats("cpu"))
    count = qmm.cuda_device_count()
    _expect_error("InvalidArgument", f"there is no CUDA device {count} (qmm sees {count})",
                  lambda: qmm.release_cached_memory(count))
    _expect_error("InvalidArgument", "device -1 is not a device", lambda: qmm.memory_stats(-1))
    if "cuda" not in DEVICES:
        _expect_error("InvalidArgument", "there is no CUDA device 0 (qmm sees 0)", qmm.memory_stats)
        return
    n, k = 1000, 1536
    w4 = qmm.Nf4Weight.quantize(randn((n, k), 1, "cuda"), double_quant=False)
    x = randn((65, k), 2, "cuda").bfloat16()
    qmm.release_cached_memory()
    qmm.reset_peak_memory_stats("cuda")
    assert qmm.memory_stats()["scratch_reserved"] == 0 and qmm.memory_stats(0)["scratch_in_use_peak"] == 0
    stream = torch.cuda.Stream()  # a context of its own
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qmm.nf4_gemm(x, w4, path="dequant_gemm")
    torch.cuda.synchronize()
    stats = qmm.memory_stats(torch.device("cuda", 0))
    assert set(stats) == {"fixed", "scratch_reserved", "scratch_reserved_peak", "scratch_in_use",
                          "scratch_in_use_peak"}
    assert stats["fixed"] > 0
    assert stats["scratch_in_use_peak"] >= n * k * 2
    assert stats["scratch_reserved"] >= stats["scratch_in_use_peak"]  # kept for the next call
    assert stats["scratch_in_use"] == 0
    qmm.release_cached_memory()
    assert qmm.memory_stats()["scratch_reserved"] == 0


# ---- autograd ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_linear_autograd(device, dtype):
    w4 = qmm.Nf4Weight.quantize(randn((48, 128), 1, device))
    wd = w4.dequantize(torch.bfloat16).double().cpu()
    x = randn((2, 5, 128), 2, device, dtype).requires_grad_()
    bias = randn((48,), 3, device, dtype).requires_grad_()
    y = qmm.nf4_linear(x, w4, bias)
    dy = randn((2, 5, 48), 4, device, dtype)
    y.backward(dy)
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    ref_dx = bf16(dy.cpu()) @ wd
    assert_close(x.grad, ref_dx, nf4_bound(dy.cpu().reshape(-1, 48), wd.t(), device, dtype).reshape(2, 5, 128),
                 "nf4_linear dx")
    # PyTorch sums the bias gradient in dy's dtype: 10 terms, a rounding each in bf16 (2^-8 of the running sum).
    rel = 10 * 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert_close(bias.grad, dy.cpu().double().sum((0, 1)), rel * dy.cpu().double().abs().sum((0, 1)), "bias grad")


@pytest.mark.parametrize("device", DEVICES)
def test_nf4_swiglu_autograd_matches_torch(device):
    k, n = 128, 40
    wg = qmm.Nf4Weight.quantize(randn((n, k), 1, device))
    wu = qmm.Nf4Weight.quantize(randn((n, k), 2, device))
    x = randn((3, k), 3, device).requires_grad_()
    h = qmm.nf4_swiglu(x, wg, wu)
    dh = randn((3, n), 4, device)
    h.backward(dh)
    # PyTorch in fp64 on the same bf16 operands.
    xd = bf16(x.detach().cpu()).requires_grad_()
    gd, ud = (w.dequantize(torch.bfloat16).double().cpu() for w in (wg, wu))
    g, u = xd @ gd.t(), xd @ ud.t()
    ref = torch.nn.functional.silu(g) * u
    ref.backward(dh.cpu().double())
    # f32 sums of 128 bf16 products and f32 SwiGLU math: 2^-8 of the magnitudes involved, with room.
    scale = (xd.detach().abs() @ gd.abs().t()) * (xd.detach().abs() @ ud.abs().t())
    assert_close(h, ref, 2.0 ** -8 * scale + 1e-5, "nf4_swiglu h")
    mag = (dh.cpu().double().abs() * (xd.detach().abs() @ (gd.abs() + ud.abs()).t())) @ (gd.abs() + ud.abs())
    assert_close(x.grad, xd.grad, 2.0 ** -7 * mag + 1e-5, "nf4_swiglu dx")


def _fused_reference(x, wds, loras, bias, douts, swiglu):
    """The fused ops' outputs and gradients in fp64 by PyTorch's autograd: x, the dequantized weights (wds), each
    adapter (a, b, scale, dropout mask or None), the bias and the output gradient as fp64 leaves; returns the output
    (the SwiGLU of the two projections, or their sum) and the gradients of x, every a and b, and the bias. Run on the
    inputs' absolute values (and a mask's) without the SwiGLU, it gives the magnitudes that bound each result's
    rounding errors."""
    x = x.detach().double().requires_grad_()
    leaves, ys = [x], []
    xb = x + (bf16(x) - x).detach()  # the bf16 operand of the NF4 product, with the gradient passed through as is
    for wd, lora in zip(wds, loras):
        y = xb @ wd.t()
        if lora is not None:
            a, b, scale, mask = lora
            a, b = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
            leaves += [a, b]
            xd = x if mask is None else x * mask
            y = y + scale * (xd @ a.t()) @ b.t()
        ys.append(y)
    if bias is not None:
        bias = bias.detach().double().requires_grad_()
        leaves.append(bias)
        ys[0] = ys[0] + bias
    out = torch.nn.functional.silu(ys[0]) * ys[1] if swiglu else sum(ys)
    out.backward(douts.detach().double())
    return [out.detach()] + [t.grad for t in leaves]


def _fused_case(device, dtype, m, k, n, adapters, dropout, seed):
    """Inputs of a fused-op test: x [2, m, k] (leading dims), NF4 weights [n, k], adapters of rank 4 (float32, as
    PEFT keeps them) and, with dropout, PyTorch's mask applied to x (the adapter's input)."""
    ws = [qmm.Nf4Weight.quantize(randn((n, k), seed + i, device) * 0.5) for i in range(2)]
    x = randn((2, m, k), seed + 2, device, dtype)
    loras = []
    for i in range(adapters):
        a, b = randn((4, k), seed + 3 + i, device) * 0.2, randn((n, 4), seed + 5 + i, device) * 0.2
        mask = (torch.rand((2, m, k), generator=gen(seed + 7 + i)) > 0.25).to(dtype).to(device) / 0.75 \
            if dropout else None
        loras.append((a.requires_grad_(), b.requires_grad_(), 2.0, mask))
    return ws, x, loras + [None] * (2 - adapters)


def _fused_bounds(device, dtype, magnitudes, loras):
    """Error bounds of the fused ops' results, from their contracts, given magnitudes(abs_loras) (the results'
    magnitudes for the adapters' absolute values) and the adapters. bf16 activations: the adapter's input, A, B and
    t = xd @ A^T are each rounded to bf16 (2^-9 each, four roundings and the output's: 2^-6 of all magnitudes, with
    room). fp32 activations keep the adapter in fp32: its terms within 1e-6 of their magnitudes on the CPU's fp64
    sums, 1e-5 on the GPU's fp32 ones; only the NF4 products' bf16 operands (x, and dy in the input gradient: 2^-9;
    2^-8 on the GPU, whose small-M kernels also take the weight as bf16(code) * scale) count against the base's."""
    absolute = [None if lora is None else tuple(t.abs() if torch.is_tensor(t) else t for t in lora) for lora in loras]
    full = magnitudes(absolute)
    if dtype == torch.bfloat16:
        return [2.0 ** -6 * m + 1e-5 for m in full]
    base = magnitudes([None if a is None else (0 * a[0], 0 * a[1]) + a[2:] for a in absolute])
    rel_base, rel = (2.0 ** -8, 1e-6) if device == "cpu" else (2.0 ** -7, 1e-5)
    return [rel_base * b + rel * f + 1e-6 for b, f in zip(base, full)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 7), (7, 128, 63), (65, 192, 65), (33, 256, 96)])
@pytest.mark.parametrize("adapter,bias,dropout", [(True, True, False), (True, False, True), (False, True, False)])
def test_lora_nf4_linear_matches_reference(device, dtype, m, k, n, adapter, bias, dropout):
    """lora_nf4_linear (NF4 base, bias and adapter as one op) and its gradients in x, the bias, A and B against
    PyTorch's autograd in fp64 on the same operands, with leading dimensions, ragged shapes and LoRA dropout (x's
    mask applied by PyTorch before the op, as patch_bnb does)."""
    seed = m * 100 + k + n
    (w4, _), x, (lora, _) = _fused_case(device, dtype, m, k, n, int(adapter), dropout, seed)
    bias_t = randn((n,), seed + 9, device, dtype).requires_grad_() if bias else None
    xr = x.clone().requires_grad_()
    term = None
    if lora is not None:
        a, b, scale, mask = lora
        term = qmm.Lora(a, b, scale, None if mask is None else xr * mask)
    y = qmm.lora_nf4_linear(xr, w4, term, bias_t)
    assert y.shape == (2, m, n) and y.dtype == dtype
    dy = randn(y.shape, seed + 10, device, dtype)
    y.backward(dy)
    got = [y, xr.grad] + ([] if lora is None else [lora[0].grad, lora[1].grad]) + ([bias_t.grad] if bias else [])
    wd = [w4.dequantize(torch.bfloat16).double().cpu()]
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    ref_lora = None if lora is None else (cpu(lora[0]), cpu(lora[1]), lora[2], cpu(lora[3]))
    ref = _fused_reference(cpu(x), wd, [ref_lora], cpu(bias_t), cpu(dy), False)
    bounds = _fused_bounds(device, dtype, lambda loras: _fused_reference(
        cpu(x).abs(), [w.abs() for w in wd], loras, None if not bias else cpu(bias_t).abs(), cpu(dy).abs(), False),
        [ref_lora])
    for i, (g, r, bound) in enumerate(zip(got, ref, bounds)):
        assert g.dtype == (dtype if i in (0, 1) or (bias and i == len(got) - 1) else torch.float32)
        assert_close(g, r, bound, f"lora_nf4_linear result {i}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 7), (7, 128, 63), (65, 192, 65)])
@pytest.mark.parametrize("adapters,dropout", [(2, False), (1, True), (0, False)])
def test_lora_nf4_swiglu_matches_reference(device, dtype, m, k, n, adapters, dropout):
    """lora_nf4_swiglu (gate and up from one read of x with their adapters, then the SwiGLU) and its gradients
    against PyTorch's autograd in fp64: both adapters, the gate's alone with dropout, none."""
    seed = m * 100 + k + n + 7
    ws, x, loras = _fused_case(device, dtype, m, k, n, adapters, dropout, seed)
    xr = x.clone().requires_grad_()
    terms = [None if lora is None else qmm.Lora(lora[0], lora[1], lora[2], None if lora[3] is None else xr * lora[3])
             for lora in loras]
    h = qmm.lora_nf4_swiglu(xr, *ws, *terms)
    assert h.shape == (2, m, n) and h.dtype == dtype
    dh = randn(h.shape, seed + 10, device, dtype)
    h.backward(dh)
    got = [h, xr.grad] + [t.grad for lora in loras if lora is not None for t in lora[:2]]
    wds = [w.dequantize(torch.bfloat16).double().cpu() for w in ws]
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    ref_loras = [None if lora is None else (cpu(lora[0]), cpu(lora[1]), lora[2], cpu(lora[3])) for lora in loras]
    ref = _fused_reference(cpu(x), wds, ref_loras, None, cpu(dh), True)
    # The SwiGLU's magnitudes: with G >= |gate|, |up| (the projections' magnitudes), |silu(g)| <= |g| and
    # |silu'(g)| <= 1.1, an error e in gate or up moves h by at most 1.1 e (G + 1) and the gradients of gate and up
    # are at most 1.1 |dh| (G + 1) (with silu'' <= 0.5 for their own errors): the linear magnitudes under that
    # gradient bound the backward's, and 2.2 G (G + 1) bounds h's.
    absw = [w.abs() for w in wds]

    def magnitudes(loras):
        g_mag = _fused_reference(cpu(x).abs(), absw, loras, None, torch.ones_like(cpu(dh)), False)[0]
        mag = _fused_reference(cpu(x).abs(), absw, loras, None, 2.2 * (g_mag + 1) * cpu(dh).abs(), False)
        return [2.2 * g_mag * (g_mag + 1)] + mag[1:]
    for i, (g, r, bound) in enumerate(zip(got, ref, _fused_bounds(device, dtype, magnitudes, ref_loras))):
        assert_close(g, r, 2 * bound, f"lora_nf4_swiglu result {i}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 72), (7, 128, 63), (65, 192, 136)])
@pytest.mark.parametrize("case", ["all", "down only", "gate and up with dropout", "none"])
def test_lora_nf4_mlp_matches_reference(device, dtype, m, k, n, case):
    """lora_nf4_mlp (a whole SwiGLU block: h is not kept, the backward's SwiGLU kernel writes it again and adds the
    down adapter's share of dh) and every gradient against PyTorch's autograd in fp64 on the dequantized weights.
    The adapters' terms are about as large as the base products, so leaving one out (the down adapter's share of
    dh, its a gradient's h) moves a result by tens of percent, far over the tolerance: relative Frobenius error
    2^-5 for bf16 (a chain of bf16 roundings of O(1) values), 2^-7 for f32 (the NF4 products take bf16 operands)."""
    seed = m * 10 + k + n
    ws = [qmm.Nf4Weight.quantize(randn(shape, seed + i, device) * 0.3)
          for i, shape in enumerate(((n, k), (n, k), (k, n)))]
    x = randn((2, m, k), seed + 3, device, dtype)
    ranks = {"all": (4, 8, 16), "down only": (0, 0, 16), "gate and up with dropout": (4, 8, 0), "none": (0, 0, 0)}[case]
    params = []
    for i, (r, (out_f, in_f)) in enumerate(zip(ranks, ((n, k), (n, k), (k, n)))):
        params.append(None if r == 0 else (randn((r, in_f), seed + 10 + i, device) * 0.3,
                                           randn((out_f, r), seed + 20 + i, device) * 0.3, 1.5))
    masks = [((torch.rand((2, m, k), generator=gen(seed + 30 + i)) > 0.25).to(dtype).to(device) / 0.75
              if case == "gate and up with dropout" else None) for i in range(2)]
    dy = randn((2, m, k), seed + 40, device, dtype)

    def run(x_in, ps, wds=None):
        xr = x_in.clone().requires_grad_()
        leaves = [None if p is None else (p[0].clone().requires_grad_(), p[1].clone().requires_grad_(), p[2])
                  for p in ps]
        if wds is None:
            terms = [None if p is None else qmm.Lora(p[0], p[1], p[2], None if i == 2 or masks[i] is None
                                                     else xr * masks[i]) for i, p in enumerate(leaves)]
            y = qmm.lora_nf4_mlp(xr, *ws, *terms)
        else:  # fp64 reference
            def proj(inp, w, p, mask):
                out = inp @ w.T
                return out if p is None else out + p[2] * ((inp if mask is None else inp * mask) @ p[0].T) @ p[1].T
            g = proj(xr, wds[0], leaves[0], masks[0] if masks[0] is None else masks[0].double().cpu())
            u = proj(xr, wds[1], leaves[1], masks[1] if masks[1] is None else masks[1].double().cpu())
            y = proj(torch.nn.functional.silu(g) * u, wds[2], leaves[2], None)
        y.backward(dy if wds is None else dy.double().cpu())
        return [y, xr.grad] + [t.grad for p in leaves if p is not None for t in p[:2]]

    got = run(x, params)
    wds = [w.dequantize(torch.bfloat16).double().cpu() for w in ws]
    ref = run(x.double().cpu(), [None if p is None else (p[0].double().cpu(), p[1].double().cpu(), p[2])
                                 for p in params], wds)
    tol = 2.0 ** -5 if dtype == torch.bfloat16 else 2.0 ** -7
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape and torch.isfinite(g).all(), f"lora_nf4_mlp result {i}"
        err = (g.double().cpu() - r).norm() / r.norm().clamp_min(1e-30)
        assert err <= tol, f"lora_nf4_mlp result {i} ({case}): relative error {err:.3g} over {tol:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("down_rank", [0, 16])
@pytest.mark.parametrize("compiled", [False, True])
def test_lora_nf4_mlp_adds_a_residual(device, dtype, down_rank, compiled):
    """lora_nf4_mlp(..., residual=r) is lora_nf4_mlp(...) + r (the residual rides in the down adapter's GEMM, or is
    copied under the NF4 product without a down adapter: roundings of the sum in another order, up to a bf16 ulp of
    the largest value, 2^-7), r's gradient is the output's, exactly, and every other gradient is the one without a residual, bit for
    bit (the backward does not change); the same compiled (aot_eager, fullgraph). A residual of another shape or
    dtype is a qmm.Error."""
    if compiled and not qmm.compile_ops.AVAILABLE:
        pytest.skip("needs PyTorch >= 2.4")
    m, k, n = 65, 64, 96
    ws = mlp_weights(device, k, n)
    x, dy = randn((2, m, k), 1, device, dtype), randn((2, m, k), 3, device, dtype)
    r = randn((2, m, k), 2, device, dtype) * 4
    down = None if down_rank == 0 else (randn((down_rank, n), 6, device) * 0.3, randn((k, down_rank), 7, device) * 0.3)
    params = [(randn((4, k), 4, device) * 0.3, randn((n, 4), 5, device) * 0.3), None, down]

    def run(with_residual):
        xr, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
        leaves = [None if p is None else [t.clone().requires_grad_() for t in p] for p in params]
        loras = [None if p is None else qmm.Lora(p[0], p[1], 1.5) for p in leaves]
        fn = _compiled_afresh(qmm.lora_nf4_mlp, compiled)
        y = fn(xr, *ws, *loras, residual=rr) if with_residual else fn(xr, *ws, *loras) + rr
        y.backward(dy)
        return [y.detach(), rr.grad, xr.grad] + [t.grad for p in leaves if p is not None for t in p]

    got, ref = run(True), run(False)
    assert_close(got[0], ref[0], 2.0 ** -7 * ref[0].double().abs().max().item() + 1e-6, "output")
    assert torch.equal(got[1], dy), "residual's gradient"
    for i, (g, want) in enumerate(zip(got[2:], ref[2:])):
        assert torch.equal(g, want), f"gradient {i}"
    lora = qmm.Lora(*params[0], 1.5)
    for bad in (r[:, 1:], r.double() if dtype == torch.float32 else r.float()):
        with pytest.raises(qmm.Error, match="lora_nf4_mlp: residual"):
            qmm.lora_nf4_mlp(x, *ws, lora, residual=bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,ns", [(1, 64, (64, 16, 16)), (7, 128, (63, 65, 7)), (65, 192, (96, 32, 32))])
@pytest.mark.parametrize("unused_v", [False, True])
@pytest.mark.parametrize("dropout", [True, False])
def test_lora_nf4_linears_matches_reference(device, dtype, m, k, ns, unused_v, dropout):
    """lora_nf4_linears (an attention's q, k and v: three NF4 projections of one x, of GQA's unequal widths, as one
    op) and its gradients against PyTorch's autograd in fp64, projection by projection: q with an adapter and a
    bias, k with an adapter on dropout(x) (or, without dropout, on x: the adapters then run stacked, as one
    lora_nf4_linears op), v with neither (or, unused_v, its output given no gradient). x's gradient is the sum of
    the three projections' (each within its own bound); under torch.compile (aot_eager, fullgraph) the op gives
    the eager op's outputs and gradients bit for bit."""
    seed = m * 100 + k + sum(ns)
    ws = [qmm.Nf4Weight.quantize(randn((n, k), seed + i, device) * 0.5) for i, n in enumerate(ns)]
    x = randn((2, m, k), seed + 3, device, dtype)
    mask = (torch.rand((2, m, k), generator=gen(seed + 4)) > 0.25).to(dtype).to(device) / 0.75
    if not dropout:
        mask = None
    loras = [(randn((4, k), seed + 5, device) * 0.2, randn((ns[0], 4), seed + 6, device) * 0.2, 2.0, None),
             (randn((8, k), seed + 7, device) * 0.2, randn((ns[1], 8), seed + 8, device) * 0.2, 0.5, mask), None]
    bias = randn((ns[0],), seed + 9, device, dtype)
    dys = [randn((2, m, n), seed + 10 + i, device, dtype) for i, n in enumerate(ns)]

    def run(fn):
        xr = x.clone().requires_grad_()
        params = [t.detach().clone().requires_grad_() for lora in loras[:2] for t in lora[:2]] + \
            [bias.detach().clone().requires_grad_()]
        terms = [qmm.Lora(params[0], params[1], 2.0),
                 qmm.Lora(params[2], params[3], 0.5, None if mask is None else xr * mask), None]
        ys = fn(xr, ws, terms, [params[4], None, None])
        assert [tuple(y.shape) for y in ys] == [(2, m, n) for n in ns] and all(y.dtype == dtype for y in ys)
        used = 2 if unused_v else 3
        sum((y * dy).sum() for y, dy in zip(ys[:used], dys[:used])).backward()
        return [*ys, xr.grad] + [p.grad for p in params]
    got = run(qmm.lora_nf4_linears)
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    wds = [w.dequantize(torch.bfloat16).double().cpu() for w in ws]
    ref_loras = [None if lora is None else (cpu(lora[0]), cpu(lora[1]), lora[2], cpu(lora[3])) for lora in loras]
    biases = [cpu(bias), None, None]
    dx_ref, dx_bound = 0, 0
    for i in range(3):
        dy = cpu(dys[i]) * (0 if unused_v and i == 2 else 1)
        ref = _fused_reference(cpu(x), [wds[i]], [ref_loras[i]], biases[i], dy, False)
        bounds = _fused_bounds(device, dtype, lambda ls, i=i, dy=dy: _fused_reference(
            cpu(x).abs(), [wds[i].abs()], ls, None if biases[i] is None else biases[i].abs(), dy.abs(), False),
            [ref_loras[i]])
        assert_close(got[i], ref[0], bounds[0], f"lora_nf4_linears output {i}")
        dx_ref, dx_bound = dx_ref + ref[1], dx_bound + bounds[1]
        grads = {0: [got[4], got[5], got[8]], 1: [got[6], got[7]], 2: []}[i]
        for j, (g, r, bound) in enumerate(zip(grads, ref[2:], bounds[2:])):
            assert g.dtype == (dtype if j == 2 else torch.float32)
            assert_close(g, r, bound, f"lora_nf4_linears projection {i} gradient {j}")
    assert_close(got[3], dx_ref, dx_bound, "lora_nf4_linears dx")
    if qmm.compile_ops.AVAILABLE:
        torch._dynamo.reset()
        compiled = run(torch.compile(qmm.lora_nf4_linears, backend="aot_eager", fullgraph=True))
        for i, (c, e) in enumerate(zip(compiled, got)):
            assert torch.equal(c, e), f"compiled result {i}"


@pytest.mark.parametrize("device", DEVICES)
def test_lora_nf4_linears_leaves_an_unused_outputs_adapter_without_gradient(device):
    """Stacked adapters (no dropout) whose one output gets no gradient: that adapter's parameters get none (None, as
    unstacked ones: an optimizer leaves them alone), the others theirs, as when each projection runs alone."""
    ws = [qmm.Nf4Weight.quantize(randn((n, 64), 70 + i, device) * 0.5) for i, n in enumerate((64, 32, 32))]
    x = randn((5, 64), 73, device, torch.bfloat16)
    params = [(randn((8, 64), 80 + i, device) * 0.2).requires_grad_() for i in range(3)] + \
        [(randn((n, 8), 90 + i, device) * 0.2).requires_grad_() for i, n in enumerate((64, 32, 32))]
    ys = qmm.lora_nf4_linears(x, ws, [qmm.Lora(params[i], params[3 + i], 2.0) for i in range(3)])
    (ys[0].float().sum() + ys[1].float().sum()).backward()
    assert params[2].grad is None and params[5].grad is None
    for i in (0, 1):
        a, b = params[i].detach().clone().requires_grad_(), params[3 + i].detach().clone().requires_grad_()
        qmm.lora_nf4_linears(x, [ws[i]], [qmm.Lora(a, b, 2.0)])[0].float().sum().backward()
        assert_close(params[i].grad, a.grad, 1e-2 * a.grad.abs().max().item() + 1e-6, f"a {i}")
        assert_close(params[3 + i].grad, b.grad, 1e-2 * b.grad.abs().max().item() + 1e-6, f"b {i}")


def test_lora_nf4_linears_checks_its_arguments():
    """lora_nf4_linears (and lora_nf4_linear, for its bias) names what is wrong with its arguments before anything
    runs."""
    x = randn((3, 64), 2, "cpu")
    w4, w_other = (qmm.Nf4Weight.quantize(randn(shape, 1, "cpu")) for shape in ((32, 64), (32, 128)))
    cases = ((lambda: qmm.lora_nf4_linears(x, []), "InvalidArgument", "'weights' must be a non-empty list"),
             (lambda: qmm.lora_nf4_linears(x, [w4, w_other]), "ShapeMismatch", "share their input width"),
             (lambda: qmm.lora_nf4_linears(x, [w4, w4], [None]), "InvalidArgument", "'loras' has 1 entries for 2"),
             (lambda: qmm.lora_nf4_linears(x, [w4], biases=[None, None]), "InvalidArgument", "'biases' has 2"),
             (lambda: qmm.lora_nf4_linears(x, [w4, "w"]), "InvalidArgument", "weights[1]"),
             (lambda: qmm.lora_nf4_linears(x, [w4], [qmm.Lora(torch.zeros(4, 64), torch.zeros(16, 4), 1.0)]),
              "ShapeMismatch", "loras[0]"),
             (lambda: qmm.lora_nf4_linears(x, [w4, w4], biases=[None, torch.zeros(31)]), "ShapeMismatch",
              "'biases[1]' is [31]"),
             (lambda: qmm.lora_nf4_linear(x, w4, bias=torch.zeros(2, 32)), "ShapeMismatch", "'bias' is [2, 32]"),
             (lambda: qmm.lora_nf4_linear(x, w4, bias=torch.zeros(32, dtype=torch.int32)), "ShapeMismatch",
              "floating tensor [32]"),
             (lambda: qmm.lora_nf4_linears(x.half(), [w4]), "DTypeMismatch", "lora_nf4_linears: argument 'x' is "
              "torch.float16"),
             (lambda: qmm.lora_nf4_swiglu(x.half(), w4, w4), "DTypeMismatch", "lora_nf4_swiglu: argument 'x'"))
    for call, code, words in cases:
        with pytest.raises(qmm.Error) as e:
            call()
        assert e.value.code == code and words in str(e.value), str(e.value)


def test_fused_ops_check_their_adapters():
    """A wrong adapter is reported by the fused op, naming it, before anything runs."""
    w4 = qmm.Nf4Weight.quantize(randn((32, 64), 1, "cpu"))
    x = randn((3, 64), 2, "cpu")
    cases = ((qmm.Lora(torch.zeros(4, 32), torch.zeros(32, 4), 1.0), "ShapeMismatch", "must be [r, 64] and [32, r]"),
             (qmm.Lora(torch.zeros(4, 64), torch.zeros(32, 5), 1.0), "ShapeMismatch", "must be [r, 64] and [32, r]"),
             (qmm.Lora(torch.zeros(4, 64), torch.zeros(32, 4), float("nan")), "InvalidArgument", "scale nan"),
             (qmm.Lora(torch.zeros(4, 64), torch.zeros(32, 4), 1.0, torch.zeros(2, 64)), "ShapeMismatch",
              "x_dropped"),
             ((torch.zeros(4, 64), torch.zeros(32, 4), 1.0), "InvalidArgument", "must be a qmm.Lora"))
    for lora, code, words in cases:
        for call in (lambda: qmm.lora_nf4_linear(x, w4, lora),
                     lambda: qmm.lora_nf4_swiglu(x, w4, w4, lora)):
            with pytest.raises(qmm.Error) as e:
                call()
            assert e.value.code == code and words in str(e.value), str(e.value)
    with pytest.raises(qmm.Error) as e:
        qmm.lora_nf4_swiglu(x, w4, qmm.Nf4Weight.quantize(randn((16, 64), 3, "cpu")))
    assert e.value.code == "ShapeMismatch" and "w_up" in str(e.value)


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_linear_trains_like_torch(device):
    torch.manual_seed(0)
    w4 = qmm.Nf4Weight.quantize(randn((24, 64), 1, device))
    layer = qmm.QLoraLinear(w4, rank=4, alpha=8.0)
    with torch.no_grad():
        layer.lora.lora_b.copy_(randn((24, 4), 2, device) * 0.1)  # B starts at zero; make the adapter path count
    x = randn((6, 64), 3, device)
    y = layer(x)
    dy = randn((6, 24), 4, device)
    y.backward(dy)
    # The same layer in PyTorch on the dequantized weight, fp64.
    wd = w4.dequantize(torch.float32).double().cpu()
    a_ref = layer.lora.lora_a.detach().cpu().double().requires_grad_()
    b_ref = layer.lora.lora_b.detach().cpu().double().requires_grad_()
    xd = x.cpu().double()
    y_ref = bf16(xd) @ bf16(wd).t() + 2.0 * (xd @ a_ref.t()) @ b_ref.t()
    y_ref.backward(dy.cpu().double())
    assert_close(y, y_ref, nf4_bound(xd, bf16(wd), device, torch.float32) + 1e-5, "QLoraLinear forward")
    assert_close(layer.lora.lora_a.grad, a_ref.grad, 1e-4 * a_ref.grad.abs().max(), "lora_a grad")
    assert_close(layer.lora.lora_b.grad, b_ref.grad, 1e-4 * b_ref.grad.abs().max(), "lora_b grad")
    assert layer.lora.lora_a.grad.abs().sum() > 0 and layer.lora.lora_b.grad.abs().sum() > 0


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU")
def test_runs_on_torchs_current_stream():
    w4 = qmm.Nf4Weight.quantize(randn((256, 512), 1, "cuda"))
    a = randn((4, 512), 2, "cuda", torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c = qmm.nf4_gemm(a, w4)
        c2 = qmm.nf4_gemm(a, w4, out_dtype=torch.float32)
    side.synchronize()
    wd = w4.dequantize(torch.bfloat16).double().cpu()
    assert_close(c2, bf16(a.cpu()) @ wd.t(), nf4_bound(a.cpu(), wd, "cuda", torch.float32), "side stream")
    assert_close(c, c2, 2.0 ** -8 * c2.double().abs().cpu() + 1e-6, "side stream bf16")


def mlp_weights(device, hidden, inter):
    return [qmm.Nf4Weight.quantize(randn(shape, s, device) * 0.2)
            for s, shape in ((1, (inter, hidden)), (2, (inter, hidden)), (3, (hidden, inter)))]


@pytest.mark.parametrize("device", DEVICES)
def test_nf4_gate_up_linear_autograd(device):
    wg, wu, _ = mlp_weights(device, 64, 40)
    x = randn((2, 3, 64), 4, device).requires_grad_()
    gate, up = qmm.nf4_gate_up_linear(x, wg, wu)
    dgate = randn(gate.shape, 5, device)
    (gate * dgate).sum().backward()  # up unused: its gradient is None
    wd = wg.dequantize(torch.bfloat16).double().cpu()
    ref = bf16(dgate.cpu()) @ wd
    assert_close(x.grad, ref, nf4_bound(dgate.cpu().reshape(-1, 40), wd.t(), device, torch.float32).reshape(2, 3, 64),
                 "gate-only dx")
    assert_close(up, qmm.nf4_gemm(x.detach(), wu), 0.0, "up equals nf4_gemm")


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_swiglu_mlp_matches_torch(device):
    torch.manual_seed(0)
    hidden, inter = 64, 96
    mlp = qmm.QLoraSwiGluMlp(*mlp_weights(device, hidden, inter), rank=4, alpha=8.0)
    adapters = [mlp.gate_lora, mlp.up_lora, mlp.down.lora]
    with torch.no_grad():
        for i, ad in enumerate(adapters):
            ad.lora_b.copy_(randn(ad.lora_b.shape, 10 + i, device) * 0.1)
    x = randn((5, hidden), 4, device).requires_grad_()
    y = mlp(x)
    dy = randn((5, hidden), 5, device)
    y.backward(dy)
    # PyTorch in fp64 on the dequantized bf16 weights and the same adapters (f32 masters, widened).
    wg, wu, wd = (w.dequantize(torch.bfloat16).double().cpu() for w in (mlp.w_gate, mlp.w_up, mlp.down.weight))
    ref_ad = [(ad.lora_a.detach().cpu().double().requires_grad_(), ad.lora_b.detach().cpu().double().requires_grad_())
              for ad in adapters]
    xd = x.detach().cpu().double().requires_grad_()
    lora = lambda t, ab: 2.0 * (t @ ab[0].t()) @ ab[1].t()  # noqa: E731
    g = xd @ wg.t() + lora(xd, ref_ad[0])
    u = xd @ wu.t() + lora(xd, ref_ad[1])
    h = torch.nn.functional.silu(g) * u
    y_ref = h @ wd.t() + lora(h, ref_ad[2])
    y_ref.backward(dy.cpu().double())
    # Two chained products with f32 intermediates (gate, up and h held in f32 here, operands rounded to bf16 for the
    # NF4 GEMMs): 2^-7 of the chain's magnitudes, with room; gradients to 1e-2 of their largest entry.
    mag = (torch.nn.functional.silu(g).abs() * u.abs()) @ wd.abs().t()
    assert_close(y, y_ref, 2.0 ** -6 * mag.detach() + 1e-5, "QLoraSwiGluMlp forward")
    assert_close(x.grad, xd.grad, 1e-2 * xd.grad.abs().max(), "QLoraSwiGluMlp dx")
    for ad, (a_ref, b_ref) in zip(adapters, ref_ad):
        assert_close(ad.lora_a.grad, a_ref.grad, 1e-2 * a_ref.grad.abs().max(), "lora_a grad")
        assert_close(ad.lora_b.grad, b_ref.grad, 1e-2 * b_ref.grad.abs().max(), "lora_b grad")
        assert ad.lora_a.grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_mlp_learns_a_low_rank_change(device):
    """QLoraSwiGluMlp, trained with torch's AdamW to match the same MLP whose down projection moved by a rank-2
    change: the adapters must recover it (the loss falls below 1% of its start; 80 steps took it to ~0.03% on the
    CPU)."""
    torch.manual_seed(0)
    hidden, inter, tokens = 64, 96, 256
    mlp = qmm.QLoraSwiGluMlp(*mlp_weights(device, hidden, inter), rank=4, alpha=8.0)
    delta = (randn((hidden, 2), 4, device) @ randn((2, inter), 5, device)) * 0.05
    x = randn((tokens, hidden), 6, device)
    with torch.no_grad():
        deq = [w.dequantize(torch.float32) for w in (mlp.w_gate, mlp.w_up, mlp.down.weight)]
        target = torch.nn.functional.silu(x @ deq[0].t()) * (x @ deq[1].t()) @ (deq[2] + delta).t()
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(80):
        loss = torch.nn.functional.mse_loss(mlp(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.01 * losses[0], f"loss {losses[0]:.3g} -> {losses[-1]:.3g}"


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="needs PyTorch >= 2.4 (torch.library.custom_op)")
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_matches_eager(device):
    """The QLoRA MLP block (nf4_gate_up_linear, swiglu_autograd, nf4_linear) compiles into one graph, and its loss
    and gradients equal the eager ones (the same kernels run; PyTorch's own ops may be reordered: 1e-5 relative)."""
    torch.manual_seed(0)
    mlp = qmm.QLoraSwiGluMlp(*mlp_weights(device, 64, 96), rank=4, alpha=8.0)
    with torch.no_grad():
        for i, ad in enumerate((mlp.gate_lora, mlp.up_lora, mlp.down.lora)):
            ad.lora_b.copy_(randn(ad.lora_b.shape, 10 + i, device) * 0.1)
    x = randn((5, 64), 4, device)

    def run(fn):
        mlp.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        loss = fn(xr)
        loss.backward()
        return [loss.detach(), xr.grad] + [p.grad.clone() for p in mlp.parameters()]

    def loss_of(inp):
        return (mlp(inp) ** 2).mean()

    eager = run(loss_of)
    compiled = run(torch.compile(loss_of, backend="aot_eager", fullgraph=True))
    for e, c in zip(eager, compiled):
        assert_close(c, e, 1e-5 * e.abs().max() + 1e-7, "compiled vs eager")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU")
def test_cuda_graph_capture_after_warmup_on_the_capture_stream():
    """qmm ops inside torch.cuda.graph: warmed up once on the capture stream (which makes qmm's context for that
    stream), captured, then replayed on new inputs."""
    w4 = qmm.Nf4Weight.quantize(randn((256, 512), 1, "cuda"))
    a = randn((1, 512), 2, "cuda", torch.bfloat16)
    out = torch.empty((1, 256), dtype=torch.bfloat16, device="cuda")
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        qmm.nf4_gemm(a, w4, out=out)
    capture.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        qmm.nf4_gemm(a, w4, out=out)
    a.copy_(randn((1, 512), 3, "cuda", torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    wd = w4.dequantize(torch.bfloat16).double().cpu()
    assert_close(out, bf16(a.cpu()) @ wd.t(), nf4_bound(a.cpu(), wd, "cuda", torch.bfloat16), "graph replay")


def _with_quant_state(t, quant_state):
    t.quant_state = quant_state
    return t


class FakeLinear4bit(torch.nn.Module):
    """A bitsandbytes Linear4bit as qmm sees one: a packed uint8 weight carrying a QuantState-like quant_state. Its
    forward (counted in `calls`) is bitsandbytes' for bf16 compute: bf16(x) @ bf16(dequant(W))^T, here in fp64."""

    def __init__(self, w4, bias=None):
        super().__init__()
        self.weight = w4.codes.reshape(-1, 1).clone()
        state2 = types.SimpleNamespace(absmax=w4.absmax2, code=w4.code2, blocksize=256)
        self.weight.quant_state = types.SimpleNamespace(quant_type="nf4", absmax=w4.absmax, shape=torch.Size(w4.shape),
                                                        blocksize=w4.block_size, state2=state2,
                                                        offset=torch.tensor(w4.offset))
        self.bias = bias
        self.dequantized, self.calls = w4.dequantize(torch.bfloat16).double(), 0

    def forward(self, x):
        self.calls += 1
        y = bf16(x) @ self.dequantized.t()
        return (y if self.bias is None else y + self.bias.double()).to(x.dtype)


class FakeLora(torch.nn.Module):
    """PEFT's LoRA layer as qmm sees one (base_layer; lora_A, lora_B, lora_dropout and scaling per adapter;
    active_adapters, disable_adapters, merged, lora_variant) with PEFT's forward. B is random, not PEFT's zeros, so
    that the adapter's term shows in the output."""

    def __init__(self, base, rank, seed):
        super().__init__()
        out_features, in_features = base.weight.quant_state.shape
        device = base.weight.device
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(in_features, rank, bias=False, device=device)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(rank, out_features, bias=False, device=device)})
        with torch.no_grad():
            self.lora_A["default"].weight.copy_(randn((rank, in_features), seed, device) * 0.1)
            self.lora_B["default"].weight.copy_(randn((out_features, rank), seed + 1, device) * 0.1)
        self.lora_dropout = torch.nn.ModuleDict({"default": torch.nn.Identity()})
        self.scaling = {"default": 2.0}
        self.active_adapters, self.disable_adapters, self.merged, self.lora_variant = ["default"], False, False, {}

    def forward(self, x):
        y = self.base_layer(x)
        if self.disable_adapters or self.merged:
            return y
        for a in self.active_adapters:
            if a in self.lora_variant:
                y = self.lora_variant[a](self, x, y)
            else:
                y = y + (self.lora_B[a](self.lora_A[a](self.lora_dropout[a](x.to(torch.float32)))) *
                         self.scaling[a]).to(y.dtype)
        return y


class FakeMlp(torch.nn.Module):
    """A Hugging Face Llama/Qwen MLP on bitsandbytes-style 4-bit layers."""

    def __init__(self, weights, act=torch.nn.SiLU):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (FakeLinear4bit(w) for w in weights)
        self.act_fn = act()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("device", DEVICES)
def test_replace_bnb_mlps_in_a_model(device):
    """A model whose MLPs hold bitsandbytes-style 4-bit layers: replace_bnb_mlps swaps each MLP for a
    QLoraSwiGluMlp on the same NF4 memory (no copy); with B = 0 it computes the original MLP."""
    hidden, inter = 64, 96
    weights = mlp_weights(device, hidden, inter)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.mlp = FakeMlp(weights)
        layer.norm = torch.nn.LayerNorm(hidden)
    # bitsandbytes' quant_storage: the packed bytes may be held as another dtype (bfloat16 under FSDP).
    down = model.layers[1].mlp.down_proj
    down.weight = _with_quant_state(down.weight.reshape(-1).view(torch.bfloat16).reshape(-1, 1),
                                    down.weight.quant_state)
    codes_ptr = model.layers[1].mlp.gate_proj.weight.data_ptr()
    assert qmm.replace_bnb_mlps(model, rank=4, alpha=8.0) == ["layers.0.mlp", "layers.1.mlp"]
    mlp = model.layers[1].mlp
    assert isinstance(mlp, qmm.QLoraSwiGluMlp) and isinstance(model.layers[1].norm, torch.nn.LayerNorm)
    assert mlp.w_gate.codes.data_ptr() == codes_ptr
    x = randn((3, hidden), 1, device)
    wg, wu, wd = (w.dequantize(torch.bfloat16).double().cpu() for w in weights)
    xb = bf16(x.cpu())
    g, u = xb @ wg.t(), xb @ wu.t()
    h = torch.nn.functional.silu(g) * u
    mag = (torch.nn.functional.silu(g).abs() * u.abs()) @ wd.abs().t()
    assert_close(mlp(x), bf16(h) @ wd.t(), 2.0 ** -6 * mag + 1e-5, "replaced MLP")
    with pytest.raises(qmm.Error) as e:
        qmm.replace_bnb_mlps(torch.nn.ModuleList([FakeMlp(weights, act=torch.nn.GELU)]))
    assert e.value.code == "Unsupported" and "GELU" in str(e.value)
    biased = FakeMlp(weights)
    biased.down_proj.bias = torch.zeros(hidden, device=device)
    with pytest.raises(qmm.Error) as e:
        qmm.QLoraSwiGluMlp.from_bnb(biased)
    assert e.value.code == "Unsupported" and "down_proj" in str(e.value)


@pytest.mark.parametrize("device", DEVICES)
def test_replace_bnb_linears_keeps_weight_and_bias(device):
    w4 = qmm.Nf4Weight.quantize(randn((32, 64), 1, device))
    attn = torch.nn.Module()
    bias = randn((32,), 2, device)
    attn.q_proj, attn.o_proj = FakeLinear4bit(w4, bias=bias), FakeLinear4bit(w4)
    attn.other = FakeLinear4bit(w4)
    model = torch.nn.Module()
    model.attn = attn
    assert qmm.replace_bnb_linears(model, rank=4) == ["attn.q_proj", "attn.o_proj"]
    assert isinstance(attn.q_proj, qmm.QLoraLinear) and isinstance(attn.other, FakeLinear4bit)
    # The bias is the frozen base's: shared, not trained; the adapters are.
    assert attn.q_proj.bias.data_ptr() == bias.data_ptr() and not attn.q_proj.bias.requires_grad
    assert [n for n, p in attn.q_proj.named_parameters() if p.requires_grad] == ["lora.lora_a", "lora.lora_b"]
    x = randn((3, 64), 3, device)
    wd = w4.dequantize(torch.bfloat16).double().cpu()
    ref = bf16(x.cpu()) @ wd.t() + bias.cpu().double()  # B = 0: the adapter adds nothing yet
    assert_close(attn.q_proj(x), ref, nf4_bound(x.cpu(), wd, device, torch.float32) + 1e-5, "q_proj")
    assert_close(attn.o_proj(x), ref - bias.cpu().double(), nf4_bound(x.cpu(), wd, device, torch.float32), "o_proj")
    with pytest.raises(qmm.Error) as e:
        qmm.QLoraLinear.from_bnb(torch.nn.Linear(4, 4))
    assert e.value.code == "InvalidArgument"


def _lora_model(device, hidden=64, inter=96):
    """A PEFT-style QLoRA model: a LoRA-wrapped 4-bit q_proj with a bias, then an MLP whose three projections are
    LoRA-wrapped 4-bit layers."""
    mlp = FakeMlp(mlp_weights(device, hidden, inter))
    for i, p in enumerate(("gate_proj", "up_proj", "down_proj")):
        setattr(mlp, p, FakeLora(getattr(mlp, p), 4, 10 + 2 * i))
    w_q = qmm.Nf4Weight.quantize(randn((hidden, hidden), 4, device) * 0.2)
    q = FakeLinear4bit(w_q, bias=randn((hidden,), 5, device))
    return torch.nn.Sequential(FakeLora(q, 4, 20), mlp)


@pytest.mark.parametrize("down_dropout", [False, True])
def test_patch_bnb_runs_the_mlp_as_one_block_unless_down_has_dropout(monkeypatch, down_dropout):
    """A patched MLP whose down_proj is an NF4 LoRA layer without dropout runs as lora_nf4_mlp (h not kept); with
    dropout on down_proj's adapter, lora_nf4_swiglu then down_proj's own patched forward (its adapter needs the
    dropped-out h); both match the unpatched model."""
    model = _lora_model("cpu")
    if down_dropout:
        model[1].down_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    x, dy = randn((2, 5, 64), 6, "cpu"), randn((2, 5, 64), 7, "cpu")
    torch.manual_seed(3)
    ref = _forward_backward(model, x, dy)
    calls = {"mlp": 0, "swiglu": 0}
    for name, key in (("lora_nf4_mlp", "mlp"), ("lora_nf4_swiglu", "swiglu")):
        real = getattr(qmm.patch, name)
        monkeypatch.setattr(qmm.patch, name, lambda *a, _r=real, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1)
                            or _r(*a, **k))
    qmm.patch_bnb(model)
    torch.manual_seed(3)
    got = _forward_backward(model, x, dy)
    assert calls == ({"mlp": 0, "swiglu": 1} if down_dropout else {"mlp": 1, "swiglu": 0})
    _assert_near(got, ref, 2.0 ** -6, "patched MLP block")


def _forward_backward(model, x, dy, params_of=None):
    """The model's output, x's gradient and the LoRA parameters' gradients (of `params_of`, by default the model)
    for the loss sum(y * dy)."""
    x = x.detach().clone().requires_grad_()
    y = model(x)
    (y.double() * dy.double()).sum().backward()
    params = [p for n, p in (params_of or model).named_parameters() if "lora_" in n]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return [y.detach(), x.grad] + grads


def _assert_near(got, ref, rel, what, rel_grads=2.0 ** -6):
    """got's output within rel, its gradients within rel_grads, of their reference's largest magnitude."""
    for i, (g, r) in enumerate(zip(got, ref)):
        bound = (rel if i == 0 else rel_grads) * r.double().abs().max().item() + 1e-7
        assert_close(g, r, bound, f"{what}, tensor {i}")


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_runs_a_peft_model_with_qmm(device, monkeypatch):
    """patch_bnb on a PEFT-style model: the same outputs and gradients as the model's own forward (every 4-bit
    product then by qmm, none by the layers), the same parameters; unpatch_bnb restores the forwards. The reference
    rounds x and W to bf16 as bitsandbytes does, so the outputs differ by the sums' precision: fp64 on the CPU (1e-6
    of the largest value), fp32 sums and the scale-after contract's weights on the GPU (2^-9 per weight; 2^-6 of the
    largest value, with room for two layers). In the backward qmm also rounds the output gradients to bf16 (2^-9
    per element, over sums that cancel): 2^-6 of the largest gradient on either device."""
    model = _lora_model(device)
    x, dy = randn((2, 5, 64), 6, device), randn((2, 5, 64), 7, device)
    ref = _forward_backward(model, x, dy)
    params = dict(model.named_parameters())
    names = qmm.patch_bnb(model)
    assert names == ["0", "0.base_layer", "1", "1.gate_proj", "1.gate_proj.base_layer", "1.up_proj",
                     "1.up_proj.base_layer", "1.down_proj", "1.down_proj.base_layer"]
    assert qmm.patch_bnb(model) == []  # patched once only
    bases = [model[0].base_layer] + [getattr(model[1], p).base_layer for p in ("gate_proj", "up_proj", "down_proj")]
    calls = [b.calls for b in bases]
    rel = 1e-6 if device == "cpu" else 2.0 ** -6
    _assert_near(_forward_backward(model, x, dy), ref, rel, "patched")
    assert [b.calls for b in bases] == calls, "a 4-bit product ran in the layer's own forward, not in qmm"
    assert dict(model.named_parameters()) == params

    # What qmm does not cover runs the layers' own forwards: a LoRA variant (DoRA) on gate_proj makes the MLP fall
    # back (its bases stay qmm's); float16 activations make a layer fall back.
    model[1].gate_proj.lora_variant = {"default": lambda layer, x, y: y + 3 * layer.lora_B["default"](
        layer.lora_A["default"](x))}
    with pytest.warns(UserWarning, match="LoRA variant"):  # the fallback says why
        varied = _forward_backward(model, x, dy)
    qmm.unpatch_bnb(model)
    _assert_near(varied, _forward_backward(model, x, dy), rel, "LoRA variant")
    model[1].gate_proj.lora_variant = {}
    qmm.patch_bnb(model)
    calls = [b.calls for b in bases]
    with pytest.warns(UserWarning, match="torch.float16 activations"):
        y16 = model[0](x.half())  # (PyTorch's CPU SiLU takes no float16: the MLP is not run)
    assert y16.dtype == torch.float16 and [b.calls for b in bases] == [calls[0] + 1] + calls[1:]

    # Adapters disabled (PEFT's disable_adapter): the MLP's SwiGLU runs in the gate/up kernel's epilogue.
    for m in model.modules():
        if isinstance(m, FakeLora):
            m.disable_adapters = True
    outputs_asked, gate_up = [], qmm._qmm.nf4_gate_up
    monkeypatch.setattr(qmm._qmm, "nf4_gate_up",
                        lambda *a, **k: outputs_asked.append([t is not None for t in a[3:6]]) or gate_up(*a, **k))
    y_plain = model(x)
    assert outputs_asked == [[False, False, True]]  # h alone, from the kernel's epilogue
    qmm.unpatch_bnb(model)
    assert_close(y_plain, model(x), rel * model(x).abs().max().item() + 1e-7, "adapters disabled")
    qmm.patch_bnb(model)
    for m in model.modules():
        if isinstance(m, FakeLora):
            m.disable_adapters = False

    assert qmm.unpatch_bnb(model) == names
    assert all("forward" not in m.__dict__ and "_qmm_patch" not in m.__dict__ for m in model.modules())
    _assert_near(_forward_backward(model, x, dy), ref, 0.0, "unpatched", rel_grads=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_with_several_adapters_or_a_biased_lora_b(device):
    """Two active adapters on one layer, or a lora_B with a bias (PEFT's lora_bias): qmm computes the base product
    and adds the adapters as PEFT does; the outputs and gradients are the unpatched model's (to
    test_patch_bnb_runs_a_peft_model_with_qmm's tolerances), and no 4-bit product runs in the layers."""
    model = _lora_model(device)
    for i, layer in enumerate((model[0], model[1].gate_proj)):
        out_features, in_features = layer.base_layer.weight.quant_state.shape
        layer.lora_A["second"] = torch.nn.Linear(in_features, 2, bias=False, device=device)
        layer.lora_B["second"] = torch.nn.Linear(2, out_features, bias=False, device=device)
        layer.lora_dropout["second"], layer.scaling["second"] = torch.nn.Identity(), 0.5
        with torch.no_grad():
            layer.lora_B["second"].weight.copy_(randn((out_features, 2), 60 + i, device) * 0.1)
        layer.active_adapters = ["default", "second"]
    up = model[1].up_proj
    up.lora_B["default"] = torch.nn.Linear(4, 96, bias=True, device=device)
    x, dy = randn((2, 5, 64), 6, device), randn((2, 5, 64), 7, device)
    ref = _forward_backward(model, x, dy)
    qmm.patch_bnb(model)
    bases = [m.base_layer for m in model.modules() if isinstance(m, FakeLora)]
    rel = 1e-6 if device == "cpu" else 2.0 ** -6
    _assert_near(_forward_backward(model, x, dy), ref, rel, "several adapters")
    assert all(b.calls == 1 for b in bases), "a 4-bit product ran in the layer's own forward, not in qmm"


class LlamaAttention(torch.nn.Module):
    """A Hugging Face attention as patch_bnb sees one (the class name it recognizes; q_proj, k_proj, v_proj and
    o_proj on 4-bit layers): q, k and v of the hidden states (GQA: k and v narrower), a stand-in for the attention
    itself, o_proj. `reproject` makes the forward call k_proj on a copy of the hidden states instead."""

    def __init__(self, device, hidden=64, kv=32, bias=False):
        super().__init__()
        shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                  "o_proj": (hidden, hidden)}
        for i, (name, shape) in enumerate(shapes.items()):
            w4 = qmm.Nf4Weight.quantize(randn(shape, 30 + i, device) * 0.2)
            b = randn((shape[0],), 40 + i, device) if bias and name != "o_proj" else None
            setattr(self, name, FakeLora(FakeLinear4bit(w4, bias=b), 4, 50 + 2 * i))
        self.reproject = False

    def forward(self, hidden_states, position_embeddings=None):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states * 1 if self.reproject else hidden_states)
        v = self.v_proj(hidden_states)
        mixed = q * torch.cat([k, v], dim=-1).tanh()
        return self.o_proj(mixed), None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_patch_bnb_computes_an_attentions_q_k_v_as_one_op(device, bias, monkeypatch):
    """patch_bnb on a Llama-style attention over PEFT-style 4-bit layers: q, k and v run as one lora_nf4_linears call
    handed to the projections, with the outputs and gradients of the unpatched module (to
    test_patch_bnb_runs_a_peft_model_with_qmm's tolerances) and no 4-bit product left to the layers. Where the grouped
    op does not cover the projections (two adapters on k_proj) or the forward calls one on another tensor, each
    projection computes for itself, with the same results; fuse_qkv=False leaves the attention alone."""
    attn = LlamaAttention(device, bias=bias)
    x, dy = randn((2, 5, 64), 6, device), randn((2, 5, 64), 7, device)

    def run(module):
        return _forward_backward(lambda t: module(t)[0], x, dy, params_of=module)
    ref = run(attn)
    grouped, single, linears, linear = [], [], qmm.patch.lora_nf4_linears, qmm.patch.lora_nf4_linear
    monkeypatch.setattr(qmm.patch, "lora_nf4_linears", lambda *a, **k: grouped.append(1) or linears(*a, **k))
    monkeypatch.setattr(qmm.patch, "lora_nf4_linear", lambda *a, **k: single.append(1) or linear(*a, **k))
    assert "" in qmm.patch_bnb(attn)
    bases = [getattr(attn, p).base_layer for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    calls = [b.calls for b in bases]
    rel = 1e-6 if device == "cpu" else 2.0 ** -6
    _assert_near(run(attn), ref, rel, "q, k, v as one op")
    assert len(grouped) == 1 and [b.calls for b in bases] == calls, "not one grouped op, or a 4-bit product in a layer"
    assert len(single) == 1, "q, k or v computed again by its own projection (o_proj's is the one single call)"
    assert not qmm.patch._precomputed  # nothing handed over is left behind

    attn.reproject = True  # k_proj called on another tensor: it computes for itself
    _assert_near(run(attn), ref, rel, "k_proj on another tensor")
    assert len(grouped) == 2 and len(single) == 3 and not qmm.patch._precomputed  # o_proj's and k_proj's own
    attn.reproject = False
    k = attn.k_proj
    k.lora_A["second"] = torch.nn.Linear(64, 2, bias=False, device=device)
    k.lora_B["second"] = torch.nn.Linear(2, 32, bias=False, device=device)
    k.lora_dropout["second"], k.scaling["second"] = torch.nn.Identity(), 0.5
    torch.nn.init.zeros_(k.lora_B["second"].weight)  # a second adapter adding nothing: the same results
    k.active_adapters = ["default", "second"]
    _assert_near(run(attn)[:2], ref[:2], rel, "two adapters on k_proj")  # (its parameters' list is longer)
    assert len(grouped) == 2, "the grouped op took a projection with two adapters"
    k.active_adapters = ["default"]
    del k.lora_A["second"], k.lora_B["second"]
    qmm.unpatch_bnb(attn)
    qmm.patch_bnb(attn, fuse_qkv=False)
    _assert_near(run(attn), ref, rel, "fuse_qkv=False")
    assert len(grouped) == 2 and "_qmm_patch" not in attn.__dict__
    qmm.unpatch_bnb(attn)


@pytest.mark.parametrize("device", DEVICES)
def test_patch_bnb_follows_a_replaced_weight_and_keeps_hooks(device):
    """A patched layer reads its weight as it is at the call (bitsandbytes quantizes on .to(device), PEFT's merge
    writes a new one); accelerate's hooks (a forward wrapper calling _old_forward) stay in place and are called."""
    w_a, w_b = (qmm.Nf4Weight.quantize(randn((48, 64), s, device)) for s in (1, 2))
    layer = FakeLinear4bit(w_a)
    hook_calls = []

    def hooked(x):
        hook_calls.append(x.shape)
        return layer._old_forward(x)
    layer._old_forward, layer.forward = layer.forward, hooked
    assert qmm.patch_bnb(layer) == [""]
    x = randn((3, 64), 3, device)
    for w in (w_a, w_b):
        fresh = FakeLinear4bit(w)
        layer.weight = fresh.weight
        expected = fresh(x)
        assert_close(layer(x), expected, 2.0 ** -7 * expected.abs().max().item(), "patched layer")
        assert layer.calls == 0 and len(hook_calls) == (1 if w is w_a else 2)
    qmm.unpatch_bnb(layer)
    assert layer.forward is hooked and layer._old_forward.__func__ is FakeLinear4bit.forward


def _compile_test_model(device, dropout):
    """Three PEFT-style LoRA layers on 4-bit bases of different double-quantization offsets (one with a bias), then
    an MLP whose projections are all LoRA-wrapped; with `dropout`, LoRA dropout on every adapter."""
    layers = [FakeLora(FakeLinear4bit(qmm.Nf4Weight.quantize(randn((64, 64), 30 + i, device)),
                                      bias=randn((64,), 50, device) if i == 1 else None), 4, 40 + 2 * i)
              for i in range(3)]
    model = torch.nn.Sequential(*layers, _lora_model(device)[1])
    for m in model.modules():
        if isinstance(m, FakeLora) and dropout:
            m.lora_dropout["default"] = torch.nn.Dropout(dropout)
    return model


def _graph_breaks():
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def _compiled_afresh(fn, compiled):
    """fn compiled (aot_eager, fullgraph) after resetting dynamo and its graph-break count; fn itself otherwise."""
    if not compiled:
        return fn
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_patch_bnb_compiles_whole_and_equals_eager(device, dropout):
    """A patched PEFT-style model (LoRA layers with a bias, the fused MLP, LoRA dropout) under
    torch.compile(fullgraph=True): no graph break, and the output, x's gradient and every LoRA gradient equal the
    eager ones bit for bit (the same kernels in the same order; aot_eager runs PyTorch's own ops, dropout included,
    as eager does, from the same seed)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    model = _compile_test_model(device, dropout)
    assert len({m.base_layer.weight.quant_state.offset.item() for m in model[:3]}) == 3
    qmm.patch_bnb(model)
    x, dy = randn((2, 5, 64), 6, device), randn((2, 5, 64), 7, device)
    torch.manual_seed(3)
    eager = _forward_backward(model, x, dy)
    torch.manual_seed(3)
    compiled = _forward_backward(torch.compile(model, backend="aot_eager", fullgraph=True), x, dy)
    assert _graph_breaks() == 0
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    calls = [m.base_layer.calls for m in model.modules() if isinstance(m, FakeLora)]
    assert calls == [0] * len(calls), "a 4-bit product ran in the layer's own forward, not in qmm"


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
def test_compiled_ops_reuse_a_weight_made_once_and_follow_a_replaced_one(monkeypatch):
    """The custom ops get a layer's same weight tensors at every call of a compiled model: its Nf4Weight is made at
    the first call only; a weight bitsandbytes replaces (new tensors) gets a new one, and the old one is let go."""
    torch._dynamo.reset()
    model = _compile_test_model("cpu", 0.0)[:3]
    qmm.patch_bnb(model)
    made = []
    init = qmm.nf4.Nf4Weight.__init__
    monkeypatch.setattr(qmm.nf4.Nf4Weight, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, dy = randn((5, 64), 6, "cpu"), randn((5, 64), 7, "cpu")
    _forward_backward(compiled, x, dy)
    assert len(made) == 3
    made.clear()
    _forward_backward(compiled, x, dy)
    assert made == []
    before = _forward_backward(compiled, x, dy)
    old_key = id(model[1].base_layer.weight)  # the ops take a uint8 weight itself as the codes
    assert old_key in qmm.compile_ops._weights
    model[1].base_layer.weight = FakeLinear4bit(qmm.Nf4Weight.quantize(randn((64, 64), 77, "cpu"))).weight
    assert qmm.patch_bnb(model) == []  # reads the new weight's offset (and patches nothing again)
    gc.collect()
    made.clear()
    assert old_key not in qmm.compile_ops._weights, "the replaced weight's entry outlived it"
    got = _forward_backward(compiled, x, dy)
    assert len(made) == 1 and id(model[1].base_layer.weight) in qmm.compile_ops._weights
    eager = _forward_backward(model, x, dy)
    assert all(torch.equal(g, e) for g, e in zip(got, eager)) and not torch.equal(got[0], before[0])


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
def test_compiled_backward_finds_the_forward_weight_without_its_offset():
    """A backward op takes the NF4 weight's tensors without the offset (a CPU tensor saved for the backward would be
    an output of the compiled forward, which CUDA-graph replay refuses): it finds the forward's Nf4Weight, offset
    included, also through another view of the codes, and refuses tensors no forward has seen."""
    w = qmm.Nf4Weight.quantize(randn((64, 32), 81, "cpu"))
    args = w.op_args()
    assert args[4].item() == w.offset != 0.0
    made = qmm.compile_ops.weight_of(*args)
    codes, absmax, absmax2, code2, _, rows, cols, block_size = args
    assert qmm.compile_ops.saved_weight_of(codes, absmax, absmax2, code2, rows, cols, block_size) is made
    alias = codes.view(codes.shape)
    found = qmm.compile_ops.saved_weight_of(alias, absmax, absmax2, code2, rows, cols, block_size)
    assert found is made and found.offset == w.offset
    other = qmm.Nf4Weight.quantize(randn((64, 32), 82, "cpu")).op_args()
    with pytest.raises(qmm.Error) as e:
        qmm.compile_ops.saved_weight_of(other[0], other[1], other[2], other[3], rows, cols, block_size)
    assert e.value.code == "InvalidArgument" and "forward did not run" in str(e.value)


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
@pytest.mark.parametrize("device", DEVICES)
def test_patched_layers_compiled_one_by_one_share_a_graph(device):
    """Each decoder layer compiled as its own region (as Unsloth does): layers of one shape share one compiled
    graph, forward and backward, with no recompilation for their weights' different offsets (which the custom ops
    take as a tensor, not as a float the graph would specialize on)."""
    torch._dynamo.reset()
    model = _compile_test_model(device, 0.0)
    qmm.patch_bnb(model)
    x, dy = randn((5, 64), 6, device), randn((5, 64), 7, device)
    eager = [_forward_backward(layer, x, dy) for layer in (model[0], model[2])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        region = torch.compile(lambda layer, inp: layer(inp), backend="aot_eager", fullgraph=True)
        compiled = [_forward_backward(functools.partial(region, layer), x, dy, layer) for layer in (model[0], model[2])]
    for c, e in zip(compiled, eager):
        assert all(torch.equal(a, b) for a, b in zip(c, e))


@pytest.mark.parametrize("device", DEVICES)
def test_copy_and_pickle_of_nf4_modules(device):
    """copy.deepcopy and torch.save/torch.load of a module holding Nf4Weights (a reference model, a whole-model
    checkpoint): the copy has its own tensors and computes the same output, bit for bit."""
    mlp = qmm.QLoraSwiGluMlp(*mlp_weights(device, 64, 96), rank=4)
    x = randn((3, 64), 1, device)
    buf = io.BytesIO()
    torch.save(mlp, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(mlp), torch.load(buf, weights_only=False)):
        assert copied.w_gate.codes.data_ptr() != mlp.w_gate.codes.data_ptr()
        assert copied.w_gate.offset == mlp.w_gate.offset and copied.w_gate.device == mlp.w_gate.device
        assert torch.equal(copied(x), mlp(x))


@pytest.mark.parametrize("device", DEVICES)
def test_inference_calls_skip_autograd_and_unneeded_outputs(device, monkeypatch):
    """Without a gradient to compute (torch.no_grad, or inputs that need none) the differentiable ops give the same
    values with no autograd graph: bit for bit on the CPU, within 1e-6 relative on the GPU (a kernel storing fewer
    outputs may take another epilogue). nf4_swiglu then asks the kernel for h alone (gate and up are kept only for
    a backward)."""
    wg, wu, _ = mlp_weights(device, 64, 96)
    x = randn((3, 64), 1, device).requires_grad_()
    g, u = randn((3, 96), 2, device).requires_grad_(), randn((3, 96), 3, device).requires_grad_()

    def run():
        return [qmm.nf4_linear(x, wg), *qmm.nf4_gate_up_linear(x, wg, wu), qmm.nf4_swiglu(x, wg, wu),
                qmm.swiglu_autograd(g, u)]

    outputs_asked, gate_up = [], qmm._qmm.nf4_gate_up
    monkeypatch.setattr(qmm._qmm, "nf4_gate_up",
                        lambda *a, **k: outputs_asked.append([t is not None for t in a[3:6]]) or gate_up(*a, **k))
    trained = run()
    assert all(t.grad_fn is not None for t in trained)
    assert outputs_asked == [[True, True, False], [True, True, True]]
    outputs_asked.clear()
    with torch.no_grad():
        inferred = run()
    assert all(t.grad_fn is None for t in inferred)
    for t, r in zip(inferred, trained):
        assert_close(t, r.detach(), 0.0 if device == "cpu" else 1e-6 * r.abs().max().item(), "no_grad")
    assert outputs_asked == [[True, True, False], [False, False, True]]


def test_model_level_calls_check_their_arguments_up_front():
    """A wrong model or path is reported when given, naming the call and the argument, not at a later forward."""
    w4 = qmm.Nf4Weight.quantize(randn((32, 64), 1, "cpu"))
    for call, what in ((lambda: qmm.patch_bnb(torch.nn.Linear(2, 2), path="fastest"), "patch_bnb: path"),
                       (lambda: qmm.QLoraLinear(w4, path="fastest"), "QLoraLinear: path"),
                       (lambda: qmm.QLoraSwiGluMlp(w4, w4, qmm.Nf4Weight.quantize(randn((64, 32), 2, "cpu")),
                                                   path="fastest"), "QLoraSwiGluMlp: path"),
                       (lambda: qmm.patch_bnb("model"), "patch_bnb: argument 'model'"),
                       (lambda: qmm.unpatch_bnb(None), "unpatch_bnb: argument 'model'"),
                       (lambda: qmm.replace_bnb_mlps([]), "replace_bnb_mlps: argument 'model'")):
        with pytest.raises(qmm.Error) as e:
            call()
        assert e.value.code == "InvalidArgument" and str(e.value).startswith(what), str(e.value)


@pytest.mark.parametrize("device", DEVICES)
def test_nf4_modules_move_with_to_and_keep_their_format_under_dtype_casts(device):
    """QLoraSwiGluMlp.to(device) moves its NF4 bases with its adapters (a CPU-built block then runs on the GPU and
    computes what it computed on the CPU, to the GPU's bound); dtype casts change the adapters only."""
    mlp = qmm.QLoraSwiGluMlp(*mlp_weights("cpu", 64, 96), rank=4)
    with torch.no_grad():
        for ad in (mlp.gate_lora, mlp.up_lora, mlp.down.lora):
            ad.lora_b.copy_(randn(ad.lora_b.shape, 3, "cpu") * 0.1)
    x = randn((3, 64), 1, "cpu")
    expected = mlp(x)
    codes = mlp.w_gate.codes
    mlp.to(torch.float64)
    assert mlp.w_gate.codes is codes and mlp.w_gate.absmax2.dtype == torch.float32
    assert mlp.gate_lora.lora_a.dtype == torch.float64
    mlp.to(torch.float32).to(device)
    assert all(w.device.type == device for w in (mlp.w_gate, mlp.w_up, mlp.down.weight))
    assert (mlp.w_gate.codes is codes) == (device == "cpu")
    got = mlp(x.to(device))
    assert_close(got, expected, (1e-6 if device == "cpu" else 2.0 ** -6) * expected.abs().max().item() + 1e-7, "moved")


# ---- linear_cross_entropy ------------------------------------------------------------------------------------------


def test_linear_cross_entropy_matches_torch():
    """The fused head + loss on the CPU backend (fp64 sums) against PyTorch's cross_entropy of the fp64 logits, rounded
    to bf16 for bf16 inputs as the op's contract says (ignore index, int64 labels), its dh against autograd's (through
    the rounding) and dw accumulated (or, with accumulate_dw=False, written over NaN); and against what PyTorch
    users get (bf16 logits upcast to fp32)."""
    for dtype, t, hid, vocab in ((torch.float32, 7, 16, 63), (torch.bfloat16, 65, 32, 130), (torch.float32, 1, 3, 1)):
        h, w = randn((t, hid), 1, "cpu", dtype), randn((vocab, hid), 2, "cpu", dtype)
        labels = torch.randint(0, vocab, (t,), generator=gen(3))
        labels[1::3] = -100
        dw = torch.ones((vocab, hid))
        loss, dh = qmm.linear_cross_entropy(h, w, labels, dh=True, dw=dw)
        hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
        z = hd @ wd.t()
        if dtype == torch.bfloat16:  # rounded in the forward, the identity in the backward
            z = z + (z.float().bfloat16().double() - z).detach()
        ref = torch.nn.functional.cross_entropy(z, labels, ignore_index=-100)
        ref.backward()
        assert loss.dtype == torch.float32 and loss.shape == ()
        assert abs(loss.item() - ref.item()) <= 1e-6 * (1 + abs(ref.item()))
        assert_close(dh, hd.grad, (2.0 ** -8 if dtype == torch.bfloat16 else 1e-6) * hd.grad.abs() + 1e-7, "dh")
        assert_close(dw, 1 + wd.grad, 1e-6, "dw accumulated")
        written = torch.full((vocab, hid), float("nan"))
        qmm.linear_cross_entropy(h, w, labels, dw=written, accumulate_dw=False)
        assert_close(written, wd.grad, 1e-6, "dw written")
        users = torch.nn.functional.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100)
        logit_bound = (2.0 ** -8 if dtype == torch.bfloat16 else 1e-6) * (h.double().abs() @ w.double().abs().t()).max()
        assert abs(loss.item() - users.item()) <= 2 * logit_bound.item() + 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_pending_label_check_finds_the_first_label_out_of_range(device):
    """The patched causal LM's label check, started with the labels and read at the loss (on a GPU through pinned
    memory and an event, so the step never waits for its forward pass): the first label in row-major order that is
    neither in [0, vocab) nor the ignore index, with its index in the labels' own shape; None when all are fine."""
    labels = torch.tensor([[1, 2, -100, 3], [4, 5, 6, 7]], device=device)
    assert qmm._impl.PendingLabelCheck(labels, 8, -100).first_bad() is None
    assert qmm._impl.PendingLabelCheck(labels, 7, -100).first_bad() == ((1, 3), 7)
    assert qmm._impl.PendingLabelCheck(labels, 8, 1).first_bad() == ((0, 2), -100)
    view = labels[:, 1:]  # not contiguous, as the patch passes it
    assert qmm._impl.PendingLabelCheck(view, 6, -100).first_bad() == ((1, 1), 6)
    pending = qmm._impl.PendingLabelCheck(labels, 8, -100)
    labels[0, 0] = 99  # changed after the check started: the check sees the labels as they were
    assert pending.first_bad() is None


def test_linear_cross_entropy_loss_unchecked_labels_give_a_nan_loss():
    h, w = randn((4, 8), 1, "cpu").requires_grad_(), randn((10, 8), 2, "cpu")
    bad = torch.tensor([1, 2, 10, 3])
    _expect_error("InvalidArgument", "labels[2] is 10", lambda: qmm.linear_cross_entropy_loss(h, w, bad))
    for flag in ("no", 0, None):
        _expect_error("InvalidArgument", "check_labels must be True or False",
                      lambda: qmm.linear_cross_entropy_loss(h, w, bad, check_labels=flag))
        _expect_error("InvalidArgument", "linear_cross_entropy: check_labels",
                      lambda: qmm.linear_cross_entropy(h, w, bad, check_labels=flag))
        _expect_error("InvalidArgument", "linear_cross_entropy: accumulate_dw",
                      lambda: qmm.linear_cross_entropy(h, w, bad, accumulate_dw=flag))
    loss = qmm.linear_cross_entropy_loss(h, w, bad, check_labels=False)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.isnan(h.grad[2]).all() and torch.isfinite(h.grad[[0, 1, 3]]).all()


def test_linear_cross_entropy_bad_input_and_all_ignored():
    h, w = randn((4, 8), 1, "cpu"), randn((10, 8), 2, "cpu")
    loss, dh = qmm.linear_cross_entropy(h, w, torch.full((4,), -100), dh=True)
    assert loss.item() == 0.0 and (dh == 0).all()  # every token ignored: 0, with a defined (zero) gradient
    _expect_error("InvalidArgument", "labels[2] is 10",
                  lambda: qmm.linear_cross_entropy(h, w, torch.tensor([1, 2, 10, 3])))
    # Unchecked (nothing waits for the device): a NaN loss, NaN in that token's dh row only.
    loss, dh = qmm.linear_cross_entropy(h, w, torch.tensor([1, 2, 10, 3]), dh=True, check_labels=False)
    assert torch.isnan(loss) and torch.isnan(dh[2]).all() and torch.isfinite(dh[[0, 1, 3]]).all()
    _expect_error("ShapeMismatch", "labels is [3]", lambda: qmm.linear_cross_entropy(h, w, torch.tensor([1, 2, 3])))
    _expect_error("DTypeMismatch", "labels", lambda: qmm.linear_cross_entropy(h, w, torch.ones(4)))
    _expect_error("ShapeMismatch", "w must be [V, H]", lambda: qmm.linear_cross_entropy(h, w[:, :7], torch.zeros(4)))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_loss_autograd_in_any_chunking(device):
    """The differentiable loss (h [B, S, H] flattened, w a trained head) against PyTorch's cross_entropy of the fp64
    logits, loss and both gradients, with qmm's own chunking and chunks of 5 tokens (a GPU then runs 5 chunks, the
    last ragged; the CPU backend takes the whole at once): f32, so fp32 sums' reordering only (1e-5 relative on
    the loss, 1e-4 of the largest gradient); a loss scaled by 2.5 and backpropagated twice gives 2.5 times the
    gradients both times. A negative chunk is a qmm.Error."""
    g = gen(11)
    h = (torch.randn((3, 7, 16), generator=g)).to(device)
    w = (torch.randn((40, 16), generator=g) * 0.25).to(device)
    labels = torch.randint(0, 40, (3, 7), generator=g)
    labels[:, ::4] = -100
    hd, wd = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    ref = torch.nn.functional.cross_entropy((hd.reshape(-1, 16) @ wd.t()), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    for chunk in (0, 5):
        hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = qmm.linear_cross_entropy_loss(hq, wq, labels.to(device), chunk_tokens=chunk)
        loss.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), chunk
        for got, want, name in ((hq.grad, hd.grad, "dh"), (wq.grad, wd.grad, "dw")):
            assert (got.cpu().double() - want).abs().max() <= 1e-4 * want.abs().max(), (name, chunk)
    # A scaled loss, backpropagated twice through one graph: the saved gradients are scaled in copies
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = 2.5 * qmm.linear_cross_entropy_loss(hq, wq, labels.to(device))
    loss.backward(retain_graph=True)
    first = (hq.grad.clone(), wq.grad.clone())
    hq.grad, wq.grad = None, None
    loss.backward()
    assert torch.equal(hq.grad, first[0]) and torch.equal(wq.grad, first[1])
    for got, want in ((hq.grad, hd.grad), (wq.grad, wd.grad)):
        assert (got.cpu().double() - 2.5 * want).abs().max() <= 2.5e-4 * want.abs().max()
    _expect_error("InvalidArgument", "chunk_tokens is -1",
                  lambda: qmm.linear_cross_entropy_loss(h, w, labels.to(device), chunk_tokens=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_in_vocabulary_chunks(device):
    """dh without dw, the vocabulary in chunks (a GPU keeps each row's running maximum and sum and dh's f32
    accumulator over them; the CPU backend takes the whole at once), against PyTorch's cross_entropy of the fp64
    logits: chunks of 7 columns and 5 tokens (both ragged), one column, and qmm's own choice; a planted logit near 40
    in the last column makes two rows' maximum jump there (one's label there, the other's in the first chunk); the
    differentiable loss with a frozen head, eager and compiled. f32: 1e-5 relative on the loss, 1e-4 of the largest
    gradient. A negative chunk_vocab is a qmm.Error."""
    g = gen(12)
    h = torch.randn((21, 16), generator=g)
    w = torch.randn((40, 16), generator=g) * 0.25
    h[2] = h[1]
    w[39] = 40 * h[1] / h[1].dot(h[1])
    labels = torch.randint(0, 40, (21,), generator=g)
    labels[::4], labels[1], labels[2] = -100, 39, 0
    ref_h = h.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_h @ w.double().t(), labels, ignore_index=-100)
    ref.backward()
    h, w = h.to(device), w.to(device)
    for chunk_tokens, chunk_vocab in ((5, 7), (0, 1), (0, 0)):
        loss, dh = qmm.linear_cross_entropy(h, w, labels.to(device), dh=True, chunk_tokens=chunk_tokens,
                                            chunk_vocab=chunk_vocab)
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), chunk_vocab
        assert (dh.cpu().double() - ref_h.grad).abs().max() <= 1e-4 * ref_h.grad.abs().max(), chunk_vocab
    # The differentiable loss with a frozen head, the same split
    hq = h.clone().requires_grad_()
    loss = qmm.linear_cross_entropy_loss(hq, w, labels.to(device), chunk_tokens=5, chunk_vocab=7)
    loss.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert (hq.grad.cpu().double() - ref_h.grad).abs().max() <= 1e-4 * ref_h.grad.abs().max()
    if qmm.compile_ops.AVAILABLE:  # the custom op carries the split: compiled equals eager bit for bit
        def loss_of(hi):
            return qmm.linear_cross_entropy_loss(hi, w, labels.to(device), chunk_tokens=5, chunk_vocab=7)
        hc = h.clone().requires_grad_()
        compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True)(hc)
        compiled.backward()
        assert torch.equal(compiled.detach(), loss.detach()) and torch.equal(hc.grad, hq.grad)
    _expect_error("InvalidArgument", "chunk_vocab -1",
                  lambda: qmm.linear_cross_entropy(h, w, labels.to(device), chunk_vocab=-1))


# ---- rms_norm ---------------------------------------------------------------------------------------------------


def _hf_rms_norm(x, w, eps):
    """Hugging Face's LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hugging_faces_module(dtype):
    """qmm.rms_norm_autograd against Hugging Face's RMSNorm arithmetic in PyTorch: the output to one rounding of its
    dtype (the same two roundings, fp32 vs fp64 statistics), the gradients of x and w against PyTorch's autograd of
    the same module in fp64 (qmm's backward uses the unrounded x·rstd)."""
    x = randn((2, 5, 64), 1, "cpu", dtype) * 3
    w = (randn((64,), 2, "cpu") * 0.2 + 1).to(dtype)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = qmm.rms_norm_autograd(xr, wr, 1e-6)
    dy = randn(y.shape, 3, "cpu", dtype)
    y.backward(dy)
    ref = _hf_rms_norm(x, w, 1e-6)
    one = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert_close(y, ref, one * ref.double().abs() + 1e-6, "rms_norm y")
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    (wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))).backward(dy.double())
    tol = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-5
    assert_close(xr.grad, xd.grad, tol * xd.grad.abs().max() + 1e-6, "rms_norm dx")
    assert_close(wr.grad, wd.grad, tol * wd.grad.abs().max() + 1e-6, "rms_norm dw")
    _expect_error("ShapeMismatch", "w is [63]", lambda: qmm.rms_norm(x, w[:63], 1e-6))


class LlamaRMSNorm(torch.nn.Module):
    """A stand-in of transformers' LlamaRMSNorm (the same class name, attributes and forward)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        return _hf_rms_norm(x, self.weight, self.variance_epsilon)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_bnb_fused_norm_runs_qmms_rms_norm(compiled, dtype):
    """patch_bnb(fused_norm=True) patches RMSNorm modules (without bitsandbytes anywhere in the model): output and
    gradients as the module's own forward within the op's test tolerances, qmm's kernel called (a poisoned
    pure-PyTorch path would differ), no graph break compiled; a float32 weight under bf16 activations (peft's
    prepare_model_for_kbit_training) falls back to the module's forward with a warning, and unpatch_bnb restores it."""
    if compiled and not qmm.compile_ops.AVAILABLE:
        pytest.skip("needs PyTorch >= 2.4")
    norm = LlamaRMSNorm(64).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn((64,), 2, "cpu") * 0.2 + 1)
    model = torch.nn.Sequential(norm, torch.nn.Identity())
    x = randn((2, 5, 64), 1, "cpu", dtype) * 3
    dy = randn((2, 5, 64), 3, "cpu", dtype)

    def run(fn):
        norm.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        y = fn(xr)
        y.backward(dy)
        return y.detach(), xr.grad, norm.weight.grad

    ref = run(model)
    assert qmm.patch_bnb(model, fused_norm=True) == ["0"]
    got = run(_compiled_afresh(model, compiled))
    if compiled:
        assert _graph_breaks() == 0
    one, tol = (2.0 ** -7, 2.0 ** -6) if dtype == torch.bfloat16 else (1e-6, 1e-5)
    assert_close(got[0], ref[0], one * ref[0].double().abs() + 1e-6, "patched norm y")
    assert_close(got[1], ref[1], tol * ref[1].abs().max() + 1e-6, "patched norm dx")
    assert_close(got[2], ref[2], tol * ref[2].abs().max() + 1e-6, "patched norm dw")
    if dtype == torch.bfloat16:
        norm.float()  # the weight upcast, the activations bf16: the module's own forward, with a warning
        with pytest.warns(UserWarning, match="RMSNorm weight in torch.float32"):
            y = model(x)
        assert torch.equal(y, _hf_rms_norm(x, norm.weight, 1e-6))
    assert qmm.unpatch_bnb(model) == ["0"]


def _hf_add_norm_fp64(x, r, w, eps):
    """The decoder layer's residual add and RMSNorm in fp64 (the gradients' reference)."""
    h = x + r
    return h, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_add_rms_norm_and_the_residual_gradient(device, dtype, compiled):
    """qmm.add_rms_norm is PyTorch's x + r and qmm.rms_norm of it, bit for bit; rms_norm_backward(dres=) adds dres to
    dx before its one rounding (within a rounding of dx and of the sum); add_rms_norm_autograd and
    rms_norm_residual_autograd (the residual a view of x) give the ops' outputs and the gradients of the same
    arithmetic in fp64 to test_rms_norm_matches_hugging_faces_module's tolerance, eagerly and compiled (no graph
    break); bad shapes are qmm.Errors that name the argument."""
    if compiled and not qmm.compile_ops.AVAILABLE:
        pytest.skip("needs PyTorch >= 2.4")
    x, r = randn((2, 5, 64), 1, device, dtype) * 2, randn((2, 5, 64), 2, device, dtype) * 2
    w = (randn((64,), 3, "cpu") * 0.2 + 1).to(dtype).to(device)
    h, y, rstd = qmm.add_rms_norm(x, r, w, 1e-6, rstd=True)
    y_ref, rstd_ref = qmm.rms_norm(x + r, w, 1e-6, rstd=True)
    assert torch.equal(h, x + r) and torch.equal(y, y_ref) and torch.equal(rstd, rstd_ref)
    dy, dres = randn(x.shape, 4, device, dtype), randn(x.shape, 5, device, dtype)
    plain = qmm.rms_norm_backward(h, w, rstd, dy).double()
    one = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    got = qmm.rms_norm_backward(h, w, rstd, dy, dres=dres)
    assert_close(got, plain + dres.double(), one * (plain.abs() + (plain + dres.double()).abs()) + 1e-6, "dx + dres")

    a, b = randn(x.shape, 6, device, dtype), randn(x.shape, 7, device, dtype)
    tol = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-5
    for name, fn, ref_fn in [("add_rms_norm", lambda x, r, w: qmm.add_rms_norm_autograd(x, r, w, 1e-6),
                              lambda x, r, w: _hf_add_norm_fp64(x, r, w, 1e-6)),
                             ("rms_norm_residual", lambda x, r, w: qmm.rms_norm_residual_autograd(x, w, 1e-6),
                              lambda x, r, w: (x, _hf_add_norm_fp64(x, 0 * r, w, 1e-6)[1]))]:
        fn = _compiled_afresh(fn, compiled)
        xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
        first, second = fn(xs, rs, ws)
        if name == "rms_norm_residual" and not compiled:
            assert first._base is xs, "the residual is not a view of x"
        ((first.double() * a.double()).sum() + (second.double() * b.double()).sum()).backward()
        xd, rd, wd = (t.double().requires_grad_() for t in (x, r, w))
        ref_first, ref_second = ref_fn(xd, rd, wd)
        ((ref_first * a.double()).sum() + (ref_second * b.double()).sum()).backward()
        assert torch.equal(second.detach(), y_ref if name == "add_rms_norm" else qmm.rms_norm(x, w, 1e-6)[0])
        for got_g, ref_g, what in [(xs.grad, xd.grad, "dx"), (ws.grad, wd.grad, "dw")] + \
                ([(rs.grad, rd.grad, "dr")] if name == "add_rms_norm" else []):
            assert_close(got_g, ref_g, tol * ref_g.abs().max() + 1e-6, f"{name} {what}")
        if compiled:
            assert _graph_breaks() == 0
    _expect_error("ShapeMismatch", "r has shape [2, 5, 63]", lambda: qmm.add_rms_norm(x, r[..., :63], w, 1e-6))
    _expect_error("ShapeMismatch", "dres has shape [5, 64]",
                  lambda: qmm.rms_norm_backward(h, w, rstd, dy, dres=dres[0]))
    _expect_error("InvalidArgument", "dres is given but dx is not",
                  lambda: qmm.rms_norm_backward(h, w, rstd, dy, dx=False, dres=dres))


class _DecoderAttention(torch.nn.Module):
    """An attention as a decoder layer calls it (keywords only); records the keywords of each call."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.calls = []

    def forward(self, hidden_states, **kwargs):
        self.calls.append(kwargs)
        return self.proj(hidden_states).tanh(), None


class _DecoderMlp(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


class LlamaDecoderLayer(torch.nn.Module):
    """A stand-in of transformers' LlamaDecoderLayer: its class name, modules and forward, word for word."""

    def __init__(self, hidden):
        super().__init__()
        self.self_attn, self.mlp = _DecoderAttention(hidden), _DecoderMlp(hidden)
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(hidden), LlamaRMSNorm(hidden)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class MistralDecoderLayer(LlamaDecoderLayer):
    """A decoder layer of a known name whose forward is not the known one (its MLP's output scaled)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, past_key_values=past_key_values,
                                          use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + 0.5 * hidden_states
        return hidden_states


def _decoder_layer(cls, dtype, device):
    torch.manual_seed(11)
    layer = cls(64)
    with torch.no_grad():
        for i, norm in enumerate((layer.input_layernorm, layer.post_attention_layernorm)):
            norm.weight.copy_(randn((64,), 20 + i, "cpu") * 0.2 + 1)
    return layer.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_patch_bnb_fused_norm_fuses_a_decoder_layers_residual_adds(device, dtype, compiled, monkeypatch):
    """patch_bnb(fused_norm=True) on a Llama-style decoder layer whose forward is transformers' own: the layer gets a
    subclass of the same name computing the input norm with the residual's gradient (rms_norm_residual_autograd)
    and the attention's add with the post-attention norm (add_rms_norm_autograd), once each a call; the output and
    the gradients of x and every weight are the unpatched layer's to the norms' tolerances (bf16: the gradients'
    sums rounded once instead of twice), the attention gets the same keywords (extra ones passed on), compiled
    without a graph break; torch.save/torch.load and copy.deepcopy keep the fused class and its results; a call
    with positional arguments runs the layer's own forward with a warning; a layer whose forward differs keeps
    its class; unpatch_bnb gives the class back."""
    if compiled and not qmm.compile_ops.AVAILABLE:
        pytest.skip("needs PyTorch >= 2.4")
    layer = _decoder_layer(LlamaDecoderLayer, dtype, device)
    x, dy = randn((2, 5, 64), 1, device, dtype) * 2, randn((2, 5, 64), 2, device, dtype)
    cos = randn((1, 5, 16), 3, device, dtype)
    keywords = dict(position_embeddings=(cos, cos), use_cache=False, output_attentions=False)

    def run(module):
        module.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        y = module(xr, **keywords)
        (y.double() * dy.double()).sum().backward()
        return [y.detach(), xr.grad] + [p.grad for p in layer.parameters()]

    ref = run(layer)
    ref_calls = layer.self_attn.calls[:]
    assert qmm.patch_bnb(layer, fused_norm=True) == ["", "input_layernorm", "post_attention_layernorm"]
    assert type(layer) is not LlamaDecoderLayer and isinstance(layer, LlamaDecoderLayer)
    assert type(layer).__name__ == "LlamaDecoderLayer"
    fused = []
    for name in ("add_rms_norm_autograd", "rms_norm_residual_autograd"):
        monkeypatch.setattr(qmm.patch, name, functools.partial(
            lambda f, n, *a: fused.append(n) or f(*a), getattr(qmm.patch, name), name))
    layer.self_attn.calls.clear()
    got = run(_compiled_afresh(layer, compiled))
    if compiled:
        assert _graph_breaks() == 0
    else:
        assert sorted(fused) == ["add_rms_norm_autograd", "rms_norm_residual_autograd"]
    assert [sorted(c) for c in layer.self_attn.calls] == [sorted(c) for c in ref_calls]
    assert "output_attentions" in layer.self_attn.calls[0]
    one, tol = (2.0 ** -7, 2.0 ** -5) if dtype == torch.bfloat16 else (1e-6, 1e-5)
    assert_close(got[0], ref[0], one * ref[0].double().abs() + 4 * one, "layer output")
    for i, (g, r) in enumerate(zip(got[1:], ref[1:])):
        assert_close(g, r, tol * r.abs().max() + 1e-6, f"gradient {i}")
    if not compiled:
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        for copied in (torch.load(buf, weights_only=False), copy.deepcopy(layer)):
            assert type(copied) is type(layer)
            assert torch.equal(copied(x, **keywords), layer(x, **keywords))
        with pytest.warns(UserWarning, match="positional arguments"):
            y = layer(x, None)
        assert_close(y, ref[0], one * ref[0].double().abs() + 4 * one, "layer output, own forward")
    assert qmm.unpatch_bnb(layer) == ["", "input_layernorm", "post_attention_layernorm"]
    assert type(layer) is LlamaDecoderLayer
    other = _decoder_layer(MistralDecoderLayer, dtype, device)
    assert qmm.patch_bnb(other, fused_norm=True) == ["input_layernorm", "post_attention_layernorm"]
    assert type(other) is MistralDecoderLayer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("hooked", [False, True])
def test_fused_decoder_layer_adds_the_residual_in_a_patched_mlp(device, compiled, hooked, monkeypatch):
    """A fused decoder layer whose MLP patch_bnb runs as one block (NF4 LoRA projections) hands the layer's last
    residual add to that block (lora_nf4_mlp's residual, in the down projection's GEMM); with a forward hook on
    the MLP the layer calls the module (the hook runs) and adds after. Output and gradients are the unpatched
    layer's to the patched MLP's tolerance (2^-6 of the largest), compiled without a graph break."""
    if compiled and not qmm.compile_ops.AVAILABLE:
        pytest.skip("needs PyTorch >= 2.4")
    layer = _decoder_layer(LlamaDecoderLayer, torch.float32, device)
    layer.mlp = FakeMlp(mlp_weights(device, 64, 96))
    for i, p in enumerate(("gate_proj", "up_proj", "down_proj")):
        setattr(layer.mlp, p, FakeLora(getattr(layer.mlp, p), 4, 10 + 2 * i))
    hook_calls = []
    if hooked:
        layer.mlp.register_forward_hook(lambda *a: hook_calls.append(1))
    x, dy = randn((2, 5, 64), 1, device) * 2, randn((2, 5, 64), 2, device)
    keywords = dict(position_embeddings=(randn((1, 5, 16), 3, device),) * 2)

    def run(module):
        module.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        y = module(xr, **keywords)
        (y.double() * dy.double()).sum().backward()
        return [y.detach(), xr.grad] + [p.grad for n, p in layer.named_parameters() if "lora_" in n]

    ref = run(layer)
    residuals = []
    real = qmm.patch.lora_nf4_mlp
    monkeypatch.setattr(qmm.patch, "lora_nf4_mlp", lambda *a, **k: residuals.append(k.get("residual") is not None)
                        or real(*a, **k))
    qmm.patch_bnb(layer, fused_norm=True)
    hook_calls.clear()
    got = run(_compiled_afresh(layer, compiled))
    if compiled:
        assert _graph_breaks() == 0
    else:
        assert residuals == [not hooked]
    assert len(hook_calls) == (1 if hooked else 0)
    _assert_near(got, ref, 2.0 ** -6, "fused decoder layer with a patched MLP")
    qmm.unpatch_bnb(layer)


# ---- rope -------------------------------------------------------------------------------------------------------


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_rope(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb (unsqueeze_dim=1), written out."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rope_inputs(device, dtype, b, s, hq, hk, d, cos_batch, seed):
    """q and k as Hugging Face's attention makes them (projection outputs [B, S, H·D] viewed per head, transposed
    to [B, H, S, D]) and cos, sin [cos_batch, S, D] as its rotary embedding does (one angle per column pair,
    positions shifted per sequence where cos_batch = B), in q's dtype."""
    q = randn((b, s, hq * d), seed, device, dtype).view(b, s, hq, d).transpose(1, 2)
    k = randn((b, s, hk * d), seed + 1, device, dtype).view(b, s, hk, d).transpose(1, 2)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.arange(s, dtype=torch.float64)[None] + 5 * torch.arange(cos_batch, dtype=torch.float64)[:, None]
    emb = torch.cat((pos[..., None] * inv_freq,) * 2, dim=-1)
    return q, k, emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def _rope_bound(x, cos, sin, rtol):
    """rtol times |x·cos| + |rotate_half(x)·sin| in fp64: one rounding of the result (and fp32's of its products)
    relative to the terms' size, not the result's, which the two terms may cancel."""
    x, cos, sin = x.double().cpu(), cos.double().cpu().unsqueeze(1), sin.double().cpu().unsqueeze(1)
    return rtol * ((x * cos).abs() + (_rotate_half(x) * sin).abs()) + 1e-30


# One rounding to the output dtype, the products rounded to fp32 first on a GPU: 2^-22 (f32), 2^-8 (bf16) of the terms.
ROPE_RTOL = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,s,hq,hk,d,cos_batch", [(1, 1, 1, 1, 2, 1), (2, 7, 4, 2, 64, 1), (3, 65, 6, 2, 128, 3),
                                                   (2, 9, 3, 3, 6, 2)])
def test_rope_matches_hugging_faces_formula(device, dtype, b, s, hq, hk, d, cos_batch):
    """qmm.rope against Hugging Face's q·cos + rotate_half(q)·sin in fp64 on the same stored inputs, for q and k in
    Hugging Face's layout (read in place), contiguous [B, H, S, D] (viewed or copied), in place; and its three-
    rounding bf16 result within another ulp. The inverse rotates back (cos² + sin² = 1 up to their rounding)."""
    q, k, cos, sin = _rope_inputs(device, dtype, b, s, hq, hk, d, cos_batch, 10 * b + s)
    ref_q, ref_k = _hf_rope(q.double(), k.double(), cos.double(), sin.double())
    rtol = ROPE_RTOL[dtype]
    bound_q, bound_k = _rope_bound(q, cos, sin, rtol), _rope_bound(k, cos, sin, rtol)
    qe, ke = qmm.rope(q, k, cos, sin)
    assert qe.shape == q.shape and ke.shape == k.shape and qe.dtype == dtype and qe.stride() == q.stride()
    assert_close(qe, ref_q, bound_q, "rope q")
    assert_close(ke, ref_k, bound_k, "rope k")
    hf_q, _ = _hf_rope(q, k, cos, sin)  # Hugging Face's own rounding: each product and the sum in q's dtype
    assert_close(qe, hf_q, 3 * bound_q, "rope q vs Hugging Face's rounding")
    # Contiguous [B, H, S, D]: viewed as [B·H, S, 1, D] with cos broadcast over the batch, else copied.
    qc, kc = q.contiguous(), k.contiguous()
    qe2, ke2 = qmm.rope(qc, kc, cos, sin)
    assert torch.equal(qe2, qe) and torch.equal(ke2, ke) and (qe2.is_contiguous() or cos_batch > 1)
    # In place: q and k themselves, rotated.
    qi, ki = q.clone(), k.clone()  # clone keeps Hugging Face's strides
    out = qmm.rope(qi, ki, cos, sin, inplace=True)
    assert out[0] is qi and out[1] is ki and torch.equal(qi, qe) and torch.equal(ki, ke)
    # Only q; cos and sin as [S, D] where broadcast.
    alone, none = qmm.rope(q, None, cos[0] if cos_batch == 1 else cos, sin[0] if cos_batch == 1 else sin)
    assert none is None and torch.equal(alone, qe)
    # The inverse undoes the forward: two roundings, and bf16 cos, sin rotate by slightly more or less than 1.
    back_q, back_k = qmm.rope(qe, ke, cos, sin, inverse=True)
    tol = 2.0 ** -5 if dtype == torch.bfloat16 else 1e-6
    assert_close(back_q, q, tol * q.abs().max().item(), "inverse(forward(q))")
    assert_close(back_k, k, tol * k.abs().max().item(), "inverse(forward(k))")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_autograd_matches_fp64_autograd(device, dtype):
    """qmm.rope_autograd's gradients of q and k (the inverse rotation of the outputs' gradients) against PyTorch's
    autograd of Hugging Face's formula in fp64; an output left unused gives its input no gradient."""
    q, k, cos, sin = _rope_inputs(device, dtype, 2, 33, 4, 2, 64, 1, 7)
    gq, gk = randn(q.shape, 8, device, dtype), randn(k.shape, 9, device, dtype)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = qmm.rope_autograd(qr, kr, cos, sin)
    ((qe * gq).sum() + (ke * gk).sum()).backward()
    qd, kd = q.double().cpu().requires_grad_(), k.double().cpu().requires_grad_()
    rq, rk = _hf_rope(qd, kd, cos.double().cpu(), sin.double().cpu())
    ((rq * gq.double().cpu()).sum() + (rk * gk.double().cpu()).sum()).backward()
    rtol = ROPE_RTOL[dtype]
    assert_close(qr.grad, qd.grad, 2 * rtol * gq.abs().max().item(), "rope dq")  # |dx| <= |g1| + |g2|
    assert_close(kr.grad, kd.grad, 2 * rtol * gk.abs().max().item(), "rope dk")
    qr.grad = None
    kr2 = k.detach().requires_grad_()
    qe, _ = qmm.rope_autograd(qr, kr2, cos, sin)
    (qe * gq).sum().backward()
    assert kr2.grad is None
    assert_close(qr.grad, qd.grad, 2 * rtol * gq.abs().max().item(), "rope dq alone")
    with torch.no_grad():
        assert not qmm.rope_autograd(qr, kr, cos, sin)[0].requires_grad


def test_rope_bad_input_raises():
    q, k, cos, sin = _rope_inputs("cpu", torch.float32, 2, 5, 4, 2, 8, 1, 1)
    _expect_error("ShapeMismatch", "it must be [B, H, S, D]", lambda: qmm.rope(q[0], k, cos, sin))
    _expect_error("ShapeMismatch", "head dimension", lambda: qmm.rope(q[..., :7], None, cos[..., :7], sin[..., :7]))
    _expect_error("ShapeMismatch", "cos is [1,4,8]", lambda: qmm.rope(q, k, cos[:, :4], sin[:, :4]))
    _expect_error("ShapeMismatch", "cos is [2,5,8] but must be [1 or 3", lambda: qmm.rope(
        torch.cat((q, q[:1])), None, torch.cat((cos, cos)), torch.cat((sin, sin))))
    _expect_error("ShapeMismatch", "sin is", lambda: qmm.rope(q, k, cos, sin[:, :, :4]))
    _expect_error("DTypeMismatch", "k is bf16", lambda: qmm.rope(q, k.bfloat16(), cos, sin))
    _expect_error("DTypeMismatch", "cos is bf16", lambda: qmm.rope(q, k, cos.bfloat16(), sin.bfloat16()))
    _expect_error("ShapeMismatch", "with q's B, S, D", lambda: qmm.rope(q, k[:1], cos, sin))
    # q and k in different layouts (Hugging Face's, contiguous): the same checks, made in Hugging Face's shapes.
    kc = k.contiguous()
    _expect_error("ShapeMismatch", "with q's B, S, D", lambda: qmm.rope(q, kc[:1], cos, sin))
    _expect_error("ShapeMismatch", "with q's B, S, D", lambda: qmm.rope(q, kc[..., :4], cos, sin))
    _expect_error("DTypeMismatch", "k is bf16 but q is f32", lambda: qmm.rope(q, kc.bfloat16(), cos, sin))
    buffer = torch.randn(2, 5, 4 * 8)
    hf_view, contiguous_view = buffer.view(2, 5, 4, 8).transpose(1, 2), buffer.view(2, 4, 5, 8)  # the same memory
    _expect_error("InvalidArgument", "q and k overlap",
                  lambda: qmm.rope(hf_view, contiguous_view, cos, sin, inplace=True))
    _expect_error("InvalidArgument", "q and k overlap", lambda: qmm.rope(hf_view, hf_view, cos, sin, inplace=True))
    kept, qi = buffer.clone(), q.clone()
    _expect_error("InvalidArgument", "k and sin overlap", lambda: qmm.rope(
        qi, contiguous_view[:, :2], cos, buffer.view(-1)[:40].view(1, 5, 8), inplace=True))
    assert torch.equal(buffer, kept) and torch.equal(qi, q)  # q, whose call would come first, untouched too
    strided = q.transpose(2, 3).contiguous().transpose(2, 3)  # neither layout qmm takes as it is
    _expect_error("InvalidArgument", "cannot be rotated in place",
                  lambda: qmm.rope(strided, None, cos, sin, inplace=True))
    before = q.clone()
    _expect_error("ShapeMismatch", "cos is", lambda: qmm.rope(q, k, cos[:, :4], sin[:, :4], inplace=True))
    assert torch.equal(q, before)


@pytest.mark.skipif(not qmm.compile_ops.AVAILABLE, reason="needs PyTorch >= 2.4")
@pytest.mark.parametrize("device", DEVICES)
def test_rope_compiles_fullgraph_and_equals_eager(device):
    """rope_autograd under torch.compile(fullgraph=True) runs as the custom op qmm::rope (its backward another call
    of it): the same kernels as eager, so the same outputs and gradients; the op's fake and autograd registrations
    pass PyTorch's opcheck."""
    q, k, cos, sin = _rope_inputs(device, torch.bfloat16, 2, 9, 4, 2, 64, 1, 3)
    g = randn((2, 4, 9, 64), 4, device, torch.bfloat16)

    def run(fn):
        qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
        loss = fn(qr, kr)
        loss.backward()
        return [loss.detach(), qr.grad, kr.grad]

    def loss_of(qr, kr):
        qe, ke = qmm.rope_autograd(qr, kr, cos, sin)
        return (qe.float() * g).sum() + ke.float().pow(2).sum()

    eager = run(loss_of)
    compiled = run(torch.compile(loss_of, backend="aot_eager", fullgraph=True))
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    torch.library.opcheck(qmm.compile_ops.rope_op, (q.detach().requires_grad_(), k, cos, sin, False))
    torch.library.opcheck(qmm.compile_ops.rope_op, (q.contiguous(), None, cos, sin, True))


def test_patch_bnb_fused_rope_points_the_family_at_qmm_and_back(monkeypatch):
    """patch_bnb(fused_rope=True) on a model with a Llama attention (a stand-in: the class name, and a modeling
    module whose apply_rotary_pos_emb its forward calls, as transformers' do): the module's function then runs
    qmm's rope (within ROPE_RTOL of Hugging Face's formula, gradients the inverse rotation), falls back to the
    original for calls qmm does not take (another unsqueeze_dim, float16), is held while a second patched model
    remains, and is restored by unpatch_bnb of the last one."""
    import sys
    import types
    modeling = types.ModuleType("qmm_test_modeling_llama")
    modeling.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: _hf_rope(q, k, cos, sin) \
        if unsqueeze_dim == 1 else ("original", unsqueeze_dim)
    own = modeling.apply_rotary_pos_emb
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)

    class LlamaAttention(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return sys.modules[type(self).__module__].apply_rotary_pos_emb(q, k, cos, sin)

    LlamaAttention.__module__ = modeling.__name__
    first, second = torch.nn.Sequential(LlamaAttention()), torch.nn.Sequential(LlamaAttention())
    assert qmm.patch_bnb(first, fused_rope=True) == [] and modeling.apply_rotary_pos_emb is not own
    qmm.patch_bnb(second, fused_rope=True)
    calls = []
    rope_apply = qmm.functional._Rope.apply
    monkeypatch.setattr(qmm.functional._Rope, "apply", lambda *a: calls.append(1) or rope_apply(*a))
    q, k, cos, sin = _rope_inputs("cpu", torch.float32, 2, 7, 4, 2, 64, 1, 3)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    got_q, got_k = first[0](qr, kr, cos, sin)
    ref_q, ref_k = _hf_rope(q.double(), k.double(), cos.double(), sin.double())
    assert calls == [1]
    assert_close(got_q, ref_q, _rope_bound(q, cos, sin, ROPE_RTOL[torch.float32]), "patched rope q")
    assert_close(got_k, ref_k, _rope_bound(k, cos, sin, ROPE_RTOL[torch.float32]), "patched rope k")
    (got_q.sum() + 2 * got_k.sum()).backward()
    qd, kd = q.double().requires_grad_(), k.double().requires_grad_()
    ref_q, ref_k = _hf_rope(qd, kd, cos.double(), sin.double())
    (ref_q.sum() + 2 * ref_k.sum()).backward()
    assert_close(qr.grad, qd.grad, 1e-5 * qd.grad.abs().max(), "patched rope dq")
    assert_close(kr.grad, kd.grad, 1e-5 * kd.grad.abs().max(), "patched rope dk")
    assert modeling.apply_rotary_pos_emb(q, k, cos, sin, 2) == ("original", 2)
    half = modeling.apply_rotary_pos_emb(q.half(), k.half(), cos.half(), sin.half())
    assert calls == [1] and half[0].dtype == torch.float16
    qmm.unpatch_bnb(first)
    assert modeling.apply_rotary_pos_emb is not own  # the second model still holds it
    qmm.unpatch_bnb(second)
    assert modeling.apply_rotary_pos_emb is own


def test_fused_projection_calls_check_every_operand_before_writing():
    """The one-call forward and backward of a fused projection (_qmm.lora_nf4_linear_forward/backward, what
    qmm.lora_nf4_linear runs) refuse an operand of the wrong shape or dtype with a qmm.Error naming it, and leave
    every output as it was."""
    from qmm import _qmm
    from qmm._base import _call
    w = qmm.Nf4Weight.quantize(randn((32, 64), 1, "cpu"))
    x, a, b = randn((5, 64), 2, "cpu"), randn((4, 64), 3, "cpu"), randn((32, 4), 4, "cpu")
    y, t = torch.full((5, 32), 7.0), torch.full((5, 4), 7.0)
    bad_t = torch.full((5, 3), 7.0)
    _expect_error("ShapeMismatch", "lora_nf4_linear_forward: t is [5,3]", lambda: _call(
        _qmm.lora_nf4_linear_forward, x, x, w._native, y, 0.0, "auto", None, a, b, None, None, bad_t, 1.0))
    _expect_error("ShapeMismatch", "lora_nf4_linear_forward: b is [32,3]", lambda: _call(
        _qmm.lora_nf4_linear_forward, x, x, w._native, y, 0.0, "auto", None, a, b[:, :3].contiguous(), None, None,
        t, 1.0))
    _expect_error("InvalidArgument", "a_w and b_w", lambda: _call(
        _qmm.lora_nf4_linear_forward, x.bfloat16(), x.bfloat16(), w._native, y.bfloat16(), 0.0, "auto", None, a, b,
        None, None, t.bfloat16(), 1.0))
    assert (y == 7).all() and (t == 7).all() and (bad_t == 7).all()
    dy, dx, dt = randn((5, 32), 5, "cpu"), torch.full((5, 64), 7.0), torch.full((5, 4), 7.0)
    grad_a, grad_b = torch.full((4, 64), 7.0), torch.full((32, 4), 7, dtype=torch.bfloat16)
    _expect_error("DTypeMismatch", "lora_nf4_linear_backward: grad_b is bf16", lambda: _call(
        _qmm.lora_nf4_linear_backward, dy, dy, w._native, "auto", dx, x, t, a, b, 1.0, dt, grad_a, grad_b, False,
        None))
    dy16 = dy[:, :16].contiguous()
    _expect_error("ShapeMismatch", "but w has 32 rows", lambda: _call(
        _qmm.lora_nf4_linear_backward, dy16, dy16, w._native, "auto", dx, None, None, None, None, 1.0, None, None,
        None, False, None))
    assert (dx == 7).all() and (dt == 7).all() and (grad_a == 7).all() and (grad_b == 7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_swiglu_mlp_with_dropout_on_down(device):
    """QLoraSwiGluMlp runs as one op (lora_nf4_mlp) unless the down projection drops out in training, where
    lora_nf4_swiglu and the down projection run apart: in eval mode a dropout module computes what the same module
    without dropout does (to the bit), in training its adapters' gradients flow through the mask."""
    torch.manual_seed(0)
    weights = mlp_weights(device, 64, 96)
    plain = qmm.QLoraSwiGluMlp(*weights, rank=4, alpha=8.0)
    dropping = qmm.QLoraSwiGluMlp(*weights, rank=4, alpha=8.0, dropout=0.5)
    with torch.no_grad():
        for i, ad in enumerate((plain.gate_lora, plain.up_lora, plain.down.lora)):
            ad.lora_b.copy_(randn(ad.lora_b.shape, 20 + i, device) * 0.1)
    dropping.load_state_dict(plain.state_dict())
    x = randn((7, 64), 3, device)
    dropping.eval()
    assert torch.equal(dropping(x), plain(x))
    dropping.train()
    y = dropping(x)
    assert not torch.equal(y, plain(x))
    y.square().sum().backward()
    for ad in (dropping.gate_lora, dropping.up_lora, dropping.down.lora):
        assert torch.isfinite(ad.lora_a.grad).all() and ad.lora_a.grad.abs().sum() > 0


# ---- a batch of no tokens ----------------------------------------------------------------------------------------


def _grads_of(tensors):
    return [t.grad for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
def test_ops_on_zero_rows_give_empty_outputs_and_zero_parameter_gradients(device):
    """M = 0 rows (a mixture-of-experts expert that got no token, an empty micro-batch): every differentiable op
    returns its empty output and, through backward, zero gradients for its weights and adapters: all written (the
    tensors a framework gives for no elements carry no address; qmm must not take them for arguments not given)."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32

    def leaf(shape, seed):
        return (randn(shape, seed, device) * 0.1).requires_grad_()

    w = qmm.Nf4Weight.quantize(randn((16, 64), 1, device))
    wg, wu, wd = (qmm.Nf4Weight.quantize(randn(s, 2 + i, device)) for i, s in enumerate(((32, 64), (32, 64),
                                                                                         (64, 32))))
    cases = []
    x = torch.empty((0, 64), device=device, dtype=dt, requires_grad=True)
    lora = qmm.Lora(leaf((4, 64), 10), leaf((16, 4), 11), 2.0)
    cases.append(("lora_nf4_linear", lambda: [qmm.lora_nf4_linear(x, w, lora)], [lora.a, lora.b]))
    loras = [qmm.Lora(leaf((4, 64), 12 + i), leaf((16, 4), 15 + i), 1.0) for i in range(3)]
    cases.append(("lora_nf4_linears", lambda: qmm.lora_nf4_linears(x, [w, w, w], loras),
                  [p for lo in loras for p in (lo.a, lo.b)]))
    gu = [qmm.Lora(leaf((4, 64), 20 + i), leaf((32, 4), 22 + i), 1.0) for i in range(2)]
    down = qmm.Lora(leaf((4, 32), 24), leaf((64, 4), 25), 1.0)
    cases.append(("lora_nf4_swiglu", lambda: [qmm.lora_nf4_swiglu(x, wg, wu, *gu)],
                  [p for lo in gu for p in (lo.a, lo.b)]))
    residual = torch.empty((0, 64), device=device, dtype=dt)
    cases.append(("lora_nf4_mlp", lambda: [qmm.lora_nf4_mlp(x, wg, wu, wd, *gu, down, residual=residual)],
                  [p for lo in gu + [down] for p in (lo.a, lo.b)]))
    norm_w = (randn((64,), 30, device) * 0.1).to(dt).requires_grad_()  # the norm's weight is in x's dtype
    cases.append(("rms_norm_autograd", lambda: [qmm.rms_norm_autograd(x, norm_w, 1e-6)], [norm_w]))
    r = torch.empty((0, 64), device=device, dtype=dt, requires_grad=True)
    cases.append(("add_rms_norm_autograd", lambda: list(qmm.add_rms_norm_autograd(x, r, norm_w, 1e-6)), [norm_w]))
    for name, run, params in cases:
        for p in params:
            p.grad = None
        outs = run()
        assert all(o.shape[0] == 0 for o in outs), name
        sum(o.float().sum() for o in outs).backward()
        for p, g in zip(params, _grads_of(params)):
            assert g is not None and g.shape == p.shape and torch.count_nonzero(g) == 0, name
        assert x.grad is None or x.grad.shape == x.shape, name


def test_int64_labels_past_int32_stay_out_of_range():
    """int64 labels go to qmm as int32: a label past int32's range must be reported as out of range (or make the loss
    NaN unchecked), never wrap into a valid label or into ignore_index."""
    h, w = randn((4, 8), 1, "cpu"), randn((10, 8), 2, "cpu")
    for bad in (2 ** 32 + 3, 2 ** 32 - 100, -2 ** 40):
        labels = torch.tensor([1, bad, 2, 3])
        _expect_error("InvalidArgument", "label", lambda: qmm.linear_cross_entropy(h, w, labels))
        loss, _ = qmm.linear_cross_entropy(h, w, labels, check_labels=False)
        assert torch.isnan(loss), bad
    edge = torch.tensor([1, 2 ** 40, 2, 3])
    loss, _ = qmm.linear_cross_entropy(h, w, edge, check_labels=False, ignore_index=2 ** 31 - 1)
    assert torch.isnan(loss)  # not taken for the ignore_index it would clamp to


@pytest.mark.parametrize("bad", [2 ** 40, -100.0, None, True])
def test_linear_cross_entropy_refuses_a_bad_ignore_index(bad):
    _expect_error("InvalidArgument", "ignore_index", lambda: qmm.linear_cross_entropy(
        randn((4, 8), 1, "cpu"), randn((10, 8), 2, "cpu"), torch.tensor([1, 2, 3, 4]), ignore_index=bad))


def test_linear_cross_entropy_loss_labels_must_match_the_rows_of_h():
    h, w = randn((2, 3, 8), 1, "cpu"), randn((10, 8), 2, "cpu")
    labels = torch.randint(0, 10, (2, 3), generator=gen(3))
    want = qmm.linear_cross_entropy_loss(h, w, labels)
    assert torch.equal(qmm.linear_cross_entropy_loss(h, w, labels.reshape(-1)), want)  # flattened: the same rows
    _expect_error("ShapeMismatch", "labels", lambda: qmm.linear_cross_entropy_loss(h, w, labels.t()))
    _expect_error("ShapeMismatch", "labels", lambda: qmm.linear_cross_entropy_loss(h, w, labels[:, :2]))


def test_rms_norm_backward_dy_must_have_x_shape():
    x, w = randn((2, 3, 7), 1, "cpu"), randn((7,), 2, "cpu")
    _, rstd = qmm.rms_norm(x, w, 1e-6, rstd=True)
    _expect_error("ShapeMismatch", "dy", lambda: qmm.rms_norm_backward(x, w, rstd, randn((3, 2, 7), 3, "cpu")))


def test_outputs_written_in_place_are_seen_by_autograd():
    """out=, dw=, grad_b= and rope's inplace write the caller's tensors: refused where one requires grad in grad mode
    (autograd would not see the write; torch refuses out= there too), and a tensor a backward saved is marked
    written, so that the backward fails instead of reading the new values. Nothing is written when refused."""
    a, b = randn((3, 4), 1, "cpu"), randn((4, 5), 2, "cpu")
    out = torch.zeros((3, 5), requires_grad=True)
    _expect_error("InvalidArgument", "'out' requires grad", lambda: qmm.gemm(a, b, out=out))
    assert torch.count_nonzero(out) == 0
    with torch.no_grad():
        qmm.gemm(a, b, out=out)  # as torch's own in-place ops under no_grad
    assert torch.allclose(out, a @ b)
    leaf = torch.randn(3, 5, requires_grad=True)
    saved = torch.zeros(3, 5)
    y = (leaf * saved).sum()  # saves `saved` for its backward
    qmm.gemm(a, b, out=saved)
    if qmm._base._increment_version is not None:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    q = randn((1, 2, 3, 4), 4, "cpu").requires_grad_() * 1.0
    cos, sin = randn((1, 2, 4), 5, "cpu"), randn((1, 2, 4), 6, "cpu")
    before = q.detach().clone()
    _expect_error("InvalidArgument", "'q' requires grad", lambda: qmm.rope(q, None, cos, sin, inplace=True))
    assert torch.equal(q.detach(), before)
    h, w, labels = randn((4, 8), 7, "cpu"), randn((10, 8), 8, "cpu"), torch.tensor([1, 2, 3, 4])
    _expect_error("InvalidArgument", "'dw' requires grad", lambda: qmm.linear_cross_entropy(
        h, w, labels, dw=torch.zeros((10, 8), requires_grad=True)))


def test_a_plain_nf4_weight_takes_no_double_quant_parts():
    w4 = qmm.Nf4Weight.quantize(randn((16, 64), 1, "cpu"), double_quant=False)
    for extra in (dict(absmax2=torch.ones(1)), dict(code2=torch.ones(256)), dict(offset=0.5)):
        _expect_error("InvalidArgument", "plain", lambda: qmm.Nf4Weight(w4.codes, w4.absmax, (16, 64), 64, **extra))


def test_a_malformed_quant_state_with_bytes_that_are_not_utf8_is_a_qmm_error():
    w4 = qmm.Nf4Weight.quantize(randn((16, 64), 1, "cpu"))
    sd = w4.to_bnb_state_dict()
    key = next(k for k in sd if k.endswith("quant_state.bitsandbytes__nf4"))
    text = bytes(sd[key].tolist())[:-1] + b', "x\xff": 1}'
    sd[key] = torch.tensor(list(text), dtype=torch.uint8)
    _expect_error("Io", "not valid JSON", lambda: qmm.Nf4Weight.from_bnb_state_dict(sd))


def test_lora_nf4_mlp_takes_a_strided_residual():
    x = randn((5, 64), 1, "cpu")
    wg, wu, wd = (qmm.Nf4Weight.quantize(randn(s, 2 + i, "cpu")) for i, s in enumerate(((32, 64), (32, 64), (64, 32))))
    down = qmm.Lora(randn((4, 32), 5, "cpu"), randn((64, 4), 6, "cpu"), 1.0)
    residual = randn((64, 5), 7, "cpu").t()  # [5, 64], not contiguous
    want = qmm.lora_nf4_mlp(x, wg, wu, wd, down_lora=down, residual=residual.contiguous())
    assert torch.equal(qmm.lora_nf4_mlp(x, wg, wu, wd, down_lora=down, residual=residual), want)


def test_bad_arguments_are_qmm_errors_naming_op_and_argument():
    """Arguments of the wrong kind (a str for a flag, None for a path, a float16 adapter, a scale past float32, a
    wrapped device index) are qmm.Errors naming the op and the argument, not errors from deeper down."""
    w4 = qmm.Nf4Weight.quantize(randn((16, 64), 1, "cpu"))
    x = randn((3, 64), 2, "cpu")
    a, b = randn((4, 64), 3, "cpu"), randn((16, 4), 4, "cpu")
    q, cos, sin = randn((1, 2, 3, 4), 5, "cpu"), randn((1, 2, 4), 6, "cpu"), randn((1, 2, 4), 7, "cpu")
    cases = [
        ("DTypeMismatch", "lora_nf4_linear: argument 'lora' has a of torch.float16",
         lambda: qmm.lora_nf4_linear(x, w4, qmm.Lora(a.half(), b.half(), 1.0))),
        ("InvalidArgument", "has scale 1e+40", lambda: qmm.lora_nf4_linear(x, w4, qmm.Lora(a, b, 1e40))),
        ("InvalidArgument", "has scale None", lambda: qmm.lora_nf4_linear(x, w4, qmm.Lora(a, b, None))),
        ("InvalidArgument", "nf4_linear: path must be a str", lambda: qmm.nf4_linear(x, w4, path=None)),
        ("InvalidArgument", "nf4_gemm: path must be a str", lambda: qmm.nf4_gemm(x, w4, path=None)),
        ("InvalidArgument", "rope: inverse must be True or False", lambda: qmm.rope(q, None, cos, sin, inverse=1)),
        ("InvalidArgument", "rope: inplace must be True or False",
         lambda: qmm.rope(q, None, cos, sin, inplace="yes")),
        ("InvalidArgument", "batched_gemm: transpose_b", lambda: qmm.batched_gemm(
            randn((1, 1, 2, 3), 8, "cpu"), randn((1, 1, 3, 2), 9, "cpu"), transpose_b=1)),
        ("InvalidArgument", "Nf4Weight.quantize: double_quant",
         lambda: qmm.Nf4Weight.quantize(randn((16, 64), 1, "cpu"), double_quant="no")),
        ("InvalidArgument", "Nf4Weight.quantize: block_size",
         lambda: qmm.Nf4Weight.quantize(randn((16, 64), 1, "cpu"), block_size=64.0)),
        ("InvalidArgument", "LoraAdapter: rank", lambda: qmm.QLoraLinear(w4, rank=2.5)),
        ("InvalidArgument", "LoraAdapter: dropout", lambda: qmm.QLoraLinear(w4, dropout=1.5)),
        ("InvalidArgument", "LoraAdapter: dropout", lambda: qmm.QLoraLinear(w4, dropout=-0.1)),
        ("ShapeMismatch", "QLoraLinear: bias", lambda: qmm.QLoraLinear(w4, bias=torch.zeros(15))),
        ("InvalidArgument", "patch_bnb: fused_loss", lambda: qmm.patch_bnb(torch.nn.Linear(2, 2), fused_loss="no")),
        ("InvalidArgument", "memory_stats: there is no CUDA device 256", lambda: qmm.memory_stats(256)),
    ]
    for code, fragment, fn in cases:
        _expect_error(code, fragment, fn)


def test_malformed_weights_and_tensor_arguments_are_qmm_errors():
    w4 = qmm.Nf4Weight.quantize(randn((16, 64), 1, "cpu"))
    cases = [
        ("InvalidArgument", "shape (rows, cols) must be two ints",
         lambda: qmm.Nf4Weight(w4.codes, w4.absmax, (16, 64, 1), 64, w4.absmax2, w4.code2, w4.offset)),
        ("InvalidArgument", "shape (rows, cols) must be two ints",
         lambda: qmm.Nf4Weight(w4.codes, w4.absmax, (16.5, 64), 64, w4.absmax2, w4.code2, w4.offset)),
        ("InvalidArgument", "pickled state", lambda: qmm.Nf4Weight.__new__(qmm.Nf4Weight).__setstate__(
            {"codes": w4.codes})),
        ("InvalidArgument", "gemm: argument 'a' must be a torch.Tensor",
         lambda: qmm.gemm(None, randn((4, 5), 2, "cpu"))),
        ("InvalidArgument", "rms_norm: argument 'w' must be",
         lambda: qmm.rms_norm(randn((2, 7), 3, "cpu"), None, 1e-6)),
        ("InvalidArgument", "rope: argument 'cos' must be", lambda: qmm.rope(randn((1, 2, 3, 4), 5, "cpu"), None,
                                                                            None, None)),
        ("InvalidArgument", "linear_cross_entropy: argument 'labels'", lambda: qmm.linear_cross_entropy(
            randn((4, 8), 1, "cpu"), randn((10, 8), 2, "cpu"), None)),
        ("DeviceMismatch", "", lambda: qmm.gemm(torch.empty(3, 4, device="meta"), torch.empty(4, 5, device="meta"))),
        ("InvalidArgument", "names must be a tuple", lambda: qmm.replace_bnb_linears(torch.nn.Linear(2, 2),
                                                                                    names="q_proj")),
    ]
    for code, fragment, fn in cases:
        _expect_error(code, fragment, fn)
    state = w4.__getstate__()
    again = qmm.Nf4Weight.__new__(qmm.Nf4Weight)
    again.__setstate__(state)  # a well-formed pickle still loads, to the same weight
    assert torch.equal(qmm.nf4_gemm(randn((3, 64), 4, "cpu"), again), qmm.nf4_gemm(randn((3, 64), 4, "cpu"), w4))
