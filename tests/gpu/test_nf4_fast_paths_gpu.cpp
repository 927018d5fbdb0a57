// The NF4 GEMM fast paths against the CPU oracle, forced by path: the small-M kernels (forward, input gradient,
// gate+up), the fused tensor-core kernels (sm_90a; in-loop and shared dequantization) and the fused mma.sync
// kernel (sm_80 on).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "common/test_util.h"
#include "core/nf4_forced.h"
#ifdef QMM_WITH_CUDA
#include "cuda/nf4/nf4_slice.h"
#endif

namespace qmm {
namespace {

struct Problem {
  Nf4Tensor w_host;
  Nf4Tensor w_dev;
};

Nf4Tensor nf4_to_device(const Nf4Tensor& h, Device d) {
  Nf4Tensor out = h;
  out.codes = to_device(h.codes, d);
  out.absmax = to_device(h.absmax, d);
  if (h.absmax2.defined()) out.absmax2 = to_device(h.absmax2, d);
  if (h.code2.defined()) out.code2 = to_device(h.code2, d);
  return out;
}

// Rows scaled by 1 .. 4 in a 13-row cycle, so that neighbouring blocks and absmax2 groups (256 blocks) have
// different scales and a kernel that reads the wrong one fails.
Problem make_weight(std::int64_t n, std::int64_t k, bool dq, std::uint64_t seed,
                    int block_size = kNf4DefaultBlockSize) {
  const Context cpu = Context::cpu();
  Tensor w = test::random_tensor(DType::BF16, {n, k}, seed, -0.05f, 0.05f);
  auto* v = w.data_as<std::uint16_t>();
  for (std::int64_t i = 0; i < n * k; ++i)
    v[i] = float_to_bf16(bf16_to_float(v[i]) * (1.0f + 0.25f * static_cast<float>((i / k) % 13)));
  Problem p;
  p.w_host = nf4_quantize(cpu, w, dq, block_size);
  p.w_dev = nf4_to_device(p.w_host, test::gpu_context()->device());
  return p;
}

// Both sides multiply the same bf16 operands; only summation order differs.
test::Tolerance tolerance_for(DType out, std::int64_t k) {
  return out == DType::BF16 ? test::bf16_output_tolerance(k) : test::fp32_accum_tolerance(k);
}

// The small-M forward with M <= 16 (A bf16 or f32), blocks of 64 and K a multiple of 256 takes the pair kernel,
// which applies the block scale after each block's product (ops.h) where the GPU gives a block its shared memory
// (sm_90: on the H200 it must); elsewhere the table kernel or the GEMV keep the dequantized weight's contract.
// Each is checked against its own fp64 reference to fp32 accumulation precision.
bool scale_after_expected(Nf4Path path, const TensorView& a, const Nf4Weight& w) {
  return (path == nf4_forced::kSmallM || path == Nf4Path::Auto) && a.dim(0) <= 16 && w.block_size == 64 &&
         w.cols % 256 == 0;
}
::testing::AssertionResult forward_close(Nf4Path path, const TensorView& a, const Nf4Weight& w_host,
                                         const TensorView& got, const TensorView& exact, const TensorView& c0,
                                         float alpha, float beta, test::Tolerance tol) {
  if (!scale_after_expected(path, a, w_host)) return test::all_close(got, exact, tol);
  const Tensor after = test::nf4_scale_after_reference(a, w_host, c0, alpha, beta);
  if (test::gpu_context()->info().compute_capability == 90) return test::all_close(got, after, tol);
  return test::nf4_forward_close(got, exact, after, tol);
}

using Shape3 = std::tuple<std::int64_t, std::int64_t, std::int64_t>;  // M, N, K

// Every scale format, A and C dtype, and beta in {0, 1} (C poisoned when beta is 0).
void expect_forward_matches(Nf4Path path, std::int64_t m, std::int64_t n, std::int64_t k, int block_size) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = static_cast<std::uint64_t>(m * 1000003 + n * 1009 + k);
  for (bool dq : {false, true})
    for (DType adt : {DType::BF16, DType::F32})
      for (DType cdt : {DType::F32, DType::BF16}) {
        Problem p = make_weight(n, k, dq, ++seed, block_size);
        Tensor a = test::random_tensor(adt, {m, k}, ++seed);
        Tensor c0 = test::random_tensor(cdt, {m, n}, ++seed);
        for (float beta : {0.0f, 1.0f}) {
          const Nf4GemmOptions opts{0.75f, beta, path};
          Tensor ref = test::host_copy(c0);
          nf4_gemm(cpu, a, p.w_host, ref, {0.75f, beta, Nf4Path::Auto});
          Tensor c = to_device(c0, gpu.device());
          if (beta == 0.0f) test::poison(c);
          nf4_gemm(gpu, to_device(a, gpu.device()), p.w_dev, c, opts);
          gpu.synchronize();
          EXPECT_TRUE(forward_close(path, a, p.w_host, test::host_copy(c), ref, c0, 0.75f, beta, tolerance_for(cdt, k)))
              << nf4_path_name(path) << " M=" << m << " N=" << n << " K=" << k << " block=" << block_size
              << " dq=" << dq << " a=" << dtype_name(adt) << " c=" << dtype_name(cdt) << " beta=" << beta;
        }
      }
}

class SmallMForward : public ::testing::TestWithParam<Shape3> {};

TEST_P(SmallMForward, MatchesCpuOracle) {
  QMM_REQUIRE_GPU();
  const auto [m, n, k] = GetParam();
  expect_forward_matches(nf4_forced::kSmallM, m, n, k, kNf4DefaultBlockSize);
}

// M = 2-16 with K a multiple of 256 take the pair kernel (N ragged around its 16-row units, one and two n8
// tiles, one split and up to 16 (18432), and on an H200 (132 SMs) two splits in three rounds: 36000 rows), bf16 A
// read directly but for 9-16 rows with K >= 4096 (13 x 70 x 18432), f32 A packed first by a kernel of its own;
// other K or M, the table kernel: one n8 tile of A rows (M <= 8), two (<= 16) or four;
// K not a multiple of the 256-element span (64, 192, 320, 576: lanes past K idle), N ragged around the 16-row warp
// tile and the 128-row block, split-K with a partial last span (4160 = 65 blocks) and with many splits (18432).
INSTANTIATE_TEST_SUITE_P(Shapes, SmallMForward,
                         ::testing::Values(Shape3{2, 1, 64}, Shape3{3, 63, 192}, Shape3{7, 1000, 576},
                                           Shape3{8, 129, 4160}, Shape3{9, 65, 1536}, Shape3{16, 129, 1536},
                                           Shape3{17, 257, 512}, Shape3{32, 300, 1024}, Shape3{5, 14336 / 16, 4096},
                                           Shape3{13, 70, 18432}, Shape3{3, 1537, 1536}, Shape3{9, 1000, 512},
                                           Shape3{16, 300, 256}, Shape3{6, 5000, 1024},
                                           Shape3{4, 36000, 1024}, Shape3{12, 77, 320}));

// M = 1: K a multiple of 256 takes the pair kernel (2048, 18432, 4096; 40000 x 256: one unit per row group, two
// rounds on an H200), bf16 A read directly, f32 A packed first; other K (64, 4160) the GEMV kernel: one k group
// with 1 and all 32 lanes busy, three groups on six warps (65 chunks), and enough rows per block (10560 on an
// H200: 40 per block, 5 per warp) that each warp's ring of code rows wraps around.
INSTANTIATE_TEST_SUITE_P(Gemv, SmallMForward,
                         ::testing::Values(Shape3{1, 1, 64}, Shape3{1, 63, 2048}, Shape3{1, 1000, 4160},
                                           Shape3{1, 130, 18432}, Shape3{1, 10560, 64}, Shape3{1, 2050, 4096},
                                           Shape3{1, 40000, 256}));

#ifdef QMM_WITH_CUDA  // the slice kernel's own entry points
// The scale formats and A and C dtypes a slice-kernel case runs: all eight, or on the large shapes (there for
// their schedule: several passes per block), two that between them take each once, to keep the fp64 reference
// to seconds.
struct SliceConfig {
  bool dq;
  DType a, c;
};
std::vector<SliceConfig> slice_configs(std::int64_t m, std::int64_t n, std::int64_t k) {
  if (m * n * k > 100'000'000) return {{true, DType::BF16, DType::F32}, {false, DType::F32, DType::BF16}};
  std::vector<SliceConfig> all;
  for (bool dq : {false, true})
    for (DType adt : {DType::BF16, DType::F32})
      for (DType cdt : {DType::F32, DType::BF16}) all.push_back({dq, adt, cdt});
  return all;
}

// The scale-after reference's plain sums of A * dequant(W)^T, fp32.
Tensor slice_sums(const TensorView& a, const Nf4Weight& w) {
  return test::nf4_scale_after_reference(a, w, Tensor(DType::F32, {a.dim(0), w.rows}), 1.0f, 0.0f);
}

// The slice kernel, launched through its entry point, against the scale-after reference to fp32 accumulation
// precision, every scale format, A and C dtype (slice_configs) and beta in {0, 1} (C poisoned when beta is 0).
class SmallMSlice : public ::testing::TestWithParam<Shape3> {};

TEST_P(SmallMSlice, MatchesScaleAfterReference) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const auto [m, n, k] = GetParam();
  std::uint64_t seed = static_cast<std::uint64_t>(m * 4099 + n * 37 + k);
  for (const auto& [dq, adt, cdt] : slice_configs(m, n, k)) {
    Problem p = make_weight(n, k, dq, ++seed);
    Tensor a = test::random_tensor(adt, {m, k}, ++seed);
    Tensor c0 = test::random_tensor(cdt, {m, n}, ++seed);
    const Tensor a_dev = to_device(a, gpu.device());
    if (!cuda::nf4_small_m_slice_supported(gpu, a_dev, p.w_dev))
      GTEST_SKIP() << "the slice kernel needs sm_90's shared memory per block";
    const Tensor sums = slice_sums(a, p.w_host);
    for (float beta : {0.0f, 1.0f}) {
      Tensor c = to_device(c0, gpu.device());
      if (beta == 0.0f) test::poison(c);
      cuda::launch_nf4_gemm_small_m_slice(gpu, a_dev, p.w_dev, c, 0.75f, beta);
      gpu.synchronize();
      const Tensor want = test::scaled_output(sums, c0, 0.75f, beta);
      EXPECT_TRUE(test::all_close(test::host_copy(c), want, tolerance_for(cdt, k)))
          << "M=" << m << " N=" << n << " K=" << k << " dq=" << dq << " a=" << dtype_name(adt)
          << " c=" << dtype_name(cdt) << " beta=" << beta;
    }
  }
}

