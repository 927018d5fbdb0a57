// SwiGLU forward and backward on the CPU backend, against formulas written here and against central finite
// differences of a double-precision forward.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

// Written differently from the backend on purpose (x / (1 + e^-x) rather than x * sigmoid(x)).
double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }
// d/dx [x / (1 + e^-x)] = s + x * s * (1 - s) with s the logistic function.
double silu_grad_ref(double x) {
  const double s = 1.0 / (1.0 + std::exp(-x));
  return s + x * s * (1.0 - s);
}

Tensor from_doubles(DType dtype, Shape shape, const std::vector<double>& v) {
  Tensor t(dtype, shape);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    if (dtype == DType::F32) t.data_as<float>()[i] = f;
    else t.data_as<std::uint16_t>()[i] = float_to_bf16(f);
  }
  return t;
}

// Library vs formula: both evaluate in double and round once to the dtype, so they differ by at most one output
// ulp where exp() or the operation order puts a value next to a rounding boundary (f32 2^-23, bf16 2^-7 relative).
// atol covers results that are tiny next to their inputs (gate near 0 or very negative).
test::Tolerance formula_tolerance(DType dtype) {
  return dtype == DType::BF16 ? test::Tolerance{1e-30, 7.9e-3, 4e-3} : test::Tolerance{1e-30, 1.2e-7, 1e-7};
}

constexpr std::int64_t kSizes[] = {1, 7, 1000, 65537};
constexpr DType kDTypes[] = {DType::F32, DType::BF16};

struct Inputs {
  Tensor gate, up, dh;
};
// gate spans the saturated tails of the sigmoid as well as its middle.
Inputs make_inputs(DType dtype, std::int64_t n, std::uint64_t seed) {
  return {test::random_tensor(dtype, {n}, seed, -12.0f, 12.0f), test::random_tensor(dtype, {n}, seed + 1, -2.0f, 2.0f),
          test::random_tensor(dtype, {n}, seed + 2, -1.5f, 1.5f)};
}

Tensor forward_ref(const Inputs& in) {
  const std::vector<double> g = test::to_doubles(in.gate), u = test::to_doubles(in.up);
  std::vector<double> h(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) h[i] = silu_ref(g[i]) * u[i];
  return from_doubles(in.gate.dtype(), in.gate.shape(), h);
}

std::pair<Tensor, Tensor> backward_ref(const Inputs& in) {
  const std::vector<double> g = test::to_doubles(in.gate), u = test::to_doubles(in.up), d = test::to_doubles(in.dh);
  std::vector<double> dg(g.size()), du(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    dg[i] = d[i] * u[i] * silu_grad_ref(g[i]);
    du[i] = d[i] * silu_ref(g[i]);
  }
  return {from_doubles(in.gate.dtype(), in.gate.shape(), dg), from_doubles(in.gate.dtype(), in.gate.shape(), du)};
}

std::string describe(DType dtype, std::int64_t n) { return std::string(dtype_name(dtype)) + " n=" + std::to_string(n); }

TEST(Swiglu, ForwardMatchesFormula) {
  const Context ctx = Context::cpu();
  for (DType dt : kDTypes) {
    for (std::int64_t n : kSizes) {
      const Inputs in = make_inputs(dt, n, 10 + static_cast<std::uint64_t>(n));
      Tensor h(dt, {n});
      test::poison(h);
      swiglu(ctx, in.gate, in.up, h);
      EXPECT_TRUE(test::all_close(h, forward_ref(in), formula_tolerance(dt))) << describe(dt, n);
    }
  }
}

TEST(Swiglu, MultiDimensionalShapes) {
  // Elementwise over any rank: a [7,3,65] tensor behaves as its 1365 elements.
  const Context ctx = Context::cpu();
  Inputs in = make_inputs(DType::F32, 7 * 3 * 65, 77);
  const Shape s{7, 3, 65};
  const TensorView g(in.gate.data(), DType::F32, s), u(in.up.data(), DType::F32, s);
  Tensor h(DType::F32, s);
  test::poison(h);
  swiglu(ctx, g, u, h);
  EXPECT_TRUE(test::all_close(h, forward_ref(in), formula_tolerance(DType::F32)));
}

