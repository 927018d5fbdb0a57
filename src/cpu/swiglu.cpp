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

// One adapter term t·bᵀ as a double at (row, col): t's row at t + row·ldt, b's (col, k) at b[col·bn + k·bk] (B
// [N, r]: bn = r, bk = 1; A [r, N]: bn = 1, bk = N). r = 0: no term.
template <class S>
struct Term {
  using T = typename S::T;
  const T* t = nullptr;
  const T* b = nullptr;
  std::int64_t ldt = 0, bn = 0, bk = 0, r = 0;
  double scale = 1.0;

  Term() = default;
  Term(const TensorView& tv, std::int64_t col, const TensorView& bv, bool b_is_a, double s) {
    if (bv.empty()) return;
    r = b_is_a ? bv.dim(0) : bv.dim(1);
    t = tv.data_as<const T>() + col;
    ldt = tv.dim(1);
    b = bv.data_as<const T>();
    bn = b_is_a ? 1 : r;
    bk = b_is_a ? bv.dim(1) : 1;
    scale = s;
  }
  double at(std::int64_t row, std::int64_t col) const {
    double sum = 0.0;
    for (std::int64_t k = 0; k < r; ++k) sum += S::load(t, row * ldt + k) * S::load(b, col * bn + k * bk);
    return scale * sum;
  }
};

// Element i's terms of gate, up and (backward) dh: zeros without adapters.
template <class S>
struct Terms {
  Term<S> gate, up, dh;
  std::int64_t n = 1;

  Terms(const TensorView& g, const SwiGluAdapters& ad) {
    if (ad.empty()) return;
    n = g.dim(1);
    gate = Term<S>(ad.t, 0, ad.b_gate, false, ad.gate_scale);
    up = ad.t_up.empty() ? Term<S>(ad.t, gate.r, ad.b_up, false, ad.up_scale)
                         : Term<S>(ad.t_up, 0, ad.b_up, false, ad.up_scale);
    dh = Term<S>(ad.dh_t, 0, ad.dh_a, true, 1.0);
  }
  double of(const Term<S>& term, std::int64_t i) const { return term.r > 0 ? term.at(i / n, i % n) : 0.0; }
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
    const double x = S::load(g, i) + terms.of(terms.gate, i), y = S::load(u, i) + terms.of(terms.up, i);
    S::store(out, i, x * sigmoid(x) * y);
  }
}

template <class S>
void swiglu_backward_impl(const TensorView& gate, const TensorView& up, const TensorView& dh, const TensorView& dgate,
                          const TensorView& dup, const SwiGluAdapters& ad, const TensorView& h) {
  using T = typename S::T;
  const T* g = gate.data_as<const T>();
  const T* u = up.data_as<const T>();
  const T* d = dh.data_as<const T>();
  T* dg = dgate.data_as<T>();
  T* du = dup.data_as<T>();
  T* hout = h.empty() ? nullptr : h.data_as<T>();
  const std::int64_t n = dgate.numel();
  const Terms<S> terms(gate, ad);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = S::load(g, i) + terms.of(terms.gate, i), y = S::load(u, i) + terms.of(terms.up, i);
    const double grad = S::load(d, i) + terms.of(terms.dh, i);
    const double s = sigmoid(x);
    // silu'(x) = s * (1 + x * (1 - s))
    const double dgate_v = grad * y * s * (1.0 + x * (1.0 - s));
    const double dup_v = grad * x * s;
    S::store(dg, i, dgate_v);
    S::store(du, i, dup_v);
    if (hout) S::store(hout, i, x * s * y);
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
                     const TensorView& dup, const SwiGluAdapters& adapters, const TensorView& h) {
  if (dgate.dtype() == DType::BF16)
    swiglu_backward_impl<Bf16>(gate, up, dh, dgate, dup, adapters, h);
  else
    swiglu_backward_impl<F32>(gate, up, dh, dgate, dup, adapters, h);
}

}  // namespace qmm::cpu