// K = 256 .. 4096 in one split (one slice: 16 warps per slice; six: two per slice, four warps idle; 13: one,
// three idle), K > 4096 split over blocks (4352: 17 slices, two splits of 9 and 8, so one warp of the second split
// idles; 18432: five splits, the last of 12 slices; 14336: the Llama down projection's four); N ragged around the
// 16-row group (1, 17, 1000), large enough for two passes of row groups per block at 8 rows (12000 x 4096: 6 row
// groups per block on an H200, the sums of 5 per pass) and at 16 (5000 x 4096: 3 per block, 2 per pass), and with
// row groups that do not divide evenly among a block's warps (8960 x 1536, Qwen gate/up: 5 per block, 2 warps per
// slice); 9-16 rows take the two-tile instance (9, 13 with a K split, 16).
INSTANTIATE_TEST_SUITE_P(Shapes, SmallMSlice,
                         ::testing::Values(Shape3{1, 1, 256}, Shape3{8, 17, 256}, Shape3{3, 1000, 1536},
                                           Shape3{7, 65, 3328}, Shape3{1, 300, 4096}, Shape3{8, 300, 4352},
                                           Shape3{5, 63, 18432}, Shape3{2, 129, 14336}, Shape3{8, 12000, 4096},
                                           Shape3{1, 8960, 1536}, Shape3{4, 2300, 4096}, Shape3{9, 65, 1024},
                                           Shape3{13, 300, 4352}, Shape3{16, 5000, 4096}));

// gate_up through the slice kernel (its direct launch): gate and up against the scale-after reference,
// h against silu(gate) * up of those, with every output, gate and up only accumulating (beta 1; C not poisoned),
// and h alone; the scale formats and dtypes of slice_configs (its C dtype for gate).
class SmallMSliceGateUp : public ::testing::TestWithParam<Shape3> {};

