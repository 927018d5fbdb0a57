// The dense GEMM family on the CPU backend, against naive triple loops written here (independent of src/cpu/),
// with the operand roundings of each math mode restated here by bit manipulation.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <omp.h>

#include "common/test_util.h"
#include "core/gemm_problem.h"

namespace qmm {
namespace {

using test::bits_of;
using test::float_of;

// ---- the contracts, restated ------------------------------------------------------------------------------------
float tf32_nearest_even(float x) {  // 10 explicit mantissa bits kept, ties to even
  if (!std::isfinite(x)) return x;
  const std::uint32_t u = bits_of(x);
  const std::uint32_t lsb = (u >> 13) & 1u;
  return float_of((u + 0x0FFFu + lsb) & ~0x1FFFu);
}
float bf16_truncated(float x) { return float_of(bits_of(x) & 0xFFFF0000u); }
std::uint16_t bf16_nearest_even_bits(float x) {  // the output rounding of a bf16 C
  const std::uint32_t u = bits_of(x);
  if (std::isnan(x)) return 0x7FC0;
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// What the multiplier sees of one stored element.
double operand(double stored, MathMode math, DType storage) {
  if (storage == DType::BF16) return stored;  // bf16 values are exact; the mode does not touch them
  const float f = static_cast<float>(stored);
  switch (math) {
    case MathMode::FP32: return f;
    case MathMode::TF32: return tf32_nearest_even(f);
    case MathMode::BF16: return bf16_truncated(f);
  }
  return f;
}

// ---- the variants, described once ---------------------------------------------------------------------------------
enum class Op { Gemm, GemmBt, BackwardA, BackwardB, Batched, BatchedBt };
constexpr Op kAllOps[] = {Op::Gemm, Op::GemmBt, Op::BackwardA, Op::BackwardB, Op::Batched, Op::BatchedBt};

// The product out[m,n] = sum over k of x * y; batch and heads only for the batched ops.
struct Dims {
  std::int64_t m, n, k;
  std::int64_t batch = 2, heads = 3;
};

struct Names {
  const char* op;
  const char* x;
  const char* y;
  const char* out;
};

Names names(Op op) {
  switch (op) {
    case Op::Gemm: return {"gemm", "A", "B", "C"};
    case Op::GemmBt: return {"gemm_bt", "A", "B", "C"};
    case Op::BackwardA: return {"gemm_backward_a", "dC", "B", "dA"};
    case Op::BackwardB: return {"gemm_backward_b", "A", "dC", "dB"};
    case Op::Batched: return {"batched_gemm", "A", "B", "C"};
    case Op::BatchedBt: return {"batched_gemm", "A", "B", "C"};
  }
  return {};
}

std::string label(Op op) { return op == Op::BatchedBt ? "batched_gemm(transpose_b)" : names(op).op; }
bool is_batched(Op op) { return op == Op::Batched || op == Op::BatchedBt; }

struct Layout {
  Shape x, y, out;
};

// Stored shapes, straight from the API comments in ops.h.
Layout layout(Op op, const Dims& d) {
  const std::int64_t m = d.m, n = d.n, k = d.k, b = d.batch, h = d.heads;
  switch (op) {
    case Op::Gemm: return {{m, k}, {k, n}, {m, n}};          // C[M,N] = A[M,K] B[K,N]
    case Op::GemmBt: return {{m, k}, {n, k}, {m, n}};        // B given [N,K]
    case Op::BackwardA: return {{m, k}, {n, k}, {m, n}};     // dA[M,K] = dC[M,N] B[K,N]^T: m=M, n=K, k=N
    case Op::BackwardB: return {{k, m}, {k, n}, {m, n}};     // dB[K,N] = A[M,K]^T dC[M,N]: m=K, n=N, k=M
    case Op::Batched: return {{b, h, m, k}, {b, h, k, n}, {b, h, m, n}};
    case Op::BatchedBt: return {{b, h, m, k}, {b, h, n, k}, {b, h, m, n}};
  }
  return {};
}

// Where x(i,p) and y(p,j) of batch entry e live in the stored tensors.
std::int64_t x_index(Op op, const Dims& d, std::int64_t e, std::int64_t i, std::int64_t p) {
  if (op == Op::BackwardB) return p * d.m + i;
  return e * d.m * d.k + i * d.k + p;
}
std::int64_t y_index(Op op, const Dims& d, std::int64_t e, std::int64_t p, std::int64_t j) {
  switch (op) {
    case Op::Gemm:
    case Op::BackwardB:
    case Op::Batched: return e * d.k * d.n + p * d.n + j;
    case Op::GemmBt:
    case Op::BackwardA:
    case Op::BatchedBt: return e * d.n * d.k + j * d.k + p;
  }
  return 0;
}

void call(Op op, const Context& ctx, const TensorView& x, const TensorView& y, const TensorView& out,
          const GemmOptions& o) {
  switch (op) {
    case Op::Gemm: return gemm(ctx, x, y, out, o);
    case Op::GemmBt: return gemm_bt(ctx, x, y, out, o);
    case Op::BackwardA: return gemm_backward_a(ctx, x, y, out, o);
    case Op::BackwardB: return gemm_backward_b(ctx, x, y, out, o);
    case Op::Batched: return batched_gemm(ctx, x, y, out, false, o);
    case Op::BatchedBt: return batched_gemm(ctx, x, y, out, true, o);
  }
}

// The naive oracle: fp64 triple loop over the contract-rounded operands; C = alpha*sum + beta*C_old, rounded once.
Tensor naive(Op op, const Dims& d, const Tensor& x, const Tensor& y, const Tensor& c_old, const GemmOptions& o) {
  std::vector<double> xv = test::to_doubles(x), yv = test::to_doubles(y);
  for (double& v : xv) v = operand(v, o.math, x.dtype());
  for (double& v : yv) v = operand(v, o.math, y.dtype());
  const std::vector<double> cv = test::to_doubles(c_old);
  Tensor out(c_old.dtype(), c_old.shape());
  const std::int64_t entries = is_batched(op) ? d.batch * d.heads : 1;
  for (std::int64_t e = 0; e < entries; ++e)
    for (std::int64_t i = 0; i < d.m; ++i)
      for (std::int64_t j = 0; j < d.n; ++j) {
        double s = 0;
        for (std::int64_t p = 0; p < d.k; ++p)
          s += xv[static_cast<std::size_t>(x_index(op, d, e, i, p))] *
               yv[static_cast<std::size_t>(y_index(op, d, e, p, j))];
        const std::int64_t ci = (e * d.m + i) * d.n + j;
        double v = static_cast<double>(o.alpha) * s;
        if (o.beta != 0.0f) v += static_cast<double>(o.beta) * cv[static_cast<std::size_t>(ci)];
        if (out.dtype() == DType::F32) out.data_as<float>()[ci] = static_cast<float>(v);
        else out.data_as<std::uint16_t>()[ci] = bf16_nearest_even_bits(static_cast<float>(v));
      }
  return out;
}

// Tolerances of library vs naive. Both sides sum the same rounded operands in fp64 and round once, so they agree
// up to one output ulp where an fp64 sum lands next to a rounding boundary (f32: 2^-23 relative; bf16: 2^-7),
// plus fp64 summation error in cancellation (K * 2^-53 * sum|x*y| < 1e-10 for |values| <= 4, K <= 300).
constexpr test::Tolerance kSameOperandsF32{1e-10, 1.2e-7, 1e-7};
constexpr test::Tolerance kSameOperandsBf16{1e-10, 7.9e-3, 4e-3};
test::Tolerance same_operands(DType out) { return out == DType::BF16 ? kSameOperandsBf16 : kSameOperandsF32; }

struct DTypes {
  DType in, out;
};
constexpr DTypes kDTypeCombos[] = {{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}};
constexpr MathMode kModes[] = {MathMode::FP32, MathMode::TF32, MathMode::BF16};

std::string describe(Op op, const Dims& d, DTypes t, const GemmOptions& o) {
  return label(op) + " m=" + std::to_string(d.m) + " n=" + std::to_string(d.n) + " k=" + std::to_string(d.k) +
         " " + dtype_name(t.in) + "->" + dtype_name(t.out) + " " + math_mode_name(o.math) +
         " alpha=" + std::to_string(o.alpha) + " beta=" + std::to_string(o.beta);
}

// ---- exact results on small integers ------------------------------------------------------------------------------
TEST(Gemm, ExactOnSmallIntegersEveryVariantDtypeAndMode) {
  // Integers in [-4,4] are exact in bf16 and tf32 and their products and sums are exact in fp64, so every mode
  // gives the exact integer result (then rounded once to C's dtype): byte-identity with the naive loop.
  const Context ctx = Context::cpu();
  std::uint64_t seed = 100;
  for (Op op : kAllOps) {
    const Dims d = is_batched(op) ? Dims{7, 9, 33} : Dims{7, 65, 33};
    const Layout l = layout(op, d);
    for (DTypes t : kDTypeCombos) {
      for (MathMode math : kModes) {
        for (GemmOptions o : {GemmOptions{1.0f, 0.0f, math}, GemmOptions{2.0f, -1.0f, math}}) {
          const Tensor x = test::random_int_tensor(t.in, l.x, ++seed);
          const Tensor y = test::random_int_tensor(t.in, l.y, ++seed);
          Tensor c = test::random_int_tensor(t.out, l.out, ++seed);
          if (o.beta == 0.0f) test::poison(c);
          const Tensor want = naive(op, d, x, y, c, o);
          call(op, ctx, x, y, c, o);
          EXPECT_TRUE(test::bytes_equal(c, want)) << describe(op, d, t, o);
        }
      }
    }
  }
}

// ---- random inputs, ragged shapes, every math mode --------------------------------------------------------------
TEST(Gemm, RandomRaggedShapesEveryMathMode) {
  // Ragged sizes, none a multiple of the backend's tiles; the larger ones cross several tiles of M and N and
  // more than one packed panel of K.
  const Dims shapes[] = {{1, 1, 1}, {1, 7, 63}, {7, 1, 65}, {63, 65, 7}, {65, 63, 1}, {130, 257, 300}, {300, 7, 259}};
  const Dims batched_shapes[] = {{1, 1, 1, 1, 1}, {7, 63, 65, 2, 3}, {65, 33, 129, 1, 2}};
  const Context ctx = Context::cpu();
  std::uint64_t seed = 1000;
  for (Op op : kAllOps) {
    auto run = [&](const Dims& d) {
      const Layout l = layout(op, d);
      for (DTypes t : kDTypeCombos) {
        for (MathMode math : kModes) {
          // bf16 storage ignores the mode, so one mode suffices there (ModesDoNotTouchBf16Storage checks that).
          if (t.in == DType::BF16 && math != MathMode::FP32) continue;
          const GemmOptions o{1.0f, 0.0f, math};
          const Tensor x = test::random_tensor(t.in, l.x, ++seed);
          const Tensor y = test::random_tensor(t.in, l.y, ++seed);
          Tensor c(t.out, l.out);
          test::poison(c);
          call(op, ctx, x, y, c, o);
          EXPECT_TRUE(test::all_close(c, naive(op, d, x, y, c, o), same_operands(t.out))) << describe(op, d, t, o);
        }
      }
    };
    if (is_batched(op))
      for (const Dims& d : batched_shapes) run(d);
    else
      for (const Dims& d : shapes) run(d);
  }
}

TEST(Gemm, ModesDoNotTouchBf16Storage) {
  const Context ctx = Context::cpu();
  const Tensor a = test::random_tensor(DType::BF16, {17, 70}, 7), b = test::random_tensor(DType::BF16, {70, 9}, 8);
  Tensor ref(DType::F32, {17, 9}), c(DType::F32, {17, 9});
  gemm(ctx, a, b, ref, {1, 0, MathMode::FP32});
  for (MathMode math : {MathMode::TF32, MathMode::BF16}) {
    test::poison(c);
    gemm(ctx, a, b, c, {1, 0, math});
    EXPECT_TRUE(test::bytes_equal(c, ref)) << math_mode_name(math);
  }
}

// ---- alpha and beta -------------------------------------------------------------------------------------------------
TEST(Gemm, AlphaBetaAndAccumulation) {
  const Context ctx = Context::cpu();
  std::uint64_t seed = 2000;
  const Dims d{63, 65, 47, 2, 2};
  for (Op op : kAllOps) {
    const Layout l = layout(op, d);
    for (DTypes t : kDTypeCombos) {
      // beta = 1 is how the backward ops accumulate gradients; the others exercise scaling of both terms.
      for (GemmOptions o : {GemmOptions{1.0f, 1.0f, MathMode::FP32}, GemmOptions{0.5f, -2.0f, MathMode::TF32},
                            GemmOptions{-3.0f, 0.25f, MathMode::BF16}, GemmOptions{0.0f, 1.5f, MathMode::FP32}}) {
        const Tensor x = test::random_tensor(t.in, l.x, ++seed);
        const Tensor y = test::random_tensor(t.in, l.y, ++seed);
        Tensor c = test::random_tensor(t.out, l.out, ++seed);
        const Tensor want = naive(op, d, x, y, c, o);
        call(op, ctx, x, y, c, o);
        EXPECT_TRUE(test::all_close(c, want, same_operands(t.out))) << describe(op, d, t, o);
      }
    }
  }
}

TEST(Gemm, BetaZeroNeverReadsC) {
  // NaN in C with beta = 0 must be overwritten, not propagated (0 * NaN would be NaN).
  const Context ctx = Context::cpu();
  std::uint64_t seed = 3000;
  const Dims d{33, 17, 29, 1, 3};
  for (Op op : kAllOps) {
    const Layout l = layout(op, d);
    for (DTypes t : kDTypeCombos) {
      const GemmOptions o{1.5f, 0.0f, MathMode::FP32};
      const Tensor x = test::random_tensor(t.in, l.x, ++seed);
      const Tensor y = test::random_tensor(t.in, l.y, ++seed);
      Tensor c(t.out, l.out);
      test::poison(c);
      call(op, ctx, x, y, c, o);
      std::int64_t nonfinite = 0;
      for (double v : test::to_doubles(c)) nonfinite += !std::isfinite(v);
      EXPECT_EQ(nonfinite, 0) << describe(op, d, t, o);
      EXPECT_TRUE(test::all_close(c, naive(op, d, x, y, c, o), same_operands(t.out))) << describe(op, d, t, o);
    }
  }
}

TEST(Gemm, AddendStandsInForTheOldOutput) {
  // out = alpha·product + beta·addend: the addend read where out's old contents would be, out never read (poisoned
  // here); the addend may be out itself; beta = 0 never reads it either; K = 0 gives beta·addend.
  const Context ctx = Context::cpu();
  std::uint64_t seed = 2500;
  for (Op op : kAllOps) {
    for (const Dims& d : {Dims{63, 65, 47, 2, 2}, Dims{1, 7, 1000, 1, 1}, Dims{5, 6, 0, 2, 1}}) {
      const Layout l = layout(op, d);
      for (DTypes t : kDTypeCombos) {
        for (GemmOptions o : {GemmOptions{1.0f, 1.0f, MathMode::FP32}, GemmOptions{0.5f, -2.0f, MathMode::TF32},
                              GemmOptions{1.5f, 0.0f, MathMode::BF16}}) {
          const Tensor x = test::random_tensor(t.in, l.x, ++seed);
          const Tensor y = test::random_tensor(t.in, l.y, ++seed);
          Tensor addend = test::random_tensor(t.out, l.out, ++seed);
          if (o.beta == 0.0f) test::poison(addend);
          const Tensor before = test::host_copy(addend);
          Tensor c(t.out, l.out);
          test::poison(c);
          o.addend = addend;
          call(op, ctx, x, y, c, o);
          const Tensor want = naive(op, d, x, y, addend, o);
          EXPECT_TRUE(test::all_close(c, want, same_operands(t.out))) << describe(op, d, t, o);
          EXPECT_TRUE(test::bytes_equal(addend, before)) << describe(op, d, t, o) << ": the addend changed";
          Tensor in_place = test::host_copy(before);  // the addend as out itself: the same as no addend
          o.addend = in_place;
          call(op, ctx, x, y, in_place, o);
          EXPECT_TRUE(test::bytes_equal(in_place, c)) << describe(op, d, t, o) << ": in place";
        }
      }
    }
  }
}

// ---- the math modes really are different ------------------------------------------------------------------------
TEST(Gemm, MathModesRoundOperandsAsSpecified) {
  // One row times one column, exact in fp32: the result shows how each operand was rounded.
  //   a0 = 1 + 3*2^-11: tf32 rounds to nearest (1 + 2^-9; truncation would give 1 + 2^-10); bf16 truncates to 1.
  //   a1 = 1 + 3*2^-9:  exact in tf32; bf16 truncates to 1 (round-to-nearest would give 1 + 2^-7).
  const Context ctx = Context::cpu();
  Tensor a(DType::F32, {1, 2}), b = test::filled(DType::F32, {2, 1}, 1.0f), c(DType::F32, {1, 1});
  a.data_as<float>()[0] = 1.0f + 3 * std::ldexp(1.0f, -11);
  a.data_as<float>()[1] = 1.0f + 3 * std::ldexp(1.0f, -9);
  const float want_fp32 = 2.0f + 3 * std::ldexp(1.0f, -11) + 3 * std::ldexp(1.0f, -9);
  const float want_tf32 = 2.0f + std::ldexp(1.0f, -9) + 3 * std::ldexp(1.0f, -9);
  const float want_bf16 = 2.0f;
  for (auto [math, want] : {std::pair{MathMode::FP32, want_fp32}, std::pair{MathMode::TF32, want_tf32},
                            std::pair{MathMode::BF16, want_bf16}}) {
    test::poison(c);
    gemm(ctx, a, b, c, {1, 0, math});
    EXPECT_EQ(c.data_as<float>()[0], want) << math_mode_name(math);
  }
}

TEST(Gemm, MathModesDifferOnRandomInputs) {
  // Uniform fp32 values have their low mantissa bits set, so the three modes must give three different results,
  // each matching the naive loop with its own rounding.
  const Context ctx = Context::cpu();
  const Dims d{33, 65, 47};
  const Tensor a = test::random_tensor(DType::F32, {d.m, d.k}, 41);
  const Tensor b = test::random_tensor(DType::F32, {d.k, d.n}, 42);
  std::vector<std::vector<double>> results;
  for (MathMode math : kModes) {
    Tensor c(DType::F32, {d.m, d.n});
    test::poison(c);
    gemm(ctx, a, b, c, {1, 0, math});
    EXPECT_TRUE(test::all_close(c, naive(Op::Gemm, d, a, b, c, {1, 0, math}), kSameOperandsF32))
        << math_mode_name(math);
    results.push_back(test::to_doubles(c));
  }
  auto max_diff = [](const std::vector<double>& u, const std::vector<double>& v) {
    double m = 0;
    for (std::size_t i = 0; i < u.size(); ++i) m = std::max(m, std::fabs(u[i] - v[i]));
    return m;
  };
  // The rounding errors are ~2^-11 (tf32) and ~2^-8 (bf16) relative per operand; sums are O(1).
  EXPECT_GT(max_diff(results[0], results[1]), 1e-5) << "TF32 equals FP32";
  EXPECT_GT(max_diff(results[0], results[2]), 1e-4) << "BF16 equals FP32";
  EXPECT_GT(max_diff(results[1], results[2]), 1e-4) << "BF16 equals TF32";
}

TEST(Gemm, Bf16ModeIsTheTruncatedIntegerProduct) {
  // x = n + sign(n) * j * 2^-12 with 1 <= |n| <= 4 and 1 <= j <= 15: the fraction is below bf16's resolution at
  // every |n| (2^-7 at 1), so truncation drops it exactly and the BF16 result is the integer product, bit for bit.
  const Context ctx = Context::cpu();
  const std::int64_t m = 19, k = 37, n = 23;
  Tensor a_int(DType::F32, {m, k}), b_int(DType::F32, {k, n});
  Tensor a(DType::F32, {m, k}), b(DType::F32, {k, n});
  std::uint64_t state = 12345;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int>(state >> 33);
  };
  auto fill = [&](Tensor& ints, Tensor& frac) {
    for (std::int64_t i = 0; i < ints.numel(); ++i) {
      const int mag = 1 + next() % 4, sign = next() % 2 ? 1 : -1, j = 1 + next() % 15;
      ints.data_as<float>()[i] = static_cast<float>(sign * mag);
      frac.data_as<float>()[i] = static_cast<float>(sign * (mag + j * std::ldexp(1.0, -12)));
    }
  };
  fill(a_int, a);
  fill(b_int, b);
  Tensor want(DType::F32, {m, n}), c(DType::F32, {m, n});
  gemm(ctx, a_int, b_int, want, {1, 0, MathMode::FP32});
  EXPECT_TRUE(test::bytes_equal(want, naive(Op::Gemm, {m, n, k}, a_int, b_int, want, {1, 0, MathMode::FP32})));
  test::poison(c);
  gemm(ctx, a, b, c, {1, 0, MathMode::BF16});
  EXPECT_TRUE(test::bytes_equal(c, want));
  // FP32 keeps the fractions, so it must differ from the integer product.
  gemm(ctx, a, b, c, {1, 0, MathMode::FP32});
  EXPECT_FALSE(test::bytes_equal(c, want));
}

// ---- batched: entries are independent -----------------------------------------------------------------------------
TEST(Gemm, BatchedEqualsPerEntryGemm) {
  // Each [b,h] entry of batched_gemm must equal a gemm / gemm_bt on that entry's slices.
  const Context ctx = Context::cpu();
  const std::int64_t bs = 2, hs = 3, m = 7, n = 65, k = 63;
  for (bool tb : {false, true}) {
    for (DTypes t : kDTypeCombos) {
      const Tensor a = test::random_tensor(t.in, {bs, hs, m, k}, 51);
      const Tensor b = tb ? test::random_tensor(t.in, {bs, hs, n, k}, 52) : test::random_tensor(t.in, {bs, hs, k, n}, 52);
      Tensor c(t.out, {bs, hs, m, n});
      test::poison(c);
      batched_gemm(ctx, a, b, c, tb);
      const std::size_t in_size = dtype_size(t.in), out_size = dtype_size(t.out);
      for (std::int64_t e = 0; e < bs * hs; ++e) {
        auto* ap = static_cast<std::uint8_t*>(a.data()) + e * m * k * in_size;
        auto* bp = static_cast<std::uint8_t*>(b.data()) + e * k * n * in_size;
        auto* cp = static_cast<std::uint8_t*>(c.data()) + e * m * n * out_size;
        const TensorView ae(ap, t.in, {m, k}), ce(cp, t.out, {m, n});
        Tensor single(t.out, {m, n});
        if (tb) gemm_bt(ctx, ae, TensorView(bp, t.in, {n, k}), single);
        else gemm(ctx, ae, TensorView(bp, t.in, {k, n}), single);
        EXPECT_TRUE(test::bytes_equal(ce, single)) << "entry " << e << " transpose_b " << tb;
      }
    }
  }
}

TEST(Gemm, ResultDoesNotDependOnThreadCount) {
  // The fp64 sums run in index order whatever the tiling, so one thread and all threads give the same bytes.
  const Context ctx = Context::cpu();
  const Tensor a = test::random_tensor(DType::F32, {130, 300}, 61), b = test::random_tensor(DType::F32, {257, 300}, 62);
  Tensor c1(DType::F32, {130, 257}), cn(DType::F32, {130, 257});
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  gemm_bt(ctx, a, b, c1, {1, 0, MathMode::TF32});
  omp_set_num_threads(std::max(threads, 2));
  gemm_bt(ctx, a, b, cn, {1, 0, MathMode::TF32});
  omp_set_num_threads(threads);
  EXPECT_TRUE(test::bytes_equal(c1, cn));
}

// ---- empty dimensions ------------------------------------------------------------------------------------------------
TEST(Gemm, ZeroSizedDimensions) {
  const Context ctx = Context::cpu();
  // M = 0 or N = 0: nothing to compute, nothing written.
  {
    Tensor a = test::random_tensor(DType::F32, {0, 5}, 1), b = test::random_tensor(DType::F32, {5, 3}, 2);
    Tensor c(DType::F32, {0, 3});
    EXPECT_NO_THROW(gemm(ctx, a, b, c));
    Tensor a2 = test::random_tensor(DType::F32, {4, 5}, 3), b2 = test::random_tensor(DType::F32, {5, 0}, 4);
    Tensor c2(DType::F32, {4, 0});
    EXPECT_NO_THROW(gemm(ctx, a2, b2, c2));
    Tensor qa(DType::BF16, {0, 2, 3, 4}), qb(DType::BF16, {0, 2, 5, 4}), qc(DType::F32, {0, 2, 3, 5});
    EXPECT_NO_THROW(batched_gemm(ctx, qa, qb, qc, true));
  }
  // K = 0: the product is empty, so C = beta * C; beta = 0 gives zeros even over NaN.
  for (Op op : kAllOps) {
    const Dims d{5, 6, 0, 2, 1};
    const Layout l = layout(op, d);
    for (DTypes t : kDTypeCombos) {
      const Tensor x(t.in, l.x), y(t.in, l.y);
      Tensor c(t.out, l.out);
      test::poison(c);
      call(op, ctx, x, y, c, {2.0f, 0.0f, MathMode::FP32});
      EXPECT_TRUE(test::all_close(c, test::filled(t.out, l.out, 0.0f), {0, 0, 0})) << label(op);
      const Tensor c0 = test::random_int_tensor(t.out, l.out, 9);
      Tensor c1 = test::host_copy(c0);
      call(op, ctx, x, y, c1, {2.0f, 0.5f, MathMode::TF32});
      std::vector<double> want = test::to_doubles(c0);
      Tensor want_t(t.out, l.out);
      for (std::size_t i = 0; i < want.size(); ++i) {
        const float v = static_cast<float>(0.5 * want[i]);  // halves of small integers: exact in bf16 too
        if (t.out == DType::F32) want_t.data_as<float>()[i] = v;
        else want_t.data_as<std::uint16_t>()[i] = bf16_nearest_even_bits(v);
      }
      EXPECT_TRUE(test::all_close(c1, want_t, {0, 0, 0})) << label(op);
    }
  }
}

// ---- validation -----------------------------------------------------------------------------------------------------
// Runs a call that must be rejected and checks the error and that `out` (the memory the call would write) is
// unchanged.
template <class Fn>
void expect_rejected(const std::string& what, const TensorView& out, Fn&& fn, ErrorCode code,
                     std::initializer_list<std::string> needles) {
  const Tensor before = test::host_copy(out);
  EXPECT_TRUE(test::throws_error(fn, code, needles)) << what;
  EXPECT_TRUE(test::bytes_equal(out, before)) << what << ": output changed";
}

TEST(Gemm, ExactErrorMessageForInnerDimensions) {
  const Context ctx = Context::cpu();
  Tensor a(DType::F32, {64, 32}), b(DType::F32, {33, 16}), c = test::random_tensor(DType::F32, {64, 16}, 1);
  expect_rejected("inner", c, [&] { gemm(ctx, a, b, c); }, ErrorCode::ShapeMismatch,
                  {"gemm: A is [64,32] but B is [33,16]: inner dimensions differ"});
}

TEST(Gemm, EveryValidationPathThrowsAndLeavesOutputUnchanged) {
  const Context ctx = Context::cpu();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (Op op : kAllOps) {
    const Names nm = names(op);
    const Dims d{6, 5, 4, 2, 3};
    const Layout l = layout(op, d);
    const Tensor x = test::random_tensor(DType::F32, l.x, 1), y = test::random_tensor(DType::F32, l.y, 2);
    const Tensor out = test::random_tensor(DType::F32, l.out, 3);
    const std::string what = label(op);
    auto run = [&](const TensorView& xx, const TensorView& yy, const TensorView& oo, GemmOptions o = {}) {
      return [=, &ctx] { call(op, ctx, xx, yy, oo, o); };
    };
    const ErrorCode shape = ErrorCode::ShapeMismatch, dtype = ErrorCode::DTypeMismatch,
                    device = ErrorCode::DeviceMismatch, invalid = ErrorCode::InvalidArgument;
    const int rank = is_batched(op) ? 4 : 2;
    const Shape wrong_rank = is_batched(op) ? Shape{6, 4} : Shape{1, 6, 4};

    // Rank of each argument.
    const Tensor bad_rank(DType::F32, wrong_rank);
    expect_rejected(what + " rank x", out, run(bad_rank, y, out), shape, {nm.op, nm.x, "rank " + std::to_string(rank)});
    expect_rejected(what + " rank y", out, run(x, bad_rank, out), shape, {nm.op, nm.y, "rank"});
    expect_rejected(what + " rank out", bad_rank, run(x, y, bad_rank), shape, {nm.op, nm.out, "rank"});

    // Inner (contraction) dimension: y laid out for k + 1.
    const Tensor y_inner = test::random_tensor(DType::F32, layout(op, {d.m, d.n, d.k + 1, d.batch, d.heads}).y, 4);
    expect_rejected(what + " inner", out, run(x, y_inner, out), shape,
                    {std::string(nm.op) + ": ", nm.x, nm.y, "inner dimensions differ"});
    // Output shape: laid out for n + 1.
    const Tensor out_shape = test::random_tensor(DType::F32, layout(op, {d.m, d.n + 1, d.k, d.batch, d.heads}).out, 5);
    expect_rejected(what + " out shape", out_shape, run(x, y, out_shape), shape,
                    {std::string(nm.op) + ": ", nm.out, l.out.str()});
    if (is_batched(op)) {
      const Tensor y_batch = test::random_tensor(DType::F32, layout(op, {d.m, d.n, d.k, d.batch + 1, d.heads}).y, 6);
      expect_rejected(what + " batch dims", out, run(x, y_batch, out), shape, {nm.op, "batch dimensions"});
    }

    // Dtypes: unsupported input, mixed inputs, output narrower than f32 inputs, unsupported output.
    const Tensor x_f16(DType::F16, l.x), x_bf16 = test::random_tensor(DType::BF16, l.x, 7);
    const Tensor y_bf16 = test::random_tensor(DType::BF16, l.y, 8);
    const Tensor out_bf16 = test::random_tensor(DType::BF16, l.out, 9), out_f16(DType::F16, l.out);
    expect_rejected(what + " f16 x", out, run(x_f16, y, out), dtype, {nm.op, nm.x, "f16"});
    expect_rejected(what + " mixed", out, run(x, y_bf16, out), dtype, {nm.op, nm.x, nm.y, "bf16"});
    expect_rejected(what + " mixed 2", out, run(x_bf16, y, out), dtype, {nm.op, nm.x, nm.y, "f32"});
    expect_rejected(what + " bf16 out of f32", out_bf16, run(x, y, out_bf16), dtype, {nm.op, nm.out, "bf16"});
    expect_rejected(what + " f16 out", out_f16, run(x_bf16, y_bf16, out_f16), dtype, {nm.op, nm.out, "f16"});

    // Device: views that claim to live on a GPU while the context is the CPU (never dereferenced).
    const TensorView x_gpu(x.data(), DType::F32, l.x, Device::cuda(0));
    const TensorView y_gpu(y.data(), DType::F32, l.y, Device::cuda(0));
    const TensorView out_gpu(out.data(), DType::F32, l.out, Device::cuda(0));
    expect_rejected(what + " device x", out, run(x_gpu, y, out), device, {nm.op, nm.x, "cuda:0", "cpu"});
    expect_rejected(what + " device y", out, run(x, y_gpu, out), device, {nm.op, nm.y, "cuda:0"});
    expect_rejected(what + " device out", out, run(x, y, out_gpu), device, {nm.op, nm.out, "cuda:0"});

    // Null data.
    const TensorView x_null(nullptr, DType::F32, l.x), y_null(nullptr, DType::F32, l.y);
    const TensorView out_null(nullptr, DType::F32, l.out);
    expect_rejected(what + " null x", out, run(x_null, y, out), invalid, {nm.op, nm.x, "null"});
    expect_rejected(what + " null y", out, run(x, y_null, out), invalid, {nm.op, nm.y, "null"});
    expect_rejected(what + " null out", out, [&] { call(op, ctx, x, y, out_null, {}); }, invalid,
                    {nm.op, nm.out, "null"});

    // The output overlapping an input (a view of out's shape over the input's memory, which must not change).
    Tensor big_x = test::random_tensor(DType::F32, {l.x.numel() + l.out.numel()}, 10);
    Tensor big_y = test::random_tensor(DType::F32, {l.y.numel() + l.out.numel()}, 11);
    const TensorView xo(big_x.data(), DType::F32, l.x), yo(big_y.data(), DType::F32, l.y);
    const TensorView out_on_x(big_x.data_as<float>() + 1, DType::F32, l.out);  // partial overlap with xo
    const TensorView out_on_y(big_y.data(), DType::F32, l.out);                // starts where yo starts
    expect_rejected(what + " overlap x", big_x, run(xo, y, out_on_x), invalid, {nm.op, nm.out, nm.x, "overlap"});
    expect_rejected(what + " overlap y", big_y, run(x, yo, out_on_y), invalid, {nm.op, nm.out, nm.y, "overlap"});

    // The addend: out's shape and dtype, on the context's device, out itself or apart from it.
    const auto with_addend = [](const TensorView& a) {
      GemmOptions o;
      o.beta = 1.0f;
      o.addend = a;
      return o;
    };
    const Tensor add_shape = test::random_tensor(DType::F32, layout(op, {d.m, d.n + 1, d.k, d.batch, d.heads}).out, 12);
    const Tensor add_bf16 = test::random_tensor(DType::BF16, l.out, 13);
    Tensor big_out = test::random_tensor(DType::F32, {l.out.numel() + 1}, 14);
    const TensorView out_in_big(big_out.data(), DType::F32, l.out);
    const TensorView add_on_out(big_out.data_as<float>() + 1, DType::F32, l.out);  // partial overlap with out
    const TensorView add_gpu(add_bf16.data(), DType::F32, l.out, Device::cuda(0));
    expect_rejected(what + " addend shape", out, run(x, y, out, with_addend(add_shape)), shape,
                    {nm.op, "addend", l.out.str()});
    expect_rejected(what + " addend dtype", out, run(x, y, out, with_addend(add_bf16)), dtype,
                    {nm.op, "addend", "bf16"});
    expect_rejected(what + " addend overlap", big_out, run(x, y, out_in_big, with_addend(add_on_out)), invalid,
                    {nm.op, "addend", nm.out, "overlap"});
    expect_rejected(what + " addend device", out, run(x, y, out, with_addend(add_gpu)), device,
                    {nm.op, "addend", "cuda:0"});
    expect_rejected(what + " addend null", out, run(x, y, out, with_addend(TensorView(nullptr, DType::F32, l.out))),
                    invalid, {nm.op, "addend", "null"});

    // Scalars and mode.
    expect_rejected(what + " alpha inf", out, run(x, y, out, {inf, 0, MathMode::FP32}), invalid, {nm.op, "alpha"});
    expect_rejected(what + " alpha nan", out, run(x, y, out, {nan, 0, MathMode::FP32}), invalid, {nm.op, "alpha"});
    expect_rejected(what + " beta nan", out, run(x, y, out, {1, nan, MathMode::FP32}), invalid, {nm.op, "beta"});
    expect_rejected(what + " beta -inf", out, run(x, y, out, {1, -inf, MathMode::FP32}), invalid, {nm.op, "beta"});
    expect_rejected(what + " math", out, run(x, y, out, {1, 0, static_cast<MathMode>(7)}), invalid,
                    {nm.op, "math mode"});
  }
}

// lora_backward_dy on the CPU is the two GEMMs it names (the GPU's one-pass kernel is held to this).
TEST(LoraBackwardDy, EqualsItsTwoGemmsInEveryDtypeAndMode) {
  const Context ctx = Context::cpu();
  std::uint64_t seed = 900;
  struct Case {
    DType dt;
    MathMode math;
  };
  for (Case c : {Case{DType::BF16, MathMode::FP32}, Case{DType::F32, MathMode::FP32}, Case{DType::F32, MathMode::TF32},
                 Case{DType::F32, MathMode::BF16}})
    for (auto [m, n, r] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 8, 8}, {7, 65, 16}, {130, 63, 12}})
      for (float beta : {1.0f, 0.0f}) {
        const Tensor dy = test::random_tensor(c.dt, {m, n}, ++seed), b = test::random_tensor(c.dt, {n, r}, ++seed);
        const Tensor t = test::random_tensor(c.dt, {m, r}, ++seed), gb0 = test::random_tensor(DType::F32, {n, r}, ++seed);
        Tensor dt(c.dt, {m, r}), dt_ref(c.dt, {m, r});
        test::poison(dt);
        Tensor gb = test::host_copy(gb0), gb_ref = test::host_copy(gb0);
        if (beta == 0.0f) test::poison(gb);  // beta = 0 must not read grad_b
        lora_backward_dy(ctx, dy, b, t, dt, gb, 0.625f, c.math, beta);
        gemm(ctx, dy, b, dt_ref, {0.625f, 0.0f, c.math});
        gemm_backward_b(ctx, dy, t, gb_ref, {0.625f, beta, c.math});
        const std::string what = std::string(dtype_name(c.dt)) + " " + math_mode_name(c.math) + " m" +
                                 std::to_string(m) + " n" + std::to_string(n) + " r" + std::to_string(r) +
                                 " beta " + std::to_string(beta);
        EXPECT_TRUE(test::bytes_equal(dt, dt_ref)) << what;
        EXPECT_TRUE(test::bytes_equal(gb, gb_ref)) << what;
      }
}

