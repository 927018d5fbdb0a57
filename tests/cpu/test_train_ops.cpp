// Train ops on the CPU backend (cast, add, add_bias, dropout, mse_loss, grad_norm, adamw_step, zero) against naive
// loops written here, in-place aliasing, dropout mask statistics, a hand-written fp64 AdamW over several steps, and
// every validation path (right code, a message naming op and argument, outputs untouched).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

using test::bits_of;
using test::float_of;

constexpr std::int64_t kSizes[] = {1, 7, 63, 65, 1000, 4099};
constexpr DType kDTypes[] = {DType::F32, DType::BF16};

std::string describe(DType dt, std::int64_t n) { return std::string(dtype_name(dt)) + " n=" + std::to_string(n); }

// Round to nearest even at bf16, written independently of the library: pick the nearer of the two bf16 neighbours
// by comparing distances in double; a tie goes to the even one. Above the largest bf16 the upper neighbour is 2^128
// (which rounds to infinity, as IEEE rounding does).
std::uint16_t naive_bf16(float x) {
  if (std::isnan(x)) return static_cast<std::uint16_t>((bits_of(x) >> 16) | 0x40);
  if (std::isinf(x)) return static_cast<std::uint16_t>(bits_of(x) >> 16);
  const std::uint32_t lo = bits_of(x) & 0xFFFF0000u;  // toward zero
  const std::uint32_t hi = lo + 0x10000u;             // away from zero (may be the infinity pattern)
  const double vlo = std::fabs(static_cast<double>(float_of(lo)));
  const double vhi =
      (hi & 0x7FFFFFFFu) == 0x7F800000u ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(float_of(hi)));
  const double ax = std::fabs(static_cast<double>(x));
  const double dlo = ax - vlo, dhi = vhi - ax;
  const bool up = dhi < dlo || (dhi == dlo && ((lo >> 16) & 1u));
  return static_cast<std::uint16_t>((up ? hi : lo) >> 16);
}

// Each value rounded once to the storage dtype (to fp32, then by naive_bf16 for bf16), as a host tensor.
Tensor from_doubles(DType dt, Shape shape, const std::vector<double>& values) {
  Tensor t(dt, shape);
  std::int64_t i = 0;
  for (double x : values) {
    const float f = static_cast<float>(x);
    if (dt == DType::BF16)
      t.data_as<std::uint16_t>()[i++] = naive_bf16(f);
    else
      t.data_as<float>()[i++] = f;
  }
  return t;
}

// The library and these loops evaluate the same value in double and round it once; an evaluation order that differs
// in the last double bit can move the rounded result by one output ulp, never more.
test::Tolerance one_ulp(DType dt) {
  return dt == DType::BF16 ? test::Tolerance{1e-30, 7.9e-3, 4e-3} : test::Tolerance{1e-30, 1.2e-7, 1e-7};
}

// Runs `fn`, expects qmm::Error with `code` and every needle in the message, and every output byte-for-byte as
// before the call.
template <class Fn>
::testing::AssertionResult rejects(Fn&& fn, ErrorCode code, std::initializer_list<std::string> needles,
                                   std::initializer_list<TensorView> outputs) {
  std::vector<Tensor> before;
  for (const TensorView& o : outputs) before.push_back(test::host_copy(o));
  ::testing::AssertionResult thrown = test::throws_error(fn, code, needles);
  if (!thrown) return thrown;
  std::size_t k = 0;
  for (const TensorView& o : outputs) {
    ::testing::AssertionResult same = test::bytes_equal(o, before[k]);
    if (!same) return ::testing::AssertionFailure() << "output " << k << " was written: " << same.message();
    ++k;
  }
  return ::testing::AssertionSuccess();
}

const ErrorCode kShape = ErrorCode::ShapeMismatch, kDType = ErrorCode::DTypeMismatch,
                kDevice = ErrorCode::DeviceMismatch, kInvalid = ErrorCode::InvalidArgument;

// The same memory labelled as another device (never dereferenced: validation rejects it first).
TensorView on_gpu(const TensorView& t) { return TensorView(t.data(), t.dtype(), t.shape(), Device::cuda(0)); }
TensorView null_like(const TensorView& t) { return TensorView(nullptr, t.dtype(), t.shape()); }
// A view of `n` elements of `buf` starting `offset` elements in.
TensorView part(const Tensor& buf, std::int64_t offset, Shape shape) {
  return TensorView(static_cast<char*>(buf.data()) + offset * static_cast<std::int64_t>(dtype_size(buf.dtype())),
                    buf.dtype(), shape);
}

// ---- cast ---------------------------------------------------------------------------------------------------------

TEST(TrainCast, F32ToBf16RoundsToNearestEven) {
  const Context ctx = Context::cpu();
  for (std::int64_t n : kSizes) {
    const Tensor src = test::random_tensor(DType::F32, {n}, 10 + static_cast<std::uint64_t>(n), -3.0f, 3.0f);
    Tensor dst(DType::BF16, {1, n});  // shapes may differ: a flat copy
    test::poison(dst);
    cast(ctx, src, dst);
    Tensor want(DType::BF16, {1, n});
    for (std::int64_t i = 0; i < n; ++i) want.data_as<std::uint16_t>()[i] = naive_bf16(src.data_as<float>()[i]);
    EXPECT_TRUE(test::bytes_equal(dst, want)) << "n=" << n;
  }
}

TEST(TrainCast, SpecialValuesAndTies) {
  const Context ctx = Context::cpu();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> xs = {0.0f,
                                 -0.0f,
                                 inf,
                                 -inf,
                                 std::numeric_limits<float>::max(),
                                 -std::numeric_limits<float>::max(),
                                 std::numeric_limits<float>::denorm_min(),
                                 1e-40f,
                                 float_of(0x3F808000u) /* tie, even below */,
                                 float_of(0x3F818000u) /* tie, odd below */,
                                 float_of(0x3F808001u),
                                 1.0f,
                                 -2.5f,
                                 std::nanf("")};
  const std::int64_t n = static_cast<std::int64_t>(xs.size());
  Tensor src(DType::F32, {n}), dst(DType::BF16, {n}), want(DType::BF16, {n});
  for (std::int64_t i = 0; i < n; ++i) {
    src.data_as<float>()[i] = xs[static_cast<std::size_t>(i)];
    want.data_as<std::uint16_t>()[i] = naive_bf16(xs[static_cast<std::size_t>(i)]);
  }
  test::poison(dst);
  cast(ctx, src, dst);
  EXPECT_TRUE(test::bytes_equal(dst, want));
  EXPECT_EQ(dst.data_as<std::uint16_t>()[2], 0x7F80);  // inf stays inf
  EXPECT_EQ(dst.data_as<std::uint16_t>()[4], 0x7F80);  // FLT_MAX rounds up to inf
  EXPECT_EQ(dst.data_as<std::uint16_t>()[8], 0x3F80);  // tie to even (down)
  EXPECT_EQ(dst.data_as<std::uint16_t>()[9], 0x3F82);  // tie to even (up)
  EXPECT_TRUE(std::isnan(bf16_to_float(dst.data_as<std::uint16_t>()[n - 1])));
}

TEST(TrainCast, Bf16ToF32IsExactAndSameDTypeCopies) {
  const Context ctx = Context::cpu();
  for (std::int64_t n : kSizes) {
    const Tensor b = test::random_tensor(DType::BF16, {n}, 20 + static_cast<std::uint64_t>(n), -5.0f, 5.0f);
    Tensor f(DType::F32, {n}), want(DType::F32, {n});
    test::poison(f);
    cast(ctx, b, f);
    for (std::int64_t i = 0; i < n; ++i)
      want.data_as<float>()[i] = float_of(static_cast<std::uint32_t>(b.data_as<std::uint16_t>()[i]) << 16);
    EXPECT_TRUE(test::bytes_equal(f, want)) << "bf16->f32 n=" << n;
    for (DType dt : kDTypes) {
      const Tensor src = test::random_tensor(dt, {n}, 30 + static_cast<std::uint64_t>(n));
      Tensor dst(dt, {n, 1});
      test::poison(dst);
      cast(ctx, src, dst);
      EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.nbytes()), 0) << describe(dt, n);
      Tensor same = test::host_copy(src);
      cast(ctx, same, same);  // an exact alias of the same dtype: nothing to do
      EXPECT_TRUE(test::bytes_equal(same, src)) << describe(dt, n);
    }
  }
}

TEST(TrainCast, Validation) {
  const Context ctx = Context::cpu();
  const Tensor src = test::random_tensor(DType::F32, {64}, 1);
  const Tensor dst = test::random_tensor(DType::BF16, {64}, 2), dst_short = test::random_tensor(DType::BF16, {63}, 3);
  const Tensor f16(DType::F16, {64}), u8(DType::U8, {64});
  EXPECT_TRUE(rejects([&] { cast(ctx, null_like(src), dst); }, kInvalid, {"cast: src", "null"}, {dst}));
  EXPECT_TRUE(test::throws_error([&] { cast(ctx, src, null_like(dst)); }, kInvalid, {"cast: dst", "null"}));
  EXPECT_TRUE(rejects([&] { cast(ctx, on_gpu(src), dst); }, kDevice, {"cast: src", "cuda:0"}, {dst}));
  EXPECT_TRUE(rejects([&] { cast(ctx, src, on_gpu(dst)); }, kDevice, {"cast: dst", "cuda:0"}, {dst}));
  EXPECT_TRUE(rejects([&] { cast(ctx, src, f16); }, kDType, {"cast: dst", "f16"}, {f16}));
  EXPECT_TRUE(rejects([&] { cast(ctx, u8, dst); }, kDType, {"cast: src", "u8"}, {dst}));
  EXPECT_TRUE(rejects([&] { cast(ctx, src, dst_short); }, kShape, {"cast: dst", "[63]", "[64]"}, {dst_short}));
  // f32 source and bf16 destination over one buffer: any overlap is rejected (an exact alias cannot convert).
  const Tensor buf = test::random_tensor(DType::F32, {64}, 4);
  const TensorView as_bf16(buf.data(), DType::BF16, {64});
  EXPECT_TRUE(rejects([&] { cast(ctx, buf, as_bf16); }, kInvalid, {"cast: dst and src", "overlap"}, {buf}));
  const TensorView shifted = part(buf, 1, {32});
  EXPECT_TRUE(rejects([&] { cast(ctx, part(buf, 0, {32}), shifted); }, kInvalid, {"cast", "overlap"}, {buf}));
}

// The batched cast is the single one per pair: every dtype pair, empty tensors, an exact same-dtype alias.
TEST(TrainCast, ManyIsEachPairCastAlone) {
  const Context ctx = Context::cpu();
  std::vector<Tensor> src, dst, want;
  std::uint64_t seed = 40;
  for (std::int64_t n : {0L, 1L, 7L, 63L, 65L, 1000L})
    for (auto [from, to] : {std::pair{DType::F32, DType::BF16}, {DType::BF16, DType::F32}, {DType::F32, DType::F32}}) {
      src.push_back(test::random_tensor(from, {n}, ++seed, -3.0f, 3.0f));
      dst.emplace_back(to, Shape{n});
      test::poison(dst.back());
      want.emplace_back(to, Shape{n});
      cast(ctx, src.back(), want.back());
    }
  Tensor alias = test::random_tensor(DType::BF16, {9}, ++seed);
  const Tensor alias_before = test::host_copy(alias);
  std::vector<TensorView> s(src.begin(), src.end()), d(dst.begin(), dst.end());
  s.push_back(alias);
  d.push_back(alias);
  cast(ctx, s, d);
  for (std::size_t i = 0; i < dst.size(); ++i) EXPECT_TRUE(test::bytes_equal(dst[i], want[i])) << "pair " << i;
  EXPECT_TRUE(test::bytes_equal(alias, alias_before));
  cast(ctx, std::span<const TensorView>(), std::span<const TensorView>());  // nothing to do
}

TEST(TrainCast, ManyValidatesEveryPairBeforeWritingAny) {
  const Context ctx = Context::cpu();
  const Tensor a = test::random_tensor(DType::F32, {64}, 1), b = test::random_tensor(DType::F32, {32}, 2);
  const Tensor da = test::random_tensor(DType::BF16, {64}, 3), db = test::random_tensor(DType::BF16, {32}, 4);
  const Tensor db_short = test::random_tensor(DType::BF16, {31}, 5);
  auto many = [&](std::vector<TensorView> s, std::vector<TensorView> d) { return [&ctx, s, d] { cast(ctx, s, d); }; };
  EXPECT_TRUE(rejects(many({a, b}, {da}), kInvalid, {"cast", "src has 2 tensors but dst has 1"}, {da}));
  // The second pair is bad: the first is not written either.
  EXPECT_TRUE(rejects(many({a, b}, {da, db_short}), kShape, {"cast: dst[1]", "[31]", "src[1]"}, {da, db_short}));
  EXPECT_TRUE(rejects(many({a, b}, {da, on_gpu(db)}), kDevice, {"cast: dst[1]", "cuda:0"}, {da, db}));
  // A destination over another pair's source or destination.
  const TensorView a_as_bf16(a.data(), DType::BF16, {32});
  EXPECT_TRUE(rejects(many({a, b}, {da, a_as_bf16}), kInvalid, {"cast", "dst[1]", "src[0]", "overlap"}, {da, a}));
  EXPECT_TRUE(rejects(many({a, b}, {da, part(da, 8, {32})}), kInvalid, {"cast", "dst[1]", "dst[0]", "overlap"}, {da}));
}

