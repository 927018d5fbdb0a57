// CPU reference SwiGLU: each element in double, rounded once to the storage dtype. Every element is loaded before
// its outputs are stored, so outputs may alias inputs exactly (in place).
#include <cmath>
#include <cstdint>

#include "cpu/cpu_backend.h"
#include "qmm/tensor.h"

namespace qmm::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr std::int64_t kParallelMin = 1 << 15;

struct F32 {
  using T = float;
  static double load(const T* p, std::int64_t i) { return p[i]; }
  static void store(T* p, std::int64_t i, double v) { p[i] = static_cast<float>(v); }
};
struct Bf16 {
  using T = std::uint16_t;
  static double load(const T* p, std::int64_t i) { return bf16_to_float(p[i]); }
  static void store(T* p, std::int64_t i, double v) { p[i] = float_to_bf16(static_cast<float>(v)); }
};

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

template <class S>
void swiglu_impl(const TensorView& gate, const TensorView& up, const TensorView& h) {
  using T = typename S::T;
  const T* g = gate.data_as<const T>();
  const T* u = up.data_as<const T>();
  T* out = h.data_as<T>();
  const std::int64_t n = h.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = S::load(g, i), y = S::load(u, i);
    S::store(out, i, x * sigmoid(x) * y);
  }
}

template <class S>
void swiglu_backward_impl(const TensorView& gate, const TensorView& up, const TensorView& dh,
                          const TensorView& dgate, const TensorView& dup) {
  using T = typename S::T;
  const T* g = gate.data_as<const T>();
  const T* u = up.data_as<const T>();
  const T* d = dh.data_as<const T>();
  T* dg = dgate.data_as<T>();
  T* du = dup.data_as<T>();
  const std::int64_t n = dgate.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = S::load(g, i), y = S::load(u, i), grad = S::load(d, i);
    const double s = sigmoid(x);
    // silu'(x) = s * (1 + x * (1 - s))
    const double dgate_v = grad * y * s * (1.0 + x * (1.0 - s));
    const double dup_v = grad * x * s;
    S::store(dg, i, dgate_v);
    S::store(du, i, dup_v);
  }
}

}  // namespace

void swiglu(const TensorView& gate, const TensorView& up, const TensorView& h) {
  if (h.dtype() == DType::BF16) swiglu_impl<Bf16>(gate, up, h);
  else swiglu_impl<F32>(gate, up, h);
}

void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dh, const TensorView& dgate,
                     const TensorView& dup) {
  if (dgate.dtype() == DType::BF16) swiglu_backward_impl<Bf16>(gate, up, dh, dgate, dup);
  else swiglu_backward_impl<F32>(gate, up, dh, dgate, dup);
}

}  // namespace qmm::cpu
