// The dense GEMM family on the CUDA backend (cuBLASLt + the BF16 truncation pass) against the CPU oracle: the same
// host inputs, the same initial C, every variant (so every transpose combination), every math mode with f32 and
// bf16 storage, ragged shapes, alpha/beta, NaN-poisoned outputs, exact integer inputs, the truncation contract,
// unaligned views, K = 0, the plan cache, concurrent use from several threads, and device validation.
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/test_util.h"
#include "core/context_impl.h"

namespace qmm {
namespace {

using test::bits_of;
using test::float_of;

// ---- the variants -----------------------------------------------------------------------------------------------
enum class Op { Gemm, GemmBt, BackwardA, BackwardB, Batched, BatchedBt };
constexpr Op kAllOps[] = {Op::Gemm, Op::GemmBt, Op::BackwardA, Op::BackwardB, Op::Batched, Op::BatchedBt};

const char* op_name(Op op) {
  switch (op) {
    case Op::Gemm: return "gemm";
    case Op::GemmBt: return "gemm_bt";
    case Op::BackwardA: return "gemm_backward_a";
    case Op::BackwardB: return "gemm_backward_b";
    case Op::Batched: return "batched_gemm";
    case Op::BatchedBt: return "batched_gemm_bt";
  }
  return "?";
}

void PrintTo(Op op, std::ostream* os) { *os << op_name(op); }  // readable test names in gtest and CTest

// The product: out [m,n] (per batch entry) = sum over k. Batched ops run over [kBatch, kHeads].
struct Dims {
  std::int64_t m, n, k;
};
constexpr std::int64_t kBatch = 2, kHeads = 3;

struct Shapes {
  Shape x, y, out;  // the op's first input, second input, output
};

Shapes shapes_of(Op op, Dims d) {
  switch (op) {
    case Op::Gemm: return {{d.m, d.k}, {d.k, d.n}, {d.m, d.n}};
    case Op::GemmBt: return {{d.m, d.k}, {d.n, d.k}, {d.m, d.n}};
    // dA[M,K] = dC[M,N]·B[K,N]^T: M = m, K = n (output columns), N = k (contracted).
    case Op::BackwardA: return {{d.m, d.k}, {d.n, d.k}, {d.m, d.n}};
    // dB[K,N] = A[M,K]^T·dC[M,N]: K = m, N = n, M = k (contracted).
    case Op::BackwardB: return {{d.k, d.m}, {d.k, d.n}, {d.m, d.n}};
    case Op::Batched: return {{kBatch, kHeads, d.m, d.k}, {kBatch, kHeads, d.k, d.n}, {kBatch, kHeads, d.m, d.n}};
    case Op::BatchedBt: return {{kBatch, kHeads, d.m, d.k}, {kBatch, kHeads, d.n, d.k}, {kBatch, kHeads, d.m, d.n}};
  }
  return {};
}

void run_op(const Context& ctx, Op op, const TensorView& x, const TensorView& y, const TensorView& out,
            const GemmOptions& opts) {
  switch (op) {
    case Op::Gemm: gemm(ctx, x, y, out, opts); return;
    case Op::GemmBt: gemm_bt(ctx, x, y, out, opts); return;
    case Op::BackwardA: gemm_backward_a(ctx, x, y, out, opts); return;
    case Op::BackwardB: gemm_backward_b(ctx, x, y, out, opts); return;
    case Op::Batched: batched_gemm(ctx, x, y, out, false, opts); return;
    case Op::BatchedBt: batched_gemm(ctx, x, y, out, true, opts); return;
  }
}

// ---- storage and math -------------------------------------------------------------------------------------------
struct Mode {
  DType ab, c;
  MathMode math;
};
// f32 storage in every math mode; bf16 storage (bf16 and f32 out) under several modes, which must not matter.
constexpr Mode kModes[] = {
    {DType::F32, DType::F32, MathMode::FP32},   {DType::F32, DType::F32, MathMode::TF32},
    {DType::F32, DType::F32, MathMode::BF16},   {DType::BF16, DType::BF16, MathMode::FP32},
    {DType::BF16, DType::F32, MathMode::FP32},  {DType::BF16, DType::BF16, MathMode::BF16},
    {DType::BF16, DType::F32, MathMode::TF32},
};

std::string mode_text(const Mode& m) {
  return std::string(dtype_name(m.ab)) + "->" + dtype_name(m.c) + " " + math_mode_name(m.math);
}

// Tolerances, from tests/common/test_util.h, with why each fits:
//  - FP32: strict fp32 on the GPU, fp64 in the oracle: fp32 rounding of products and sums only.
//  - BF16 compute on f32 storage, and bf16 storage with f32 out: both sides multiply the same bf16 operands
//    (products exact in fp32); only the fp32 accumulation order differs.
//  - bf16 out: the same, plus one bf16 rounding of the result.
//  - TF32: the oracle rounds operands to tf32 to nearest even; the GPU's tensor cores may instead drop the low 13
//    bits (truncate). Per operand the two differ by 0 or 1 tf32 ulp (≤ 2^-10 relative, ~7e-4 on average), so each
//    product differs by ≤ ~2·2^-10 relative: a part proportional to the result (well within rtol 5e-3) and a
//    random part of about 2e-4·sqrt(K) for inputs in [-1,1], far inside atol 2e-3·sqrt(K). tf32_tolerance
//    therefore accepts either hardware rounding while still rejecting fp16/bf16-level operand rounding.
test::Tolerance tolerance_for(const Mode& m, std::int64_t k) {
  if (m.c == DType::BF16) return test::bf16_output_tolerance(k);
  if (m.ab == DType::F32 && m.math == MathMode::TF32) return test::tf32_tolerance(k);
  return test::fp32_accum_tolerance(k);
}
// Exact integer inputs: every mode represents them exactly and every partial sum is an integer below 2^24, so
// both sides hold the exact result before the (identical, round-to-nearest-even) output rounding.
constexpr test::Tolerance kExact{0.0, 0.0, 0.0};

std::string case_text(Op op, Dims d, const Mode& mode, float alpha, float beta) {
  std::ostringstream s;
  s << op_name(op) << " m=" << d.m << " n=" << d.n << " k=" << d.k << " " << mode_text(mode) << " alpha=" << alpha
    << " beta=" << beta;
  return s.str();
}

Device gpu_device() { return test::gpu_context()->device(); }

// Runs one case on the GPU and on the CPU oracle with the same host inputs and the same initial C.
::testing::AssertionResult check_case(Op op, Dims d, const Mode& mode, float alpha, float beta, std::uint64_t seed,
                                      bool integers = false) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const Shapes s = shapes_of(op, d);
  auto make = [&](DType dt, const Shape& shape, std::uint64_t sd) {
    return integers ? test::random_int_tensor(dt, shape, sd) : test::random_tensor(dt, shape, sd);
  };
  Tensor x = make(mode.ab, s.x, seed * 3 + 1);
  Tensor y = make(mode.ab, s.y, seed * 3 + 2);
  Tensor c0 = make(mode.c, s.out, seed * 3 + 3);
  const GemmOptions opts{alpha, beta, mode.math};

