// The fused NF4 GEMM on mma.sync for GPUs from Ampere on (forced path fused_mma): the weight dequantized inside the
// GEMM's main loop, no bf16 copy of W in memory. See nf4_fused_mma.cu.
#pragma once

#include <cstdint>

#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

// Forward: out[M,N] = alpha * X16[M,K] * dequant(W)^T + beta * out; backward (input gradient): out[M,K] =
// alpha * X16[M,N] * dequant(W) + beta * out. X16 bf16 (row-major, 16-byte aligned), out f32 or bf16.
void launch_nf4_fused_mma(const Context& ctx, const void* x16, std::int64_t M, const Nf4Weight& w,
                          const TensorView& out, float alpha, float beta, bool backward);

}  // namespace qmm::cuda