// ---- add ----------------------------------------------------------------------------------------------------------

TEST(TrainAdd, MatchesNaive) {
  const Context ctx = Context::cpu();
  std::uint64_t seed = 100;
  for (DType dt : kDTypes)
    for (std::int64_t n : kSizes)
      for (float alpha : {1.0f, -0.5f, 0.0f, 3.25f}) {
        const Tensor a = test::random_tensor(dt, {n}, ++seed), b = test::random_tensor(dt, {n}, ++seed);
        Tensor out(dt, {n});
        test::poison(out);
        add(ctx, a, b, out, alpha);
        const std::vector<double> x = test::to_doubles(a), y = test::to_doubles(b);
        std::vector<double> want(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) want[i] = x[i] + static_cast<double>(alpha) * y[i];
        EXPECT_TRUE(test::all_close(out, from_doubles(dt, {n}, want), one_ulp(dt)))
            << describe(dt, n) << " alpha=" << alpha;
      }
}

TEST(TrainAdd, InPlaceAndSelf) {
  const Context ctx = Context::cpu();
  std::uint64_t seed = 200;
  for (DType dt : kDTypes)
    for (std::int64_t n : kSizes) {
      const Tensor a = test::random_tensor(dt, {n}, ++seed), b = test::random_tensor(dt, {n}, ++seed);
      Tensor ref(dt, {n}), ref_self(dt, {n});
      add(ctx, a, b, ref, 0.75f);
      add(ctx, a, a, ref_self, -2.0f);
      Tensor x = test::host_copy(a);
      add(ctx, x, b, x, 0.75f);
      EXPECT_TRUE(test::bytes_equal(x, ref)) << "out = a, " << describe(dt, n);
      Tensor y = test::host_copy(b);
      add(ctx, a, y, y, 0.75f);
      EXPECT_TRUE(test::bytes_equal(y, ref)) << "out = b, " << describe(dt, n);
      Tensor z = test::host_copy(a);
      add(ctx, z, z, z, -2.0f);
      EXPECT_TRUE(test::bytes_equal(z, ref_self)) << "out = a = b, " << describe(dt, n);
    }
}

TEST(TrainAdd, Validation) {
  const Context ctx = Context::cpu();
  const Tensor a = test::random_tensor(DType::F32, {8, 8}, 1), b = test::random_tensor(DType::F32, {8, 8}, 2);
  const Tensor out = test::random_tensor(DType::F32, {8, 8}, 3), flat = test::random_tensor(DType::F32, {64}, 4);
  const Tensor b16 = test::random_tensor(DType::BF16, {8, 8}, 5), h16(DType::F16, {8, 8});
  EXPECT_TRUE(rejects([&] { add(ctx, a, flat, out); }, kShape, {"add: b", "[64]", "[8,8]"}, {out}));
  EXPECT_TRUE(rejects([&] { add(ctx, a, b, flat); }, kShape, {"add: out", "[64]"}, {flat}));
  EXPECT_TRUE(rejects([&] { add(ctx, a, b16, out); }, kDType, {"add: b", "bf16"}, {out}));
  EXPECT_TRUE(rejects([&] { add(ctx, a, b, b16); }, kDType, {"add: out", "bf16"}, {b16}));
  EXPECT_TRUE(rejects([&] { add(ctx, h16, h16, out); }, kDType, {"add: a", "f16"}, {out}));
  EXPECT_TRUE(rejects([&] { add(ctx, a, b, out, std::nanf("")); }, kInvalid, {"add: alpha", "nan"}, {out}));
  EXPECT_TRUE(rejects([&] { add(ctx, a, b, out, INFINITY); }, kInvalid, {"add: alpha", "inf"}, {out}));
  EXPECT_TRUE(rejects([&] { add(ctx, on_gpu(a), b, out); }, kDevice, {"add: a", "cuda:0"}, {out}));
  EXPECT_TRUE(rejects([&] { add(ctx, a, null_like(b), out); }, kInvalid, {"add: b", "null"}, {out}));
  const Tensor buf = test::random_tensor(DType::F32, {65}, 6);
  const TensorView lo = part(buf, 0, {8, 8}), hi = part(buf, 1, {8, 8});
  EXPECT_TRUE(rejects([&] { add(ctx, lo, b, hi); }, kInvalid, {"add: out and a", "overlap"}, {buf}));
  EXPECT_TRUE(rejects([&] { add(ctx, a, lo, hi); }, kInvalid, {"add: out and b", "overlap"}, {buf}));
}

// ---- add_bias -----------------------------------------------------------------------------------------------------

TEST(TrainAddBias, MatchesNaive) {
  const Context ctx = Context::cpu();
  struct Combo {
    DType y, bias;
  };
  const Combo combos[] = {{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}};
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1, 1},    {7, 63},  {65, 7}, {3, 1000},
                                                          {2, 4099}, {63, 65}, {4, 1}};
  std::uint64_t seed = 300;
  for (const Combo& c : combos)
    for (const auto& [rows, cols] : shapes) {
      const Tensor y0 = test::random_tensor(c.y, {rows, cols}, ++seed);
      const Tensor bias = test::random_tensor(c.bias, {cols}, ++seed, -4.0f, 4.0f);
      Tensor y = test::host_copy(y0);
      add_bias(ctx, y, bias);
      const std::vector<double> x = test::to_doubles(y0), b = test::to_doubles(bias);
      std::vector<double> want(x.size());
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < cols; ++j) {
          const auto i = static_cast<std::size_t>(r * cols + j);
          want[i] = x[i] + b[static_cast<std::size_t>(j)];
        }
      EXPECT_TRUE(test::all_close(y, from_doubles(c.y, {rows, cols}, want), one_ulp(c.y)))
          << dtype_name(c.y) << " y, " << dtype_name(c.bias) << " bias, " << rows << "x" << cols;
    }
}

TEST(TrainAddBias, Validation) {
  const Context ctx = Context::cpu();
  const Tensor y = test::random_tensor(DType::F32, {7, 64}, 1), bias = test::random_tensor(DType::F32, {64}, 2);
  const Tensor y1 = test::random_tensor(DType::F32, {64}, 3), y3 = test::random_tensor(DType::F32, {1, 7, 64}, 4);
  const Tensor bias2 = test::random_tensor(DType::F32, {1, 64}, 5), bias65 = test::random_tensor(DType::F32, {65}, 6);
  const Tensor bias16 = test::random_tensor(DType::BF16, {64}, 7), yh(DType::F16, {7, 64});
  const Tensor y16 = test::random_tensor(DType::BF16, {7, 64}, 8), bias_h(DType::F16, {64});
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y1, bias); }, kShape, {"add_bias: y", "rank 2", "[64]"}, {y1}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y3, bias); }, kShape, {"add_bias: y", "rank 2", "[1,7,64]"}, {y3}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y, bias2); }, kShape, {"add_bias: bias", "rank 1"}, {y}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y, bias65); }, kShape, {"add_bias: bias is [65] but y is [7,64]"}, {y}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y, bias16); }, kDType, {"add_bias: bias", "bf16", "f32"}, {y}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y16, bias_h); }, kDType, {"add_bias: bias", "f16"}, {y16}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, yh, bias); }, kDType, {"add_bias: y", "f16"}, {yh}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, on_gpu(y), bias); }, kDevice, {"add_bias: y", "cuda:0"}, {y}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y, on_gpu(bias)); }, kDevice, {"add_bias: bias", "cuda:0"}, {y}));
  EXPECT_TRUE(rejects([&] { add_bias(ctx, y, null_like(bias)); }, kInvalid, {"add_bias: bias", "null"}, {y}));
  const Tensor buf = test::random_tensor(DType::F32, {8 * 64}, 9);
  EXPECT_TRUE(rejects(
      [&] {
        add_bias(ctx, part(buf, 0, {7, 64}), part(buf, 7 * 64 - 1, {64}));
      },
      kInvalid, {"add_bias: y and bias", "overlap"}, {buf}));
}

// ---- dropout ------------------------------------------------------------------------------------------------------

TEST(TrainDropout, MatchesMaskDefinition) {
  // Kept elements are x times the fp32 scale 1/(1-p), rounded once; dropped ones are +0.
  const Context ctx = Context::cpu();
  std::uint64_t seed = 400;
  for (DType dt : kDTypes)
    for (std::int64_t n : kSizes)
      for (float p : {0.1f, 0.5f, 0.875f}) {
        const Tensor x = test::random_tensor(dt, {n}, ++seed);
        Tensor out(dt, {n});
        test::poison(out);
        const std::uint64_t mask_seed = 0xC0FFEE + seed;
        dropout(ctx, x, out, p, mask_seed);
        const double scale = 1.0f / (1.0f - p);
        const std::vector<double> v = test::to_doubles(x);
        std::vector<double> want(v.size());
        for (std::size_t i = 0; i < v.size(); ++i)
          want[i] = dropout_keep(mask_seed, static_cast<std::int64_t>(i), p) ? v[i] * scale : 0.0;
        EXPECT_TRUE(test::bytes_equal(out, from_doubles(dt, {n}, want))) << describe(dt, n) << " p=" << p;
      }
}

TEST(TrainDropout, MaskStatistics) {
  // The mask of all-ones input is visible directly: out != 0 exactly where dropout_keep says so. Its statistics:
  // the kept fraction (overall, on even and on odd indices: the two halves of one hash), neighbours kept together,
  // and agreement with the mask of the next seed, each within 5 standard deviations of independent draws.
  const Context ctx = Context::cpu();
  const std::int64_t n = 200003;
  const Tensor ones = test::filled(DType::F32, {n}, 1.0f);
  for (float p : {0.1f, 0.5f, 0.9f}) {
    const std::uint64_t seed = 1234;
    Tensor out(DType::F32, {n}), next(DType::F32, {n});
    dropout(ctx, ones, out, p, seed);
    dropout(ctx, ones, next, p, seed + 1);
    std::int64_t kept = 0, kept_even = 0, both_adjacent = 0, agree = 0, mismatches = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const bool k = out.data_as<float>()[i] != 0.0f;
      mismatches += k != dropout_keep(seed, i, p);
      kept += k;
      kept_even += k && i % 2 == 0;
      if (i + 1 < n) both_adjacent += k && out.data_as<float>()[i + 1] != 0.0f;
      agree += k == (next.data_as<float>()[i] != 0.0f);
    }
    EXPECT_EQ(mismatches, 0) << "p=" << p;
    const double q = 1.0 - p;
    auto within = [](double count, double trials, double prob) {
      const double sd = std::sqrt(trials * prob * (1.0 - prob));
      return std::fabs(count - trials * prob) <= 5.0 * sd;
    };
    const double halfn = static_cast<double>((n + 1) / 2);
    EXPECT_TRUE(within(static_cast<double>(kept), static_cast<double>(n), q)) << "kept " << kept << " p=" << p;
    EXPECT_TRUE(within(static_cast<double>(kept_even), halfn, q)) << "kept on even indices, p=" << p;
    EXPECT_TRUE(within(static_cast<double>(kept - kept_even), static_cast<double>(n) - halfn, q)) << "odd, p=" << p;
    // Adjacent pairs overlap, so their count varies a little more than independent trials; 5 sd still bounds it.
    EXPECT_TRUE(within(static_cast<double>(both_adjacent), static_cast<double>(n - 1), q * q)) << "pairs, p=" << p;
    EXPECT_TRUE(within(static_cast<double>(agree), static_cast<double>(n), q * q + p * p)) << "seed+1, p=" << p;
  }
}

TEST(TrainDropout, DeterministicInPlaceAndZeroP) {
  const Context ctx = Context::cpu();
  std::uint64_t seed = 500;
  for (DType dt : kDTypes)
    for (std::int64_t n : kSizes) {
      const Tensor x = test::random_tensor(dt, {n}, ++seed);
      Tensor a(dt, {n}), b(dt, {n});
      dropout(ctx, x, a, 0.3f, 77);
      dropout(ctx, x, b, 0.3f, 77);
      EXPECT_TRUE(test::bytes_equal(a, b)) << "same seed twice, " << describe(dt, n);
      Tensor y = test::host_copy(x);
      dropout(ctx, y, y, 0.3f, 77);
      EXPECT_TRUE(test::bytes_equal(y, a)) << "in place, " << describe(dt, n);
      Tensor c(dt, {n});
      test::poison(c);
      dropout(ctx, x, c, 0.0f, 77);
      EXPECT_TRUE(test::bytes_equal(c, x)) << "p = 0 copies, " << describe(dt, n);
    }
  // Backward re-applies the forward's mask: the gradient is zero exactly where the activation was dropped.
  const std::int64_t n = 4099;
  const Tensor x = test::random_tensor(DType::F32, {n}, 9, 0.5f, 1.0f),
               g = test::random_tensor(DType::F32, {n}, 10, 0.5f, 1.0f);
  Tensor fx(DType::F32, {n}), fg(DType::F32, {n});
  dropout(ctx, x, fx, 0.5f, 4242);
  dropout(ctx, g, fg, 0.5f, 4242);
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < n; ++i) differ += (fx.data_as<float>()[i] == 0.0f) != (fg.data_as<float>()[i] == 0.0f);
  EXPECT_EQ(differ, 0);
}

