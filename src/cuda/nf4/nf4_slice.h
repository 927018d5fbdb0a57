// The small-M slice kernel (M <= 16, blocks of 64, K a multiple of 256, a GPU that gives a block its shared
// memory: sm_90): the pair kernel's table and contract in another order, each warp holding a slice of K of A in
// registers and streaming weight row groups past it (nf4_slice_kernel.cuh). Auto takes it for bf16 activations
// where it fits and beat the pair kernel (nf4_plan.cpp's rule), the forced path small_m_slice anywhere it fits;
// the GPU tests also launch it here. Where it does not fit, the launches throw Unsupported.
#pragma once

#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

bool nf4_small_m_slice_supported(const Context& ctx, const TensorView& a, const Nf4Weight& w);
void launch_nf4_gemm_small_m_slice(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
                                   float alpha, float beta);
// Both weights in one scale format.
void launch_nf4_gate_up_small_m_slice(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate,
                                      const Nf4Weight& w_up, const GateUpOutputs& out, float alpha, float beta);

}  // namespace qmm::cuda
