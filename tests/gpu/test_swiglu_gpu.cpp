// SwiGLU forward and backward on the GPU against the CPU backend (fp64 math, one rounding to the dtype): ragged
// lengths through the vector body and the scalar tail, in-place aliasing, misaligned pointers, extreme gates.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

// Tolerances against the fp64 oracle, and why:
//  - bf16: the GPU computes in fp32 (a few fp32 ulps of error) and rounds once; the oracle rounds the exact value
//    (through fp32, then bf16). The two can land on neighbouring bf16 values near a rounding midpoint, never
//    further: at most 1 bf16 ulp apart.
//  - f32: expf (2 ulp), the division and the products add up to ~5 fp32 ulps (~6e-7) relative. dgate's factor
//    1 + g(1 - s) cancels near g = -1.2785 (where silu' = 0): there the error is absolute, a few ulps of the terms,
//    which are O(1) for the input ranges below, hence the atol.
constexpr double kF32Rtol = 2e-6;
constexpr double kF32Atol = 1e-6;
constexpr int kBf16MaxUlps = 1;

// bf16 bits -> a monotone integer key (sign-magnitude to two's-complement order; +0 and -0 both map to 0).
int ordered_bf16(std::uint16_t b) { return (b & 0x8000) ? -static_cast<int>(b & 0x7FFF) : static_cast<int>(b); }

::testing::AssertionResult close_to_oracle(const TensorView& got_any, const TensorView& ref) {
  const Tensor got = test::host_copy(got_any);
  if (got.numel() != ref.numel() || got.dtype() != ref.dtype())
    return ::testing::AssertionFailure() << got.view().str() << " vs " << ref.str();
  std::int64_t bad = 0;
  std::ostringstream first;
  first.precision(9);
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    bool ok;
    double g, r;
    if (got.dtype() == DType::BF16) {
      const std::uint16_t gb = got.data_as<std::uint16_t>()[i], rb = ref.data_as<std::uint16_t>()[i];
      g = bf16_to_float(gb);
      r = bf16_to_float(rb);
      ok = std::isfinite(g) && std::abs(ordered_bf16(gb) - ordered_bf16(rb)) <= kBf16MaxUlps;
    } else {
      g = got.data_as<float>()[i];
      r = ref.data_as<float>()[i];
      ok = std::isfinite(g) && std::fabs(g - r) <= kF32Atol + kF32Rtol * std::fabs(r);
    }
    if (!ok && bad++ < 5) first << "\n  [" << i << "] got " << g << " ref " << r;
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements off" << first.str();
  return ::testing::AssertionSuccess();
}

// A device tensor of n elements, optionally starting one element past a 16-byte boundary (misaligned for vectors).
struct DeviceBuf {
  Tensor storage;
  TensorView view;
};
DeviceBuf device_buf(DType dt, std::int64_t n, bool misaligned) {
  Context& gpu = *test::gpu_context();
  DeviceBuf b;
  b.storage = Tensor(dt, {n + 1}, gpu.device());
  char* p = static_cast<char*>(b.storage.data()) + (misaligned ? dtype_size(dt) : 0);
  b.view = TensorView(p, dt, {n}, gpu.device());
  return b;
}
DeviceBuf device_copy(const Tensor& host, bool misaligned = false) {
  DeviceBuf b = device_buf(host.dtype(), host.numel(), misaligned);
  copy(b.view, host);
  return b;
}

// Inputs: gate over [-6, 6] (both saturations of the sigmoid and silu's minimum), up and dh over [-1, 1].
struct Inputs {
  Tensor gate, up, dh;
};
Inputs make_inputs(DType dt, std::int64_t n, std::uint64_t seed) {
  return {test::random_tensor(dt, {n}, seed, -6.0f, 6.0f), test::random_tensor(dt, {n}, seed + 1),
          test::random_tensor(dt, {n}, seed + 2)};
}

struct Oracle {
  Tensor h, dgate, dup;
};
Oracle oracle(const Inputs& in) {
  const Context cpu = Context::cpu();
  const DType dt = in.gate.dtype();
  const std::int64_t n = in.gate.numel();
  Oracle o{Tensor(dt, {n}), Tensor(dt, {n}), Tensor(dt, {n})};
  swiglu(cpu, in.gate, in.up, o.h);
  swiglu_backward(cpu, in.gate, in.up, in.dh, o.dgate, o.dup);
  return o;
}