TEST(TrainDropout, Validation) {
  const Context ctx = Context::cpu();
  const Tensor x = test::random_tensor(DType::F32, {64}, 1), out = test::random_tensor(DType::F32, {64}, 2);
  const Tensor out63 = test::random_tensor(DType::F32, {63}, 3), out16 = test::random_tensor(DType::BF16, {64}, 4);
  EXPECT_TRUE(rejects([&] { dropout(ctx, x, out, 1.0f, 1); }, kInvalid, {"dropout: p", "1", "[0, 1)"}, {out}));
  EXPECT_TRUE(rejects([&] { dropout(ctx, x, out, -0.25f, 1); }, kInvalid, {"dropout: p", "-0.25"}, {out}));
  EXPECT_TRUE(rejects([&] { dropout(ctx, x, out, std::nanf(""), 1); }, kInvalid, {"dropout: p", "nan"}, {out}));
  EXPECT_TRUE(rejects([&] { dropout(ctx, x, out63, 0.5f, 1); }, kShape, {"dropout: out", "[63]"}, {out63}));
  EXPECT_TRUE(rejects([&] { dropout(ctx, x, out16, 0.5f, 1); }, kDType, {"dropout: out", "bf16"}, {out16}));
  EXPECT_TRUE(rejects([&] { dropout(ctx, on_gpu(x), out, 0.5f, 1); }, kDevice, {"dropout: x", "cuda:0"}, {out}));
  EXPECT_TRUE(rejects([&] { dropout(ctx, null_like(x), out, 0.5f, 1); }, kInvalid, {"dropout: x", "null"}, {out}));
  const Tensor buf = test::random_tensor(DType::F32, {65}, 5);
  EXPECT_TRUE(rejects([&] { dropout(ctx, part(buf, 1, {64}), part(buf, 0, {64}), 0.5f, 1); }, kInvalid,
                      {"dropout: out and x", "overlap"}, {buf}));
  EXPECT_TRUE(test::throws_error([] { dropout_keep(1, 0, 1.0f); }, kInvalid, {"dropout_keep: p"}));
  EXPECT_TRUE(test::throws_error([] { dropout_keep(1, -1, 0.5f); }, kInvalid, {"dropout_keep: index", "-1"}));
}

// ---- mse_loss -----------------------------------------------------------------------------------------------------

TEST(TrainMseLoss, MatchesNaive) {
  const Context ctx = Context::cpu();
  std::uint64_t seed = 600;
  for (DType dt : kDTypes)
    for (std::int64_t n : kSizes)
      for (float scale : {1.0f, 0.125f}) {
        const Tensor y = test::random_tensor(dt, {n}, ++seed, -2.0f, 2.0f), t = test::random_tensor(dt, {n}, ++seed);
        Tensor loss(DType::F32, {1}), dy(dt, {n});
        test::poison(loss);
        test::poison(dy);
        mse_loss(ctx, y, t, loss, dy, scale);
        const std::vector<double> a = test::to_doubles(y), b = test::to_doubles(t);
        double sum = 0;
        std::vector<double> grad(a.size());
        for (std::size_t i = 0; i < a.size(); ++i) {
          sum += (a[i] - b[i]) * (a[i] - b[i]);
          grad[i] = scale * 2.0 * (a[i] - b[i]) / static_cast<double>(n);
        }
        // fp64 sums in another order differ far below fp32's resolution: the loss agrees to one fp32 rounding.
        const double want = sum / static_cast<double>(n);
        EXPECT_NEAR(loss.data_as<float>()[0], want, 1.2e-7 * want) << describe(dt, n);
        EXPECT_TRUE(test::all_close(dy, from_doubles(dt, {n}, grad), one_ulp(dt)))
            << describe(dt, n) << " scale=" << scale;
      }
}

TEST(TrainMseLoss, InPlaceGradientAndRank) {
  const Context ctx = Context::cpu();
  for (DType dt : kDTypes) {
    const Shape s{3, 7, 65};
    const Tensor y = test::random_tensor(dt, s, 1), t = test::random_tensor(dt, s, 2);
    Tensor loss(DType::F32, {}), dy(dt, s);  // a rank-0 loss holds its one element
    mse_loss(ctx, y, t, loss, dy);
    Tensor y2 = test::host_copy(y), loss2(DType::F32, {1, 1});
    mse_loss(ctx, y2, t, loss2, y2);
    EXPECT_TRUE(test::bytes_equal(y2, dy)) << "dy = y, " << dtype_name(dt);
    EXPECT_EQ(loss2.data_as<float>()[0], loss.data_as<float>()[0]) << dtype_name(dt);
    Tensor t2 = test::host_copy(t);
    mse_loss(ctx, y, t2, loss2, t2);
    EXPECT_TRUE(test::bytes_equal(t2, dy)) << "dy = target, " << dtype_name(dt);
  }
}

TEST(TrainMseLoss, Validation) {
  const Context ctx = Context::cpu();
  const Tensor y = test::random_tensor(DType::F32, {64}, 1), t = test::random_tensor(DType::F32, {64}, 2);
  const Tensor loss = test::random_tensor(DType::F32, {1}, 3), dy = test::random_tensor(DType::F32, {64}, 4);
  const Tensor t63 = test::random_tensor(DType::F32, {63}, 5), dy16 = test::random_tensor(DType::BF16, {64}, 6);
  const Tensor loss16 = test::random_tensor(DType::BF16, {1}, 7), loss2 = test::random_tensor(DType::F32, {2}, 8);
  const Tensor empty(DType::F32, {0});
  const char* op = "mse_loss";
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, y, t63, loss, dy); }, kShape, {op, "target", "[63]"}, {loss, dy}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, y, t, loss, dy16); }, kDType, {op, "dy", "bf16"}, {loss, dy16}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, y, t, loss16, dy); }, kDType, {op, "loss", "bf16"}, {loss16, dy}));
  EXPECT_TRUE(
      rejects([&] { mse_loss(ctx, y, t, loss2, dy); }, kShape, {op, "loss", "one element", "[2]"}, {loss2, dy}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, empty, empty, loss, empty); }, kInvalid, {op, "y", "[0]"}, {loss}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, y, t, loss, dy, INFINITY); }, kInvalid, {op, "scale", "inf"}, {loss, dy}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, y, t, on_gpu(loss), dy); }, kDevice, {op, "loss", "cuda:0"}, {loss, dy}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, y, t, null_like(loss), dy); }, kInvalid, {op, "loss", "null"}, {dy}));
  const Tensor buf = test::random_tensor(DType::F32, {66}, 9);
  const TensorView lo = part(buf, 0, {64}), hi = part(buf, 1, {64});
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, lo, t, loss, hi); }, kInvalid, {op, "dy and y", "overlap"}, {buf, loss}));
  EXPECT_TRUE(
      rejects([&] { mse_loss(ctx, y, lo, loss, hi); }, kInvalid, {op, "dy and target", "overlap"}, {buf, loss}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, lo, t, part(buf, 63, {1}), dy); }, kInvalid, {op, "loss and y", "overlap"},
                      {buf, dy}));
  EXPECT_TRUE(rejects([&] { mse_loss(ctx, y, lo, part(buf, 10, {1}), dy); }, kInvalid,
                      {op, "loss and target", "overlap"}, {buf, dy}));
  EXPECT_TRUE(
      rejects([&] { mse_loss(ctx, y, t, part(buf, 10, {1}), lo); }, kInvalid, {op, "loss and dy", "overlap"}, {buf}));
}

// ---- grad_norm ----------------------------------------------------------------------------------------------------

double naive_norm(const std::vector<Tensor>& grads) {
  double s = 0;
  for (const Tensor& g : grads)
    for (double x : test::to_doubles(g)) s += x * x;
  return std::sqrt(s);
}

std::vector<Tensor> ragged_grads(std::uint64_t seed, bool mixed_dtypes) {
  std::vector<Tensor> grads;
  for (std::int64_t n : kSizes) {
    const DType dt = mixed_dtypes && n % 2 == 1 && n > 7 ? DType::BF16 : DType::F32;
    grads.push_back(test::random_tensor(dt, {n}, seed + static_cast<std::uint64_t>(n), -0.1f, 0.1f));
  }
  grads.emplace_back(DType::F32, Shape{0});  // an empty tensor contributes nothing
  grads.push_back(test::random_tensor(DType::F32, {16, 65}, seed + 7));
  return grads;
}

TEST(TrainGradNorm, MatchesNaive) {
  const Context ctx = Context::cpu();
  for (bool mixed : {false, true}) {
    const std::vector<Tensor> grads = ragged_grads(700, mixed);
    const std::vector<TensorView> views(grads.begin(), grads.end());
    Tensor norm(DType::F32, {1});
    test::poison(norm);
    grad_norm(ctx, views, norm);
    const double want = naive_norm(grads);
    EXPECT_NEAR(norm.data_as<float>()[0], want, 1.2e-7 * want) << (mixed ? "mixed dtypes" : "f32");
    for (const Tensor& g : grads) {  // one tensor alone
      const TensorView one[] = {g};
      grad_norm(ctx, one, norm);
      const double w = naive_norm({g});
      EXPECT_NEAR(norm.data_as<float>()[0], w, 1.2e-7 * w) << g.view().str();
    }
  }
}

TEST(TrainGradNorm, SameResultForAnyThreadCount) {
  // The fp64 sum runs over fixed chunks in a fixed order, so one thread and two give the same bits.
  const Context ctx = Context::cpu();
  const Tensor g = test::random_tensor(DType::F32, {300007}, 71);
  const TensorView views[] = {g};
  Tensor one(DType::F32, {1}), two(DType::F32, {1});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  grad_norm(ctx, views, one);
  omp_set_num_threads(2);
  grad_norm(ctx, views, two);
  omp_set_num_threads(saved);
  EXPECT_TRUE(test::bytes_equal(one, two));
}

TEST(TrainGradNorm, Validation) {
  const Context ctx = Context::cpu();
  const Tensor g0 = test::random_tensor(DType::F32, {64}, 1), g1 = test::random_tensor(DType::BF16, {7}, 2);
  const Tensor h16(DType::F16, {5}), norm = test::random_tensor(DType::F32, {1}, 3);
  const Tensor norm2 = test::random_tensor(DType::F32, {2}, 4), norm16 = test::random_tensor(DType::BF16, {1}, 5);
  const char* op = "grad_norm";
  const std::vector<TensorView> ok = {g0, g1};
  EXPECT_TRUE(rejects([&] { grad_norm(ctx, {}, norm); }, kInvalid, {op, "grads is empty"}, {norm}));
  const std::vector<TensorView> bad_dtype = {g0, g1, h16};
  EXPECT_TRUE(rejects([&] { grad_norm(ctx, bad_dtype, norm); }, kDType, {op, "grads[2]", "f16"}, {norm}));
  const std::vector<TensorView> bad_null = {g0, null_like(g1)};
  EXPECT_TRUE(rejects([&] { grad_norm(ctx, bad_null, norm); }, kInvalid, {op, "grads[1]", "null"}, {norm}));
  const std::vector<TensorView> bad_device = {g0, on_gpu(g1)};
  EXPECT_TRUE(rejects([&] { grad_norm(ctx, bad_device, norm); }, kDevice, {op, "grads[1]", "cuda:0"}, {norm}));
  EXPECT_TRUE(rejects([&] { grad_norm(ctx, ok, norm2); }, kShape, {op, "norm", "one element"}, {norm2}));
  EXPECT_TRUE(rejects([&] { grad_norm(ctx, ok, norm16); }, kDType, {op, "norm", "bf16"}, {norm16}));
  EXPECT_TRUE(rejects([&] { grad_norm(ctx, ok, on_gpu(norm)); }, kDevice, {op, "norm", "cuda:0"}, {norm}));
  const Tensor buf = test::random_tensor(DType::F32, {64}, 6);
  const std::vector<TensorView> over = {g0, buf};
  EXPECT_TRUE(
      rejects([&] { grad_norm(ctx, over, part(buf, 5, {1})); }, kInvalid, {op, "norm and grads[1]", "overlap"}, {buf}));
}

// ---- adamw_step ---------------------------------------------------------------------------------------------------

// One tensor's optimizer state as tensors (for the library) and the hand-written reference's copy.
struct Slot {
  Tensor param, grad, m, v;
  std::vector<double> ref_p, ref_m, ref_v;  // held at fp32 precision, like the library's storage
};

std::vector<Slot> make_slots(std::uint64_t seed, bool warm_moments) {
  std::vector<Slot> slots;
  std::vector<Shape> shapes;
  for (std::int64_t n : kSizes) shapes.push_back(Shape{n});
  shapes.push_back(Shape{16, 65});
  for (const Shape& s : shapes) {
    Slot sl;
    sl.param = test::random_tensor(DType::F32, s, ++seed);
    sl.grad = Tensor(DType::F32, s);
    sl.m = warm_moments ? test::random_tensor(DType::F32, s, ++seed, -0.01f, 0.01f) : test::filled(DType::F32, s, 0.0f);
    sl.v = warm_moments ? test::random_tensor(DType::F32, s, ++seed, 0.0f, 1e-4f) : test::filled(DType::F32, s, 0.0f);
    sl.ref_p = test::to_doubles(sl.param);
    sl.ref_m = test::to_doubles(sl.m);
    sl.ref_v = test::to_doubles(sl.v);
    slots.push_back(std::move(sl));
  }
  return slots;
}