TEST(Swiglu, ForwardInPlace) {
  // h may be gate or up itself: the result must be the same bytes as out of place.
  const Context ctx = Context::cpu();
  for (DType dt : kDTypes) {
    for (std::int64_t n : kSizes) {
      const Inputs in = make_inputs(dt, n, 20 + static_cast<std::uint64_t>(n));
      Tensor ref(dt, {n});
      swiglu(ctx, in.gate, in.up, ref);
      Tensor g = test::host_copy(in.gate), u = test::host_copy(in.up);
      swiglu(ctx, g, u, g);
      EXPECT_TRUE(test::bytes_equal(g, ref)) << "h = gate, " << describe(dt, n);
      g = test::host_copy(in.gate);
      swiglu(ctx, g, u, u);
      EXPECT_TRUE(test::bytes_equal(u, ref)) << "h = up, " << describe(dt, n);
    }
  }
}

TEST(Swiglu, BackwardMatchesFormula) {
  const Context ctx = Context::cpu();
  for (DType dt : kDTypes) {
    for (std::int64_t n : kSizes) {
      const Inputs in = make_inputs(dt, n, 30 + static_cast<std::uint64_t>(n));
      Tensor dg(dt, {n}), du(dt, {n});
      test::poison(dg);
      test::poison(du);
      swiglu_backward(ctx, in.gate, in.up, in.dh, dg, du);
      const auto [want_dg, want_du] = backward_ref(in);
      EXPECT_TRUE(test::all_close(dg, want_dg, formula_tolerance(dt))) << "dgate " << describe(dt, n);
      EXPECT_TRUE(test::all_close(du, want_du, formula_tolerance(dt))) << "dup " << describe(dt, n);
    }
  }
}

TEST(Swiglu, BackwardInPlace) {
  // dgate may be gate and dup may be up (each alone, or both): same bytes as out of place.
  const Context ctx = Context::cpu();
  for (DType dt : kDTypes) {
    for (std::int64_t n : kSizes) {
      const Inputs in = make_inputs(dt, n, 40 + static_cast<std::uint64_t>(n));
      Tensor ref_dg(dt, {n}), ref_du(dt, {n});
      swiglu_backward(ctx, in.gate, in.up, in.dh, ref_dg, ref_du);
      {
        Tensor g = test::host_copy(in.gate), u = test::host_copy(in.up);
        swiglu_backward(ctx, g, u, in.dh, g, u);
        EXPECT_TRUE(test::bytes_equal(g, ref_dg)) << "dgate = gate, " << describe(dt, n);
        EXPECT_TRUE(test::bytes_equal(u, ref_du)) << "dup = up, " << describe(dt, n);
      }
      {
        Tensor g = test::host_copy(in.gate), du(dt, {n});
        swiglu_backward(ctx, g, in.up, in.dh, g, du);
        EXPECT_TRUE(test::bytes_equal(g, ref_dg)) << "dgate = gate only, " << describe(dt, n);
        EXPECT_TRUE(test::bytes_equal(du, ref_du)) << "dgate = gate only, " << describe(dt, n);
      }
    }
  }
}

TEST(Swiglu, BackwardMatchesFiniteDifferences) {
  // Central differences of a double-precision forward, f(g, u) = silu(g) * u, at the stored inputs:
  // truncation error ~ eps^2 * |f'''| ~ 1e-12 and cancellation ~ 1e-16 / eps ~ 1e-10, both far below the f32
  // rounding of the backend's output (2^-24 relative), so the tolerance is that rounding plus a margin.
  const Context ctx = Context::cpu();
  const double eps = 1e-6;
  for (std::int64_t n : {1, 7, 65}) {
    const Inputs in = make_inputs(DType::F32, n, 50 + static_cast<std::uint64_t>(n));
    Tensor dg(DType::F32, {n}), du(DType::F32, {n});
    test::poison(dg);
    test::poison(du);
    swiglu_backward(ctx, in.gate, in.up, in.dh, dg, du);
    const std::vector<double> g = test::to_doubles(in.gate), u = test::to_doubles(in.up), d = test::to_doubles(in.dh);
    auto f = [](double x, double y) { return x / (1.0 + std::exp(-x)) * y; };
    std::vector<double> fd_g(g.size()), fd_u(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      fd_g[i] = d[i] * (f(g[i] + eps, u[i]) - f(g[i] - eps, u[i])) / (2 * eps);
      fd_u[i] = d[i] * (f(g[i], u[i] + eps) - f(g[i], u[i] - eps)) / (2 * eps);
    }
    const test::Tolerance tol{1e-9, 2e-7, 2e-7};
    EXPECT_TRUE(test::all_close(dg, from_doubles(DType::F32, {n}, fd_g), tol)) << "dgate n=" << n;
    EXPECT_TRUE(test::all_close(du, from_doubles(DType::F32, {n}, fd_u), tol)) << "dup n=" << n;
  }
}

