// CPU reference SwiGLU: each element in double, rounded once to the storage dtype. Every element is loaded before
// its outputs are stored, so outputs may alias inputs exactly (in place). Adapters' terms (ops.h, SwiGluAdapters)
// are summed in double and added to the stored gate and up before the SwiGLU.
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

// Element i's adapter terms: (gate term, up term), zero without adapters.
template <class S>
struct Terms {
  using T = typename S::T;
  const T* t = nullptr;
  const T* bg = nullptr;
  const T* bu = nullptr;
  std::int64_t n = 1, ldt = 0, rg = 0, ru = 0;
  double sg = 0.0, su = 0.0;

  explicit Terms(const TensorView& gate, const SwiGluAdapters& ad) {
    if (ad.empty()) return;
    n = gate.dim(1);
    t = ad.t.data_as<const T>();
    ldt = ad.t.dim(1);
    if (!ad.b_gate.empty()) bg = ad.b_gate.data_as<const T>(), rg = ad.b_gate.dim(1), sg = ad.gate_scale;
    if (!ad.b_up.empty()) bu = ad.b_up.data_as<const T>(), ru = ad.b_up.dim(1), su = ad.up_scale;
  }
  double dot(const T* b, std::int64_t r, std::int64_t i, std::int64_t c0) const {
    const std::int64_t row = i / n, col = i % n;
    double s = 0.0;
    for (std::int64_t k = 0; k < r; ++k) s += S::load(t, row * ldt + c0 + k) * S::load(b, col * r + k);
    return s;
  }
  double gate(std::int64_t i) const { return rg > 0 ? sg * dot(bg, rg, i, 0) : 0.0; }
  double up(std::int64_t i) const { return ru > 0 ? su * dot(bu, ru, i, rg) : 0.0; }
};

template <class S>
void swiglu_impl(const TensorView& gate, const TensorView& up, const TensorView& h, const SwiGluAdapters& ad) {
  using T = typename S::T;
  const T* g = gate.data_as<const T>();
  const T* u = up.data_as<const T>();
  T* out = h.data_as<T>();
  const std::int64_t n = h.numel();
  const Terms<S> terms(gate, ad);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = S::load(g, i) + terms.gate(i), y = S::load(u, i) + terms.up(i);
    S::store(out, i, x * sigmoid(x) * y);
  }
}

template <class S>
void swiglu_backward_impl(const TensorView& gate, const TensorView& up, const TensorView& dh, const TensorView& dgate,
                          const TensorView& dup, const SwiGluAdapters& ad) {
  using T = typename S::T;
  const T* g = gate.data_as<const T>();
  const T* u = up.data_as<const T>();
  const T* d = dh.data_as<const T>();
  T* dg = dgate.data_as<T>();
  T* du = dup.data_as<T>();
  const std::int64_t n = dgate.numel();
  const Terms<S> terms(gate, ad);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = S::load(g, i) + terms.gate(i), y = S::load(u, i) + terms.up(i), grad = S::load(d, i);
    const double s = sigmoid(x);
    // silu'(x) = s * (1 + x * (1 - s))
    const double dgate_v = grad * y * s * (1.0 + x * (1.0 - s));
    const double dup_v = grad * x * s;
    S::store(dg, i, dgate_v);
    S::store(du, i, dup_v);
  }
}

}  // namespace

void swiglu(const TensorView& gate, const TensorView& up, const TensorView& h, const SwiGluAdapters& adapters) {
  if (h.dtype() == DType::BF16)
    swiglu_impl<Bf16>(gate, up, h, adapters);
  else
    swiglu_impl<F32>(gate, up, h, adapters);
}

void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dh, const TensorView& dgate,
                     const TensorView& dup, const SwiGluAdapters& adapters) {
  if (dgate.dtype() == DType::BF16)
    swiglu_backward_impl<Bf16>(gate, up, dh, dgate, dup, adapters);
  else
    swiglu_backward_impl<F32>(gate, up, dh, dgate, dup, adapters);
}

}  // namespace qmm::cpu
