// How the core reaches the CPU reference backend, as it reaches a GPU through GpuBackend (core/gpu_backend.h): the
// core validates every argument and hands CPU work to the ReferenceBackend that src/cpu/reference_backend.cpp
// defines. No core file includes a backend's headers; a backend includes the core's.
// Arguments arrive validated. The backend accumulates in fp64 and rounds inputs exactly as each op's contract says:
// it is the oracle every test compares against.
#pragma once

#include <cstdint>
#include <span>

#include "core/gemm_problem.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/train_ops.h"

namespace qmm {

class ReferenceBackend {
 public:
  virtual ~ReferenceBackend() = default;

  // GEMMs, SwiGLU and NF4 (ops.h, nf4.h).
  virtual void gemm(const GemmProblem& p) const = 0;
  virtual void swiglu(const TensorView& gate, const TensorView& up, const TensorView& h,
                      const SwiGluAdapters& adapters) const = 0;
  virtual void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dh,
                               const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters,
                               const TensorView& h) const = 0;
  virtual void nf4_quantize(const TensorView& w, Nf4Weight& out) const = 0;
  virtual void nf4_dequantize(const Nf4Weight& w, const TensorView& out) const = 0;
  // c = alpha·a·dequant(W)ᵀ + beta·c (+ bias [N] on every row, where not empty), rounded once.
  virtual void nf4_gemm(const TensorView& a, const Nf4Weight& w, const TensorView& c, float alpha, float beta,
                        const TensorView& bias = {}) const = 0;
  virtual void nf4_gemm_backward_a(const TensorView& dc, const Nf4Weight& w, const TensorView& da, float alpha,
                                   float beta) const = 0;

  // Train ops (train_ops.h). Reductions (mse_loss, grad_norm, the clipping norm) sum in fp64 over fixed chunks in a
  // fixed order, so results do not depend on the thread count.
  virtual void cast(std::span<const TensorView> src, std::span<const TensorView> dst) const = 0;
  virtual void add(const TensorView& a, const TensorView& b, const TensorView& out, float alpha) const = 0;
  virtual void add_bias(const TensorView& y, const TensorView& bias) const = 0;
  virtual void dropout(const TensorView& x, const TensorView& out, float p, std::uint64_t seed) const = 0;
  virtual void mse_loss(const TensorView& y, const TensorView& target, const TensorView& loss, const TensorView& dy,
                        float scale) const = 0;
  virtual void grad_norm(std::span<const TensorView> grads, const TensorView& norm) const = 0;
  virtual void adamw_step(std::span<const AdamWParam> params, const AdamWOptions& opts, int step,
                          const TensorView& norm) const = 0;
  virtual void zero(const TensorView& t) const = 0;
  // r and h are absent views (rank 0) without the residual add (rms_norm), dres without a second gradient.
  virtual void rms_norm(const TensorView& x, const TensorView& r, const TensorView& w, const TensorView& h,
                        const TensorView& y, const TensorView& rstd, float eps) const = 0;
  virtual void rms_norm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                                 const TensorView& dx, const TensorView& dw, const TensorView& dres) const = 0;
  // k and k_out are absent views (rank 0) where there is no k.
  virtual void rope(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
                    const TensorView& q_out, const TensorView& k_out, bool inverse) const = 0;
  // The labels are not checked here (the core did, where asked). accumulate_dw false: dw written, never read.
  virtual void linear_cross_entropy(const TensorView& h, const TensorView& w, const TensorView& labels,
                                    const TensorView& loss, const TensorView& dh, const TensorView& dw,
                                    std::int32_t ignore_index, bool accumulate_dw) const = 0;
};

// The CPU reference backend (always linked).
const ReferenceBackend& reference_backend();

}  // namespace qmm