TEST_P(SmallMSliceGateUp, MatchesScaleAfterReference) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const auto [m, n, k] = GetParam();
  std::uint64_t seed = static_cast<std::uint64_t>(m * 8191 + n * 131 + k);
  const float alpha = 0.75f;
  for (const auto& [dq, adt, gdt] : slice_configs(m, n, k)) {  // gate in gdt, up and h in bf16
    Problem wg = make_weight(n, k, dq, ++seed), wu = make_weight(n, k, dq, ++seed);
    const Tensor a = test::random_tensor(adt, {m, k}, ++seed);
    const Tensor g0 = test::random_tensor(gdt, {m, n}, ++seed);
    const Tensor u0 = test::random_tensor(DType::BF16, {m, n}, ++seed);
    const Tensor a_dev = to_device(a, gpu.device());
    if (!cuda::nf4_small_m_slice_supported(gpu, a_dev, wg.w_dev))
      GTEST_SKIP() << "the slice kernel needs sm_90's shared memory per block";
    // h from fp32 gate and up, as the kernel forms it.
    const Tensor g_sums = slice_sums(a, wg.w_host), u_sums = slice_sums(a, wu.w_host);
    const Tensor f32_zero = test::filled(DType::F32, {m, n}, 0.0f);
    Tensor h_ref(DType::F32, {m, n});
    swiglu(cpu, test::scaled_output(g_sums, f32_zero, alpha, 0.0f), test::scaled_output(u_sums, f32_zero, alpha, 0.0f),
           h_ref);
    const std::string what = "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k) +
                             " dq=" + std::to_string(dq) + " a=" + dtype_name(adt) + " gate=" + dtype_name(gdt);
    for (int form = 0; form < 3; ++form) {  // all three outputs; gate and up with beta 1; h alone
      const float beta = form == 1 ? 1.0f : 0.0f;
      Tensor dg = to_device(g0, gpu.device()), du = to_device(u0, gpu.device());
      Tensor dh(DType::BF16, {m, n}, gpu.device());
      if (beta == 0.0f) {
        test::poison(dg);
        test::poison(du);
      }
      test::poison(dh);
      const GateUpOutputs out{form == 2 ? TensorView() : TensorView(dg), form == 2 ? TensorView() : TensorView(du),
                              form == 1 ? TensorView() : TensorView(dh)};
      cuda::launch_nf4_gate_up_small_m_slice(gpu, a_dev, wg.w_dev, wu.w_dev, out, alpha, beta);
      gpu.synchronize();
      if (form != 2) {
        EXPECT_TRUE(
            test::all_close(test::host_copy(dg), test::scaled_output(g_sums, g0, alpha, beta), tolerance_for(gdt, k)))
            << what << " gate";
        EXPECT_TRUE(test::all_close(test::host_copy(du), test::scaled_output(u_sums, u0, alpha, beta),
                                    test::bf16_output_tolerance(k)))
            << what << " up";
      }
      if (form != 1)
        EXPECT_TRUE(test::all_close(test::host_copy(dh), h_ref, test::bf16_output_tolerance(k))) << what << " h";
    }
  }
}

// One pass per block and several (5000 x 4096: two, the pass shortened to an even 4 groups; 16 x 2500 x 4096:
// two of 2), 1-3 warps per slice (1536: 2; 1280: 3, an odd pass that takes all of a block's groups at once), K
// split (4352: partials of both weights summed by gate_up's reduction kernel), N ragged, one and two n8 tiles.
INSTANTIATE_TEST_SUITE_P(Shapes, SmallMSliceGateUp,
                         ::testing::Values(Shape3{1, 333, 1024}, Shape3{8, 300, 4352}, Shape3{3, 1000, 1536},
                                           Shape3{5, 200, 1280}, Shape3{7, 65, 3328}, Shape3{8, 5000, 4096},
                                           Shape3{12, 1000, 1536}, Shape3{16, 2500, 4096}, Shape3{10, 65, 4352}));

// A forced slice kernel that cannot take the problem throws instead of launching (nothing written): K not a
// multiple of 256, more than 16 rows, gate and up in different scale formats.
TEST(SmallMSliceArgs, UnsupportedProblemThrows) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  Problem p = make_weight(16, 320, true, 5);  // K not a multiple of 256
  const Tensor a = to_device(test::random_tensor(DType::BF16, {4, 320}, 6), gpu.device());
  Tensor c = to_device(test::random_tensor(DType::F32, {4, 16}, 7), gpu.device());
  const Tensor before = test::host_copy(c);
  EXPECT_THROW(cuda::launch_nf4_gemm_small_m_slice(gpu, a, p.w_dev, c, 1.0f, 0.0f), Error);
  Problem p17 = make_weight(16, 256, true, 8);
  const Tensor a17 = to_device(test::random_tensor(DType::BF16, {17, 256}, 9), gpu.device());
  Tensor c17 = to_device(test::random_tensor(DType::F32, {17, 16}, 10), gpu.device());
  EXPECT_THROW(cuda::launch_nf4_gemm_small_m_slice(gpu, a17, p17.w_dev, c17, 1.0f, 0.0f),
               Error);
  // gate_up: one kernel instance serves both weights, so their scale formats must agree.
  Problem plain = make_weight(16, 256, false, 11), dq = make_weight(16, 256, true, 12);
  const Tensor a4 = to_device(test::random_tensor(DType::BF16, {4, 256}, 13), gpu.device());
  Tensor g = to_device(test::random_tensor(DType::F32, {4, 16}, 14), gpu.device());
  const Tensor g_before = test::host_copy(g);
  EXPECT_THROW(cuda::launch_nf4_gate_up_small_m_slice(gpu, a4, plain.w_dev, dq.w_dev, {g, TensorView(), TensorView()}, 1.0f,
                                                0.0f),
               Error);
  gpu.synchronize();
  EXPECT_TRUE(test::bytes_equal(test::host_copy(c), before));
  EXPECT_TRUE(test::bytes_equal(test::host_copy(g), g_before));
}

