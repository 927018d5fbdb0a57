#include "common/test_util.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>

namespace qmm::test {

Tolerance fp32_accum_tolerance(std::int64_t k) {
  const double s = std::sqrt(static_cast<double>(std::max<std::int64_t>(k, 1)));
  return {1e-6 * s, 1e-5, 2e-6 * s};
}

Tolerance bf16_output_tolerance(std::int64_t k) {
  const double s = std::sqrt(static_cast<double>(std::max<std::int64_t>(k, 1)));
  return {1e-3 * s, 8e-3, 5e-3};
}

Tolerance tf32_tolerance(std::int64_t k) {
  const double s = std::sqrt(static_cast<double>(std::max<std::int64_t>(k, 1)));
  return {2e-3 * s, 5e-3, 5e-3};
}

std::string data_dir() { return QMM_TEST_DATA_DIR; }

namespace {
void store(const TensorView& t, std::int64_t i, double v) {
  const float f = static_cast<float>(v);
  switch (t.dtype()) {
    case DType::F32: t.data_as<float>()[i] = f; break;
    case DType::BF16: t.data_as<std::uint16_t>()[i] = float_to_bf16(f); break;
    case DType::F16: t.data_as<std::uint16_t>()[i] = float_to_f16(f); break;
    case DType::U8: t.data_as<std::uint8_t>()[i] = static_cast<std::uint8_t>(v); break;
    case DType::I32: t.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(v); break;
  }
}
double load(const TensorView& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::F32: return t.data_as<float>()[i];
    case DType::BF16: return bf16_to_float(t.data_as<std::uint16_t>()[i]);
    case DType::F16: return f16_to_float(t.data_as<std::uint16_t>()[i]);
    case DType::U8: return t.data_as<std::uint8_t>()[i];
    case DType::I32: return t.data_as<std::int32_t>()[i];
  }
  return 0;
}
}  // namespace

Tensor random_tensor(DType dtype, Shape shape, std::uint64_t seed, float lo, float hi) {
  Tensor t(dtype, shape);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (std::int64_t i = 0; i < t.numel(); ++i) store(t, i, dist(rng));
  return t;
}

Tensor random_int_tensor(DType dtype, Shape shape, std::uint64_t seed, int range) {
  Tensor t(dtype, shape);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-range, range);
  for (std::int64_t i = 0; i < t.numel(); ++i) store(t, i, dist(rng));
  return t;
}

void set_value(const TensorView& t, std::int64_t i, double v) { store(t, i, v); }
double get_value(const TensorView& t, std::int64_t i) { return load(t, i); }

Tensor filled(DType dtype, Shape shape, float value) {
  Tensor t(dtype, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) store(t, i, value);
  return t;
}

void poison(const TensorView& t) {
  Tensor h(t.dtype(), t.shape());
  if (t.dtype() == DType::U8) std::memset(h.data(), 0xFF, h.nbytes());
  else for (std::int64_t i = 0; i < h.numel(); ++i) store(h, i, std::nan(""));
  copy(t, h);
}

Tensor host_copy(const TensorView& t) {
  Tensor h(t.dtype(), t.shape());
  copy(h, t);
  return h;
}

std::vector<double> to_doubles(const TensorView& t) {
  Tensor h = host_copy(t);
  std::vector<double> v(static_cast<std::size_t>(h.numel()));
  for (std::int64_t i = 0; i < h.numel(); ++i) v[static_cast<std::size_t>(i)] = load(h, i);
  return v;
}

::testing::AssertionResult all_close(const TensorView& got, const TensorView& ref, Tolerance tol) {
  if (got.numel() != ref.numel())
    return ::testing::AssertionFailure() << "size " << got.str() << " vs reference " << ref.str();
  const std::vector<double> g = to_doubles(got), r = to_doubles(ref);
  double diff2 = 0, ref2 = 0, worst = 0;
  std::int64_t bad = 0;
  std::ostringstream first;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double d = std::fabs(g[i] - r[i]);
    const bool ok = std::isfinite(r[i]) ? (std::isfinite(g[i]) && d <= tol.atol + tol.rtol * std::fabs(r[i]))
                                        : (std::isnan(r[i]) ? std::isnan(g[i]) : g[i] == r[i]);
    if (std::isfinite(d)) {
      diff2 += d * d;
      worst = std::max(worst, d);
    }
    if (std::isfinite(r[i])) ref2 += r[i] * r[i];
    if (!ok && bad++ < 5) first << "\n  [" << i << "] got " << g[i] << " ref " << r[i];
  }
  const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  if (bad > 0 || rel > tol.rel_fro)
    return ::testing::AssertionFailure() << bad << " of " << g.size() << " elements out of tolerance (atol "
                                         << tol.atol << ", rtol " << tol.rtol << "), relative Frobenius error "
                                         << rel << " (limit " << tol.rel_fro << "), max |diff| " << worst
                                         << first.str();
  return ::testing::AssertionSuccess() << "rel " << rel;
}