  Tensor ref = test::host_copy(c0);
  run_op(cpu, op, x, y, ref, opts);

  Tensor c = to_device(c0, gpu.device());
  if (beta == 0.0f) test::poison(c);  // beta = 0 must overwrite: an unread NaN must not survive
  run_op(gpu, op, to_device(x, gpu.device()), to_device(y, gpu.device()), c, opts);
  gpu.synchronize();
  const test::Tolerance tol = integers ? kExact : tolerance_for(mode, d.k);
  ::testing::AssertionResult r = test::all_close(test::host_copy(c), ref, tol);
  if (!r) r << "\n  case: " << case_text(op, d, mode, alpha, beta) << (integers ? " (integers)" : "");
  return r;
}

// Ragged sizes in every role (1, 7, 63, 65, 1000), never multiples of a tile; total work kept modest.
const std::vector<Dims> kDims2d = {{1, 1, 1},   {7, 63, 65},   {65, 7, 1000}, {63, 65, 7},
                                   {1, 1000, 63}, {1000, 1, 65}, {1000, 65, 1}};
const std::vector<Dims> kDimsBatched = {{65, 63, 33}, {1, 7, 65}, {7, 1, 1000}, {63, 65, 7}};

const std::vector<Dims>& dims_for(Op op) {
  return (op == Op::Batched || op == Op::BatchedBt) ? kDimsBatched : kDims2d;
}

struct Scalars {
  float alpha, beta;
};
constexpr Scalars kScalars[] = {{1.0f, 0.0f}, {-0.75f, 0.0f}, {0.5f, 1.25f}};

// ---- every variant x every mode x ragged shapes x alpha/beta ------------------------------------------------------
class GpuGemmVariant : public ::testing::TestWithParam<Op> {};

TEST_P(GpuGemmVariant, MatchesCpuOracleInEveryMode) {
  QMM_REQUIRE_GPU();
  const Op op = GetParam();
  std::uint64_t seed = 1000 * static_cast<std::uint64_t>(op) + 17;
  for (const Dims& d : dims_for(op))
    for (const Mode& mode : kModes)
      for (const Scalars& sc : kScalars) EXPECT_TRUE(check_case(op, d, mode, sc.alpha, sc.beta, ++seed));
}

TEST_P(GpuGemmVariant, ExactIntegerInputsGiveExactResults) {
  QMM_REQUIRE_GPU();
  const Op op = GetParam();
  std::uint64_t seed = 5000 * static_cast<std::uint64_t>(op) + 3;
  const std::vector<Dims> dims = (op == Op::Batched || op == Op::BatchedBt)
                                     ? std::vector<Dims>{{65, 63, 33}, {7, 1, 1000}}
                                     : std::vector<Dims>{{7, 63, 65}, {65, 7, 1000}, {1, 1000, 63}};
  for (const Dims& d : dims)
    for (const Mode& mode : kModes) {
      EXPECT_TRUE(check_case(op, d, mode, 1.0f, 0.0f, ++seed, true));
      EXPECT_TRUE(check_case(op, d, mode, 2.0f, -1.0f, ++seed, true));  // integer C, accumulated
    }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, GpuGemmVariant, ::testing::ValuesIn(kAllOps),
                         [](const ::testing::TestParamInfo<Op>& info) { return std::string(op_name(info.param)); });

// A few larger ragged shapes, where cuBLASLt picks real tensor-core tiles (and perhaps split-K).
TEST(GpuGemm, LargerRaggedShapes) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 777;
  for (const Dims& d : {Dims{257, 193, 1000}, Dims{1000, 129, 255}})
    for (const Mode& mode : kModes) {
      EXPECT_TRUE(check_case(Op::Gemm, d, mode, 1.0f, 0.0f, ++seed));
      EXPECT_TRUE(check_case(Op::GemmBt, d, mode, 0.5f, 1.0f, ++seed));
    }
}