// The forced path small_m_slice through the public entry points runs the same kernel as the direct launches: bit
// for bit, nf4_gemm and nf4_gate_up (with h), one and two n8 tiles; the input gradient refuses it.
TEST(SmallMSliceArgs, ForcedPathIsTheDirectLaunch) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  std::uint64_t seed = 21;
  for (std::int64_t m : {1, 7, 16}) {
    Problem wg = make_weight(300, 1024, true, ++seed), wu = make_weight(300, 1024, true, ++seed);
    const Tensor a = to_device(test::random_tensor(DType::BF16, {m, 1024}, ++seed), gpu.device());
    if (!cuda::nf4_small_m_slice_supported(gpu, a, wg.w_dev))
      GTEST_SKIP() << "the slice kernel needs sm_90's shared memory per block";
    const Nf4GemmOptions slice{0.5f, 0.0f, nf4_forced::kSmallMSlice};
    Tensor c(DType::BF16, {m, 300}, gpu.device()), c_direct(DType::BF16, {m, 300}, gpu.device());
    test::poison(c);
    nf4_gemm(gpu, a, wg.w_dev, c, slice);
    cuda::launch_nf4_gemm_small_m_slice(gpu, a, wg.w_dev, c_direct, 0.5f, 0.0f);
    Tensor h(DType::BF16, {m, 300}, gpu.device()), h_direct(DType::BF16, {m, 300}, gpu.device());
    test::poison(h);
    nf4_gate_up(gpu, a, wg.w_dev, wu.w_dev, {TensorView(), TensorView(), h}, slice);
    cuda::launch_nf4_gate_up_small_m_slice(gpu, a, wg.w_dev, wu.w_dev, {TensorView(), TensorView(), h_direct}, 0.5f,
                                           0.0f);
    gpu.synchronize();
    EXPECT_TRUE(test::bytes_equal(test::host_copy(c), test::host_copy(c_direct))) << "M=" << m;
    EXPECT_TRUE(test::bytes_equal(test::host_copy(h), test::host_copy(h_direct))) << "M=" << m;
    const Tensor dc = to_device(test::random_tensor(DType::BF16, {m, 300}, ++seed), gpu.device());
    Tensor da(DType::BF16, {m, 1024}, gpu.device());
    EXPECT_THROW(nf4_gemm_backward_a(gpu, dc, wg.w_dev, da, slice), Error);
  }
}

// Auto takes the slice kernel for bf16 rows where it fits: from 2 rows to 16, and at one row where N >= K (gate and
// up) or for gate_up; one row of a weight with N < K (down) stays with the pair kernel. Bit for bit against the
// direct launches.
TEST(SmallMSliceArgs, AutoTakesItForBf16Rows) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  std::uint64_t seed = 41;
  for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{1024, 512}, {300, 1024}}) {
    Problem wg = make_weight(n, k, true, ++seed), wu = make_weight(n, k, true, ++seed);
    for (std::int64_t m : {1, 2, 16}) {
      const Tensor a = to_device(test::random_tensor(DType::BF16, {m, k}, ++seed), gpu.device());
      if (!cuda::nf4_small_m_slice_supported(gpu, a, wg.w_dev))
        GTEST_SKIP() << "the slice kernel needs sm_90's shared memory per block";
      const bool slice = m >= 2 || n >= k;
      Tensor c(DType::BF16, {m, n}, gpu.device()), c_want(DType::BF16, {m, n}, gpu.device());
      test::poison(c);
      nf4_gemm(gpu, a, wg.w_dev, c);
      if (slice) cuda::launch_nf4_gemm_small_m_slice(gpu, a, wg.w_dev, c_want, 1.0f, 0.0f);
      else nf4_gemm(gpu, a, wg.w_dev, c_want, {1.0f, 0.0f, nf4_forced::kSmallM});
      Tensor h(DType::BF16, {m, n}, gpu.device()), h_want(DType::BF16, {m, n}, gpu.device());
      test::poison(h);
      nf4_gate_up(gpu, a, wg.w_dev, wu.w_dev, {TensorView(), TensorView(), h});
      cuda::launch_nf4_gate_up_small_m_slice(gpu, a, wg.w_dev, wu.w_dev, {TensorView(), TensorView(), h_want}, 1.0f,
                                             0.0f);
      gpu.synchronize();
      EXPECT_TRUE(test::bytes_equal(test::host_copy(c), test::host_copy(c_want))) << "N=" << n << " M=" << m;
      EXPECT_TRUE(test::bytes_equal(test::host_copy(h), test::host_copy(h_want))) << "N=" << n << " M=" << m;
    }
  }
}
#endif

// Both scale formats and dC/dA dtypes, beta in {0, 1} (dA poisoned when beta is 0).
void expect_backward_matches(Nf4Path path, std::int64_t m, std::int64_t n, std::int64_t k, int block_size) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = static_cast<std::uint64_t>(m * 7919 + n * 31 + k);
  for (bool dq : {false, true})
    for (DType dt : {DType::BF16, DType::F32}) {
      Problem p = make_weight(n, k, dq, ++seed, block_size);
      Tensor dc = test::random_tensor(dt, {m, n}, ++seed);
      Tensor da0 = test::random_tensor(dt, {m, k}, ++seed);
      for (float beta : {0.0f, 1.0f}) {
        Tensor ref = test::host_copy(da0);
        nf4_gemm_backward_a(cpu, dc, p.w_host, ref, {1.25f, beta, Nf4Path::Auto});
        Tensor da = to_device(da0, gpu.device());
        if (beta == 0.0f) test::poison(da);
        nf4_gemm_backward_a(gpu, to_device(dc, gpu.device()), p.w_dev, da, {1.25f, beta, path});
        gpu.synchronize();
        EXPECT_TRUE(test::all_close(test::host_copy(da), ref, tolerance_for(dt, n)))
            << nf4_path_name(path) << " M=" << m << " N=" << n << " K=" << k << " block=" << block_size
            << " dq=" << dq << " dtype=" << dtype_name(dt) << " beta=" << beta;
      }
    }
}

class SmallMBackward : public ::testing::TestWithParam<Shape3> {};

TEST_P(SmallMBackward, MatchesCpuOracle) {
  QMM_REQUIRE_GPU();
  const auto [m, n, k] = GetParam();
  expect_backward_matches(nf4_forced::kSmallM, m, n, k, kNf4DefaultBlockSize);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SmallMBackward,
                         ::testing::Values(Shape3{1, 1, 32}, Shape3{1, 7, 96}, Shape3{8, 130, 544},
                                           Shape3{9, 1000, 256}, Shape3{16, 2050, 1536}, Shape3{3, 4096, 1024}));

// Blocks larger than the default 64, straddling rows (K = 576 and 544 are not multiples of 128, 256 or 1024).
TEST(SmallMBlockSizes, ForwardAndInputGradientMatchCpuOracle) {
  QMM_REQUIRE_GPU();
  for (int block : {128, 256, 1024}) {
    expect_forward_matches(nf4_forced::kSmallM, 5, 130, 576, block);  // the table kernel
    expect_forward_matches(nf4_forced::kSmallM, 1, 130, 576, block);  // the GEMV kernel
    expect_backward_matches(nf4_forced::kSmallM, 3, 130, 544, block);
  }
}