TEST(Swiglu, EmptyTensorsAreANoOp) {
  const Context ctx = Context::cpu();
  Tensor g(DType::F32, {0}), u(DType::F32, {0}), d(DType::F32, {0}), dg(DType::F32, {0}), du(DType::F32, {0});
  EXPECT_NO_THROW(swiglu(ctx, g, u, d));
  EXPECT_NO_THROW(swiglu_backward(ctx, g, u, d, dg, du));
}

// ---- validation -----------------------------------------------------------------------------------------------------
template <class Fn>
void expect_rejected(const std::string& what, std::initializer_list<TensorView> outs, Fn&& fn, ErrorCode code,
                     std::initializer_list<std::string> needles) {
  std::vector<Tensor> before;
  for (const TensorView& o : outs) before.push_back(test::host_copy(o));
  EXPECT_TRUE(test::throws_error(fn, code, needles)) << what;
  std::size_t i = 0;
  for (const TensorView& o : outs) EXPECT_TRUE(test::bytes_equal(o, before[i++])) << what << ": output changed";
}

TEST(Swiglu, ForwardValidation) {
  const Context ctx = Context::cpu();
  const std::int64_t n = 64;
  const Tensor g = test::random_tensor(DType::F32, {n}, 1), u = test::random_tensor(DType::F32, {n}, 2);
  const Tensor h = test::random_tensor(DType::F32, {n}, 3);
  const Tensor short_h = test::random_tensor(DType::F32, {n - 1}, 4), h2d = test::random_tensor(DType::F32, {8, 8}, 5);
  const Tensor h_bf16 = test::random_tensor(DType::BF16, {n}, 6), u_bf16 = test::random_tensor(DType::BF16, {n}, 7);
  const Tensor g_f16(DType::F16, {n}), u_f16(DType::F16, {n}), h_f16(DType::F16, {n});
  const ErrorCode shape = ErrorCode::ShapeMismatch, dtype = ErrorCode::DTypeMismatch,
                  device = ErrorCode::DeviceMismatch, invalid = ErrorCode::InvalidArgument;

  expect_rejected("short h", {short_h}, [&] { swiglu(ctx, g, u, short_h); }, shape, {"swiglu", "h", "[63]"});
  expect_rejected("2-d h", {h2d}, [&] { swiglu(ctx, g, u, h2d); }, shape, {"swiglu", "h", "[8,8]"});
  expect_rejected("up shape", {h}, [&] { swiglu(ctx, g, short_h, h); }, shape, {"swiglu", "up"});
  expect_rejected("f16", {h_f16}, [&] { swiglu(ctx, g_f16, u_f16, h_f16); }, dtype, {"swiglu", "gate", "f16"});
  expect_rejected("mixed up", {h}, [&] { swiglu(ctx, g, u_bf16, h); }, dtype, {"swiglu", "up", "bf16"});
  expect_rejected("mixed h", {h_bf16}, [&] { swiglu(ctx, g, u, h_bf16); }, dtype, {"swiglu", "h", "bf16"});
  const TensorView g_gpu(g.data(), DType::F32, {n}, Device::cuda(0)), h_gpu(h.data(), DType::F32, {n}, Device::cuda(0));
  expect_rejected("gate device", {h}, [&] { swiglu(ctx, g_gpu, u, h); }, device, {"swiglu", "gate", "cuda:0"});
  expect_rejected("h device", {h}, [&] { swiglu(ctx, g, u, h_gpu); }, device, {"swiglu", "h", "cuda:0"});
  const TensorView null_up(nullptr, DType::F32, {n}), null_h(nullptr, DType::F32, {n});
  expect_rejected("null up", {h}, [&] { swiglu(ctx, g, null_up, h); }, invalid, {"swiglu", "up", "null"});
  EXPECT_TRUE(test::throws_error([&] { swiglu(ctx, g, u, null_h); }, invalid, {"swiglu", "h", "null"}));

  // Partial overlaps: h starting one element into gate (or up), over a buffer holding both.
  Tensor buf = test::random_tensor(DType::F32, {2 * n}, 8);
  const TensorView lo(buf.data(), DType::F32, {n}), shifted(buf.data_as<float>() + 1, DType::F32, {n});
  expect_rejected("h partly over gate", {buf}, [&] { swiglu(ctx, lo, u, shifted); }, invalid,
                  {"swiglu", "h", "gate", "overlap"});
  expect_rejected("h partly over up", {buf}, [&] { swiglu(ctx, g, lo, shifted); }, invalid,
                  {"swiglu", "h", "up", "overlap"});
}