// backward_a's two uses: overwrite (beta 0) and accumulate into an existing gradient (beta 1).
TEST(GpuGemm, BackwardAOverwriteAndAccumulate) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 4242;
  for (const Mode& mode : kModes)
    for (float beta : {0.0f, 1.0f}) {
      EXPECT_TRUE(check_case(Op::BackwardA, {65, 63, 1000}, mode, 1.0f, beta, ++seed));
      EXPECT_TRUE(check_case(Op::BackwardB, {65, 63, 1000}, mode, 1.0f, beta, ++seed));
    }
}

// ---- the BF16-compute contract: C = sum trunc(A)·trunc(B), not round-to-nearest -----------------------------------

// f32 values in [-1,1) whose low 16 bits lie strictly above the half-way point, so truncation and
// round-to-nearest give different bf16 values for every element.
Tensor low_bits_tensor(Shape shape, std::uint64_t seed) {
  Tensor t = test::random_tensor(DType::F32, shape, seed);
  std::mt19937_64 rng(seed ^ 0x9E3779B97F4A7C15ull);
  std::uniform_int_distribution<std::uint32_t> low(0x8001u, 0xFFFFu);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = float_of((bits_of(p[i]) & 0xFFFF0000u) | low(rng));
  return t;
}

// The same values rounded to bf16 (nearest even): what a rounding conversion would have multiplied.
Tensor rounded_bf16(const Tensor& f32) {
  Tensor t(DType::BF16, f32.shape());
  for (std::int64_t i = 0; i < f32.numel(); ++i)
    t.data_as<std::uint16_t>()[i] = float_to_bf16(f32.data_as<float>()[i]);
  return t;
}

