"""qmm for PyTorch: qmm's GEMMs, SwiGLU and NF4 ops on torch tensors, on the CPU (reference backend) or a GPU.

Ops run on the tensors' device: CPU tensors on qmm's CPU reference backend, CUDA tensors on the GPU backend, in
PyTorch's current stream. Inputs are taken as they are when dense row-major (otherwise as a contiguous copy);
outputs are allocated here unless passed as `out=`, which must be dense row-major (qmm writes it in place, as
PyTorch's in-place ops do: refused where it requires grad in grad mode, its version bumped for autograd). Every
error is a `qmm.Error` (a RuntimeError) whose `code` names the kind ("ShapeMismatch", "Unsupported", ...); no
output is written when an op fails. On the GPU, qmm keeps one context per (device, stream) with its own cuBLASLt
workspace and a CUDA memory pool for scratch (the bf16 copy of the weight that the dequantize-then-GEMM path
writes, for one): memory that PyTorch's allocator does not see (qmm.memory_stats reports it,
qmm.release_cached_memory gives it back).

    import qmm, torch
    w4 = qmm.Nf4Weight.quantize(w.cuda())               # W [out, in] -> NF4, bitsandbytes' layout
    y = qmm.nf4_linear(x, w4)                          # x [..., in] -> [..., out], differentiable in x
    layer = qmm.QLoraLinear(w4, rank=16, alpha=32)     # frozen NF4 base + trainable LoRA adapters
    mlp = qmm.QLoraSwiGluMlp(w4_gate, w4_up, w4_down)  # an MLP block on NF4 weights, LoRA on all three
    qmm.patch_bnb(peft_model)                          # or: a bitsandbytes/PEFT QLoRA model, computed by qmm
    qmm.patch_bnb(peft_model, fused_loss=True, fused_norm=True, fused_rope=True)  # training: loss, norms, rope too
    step = qmm.graph_step(train_step)                  # a whole training step replayed as one CUDA graph
    qmm.static_decoder(model, 1024).generate(ids, max_new_tokens=64)  # decode steps replayed as CUDA graphs
"""
from . import compile_ops, functional, generate, graphs, layers, nf4, ops, patch  # noqa: F401 (by concern)
from ._base import Error
from .functional import (Lora, add_rms_norm_autograd, linear_cross_entropy_loss, lora_nf4_linear, lora_nf4_linears,
                         lora_nf4_mlp, lora_nf4_swiglu, nf4_gate_up_linear, nf4_linear, nf4_swiglu, rms_norm_autograd,
                         rms_norm_residual_autograd, rope_autograd, swiglu_autograd)
from .generate import static_decoder
from .graphs import graph_step
from .layers import LoraAdapter, QLoraLinear, QLoraSwiGluMlp, replace_bnb_linears, replace_bnb_mlps
from .nf4 import NF4_CODEBOOK, NF4_NESTED_BLOCK_SIZE, Nf4Weight
from .ops import (add_rms_norm, batched_gemm, cuda_device_count, gemm, gemm_backward_a, gemm_backward_b, gemm_bt,
                  linear_cross_entropy, lora_backward_dy, memory_stats, nf4_gate_up, nf4_gemm, nf4_gemm_backward_a,
                  release_cached_memory, reset_peak_memory_stats, rms_norm, rms_norm_backward, rope, swiglu,
                  swiglu_backward)
from .patch import patch_bnb, unpatch_bnb

__all__ = [
    "Error", "Lora", "LoraAdapter", "Nf4Weight", "QLoraLinear", "QLoraSwiGluMlp", "add_rms_norm",
    "add_rms_norm_autograd", "batched_gemm", "cuda_device_count", "gemm", "gemm_backward_a", "gemm_backward_b",
    "gemm_bt", "graph_step", "linear_cross_entropy", "linear_cross_entropy_loss", "lora_backward_dy", "lora_nf4_linear",
    "lora_nf4_linears", "lora_nf4_mlp", "lora_nf4_swiglu", "memory_stats", "nf4_gate_up", "nf4_gate_up_linear",
    "nf4_gemm", "nf4_gemm_backward_a", "nf4_linear", "nf4_swiglu", "patch_bnb", "release_cached_memory",
    "replace_bnb_linears", "replace_bnb_mlps", "reset_peak_memory_stats", "rms_norm", "rms_norm_autograd",
    "rms_norm_backward", "rms_norm_residual_autograd", "rope", "rope_autograd", "static_decoder", "swiglu",
    "swiglu_autograd", "swiglu_backward", "unpatch_bnb",
]