// AdamW as torch.optim.AdamW writes it (decay by a factor, the update by addcdiv with sqrt(bc2) pulled out), in
// double, rounding the state to fp32 after each step as fp32 storage does. Returns the norm before clipping.
double reference_adamw(std::vector<Slot>& slots, const AdamWOptions& o, int step) {
  double ss = 0;
  for (const Slot& s : slots)
    for (double g : test::to_doubles(s.grad)) ss += g * g;
  const double norm = std::sqrt(ss);
  double clip = 1.0;
  if (o.max_grad_norm > 0) clip = std::min(1.0, o.max_grad_norm / (norm + 1e-6));
  const double bc1 = 1.0 - std::pow(static_cast<double>(o.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(o.beta2), step);
  const double lr = o.lr, b1 = o.beta1, b2 = o.beta2;
  for (Slot& s : slots) {
    const std::vector<double> g = test::to_doubles(s.grad);
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double gi = g[i] * clip;
      double p = s.ref_p[i] * (1.0 - lr * o.weight_decay);
      const double m = b1 * s.ref_m[i] + (1.0 - b1) * gi;
      const double v = b2 * s.ref_v[i] + (1.0 - b2) * gi * gi;
      const double denom = std::sqrt(v) / std::sqrt(bc2) + o.eps;
      p -= (lr / bc1) * m / denom;
      s.ref_p[i] = static_cast<float>(p);
      s.ref_m[i] = static_cast<float>(m);
      s.ref_v[i] = static_cast<float>(v);
    }
  }
  return norm;
}

// Library vs reference after several steps: both compute in double and store fp32, so each step may leave them a
// rounding apart (2^-24 relative), and the clip factor (fp32 in the library) another 2^-24; a few steps stay well
// within 1e-6 relative. m can cancel to near zero (b1*m and (1-b1)*g of opposite signs), where the clip factor's
// 2^-24 difference leaves an absolute error of about 2^-24 * |g| (|g| <= 0.05 here): hence m's atol of 1e-8.
void expect_state_matches(const std::vector<Slot>& slots, const std::string& what) {
  for (std::size_t k = 0; k < slots.size(); ++k) {
    const Slot& s = slots[k];
    const Shape sh = s.param.shape();
    const std::string at = what + " slot " + std::to_string(k) + " " + sh.str();
    EXPECT_TRUE(test::all_close(s.param, from_doubles(DType::F32, sh, s.ref_p), {1e-9, 1e-6, 1e-6})) << at << " param";
    EXPECT_TRUE(test::all_close(s.m, from_doubles(DType::F32, sh, s.ref_m), {1e-8, 1e-6, 1e-6})) << at << " m";
    EXPECT_TRUE(test::all_close(s.v, from_doubles(DType::F32, sh, s.ref_v), {1e-14, 1e-6, 1e-6})) << at << " v";
  }
}

std::vector<AdamWParam> params_of(const std::vector<Slot>& slots) {
  std::vector<AdamWParam> ps;
  for (const Slot& s : slots) ps.push_back({s.param, s.grad, s.m, s.v});
  return ps;
}

void fill_grads(std::vector<Slot>& slots, std::uint64_t seed) {
  for (Slot& s : slots) {
    const Tensor g = test::random_tensor(DType::F32, s.grad.shape(), ++seed, -0.05f, 0.05f);
    std::memcpy(s.grad.data(), g.data(), g.nbytes());
  }
}

TEST(TrainAdamW, MatchesHandWrittenAdamWOverSeveralSteps) {
  const Context ctx = Context::cpu();
  // The gradients' norm is about 0.05/sqrt(3) * sqrt(7258) ~ 1.4: max_grad_norm 0.5 clips every step, 10 never does.
  struct Config {
    const char* name;
    AdamWOptions opts;
    bool warm;  // moments carried over from earlier steps
    int first_step;
    bool want_norm;
  };
  const Config configs[] = {
      {"plain", {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0.0f}, false, 1, false},
      {"decay + clipping active", {2e-3f, 0.9f, 0.95f, 1e-6f, 0.1f, 0.5f}, false, 1, true},
      {"decay + clipping inactive", {1e-3f, 0.8f, 0.99f, 1e-8f, 0.01f, 10.0f}, true, 11, true},
      {"norm only", {5e-4f, 0.9f, 0.999f, 1e-8f, 0.05f, 0.0f}, true, 3, true},
  };
  std::uint64_t seed = 800;
  for (const Config& c : configs) {
    std::vector<Slot> slots = make_slots(seed += 50, c.warm);
    const std::vector<AdamWParam> ps = params_of(slots);
    for (int step = c.first_step; step < c.first_step + 4; ++step) {
      fill_grads(slots, seed += 20);
      std::vector<Tensor> grads_before;
      for (const Slot& s : slots) grads_before.push_back(test::host_copy(s.grad));
      Tensor norm(DType::F32, {1});
      test::poison(norm);
      adamw_step(ctx, ps, c.opts, step, c.want_norm ? norm.view() : TensorView());
      const double want_norm = reference_adamw(slots, c.opts, step);
      const std::string what = std::string(c.name) + " step " + std::to_string(step);
      if (c.want_norm) EXPECT_NEAR(norm.data_as<float>()[0], want_norm, 1.2e-7 * want_norm) << what;
      if (c.opts.max_grad_norm > 0)
        EXPECT_EQ(want_norm > c.opts.max_grad_norm, c.opts.max_grad_norm < 1.0f) << what << ": clipping as intended";
      for (std::size_t k = 0; k < slots.size(); ++k)
        EXPECT_TRUE(test::bytes_equal(slots[k].grad, grads_before[k])) << what << ": gradients are left unchanged";
      expect_state_matches(slots, what);
    }
  }
}

TEST(TrainAdamW, InactiveClippingChangesNothing) {
  // With the norm below max_grad_norm the coefficient is exactly 1: the same bytes as without clipping.
  const Context ctx = Context::cpu();
  std::vector<Slot> a = make_slots(900, true), b = make_slots(900, true);
  fill_grads(a, 950);
  fill_grads(b, 950);
  AdamWOptions o{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 0.0f};
  adamw_step(ctx, params_of(a), o, 5);
  o.max_grad_norm = 100.0f;
  adamw_step(ctx, params_of(b), o, 5);
  for (std::size_t k = 0; k < a.size(); ++k) {
    EXPECT_TRUE(test::bytes_equal(a[k].param, b[k].param)) << k;
    EXPECT_TRUE(test::bytes_equal(a[k].m, b[k].m)) << k;
    EXPECT_TRUE(test::bytes_equal(a[k].v, b[k].v)) << k;
  }
}

TEST(TrainAdamW, SharedGradientIsAllowed) {
  // Two parameters reading one gradient buffer: only written tensors must be disjoint.
  const Context ctx = Context::cpu();
  const Tensor g = test::random_tensor(DType::F32, {33}, 1);
  Tensor p1 = test::random_tensor(DType::F32, {33}, 2), p2 = test::host_copy(p1);
  Tensor m1 = test::filled(DType::F32, {33}, 0), v1 = test::filled(DType::F32, {33}, 0);
  Tensor m2 = test::filled(DType::F32, {33}, 0), v2 = test::filled(DType::F32, {33}, 0);
  const AdamWParam ps[] = {{p1, g, m1, v1}, {p2, g, m2, v2}};
  ASSERT_NO_THROW(adamw_step(ctx, ps, {}, 1));
  EXPECT_TRUE(test::bytes_equal(p1, p2));
}

TEST(TrainAdamW, Validation) {
  const Context ctx = Context::cpu();
  std::vector<Slot> slots = make_slots(1000, true);
  std::vector<AdamWParam> ps = params_of(slots);
  Tensor norm = test::random_tensor(DType::F32, {1}, 1);
  // Every tensor the step could write, plus the norm, must come through each rejected call untouched.
  auto outputs = [&] {
    std::vector<Tensor> snap;
    for (const Slot& s : slots)
      for (const Tensor* t : {&s.param, &s.m, &s.v, &s.grad}) snap.push_back(test::host_copy(*t));
    snap.push_back(test::host_copy(norm));
    return snap;
  };
  const std::vector<Tensor> before = outputs();
  auto expect = [&](const char* what, auto&& fn, ErrorCode code, std::initializer_list<std::string> needles) {
    EXPECT_TRUE(test::throws_error(fn, code, needles)) << what;
    const std::vector<Tensor> after = outputs();
    for (std::size_t i = 0; i < after.size(); ++i)
      EXPECT_TRUE(test::bytes_equal(after[i], before[i])) << what << " " << i;
  };
  const char* op = "adamw_step";
  const AdamWOptions good{};
  auto with = [&](auto change) {
    AdamWOptions o = good;
    change(o);
    return o;
  };
  expect("empty", [&] { adamw_step(ctx, {}, good, 1); }, kInvalid, {op, "params is empty"});
  expect("step 0", [&] { adamw_step(ctx, ps, good, 0); }, kInvalid, {op, "step is 0"});
  expect("step -3", [&] { adamw_step(ctx, ps, good, -3); }, kInvalid, {op, "step is -3"});
  expect("lr nan", [&] { adamw_step(ctx, ps, with([](auto& o) { o.lr = NAN; }), 1); }, kInvalid,
         {op, "opts.lr", "nan"});
  expect("lr < 0", [&] { adamw_step(ctx, ps, with([](auto& o) { o.lr = -1e-3f; }), 1); }, kInvalid, {op, "opts.lr"});
  expect("beta1 1", [&] { adamw_step(ctx, ps, with([](auto& o) { o.beta1 = 1.0f; }), 1); }, kInvalid,
         {op, "opts.beta1 is 1", "[0, 1)"});
  expect("beta2 < 0", [&] { adamw_step(ctx, ps, with([](auto& o) { o.beta2 = -0.5f; }), 1); }, kInvalid,
         {op, "opts.beta2 is -0.5"});
  expect("eps < 0", [&] { adamw_step(ctx, ps, with([](auto& o) { o.eps = -1e-8f; }), 1); }, kInvalid, {op, "opts.eps"});
  expect("eps inf", [&] { adamw_step(ctx, ps, with([](auto& o) { o.eps = INFINITY; }), 1); }, kInvalid,
         {op, "opts.eps", "inf"});
  expect("wd < 0", [&] { adamw_step(ctx, ps, with([](auto& o) { o.weight_decay = -0.1f; }), 1); }, kInvalid,
         {op, "opts.weight_decay"});
  expect("clip < 0", [&] { adamw_step(ctx, ps, with([](auto& o) { o.max_grad_norm = -1.0f; }), 1); }, kInvalid,
         {op, "opts.max_grad_norm"});
  expect("clip nan", [&] { adamw_step(ctx, ps, with([](auto& o) { o.max_grad_norm = NAN; }), 1); }, kInvalid,
         {op, "opts.max_grad_norm", "nan"});

  // Per-tensor fields: the message names params[i].field.
  Tensor p_wide = test::random_tensor(DType::F32, {16, 65}, 2), m_narrow = test::random_tensor(DType::F32, {16, 64}, 3);
  {
    std::vector<AdamWParam> bad = ps;
    bad[2] = {p_wide, test::random_tensor(DType::F32, {16, 65}, 4), m_narrow,
              test::random_tensor(DType::F32, {16, 65}, 5)};
    expect("m shape", [&] { adamw_step(ctx, bad, good, 1); }, kShape,
           {"adamw_step: params[2].m is [16,64] but params[2].param is [16,65]"});
  }
  const Tensor v16 = test::random_tensor(DType::BF16, slots[1].v.shape(), 6);
  auto replaced = [&](std::size_t i, int f, const TensorView& t) {
    std::vector<AdamWParam> bad = ps;
    TensorView* fields[] = {&bad[i].param, &bad[i].grad, &bad[i].m, &bad[i].v};
    *fields[f] = t;
    return bad;
  };
  expect("v bf16", [&] { adamw_step(ctx, replaced(1, 3, v16), good, 1); }, kDType, {op, "params[1].v", "bf16"});
  expect("grad null", [&] { adamw_step(ctx, replaced(0, 1, null_like(slots[0].grad)), good, 1); }, kInvalid,
         {op, "params[0].grad", "null"});
  expect("param device", [&] { adamw_step(ctx, replaced(3, 0, on_gpu(slots[3].param)), good, 1); }, kDevice,
         {op, "params[3].param", "cuda:0"});
  expect("grad shape", [&] { adamw_step(ctx, replaced(4, 1, slots[5].grad), good, 1); }, kShape,
         {op, "params[4].grad", "params[4].param"});

  // Aliasing among written tensors, and of a gradient with a written tensor.
  std::vector<Slot> twins = make_slots(1100, true);
  std::vector<AdamWParam> tw = params_of(twins);
  tw[1].m = tw[1].v;  // two moments in one buffer
  expect("m = v", [&] { adamw_step(ctx, tw, good, 1); }, kInvalid, {op, "params[1].m", "params[1].v", "overlap"});
  tw = params_of(twins);
  tw[0].grad = tw[0].param;
  expect("grad = param", [&] { adamw_step(ctx, tw, good, 1); }, kInvalid,
         {op, "params[0].grad", "params[0].param", "overlap"});
  tw = params_of(twins);
  tw[5].param = TensorView(twins[5].m.data_as<float>() + 1, DType::F32, twins[5].param.shape());  // one into m
  expect("param inside m", [&] { adamw_step(ctx, tw, good, 1); }, kInvalid,
         {op, "params[5].param", "params[5].m", "overlap"});

  // The norm output.
  const Tensor norm2 = test::random_tensor(DType::F32, {2}, 7), norm16 = test::random_tensor(DType::BF16, {1}, 8);
  expect("norm 2", [&] { adamw_step(ctx, ps, good, 1, norm2); }, kShape, {op, "norm", "one element"});
  expect("norm bf16", [&] { adamw_step(ctx, ps, good, 1, norm16); }, kDType, {op, "norm", "bf16"});
  expect("norm device", [&] { adamw_step(ctx, ps, good, 1, on_gpu(norm)); }, kDevice, {op, "norm", "cuda:0"});
  const TensorView norm_in_v(slots[4].v.data_as<float>() + 3, DType::F32, {1});
  expect("norm in v", [&] { adamw_step(ctx, ps, good, 1, norm_in_v); }, kInvalid,
         {op, "norm", "params[4].v", "overlap"});
  const TensorView norm_in_grad(slots[4].grad.data_as<float>() + 3, DType::F32, {1});
  expect("norm in grad", [&] { adamw_step(ctx, ps, good, 1, norm_in_grad); }, kInvalid,
         {op, "norm", "params[4].grad", "overlap"});
}

