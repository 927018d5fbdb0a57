// CPU reference of the train ops. Element-wise ops evaluate in double and round once to the storage dtype;
// reductions sum in fp64 over fixed chunks, and the chunk sums in index order, so the result is the same for any
// number of threads. Every element is read before it is written, so exact in-place aliases are safe.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/train_math.h"
#include "cpu/cpu_backend.h"
#include "qmm/tensor.h"

namespace qmm::cpu {
namespace {

constexpr std::int64_t kParallelMin = 1 << 15;  // below this a parallel region costs more than it saves
constexpr std::int64_t kChunk = 1 << 14;        // reduction chunk: the unit of the fixed summation order

// Storage <-> double. bf16 is held as its 16-bit pattern.
double load(const float* p, std::int64_t i) { return p[i]; }
double load(const std::uint16_t* p, std::int64_t i) { return bf16_to_float(p[i]); }
void store(float* p, std::int64_t i, double v) { p[i] = static_cast<float>(v); }
void store(std::uint16_t* p, std::int64_t i, double v) { p[i] = float_to_bf16(static_cast<float>(v)); }

// Calls fn with a null pointer of the storage type of `dtype` (f32 or bf16), to pick a template instance.
template <class Fn>
void with_storage(DType dtype, Fn&& fn) {
  if (dtype == DType::BF16)
    fn(static_cast<std::uint16_t*>(nullptr));
  else
    fn(static_cast<float*>(nullptr));
}

// Sum of term(i) for i in [0, n) in fp64: chunk sums in parallel, then added in chunk order.
template <class Term>
double fixed_order_sum(std::int64_t n, Term&& term) {
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<std::size_t>(chunks));
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t c = 0; c < chunks; ++c) {
    double s = 0;
    const std::int64_t end = std::min(n, (c + 1) * kChunk);
    for (std::int64_t i = c * kChunk; i < end; ++i) s += term(i);
    part[static_cast<std::size_t>(c)] = s;
  }
  double total = 0;
  for (double s : part) total += s;
  return total;
}

double sum_squares(const TensorView& t) {
  double s = 0;
  with_storage(t.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = t.data_as<const T>();
    s = fixed_order_sum(t.numel(), [&](std::int64_t i) {
      const double v = load(x, i);
      return v * v;
    });
  });
  return s;
}

}  // namespace

void cast(const TensorView& src, const TensorView& dst) {
  const std::int64_t n = dst.numel();
  if (src.dtype() == dst.dtype()) {
    std::memmove(dst.data(), src.data(), dst.nbytes());
    return;
  }
  if (dst.dtype() == DType::BF16) {
    const float* s = src.data_as<const float>();
    std::uint16_t* d = dst.data_as<std::uint16_t>();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (std::int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
  } else {
    const std::uint16_t* s = src.data_as<const std::uint16_t>();
    float* d = dst.data_as<float>();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (std::int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
  }
}

void cast(std::span<const TensorView> src, std::span<const TensorView> dst) {
  for (std::size_t i = 0; i < src.size(); ++i) cast(src[i], dst[i]);
}

void add(const TensorView& a, const TensorView& b, const TensorView& out, float alpha) {
  with_storage(out.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = a.data_as<const T>();
    const T* y = b.data_as<const T>();
    T* o = out.data_as<T>();
    const std::int64_t n = out.numel();
    const double s = alpha;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (std::int64_t i = 0; i < n; ++i) store(o, i, load(x, i) + s * load(y, i));
  });
}

void add_bias(const TensorView& y, const TensorView& bias) {
  const std::int64_t rows = y.dim(0), cols = y.dim(1);
  std::vector<double> b(static_cast<std::size_t>(cols));
  with_storage(bias.dtype(), [&](auto* tag) {
    using B = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t j = 0; j < cols; ++j) b[static_cast<std::size_t>(j)] = load(bias.data_as<const B>(), j);
  });
  with_storage(y.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* out = y.data_as<T>();
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < cols; ++j) {
        const std::int64_t i = r * cols + j;
        store(out, i, load(out, i) + b[static_cast<std::size_t>(j)]);
      }
  });
}