TEST(GpuGemm, Bf16ComputeTruncatesOperands) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  // m*k and k*n are not multiples of the conversion's 8-element chunks: the tails are exercised too.
  const Dims d{7, 9, 65};
  std::uint64_t seed = 99;
  for (Op op : kAllOps) {
    const Shapes s = shapes_of(op, d);
    Tensor x = low_bits_tensor(s.x, ++seed), y = low_bits_tensor(s.y, ++seed);
    const GemmOptions opts{1.0f, 0.0f, MathMode::BF16};
    Tensor ref(DType::F32, s.out);
    run_op(cpu, op, x, y, ref, opts);  // the oracle truncates
    Tensor rne(DType::F32, s.out);
    run_op(cpu, op, rounded_bf16(x), rounded_bf16(y), rne, {1.0f, 0.0f, MathMode::FP32});

    Tensor c(DType::F32, s.out, gpu.device());
    test::poison(c);
    run_op(gpu, op, to_device(x, gpu.device()), to_device(y, gpu.device()), c, opts);
    gpu.synchronize();
    Tensor got = test::host_copy(c);
    EXPECT_TRUE(test::all_close(got, ref, test::fp32_accum_tolerance(d.k))) << op_name(op);
    EXPECT_FALSE(test::all_close(got, rne, test::fp32_accum_tolerance(d.k)))
        << op_name(op) << ": the GPU result matches round-to-nearest operands, not truncated ones";
  }
}

TEST(GpuGemm, Bf16ComputeCraftedTruncationCase) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  // 0x3F80C000 = 1.005859375: truncates to 1.0, rounds to 1.0078125. With K = 64 every output is exactly 64
  // under truncation, 65.00390625 under rounding, 64.75... in fp32.
  const std::int64_t m = 3, n = 5, k = 64;
  const float v = float_of(0x3F80C000u);
  Tensor a = test::filled(DType::F32, {m, k}, v), b = test::filled(DType::F32, {k, n}, v);
  Tensor c(DType::F32, {m, n}, gpu.device());
  test::poison(c);
  gemm(gpu, to_device(a, gpu.device()), to_device(b, gpu.device()), c, {1.0f, 0.0f, MathMode::BF16});
  gpu.synchronize();
  EXPECT_TRUE(test::all_close(test::host_copy(c), test::filled(DType::F32, {m, n}, 64.0f), kExact));
}

// ---- K = 0: the empty product gives C = beta * C ------------------------------------------------------------------
TEST(GpuGemm, EmptyInnerDimensionScalesC) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 31;
  for (const Mode& mode : kModes)
    for (float beta : {0.0f, 0.5f})
      for (Op op : {Op::Gemm, Op::BackwardB, Op::Batched}) {
        const Dims d{7, 65, 0};
        const Shapes s = shapes_of(op, d);
        Tensor x(mode.ab, s.x), y(mode.ab, s.y);
        Tensor c0 = test::random_tensor(mode.c, s.out, ++seed);
        Tensor ref = test::host_copy(c0);
        run_op(cpu, op, x, y, ref, {1.0f, beta, mode.math});
        Tensor c = to_device(c0, gpu.device());
        if (beta == 0.0f) test::poison(c);
        run_op(gpu, op, to_device(x, gpu.device()), to_device(y, gpu.device()), c, {1.0f, beta, mode.math});
        gpu.synchronize();
        EXPECT_TRUE(test::all_close(test::host_copy(c), ref, kExact)) << case_text(op, d, mode, 1.0f, beta);
      }
}