// ---- zero ---------------------------------------------------------------------------------------------------------

TEST(TrainZero, EveryDTypeAndSize) {
  const Context ctx = Context::cpu();
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::U8})
    for (std::int64_t n : kSizes) {
      Tensor t(dt, {n});
      test::poison(t);
      zero(ctx, t);
      std::int64_t nonzero = 0;
      for (std::size_t i = 0; i < t.nbytes(); ++i) nonzero += t.data_as<std::uint8_t>()[i] != 0;
      EXPECT_EQ(nonzero, 0) << describe(dt, n);
    }
  Tensor scalar(DType::F32, {});
  test::poison(scalar);
  zero(ctx, scalar);
  EXPECT_EQ(scalar.data_as<float>()[0], 0.0f);
  EXPECT_NO_THROW(zero(ctx, Tensor(DType::F32, {0})));
}

TEST(TrainZero, Validation) {
  const Context ctx = Context::cpu();
  const Tensor t = test::random_tensor(DType::F32, {9}, 1);
  EXPECT_TRUE(rejects([&] { zero(ctx, null_like(t)); }, kInvalid, {"zero: t", "null"}, {t}));
  EXPECT_TRUE(rejects([&] { zero(ctx, on_gpu(t)); }, kDevice, {"zero: t", "cuda:0"}, {t}));
}

TEST(TrainOps, EmptyTensorsAreANoOp) {
  const Context ctx = Context::cpu();
  const Tensor e(DType::F32, {0}), e16(DType::BF16, {0}), y(DType::F32, {0, 5}),
      b = test::random_tensor(DType::F32, {5}, 1);
  EXPECT_NO_THROW(cast(ctx, e, e16));
  EXPECT_NO_THROW(add(ctx, e, e, e));
  EXPECT_NO_THROW(add_bias(ctx, y, b));
  EXPECT_NO_THROW(dropout(ctx, e, e, 0.5f, 1));
  const AdamWParam ps[] = {{e, e, e, e}};
  Tensor norm(DType::F32, {1});
  test::poison(norm);
  EXPECT_NO_THROW(adamw_step(ctx, ps, {}, 1, norm));
  EXPECT_EQ(norm.data_as<float>()[0], 0.0f);
}

}  // namespace

// ---- linear_cross_entropy -----------------------------------------------------------------------------------------

namespace {

struct CeReference {
  double loss = 0;
  std::vector<double> dh, dw;  // of the mean loss
};

// The loss and its gradients from the definition, written independently of the backend: softmax as exp(z) / Σ exp(z)
// over logits shifted by their row maximum, the gradient of each term, then the mean. bf16 inputs: the logits are
// rounded to bf16 (the op's contract), the rounding passed through as the identity in the gradients.
CeReference ce_reference(const Tensor& h, const Tensor& w, const std::vector<std::int32_t>& labels,
                         std::int32_t ignore) {
  const std::int64_t t = h.dim(0), hid = h.dim(1), vocab = w.dim(0);
  auto val = [](const Tensor& x, std::int64_t i) { return test::get_value(x, i); };
  CeReference r;
  r.dh.assign(static_cast<std::size_t>(t * hid), 0.0);
  r.dw.assign(static_cast<std::size_t>(vocab * hid), 0.0);
  std::int64_t n = 0;
  for (std::int32_t l : labels) n += l != ignore;
  for (std::int64_t i = 0; i < t; ++i) {
    if (labels[static_cast<std::size_t>(i)] == ignore) continue;
    std::vector<double> z(static_cast<std::size_t>(vocab));
    for (std::int64_t v = 0; v < vocab; ++v)
      for (std::int64_t k = 0; k < hid; ++k)
        z[static_cast<std::size_t>(v)] += val(h, i * hid + k) * val(w, v * hid + k);
    if (h.dtype() == DType::BF16)
      for (double& zv : z) zv = bf16_to_float(float_to_bf16(static_cast<float>(zv)));
    const double m = *std::max_element(z.begin(), z.end());
    double s = 0;
    for (double zv : z) s += std::exp(zv - m);
    const std::int32_t y = labels[static_cast<std::size_t>(i)];
    r.loss += -(z[static_cast<std::size_t>(y)] - m - std::log(s)) / double(n);
    for (std::int64_t v = 0; v < vocab; ++v) {
      const double g = (std::exp(z[static_cast<std::size_t>(v)] - m) / s - (v == y)) / double(n);
      for (std::int64_t k = 0; k < hid; ++k) {
        r.dh[static_cast<std::size_t>(i * hid + k)] += g * val(w, v * hid + k);
        r.dw[static_cast<std::size_t>(v * hid + k)] += g * val(h, i * hid + k);
      }
    }
  }
  return r;
}

std::vector<std::int32_t> ce_labels(std::int64_t t, std::int64_t vocab, std::uint64_t seed, int ignore_every) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(t));
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::int64_t i = 0; i < t; ++i) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    out[static_cast<std::size_t>(i)] =
        ignore_every > 0 && i % ignore_every == 1
            ? -100
            : static_cast<std::int32_t>((x * 2685821657736338717ull) % static_cast<std::uint64_t>(vocab));
  }
  return out;
}

Tensor i32_tensor(const std::vector<std::int32_t>& v) {
  Tensor t(DType::I32, {static_cast<std::int64_t>(v.size())});
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(std::int32_t));
  return t;
}

}  // namespace

TEST(TrainLinearCrossEntropy, MatchesDefinitionOnRaggedShapes) {
  const Context& ctx = Context::cpu();
  std::uint64_t seed = 500;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [t, hid, vocab] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 7, 1}, {7, 32, 63},
                                 {65, 16, 130}, {33, 1, 65}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T=" + std::to_string(t) + " H=" + std::to_string(hid) +
                   " V=" + std::to_string(vocab));
      const Tensor h = test::random_tensor(dt, {t, hid}, ++seed, -2.0f, 2.0f);
      const Tensor w = test::random_tensor(dt, {vocab, hid}, ++seed, -2.0f, 2.0f);
      const std::vector<std::int32_t> labels = ce_labels(t, vocab, ++seed, 3);
      const CeReference ref = ce_reference(h, w, labels, -100);
      Tensor loss = test::filled(DType::F32, {1}, NAN), dh(dt, {t, hid});
      Tensor dw = test::filled(DType::F32, {vocab, hid}, 1.0f);
      test::poison(dh);
      linear_cross_entropy(ctx, h, w, i32_tensor(labels), loss, dh, dw);
      // fp64 sums rounded once: the f32 loss and dw to 1e-6 of their magnitude, dh to its dtype's rounding.
      EXPECT_NEAR(loss.data_as<float>()[0], ref.loss, 1e-6 * (1 + std::abs(ref.loss)));
      const double dh_tol = dt == DType::BF16 ? 1.0 / 256 : 1e-6;
      for (std::int64_t i = 0; i < t * hid; ++i)
        ASSERT_NEAR(test::get_value(dh, i), ref.dh[static_cast<std::size_t>(i)],
                    dh_tol * std::abs(ref.dh[static_cast<std::size_t>(i)]) + 1e-7) << "dh " << i;
      for (std::int64_t i = 0; i < vocab * hid; ++i)  // accumulated onto the ones dw held
        ASSERT_NEAR(dw.data_as<float>()[i], 1.0 + ref.dw[static_cast<std::size_t>(i)], 1e-6) << "dw " << i;
    }
}

// accumulate_dw false: dw written without being read (a NaN-poisoned dw ends as a zeroed one accumulated to, bit
// for bit), also with no tokens (a zero gradient) and with every token ignored.
TEST(TrainLinearCrossEntropy, DwWrittenWithoutAccumulating) {
  const Context& ctx = Context::cpu();
  std::uint64_t seed = 900;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [t, hid, vocab, ignore_every] : {std::tuple<std::int64_t, std::int64_t, std::int64_t, int>{7, 16, 63, 3},
                                               {0, 8, 5, 0}, {3, 8, 5, 1}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T=" + std::to_string(t));
      const Tensor h = test::random_tensor(dt, {t, hid}, ++seed, -2.0f, 2.0f);
      const Tensor w = test::random_tensor(dt, {vocab, hid}, ++seed, -2.0f, 2.0f);
      std::vector<std::int32_t> labels = ce_labels(t, vocab, ++seed, ignore_every);
      if (ignore_every == 1) labels.assign(labels.size(), -100);
      Tensor loss(DType::F32, {1}), added = test::filled(DType::F32, {vocab, hid}, 0.0f);
      linear_cross_entropy(ctx, h, w, i32_tensor(labels), loss, {}, added);
      Tensor written = test::filled(DType::F32, {vocab, hid}, NAN);
      CrossEntropyOptions opts;
      opts.accumulate_dw = false;
      linear_cross_entropy(ctx, h, w, i32_tensor(labels), loss, {}, written, opts);
      EXPECT_TRUE(test::bytes_equal(written, added));
    }
}

// The GPU path's chunks: without dw within 5% of the fp32 logits' bytes (at least 32 MiB), whole rows where 1024
// tokens' rows fit (or all T's), else vocabulary chunks with a token chunk whose f32 dh accumulator takes a quarter;
// with dw whole rows, 1 GiB of logits, at least 512 tokens; at most T tokens and V columns; explicit chunks
// override; bad arguments raise.
TEST(TrainLinearCrossEntropy, Chunks) {
  const auto fraction = [](const CrossEntropyChunks& c, double t, double v) { return c.extra_bytes / (t * v * 4); };
  struct Case {
    std::int64_t t, hidden, vocab;
    DType dt;
    bool dh, dw;
    std::int64_t tokens, cols;
  };
  for (const Case& k : {Case{4096, 4096, 128256, DType::BF16, true, false, 1536, 25984},  // Llama-3-8B's head
                        Case{4096, 4096, 128256, DType::F32, true, false, 1536, 12928},
                        Case{4096, 4096, 128256, DType::BF16, false, false, 1536, 34176},  // no accumulator
                        Case{2048, 1536, 151936, DType::BF16, true, false, 2048, 12032},   // Qwen2.5-1.5B's
                        Case{7, 64, std::int64_t{1} << 30, DType::F32, true, false, 7, 53686912}}) {
    SCOPED_TRACE(std::to_string(k.t) + " x " + std::to_string(k.vocab) + " " + dtype_name(k.dt));
    const CrossEntropyChunks c = linear_cross_entropy_chunks(k.t, k.hidden, k.vocab, k.dt, k.dh, k.dw);
    EXPECT_EQ(c.tokens, k.tokens);
    EXPECT_EQ(c.vocab, k.cols);
    EXPECT_LE(fraction(c, k.t, k.vocab), 0.05);
    EXPECT_GE(fraction(c, k.t, k.vocab), 0.049);  // the budget used, not wasted
  }
  // Whole rows: 1024 tokens' rows fit in 32 MiB; every token fits
  CrossEntropyChunks c = linear_cross_entropy_chunks(100000, 64, 1000, DType::BF16, true, false);
  EXPECT_EQ(c.tokens, 16768);  // 16777 rows, in 128s
  EXPECT_EQ(c.vocab, 1000);
  EXPECT_EQ(c.extra_bytes, 16768 * 1000 * 2 + 100000 * 8 + 16);
  c = linear_cross_entropy_chunks(256, 128, 32003, DType::F32, true, false);
  EXPECT_EQ(c.tokens, 256);  // 262 rows fit, all 256 tokens'
  EXPECT_EQ(c.vocab, 32003);
  c = linear_cross_entropy_chunks(300, 128, 32003, DType::F32, true, false);
  EXPECT_EQ(c.tokens, 300);  // 262 rows fit, not 300: vocabulary chunks
  EXPECT_EQ(c.vocab, 27776);
  c = linear_cross_entropy_chunks(0, 64, 10, DType::F32, true, false);
  EXPECT_EQ(c.tokens, 1);
  EXPECT_EQ(c.vocab, 10);
  // With dw: whole rows of 1 GiB
  for (auto [t, dt, tokens] : {std::tuple<std::int64_t, DType, std::int64_t>{4096, DType::BF16, 4096},  // 4186 rows
                               {100000, DType::F32, 2048}}) {                                             // 2093 rows
    c = linear_cross_entropy_chunks(t, 4096, 128256, dt, true, true);
    EXPECT_EQ(c.tokens, tokens);
    EXPECT_EQ(c.vocab, 128256);
  }
  // Explicit chunks, clamped to T and V
  CrossEntropyOptions opts;
  opts.chunk_tokens = 64;
  opts.chunk_vocab = 7;
  c = linear_cross_entropy_chunks(300, 128, 32003, DType::F32, true, false, opts);
  EXPECT_EQ(c.tokens, 64);
  EXPECT_EQ(c.vocab, 7);
  EXPECT_EQ(c.extra_bytes, 1792 + 2560 + 16 + 64 * 128 * 4 + 1024);  // logits, loss terms, counts, acc, states
  opts.chunk_tokens = 1000;
  opts.chunk_vocab = 100000;
  c = linear_cross_entropy_chunks(300, 128, 32003, DType::F32, true, false, opts);
  EXPECT_EQ(c.tokens, 300);
  EXPECT_EQ(c.vocab, 32003);
  opts.chunk_vocab = 1000;  // dw keeps the vocabulary whole
  c = linear_cross_entropy_chunks(300, 128, 32003, DType::F32, true, true, opts);
  EXPECT_EQ(c.vocab, 32003);
  EXPECT_TRUE(test::throws_error([] { linear_cross_entropy_chunks(-1, 8, 10, DType::F32, true, false); }, kInvalid,
                                 {"linear_cross_entropy_chunks", "tokens is -1"}));
  EXPECT_TRUE(test::throws_error([] { linear_cross_entropy_chunks(8, 8, 0, DType::F32, true, false); }, kInvalid,
                                 {"vocab is 0"}));
  EXPECT_TRUE(test::throws_error([] { linear_cross_entropy_chunks(8, 0, 8, DType::F32, true, false); }, kInvalid,
                                 {"hidden is 0"}));
  EXPECT_TRUE(test::throws_error([] { linear_cross_entropy_chunks(8, 8, 8, DType::I32, true, false); }, kDType,
                                 {"dtype is i32"}));
  opts.chunk_vocab = -1;
  EXPECT_TRUE(test::throws_error([&] { linear_cross_entropy_chunks(8, 8, 8, DType::F32, true, false, opts); },
                                 kInvalid, {"chunk_vocab -1"}));
}