void dropout(const TensorView& x, const TensorView& out, float p, std::uint64_t seed) {
  const std::uint64_t key = train::dropout_key(seed);
  const std::uint32_t threshold = train::dropout_threshold(p);
  const double scale = train::dropout_scale(p);  // an fp32 value; x * scale is exact in double, rounded once
  with_storage(out.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = x.data_as<const T>();
    T* o = out.data_as<T>();
    const std::int64_t n = out.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (std::int64_t i = 0; i < n; ++i)
      store(o, i, train::dropout_keep_at(key, i, threshold) ? load(in, i) * scale : 0.0);
  });
}

void mse_loss(const TensorView& y, const TensorView& target, const TensorView& loss, const TensorView& dy,
              float scale) {
  const std::int64_t n = y.numel();
  const double coef = train::mse_grad_coef(scale, n);
  double sum = 0;
  with_storage(y.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* py = y.data_as<const T>();
    const T* pt = target.data_as<const T>();
    T* pd = dy.data_as<T>();
    sum = fixed_order_sum(n, [&](std::int64_t i) {
      const double d = load(py, i) - load(pt, i);
      store(pd, i, coef * d);  // after both loads: dy may be y or target itself
      return d * d;
    });
  });
  *loss.data_as<float>() = static_cast<float>(sum / static_cast<double>(n));
}

void grad_norm(std::span<const TensorView> grads, const TensorView& norm) {
  double s = 0;
  for (const TensorView& g : grads) s += sum_squares(g);
  *norm.data_as<float>() = static_cast<float>(std::sqrt(s));
}

void adamw_step(std::span<const AdamWParam> params, const AdamWOptions& opts, int step, const TensorView& norm) {
  const bool clip = opts.max_grad_norm > 0;
  float coef = 1.0f;
  if (clip || !norm.empty()) {
    double s = 0;
    for (const AdamWParam& p : params) s += sum_squares(p.grad);
    const float total = static_cast<float>(std::sqrt(s));
    if (!norm.empty()) *norm.data_as<float>() = total;
    if (clip) coef = train::clip_coefficient(total, opts.max_grad_norm);
  }
  const double lr = opts.lr, wd = opts.weight_decay, b1 = opts.beta1, b2 = opts.beta2, eps = opts.eps;
  const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
  for (const AdamWParam& p : params) {
    float* w = p.param.data_as<float>();
    const float* g = p.grad.data_as<const float>();
    float* m = p.m.data_as<float>();
    float* v = p.v.data_as<float>();
    const std::int64_t n = p.param.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (std::int64_t i = 0; i < n; ++i) {
      const double gi = static_cast<double>(g[i]) * coef;
      double wi = w[i];
      wi -= lr * wd * wi;  // decoupled weight decay, before the Adam update
      const double mi = b1 * m[i] + (1.0 - b1) * gi;
      const double vi = b2 * v[i] + (1.0 - b2) * gi * gi;
      wi -= lr * (mi / bc1) / (std::sqrt(vi / bc2) + eps);
      w[i] = static_cast<float>(wi);
      m[i] = static_cast<float>(mi);
      v[i] = static_cast<float>(vi);
    }
  }
}

void zero(const TensorView& t) { std::memset(t.data(), 0, t.nbytes()); }

// The storage dtype's value of v (the rounding a bf16 or f32 store makes).
template <class T>
double rounded(double v) {
  T tmp;
  store(&tmp, 0, v);
  return load(&tmp, 0);
}

void rms_norm(const TensorView& x, const TensorView& res, const TensorView& w, const TensorView& h, const TensorView& y,
              const TensorView& rstd, float eps) {
  const std::int64_t rows = x.dim(0), hid = x.dim(1);
  with_storage(x.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* wp = w.data_as<const T>();
    T* yp = y.data_as<T>();
    // With the residual add, the norm reads h = x + res, written first (h may be x or res: element by element).
    const T* in = x.data_as<const T>();
    const T* rp = res.empty() ? nullptr : res.data_as<const T>();
    T* hp = res.empty() ? nullptr : h.data_as<T>();
    const T* xp = rp ? hp : in;
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      if (rp)
        for (std::int64_t k = 0; k < hid; ++k) store(hp, r * hid + k, load(in, r * hid + k) + load(rp, r * hid + k));
      double ss = 0;
      for (std::int64_t k = 0; k < hid; ++k) ss += load(xp, r * hid + k) * load(xp, r * hid + k);
      const float rs = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(hid) + eps));  // fp32, the contract
      if (!rstd.empty()) rstd.data_as<float>()[r] = rs;
      for (std::int64_t k = 0; k < hid; ++k)  // y may be x: each element read before it is written
        store(yp, r * hid + k, load(wp, k) * rounded<T>(load(xp, r * hid + k) * rs));
    }
  });
}