TEST(Swiglu, BackwardValidation) {
  const Context ctx = Context::cpu();
  const std::int64_t n = 33;
  const Tensor g = test::random_tensor(DType::F32, {n}, 1), u = test::random_tensor(DType::F32, {n}, 2);
  const Tensor d = test::random_tensor(DType::F32, {n}, 3);
  const Tensor dg = test::random_tensor(DType::F32, {n}, 4), du = test::random_tensor(DType::F32, {n}, 5);
  const Tensor wrong = test::random_tensor(DType::F32, {n + 1}, 6), d_bf16 = test::random_tensor(DType::BF16, {n}, 7);
  const ErrorCode shape = ErrorCode::ShapeMismatch, dtype = ErrorCode::DTypeMismatch,
                  device = ErrorCode::DeviceMismatch, invalid = ErrorCode::InvalidArgument;
  const char* op = "swiglu_backward";

  expect_rejected("dh shape", {dg, du}, [&] { swiglu_backward(ctx, g, u, wrong, dg, du); }, shape, {op, "dh"});
  expect_rejected("dup shape", {dg, wrong}, [&] { swiglu_backward(ctx, g, u, d, dg, wrong); }, shape, {op, "dup"});
  expect_rejected("dh dtype", {dg, du}, [&] { swiglu_backward(ctx, g, u, d_bf16, dg, du); }, dtype, {op, "dh", "bf16"});
  const TensorView dg_gpu(dg.data(), DType::F32, {n}, Device::cuda(0));
  expect_rejected("dgate device", {dg, du}, [&] { swiglu_backward(ctx, g, u, d, dg_gpu, du); }, device,
                  {op, "dgate", "cuda:0"});
  const TensorView null_dh(nullptr, DType::F32, {n});
  expect_rejected("null dh", {dg, du}, [&] { swiglu_backward(ctx, g, u, null_dh, dg, du); }, invalid,
                  {op, "dh", "null"});

  // Aliases that are not allowed: each output over an input other than its own, or over the other output.
  Tensor gc = test::host_copy(g), uc = test::host_copy(u), dc = test::host_copy(d);
  expect_rejected("dgate = up", {uc, du}, [&] { swiglu_backward(ctx, g, uc, d, uc, du); }, invalid,
                  {op, "dgate", "up", "overlap"});
  expect_rejected("dgate = dh", {dc, du}, [&] { swiglu_backward(ctx, g, u, dc, dc, du); }, invalid,
                  {op, "dgate", "dh", "overlap"});
  expect_rejected("dup = gate", {dg, gc}, [&] { swiglu_backward(ctx, gc, u, d, dg, gc); }, invalid,
                  {op, "dup", "gate", "overlap"});
  expect_rejected("dup = dh", {dg, dc}, [&] { swiglu_backward(ctx, g, u, dc, dg, dc); }, invalid,
                  {op, "dup", "dh", "overlap"});
  expect_rejected("dgate = dup", {dg}, [&] { swiglu_backward(ctx, g, u, d, dg, dg); }, invalid,
                  {op, "dgate", "dup", "overlap"});
  // A partial overlap of dgate with gate is rejected even though an exact alias is fine.
  Tensor buf = test::random_tensor(DType::F32, {2 * n}, 8);
  const TensorView lo(buf.data(), DType::F32, {n}), shifted(buf.data_as<float>() + 1, DType::F32, {n});
  expect_rejected("dgate partly over gate", {buf, du}, [&] { swiglu_backward(ctx, lo, u, d, shifted, du); }, invalid,
                  {op, "dgate", "gate", "overlap"});
  expect_rejected("dup partly over up", {buf, dg}, [&] { swiglu_backward(ctx, g, lo, d, dg, shifted); }, invalid,
                  {op, "dup", "up", "overlap"});
}