TEST(LoraBackwardDy, EveryValidationPathThrowsAndWritesNothing) {
  const Context ctx = Context::cpu();
  const std::int64_t m = 6, n = 5, r = 4;
  const Tensor dy = test::random_tensor(DType::BF16, {m, n}, 1), b = test::random_tensor(DType::BF16, {n, r}, 2);
  const Tensor t = test::random_tensor(DType::BF16, {m, r}, 3);
  const Tensor dt = test::random_tensor(DType::BF16, {m, r}, 4), gb = test::random_tensor(DType::F32, {n, r}, 5);
  auto rejected = [&](const std::string& what, auto&& fn, ErrorCode code, std::initializer_list<std::string> needles) {
    const Tensor dt_before = test::host_copy(dt), gb_before = test::host_copy(gb);
    EXPECT_TRUE(test::throws_error(fn, code, needles)) << what;
    EXPECT_TRUE(test::bytes_equal(dt, dt_before)) << what << ": dt changed";
    EXPECT_TRUE(test::bytes_equal(gb, gb_before)) << what << ": grad_b changed";
  };
  const ErrorCode shape = ErrorCode::ShapeMismatch, dtype = ErrorCode::DTypeMismatch,
                  invalid = ErrorCode::InvalidArgument;
  const char* op = "lora_backward_dy";
  const Tensor b_n = test::random_tensor(DType::BF16, {n + 1, r}, 6), t_r = test::random_tensor(DType::BF16, {m, r + 1}, 7);
  const Tensor t_m = test::random_tensor(DType::BF16, {m + 1, r}, 8), gb_r(DType::F32, {n, r + 1});
  const Tensor t_f32 = test::random_tensor(DType::F32, {m, r}, 9), gb_bf16(DType::BF16, {n, r}), rank3(DType::BF16, {1, m, n});
  rejected("b rows", [&] { lora_backward_dy(ctx, dy, b_n, t, dt, gb, 1.0f); }, shape, {op, "b is [6,4]", "dy's N"});
  rejected("t rank", [&] { lora_backward_dy(ctx, dy, b, t_r, dt, gb, 1.0f); }, shape, {op, "t is [6,5]", "[6,4]"});
  rejected("t rows", [&] { lora_backward_dy(ctx, dy, b, t_m, dt, gb, 1.0f); }, shape, {op, "t is [7,4]"});
  rejected("grad_b shape", [&] { lora_backward_dy(ctx, dy, b, t, dt, gb_r, 1.0f); }, shape, {op, "grad_b"});
  rejected("dy rank", [&] { lora_backward_dy(ctx, rank3, b, t, dt, gb, 1.0f); }, shape, {op, "dy", "rank"});
  rejected("t dtype", [&] { lora_backward_dy(ctx, dy, b, t_f32, dt, gb, 1.0f); }, dtype, {op, "t", "f32"});
  rejected("grad_b dtype", [&] { lora_backward_dy(ctx, dy, b, t, dt, gb_bf16, 1.0f); }, dtype, {op, "grad_b", "bf16"});
  rejected("scale", [&] { lora_backward_dy(ctx, dy, b, t, dt, gb, std::numeric_limits<float>::infinity()); }, invalid,
           {op, "scale"});
  rejected("math", [&] { lora_backward_dy(ctx, dy, b, t, dt, gb, 1.0f, static_cast<MathMode>(9)); }, invalid,
           {op, "math mode"});
  rejected("beta", [&] { lora_backward_dy(ctx, dy, b, t, dt, gb, 1.0f, MathMode::FP32, std::nanf("")); }, invalid,
           {op, "beta"});
  rejected("null dt", [&] { lora_backward_dy(ctx, dy, b, t, TensorView(nullptr, DType::BF16, {m, r}), gb, 1.0f); },
           invalid, {op, "dt", "null"});
  const TensorView dt_on_t(t.data(), DType::BF16, {m, r});  // dt over t's memory
  rejected("dt overlaps t", [&] { lora_backward_dy(ctx, dy, b, t, dt_on_t, gb, 1.0f); }, invalid, {op, "dt", "t", "overlap"});
  const TensorView dy_gpu(dy.data(), DType::BF16, {m, n}, Device::cuda(0));
  rejected("device", [&] { lora_backward_dy(ctx, dy_gpu, b, t, dt, gb, 1.0f); }, ErrorCode::DeviceMismatch,
           {op, "dy", "cuda:0"});
}

