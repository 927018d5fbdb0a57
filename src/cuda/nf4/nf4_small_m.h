// The fused small-M NF4 GEMM (C = A * dequant(W)^T for M <= 32): reads each weight byte once with 16-byte loads
// and multiplies on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate). With blocks of 64 and K a
// multiple of 256, up to 16 rows take the pair kernel on sm_90 (one table of code-byte pairs, the block scale
// applied after the product: the scale-after contract in ops.h; f32 A rounded to bf16 by a packing kernel);
// otherwise per-lane tables of the block's 16 scaled values, on the tensor cores, or at M = 1 a GEMV kernel (same
// tables, FMAs). Device code: nf4_small_m.cuh (one header per kernel). The slice kernel (Auto's choice for bf16
// activations where it fits, up to 16 rows) is in nf4_slice.h.
#pragma once

#include "cuda/nf4/nf4_plan.h"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

constexpr int kNf4SmallMMaxRows = 32;          // forward
constexpr int kNf4SmallMBackwardMaxRows = 16;  // input gradient

// The small-M forward kernels: the one the plan names (nf4_plan.h: SmallMPair, SmallMGemv or SmallMTable, with
// its n8 tiles and whether A is packed), which must be able to run the problem (plan_nf4 checked).
void launch_nf4_gemm_small_m(const Context& ctx, const Nf4Plan& plan, const TensorView& a, const Nf4Weight& w,
                             const TensorView& c, float alpha, float beta);

// gate and up in one launch (both weights of one shape), then h = silu(gate)*up where out.h is given; beta
// accumulates into gate and up (only without h).
void launch_nf4_gate_up_small_m(const Context& ctx, const Nf4Plan& plan, const TensorView& a,
                                const Nf4Weight& w_gate, const Nf4Weight& w_up, const GateUpOutputs& out, float alpha,
                                float beta);

// dA = dC * dequant(W) for M <= 16 (plan SmallMBackward: its m8 tiles).
void launch_nf4_gemm_backward_small_m(const Context& ctx, const Nf4Plan& plan, const TensorView& dc,
                                      const Nf4Weight& w, const TensorView& da, float alpha, float beta);

// C = alpha * (sum over splits of partial[split][mn]) + beta * C: the split-K reduction (fixed order, so
// deterministic), shared with the fused kernel.
void launch_nf4_split_k_reduce(const Context& ctx, const float* partial, int splits, std::int64_t mn,
                               const TensorView& c, float alpha, float beta);

}  // namespace qmm::cuda