// Forward and backward with separate outputs; `misaligned` offsets every pointer, or (mixed) only some.
void check_out_of_place(DType dt, std::int64_t n, std::uint64_t seed, bool misaligned, bool mixed) {
  Context& gpu = *test::gpu_context();
  const Inputs in = make_inputs(dt, n, seed);
  const Oracle ref = oracle(in);
  const bool m_all = misaligned && !mixed;
  DeviceBuf g = device_copy(in.gate, misaligned), u = device_copy(in.up, m_all), d = device_copy(in.dh, m_all);
  DeviceBuf h = device_buf(dt, n, m_all), dg = device_buf(dt, n, m_all), du = device_buf(dt, n, misaligned);
  test::poison(h.view);
  test::poison(dg.view);
  test::poison(du.view);
  swiglu(gpu, g.view, u.view, h.view);
  swiglu_backward(gpu, g.view, u.view, d.view, dg.view, du.view);
  gpu.synchronize();
  const std::string what = std::string(dtype_name(dt)) + " n=" + std::to_string(n) +
                           (misaligned ? (mixed ? " mixed alignment" : " misaligned") : "");
  EXPECT_TRUE(close_to_oracle(h.view, ref.h)) << "h " << what;
  EXPECT_TRUE(close_to_oracle(dg.view, ref.dgate)) << "dgate " << what;
  EXPECT_TRUE(close_to_oracle(du.view, ref.dup)) << "dup " << what;
  // The inputs are untouched.
  EXPECT_TRUE(test::bytes_equal(test::host_copy(g.view), in.gate)) << what;
  EXPECT_TRUE(test::bytes_equal(test::host_copy(u.view), in.up)) << what;
  EXPECT_TRUE(test::bytes_equal(test::host_copy(d.view), in.dh)) << what;
}

const std::vector<std::int64_t> kLengths = {1, 7, 63, 65, 1000, 65537};

TEST(SwigluGpu, RaggedLengthsMatchCpu) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 100;
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t n : kLengths) check_out_of_place(dt, n, seed += 3, false, false);
}

TEST(SwigluGpu, MisalignedPointersMatchCpu) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 200;
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t n : kLengths) {
      check_out_of_place(dt, n, seed += 3, true, false);
      check_out_of_place(dt, n, seed += 3, true, true);
    }
}

TEST(SwigluGpu, LargeMatchesCpu) {
  QMM_REQUIRE_GPU();
  const std::int64_t n = (16LL << 20) + 3;  // many grid-stride rounds, plus a 3-element tail
  check_out_of_place(DType::F32, n, 300, false, false);
  check_out_of_place(DType::BF16, n, 303, false, false);
}

TEST(SwigluGpu, InPlaceMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  std::uint64_t seed = 400;
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t n : {std::int64_t{7}, std::int64_t{1000}, std::int64_t{65537}})
      for (bool misaligned : {false, true}) {
        const Inputs in = make_inputs(dt, n, seed += 3);
        const Oracle ref = oracle(in);
        const std::string what = std::string(dtype_name(dt)) + " n=" + std::to_string(n) +
                                 (misaligned ? " misaligned" : "");
        {  // h overwrites gate
          DeviceBuf g = device_copy(in.gate, misaligned), u = device_copy(in.up, misaligned);
          swiglu(gpu, g.view, u.view, g.view);
          gpu.synchronize();
          EXPECT_TRUE(close_to_oracle(g.view, ref.h)) << "h = gate, " << what;
          EXPECT_TRUE(test::bytes_equal(test::host_copy(u.view), in.up)) << what;
        }
        {  // h overwrites up
          DeviceBuf g = device_copy(in.gate, misaligned), u = device_copy(in.up, misaligned);
          swiglu(gpu, g.view, u.view, u.view);
          gpu.synchronize();
          EXPECT_TRUE(close_to_oracle(u.view, ref.h)) << "h = up, " << what;
        }
        {  // dgate overwrites gate and dup overwrites up
          DeviceBuf g = device_copy(in.gate, misaligned), u = device_copy(in.up, misaligned),
                    d = device_copy(in.dh, misaligned);
          swiglu_backward(gpu, g.view, u.view, d.view, g.view, u.view);
          gpu.synchronize();
          EXPECT_TRUE(close_to_oracle(g.view, ref.dgate)) << "dgate = gate, " << what;
          EXPECT_TRUE(close_to_oracle(u.view, ref.dup)) << "dup = up, " << what;
        }
        {  // only dgate in place
          DeviceBuf g = device_copy(in.gate, misaligned), u = device_copy(in.up, misaligned),
                    d = device_copy(in.dh, misaligned), du = device_buf(dt, n, misaligned);
          test::poison(du.view);
          swiglu_backward(gpu, g.view, u.view, d.view, g.view, du.view);
          gpu.synchronize();
          EXPECT_TRUE(close_to_oracle(g.view, ref.dgate)) << "dgate = gate only, " << what;
          EXPECT_TRUE(close_to_oracle(du.view, ref.dup)) << "dgate = gate only, " << what;
        }
      }
}