// ---- views that do not start on a 16-byte boundary ----------------------------------------------------------------

// A device view of `src`'s values starting `offset_elems` elements into a larger allocation.
struct OffsetView {
  Tensor storage;
  TensorView view;
};
OffsetView offset_copy(const Tensor& src, std::int64_t offset_elems) {
  OffsetView o;
  o.storage = Tensor(src.dtype(), {src.numel() + offset_elems + 8}, gpu_device());
  auto* base = static_cast<unsigned char*>(o.storage.data()) + offset_elems * dtype_size(src.dtype());
  o.view = TensorView(base, src.dtype(), src.shape(), gpu_device());
  copy(o.view, src);
  return o;
}

// An addend read in place of out's old contents (a residual in the GEMM's epilogue): out poisoned, the addend
// unchanged, every variant, against the CPU oracle run in place on the addend's values; K = 0 and an addend one
// element off a 16-byte boundary too.
TEST(GpuGemm, AddendStandsInForTheOldOutput) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 71;
  for (Op op : kAllOps)
    for (const Mode& mode : {kModes[0], kModes[3], kModes[4]})
      for (const Dims d : {Dims{65, 63, 1000}, Dims{1, 1000, 16}, Dims{7, 65, 0}})
        for (const std::int64_t offset : {0, 1}) {
          const Shapes s = shapes_of(op, d);
          const Tensor x = test::random_tensor(mode.ab, s.x, ++seed), y = test::random_tensor(mode.ab, s.y, ++seed);
          const Tensor addend = test::random_tensor(mode.c, s.out, ++seed);
          const GemmOptions plain{0.5f, 1.0f, mode.math};
          Tensor ref = test::host_copy(addend);
          run_op(cpu, op, x, y, ref, plain);
          const OffsetView add = offset_copy(addend, offset);
          Tensor c(mode.c, s.out, gpu.device());
          test::poison(c);
          GemmOptions opts = plain;
          opts.addend = add.view;
          run_op(gpu, op, to_device(x, gpu.device()), to_device(y, gpu.device()), c, opts);
          gpu.synchronize();
          const std::string what = case_text(op, d, mode, 0.5f, 1.0f) + " addend offset " + std::to_string(offset);
          EXPECT_TRUE(test::all_close(test::host_copy(c), ref, d.k == 0 ? kExact : tolerance_for(mode, d.k))) << what;
          EXPECT_TRUE(test::bytes_equal(test::host_copy(add.view), addend)) << what << ": the addend changed";
        }
}

TEST(GpuGemm, UnalignedViews) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 555;
  for (const Mode& mode : kModes)
    for (Op op : {Op::Gemm, Op::GemmBt, Op::BackwardB, Op::BatchedBt}) {
      const Dims d{33, 65, 63};
      const Shapes s = shapes_of(op, d);
      Tensor x = test::random_tensor(mode.ab, s.x, ++seed), y = test::random_tensor(mode.ab, s.y, ++seed);
      Tensor c0 = test::random_tensor(mode.c, s.out, ++seed);
      const GemmOptions opts{1.0f, 0.5f, mode.math};
      Tensor ref = test::host_copy(c0);
      run_op(cpu, op, x, y, ref, opts);
      // One element off: 4-byte (f32) or 2-byte (bf16) aligned A and C, B three elements off.
      OffsetView dx = offset_copy(x, 1), dy = offset_copy(y, 3), dc = offset_copy(c0, 1);
      run_op(gpu, op, dx.view, dy.view, dc.view, opts);
      gpu.synchronize();
      EXPECT_TRUE(test::all_close(test::host_copy(dc.view), ref, tolerance_for(mode, d.k)))
          << case_text(op, d, mode, opts.alpha, opts.beta) << " (unaligned views)";
    }
}

