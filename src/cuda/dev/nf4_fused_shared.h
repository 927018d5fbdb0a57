// The shared-dequantization fused NF4 GEMM on Hopper (forced path fused_shared): each weight tile dequantized once
// per call into a bf16 workspace that the CTAs sharing it load with TMA. A development kernel (QMM_DEV_KERNELS builds).
// See nf4_fused_shared.cu.
#pragma once

#include <cstdint>

#include "cuda/nf4/nf4_plan.h"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

// out = alpha * b16 · Tᵀ + beta * out with T = dequant(W) (forward: b16 = A [M, K]) or dequant(W)ᵀ (input
// gradient: b16 = dC [M, N]), on the plan's grid; b16 is bf16, out f32 or bf16. The plan checked the problem.
void launch_nf4_fused_shared(const Context& ctx, const Nf4FusedGrid& grid, const void* b16, std::int64_t M,
                             const Nf4Weight& w, const TensorView& out, float alpha, float beta, bool backward);

}  // namespace qmm::cuda