// ---- adapters' terms (SwiGluAdapters) -------------------------------------------------------------------------------
// gate' = gate + sg·t[:, :rg]·bgᵀ and up' = up + su·t[:, rg:rg+ru]·buᵀ summed here in double, then the formulas
// above; the library sums in double too and rounds once, so formula_tolerance holds.
struct AdapterInputs {
  Tensor gate, up, dh, t, bg, bu;
  std::int64_t rg, ru;
};

AdapterInputs make_adapter_inputs(DType dt, std::int64_t m, std::int64_t n, std::int64_t rg, std::int64_t ru,
                                  std::int64_t big_r, std::uint64_t seed) {
  return {test::random_tensor(dt, {m, n}, seed, -6.0f, 6.0f),
          test::random_tensor(dt, {m, n}, seed + 1),
          test::random_tensor(dt, {m, n}, seed + 2),
          test::random_tensor(dt, {m, big_r}, seed + 3),
          test::random_tensor(dt, {n, std::max<std::int64_t>(rg, 1)}, seed + 4, -0.3f, 0.3f),
          test::random_tensor(dt, {n, std::max<std::int64_t>(ru, 1)}, seed + 5, -0.3f, 0.3f),
          rg,
          ru};
}

Inputs with_terms(const AdapterInputs& a, double sg, double su) {
  const std::int64_t m = a.gate.shape()[0], n = a.gate.shape()[1], big_r = a.t.shape()[1];
  const std::vector<double> g = test::to_doubles(a.gate), u = test::to_doubles(a.up), t = test::to_doubles(a.t),
                            bg = test::to_doubles(a.bg), bu = test::to_doubles(a.bu);
  std::vector<double> g2(g), u2(u);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double tg = 0.0, tu = 0.0;
      for (std::int64_t k = 0; k < a.rg; ++k) tg += t[i * big_r + k] * bg[j * a.rg + k];
      for (std::int64_t k = 0; k < a.ru; ++k) tu += t[i * big_r + a.rg + k] * bu[j * a.ru + k];
      g2[i * n + j] += sg * tg;
      u2[i * n + j] += su * tu;
    }
  // Kept in double through a f64-free route: F32 tensors hold the sums (the formulas read them back as doubles).
  return {from_doubles(DType::F32, {m * n}, g2), from_doubles(DType::F32, {m * n}, u2), test::host_copy(a.dh)};
}

TEST(Swiglu, AdaptersMatchFormulas) {
  const Context ctx = Context::cpu();
  struct Case {
    std::int64_t m, n, rg, ru, extra;
  };
  std::uint64_t seed = 900;
  for (DType dt : kDTypes)
    for (const Case c : {Case{1, 1, 1, 0, 0}, Case{7, 63, 16, 16, 0}, Case{65, 9, 0, 8, 3}, Case{3, 130, 40, 24, 1}}) {
      const AdapterInputs a = make_adapter_inputs(dt, c.m, c.n, c.rg, c.ru, c.rg + c.ru + c.extra, seed += 7);
      const SwiGluAdapters ad{a.t, c.rg > 0 ? a.bg.view() : TensorView(), 1.5f, c.ru > 0 ? a.bu.view() : TensorView(),
                              -0.75f};
      Inputs summed = with_terms(a, 1.5, -0.75);
      // The backward's dh term: dh + dh_t·dh_a (rank 5), summed here in double.
      const Tensor dh_t = test::random_tensor(dt, {c.m, 5}, seed + 100),
                   dh_a = test::random_tensor(dt, {5, c.n}, seed + 101);
      SwiGluAdapters bw = ad;
      bw.dh_t = dh_t;
      bw.dh_a = dh_a;
      std::vector<double> dh2 = test::to_doubles(a.dh);
      const std::vector<double> tv = test::to_doubles(dh_t), av = test::to_doubles(dh_a);
      for (std::int64_t i = 0; i < c.m; ++i)
        for (std::int64_t j = 0; j < c.n; ++j)
          for (std::int64_t k = 0; k < 5; ++k) dh2[i * c.n + j] += tv[i * 5 + k] * av[k * c.n + j];
      summed.dh = from_doubles(DType::F32, {c.m * c.n}, dh2);
      const Tensor h_want = forward_ref(summed);
      const auto [dg_want, du_want] = backward_ref(summed);
      Tensor h(dt, {c.m, c.n}), dg(dt, {c.m, c.n}), du(dt, {c.m, c.n}), h_again(dt, {c.m, c.n});
      test::poison(h);
      test::poison(dg);
      test::poison(du);
      test::poison(h_again);
      swiglu(ctx, a.gate, a.up, h, ad);
      swiglu_backward(ctx, a.gate, a.up, a.dh, dg, du, bw, h_again);
      EXPECT_TRUE(test::bytes_equal(h_again, h)) << "the backward's h";
      // The formulas ran in f32 storage: compare in f32 after rounding ours the same way (bf16 outputs compare at
      // bf16's tolerance).
      const std::string what = describe(dt, c.m * c.n) + " r " + std::to_string(c.rg) + "+" + std::to_string(c.ru);
      const test::Tolerance tol = formula_tolerance(dt == DType::BF16 ? DType::BF16 : DType::F32);
      const auto flat = [&](const Tensor& x) { return from_doubles(DType::F32, {c.m * c.n}, test::to_doubles(x)); };
      EXPECT_TRUE(test::all_close(flat(h), h_want, {1e-6, tol.rtol, tol.rel_fro})) << "h " << what;
      EXPECT_TRUE(test::all_close(flat(dg), dg_want, {1e-6, tol.rtol, tol.rel_fro})) << "dgate " << what;
      EXPECT_TRUE(test::all_close(flat(du), du_want, {1e-6, tol.rtol, tol.rel_fro})) << "dup " << what;
    }
}