// ---- lora_backward_dy ----------------------------------------------------------------------------------------------
// The one-pass kernel (bf16, r 8/16/32, N % 8 == 0, 16-byte aligned) and the two-GEMM fallback (every other case)
// against the CPU, which runs the two GEMMs. dt (bf16) is one rounding of an fp32 sum over N, grad_b (f32) an fp32
// sum over M added to its old value: the GEMM family's tolerances for those outputs and reduction lengths.
void expect_lora_backward_dy_matches(DType dtype, MathMode math, std::int64_t m, std::int64_t n, std::int64_t r,
                                     std::uint64_t seed, bool unaligned = false, float beta = 1.0f) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const Tensor dy = test::random_tensor(dtype, {m, n}, seed), b = test::random_tensor(dtype, {n, r}, seed + 1);
  const Tensor t = test::random_tensor(dtype, {m, r}, seed + 2), gb0 = test::random_tensor(DType::F32, {n, r}, seed + 3);
  Tensor dt_ref(dtype, {m, r});
  Tensor gb_ref = test::host_copy(gb0);
  lora_backward_dy(cpu, dy, b, t, dt_ref, gb_ref, 0.375f, math, beta);

  Tensor dt(dtype, {m, r}, gpu.device()), gb = to_device(gb0, gpu.device());
  test::poison(dt);
  if (beta == 0.0f) test::poison(gb);  // beta = 0 must not read grad_b
  OffsetView dy_d = offset_copy(dy, unaligned ? 1 : 0);
  lora_backward_dy(gpu, dy_d.view, to_device(b, gpu.device()), to_device(t, gpu.device()), dt, gb, 0.375f, math,
                   beta);
  gpu.synchronize();
  const std::string what = std::string(dtype_name(dtype)) + " " + math_mode_name(math) + " m" + std::to_string(m) +
                           " n" + std::to_string(n) + " r" + std::to_string(r) + (unaligned ? " unaligned dy" : "") +
                           " beta " + std::to_string(beta);
  const test::Tolerance dt_tol = dtype == DType::BF16 ? test::bf16_output_tolerance(n)
                                 : math == MathMode::TF32 ? test::tf32_tolerance(n)
                                                          : test::fp32_accum_tolerance(n);
  const test::Tolerance gb_tol = math == MathMode::TF32 ? test::tf32_tolerance(m) : test::fp32_accum_tolerance(m);
  EXPECT_TRUE(test::all_close(test::host_copy(dt), dt_ref, dt_tol)) << what << ": dt";
  EXPECT_TRUE(test::all_close(test::host_copy(gb), gb_ref, gb_tol)) << what << ": grad_b";
}

TEST(GpuLoraBackwardDy, OnePassKernelMatchesCpuOnRaggedShapes) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 7000;
  // M over tiles of 64 rows and their row splits, N over strips of 512 columns (ragged last strip).
  for (auto [m, n, r] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 8, 8}, {7, 136, 16},
                         {63, 520, 32}, {65, 1000, 16}, {130, 4104, 8}, {1000, 1536, 16}, {1000, 8960, 32},
                         {4097, 64, 16}})
    expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, m, n, r, seed += 10);
  expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, 1000, 1536, 16, seed += 10, false, 0.0f);  // written
  expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, 7, 136, 8, seed += 10, false, 0.0f);
}

