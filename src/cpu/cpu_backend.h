// The CPU reference backend's functions (the core reaches them through core/reference_backend.h): the oracle for
// every test. Arguments arrive validated. Accumulates in fp64; inputs are rounded exactly as the op's contract says
// before they are multiplied.
#pragma once

#include "core/gemm_problem.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/train_ops.h"

namespace qmm::cpu {

void gemm(const GemmProblem& p);
void swiglu(const TensorView& gate, const TensorView& up, const TensorView& h, const SwiGluAdapters& adapters);
void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dh, const TensorView& dgate,
                     const TensorView& dup, const SwiGluAdapters& adapters, const TensorView& h);
void nf4_quantize(const TensorView& w, Nf4Weight& out);
void nf4_dequantize(const Nf4Weight& w, const TensorView& out);
void nf4_gemm(const TensorView& a, const Nf4Weight& w, const TensorView& c, float alpha, float beta,
              const TensorView& bias = {});
void nf4_gemm_backward_a(const TensorView& dc, const Nf4Weight& w, const TensorView& da, float alpha, float beta);

// Train ops (train.cpp). Reductions (mse_loss, grad_norm, the clipping norm) sum in fp64 over fixed chunks in a
// fixed order, so results do not depend on the thread count.
void cast(const TensorView& src, const TensorView& dst);
void cast(std::span<const TensorView> src, std::span<const TensorView> dst);
void add(const TensorView& a, const TensorView& b, const TensorView& out, float alpha);
void add_bias(const TensorView& y, const TensorView& bias);
void dropout(const TensorView& x, const TensorView& out, float p, std::uint64_t seed);
void mse_loss(const TensorView& y, const TensorView& target, const TensorView& loss, const TensorView& dy,
              float scale);
void grad_norm(std::span<const TensorView> grads, const TensorView& norm);
void adamw_step(std::span<const AdamWParam> params, const AdamWOptions& opts, int step, const TensorView& norm);
void zero(const TensorView& t);
// r and h are absent views (rank 0) for a norm without the residual add before it (rms_norm), as dres is for a
// backward without a second gradient.
void rms_norm(const TensorView& x, const TensorView& r, const TensorView& w, const TensorView& h, const TensorView& y,
              const TensorView& rstd, float eps);
void rms_norm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                       const TensorView& dx, const TensorView& dw, const TensorView& dres);
// k and k_out are absent views (rank 0) where there is no k.
void rope(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
          const TensorView& q_out, const TensorView& k_out, bool inverse);
void linear_cross_entropy(const TensorView& h, const TensorView& w, const TensorView& labels, const TensorView& loss,
                          const TensorView& dh, const TensorView& dw, std::int32_t ignore_index, bool accumulate_dw);

}  // namespace qmm::cpu
