// The fused small-M NF4 GEMM (C = A * dequant(W)^T for M <= 32): reads each weight byte once with 16-byte loads
// and multiplies on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate). With blocks of 64 and K a
// multiple of 256, up to 16 rows take the pair kernel on sm_90 (one table of code-byte pairs, the block scale
// applied after the product: the scale-after contract in ops.h; f32 A rounded to bf16 by a packing kernel);
// otherwise per-lane tables of the block's 16 scaled values, on the tensor cores, or at M = 1 a GEMV kernel (same
// tables, FMAs). The slice kernel (M <= 16, the pair kernel's table and contract, A held in registers) runs only
// where SmallMKernel::Slice forces it, for now. See nf4_small_m.cuh.
#pragma once

#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

constexpr int kNf4SmallMMaxRows = 32;          // forward
constexpr int kNf4SmallMBackwardMaxRows = 16;  // input gradient

// Whether the fast kernels can take this problem (M <= 32, K a multiple of 64, NF4 blocks of at least 64,
// 16-byte aligned A and codes); callers fall back to dequantize + GEMM otherwise.
bool nf4_small_m_supported(const TensorView& a, const Nf4Weight& w);

// Which small-M forward kernel launch_nf4_gemm_small_m runs. Auto: chosen by shape and GPU (launch_rows in
// nf4_small_m.cu). Slice: the slice kernel (nf4_small_m.cuh; M <= 16, blocks of 64, K a multiple of 256, a GPU that
// gives a block its shared memory: sm_90), which Auto does not take until it has run and been timed on the GPU;
// tests force it. Forced where it does not fit, it throws Unsupported.
enum class SmallMKernel { Auto, Slice };
bool nf4_small_m_slice_supported(const Context& ctx, const TensorView& a, const Nf4Weight& w);

void launch_nf4_gemm_small_m(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
                             float alpha, float beta, SmallMKernel kernel = SmallMKernel::Auto);

// gate and up in one launch (both weights of one shape), then h = silu(gate)*up where out.h is given; beta
// accumulates into gate and up (only without h). SmallMKernel::Slice: as for nf4_gemm, both weights in one scale
// format.
void launch_nf4_gate_up_small_m(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate,
                                const Nf4Weight& w_up, const GateUpOutputs& out, float alpha, float beta,
                                SmallMKernel kernel = SmallMKernel::Auto);

// dA = dC * dequant(W) for M <= 16 (K a multiple of 32, blocks of at least 32, 16-byte aligned codes).
bool nf4_small_m_backward_supported(const TensorView& dc, const Nf4Weight& w);
void launch_nf4_gemm_backward_small_m(const Context& ctx, const TensorView& dc, const Nf4Weight& w,
                                      const TensorView& da, float alpha, float beta);

// C = alpha * (sum over splits of partial[split][mn]) + beta * C: the split-K reduction (fixed order, so
// deterministic), shared with the fused kernel.
void launch_nf4_split_k_reduce(const Context& ctx, const float* partial, int splits, std::int64_t mn,
                               const TensorView& c, float alpha, float beta);

}  // namespace qmm::cuda
