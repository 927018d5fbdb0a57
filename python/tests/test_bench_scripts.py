"""The Python benchmarks' own checks (--tiny: a small Llama on the CPU), so that a script broken by a change is found
before the GPU machine spends its time on it. They need transformers, PEFT and bitsandbytes (skipped without them,
as on CI's Debian PyTorch; scripts/test-peers runs them)."""
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("transformers")
if torch.cuda.is_available():  # CPU checks of the scripts, about 90 s: CI runs them; GPU time is dearer
    pytest.skip("the scripts' CPU checks run in CI, not on the GPU machine", allow_module_level=True)

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def run_script(name, *args):
    """(stdout, stderr) of the script run with --tiny on the CPU; the test fails where it exits non-zero."""
    done = subprocess.run([sys.executable, os.path.join(BENCH, name), "--tiny", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout, done.stderr


def rows(table_text):
    """{variant: [cells]} of the markdown table rows in the text."""
    out = {}
    for line in table_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("variant", "---"):
            out[cells[0]] = cells[1:]
    return out


def test_train_step_tiny_runs_and_compares_with_bnb():
    """bench/train_step.py: every variant asked for runs (none skipped) and reports its pipelined step time too, each
    worker's end is reported as it comes, and the patched variants' losses and gradients are compared with bnb's."""
    out, err = run_script("train_step.py", "--variants", "bnb,qmm,qmm-all", "--steps", "2", "--warmup", "1")
    table = rows(out)
    assert set(table) == {"bnb", "qmm", "qmm-all"}, out
    header = next(line for line in out.splitlines() if line.startswith("| variant"))
    pipelined = [c.strip() for c in header.strip().strip("|").split("|")].index("pipelined ms") - 1
    for variant, cells in table.items():
        assert not cells[0].startswith("skipped"), (variant, cells)
        assert float(cells[pipelined]) > 0, (variant, cells)
        assert re.search(rf"tiny {variant}: exit 0 after \d+ s", err), err
    for variant in ("qmm", "qmm-all"):
        assert table[variant][-3] != "-", table[variant]  # the LoRA gradients against bnb's


def test_train_step_compares_with_the_fp32_reference():
    """The fp32-ref variant (the 4-bit weights dequantized, everything else float32) runs, and the other variants'
    LoRA gradients and losses are compared with its: bnb's within a bf16 step's distance of the exact one, the
    patched model's with every fusion no further from it than bnb's (to a quarter more: other roundings)."""
    out, _ = run_script("train_step.py", "--variants", "bnb,qmm-all,fp32-ref", "--steps", "1", "--warmup", "1")
    assert set(rows(out)) == {"bnb", "qmm-all", "fp32-ref"}, out
    distance = {}
    for variant in ("bnb", "qmm-all"):
        found = re.search(rf"^- {variant}: ([\d.]+) / ([\d.]+); ([\d.e+-]+)$", out, re.MULTILINE)
        assert found, out[-2000:]
        grad_max, grad_median, loss = (float(v) for v in found.groups())
        assert 0 < grad_median <= grad_max < 0.2 and 0 <= loss < 1e-2, found.group(0)
        distance[variant] = grad_max
    assert distance["qmm-all"] <= 1.25 * distance["bnb"], distance


def test_train_step_counts_a_layer():
    """--per-layer: a profiled step with and without the last decoder layer, the difference in the table (on the
    CPU, CPU events: a check of the script)."""
    out, _ = run_script("train_step.py", "--variants", "qmm-all", "--steps", "1", "--warmup", "1", "--per-layer")
    header = next(line for line in out.splitlines() if line.startswith("| variant"))
    column = [c.strip() for c in header.strip().strip("|").split("|")].index("kernels/layer") - 1
    assert int(rows(out)["qmm-all"][column]) > 0, out


def test_train_step_nf4_path_reaches_the_patch():
    """--nf4-path goes to qmm.patch_bnb: a path the CPU backend does not run makes the qmm variant a skipped row
    whose reason is qmm's error, naming the path."""
    out, _ = run_script("train_step.py", "--variants", "qmm", "--steps", "1", "--warmup", "1", "--nf4-path", "fused")
    assert "qmm NF4 path fused" in out
    cells = rows(out)["qmm"]
    assert cells[0].startswith("skipped") and "path fused is not available on the CPU backend" in cells[0], cells


def test_decode_tiny_generates_bitsandbytes_tokens():
    """bench/decode.py: the patched variants generate bnb's greedy tokens, qmm-static (the decode steps compiled,
    one static cache reset for every call) over two timed calls too."""
    out, err = run_script("decode.py", "--variants", "bnb,qmm,qmm-static", "--new-tokens", "4", "--repeats", "2")
    table = rows(out)
    assert set(table) == {"bnb", "qmm", "qmm-static"}, out
    assert table["qmm"][-1] == "yes" and table["qmm-static"][-1] == "yes", table
    assert "tiny qmm: exit 0" in err and "tiny qmm-static: exit 0" in err, err


def test_decode_reports_how_close_bnbs_choice_was_where_ids_part():
    """bench/decode.py's table: where a variant's greedy ids part from bnb's, the gap between bnb's two largest
    logits at that token and the median gap; a variant whose untimed rescoring call gave other ids is flagged."""
    sys.path.insert(0, BENCH)
    try:
        import decode
    finally:
        sys.path.remove(BENCH)
    bnb = {"variant": "bnb", "tokens_per_s": 10.0, "median_s": 0.4, "ids": [5, 6, 7, 8], "top2_gaps": [2, 0.01, 3, 4]}
    near = {"variant": "qmm", "tokens_per_s": 20.0, "median_s": 0.2, "ids": [5, 9, 7, 8], "top2_gaps": [1] * 4}
    moved = dict(near, variant="qmm-static", ids=[5, 6, 7, 8], rescored_ids_equal=False)
    table = rows(decode.table("tiny", [bnb, near, moved]))
    assert table["bnb"][-1] == "yes"
    assert table["qmm"][-1] == "no (from token 1; bnb's top-2 logit gap there 0.01, median 2.5)", table
    assert table["qmm-static"][-1] == "yes; its untimed call with scores gave other ids", table
    assert table["qmm"][1] == "2.00x"


def test_host_cost_runs_with_the_peft_rows():
    """bench/host_cost.py on the CPU, a few calls: every row, the patched and unpatched PEFT layers' included."""
    done = subprocess.run([sys.executable, os.path.join(BENCH, "host_cost.py"), "--device", "cpu", "--calls", "8"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for row in ("raw binding, outputs given", "autograd forward + backward", "patched PEFT layer, fwd + bwd",
                "bitsandbytes + PEFT layer, fwd + bwd"):
        assert re.search(rf"{re.escape(row)}\s+[0-9.]+ µs", done.stdout), (row, done.stdout)


def test_layer_kernels_tiny_counts_a_layer():
    """bench/layer_kernels.py: the tiny model with one and two layers, the difference reported per layer (on the
    CPU, profiled CPU events: a check of the script)."""
    out, _ = run_script("layer_kernels.py", "--variant", "qmm-all")
    found = re.search(r"with 1 layer\(s\), (\d+) with 2: (-?\d+) per layer", out)
    assert found and int(found.group(2)) > 0, out[-2000:]


def test_train_step_sorts_kernels_by_kind():
    """train_step.gpu_time_by_kind: profiled kernel names of a patched step and its peers (as torch.profiler
    names them) fall into their kinds, qmm's own by family before cuBLAS's patterns; ms a step, largest first."""
    sys.path.insert(0, BENCH)
    try:
        import train_step
    finally:
        sys.path.remove(BENCH)

    class Event:
        def __init__(self, name, us):
            self.name, self.device_time = name, us

    names = {
        "void qmm::cuda::nf4_detail::nf4_dequantize_kernel<__nv_bfloat16>(unsigned char const*, qmm": "NF4 dequantize",
        "qmm::cuda::nf4_detail::nf4_dequantize_many_kernel(qmm::cuda::nf4_detail::DequantParts)": "NF4 dequantize",
        "void qmm::cuda::(anonymous namespace)::online_rows_kernel<__nv_bfloat16, true, 16>(": "loss rows",
        "void qmm::cuda::swiglu_detail::swiglu_backward_kernel<__nv_bfloat16>(": "SwiGLU",
        "void qmm::cuda::(anonymous namespace)::lora_backward_dy_kernel<16>(__nv_bfloat16 const*": "lora_backward_dy",
        "void qmm::cuda::(anonymous namespace)::rms_norm_backward_rows_kernel<__nv_bfloat16, 8, 2, ": "RMSNorm",
        "void qmm::cuda::(anonymous namespace)::rope_kernel<__nv_bfloat16, __nv_bfloat16, 8>(": "rope",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "cuBLAS GEMM",
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32x8": "cuBLAS GEMM",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10": "PyTorch element-wise",
        "triton_poi_fused__to_copy_add_mul_rsub_sigmoid_2": "Triton", "_nf4_dequant_kernel": "Triton",
        "Memset (Device)": "memset", "Memcpy DtoD (Device -> Device)": "copy", "some_vendor_kernel": "other"}
    for name, kind in names.items():
        assert list(train_step.gpu_time_by_kind([Event(name, 1000.0)], steps=1)) == [kind], name
    got = train_step.gpu_time_by_kind([Event("nvjet_a", 3000.0), Event("nvjet_b", 1000.0),
                                       Event("Memset (Device)", 500.0)], steps=2)
    assert got == {"cuBLAS GEMM": 2.0, "memset": 0.25}


def test_train_step_finds_the_gpus_idle_gaps():
    """train_step.idle_gaps: the time between one kernel's end (or the latest end so far, where kernels overlap) and
    the next one's start, summed per step and by the pair of kernels around each gap, largest first."""
    sys.path.insert(0, BENCH)
    try:
        import train_step
    finally:
        sys.path.remove(BENCH)

    class Event:
        def __init__(self, name, start, end):
            self.name, self.time_range = name, type("Range", (), {"start": start, "end": end})()

    # spans in ms (the events' in µs): a [0, 10], b [12, 20] (gap 2 after a), c [15, 30] overlapping b, a again
    # [35, 40] (gap 5 after c), b [41, 50] (gap 1 after a), listed out of order as the profiler may
    spans = [("b", 41, 50), ("a", 0, 10), ("c", 15, 30), ("b", 12, 20), ("a", 35, 40)]
    got = train_step.idle_gaps([Event(n, a * 1e3, b * 1e3) for n, a, b in spans], steps=2)
    assert got["idle_ms"] == 4.0
    assert got["gaps"] == [["c", "a", 0.5, 2500.0], ["a", "b", 1.0, 1500.0]]
    assert train_step.idle_gaps([], steps=1) == {"idle_ms": 0.0, "gaps": []}
