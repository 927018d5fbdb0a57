// The fused NF4 tensor-core GEMMs for training-sized M (Hopper, sm_90a): C = A * dequant(W)^T and
// dA = dC * dequant(W) with the dequantization inside the GEMM kernel: into registers or shared memory inside the
// main loop (InLoop, no bf16 copy of W), or once per weight tile into a bf16 workspace (SharedDequant).
#pragma once

#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

// Whether the fused kernel can take this problem on ctx's device: an sm_90a build on a compute capability 9.0
// GPU, K a multiple of 64, a block size that is a multiple of 64, 16-byte aligned bf16 activations (A, or dC for
// the input gradient) and codes, and for the input gradient N a multiple of 8. Callers fall back to
// dequantize + GEMM otherwise. `why` (when not null) gets the first unmet condition.
bool nf4_fused_supported(const Context& ctx, const TensorView& activations, const Nf4Weight& w, bool backward,
                         const char** why = nullptr);

// The problem conditions every fused kernel (these and nf4_fused_mma.h's) shares, stages of 64 along K and 16-byte
// rows: K and the block size multiples of 64, for the input gradient N a multiple of 8, 16-byte aligned bf16
// activations and codes. Returns the first one the problem misses, or null.
const char* nf4_fused_shape_unmet(const TensorView& activations, const Nf4Weight& w, bool backward);

// How full the fused kernel's last wave of CTAs keeps the GPU for this problem (its output tiles times its split-K
// factor over whole waves of one CTA per SM), in (0, 1]: the dispatcher's measure of wave quantization.
double nf4_fused_wave_fill(const Context& ctx, std::int64_t M, const Nf4Weight& w, bool backward);

// The fused kernels: InLoop dequantizes each CTA's weight tiles inside its main loop (Nf4Path::Fused);
// SharedDequant dequantizes each tile once per launch, by whichever CTA sharing it claims it, into a bf16
// workspace of W's size that the others load with TMA (Nf4Path::FusedShared); Mma is the in-loop kernel on
// mma.sync for any GPU from sm_80 on (Nf4Path::FusedMma, nf4_fused_mma.h: its own preconditions).
enum class FusedKernel { InLoop, SharedDequant, Mma };

// C[M,N] = alpha * A16[M,K] * dequant(W)^T + beta * C, A16 bf16 (row-major, 16-byte aligned), C f32 or bf16.
void launch_nf4_gemm_fused(const Context& ctx, const void* a16, std::int64_t M, const Nf4Weight& w,
                           const TensorView& c, float alpha, float beta, FusedKernel kernel);

// dA[M,K] = alpha * dC16[M,N] * dequant(W) + beta * dA, dC16 bf16, dA f32 or bf16.
void launch_nf4_gemm_backward_fused(const Context& ctx, const void* dc16, std::int64_t M, const Nf4Weight& w,
                                    const TensorView& da, float alpha, float beta, FusedKernel kernel);

}  // namespace qmm::cuda
