// The fused NF4 tensor-core GEMMs for training-sized M (Hopper, sm_90a): C = A * dequant(W)^T and
// dA = dC * dequant(W) with the dequantization inside the GEMM kernel: into registers or shared memory inside the
// main loop (InLoop, no bf16 copy of W), or, in builds with the development kernels, once per weight tile into a bf16
// workspace (SharedDequant, dev/nf4_fused_shared.cu) or on mma.sync (dev/nf4_fused_mma.cu).
#pragma once

#include "cuda/nf4/nf4_plan.h"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

// The fused kernel the plan names (nf4_plan.h: FusedInLoop or FusedShared on plan.grid, FusedMma), which must be
// able to run the problem (plan_nf4 checked; it takes FusedShared and FusedMma only in builds that have them).
// C[M,N] = alpha * A16[M,K] * dequant(W)^T + beta * C, A16 bf16 (row-major, 16-byte aligned), C f32 or bf16.
void launch_nf4_gemm_fused(const Context& ctx, const Nf4Plan& plan, const void* a16, std::int64_t M,
                           const Nf4Weight& w, const TensorView& c, float alpha, float beta);

// dA[M,K] = alpha * dC16[M,N] * dequant(W) + beta * dA, dC16 bf16, dA f32 or bf16.
void launch_nf4_gemm_backward_fused(const Context& ctx, const Nf4Plan& plan, const void* dc16, std::int64_t M,
                                    const Nf4Weight& w, const TensorView& da, float alpha, float beta);

}  // namespace qmm::cuda
