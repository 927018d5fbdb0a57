// Host helpers of the small-M forward launches (nf4_small_m.cu), shared with the slice kernel's launches
// (nf4_slice.cu). For .cu files: the kernels' argument types come from device headers.
#pragma once

#include <cstdint>
#include <memory>

#include "cuda/common/cuda_state.h"
#include "cuda/nf4/nf4_small_m.cuh"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/tensor.h"

namespace qmm::cuda::small_m {

// What a forward call writes: C (one weight) or gate_up's outputs (two, C empty), alpha * sum (+ beta * old).
struct ForwardOut {
  TensorView c;
  GateUpOut gate_up;
  float alpha, beta;
};

// The forward kernels' view of a weight.
WeightArgs weight_args(const Nf4Weight& w);
// Scratch for `floats` fp32 partial sums (split-K, or gate and up for the reduction), owned by `scratch`.
float* new_partials(const Context& ctx, std::unique_ptr<ScratchBuffer>& scratch, std::int64_t floats);
// The pair kernel's preconditions beyond the small-M ones (its table and ring steps; the slice kernel's too).
bool pair_fits(const Context& ctx, const TensorView& a, const Nf4Weight& w);
// gate_up's reduction of split-K partials [weight][split][M][N] into its outputs.
void launch_gate_up_reduce(const Context& ctx, const float* partial, int splits, std::int64_t mn, const GateUpOut& o,
                           float alpha, float beta);
// gate_up's outputs as the kernels take them.
GateUpOut gate_up_out(const GateUpOutputs& out);

}  // namespace qmm::cuda::small_m