TEST(Gemm, NamesOfMathModesAndPlanKeys) {
  EXPECT_STREQ(math_mode_name(MathMode::FP32), "fp32");
  EXPECT_STREQ(math_mode_name(MathMode::TF32), "tf32");
  EXPECT_STREQ(math_mode_name(MathMode::BF16), "bf16");
  // A plan key names everything that selects a plan and nothing else (no pointers, no scalars).
  GemmProblem p;
  p.m = 7;
  p.n = 65;
  p.k = 33;
  const std::string base = p.key();
  GemmProblem q = p;
  int dummy[4];
  q.a = dummy;
  q.c = dummy + 1;
  q.alpha = 3.0f;
  q.beta = 1.0f;
  EXPECT_EQ(q.key(), base);
  std::vector<GemmProblem> variants(9, p);
  variants[0].m = 8;
  variants[1].n = 66;
  variants[2].k = 34;
  variants[3].batch = 2;
  variants[4].trans_a = true;
  variants[5].trans_b = true;
  variants[6].ab_dtype = DType::BF16;
  variants[7].c_dtype = DType::BF16;
  variants[8].math = MathMode::TF32;
  std::vector<std::string> keys{base};
  for (const GemmProblem& v : variants) keys.push_back(v.key());
  for (std::size_t i = 0; i < keys.size(); ++i)
    for (std::size_t j = i + 1; j < keys.size(); ++j) EXPECT_NE(keys[i], keys[j]) << i << " vs " << j;
}

