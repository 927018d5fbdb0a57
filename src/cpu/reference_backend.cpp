// The CPU reference backend as the core sees it (core/reference_backend.h): each method hands its call to
// cpu_backend.h's function. Defines reference_backend().
#include "core/reference_backend.h"

#include "cpu/cpu_backend.h"

namespace qmm {
namespace {

class CpuReference final : public ReferenceBackend {
 public:
  void gemm(const GemmProblem& p) const override { cpu::gemm(p); }
  void swiglu(const TensorView& gate, const TensorView& up, const TensorView& h,
              const SwiGluAdapters& adapters) const override {
    cpu::swiglu(gate, up, h, adapters);
  }
  void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dh, const TensorView& dgate,
                       const TensorView& dup, const SwiGluAdapters& adapters, const TensorView& h) const override {
    cpu::swiglu_backward(gate, up, dh, dgate, dup, adapters, h);
  }
  void nf4_quantize(const TensorView& w, Nf4Weight& out) const override { cpu::nf4_quantize(w, out); }
  void nf4_dequantize(const Nf4Weight& w, const TensorView& out) const override { cpu::nf4_dequantize(w, out); }
  void nf4_gemm(const TensorView& a, const Nf4Weight& w, const TensorView& c, float alpha, float beta,
                const TensorView& bias) const override {
    cpu::nf4_gemm(a, w, c, alpha, beta, bias);
  }
  void nf4_gemm_backward_a(const TensorView& dc, const Nf4Weight& w, const TensorView& da, float alpha,
                           float beta) const override {
    cpu::nf4_gemm_backward_a(dc, w, da, alpha, beta);
  }

  void cast(std::span<const TensorView> src, std::span<const TensorView> dst) const override { cpu::cast(src, dst); }
  void add(const TensorView& a, const TensorView& b, const TensorView& out, float alpha) const override {
    cpu::add(a, b, out, alpha);
  }
  void add_bias(const TensorView& y, const TensorView& bias) const override { cpu::add_bias(y, bias); }
  void dropout(const TensorView& x, const TensorView& out, float p, std::uint64_t seed) const override {
    cpu::dropout(x, out, p, seed);
  }
  void mse_loss(const TensorView& y, const TensorView& target, const TensorView& loss, const TensorView& dy,
                float scale) const override {
    cpu::mse_loss(y, target, loss, dy, scale);
  }
  void grad_norm(std::span<const TensorView> grads, const TensorView& norm) const override {
    cpu::grad_norm(grads, norm);
  }
  void adamw_step(std::span<const AdamWParam> params, const AdamWOptions& opts, int step,
                  const TensorView& norm) const override {
    cpu::adamw_step(params, opts, step, norm);
  }
  void zero(const TensorView& t) const override { cpu::zero(t); }
  void rms_norm(const TensorView& x, const TensorView& r, const TensorView& w, const TensorView& h, const TensorView& y,
                const TensorView& rstd, float eps) const override {
    cpu::rms_norm(x, r, w, h, y, rstd, eps);
  }
  void rms_norm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                         const TensorView& dx, const TensorView& dw, const TensorView& dres) const override {
    cpu::rms_norm_backward(x, w, rstd, dy, dx, dw, dres);
  }
  void rope(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
            const TensorView& q_out, const TensorView& k_out, bool inverse) const override {
    cpu::rope(q, k, cos, sin, q_out, k_out, inverse);
  }
  void linear_cross_entropy(const TensorView& h, const TensorView& w, const TensorView& labels,
                            const TensorView& loss, const TensorView& dh, const TensorView& dw,
                            std::int32_t ignore_index, bool accumulate_dw) const override {
    cpu::linear_cross_entropy(h, w, labels, loss, dh, dw, ignore_index, accumulate_dw);
  }
};

}  // namespace

const ReferenceBackend& reference_backend() {
  static const CpuReference backend;
  return backend;
}

}  // namespace qmm