TEST(GpuLoraBackwardDy, FallbackCasesMatchCpu) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 8000;
  expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, 65, 1001, 16, seed += 10);        // N % 8 != 0
  expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, 65, 520, 12, seed += 10);         // r not 8/16/32
  expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, 65, 520, 64, seed += 10);
  expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, 65, 520, 16, seed += 10, true);   // unaligned dy
  for (MathMode math : {MathMode::FP32, MathMode::TF32, MathMode::BF16})
    expect_lora_backward_dy_matches(DType::F32, math, 130, 520, 16, seed += 10);
  expect_lora_backward_dy_matches(DType::BF16, MathMode::FP32, 65, 1001, 16, seed += 10, false, 0.0f);
}

// ---- the plan cache -----------------------------------------------------------------------------------------------
TEST(GpuGemm, SecondCallHitsThePlanCache) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const std::int64_t m = 37, n = 41, k = 43;  // a shape no other test uses
  for (const Mode& mode : kModes) {
    std::size_t after_first = 0;
    for (int call = 0; call < 3; ++call) {
      // Fresh buffers each call (same shapes, same alignment), different scalars: the plan must still be reused.
      Tensor a = test::random_tensor(mode.ab, {m, k}, 10 + call), b = test::random_tensor(mode.ab, {k, n}, 20 + call);
      Tensor c0 = test::random_tensor(mode.c, {m, n}, 30 + call);
      const GemmOptions opts{1.0f + call, call == 0 ? 0.0f : 0.25f * call, mode.math};
      Tensor ref = test::host_copy(c0);
      gemm(cpu, a, b, ref, opts);
      const std::size_t before = impl_of(gpu).plans.size();
      Tensor c = to_device(c0, gpu.device());
      gemm(gpu, to_device(a, gpu.device()), to_device(b, gpu.device()), c, opts);
      gpu.synchronize();
      const std::size_t after = impl_of(gpu).plans.size();
      if (call == 0) {
        EXPECT_GT(after, before) << mode_text(mode) << ": the first call of a new shape adds a plan";
        after_first = after;
      } else {
        EXPECT_EQ(after, after_first) << mode_text(mode) << ": call " << call << " did not reuse the plan";
      }
      EXPECT_TRUE(test::all_close(test::host_copy(c), ref, tolerance_for(mode, k))) << mode_text(mode);
    }
  }
}

// ---- one Context, several host threads ----------------------------------------------------------------------------
TEST(GpuGemm, ConcurrentThreadsOnOneContext) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  constexpr int kThreads = 4, kJobs = 18, kRepeats = 3;

  struct Job {
    Op op;
    Dims d;
    Mode mode;
    Tensor x, y, ref;  // host
    Tensor dx, dy, dc;  // device
  };
  // Inputs and references are prepared here (the oracle uses OpenMP; no need to oversubscribe it from 4 threads).
  // Shapes differ per thread and job, some recur across threads (same plan key raced for), and BF16-compute jobs
  // of rising size make the scratch grow while other threads enqueue.
  std::vector<std::vector<Job>> jobs(kThreads);
  std::uint64_t seed = 8080;
  for (int t = 0; t < kThreads; ++t)
    for (int j = 0; j < kJobs; ++j) {
      Job job;
      job.op = kAllOps[static_cast<std::size_t>((t + j) % 6)];
      job.mode = kModes[static_cast<std::size_t>((t * 5 + j) % 7)];
      if (j % 3 == 0) job.d = {16 + j, 24 + j, 32};  // shared by all threads
      else job.d = {1 + (t * 37 + j * 11) % 97, 1 + (t * 53 + j * 29) % 89, 1 + (t * 17 + j * 41) % 300};
      if (job.mode.math == MathMode::BF16 && job.mode.ab == DType::F32) job.d.k += 40 * j * (t + 1);
      const Shapes s = shapes_of(job.op, job.d);
      job.x = test::random_tensor(job.mode.ab, s.x, ++seed);
      job.y = test::random_tensor(job.mode.ab, s.y, ++seed);
      job.ref = Tensor(job.mode.c, s.out);
      run_op(cpu, job.op, job.x, job.y, job.ref, {1.0f, 0.0f, job.mode.math});
      job.dx = to_device(job.x, gpu.device());
      job.dy = to_device(job.y, gpu.device());
      job.dc = Tensor(job.mode.c, s.out, gpu.device());
      test::poison(job.dc);
      jobs[static_cast<std::size_t>(t)].push_back(std::move(job));
    }

  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::vector<Job>& mine = jobs[static_cast<std::size_t>(t)];
      try {
        // beta = 0, so repeating a job rewrites the same result.
        for (int r = 0; r < kRepeats; ++r)
          for (Job& job : mine) run_op(gpu, job.op, job.dx, job.dy, job.dc, {1.0f, 0.0f, job.mode.math});
        gpu.synchronize();
        for (Job& job : mine) {
          ::testing::AssertionResult ok =
              test::all_close(test::host_copy(job.dc), job.ref, tolerance_for(job.mode, job.d.k));
          if (!ok)
            failures[static_cast<std::size_t>(t)] +=
                case_text(job.op, job.d, job.mode, 1.0f, 0.0f) + ": " + ok.message() + "\n";
        }
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(t)] += std::string("threw: ") + e.what() + "\n";
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(failures[static_cast<std::size_t>(t)].empty())
      << "thread " << t << ":\n" << failures[static_cast<std::size_t>(t)];
}