TEST(TrainLinearCrossEntropy, LossAloneAllIgnoredAndTheIgnoreIndex) {
  const Context& ctx = Context::cpu();
  const Tensor h = test::random_tensor(DType::F32, {9, 8}, 1), w = test::random_tensor(DType::F32, {20, 8}, 2);
  std::vector<std::int32_t> labels = ce_labels(9, 20, 3, 0);
  Tensor loss(DType::F32, {1}), with_grads(DType::F32, {1}), dh(DType::F32, {9, 8});
  linear_cross_entropy(ctx, h, w, i32_tensor(labels), loss);  // no gradients asked for
  linear_cross_entropy(ctx, h, w, i32_tensor(labels), with_grads, dh);
  EXPECT_EQ(loss.data_as<float>()[0], with_grads.data_as<float>()[0]);
  EXPECT_NEAR(loss.data_as<float>()[0], ce_reference(h, w, labels, -100).loss, 1e-6);
  // All ignored: loss 0 and zero gradients (dw unchanged).
  const std::vector<std::int32_t> none(9, 7);
  Tensor dw = test::filled(DType::F32, {20, 8}, 0.5f);
  CrossEntropyOptions opts;
  opts.ignore_index = 7;
  linear_cross_entropy(ctx, h, w, i32_tensor(none), loss, dh, dw, opts);
  EXPECT_EQ(loss.data_as<float>()[0], 0.0f);
  for (std::int64_t i = 0; i < dh.numel(); ++i) ASSERT_EQ(dh.data_as<float>()[i], 0.0f);
  for (std::int64_t i = 0; i < dw.numel(); ++i) ASSERT_EQ(dw.data_as<float>()[i], 0.5f);
  // Another ignore index: -100 is then an out-of-range label.
  labels[4] = -100;
  EXPECT_TRUE(test::throws_error([&] { linear_cross_entropy(ctx, h, w, i32_tensor(labels), loss, {}, {}, opts); },
                                 ErrorCode::InvalidArgument, {"labels[4] is -100", "[0, 20)", "ignore_index 7"}));
}

// With check_labels off nothing reads the labels on the host: a label out of range gives a NaN loss and NaN in its
// token's dh row, and leaves the other rows as the same call with that token ignored computes them (n counts only
// the labels in range).
TEST(TrainLinearCrossEntropy, UncheckedLabelOutOfRangeGivesNaN) {
  const Context& ctx = Context::cpu();
  const Tensor h = test::random_tensor(DType::F32, {6, 8}, 11), w = test::random_tensor(DType::F32, {13, 8}, 12);
  const std::vector<std::int32_t> labels = ce_labels(6, 13, 13, 0);
  CrossEntropyOptions opts;
  opts.check_labels = false;
  for (std::int32_t bad : {13, -1, -101}) {
    SCOPED_TRACE(bad);
    std::vector<std::int32_t> with_bad = labels, ignored = labels;
    with_bad[2] = bad;
    ignored[2] = -100;
    Tensor loss(DType::F32, {1}), dh(DType::F32, {6, 8}), ref_loss(DType::F32, {1}), ref_dh(DType::F32, {6, 8});
    linear_cross_entropy(ctx, h, w, i32_tensor(with_bad), loss, dh, {}, opts);
    linear_cross_entropy(ctx, h, w, i32_tensor(ignored), ref_loss, ref_dh);
    EXPECT_TRUE(std::isnan(loss.data_as<float>()[0]));
    for (std::int64_t i = 0; i < 6 * 8; ++i) {
      if (i / 8 == 2) ASSERT_TRUE(std::isnan(dh.data_as<float>()[i])) << i;
      else ASSERT_EQ(dh.data_as<float>()[i], ref_dh.data_as<float>()[i]) << i;
    }
  }
}

// Non-finite hidden states are not scanned for (the documented result): a NaN or Inf in one token's h makes the loss
// non-finite (NaN, or +Inf where the label's logit is -Inf) and that token's dh row NaN; every other token's dh row
// is what it is without that token's loss term.
TEST(TrainLinearCrossEntropy, NonFiniteHiddenStateSpoilsOnlyItsToken) {
  const Context& ctx = Context::cpu();
  const Tensor w = test::random_tensor(DType::F32, {11, 8}, 2);
  const std::vector<std::int32_t> labels = {1, 2, 3, 4, 5, 6};
  std::vector<std::int32_t> ignored = labels;
  ignored[2] = -100;
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    SCOPED_TRACE(bad);
    Tensor h = test::random_tensor(DType::F32, {6, 8}, 1);
    Tensor loss(DType::F32, {1}), dh(DType::F32, {6, 8}), ref_loss(DType::F32, {1}), ref_dh(DType::F32, {6, 8});
    linear_cross_entropy(ctx, h, w, i32_tensor(ignored), ref_loss, ref_dh);
    h.data_as<float>()[2 * 8 + 5] = bad;
    linear_cross_entropy(ctx, h, w, i32_tensor(labels), loss, dh);
    EXPECT_FALSE(std::isfinite(loss.data_as<float>()[0]));
    // the reference divides by 5 counted tokens, this call by 6: compare the rows scaled back to sums
    for (std::int64_t i = 0; i < 6 * 8; ++i) {
      if (i / 8 == 2) ASSERT_TRUE(std::isnan(dh.data_as<float>()[i])) << i;
      else ASSERT_NEAR(6.0 * dh.data_as<float>()[i], 5.0 * ref_dh.data_as<float>()[i], 1e-6) << i;
    }
  }
}

TEST(TrainLinearCrossEntropy, BadArgumentsNameThemAndWriteNothing) {
  const Context& ctx = Context::cpu();
  const Tensor h = test::random_tensor(DType::F32, {5, 8}, 1), w = test::random_tensor(DType::F32, {11, 8}, 2);
  const Tensor labels = i32_tensor({1, 2, 3, 4, 5});
  Tensor loss = test::filled(DType::F32, {1}, NAN), dh = test::filled(DType::F32, {5, 8}, NAN);
  struct Case {
    const char* what;
    std::function<void()> call;
    ErrorCode code;
    std::string needle;
  };
  const Tensor bad_labels = i32_tensor({1, 2, 11, 4, 5}), negative = i32_tensor({1, -1, 3, 4, 5});
  const Case cases[] = {
      {"label = V", [&] { linear_cross_entropy(ctx, h, w, bad_labels, loss, dh); }, ErrorCode::InvalidArgument,
       "labels[2] is 11"},
      {"negative label", [&] { linear_cross_entropy(ctx, h, w, negative, loss, dh); }, ErrorCode::InvalidArgument,
       "labels[1] is -1"},
      {"labels f32", [&] { linear_cross_entropy(ctx, h, w, test::filled(DType::F32, {5}, 1), loss, dh); },
       ErrorCode::DTypeMismatch, "labels"},
      {"labels count", [&] { linear_cross_entropy(ctx, h, w, i32_tensor({1, 2}), loss, dh); },
       ErrorCode::ShapeMismatch, "labels is [2]"},
      {"w width", [&] { linear_cross_entropy(ctx, h, test::random_tensor(DType::F32, {11, 7}, 3), labels, loss, dh); },
       ErrorCode::ShapeMismatch, "w must be [V, H]"},
      {"w dtype", [&] { linear_cross_entropy(ctx, h, test::random_tensor(DType::BF16, {11, 8}, 3), labels, loss); },
       ErrorCode::DTypeMismatch, "w"},
      {"loss size", [&] { linear_cross_entropy(ctx, h, w, labels, test::filled(DType::F32, {2}, 0)); },
       ErrorCode::ShapeMismatch, "loss"},
      {"dh shape", [&] { linear_cross_entropy(ctx, h, w, labels, loss, test::filled(DType::F32, {5, 7}, 0)); },
       ErrorCode::ShapeMismatch, "dh"},
      {"dw dtype", [&] { linear_cross_entropy(ctx, h, w, labels, loss, {}, test::filled(DType::BF16, {11, 8}, 0)); },
       ErrorCode::DTypeMismatch, "dw"},
      {"dh is h", [&] { linear_cross_entropy(ctx, h, w, labels, loss, h); }, ErrorCode::InvalidArgument, "dh"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_TRUE(test::throws_error(c.call, c.code, {"linear_cross_entropy", c.needle}));
    EXPECT_TRUE(std::isnan(loss.data_as<float>()[0]) && std::isnan(dh.data_as<float>()[0]));
  }
}

// ---- rms_norm ---------------------------------------------------------------------------------------------------

TEST(TrainRmsNorm, ForwardAndBackwardMatchTheDefinition) {
  const Context& ctx = Context::cpu();
  std::uint64_t seed = 900;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [rows, hid] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 7}, {65, 64}, {3, 1536}, {2, 5120}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(hid));
      const Tensor x = test::random_tensor(dt, {rows, hid}, ++seed, -3.0f, 3.0f);
      const Tensor w = test::random_tensor(dt, {hid}, ++seed, 0.5f, 1.5f);
      const Tensor dy = test::random_tensor(dt, {rows, hid}, ++seed);
      const float eps = 1e-6f;
      Tensor y(dt, {rows, hid}), rstd = test::filled(DType::F32, {rows}, NAN);
      rms_norm(ctx, x, w, y, rstd, eps);
      Tensor dx(dt, {rows, hid}), dw = test::filled(DType::F32, {hid}, 0.25f);
      rms_norm_backward(ctx, x, w, rstd, dy, dx, dw);
      const double ulp = dt == DType::BF16 ? 1.0 / 128 : 1e-6;  // two roundings in y (x̂, then the product)
      std::vector<double> dw_ref(static_cast<std::size_t>(hid), 0.25);
      for (std::int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (std::int64_t k = 0; k < hid; ++k) ss += std::pow(test::get_value(x, r * hid + k), 2);
        const double rs = 1.0 / std::sqrt(ss / double(hid) + eps);
        ASSERT_NEAR(rstd.data_as<float>()[r], rs, 1e-6 * rs);
        double gx = 0;  // Σ g·x, for dx = rs·g − rs³·x·Σ(g·x)/H: the same gradient, written another way
        for (std::int64_t k = 0; k < hid; ++k)
          gx += test::get_value(dy, r * hid + k) * test::get_value(w, k) * test::get_value(x, r * hid + k);
        for (std::int64_t k = 0; k < hid; ++k) {
          const double xv = test::get_value(x, r * hid + k), wv = test::get_value(w, k);
          const double g = test::get_value(dy, r * hid + k);
          const double y_ref = wv * xv * rs;
          ASSERT_NEAR(test::get_value(y, r * hid + k), y_ref, ulp * std::abs(y_ref) + 1e-7) << "y " << k;
          const double dx_ref = rs * g * wv - rs * rs * rs * xv * gx / double(hid);
          const double dx_mag = rs * std::abs(g * wv) + rs * rs * rs * std::abs(xv) * std::abs(gx) / double(hid);
          ASSERT_NEAR(test::get_value(dx, r * hid + k), dx_ref, (dt == DType::BF16 ? 1.0 / 128 : 1e-5) * dx_mag + 1e-7)
              << "dx " << k;
          dw_ref[static_cast<std::size_t>(k)] += g * xv * rs;
        }
      }
      for (std::int64_t k = 0; k < hid; ++k) {
        const double ref = dw_ref[static_cast<std::size_t>(k)];
        ASSERT_NEAR(dw.data_as<float>()[k], ref, 1e-5 * (1 + std::abs(ref))) << "dw " << k;
      }
      // In place (y = x, dx = dy) gives the same values.
      Tensor xy = test::host_copy(x), g = test::host_copy(dy), dw2 = test::filled(DType::F32, {hid}, 0.25f);
      rms_norm(ctx, xy, w, xy, {}, eps);
      EXPECT_TRUE(test::bytes_equal(xy, y));
      rms_norm_backward(ctx, x, w, rstd, g, g, dw2);
      EXPECT_TRUE(test::bytes_equal(g, dx));
      EXPECT_TRUE(test::bytes_equal(dw2, dw));
    }
}