void rms_norm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                       const TensorView& dx, const TensorView& dw, const TensorView& dres) {
  const std::int64_t rows = x.dim(0), hid = x.dim(1);
  const float* rs = rstd.data_as<const float>();
  with_storage(x.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.data_as<const T>();
    const T* wp = w.data_as<const T>();
    const T* dyp = dy.data_as<const T>();
    if (!dw.empty()) {  // first: dx may be dy. Each column summed over the rows in order.
      float* dwp = dw.data_as<float>();
#pragma omp parallel for schedule(static)
      for (std::int64_t k = 0; k < hid; ++k) {
        double acc = 0;
        for (std::int64_t r = 0; r < rows; ++r) acc += load(dyp, r * hid + k) * load(xp, r * hid + k) * rs[r];
        dwp[k] = static_cast<float>(dwp[k] + acc);
      }
    }
    if (dx.empty()) return;
    T* dxp = dx.data_as<T>();
    const T* dresp = dres.empty() ? nullptr : dres.data_as<const T>();
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      double dot = 0;
      for (std::int64_t k = 0; k < hid; ++k)
        dot += load(dyp, r * hid + k) * load(wp, k) * load(xp, r * hid + k) * rs[r];
      const double mean = dot / static_cast<double>(hid);
      for (std::int64_t k = 0; k < hid; ++k) {
        const double g = load(dyp, r * hid + k) * load(wp, k), xh = load(xp, r * hid + k) * rs[r];
        store(dxp, r * hid + k, rs[r] * (g - xh * mean) + (dresp ? load(dresp, r * hid + k) : 0.0));
      }
    }
  });
}

// Each pair (x1, x2) = (x[j], x[j + D/2]) of a head rotated in fp64 with the token's cos and sin, rounded once. The
// inverse is the forward with (s1, s2) replaced by (−s2, −s1): y1 = x1·c1 − x2·a, y2 = x2·c2 + x1·b for both.
void rope(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
          const TensorView& q_out, const TensorView& k_out, bool inverse) {
  const std::int64_t seq = q.dim(1), dim = q.dim(3), half = dim / 2, tokens = q.dim(0) * seq;
  const bool per_batch = cos.dim(0) != 1;  // else one row of cos and sin per position, for every sequence
  with_storage(cos.dtype(), [&](auto* ctag) {
    using C = std::remove_pointer_t<decltype(ctag)>;
    const C* cp = cos.data_as<const C>();
    const C* sp = sin.data_as<const C>();
    with_storage(q.dtype(), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      const auto rotate = [&](const TensorView& x, const TensorView& out) {
        if (x.rank() != 4) return;  // no k
        const std::int64_t heads = x.dim(2);
        const T* xp = x.data_as<const T>();
        T* yp = out.data_as<T>();
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= kParallelMin)
        for (std::int64_t t = 0; t < tokens; ++t) {
          const std::int64_t row = (per_batch ? t : t % seq) * dim;
          for (std::int64_t h = 0; h < heads; ++h)
            for (std::int64_t j = 0; j < half; ++j) {
              const std::int64_t i = (t * heads + h) * dim + j;
              const double x1 = load(xp, i), x2 = load(xp, i + half);  // both read before either is written
              const double c1 = load(cp, row + j), c2 = load(cp, row + j + half);
              const double s1 = load(sp, row + j), s2 = load(sp, row + j + half);
              const double a = inverse ? -s2 : s1, b = inverse ? -s1 : s2;
              store(yp, i, x1 * c1 - x2 * a);
              store(yp, i + half, x2 * c2 + x1 * b);
            }
        }
      };
      rotate(q, q_out);
      rotate(k, k_out);
    });
  });
}