// Every combination of requested outputs (gate, up in f32; h in bf16) against the CPU, A in `adt`. With beta != 0
// gate and up start from random values and accumulate (h cannot be requested then).
void expect_gate_up_matches(Nf4Path path, std::int64_t m, std::int64_t n, std::int64_t k, DType adt,
                            float beta = 0.0f) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  Problem g = make_weight(n, k, true, 11), u = make_weight(n, k, true, 12);
  Tensor a = test::random_tensor(adt, {m, k}, 13);
  const Tensor g0 = test::random_tensor(DType::F32, {m, n}, 14), u0 = test::random_tensor(DType::F32, {m, n}, 15);
  Tensor rg = test::host_copy(g0), ru = test::host_copy(u0), rh(DType::F32, {m, n});
  nf4_gate_up(cpu, a, g.w_host, u.w_host, {rg, ru, beta != 0.0f ? TensorView() : TensorView(rh)}, {1.0f, beta});
  // h from the scale-after contract's gate and up where that contract may apply (the pair kernel; sm_90 takes it
  // where it fits): at large K the two contracts' gate and up differ by more than h's bf16 rounding.
  const bool after = scale_after_expected(path, a, g.w_host);
  Tensor rh_after(DType::F32, {m, n});
  if (after && beta == 0.0f)
    swiglu(cpu, test::nf4_scale_after_reference(a, g.w_host, g0, 1.0f, 0.0f),
           test::nf4_scale_after_reference(a, u.w_host, u0, 1.0f, 0.0f), rh_after);
  const bool sm90 = test::gpu_context()->info().compute_capability == 90;
  Tensor ad = to_device(a, gpu.device());
  for (int mask = 1; mask < (beta != 0.0f ? 4 : 8); ++mask) {
    Tensor dg = to_device(g0, gpu.device()), du = to_device(u0, gpu.device()), dh(DType::BF16, {m, n}, gpu.device());
    if (beta == 0.0f) {
      test::poison(dg);
      test::poison(du);
    }
    test::poison(dh);
    GateUpOutputs out{(mask & 1) ? TensorView(dg) : TensorView(), (mask & 2) ? TensorView(du) : TensorView(),
                      (mask & 4) ? TensorView(dh) : TensorView()};
    nf4_gate_up(gpu, ad, g.w_dev, u.w_dev, out, {1.0f, beta, path});
    gpu.synchronize();
    const std::string what =
        std::string(nf4_path_name(path)) + " mask " + std::to_string(mask) + " beta " + std::to_string(beta);
    const test::Tolerance tol = test::fp32_accum_tolerance(k);
    if (mask & 1)
      EXPECT_TRUE(forward_close(path, a, g.w_host, test::host_copy(dg), rg, g0, 1.0f, beta, tol)) << what;
    if (mask & 2)
      EXPECT_TRUE(forward_close(path, a, u.w_host, test::host_copy(du), ru, u0, 1.0f, beta, tol)) << what;
    // h = silu(gate) * up: within bf16 rounding of that of the contract that applies (either, off sm_90).
    if (mask & 4) {
      const test::Tolerance h_tol = test::bf16_output_tolerance(k);
      const Tensor got = test::host_copy(dh);
      EXPECT_TRUE(!after ? test::all_close(got, rh, h_tol)
                  : sm90 ? test::all_close(got, rh_after, h_tol)
                         : test::nf4_forward_close(got, rh, rh_after, h_tol))
          << what;
    }
  }
}

TEST(SmallMGateUp, AllOutputCombinationsMatchCpu) {
  QMM_REQUIRE_GPU();
  expect_gate_up_matches(nf4_forced::kSmallM, 7, 333, 1088, DType::BF16);
  expect_gate_up_matches(nf4_forced::kSmallM, 7, 333, 1024, DType::BF16);  // the pair kernel, both weights in a launch
  expect_gate_up_matches(nf4_forced::kSmallM, 2, 20000, 256, DType::BF16);  // the same in two rounds (132 SMs)
  expect_gate_up_matches(nf4_forced::kSmallM, 3, 200, 4352, DType::BF16);  // the pair kernel, 17 steps of 256 k
  expect_gate_up_matches(nf4_forced::kSmallM, 12, 333, 1024, DType::F32);  // two n8 tiles, f32 A packed first
  expect_gate_up_matches(nf4_forced::kSmallM, 20, 70, 576, DType::F32);  // four n8 tiles of A rows
  expect_gate_up_matches(nf4_forced::kSmallM, 1, 333, 1088, DType::F32);  // the GEMV kernel, both weights in a launch
}

// Whether a forced path runs on this build and GPU: one that cannot raises Unsupported (tested below). The fused
// kernel (Fused) needs an sm_90a build on Hopper; the development kernels need a QMM_DEV_KERNELS build too, with
// sm_90a on Hopper for the shared-dequantization one (FusedShared), compute capability 8.0 for mma.sync (FusedMma).
bool path_available(Nf4Path path) {
  Context& gpu = *test::gpu_context();
  Problem p = make_weight(64, 64, false, 1);
  Tensor a(DType::BF16, {1, 64}, gpu.device()), c(DType::F32, {1, 64}, gpu.device());
  try {
    nf4_gemm(gpu, a, p.w_dev, c, {1, 0, path});
  } catch (const Error& e) {
    if (e.code() == ErrorCode::Unsupported) return false;
    throw;
  }
  return true;
}
bool fused_available() { return path_available(Nf4Path::Fused); }
bool fused_mma_available() { return path_available(nf4_forced::kFusedMma); }
bool fused_shared_available() { return path_available(nf4_forced::kFusedShared); }  // also a QMM_DEV_KERNELS build

// The fused wgmma paths this build runs: Fused, and FusedShared where the development kernels are built.
std::vector<Nf4Path> fused_paths() {
  std::vector<Nf4Path> paths{Nf4Path::Fused};
  if (fused_shared_available()) paths.push_back(nf4_forced::kFusedShared);
  return paths;
}

using FusedShape = std::tuple<std::int64_t, std::int64_t, std::int64_t, int>;  // M, N, K, block size

// Both fused suites skip where the kernel cannot run.
class FusedCase : public ::testing::TestWithParam<FusedShape> {
 protected:
  void SetUp() override {
    QMM_REQUIRE_GPU();
    if (!fused_available()) GTEST_SKIP() << "the fused kernel needs an sm_90a build on a Hopper GPU";
  }
};

class FusedForward : public FusedCase {};

// Both fused kernels: dequantization in the main loop (Fused) and once per tile through the workspace
// (FusedShared).
TEST_P(FusedForward, MatchesCpuOracle) {
  const auto [m, n, k, block] = GetParam();
  for (Nf4Path path : fused_paths()) expect_forward_matches(path, m, n, k, block);
}