// add_rms_norm is h = round(x + r) and then rms_norm of h, bit for bit; the backward's dres is added to dx before
// its rounding (checked against the sum in fp64 to dx's own tolerance), and both may be computed in place.
TEST(TrainRmsNorm, ResidualAddAndSecondGradientFuse) {
  const Context& ctx = Context::cpu();
  std::uint64_t seed = 950;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [rows, hid] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 63}, {65, 64}, {3, 1536}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(hid));
      const Tensor x = test::random_tensor(dt, {rows, hid}, ++seed, -3.0f, 3.0f);
      const Tensor r = test::random_tensor(dt, {rows, hid}, ++seed, -3.0f, 3.0f);
      const Tensor w = test::random_tensor(dt, {hid}, ++seed, 0.5f, 1.5f);
      const float eps = 1e-5f;
      Tensor h = test::filled(dt, {rows, hid}, NAN), y = test::filled(dt, {rows, hid}, NAN);
      Tensor rstd = test::filled(DType::F32, {rows}, NAN);
      add_rms_norm(ctx, x, r, w, h, y, rstd, eps);
      Tensor h_ref(dt, {rows, hid}), y_ref(dt, {rows, hid}), rstd_ref(DType::F32, {rows});
      for (std::int64_t i = 0; i < rows * hid; ++i)
        test::set_value(h_ref, i, test::get_value(x, i) + test::get_value(r, i));  // rounded once, as a tensor add
      rms_norm(ctx, h_ref, w, y_ref, rstd_ref, eps);
      EXPECT_TRUE(test::bytes_equal(h, h_ref));
      EXPECT_TRUE(test::bytes_equal(y, y_ref));
      EXPECT_TRUE(test::bytes_equal(rstd, rstd_ref));
      // In place: h over x and y over r.
      Tensor hx = test::host_copy(x), yr = test::host_copy(r);
      add_rms_norm(ctx, hx, yr, w, hx, yr, {}, eps);
      EXPECT_TRUE(test::bytes_equal(hx, h_ref));
      EXPECT_TRUE(test::bytes_equal(yr, y_ref));

      const Tensor dy = test::random_tensor(dt, {rows, hid}, ++seed),
                   dres = test::random_tensor(dt, {rows, hid}, ++seed);
      Tensor dx_plain(dt, {rows, hid}), dw_plain = test::filled(DType::F32, {hid}, 0.5f);
      rms_norm_backward(ctx, h, w, rstd, dy, dx_plain, dw_plain);
      Tensor dx = test::filled(dt, {rows, hid}, NAN), dw = test::filled(DType::F32, {hid}, 0.5f);
      rms_norm_backward(ctx, h, w, rstd, dy, dx, dw, dres);
      EXPECT_TRUE(test::bytes_equal(dw, dw_plain));  // dres leaves the weight's gradient alone
      const double tol = dt == DType::BF16 ? 1.0 / 128 : 1e-6;
      for (std::int64_t i = 0; i < rows * hid; ++i) {
        // The unrounded norm gradient lies within half an ulp of dx_plain: the sum within that plus dx's rounding.
        const double plain = test::get_value(dx_plain, i), res = test::get_value(dres, i);
        ASSERT_NEAR(test::get_value(dx, i), plain + res, tol * (std::abs(plain) + std::abs(plain + res)) + 1e-7) << i;
      }
      Tensor in_place = test::host_copy(dres);  // dx = dres
      rms_norm_backward(ctx, h, w, rstd, dy, in_place, {}, in_place);
      EXPECT_TRUE(test::bytes_equal(in_place, dx));
    }
}

TEST(TrainRmsNorm, BadArgumentsNameThem) {
  const Context& ctx = Context::cpu();
  const Tensor x = test::random_tensor(DType::F32, {4, 8}, 1), w = test::random_tensor(DType::F32, {8}, 2);
  Tensor y(DType::F32, {4, 8}), rstd(DType::F32, {4}), dx(DType::F32, {4, 8}), dw(DType::F32, {8});
  EXPECT_TRUE(test::throws_error([&] { rms_norm(ctx, x, test::random_tensor(DType::F32, {7}, 3), y, rstd, 1e-6f); },
                                 ErrorCode::ShapeMismatch, {"rms_norm", "w is [7]"}));
  EXPECT_TRUE(test::throws_error([&] { rms_norm(ctx, x, test::random_tensor(DType::BF16, {8}, 3), y, rstd, 1e-6f); },
                                 ErrorCode::DTypeMismatch, {"rms_norm", "w"}));
  EXPECT_TRUE(test::throws_error([&] { rms_norm(ctx, x, w, y, Tensor(DType::F32, {3}), 1e-6f); },
                                 ErrorCode::ShapeMismatch, {"rms_norm", "rstd is [3]"}));
  EXPECT_TRUE(test::throws_error([&] { rms_norm(ctx, x, w, y, rstd, NAN); }, ErrorCode::InvalidArgument,
                                 {"rms_norm", "eps"}));
  EXPECT_TRUE(test::throws_error([&] { rms_norm_backward(ctx, x, w, Tensor(DType::F32, {5}), x, dx, dw); },
                                 ErrorCode::ShapeMismatch, {"rms_norm_backward", "rstd"}));
  EXPECT_TRUE(test::throws_error([&] { rms_norm_backward(ctx, x, w, rstd, x, dx, Tensor(DType::BF16, {8})); },
                                 ErrorCode::DTypeMismatch, {"rms_norm_backward", "dw"}));
  EXPECT_TRUE(test::throws_error([&] { rms_norm_backward(ctx, x, w, rstd, x, {}, dw, x); }, ErrorCode::InvalidArgument,
                                 {"rms_norm_backward", "dres is given but dx is not"}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        rms_norm_backward(ctx, x, w, rstd, x, dx, dw, Tensor(DType::F32, {4, 7}));
      },
      ErrorCode::ShapeMismatch, {"rms_norm_backward", "dres"}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        rms_norm_backward(ctx, x, w, rstd, x, dx, dw, Tensor(DType::BF16, {4, 8}));
      },
      ErrorCode::DTypeMismatch, {"rms_norm_backward", "dres"}));
  // add_rms_norm: r and h like x, h and y distinct, nothing written on error.
  const Tensor r = test::random_tensor(DType::F32, {4, 8}, 4);
  Tensor h = test::filled(DType::F32, {4, 8}, NAN);
  y = test::filled(DType::F32, {4, 8}, NAN);
  EXPECT_TRUE(test::throws_error(
      [&] {
        add_rms_norm(ctx, x, Tensor(DType::F32, {4, 7}), w, h, y, rstd, 1e-6f);
      },
      ErrorCode::ShapeMismatch, {"add_rms_norm", "r"}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        add_rms_norm(ctx, x, r, w, Tensor(DType::BF16, {4, 8}), y, rstd, 1e-6f);
      },
      ErrorCode::DTypeMismatch, {"add_rms_norm", "h"}));
  EXPECT_TRUE(test::throws_error([&] { add_rms_norm(ctx, x, r, w, h, h, rstd, 1e-6f); }, ErrorCode::InvalidArgument,
                                 {"add_rms_norm", "y and h overlap"}));
  EXPECT_TRUE(test::throws_error([&] { add_rms_norm(ctx, x, r, w, h, y, rstd, -1.0f); }, ErrorCode::InvalidArgument,
                                 {"add_rms_norm", "eps"}));
  const Tensor buf = test::random_tensor(DType::F32, {4, 16}, 5);  // h over a part of x
  const TensorView xa(buf.data(), DType::F32, {4, 8}), hb(buf.data_as<float>() + 4, DType::F32, {4, 8});
  EXPECT_TRUE(test::throws_error([&] { add_rms_norm(ctx, xa, r, w, hb, y, rstd, 1e-6f); }, ErrorCode::InvalidArgument,
                                 {"add_rms_norm", "h and x overlap"}));
  EXPECT_TRUE(std::isnan(h.data_as<float>()[0]) && std::isnan(y.data_as<float>()[0]));
}

// ---- rope -------------------------------------------------------------------------------------------------------

namespace rope_test {

// Shapes: B, S, Hq, Hk (0: no k), D. Ragged sequence lengths, grouped-query attention (Hq ≠ Hk), the smallest D.
struct Shape5 {
  std::int64_t b, s, hq, hk, d;
};
constexpr Shape5 kShapes[] = {{1, 1, 1, 1, 2},  {2, 7, 4, 2, 64}, {3, 65, 6, 2, 128},
                              {1, 7, 3, 0, 64}, {2, 1, 2, 5, 2},  {3, 7, 5, 1, 6}};

std::string describe(const Shape5& s, DType dt, DType ct, std::int64_t bc, bool inverse) {
  return std::string(dtype_name(dt)) + " cos " + dtype_name(ct) + " B=" + std::to_string(s.b) +
         " S=" + std::to_string(s.s) + " Hq=" + std::to_string(s.hq) + " Hk=" + std::to_string(s.hk) +
         " D=" + std::to_string(s.d) + " Bc=" + std::to_string(bc) + (inverse ? " inverse" : "");
}

// Hugging Face's rotation written out in fp64 from the stored values: y = x·cos + rotate_half(x)·sin with
// rotate_half(x) = [−x2, x1]; the inverse is its transpose, y = g·cos + rotate_halfᵀ(g·sin), rotate_halfᵀ(v) =
// [v2, −v1]. Row (b, s) of x [B, S, H, D] uses row (b or 0, s) of cos and sin.
std::vector<double> reference(const TensorView& x, const TensorView& cos, const TensorView& sin, bool inverse) {
  const std::int64_t seq = x.dim(1), heads = x.dim(2), d = x.dim(3), half = d / 2;
  std::vector<double> y(static_cast<std::size_t>(x.numel()));
  for (std::int64_t b = 0; b < x.dim(0); ++b)
    for (std::int64_t s = 0; s < seq; ++s) {
      const std::int64_t row = ((cos.dim(0) == 1 ? 0 : b) * seq + s) * d;
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t base = ((b * seq + s) * heads + h) * d;
        auto xv = [&](std::int64_t i) { return test::get_value(x, base + i); };
        auto c = [&](std::int64_t i) { return test::get_value(cos, row + i); };
        auto sn = [&](std::int64_t i) { return test::get_value(sin, row + i); };
        for (std::int64_t i = 0; i < d; ++i) {
          double rot;
          if (!inverse)
            rot = (i < half ? -xv(i + half) : xv(i - half)) * sn(i);
          else
            rot = i < half ? xv(i + half) * sn(i + half) : -xv(i - half) * sn(i - half);
          y[static_cast<std::size_t>(base + i)] = xv(i) * c(i) + rot;
        }
      }
    }
  return y;
}

// One rounding of the fp64 rotation to the output dtype: at most half an ulp, 2^-24 (f32) or 2^-8 (bf16) of |y|;
// atol covers fp64's own evaluation error where the two products cancel. NaN (an unwritten, poisoned element) fails.
double rounding_tol(DType dt) { return dt == DType::BF16 ? 1.0 / 256 : 1.2e-7; }

::testing::AssertionResult close_to(const TensorView& got, const std::vector<double>& ref, double rtol) {
  std::int64_t bad = 0;
  std::ostringstream first;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = test::get_value(got, i), r = ref[static_cast<std::size_t>(i)];
    if (!(std::abs(g - r) <= rtol * std::abs(r) + 1e-12) && bad++ < 5)
      first << "\n  [" << i << "] " << g << " vs " << r;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements off:" << first.str();
}

// Σ a·b over two equally long tensors in fp64, and Σ |a·b| for its tolerance.
std::pair<double, double> dot(const TensorView& a, const TensorView& b) {
  double s = 0, m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double p = test::get_value(a, i) * test::get_value(b, i);
    s += p;
    m += std::abs(p);
  }
  return {s, m};
}

}  // namespace rope_test