// Gates far into both tails, where a naive 1/(1 + e^-x) overflows (x < -88.7): results stay finite and match the
// oracle, which there is tiny (x * e^x: a normal float down to x = -92, then denormal, then 0; the atol lets only
// denormals differ) or x itself.
TEST(SwigluGpu, ExtremeGatesStayFinite) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const std::vector<float> xs = {-3.0e38f, -1.0e30f, -1.0e4f, -1000.0f, -100.0f, -89.0f, -88.0f, -50.0f, -20.0f,
                                 -1.2785f, -0.0f, 0.0f, 1e-30f, 20.0f, 50.0f, 88.0f, 89.0f, 100.0f, 1.0e4f, 1.0e30f,
                                 3.0e38f};
  for (DType dt : {DType::F32, DType::BF16}) {
    const std::int64_t n = static_cast<std::int64_t>(xs.size()) * 3;  // vector body and scalar tail both see them
    Tensor gate(dt, {n}), up = test::random_tensor(dt, {n}, 7, 0.25f, 1.0f), dh = test::random_tensor(dt, {n}, 8);
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = xs[static_cast<std::size_t>(i) % xs.size()];
      if (dt == DType::F32) gate.data_as<float>()[i] = x;
      else gate.data_as<std::uint16_t>()[i] = float_to_bf16(x);
    }
    const Inputs in{gate, up, dh};
    const Oracle ref = oracle(in);
    DeviceBuf g = device_copy(gate), u = device_copy(up), d = device_copy(dh);
    DeviceBuf h = device_buf(dt, n, false), dg = device_buf(dt, n, false), du = device_buf(dt, n, false);
    test::poison(h.view);
    test::poison(dg.view);
    test::poison(du.view);
    swiglu(gpu, g.view, u.view, h.view);
    swiglu_backward(gpu, g.view, u.view, d.view, dg.view, du.view);
    gpu.synchronize();
    const test::Tolerance tol{1e-30, dt == DType::BF16 ? 8e-3 : kF32Rtol, dt == DType::BF16 ? 8e-3 : kF32Rtol};
    EXPECT_TRUE(test::all_close(test::host_copy(h.view), ref.h, tol)) << dtype_name(dt);
    // -1.2785 sits next to the zero of silu': there dgate = dh*up*s*(1 + x*(1-s)) cancels, and fp32 leaves an
    // absolute error of a few ulps of the terms (|dh*up| * O(1) * 2^-23), not of the tiny result.
    const test::Tolerance dgate_tol{1e-7, tol.rtol, tol.rel_fro};
    EXPECT_TRUE(test::all_close(test::host_copy(dg.view), ref.dgate, dgate_tol)) << dtype_name(dt);
    EXPECT_TRUE(test::all_close(test::host_copy(du.view), ref.dup, tol)) << dtype_name(dt);
  }
}

// SwiGLU with adapters' terms on its inputs (ops.h, SwiGluAdapters) against the oracle, which sums the terms in
// fp64. The GPU sums them in fp32 (on the tensor cores for bf16 with ranks up to 32) and keeps gate' = gate + term
// in fp32, so besides the output's rounding there is an absolute error of a few fp32 ulps of the terms and gate
// (O(1) to O(6) below), which matters where gate' or the result is small: within 1 bf16 ulp or kTermAtol.
constexpr double kTermAtol = 2e-5;

::testing::AssertionResult close_with_terms(const TensorView& got_any, const TensorView& ref) {
  const Tensor got = test::host_copy(got_any);
  std::int64_t bad = 0;
  std::ostringstream first;
  first.precision(9);
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = test::get_value(got.view(), i), r = test::get_value(ref, i);
    bool ok =
        std::isfinite(g) && std::fabs(g - r) <= kTermAtol + (got.dtype() == DType::F32 ? kF32Rtol * std::fabs(r) : 0.0);
    if (!ok && got.dtype() == DType::BF16) {
      const std::uint16_t gb = got.data_as<std::uint16_t>()[i], rb = ref.data_as<std::uint16_t>()[i];
      ok = std::isfinite(g) && std::abs(ordered_bf16(gb) - ordered_bf16(rb)) <= kBf16MaxUlps;
    }
    if (!ok && bad++ < 5) first << "\n  [" << i << "] got " << g << " ref " << r;
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements off" << first.str();
  return ::testing::AssertionSuccess();
}