// Ragged M and N around the 256 x 128 tile, one and many k steps, block sizes 64 and 256.
INSTANTIATE_TEST_SUITE_P(Shapes, FusedForward,
                         ::testing::Values(FusedShape{1, 1, 64, 64}, FusedShape{7, 130, 128, 64},
                                           FusedShape{65, 257, 576, 64}, FusedShape{256, 128, 320, 64},
                                           FusedShape{300, 1000, 1536, 64}, FusedShape{513, 129, 64, 64},
                                           FusedShape{257, 200, 1024, 256}, FusedShape{1000, 63, 2048, 64}));

class FusedBackward : public FusedCase {};

TEST_P(FusedBackward, MatchesCpuOracle) {
  const auto [m, n, k, block] = GetParam();
  for (Nf4Path path : fused_paths()) expect_backward_matches(path, m, n, k, block);
}

// N (the reduction) ragged against the 64-row stage, K not a multiple of the 128-column tile, ragged M.
INSTANTIATE_TEST_SUITE_P(Shapes, FusedBackward,
                         ::testing::Values(FusedShape{1, 8, 64, 64}, FusedShape{7, 200, 192, 64},
                                           FusedShape{300, 520, 320, 64}, FusedShape{257, 64, 1024, 64},
                                           FusedShape{65, 256, 512, 256}, FusedShape{1000, 1536, 256, 64}));

// gate_up on the fused path: the fused forward once per projection (ragged M and N, f32 and bf16 A).
TEST(FusedGateUp, AllOutputCombinationsMatchCpu) {
  QMM_REQUIRE_GPU();
  if (!fused_available()) GTEST_SKIP() << "the fused kernel needs an sm_90a build on a Hopper GPU";
  expect_gate_up_matches(Nf4Path::Fused, 65, 130, 1024, DType::BF16);
  expect_gate_up_matches(Nf4Path::Fused, 300, 257, 576, DType::F32);
  if (fused_shared_available()) expect_gate_up_matches(nf4_forced::kFusedShared, 300, 257, 576, DType::BF16);
}

// Accumulating gate and up (beta != 0, no h) on every path that can take the problem.
TEST(GateUpBeta, AccumulatesOnEveryPathLikeTheCpu) {
  QMM_REQUIRE_GPU();
  expect_gate_up_matches(nf4_forced::kSmallM, 7, 333, 1088, DType::BF16, 1.0f);
  expect_gate_up_matches(nf4_forced::kSmallM, 12, 600, 512, DType::BF16, 1.0f);  // the pair kernel
  expect_gate_up_matches(nf4_forced::kSmallM, 1, 130, 576, DType::F32, -0.5f);  // the GEMV kernel
  expect_gate_up_matches(Nf4Path::DequantGemm, 65, 130, 576, DType::BF16, 1.0f);
  if (fused_available()) expect_gate_up_matches(Nf4Path::Fused, 65, 130, 1024, DType::BF16, 1.0f);
}

// The shared-dequantization kernel at a training size: the CPU oracle is too slow there, so the GPU's dequantize +
// cuBLASLt path, itself tested against the oracle, is the reference. 256 CTAs in two waves: a strip's CTAs are
// not all resident at once, so some claim and dequantize tiles that other CTAs then wait for.
TEST(FusedPath, LargeSharedDequantMatchesDequantGemm) {
  QMM_REQUIRE_GPU();
  if (!fused_shared_available())
    GTEST_SKIP() << "the shared-dequantization kernel needs a QMM_DEV_KERNELS build with sm_90a on a Hopper GPU";
  Context& gpu = *test::gpu_context();
  const std::int64_t m = 2048, n = 4096, k = 8192;
  const Nf4Tensor w = nf4_quantize(gpu, to_device(test::random_tensor(DType::BF16, {n, k}, 91, -0.05f, 0.05f),
                                                  gpu.device()), true);
  const Tensor a = to_device(test::random_tensor(DType::BF16, {m, k}, 92), gpu.device());
  Tensor c_shared(DType::F32, {m, n}, gpu.device()), c_ref(DType::F32, {m, n}, gpu.device());
  test::poison(c_shared);
  nf4_gemm(gpu, a, w, c_shared, {1.0f, 0.0f, nf4_forced::kFusedShared});
  nf4_gemm(gpu, a, w, c_ref, {1.0f, 0.0f, Nf4Path::DequantGemm});
  gpu.synchronize();
  EXPECT_TRUE(test::all_close(test::host_copy(c_shared), test::host_copy(c_ref), test::fp32_accum_tolerance(k)));
}

// With a bf16 output and more tiles than SMs the shared-dequantization kernel runs a persistent grid: each CTA
// loops over tiles, loading and claiming for the next while its epilogue stores the current one (TMA boxes with
// beta = 0, 64 staged rows at a time with beta = 1).
// 150 tiles each way (ragged M, a ragged last strip: 6392 outputs forward, 6336 = 99 x 64 for the input
// gradient, whose K must be a multiple of 64), bf16 out, beta 0 and 1, against dequantize + cuBLASLt.
TEST(FusedPath, SharedDequantPersistentGridMatchesDequantGemm) {
  QMM_REQUIRE_GPU();
  if (!fused_shared_available())
    GTEST_SKIP() << "the shared-dequantization kernel needs a QMM_DEV_KERNELS build with sm_90a on a Hopper GPU";
  Context& gpu = *test::gpu_context();
  const std::int64_t m = 600, narrow = 256;  // 3 x 50 tiles of 256 x 128
  for (bool backward : {false, true}) {
    const std::int64_t wide = backward ? 6336 : 6392;
    const std::int64_t n = backward ? narrow : wide, k = backward ? wide : narrow;  // W [n, k]
    const std::int64_t n_out = backward ? k : n, k_red = backward ? n : k;
    const Nf4Tensor w = nf4_quantize(gpu, to_device(test::random_tensor(DType::BF16, {n, k}, 93, -0.05f, 0.05f),
                                                    gpu.device()), true);
    const Tensor a = to_device(test::random_tensor(DType::BF16, {m, k_red}, 94), gpu.device());
    const Tensor c0 = to_device(test::random_tensor(DType::BF16, {m, n_out}, 95), gpu.device());
    for (float beta : {0.0f, 1.0f}) {
      Tensor c_shared(DType::BF16, {m, n_out}, gpu.device()), c_ref(DType::BF16, {m, n_out}, gpu.device());
      copy(gpu, c_shared, c0);
      copy(gpu, c_ref, c0);
      if (beta == 0.0f) test::poison(c_shared);
      const Nf4GemmOptions shared{1.0f, beta, nf4_forced::kFusedShared}, ref{1.0f, beta, Nf4Path::DequantGemm};
      if (backward) {
        nf4_gemm_backward_a(gpu, a, w, c_shared, shared);
        nf4_gemm_backward_a(gpu, a, w, c_ref, ref);
      } else {
        nf4_gemm(gpu, a, w, c_shared, shared);
        nf4_gemm(gpu, a, w, c_ref, ref);
      }
      gpu.synchronize();
      EXPECT_TRUE(test::all_close(test::host_copy(c_shared), test::host_copy(c_ref),
                                  test::bf16_output_tolerance(k_red)))
          << (backward ? "input gradient" : "forward") << " beta=" << beta;
    }
  }
}