TEST(TrainRope, MatchesTheDefinitionOutOfPlaceAndInPlace) {
  using namespace rope_test;
  const Context& ctx = Context::cpu();
  std::uint64_t seed = 1100;
  for (auto [dt, ct] : {std::pair{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}})
    for (const Shape5& sh : kShapes)
      for (std::int64_t bc : {std::int64_t{1}, sh.b})
        for (bool inverse : {false, true}) {
          SCOPED_TRACE(describe(sh, dt, ct, bc, inverse));
          const Tensor q = test::random_tensor(dt, {sh.b, sh.s, sh.hq, sh.d}, ++seed, -2.0f, 2.0f);
          const Tensor k = sh.hk ? test::random_tensor(dt, {sh.b, sh.s, sh.hk, sh.d}, ++seed, -2.0f, 2.0f) : Tensor();
          // Any cos and sin (not only a rotation's): every term of the definition is exercised.
          const Tensor cs = test::random_tensor(ct, {bc, sh.s, sh.d}, ++seed);
          const Tensor sn = test::random_tensor(ct, {bc, sh.s, sh.d}, ++seed);
          Tensor q_out = test::filled(dt, q.shape(), NAN);
          Tensor k_out = sh.hk ? test::filled(dt, k.shape(), NAN) : Tensor();
          rope(ctx, q, k, cs, sn, q_out, k_out, inverse);
          EXPECT_TRUE(close_to(q_out, reference(q, cs, sn, inverse), rounding_tol(dt))) << "q";
          if (sh.hk) EXPECT_TRUE(close_to(k_out, reference(k, cs, sn, inverse), rounding_tol(dt))) << "k";
          // In place gives the same bits.
          Tensor q_in = test::host_copy(q), k_in = sh.hk ? test::host_copy(k) : Tensor();
          rope(ctx, q_in, k_in, cs, sn, q_in, k_in, inverse);
          EXPECT_TRUE(test::bytes_equal(q_in, q_out));
          if (sh.hk) EXPECT_TRUE(test::bytes_equal(k_in, k_out));
        }
}

// The inverse is the forward's transpose: <forward(x), g> = <x, inverse(g)> in fp64, up to the outputs' roundings
// (relative to Σ|terms|: 2^-24 per f32 element, 2^-8 per bf16 element).
TEST(TrainRope, InverseIsTheTranspose) {
  using namespace rope_test;
  const Context& ctx = Context::cpu();
  std::uint64_t seed = 1200;
  for (DType dt : kDTypes)
    for (const Shape5& sh : {Shape5{2, 7, 4, 2, 64}, Shape5{3, 65, 2, 1, 2}, Shape5{1, 7, 3, 3, 128}}) {
      SCOPED_TRACE(describe(sh, dt, dt, sh.b, false));
      const Tensor x = test::random_tensor(dt, {sh.b, sh.s, sh.hq, sh.d}, ++seed);
      const Tensor g = test::random_tensor(dt, x.shape(), ++seed);
      const Tensor cs = test::random_tensor(dt, {sh.b, sh.s, sh.d}, ++seed);
      const Tensor sn = test::random_tensor(dt, {sh.b, sh.s, sh.d}, ++seed);
      Tensor y(dt, x.shape()), z(dt, x.shape());
      rope(ctx, x, {}, cs, sn, y, {}, false);
      rope(ctx, g, {}, cs, sn, z, {}, true);
      const auto [yg, yg_mag] = dot(y, g);
      const auto [xz, xz_mag] = dot(x, z);
      EXPECT_NEAR(yg, xz, rounding_tol(dt) * (yg_mag + xz_mag));
    }
}

// With Hugging Face's cos and sin (one angle per column pair: c1 = c2 = cos θ, s1 = s2 = sin θ, so cos² + sin² = 1)
// the inverse undoes the forward, to the two roundings (and fp32's cos² + sin² − 1, ~1e-7): per pair of radius r,
// 2e-6·r in f32 and 2^-6·r in bf16 (each rounding ≤ 2^-8 of a component, the rotation mixing two).
TEST(TrainRope, InverseUndoesTheForwardForARotation) {
  using namespace rope_test;
  const Context& ctx = Context::cpu();
  for (DType dt : kDTypes) {
    const std::int64_t b = 2, s = 65, hq = 4, hk = 2, d = 64, half = d / 2;
    const Tensor q = test::random_tensor(dt, {b, s, hq, d}, 1300), k = test::random_tensor(dt, {b, s, hk, d}, 1301);
    Tensor cs(DType::F32, {1, s, d}), sn(DType::F32, {1, s, d});
    for (std::int64_t p = 0; p < s; ++p)
      for (std::int64_t j = 0; j < half; ++j) {
        const double theta = static_cast<double>(p) * std::pow(10000.0, -2.0 * static_cast<double>(j) / d);
        for (std::int64_t i : {j, j + half}) {
          cs.data_as<float>()[p * d + i] = static_cast<float>(std::cos(theta));
          sn.data_as<float>()[p * d + i] = static_cast<float>(std::sin(theta));
        }
      }
    Tensor q2 = test::host_copy(q), k2 = test::host_copy(k);
    rope(ctx, q2, k2, cs, sn, q2, k2, false);
    rope(ctx, q2, k2, cs, sn, q2, k2, true);
    const double tol = dt == DType::BF16 ? 1.0 / 64 : 2e-6;
    for (const auto& [x, back] : {std::pair<const Tensor*, const Tensor*>{&q, &q2}, {&k, &k2}})
      for (std::int64_t i = 0; i < x->numel(); ++i) {
        const std::int64_t j = i % d, partner = j < half ? i + half : i - half;
        const double r = std::hypot(test::get_value(*x, i), test::get_value(*x, partner));
        ASSERT_NEAR(test::get_value(*back, i), test::get_value(*x, i), tol * r + 1e-30) << dtype_name(dt) << " " << i;
      }
  }
}

// No elements: nothing to do, nothing written; q without heads still rotates k.
TEST(TrainRope, EmptyTensors) {
  const Context& ctx = Context::cpu();
  const Tensor cs = test::random_tensor(DType::F32, {1, 3, 4}, 1), sn = test::random_tensor(DType::F32, {1, 3, 4}, 2);
  Tensor none(DType::F32, {0, 3, 2, 4});
  rope(ctx, none, {}, test::filled(DType::F32, {1, 3, 4}, 0), cs, none, {});
  const Tensor q(DType::F32, {2, 3, 0, 4}), k = test::random_tensor(DType::F32, {2, 3, 2, 4}, 3);
  Tensor k_out = test::filled(DType::F32, k.shape(), NAN), want(DType::F32, k.shape());
  rope(ctx, q, k, cs, sn, q, k_out);
  rope(ctx, k, {}, cs, sn, want, {});
  EXPECT_TRUE(test::bytes_equal(k_out, want));
}

TEST(TrainRope, BadArgumentsNameThemAndWriteNothing) {
  const Context& ctx = Context::cpu();
  const std::int64_t b = 3, s = 5, hq = 4, hk = 2, d = 8;
  // Every argument a view into its own buffer, with room for misplaced views; the buffers are the watched outputs.
  const Tensor qb = test::random_tensor(DType::F32, {b * s * hq * d + 8}, 1);
  const Tensor kb = test::random_tensor(DType::F32, {b * s * hk * d + 8}, 2);
  const Tensor cb = test::random_tensor(DType::F32, {b * s * d + 8}, 3),
               sb = test::random_tensor(DType::F32, {b * s * d + 8}, 4);
  const Tensor qob = test::filled(DType::F32, qb.shape(), NAN), kob = test::filled(DType::F32, kb.shape(), NAN);
  const TensorView q = part(qb, 0, {b, s, hq, d}), k = part(kb, 0, {b, s, hk, d});
  const TensorView cs = part(cb, 0, {1, s, d}), sn = part(sb, 0, {1, s, d});
  const TensorView q_out = part(qob, 0, q.shape()), k_out = part(kob, 0, k.shape());
  const Tensor q16 = test::random_tensor(DType::BF16, q.shape(), 5),
               k16 = test::random_tensor(DType::BF16, k.shape(), 6);
  const Tensor c16 = test::random_tensor(DType::BF16, cs.shape(), 7);
  struct Case {
    const char* what;
    std::function<void()> call;
    ErrorCode code;
    std::string needle;
  };
  auto call = [&](TensorView q_, TensorView k_, TensorView c_, TensorView s_, TensorView qo_, TensorView ko_) {
    return [=, &ctx] { rope(ctx, q_, k_, c_, s_, qo_, ko_); };
  };
  const Case cases[] = {
      {"q rank", call(part(qb, 0, {b * s, hq, d}), k, cs, sn, part(qob, 0, {b * s, hq, d}), k_out), kShape,
       "q must have rank 4"},
      {"q odd D",
       call(part(qb, 0, {b, s, hq, 7}), {}, part(cb, 0, {1, s, 7}), part(sb, 0, {1, s, 7}), part(qob, 0, {b, s, hq, 7}),
            {}),
       kShape, "head dimension"},
      {"q u8", call(TensorView(qb.data(), DType::U8, q.shape()), {}, cs, sn, q_out, {}), kDType, "q is u8"},
      {"q null", call(null_like(q), k, cs, sn, q_out, k_out), kInvalid, "q"},
      {"q on a GPU", call(on_gpu(q), k, cs, sn, q_out, k_out), kDevice, "q"},
      {"q_out shape", call(q, k, cs, sn, part(qob, 0, {b, s, hq - 1, d}), k_out), kShape, "q_out is"},
      {"q_out dtype", call(q, k, cs, sn, TensorView(qob.data(), DType::BF16, q.shape()), k_out), kDType, "q_out"},
      {"k dtype", call(q, k16, cs, sn, q_out, k_out), kDType, "k is bf16 but q is f32"},
      {"k batch", call(q, part(kb, 0, {1, s, hk, d}), cs, sn, q_out, part(kob, 0, {1, s, hk, d})), kShape,
       "k must be [B, S, Hk, D]"},
      {"k head dim", call(q, part(kb, 0, {b, s, 1, 2 * d}), cs, sn, q_out, part(kob, 0, {b, s, 1, 2 * d})), kShape,
       "k must be [B, S, Hk, D]"},
      {"k rank", call(q, part(kb, 0, {b * s, hk, d}), cs, sn, q_out, part(kob, 0, {b * s, hk, d})), kShape,
       "k must have rank 4"},
      {"k on a GPU", call(q, on_gpu(k), cs, sn, q_out, k_out), kDevice, "k"},
      {"k without k_out", call(q, k, cs, sn, q_out, {}), kInvalid, "k_out is missing"},
      {"k_out without k", call(q, {}, cs, sn, q_out, k_out), kInvalid, "k is missing"},
      {"k_out shape", call(q, k, cs, sn, q_out, part(kob, 0, {b, s, hk - 1, d})), kShape, "k_out is"},
      {"k_out dtype", call(q16, k16, c16, c16, TensorView(qob.data(), DType::BF16, q.shape()), k_out), kDType, "k_out"},
      {"cos rank", call(q, k, part(cb, 0, {s, d}), part(sb, 0, {s, d}), q_out, k_out), kShape, "cos is [5,8]"},
      {"cos batch", call(q, k, part(cb, 0, {2, s, d}), part(sb, 0, {2, s, d}), q_out, k_out), kShape,
       "cos is [2,5,8] but must be [1 or 3, 5, 8]"},
      {"cos length", call(q, k, part(cb, 0, {1, s - 1, d}), part(sb, 0, {1, s - 1, d}), q_out, k_out), kShape,
       "cos is"},
      {"cos width", call(q, k, part(cb, 0, {1, s, d / 2}), part(sb, 0, {1, s, d / 2}), q_out, k_out), kShape, "cos is"},
      {"cos bf16 for f32 q", call(q, k, c16, c16, q_out, k_out), kDType, "cos is bf16"},
      {"cos null", call(q, k, null_like(cs), sn, q_out, k_out), kInvalid, "cos"},
      {"cos on a GPU", call(q, k, on_gpu(cs), sn, q_out, k_out), kDevice, "cos"},
      {"sin shape", call(q, k, cs, part(sb, 0, {3, s, d}), q_out, k_out), kShape, "sin is"},
      {"sin dtype",
       call(q16, k16, c16, cs, TensorView(qob.data(), DType::BF16, q.shape()),
            TensorView(kob.data(), DType::BF16, k.shape())),
       kDType, "sin"},
      {"q_out overlaps q", call(q, k, cs, sn, part(qb, 1, q.shape()), k_out), kInvalid, "q_out and q overlap"},
      {"q_out is k", call(q, part(qb, 0, {b, s, hq, d}), cs, sn, part(qb, 0, q.shape()), part(qob, 0, q.shape())),
       kInvalid, "q_out and k"},
      {"q_out is k_out", call(q, k, cs, sn, q_out, part(qob, 0, k.shape())), kInvalid, "q_out and k_out"},
      {"q_out overlaps cos", call(q, k, part(qb, 0, {1, s, d}), sn, q, k_out), kInvalid, "q_out and cos"},
      {"q_out overlaps sin", call(q, k, cs, part(qob, 3, {1, s, d}), q_out, k_out), kInvalid, "q_out and sin"},
      {"k_out overlaps k", call(q, k, cs, sn, q_out, part(kb, 2, k.shape())), kInvalid, "k_out and k overlap"},
      {"k_out overlaps q", call(q, k, cs, sn, q_out, part(qb, 0, k.shape())), kInvalid, "k_out and q"},
      {"k_out overlaps cos", call(q, k, part(kob, 1, {1, s, d}), sn, q_out, k_out), kInvalid, "k_out and cos"},
      {"k_out overlaps sin", call(q, k, cs, part(kob, 4, {1, s, d}), q_out, k_out), kInvalid, "k_out and sin"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_TRUE(rejects(c.call, c.code, {"rope: ", c.needle}, {qb, kb, cb, sb, qob, kob}));
  }
  // cos and sin may be one tensor (both only read); the checks above did not reject a good call.
  rope(ctx, q, k, cs, cs, q_out, k_out);
}

}  // namespace qmm