// ---- lora_adapters: adapters of one input, their first products stacked -----------------------------------------
// Against the per-adapter ops (gemm_bt twice, lora_backward_dy, gemm_backward_b, gemm): the same terms, the first
// products and grad_a and dx over every rank at once, so fp32 sums may differ in order.
TEST(LoraAdapters, MatchThePerAdapterOpsAndCheckArguments) {
  const Context cpu = Context::cpu();
  const std::int64_t m = 7, k = 40;
  const std::int64_t ns[] = {24, 9}, rs[] = {4, 12};
  const float scales[] = {2.0f, 0.25f};
  const Tensor x = test::random_tensor(DType::F32, {m, k}, 1), a = test::random_tensor(DType::F32, {16, k}, 2);
  std::vector<Tensor> y0, y, b, dy, gb;
  for (int i = 0; i < 2; ++i) {
    y0.push_back(test::random_tensor(DType::F32, {m, ns[i]}, 10 + i));
    y.push_back(test::host_copy(y0[i]));
    b.push_back(test::random_tensor(DType::F32, {ns[i], rs[i]}, 20 + i));
    dy.push_back(test::random_tensor(DType::F32, {m, ns[i]}, 30 + i));
    gb.push_back(Tensor(DType::F32, {ns[i], rs[i]}));
    test::poison(gb[i]);
  }
  Tensor t(DType::F32, {m, 16}), dt(DType::F32, {m, 16}), ga(DType::F32, {16, k});
  const Tensor dx0 = test::random_tensor(DType::F32, {m, k}, 40);
  Tensor dx = test::host_copy(dx0);
  const std::vector<LoraTerm> terms{{y[0], b[0], scales[0]}, {y[1], b[1], scales[1]}};
  lora_adapters(cpu, x, terms, a, t);
  const std::vector<LoraTermGrad> grads{{dy[0], b[0], scales[0], gb[0]}, {dy[1], b[1], scales[1], gb[1]}};
  lora_adapters_backward(cpu, x, grads, a, t, dt, ga, dx, 0.5f);
  Tensor dx_ref = test::host_copy(dx0);
  for (std::int64_t i = 0; i < dx_ref.numel(); ++i) test::set_value(dx_ref, i, 0.5 * test::get_value(dx0, i));
  std::int64_t row = 0;
  for (int i = 0; i < 2; ++i) {
    const TensorView ai(static_cast<float*>(a.data()) + row * k, DType::F32, {rs[i], k});
    Tensor ti(DType::F32, {m, rs[i]}), dti(DType::F32, {m, rs[i]}), gbi(DType::F32, {ns[i], rs[i]});
    Tensor yi = test::host_copy(y0[i]), gai(DType::F32, {rs[i], k});
    gemm_bt(cpu, x, ai, ti);
    gemm_bt(cpu, ti, b[i], yi, {scales[i], 1.0f});
    lora_backward_dy(cpu, dy[i], b[i], ti, dti, gbi, scales[i], MathMode::FP32, 0.0f);
    gemm_backward_b(cpu, dti, x, gai);
    gemm(cpu, dti, ai, dx_ref, {1.0f, 1.0f});
    const test::Tolerance tol = test::fp32_accum_tolerance(k + rs[i]);
    EXPECT_TRUE(test::all_close(y[i], yi, tol)) << "y " << i;
    EXPECT_TRUE(test::all_close(gb[i], gbi, test::fp32_accum_tolerance(m))) << "grad_b " << i;
    const TensorView ga_i(static_cast<float*>(ga.data()) + row * k, DType::F32, {rs[i], k});
    EXPECT_TRUE(test::all_close(test::host_copy(ga_i), gai, test::fp32_accum_tolerance(m))) << "grad_a " << i;
    row += rs[i];
  }
  EXPECT_TRUE(test::all_close(dx, dx_ref, test::fp32_accum_tolerance(16))) << "dx";

  // Bad arguments: named, nothing written.
  const Tensor y_before = test::host_copy(y[0]);
  EXPECT_TRUE(test::throws_error([&] { lora_adapters(cpu, x, std::vector<LoraTerm>{}, a, t); },
                                 ErrorCode::InvalidArgument, {"lora_adapters", "no adapters"}));
  EXPECT_TRUE(test::throws_error([&] { lora_adapters(cpu, x, std::vector<LoraTerm>{terms[0]}, a, t); },
                                 ErrorCode::ShapeMismatch, {"lora_adapters", "a is"}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        lora_adapters(cpu, x, std::vector<LoraTerm>{{y[1], b[0], 1.0f}, terms[1]}, a, t);
      },
      ErrorCode::ShapeMismatch, {"y[0] is [7,9]"}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        lora_adapters(cpu, x, std::vector<LoraTerm>{{x, b[0], 1.0f}, terms[1]}, a, t);
      },
      ErrorCode::ShapeMismatch, {"y[0]"}));
  EXPECT_TRUE(test::bytes_equal(y[0], y_before));
  EXPECT_TRUE(test::throws_error(
      [&] {
        const Tensor gb_bf16(DType::BF16, {24, 4});
        lora_adapters_backward(cpu, x, std::vector<LoraTermGrad>{{dy[0], b[0], 1.0f, gb_bf16}, grads[1]}, a, t, dt, ga,
                               dx);
      },
      ErrorCode::DTypeMismatch, {"lora_adapters_backward", "grad_b[0]"}));
  EXPECT_TRUE(test::throws_error([&] { lora_adapters_backward(cpu, x, grads, a, t, dt, ga, x); },
                                 ErrorCode::InvalidArgument, {"lora_adapters_backward", "dx and x overlap"}));
}

}  // namespace
}  // namespace qmm