// ---- validation on a CUDA context ---------------------------------------------------------------------------------
TEST(GpuGemm, HostTensorOnCudaContextIsDeviceMismatch) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  Tensor ha = test::random_tensor(DType::F32, {7, 5}, 1), hb = test::random_tensor(DType::F32, {5, 9}, 2);
  Tensor hc = test::random_tensor(DType::F32, {7, 9}, 3);
  Tensor da = to_device(ha, gpu.device()), db = to_device(hb, gpu.device()), dc = to_device(hc, gpu.device());
  Tensor hbt = test::random_tensor(DType::F32, {9, 5}, 4), dbt = to_device(hbt, gpu.device());

  EXPECT_TRUE(test::throws_error([&] { gemm(gpu, ha, db, dc); }, ErrorCode::DeviceMismatch, {"gemm", "A is on cpu"}));
  EXPECT_TRUE(test::throws_error([&] { gemm(gpu, da, hb, dc); }, ErrorCode::DeviceMismatch, {"gemm", "B is on cpu"}));
  EXPECT_TRUE(test::throws_error([&] { gemm_bt(gpu, da, dbt, hc); }, ErrorCode::DeviceMismatch,
                                 {"gemm_bt", "C is on cpu"}));
  Tensor hdc = test::random_tensor(DType::F32, {7, 9}, 5);  // dA [7,5] = dC [7,9] · B [5,9]^T
  EXPECT_TRUE(test::throws_error([&] { gemm_backward_a(gpu, hdc, db, da); }, ErrorCode::DeviceMismatch,
                                 {"gemm_backward_a", "dC is on cpu"}));
  Tensor b4 = test::random_tensor(DType::F32, {1, 2, 5, 9}, 6);
  Tensor a4 = to_device(test::random_tensor(DType::F32, {1, 2, 7, 5}, 7), gpu.device());
  Tensor c4 = to_device(test::random_tensor(DType::F32, {1, 2, 7, 9}, 8), gpu.device());
  EXPECT_TRUE(test::throws_error([&] { batched_gemm(gpu, a4, b4, c4); }, ErrorCode::DeviceMismatch,
                                 {"batched_gemm", "B is on cpu"}));
  // Validation happens before any write: the device outputs still hold what they held.
  EXPECT_TRUE(test::bytes_equal(test::host_copy(dc), hc));
  EXPECT_TRUE(test::bytes_equal(test::host_copy(da), ha));
  // And the other way round: device tensors on the CPU context.
  EXPECT_TRUE(test::throws_error([&] { gemm(Context::cpu(), da, db, hc); }, ErrorCode::DeviceMismatch,
                                 {"gemm", "A is on cuda"}));
}

}  // namespace
}  // namespace qmm