struct AdapterCase {
  DType dt;
  std::int64_t m, n, rg, ru, extra_t_cols;
  bool misaligned;
  std::int64_t rd = 0;  // the backward's dh term (dh_t [M, rd], dh_a [rd, N]); its h output is asked with it
  bool up_apart = false;  // up's t in its own tensor (t_up) on the GPU; the CPU reference keeps it stacked
};

std::string case_name(const AdapterCase& c) {
  return std::string(dtype_name(c.dt)) + " " + std::to_string(c.m) + "x" + std::to_string(c.n) + " r " +
         std::to_string(c.rg) + "+" + std::to_string(c.ru) + " dh r " + std::to_string(c.rd) +
         (c.misaligned ? " misaligned" : "") + (c.up_apart ? " t_up apart" : "");
}

// A device copy of a host [rows, cols] tensor, one element past a 16-byte boundary where `misaligned`.
DeviceBuf device_matrix(const Tensor& host, std::int64_t rows, std::int64_t cols, bool misaligned) {
  DeviceBuf b = device_copy(host, misaligned);
  b.view = TensorView(b.view.data(), host.dtype(), {rows, cols}, b.view.device());
  return b;
}

void check_adapters(const AdapterCase& c, std::uint64_t seed) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const std::int64_t m = c.m, n = c.n, big_r = c.rg + c.ru + c.extra_t_cols;
  const Tensor gate = test::random_tensor(c.dt, {m, n}, seed, -6.0f, 6.0f),
               up = test::random_tensor(c.dt, {m, n}, seed + 1), dh = test::random_tensor(c.dt, {m, n}, seed + 2),
               t = test::random_tensor(c.dt, {m, big_r}, seed + 3);
  const Tensor bg = test::random_tensor(c.dt, {n, std::max<std::int64_t>(c.rg, 1)}, seed + 4, -0.2f, 0.2f);
  const Tensor bu = test::random_tensor(c.dt, {n, std::max<std::int64_t>(c.ru, 1)}, seed + 5, -0.2f, 0.2f);
  const Tensor dh_t = test::random_tensor(c.dt, {m, std::max<std::int64_t>(c.rd, 1)}, seed + 6);
  const Tensor dh_a = test::random_tensor(c.dt, {std::max<std::int64_t>(c.rd, 1), n}, seed + 7, -0.2f, 0.2f);
  const SwiGluAdapters host_ad{t, c.rg > 0 ? bg.view() : TensorView(), 2.0f, c.ru > 0 ? bu.view() : TensorView(), 0.5f};
  SwiGluAdapters host_bw = host_ad;
  if (c.rd > 0) host_bw.dh_t = dh_t, host_bw.dh_a = dh_a;
  Tensor h_ref(c.dt, {m, n}), dg_ref(c.dt, {m, n}), du_ref(c.dt, {m, n}), h_bw_ref(c.dt, {m, n});
  swiglu(cpu, gate, up, h_ref, host_ad);
  swiglu_backward(cpu, gate, up, dh, dg_ref, du_ref, host_bw, h_bw_ref);
  EXPECT_TRUE(test::bytes_equal(h_bw_ref, h_ref)) << "the CPU backward's h is its forward's";

  const bool mis = c.misaligned;
  DeviceBuf g = device_matrix(gate, m, n, mis), u = device_matrix(up, m, n, false), d = device_matrix(dh, m, n, false);
  DeviceBuf td = device_matrix(t, m, big_r, false), bgd = device_matrix(bg, n, bg.shape()[1], false),
            bud = device_matrix(bu, n, bu.shape()[1], false);
  SwiGluAdapters ad{td.view, c.rg > 0 ? bgd.view : TensorView(), 2.0f, c.ru > 0 ? bud.view : TensorView(), 0.5f};
  DeviceBuf tud;
  if (c.up_apart) {  // t_up = t's columns rg.., misaligned with the rest where asked
    const Tensor cols(c.dt, {m, c.ru});
    const std::size_t es = dtype_size(c.dt);
    for (std::int64_t i = 0; i < m; ++i)
      std::memcpy(static_cast<char*>(cols.data()) + i * c.ru * es,
                  static_cast<const char*>(t.data()) + (i * big_r + c.rg) * es, c.ru * es);
    tud = device_matrix(cols, m, c.ru, mis);
    ad.t_up = tud.view;
  }
  DeviceBuf dtd = device_matrix(dh_t, m, dh_t.shape()[1], false), dad = device_matrix(dh_a, dh_a.shape()[0], n, false);
  SwiGluAdapters bw = ad;
  if (c.rd > 0) bw.dh_t = dtd.view, bw.dh_a = dad.view;
  DeviceBuf h = device_matrix(Tensor(c.dt, {m, n}), m, n, false), dg = device_matrix(Tensor(c.dt, {m, n}), m, n, false),
            du = device_matrix(Tensor(c.dt, {m, n}), m, n, mis);
  DeviceBuf h2 = device_matrix(Tensor(c.dt, {m, n}), m, n, false);
  test::poison(h.view);
  test::poison(dg.view);
  test::poison(du.view);
  test::poison(h2.view);
  swiglu(gpu, g.view, u.view, h.view, ad);
  swiglu_backward(gpu, g.view, u.view, d.view, dg.view, du.view, bw, c.rd > 0 ? h2.view : TensorView());
  gpu.synchronize();
  const std::string what = case_name(c);
  EXPECT_TRUE(close_with_terms(h.view, h_ref)) << "h " << what;
  if (c.rd > 0) EXPECT_TRUE(close_with_terms(h2.view, h_ref)) << "backward's h " << what;
  EXPECT_TRUE(close_with_terms(dg.view, dg_ref)) << "dgate " << what;
  EXPECT_TRUE(close_with_terms(du.view, du_ref)) << "dup " << what;
  EXPECT_TRUE(test::bytes_equal(test::host_copy(g.view), gate)) << what;
  EXPECT_TRUE(test::bytes_equal(test::host_copy(td.view), t)) << what;

  // In place: dgate over gate and dup over up give the same values.
  swiglu_backward(gpu, g.view, u.view, d.view, g.view, u.view, bw);
  gpu.synchronize();
  EXPECT_TRUE(close_with_terms(g.view, dg_ref)) << "dgate = gate, " << what;
  EXPECT_TRUE(close_with_terms(u.view, du_ref)) << "dup = up, " << what;
}