// Up's t apart (t_up, as two layers that keep their own t have it) gives the stacked form's bits.
TEST(Swiglu, AdaptersUpTermApartEqualsStacked) {
  const Context ctx = Context::cpu();
  std::uint64_t seed = 1500;
  for (DType dt : kDTypes)
    for (const auto [m, n, rg, ru] : {std::array<std::int64_t, 4>{1, 8, 4, 4}, {7, 63, 16, 8}, {65, 9, 0, 3}}) {
      const AdapterInputs a = make_adapter_inputs(dt, m, n, rg, ru, rg + ru, seed += 11);
      const std::vector<double> t = test::to_doubles(a.t);
      std::vector<double> tg(static_cast<std::size_t>(m * std::max<std::int64_t>(rg, 1))),
          tu(static_cast<std::size_t>(m * ru));
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t k = 0; k < rg; ++k) tg[i * rg + k] = t[i * (rg + ru) + k];
        for (std::int64_t k = 0; k < ru; ++k) tu[i * ru + k] = t[i * (rg + ru) + rg + k];
      }
      const Tensor t_gate = from_doubles(dt, {m, std::max<std::int64_t>(rg, 1)}, tg),
                   t_up = from_doubles(dt, {m, ru}, tu);
      const Tensor dh_t = test::random_tensor(dt, {m, 2}, seed + 1), dh_a = test::random_tensor(dt, {2, n}, seed + 2);
      const TensorView bg = rg > 0 ? a.bg.view() : TensorView();
      const SwiGluAdapters stacked{a.t, bg, 0.5f, a.bu, 2.0f, dh_t, dh_a};
      SwiGluAdapters apart{rg > 0 ? t_gate.view() : TensorView(), bg, 0.5f, a.bu, 2.0f, dh_t, dh_a};
      apart.t_up = t_up;
      const std::string what = describe(dt, m * n) + " r " + std::to_string(rg) + "+" + std::to_string(ru);
      Tensor h1(dt, {m, n}), h2(dt, {m, n});
      test::poison(h2);
      SwiGluAdapters fwd_stacked = stacked, fwd_apart = apart;
      fwd_stacked.dh_t = fwd_stacked.dh_a = fwd_apart.dh_t = fwd_apart.dh_a = TensorView();
      swiglu(ctx, a.gate, a.up, h1, fwd_stacked);
      swiglu(ctx, a.gate, a.up, h2, fwd_apart);
      EXPECT_TRUE(test::bytes_equal(h2, h1)) << "h " << what;
      Tensor dg1(dt, {m, n}), du1(dt, {m, n}), hb1(dt, {m, n}), dg2(dt, {m, n}), du2(dt, {m, n}), hb2(dt, {m, n});
      for (Tensor* o : {&dg2, &du2, &hb2}) test::poison(*o);
      swiglu_backward(ctx, a.gate, a.up, a.dh, dg1, du1, stacked, hb1);
      swiglu_backward(ctx, a.gate, a.up, a.dh, dg2, du2, apart, hb2);
      EXPECT_TRUE(test::bytes_equal(dg2, dg1)) << "dgate " << what;
      EXPECT_TRUE(test::bytes_equal(du2, du1)) << "dup " << what;
      EXPECT_TRUE(test::bytes_equal(hb2, hb1)) << "h again " << what;
    }
}