class FusedMmaCase : public ::testing::TestWithParam<FusedShape> {
 protected:
  void SetUp() override {
    QMM_REQUIRE_GPU();
    if (!fused_mma_available())
      GTEST_SKIP() << "the mma.sync fused kernel needs a QMM_DEV_KERNELS build and compute capability 8.0 or newer";
  }
};

class FusedMmaForward : public FusedMmaCase {};

TEST_P(FusedMmaForward, MatchesCpuOracle) {
  const auto [m, n, k, block] = GetParam();
  expect_forward_matches(nf4_forced::kFusedMma, m, n, k, block);
}

// Ragged M and N around the 128 x 128 tile, one stage (K = 64) and many, block sizes 64 to 1024; split-K where the
// tiles leave SMs idle (7 x 130 x 2048: 2 tiles, 8 splits of 4 stages; 300 x 63: 3 tiles) and none where they fill
// the GPU (129 x 8400: 132 tiles of which the last row and column are ragged).
INSTANTIATE_TEST_SUITE_P(Shapes, FusedMmaForward,
                         ::testing::Values(FusedShape{1, 1, 64, 64}, FusedShape{7, 130, 128, 64},
                                           FusedShape{7, 130, 2048, 64}, FusedShape{65, 257, 576, 64},
                                           FusedShape{128, 128, 320, 128}, FusedShape{300, 63, 2048, 64},
                                           FusedShape{257, 200, 1024, 256}, FusedShape{130, 70, 2048, 1024},
                                           FusedShape{129, 8400, 128, 64}, FusedShape{300, 1000, 1536, 64}));

class FusedMmaBackward : public FusedMmaCase {};

TEST_P(FusedMmaBackward, MatchesCpuOracle) {
  const auto [m, n, k, block] = GetParam();
  expect_backward_matches(nf4_forced::kFusedMma, m, n, k, block);
}

// N (the reduction) ragged against the 64-row stage, K not a multiple of the 128-column tile (192, 320: half a
// tile), ragged M, split-K (few tiles) and none (129 x 8448 outputs: 132 tiles), block sizes 64 to 256.
INSTANTIATE_TEST_SUITE_P(Shapes, FusedMmaBackward,
                         ::testing::Values(FusedShape{1, 8, 64, 64}, FusedShape{7, 200, 192, 64},
                                           FusedShape{300, 520, 320, 64}, FusedShape{257, 64, 1024, 64},
                                           FusedShape{65, 256, 512, 256}, FusedShape{70, 136, 1024, 128},
                                           FusedShape{129, 72, 8448, 64}, FusedShape{1000, 1536, 256, 64}));

// gate_up on the mma.sync kernel: once per projection, every output combination, overwriting and accumulating.
TEST(FusedMmaGateUp, AllOutputCombinationsMatchCpu) {
  QMM_REQUIRE_GPU();
  if (!fused_mma_available())
    GTEST_SKIP() << "the mma.sync fused kernel needs a QMM_DEV_KERNELS build and compute capability 8.0 or newer";
  expect_gate_up_matches(nf4_forced::kFusedMma, 65, 130, 1024, DType::BF16);
  expect_gate_up_matches(nf4_forced::kFusedMma, 300, 257, 576, DType::F32);
  expect_gate_up_matches(nf4_forced::kFusedMma, 65, 130, 576, DType::BF16, 1.0f);
}

TEST(FusedPath, ForcedWhereItCannotRunRaisesUnsupported) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  Problem p = make_weight(64, 96, false, 5);  // K = 96 is not a multiple of 64
  Tensor a(DType::BF16, {300, 96}, gpu.device()), c(DType::F32, {300, 64}, gpu.device());
  const std::string why = fused_available() ? "K a multiple of 64" : "needs";
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm(gpu, a, p.w_dev, c, {1, 0, Nf4Path::Fused}); },
                                 ErrorCode::Unsupported, {"nf4_gemm", "path fused", why}));
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm_backward_a(gpu, c, p.w_dev, a, {1, 0, Nf4Path::Fused}); },
                                 ErrorCode::Unsupported, {"nf4_gemm_backward_a", "path fused", why}));
  Problem q = make_weight(60, 128, false, 6);  // N = 60: dC rows of 120 bytes cannot be TMA rows
  Tensor dc(DType::BF16, {300, 60}, gpu.device()), da(DType::F32, {300, 128}, gpu.device());
  const std::string why_n = fused_available() ? "N a multiple of 8" : "needs";
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm_backward_a(gpu, dc, q.w_dev, da, {1, 0, Nf4Path::Fused}); },
                                 ErrorCode::Unsupported, {"nf4_gemm_backward_a", "path fused", why_n}));
  // The same preconditions for the mma.sync kernel, named by its own messages.
  const bool mma = fused_mma_available();
#ifdef QMM_DEV_KERNELS
  const std::string mma_missing = "8.0";
#else
  const std::string mma_missing = "QMM_DEV_KERNELS";
#endif
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm(gpu, a, p.w_dev, c, {1, 0, nf4_forced::kFusedMma}); },
                                 ErrorCode::Unsupported,
                                 {"nf4_gemm", "path fused_mma", mma ? "K a multiple of 64" : mma_missing}));
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm_backward_a(gpu, dc, q.w_dev, da, {1, 0, nf4_forced::kFusedMma}); },
                                 ErrorCode::Unsupported,
                                 {"nf4_gemm_backward_a", "path fused_mma", mma ? "N a multiple of 8" : mma_missing}));
}