// Token by token in fp64: the logits row, its log-sum-exp, the loss term, and (for the gradients) the row of
// (softmax - onehot) / n; a label out of range (not checked: CrossEntropyOptions::check_labels off) gives a NaN
// loss term and gradient row, as on a GPU. Per-token losses are summed in token order; dw's rows are summed over
// tokens in order (each thread owns whole rows of dw), so the result does not depend on the thread count.
void linear_cross_entropy(const TensorView& h, const TensorView& w, const TensorView& labels, const TensorView& loss,
                          const TensorView& dh, const TensorView& dw, std::int32_t ignore_index, bool accumulate_dw) {
  const std::int64_t t = h.dim(0), hid = h.dim(1), vocab = w.dim(0);
  const std::int32_t* lab = labels.data_as<const std::int32_t>();
  std::int64_t n = 0;
  const auto in_range = [&](std::int32_t y) { return y >= 0 && y < vocab; };
  for (std::int64_t i = 0; i < t; ++i) n += lab[i] != ignore_index && in_range(lab[i]);
  const bool want_grads = !dh.empty() || !dw.empty();
  const bool round_logits = h.dtype() == DType::BF16;  // a bf16 head writes bf16 logits (the GPU backend's too)
  std::vector<double> hd(static_cast<std::size_t>(t * hid)), wd(static_cast<std::size_t>(vocab * hid));
  with_storage(h.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t i = 0; i < t * hid; ++i) hd[static_cast<std::size_t>(i)] = load(h.data_as<const T>(), i);
    for (std::int64_t i = 0; i < vocab * hid; ++i) wd[static_cast<std::size_t>(i)] = load(w.data_as<const T>(), i);
  });
  std::vector<double> token_loss(static_cast<std::size_t>(t), 0.0);
  // g[i, v] = (softmax - onehot) / n for counted tokens, 0 for ignored ones.
  std::vector<double> g(want_grads ? static_cast<std::size_t>(t * vocab) : 0, 0.0);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < t; ++i) {
    if (lab[i] == ignore_index) continue;
    if (!in_range(lab[i])) {
      token_loss[static_cast<std::size_t>(i)] = NAN;
      if (want_grads) std::fill_n(g.begin() + i * vocab, vocab, NAN);
      continue;
    }
    std::vector<double> z(static_cast<std::size_t>(vocab));
    double zmax = -INFINITY;
    for (std::int64_t v = 0; v < vocab; ++v) {
      double acc = 0;
      for (std::int64_t k = 0; k < hid; ++k)
        acc += hd[static_cast<std::size_t>(i * hid + k)] * wd[static_cast<std::size_t>(v * hid + k)];
      if (round_logits) acc = bf16_to_float(float_to_bf16(static_cast<float>(acc)));
      z[static_cast<std::size_t>(v)] = acc;
      zmax = std::max(zmax, acc);
    }
    double sum = 0;
    for (double zv : z) sum += std::exp(zv - zmax);
    const double lse = zmax + std::log(sum);
    token_loss[static_cast<std::size_t>(i)] = lse - z[static_cast<std::size_t>(lab[i])];
    if (!want_grads) continue;
    for (std::int64_t v = 0; v < vocab; ++v)
      g[static_cast<std::size_t>(i * vocab + v)] =
          (std::exp(z[static_cast<std::size_t>(v)] - lse) - (v == lab[i] ? 1.0 : 0.0)) / static_cast<double>(n);
  }
  double total = 0;
  for (double l : token_loss) total += l;
  loss.data_as<float>()[0] = std::isnan(total) ? NAN
                              : n > 0           ? static_cast<float>(total / static_cast<double>(n))
                                                : 0.0f;
  if (!dh.empty()) {
    with_storage(dh.dtype(), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < t; ++i)
        for (std::int64_t k = 0; k < hid; ++k) {
          double acc = 0;
          for (std::int64_t v = 0; v < vocab; ++v)
            acc += g[static_cast<std::size_t>(i * vocab + v)] * wd[static_cast<std::size_t>(v * hid + k)];
          store(dh.data_as<T>(), i * hid + k, acc);
        }
    });
  }
  if (!dw.empty()) {
    float* out = dw.data_as<float>();
#pragma omp parallel for schedule(static)
    for (std::int64_t v = 0; v < vocab; ++v)
      for (std::int64_t k = 0; k < hid; ++k) {
        double acc = 0;
        for (std::int64_t i = 0; i < t; ++i)
          acc += g[static_cast<std::size_t>(i * vocab + v)] * hd[static_cast<std::size_t>(i * hid + k)];
        out[v * hid + k] = static_cast<float>(accumulate_dw ? out[v * hid + k] + acc : acc);
      }
  }
}

}  // namespace qmm::cpu