Tensor nf4_scale_after_reference(const TensorView& a, const Nf4Weight& w, const TensorView& c0, float alpha,
                                 float beta) {
  const std::int64_t m_rows = a.dim(0), k = a.dim(1), n_rows = w.rows;
  const std::vector<double> av = to_doubles(a), c0v = to_doubles(c0);
  const auto* codes = w.codes.data_as<std::uint8_t>();
  Tensor out(c0.dtype(), c0.shape());
  for (std::int64_t n = 0; n < n_rows; ++n)
    for (std::int64_t m = 0; m < m_rows; ++m) {
      double total = 0.0, block_sum = 0.0;
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t e = n * k + j;
        const double x = bf16_to_float(float_to_bf16(static_cast<float>(av[m * k + j])));
        const double v = bf16_to_float(float_to_bf16(nf4_code_value(nf4_unpack(codes, e))));
        block_sum += x * v;
        if (j + 1 == k || (e + 1) % w.block_size == 0) {  // the block ends here (or the row does, mid-block)
          total += static_cast<double>(nf4_block_scale(w, e / w.block_size)) * block_sum;
          block_sum = 0.0;
        }
      }
      const double prior = beta != 0.0f ? beta * c0v[m * n_rows + n] : 0.0;
      store(out, m * n_rows + n, alpha * total + prior);
    }
  return out;
}

Tensor scaled_output(const TensorView& sums, const TensorView& c0, float alpha, float beta) {
  const std::vector<double> s = to_doubles(sums), c = to_doubles(c0);
  Tensor out(c0.dtype(), c0.shape());
  for (std::size_t i = 0; i < s.size(); ++i) store(out, static_cast<std::int64_t>(i), alpha * s[i] + beta * c[i]);
  return out;
}

::testing::AssertionResult nf4_forward_close(const TensorView& got, const TensorView& exact,
                                             const TensorView& scale_after, Tolerance tol) {
  const ::testing::AssertionResult e = all_close(got, exact, tol);
  if (e) return e;
  const ::testing::AssertionResult s = all_close(got, scale_after, tol);
  if (s) return s;
  return ::testing::AssertionFailure() << "matches neither contract; against the dequantized weight: " << e.message()
                                       << "\n against the scale-after contract: " << s.message();
}

::testing::AssertionResult bytes_equal(const TensorView& got, const TensorView& ref) {
  if (got.nbytes() != ref.nbytes() || got.dtype() != ref.dtype())
    return ::testing::AssertionFailure() << got.str() << " vs " << ref.str();
  Tensor g = host_copy(got), r = host_copy(ref);
  const auto* a = g.data_as<std::uint8_t>();
  const auto* b = r.data_as<std::uint8_t>();
  std::size_t diff = 0, first = 0;
  for (std::size_t i = 0; i < g.nbytes(); ++i)
    if (a[i] != b[i] && diff++ == 0) first = i;
  if (diff)
    return ::testing::AssertionFailure() << diff << " of " << g.nbytes() << " bytes differ, first at byte "
                                         << first << " (" << int(a[first]) << " vs " << int(b[first]) << ")";
  return ::testing::AssertionSuccess();
}

namespace {
struct GpuState {
  std::unique_ptr<Context> ctx;
  std::string reason;
  GpuState() {
    try {
      ctx = std::make_unique<Context>(Context::cuda(0));
    } catch (const Error& e) {
      reason = std::string("no GPU: ") + e.what();
    }
  }
};
GpuState& gpu_state() {
  static GpuState s;
  return s;
}
}  // namespace

Context* gpu_context() { return gpu_state().ctx.get(); }
std::string gpu_skip_reason() { return gpu_state().reason; }

}  // namespace qmm::test