// Where the pair kernel splits K (or runs gate and up in one launch), a block adds its row groups' partial sums
// in a fixed order (member 0's warp, through shared memory): the same bits on every call, with calls on another
// shape in between.
TEST(SmallMPath, PairKernelSumsAreTheSameOnEveryCall) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  Problem p = make_weight(2050, 4096, true, 21), q = make_weight(333, 1024, true, 22);
  Problem other = make_weight(70, 512, true, 23);
  const Tensor a = to_device(test::random_tensor(DType::BF16, {1, 4096}, 24), gpu.device());
  const Tensor a2 = to_device(test::random_tensor(DType::BF16, {5, 1024}, 25), gpu.device());
  const Tensor a_other = to_device(test::random_tensor(DType::BF16, {3, 512}, 26), gpu.device());
  Tensor c_other(DType::F32, {3, 70}, gpu.device());
  std::vector<Tensor> cs, hs;
  for (int call = 0; call < 3; ++call) {
    Tensor c(DType::F32, {1, 2050}, gpu.device()), h(DType::BF16, {5, 333}, gpu.device());
    test::poison(c);
    test::poison(h);
    nf4_gemm(gpu, a, p.w_dev, c, {1.0f, 0.0f, nf4_forced::kSmallM});
    nf4_gate_up(gpu, a2, q.w_dev, q.w_dev, {TensorView(), TensorView(), h}, {1.0f, 0.0f, nf4_forced::kSmallM});
    nf4_gemm(gpu, a_other, other.w_dev, c_other, {1.0f, 0.0f, nf4_forced::kSmallM});
    gpu.synchronize();
    cs.push_back(test::host_copy(c));
    hs.push_back(test::host_copy(h));
  }
  for (int call = 1; call < 3; ++call) {
    EXPECT_EQ(0, std::memcmp(cs[0].data(), cs[call].data(), cs[0].nbytes())) << "nf4_gemm, call " << call;
    EXPECT_EQ(0, std::memcmp(hs[0].data(), hs[call].data(), hs[0].nbytes())) << "nf4_gate_up, call " << call;
  }
  Tensor ref(DType::F32, {1, 2050});
  nf4_gemm(Context::cpu(), test::host_copy(a), p.w_host, ref);
  EXPECT_TRUE(forward_close(nf4_forced::kSmallM, test::host_copy(a), p.w_host, cs[0], ref, ref, 1.0f, 0.0f,
                            test::fp32_accum_tolerance(4096)));
}

// The small-M kernels launch overlapping the stream's previous kernel (programmatic dependent launch on sm_90):
// each must still wait for what that kernel writes. A chain of calls, each reading the previous call's output
// with no synchronization in between, must give bitwise what the same calls give one at a time (the kernels are
// deterministic); every output is poisoned (NaN) first, so a call that read its input too early would show. bf16
// activations take the pair kernel (K multiples of 256; at M = 12 the K = 4096 calls after the packing kernel),
// f32 ones the table kernel with its split-K reduce (4160) and, at M = 1, the GEMV; the chain ends in
// nf4_gate_up.
TEST(SmallMPath, BackToBackCallsSeeTheirInputs) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  for (DType dt : {DType::BF16, DType::F32})
    for (std::int64_t m : {1, 5, 12}) {
      const std::int64_t k1 = dt == DType::BF16 ? 4096 : 4160, k2 = dt == DType::BF16 ? 512 : 320;
      Problem w1 = make_weight(k2, k1, true, 31), w2 = make_weight(k1, k2, true, 32);
      const Tensor x0 = to_device(test::random_tensor(dt, {m, k1}, 33), gpu.device());
      std::vector<Tensor> xs = {Tensor(dt, {m, k2}, gpu.device()), Tensor(dt, {m, k1}, gpu.device()),
                                Tensor(dt, {m, k2}, gpu.device()), Tensor(dt, {m, k1}, gpu.device()),
                                Tensor(DType::BF16, {m, k2}, gpu.device())};
      auto run = [&](bool sync_each) {
        for (Tensor& x : xs) test::poison(x);
        gpu.synchronize();
        const Tensor* in = &x0;
        for (int i = 0; i < 4; ++i) {
          nf4_gemm(gpu, *in, (i % 2 == 0 ? w1 : w2).w_dev, xs[i], {1.0f, 0.0f, nf4_forced::kSmallM});
          if (sync_each) gpu.synchronize();
          in = &xs[i];
        }
        nf4_gate_up(gpu, xs[3], w1.w_dev, w1.w_dev, {TensorView(), TensorView(), xs[4]},
                    {1.0f, 0.0f, nf4_forced::kSmallM});
        gpu.synchronize();
        std::vector<Tensor> got;
        for (const Tensor& x : xs) got.push_back(test::host_copy(x));
        return got;
      };
      const std::vector<Tensor> one_at_a_time = run(true), back_to_back = run(false);
      for (std::size_t i = 0; i < xs.size(); ++i) {
        const std::vector<double> v = test::to_doubles(one_at_a_time[i]);
        EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); }))
            << dtype_name(dt) << " M " << m << " call " << i;
        EXPECT_EQ(0, std::memcmp(one_at_a_time[i].data(), back_to_back[i].data(), one_at_a_time[i].nbytes()))
            << dtype_name(dt) << " M " << m << " call " << i;
      }
    }
}

TEST(SmallMPath, ForcedOnUnsupportedShapeRaisesUnsupported) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  Problem p = make_weight(64, 100, false, 5);  // K = 100 is not a multiple of 64
  Tensor a(DType::BF16, {4, 100}, gpu.device()), c(DType::F32, {4, 64}, gpu.device());
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm(gpu, a, p.w_dev, c, {1, 0, nf4_forced::kSmallM}); },
                                 ErrorCode::Unsupported, {"nf4_gemm", "path small_m", "K a multiple of 64"}));
  Problem q = make_weight(64, 128, false, 7);  // 33 rows: one more than the kernels take
  Tensor a33(DType::BF16, {33, 128}, gpu.device()), c33(DType::F32, {33, 64}, gpu.device());
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm(gpu, a33, q.w_dev, c33, {1, 0, nf4_forced::kSmallM}); },
                                 ErrorCode::Unsupported, {"nf4_gemm", "path small_m", "M <= 32"}));
  // Auto takes a correct path for the same shape.
  Tensor ah = test::random_tensor(DType::BF16, {4, 100}, 6), ref(DType::F32, {4, 64});
  nf4_gemm(Context::cpu(), ah, p.w_host, ref);
  nf4_gemm(gpu, to_device(ah, gpu.device()), p.w_dev, c);
  gpu.synchronize();
  EXPECT_TRUE(test::all_close(test::host_copy(c), ref, test::fp32_accum_tolerance(100)));
}

}  // namespace
}  // namespace qmm