TEST(Swiglu, AdaptersValidation) {
  const Context ctx = Context::cpu();
  const std::int64_t m = 5, n = 12;
  const AdapterInputs a = make_adapter_inputs(DType::F32, m, n, 4, 4, 8, 1);
  Tensor h = test::random_tensor(DType::F32, {m, n}, 2), dg = test::random_tensor(DType::F32, {m, n}, 3),
         du = test::random_tensor(DType::F32, {m, n}, 4);
  const Tensor t_short = test::random_tensor(DType::F32, {m, 7}, 5),
               t_rows = test::random_tensor(DType::F32, {m + 1, 8}, 6);
  const Tensor t_bf16 = test::random_tensor(DType::BF16, {m, 8}, 7),
               b_rows = test::random_tensor(DType::F32, {n + 1, 4}, 8);
  const Tensor flat_gate = test::random_tensor(DType::F32, {m * n}, 9),
               flat_h = test::random_tensor(DType::F32, {m * n}, 10);
  const ErrorCode shape = ErrorCode::ShapeMismatch, dtype = ErrorCode::DTypeMismatch,
                  invalid = ErrorCode::InvalidArgument;
  const auto ad = [&](TensorView t, TensorView bg, TensorView bu, float sg = 1.0f) {
    return SwiGluAdapters{t, bg, sg, bu, 1.0f};
  };
  const SwiGluAdapters good = ad(a.t, a.bg, a.bu);
  expect_rejected("t narrower than the ranks", {h}, [&] { swiglu(ctx, a.gate, a.up, h, ad(t_short, a.bg, a.bu)); },
                  shape, {"swiglu", "adapters.t", "[5,7]", "8"});
  expect_rejected("t rows", {h}, [&] { swiglu(ctx, a.gate, a.up, h, ad(t_rows, a.bg, a.bu)); }, shape,
                  {"swiglu", "adapters.t", "[6,8]"});
  expect_rejected("t dtype", {h}, [&] { swiglu(ctx, a.gate, a.up, h, ad(t_bf16, a.bg, a.bu)); }, dtype,
                  {"swiglu", "adapters.t", "bf16"});
  expect_rejected("b_up rows", {dg, du},
                  [&] { swiglu_backward(ctx, a.gate, a.up, a.dh, dg, du, ad(a.t, a.bg, b_rows)); }, shape,
                  {"swiglu_backward", "adapters.b_up", "[13,4]"});
  expect_rejected("1-d gate", {flat_h}, [&] { swiglu(ctx, flat_gate, flat_gate, flat_h, good); }, shape,
                  {"swiglu", "gate", "rank"});
  expect_rejected("scale", {h}, [&] { swiglu(ctx, a.gate, a.up, h, ad(a.t, a.bg, a.bu, std::nanf(""))); }, invalid,
                  {"swiglu", "scales", "finite"});
  // An output over an adapter operand: h written over t.
  Tensor tb = test::random_tensor(DType::F32, {m, n}, 11);
  const TensorView t_in_h(tb.data(), DType::F32, {m, 8});
  expect_rejected("h over t", {tb}, [&] { swiglu(ctx, a.gate, a.up, tb, ad(t_in_h, a.bg, a.bu)); }, invalid,
                  {"swiglu", "h", "adapters.t"});
  // The dh term: the backward's only, [M, r] and [r, N].
  const Tensor dh_t = test::random_tensor(DType::F32, {m, 3}, 12), dh_a = test::random_tensor(DType::F32, {3, n}, 13);
  const Tensor dh_a_cols = test::random_tensor(DType::F32, {3, n + 1}, 14);
  SwiGluAdapters with_dh = good;
  with_dh.dh_t = dh_t;
  with_dh.dh_a = dh_a;
  expect_rejected("dh term in the forward", {h}, [&] { swiglu(ctx, a.gate, a.up, h, with_dh); }, invalid,
                  {"swiglu", "adapters.dh_t", "backward"});
  SwiGluAdapters bad_dh = with_dh;
  bad_dh.dh_a = dh_a_cols;
  expect_rejected("dh_a columns", {dg, du}, [&] { swiglu_backward(ctx, a.gate, a.up, a.dh, dg, du, bad_dh); }, shape,
                  {"swiglu_backward", "adapters.dh_a", "[3,13]"});
  SwiGluAdapters half_dh = good;
  half_dh.dh_t = dh_t;
  expect_rejected("dh_t without dh_a", {dg, du}, [&] { swiglu_backward(ctx, a.gate, a.up, a.dh, dg, du, half_dh); },
                  invalid, {"swiglu_backward", "adapters.dh_a", "null"});
  // h written again by the backward: not over an input or another output.
  expect_rejected("h over dgate", {dg, du}, [&] { swiglu_backward(ctx, a.gate, a.up, a.dh, dg, du, with_dh, dg); },
                  invalid, {"swiglu_backward", "h", "dgate"});
  EXPECT_NO_THROW(swiglu_backward(ctx, a.gate, a.up, a.dh, dg, du, with_dh, h));
  EXPECT_NO_THROW(swiglu(ctx, a.gate, a.up, h, good));
  // Up's t apart: [M, >= r_u], only with up's term; t then needs gate's columns alone.
  const Tensor t_up = test::random_tensor(DType::F32, {m, 4}, 15),
               t_up_narrow = test::random_tensor(DType::F32, {m, 3}, 16),
               t_up_rows = test::random_tensor(DType::F32, {m + 2, 4}, 17),
               t_gate = test::random_tensor(DType::F32, {m, 4}, 18);
  SwiGluAdapters apart = ad(t_gate, a.bg, a.bu);
  apart.t_up = t_up;
  EXPECT_NO_THROW(swiglu(ctx, a.gate, a.up, h, apart));
  SwiGluAdapters apart_narrow = apart;
  apart_narrow.t_up = t_up_narrow;
  expect_rejected("t_up narrower than up's rank", {h}, [&] { swiglu(ctx, a.gate, a.up, h, apart_narrow); }, shape,
                  {"swiglu", "adapters.t_up", "[5,3]", "up's rank 4"});
  SwiGluAdapters apart_rows = apart;
  apart_rows.t_up = t_up_rows;
  expect_rejected("t_up rows", {dg, du}, [&] { swiglu_backward(ctx, a.gate, a.up, a.dh, dg, du, apart_rows); }, shape,
                  {"swiglu_backward", "adapters.t_up", "[7,4]"});
  SwiGluAdapters apart_no_up = ad(t_gate, a.bg, TensorView());
  apart_no_up.t_up = t_up;
  expect_rejected("t_up without b_up", {h}, [&] { swiglu(ctx, a.gate, a.up, h, apart_no_up); }, invalid,
                  {"swiglu", "adapters.t_up", "adapters.b_up"});
  SwiGluAdapters apart_short_t = apart;
  apart_short_t.t = t_short.view();  // [5, 7]: wide enough for gate's 4 once up's t is apart
  EXPECT_NO_THROW(swiglu(ctx, a.gate, a.up, h, apart_short_t));
  SwiGluAdapters apart_gate_narrow = apart;
  apart_gate_narrow.t = t_up_narrow;
  expect_rejected("t narrower than gate's rank", {h}, [&] { swiglu(ctx, a.gate, a.up, h, apart_gate_narrow); }, shape,
                  {"swiglu", "adapters.t", "gate's rank 4"});
  Tensor tub = test::random_tensor(DType::F32, {m, n}, 19);
  SwiGluAdapters apart_in_h = apart;
  apart_in_h.t_up = TensorView(tub.data(), DType::F32, {m, 4});
  expect_rejected("h over t_up", {tub}, [&] { swiglu(ctx, a.gate, a.up, tub, apart_in_h); }, invalid,
                  {"swiglu", "h", "adapters.t_up"});
}

}  // namespace
}  // namespace qmm