TEST(SwigluGpu, AdaptersMatchCpu) {
  QMM_REQUIRE_GPU();
  const std::vector<AdapterCase> cases = {{DType::BF16, 1, 8, 16, 16, 0, false},
                                          {DType::BF16, 7, 63, 16, 0, 0, false},
                                          {DType::BF16, 65, 1000, 8, 16, 3, false},
                                          {DType::BF16, 63, 65, 0, 32, 0, false},
                                          {DType::BF16, 130, 4104, 16, 16, 0, false},
                                          {DType::BF16, 33, 520, 32, 7, 0, false},
                                          {DType::BF16, 17, 136, 16, 16, 0, true},
                                          {DType::BF16, 1000, 72, 1, 31, 0, false},
                                          {DType::BF16, 5, 24, 64, 16, 0, false},
                                          {DType::F32, 63, 65, 16, 16, 2, false},
                                          {DType::F32, 300, 72, 16, 0, 0, true},
                                          // with the down projection's dh term, and h written again by the backward
                                          {DType::BF16, 130, 4104, 16, 16, 0, false, 16},
                                          {DType::BF16, 65, 1000, 8, 0, 0, false, 32},
                                          {DType::BF16, 17, 136, 16, 16, 0, true, 7},
                                          {DType::BF16, 9, 72, 16, 16, 0, false, 40},
                                          {DType::F32, 63, 65, 16, 16, 0, false, 16},
                                          // up's t apart (t_up), as SwiGluMlp's two layers keep theirs
                                          {DType::BF16, 130, 4104, 16, 16, 0, false, 16, true},
                                          {DType::BF16, 7, 63, 8, 16, 2, false, 0, true},
                                          {DType::BF16, 17, 136, 16, 16, 0, true, 7, true},
                                          {DType::F32, 33, 72, 16, 8, 0, false, 16, true}};
  std::uint64_t seed = 500;
  for (const AdapterCase& c : cases) check_adapters(c, seed += 7);
}

}  // namespace
}  // namespace qmm
