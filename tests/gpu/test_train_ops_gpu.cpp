// Train ops on the GPU against the CPU backend: ragged lengths through the vector body and the scalar tail,
// misaligned pointers, in-place aliases, many-tensor batches (several launches), and outputs poisoned first.
//
// What must agree how, and why:
//  - cast, dropout (mask and values), zero, mse_loss's dy: bit for bit. Both sides run the same IEEE operations on
//    the same values (the mask hash and scale are one shared host/device function; dy is coef * (y - t) in fp64,
//    rounded once to fp32 and then to bf16).
//  - add, add_bias: at most 1 ulp of the output dtype. The GPU rounds a + alpha*b once (fma in fp32); the oracle
//    rounds the double sum to fp32, which can differ from the once-rounded result in the last bit when the double
//    sum was itself rounded (operands far apart in magnitude). bf16 rounds that fp32 value again on both sides.
//  - grad_norm, mse_loss's loss: at most 1 fp32 ulp (relative 2.4e-7): both sum fp64 squares, in different orders
//    (fp64 differences ~1e-16 relative), then round to fp32 once.
//  - adamw_step: fp32 arithmetic on the GPU against the oracle's fp64 with one rounding; see kAdamW* below.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

constexpr std::int64_t kLarge = (1 << 22) + 3;  // many grid-stride rounds and a 3-element tail
const std::vector<std::int64_t> kLengths = {1, 7, 63, 65, 1000, 4099, 65537};
const std::vector<std::int64_t> kLengthsAndLarge = {1, 7, 63, 65, 1000, 4099, 65537, kLarge};

// A device tensor, optionally starting one element past a 16-byte boundary (then only the scalar path can run).
struct Dev {
  Tensor storage;
  TensorView view;
};
Dev device_tensor(DType dt, Shape shape, bool misaligned) {
  Context& gpu = *test::gpu_context();
  Dev d;
  d.storage = Tensor(dt, {shape.numel() + 1}, gpu.device());
  d.view =
      TensorView(static_cast<char*>(d.storage.data()) + (misaligned ? dtype_size(dt) : 0), dt, shape, gpu.device());
  test::poison(d.view);
  return d;
}
Dev on_device(const Tensor& host, bool misaligned = false) {
  Dev d = device_tensor(host.dtype(), host.shape(), misaligned);
  copy(d.view, host);
  return d;
}

// Monotone integer of a float's (or bf16's) bits: neighbouring values differ by one.
std::int64_t ordered(DType dt, std::uint32_t bits) {
  const std::uint32_t sign = dt == DType::BF16 ? 0x8000u : 0x80000000u;
  return (bits & sign) ? -static_cast<std::int64_t>(bits & (sign - 1)) : static_cast<std::int64_t>(bits);
}

::testing::AssertionResult within_ulps(const TensorView& got_any, const TensorView& ref, std::int64_t max_ulps) {
  const Tensor got = test::host_copy(got_any);
  if (got.numel() != ref.numel() || got.dtype() != ref.dtype())
    return ::testing::AssertionFailure() << got.view().str() << " vs " << ref.str();
  const bool bf16 = got.dtype() == DType::BF16;
  std::int64_t bad = 0;
  std::ostringstream first;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    std::uint32_t g, r;
    if (bf16) {
      g = got.data_as<std::uint16_t>()[i];
      r = ref.data_as<std::uint16_t>()[i];
    } else {
      std::memcpy(&g, got.data_as<float>() + i, 4);
      std::memcpy(&r, ref.data_as<float>() + i, 4);
    }
    const double gv = bf16 ? bf16_to_float(static_cast<std::uint16_t>(g)) : got.data_as<float>()[i];
    const bool ok = std::isfinite(gv) && std::llabs(ordered(got.dtype(), g) - ordered(got.dtype(), r)) <= max_ulps;
    if (!ok && bad++ < 5) {
      const double rv = bf16 ? bf16_to_float(static_cast<std::uint16_t>(r)) : ref.data_as<float>()[i];
      first << "\n  [" << i << "] got " << gv << " ref " << rv;
    }
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements off" << first.str();
  return ::testing::AssertionSuccess();
}

std::string what(DType dt, std::int64_t n, bool misaligned) {
  return std::string(dtype_name(dt)) + " n=" + std::to_string(n) + (misaligned ? " misaligned" : "");
}

TEST(TrainOpsGpu, CastMatchesCpuBitForBit) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 10;
  for (std::int64_t n : kLengthsAndLarge)
    for (bool misaligned : {false, true}) {
      Tensor f = test::random_tensor(DType::F32, {n}, ++seed, -3.0f, 3.0f);
      // Values the rounding treats specially, where there is room: infinities, NaN, ties, the largest float.
      const float specials[] = {INFINITY, -INFINITY, std::nanf(""), 1.00390625f, 1.01171875f, 3.4028235e38f, -0.0f};
      for (std::size_t k = 0; k < std::size(specials) && static_cast<std::int64_t>(k) < n; ++k)
        f.data_as<float>()[static_cast<std::int64_t>(k) * (n / static_cast<std::int64_t>(std::size(specials)) + 1) %
                           n] = specials[k];
      Tensor want_b(DType::BF16, {n});
      cast(cpu, f, want_b);
      Dev df = on_device(f, misaligned), db = device_tensor(DType::BF16, {n}, misaligned);
      cast(gpu, df.view, db.view);
      Dev back = device_tensor(DType::F32, {n}, misaligned);
      cast(gpu, db.view, back.view);
      Dev same = device_tensor(DType::F32, {n}, !misaligned);
      cast(gpu, df.view, same.view);  // same dtype: a device copy
      gpu.synchronize();
      Tensor want_f(DType::F32, {n});
      cast(cpu, want_b, want_f);
      EXPECT_TRUE(test::bytes_equal(db.view, want_b)) << "f32->bf16 " << what(DType::F32, n, misaligned);
      EXPECT_TRUE(test::bytes_equal(back.view, want_f)) << "bf16->f32 " << what(DType::F32, n, misaligned);
      EXPECT_TRUE(test::bytes_equal(same.view, f)) << "f32->f32 " << what(DType::F32, n, misaligned);
    }
}

// More pairs than one launch takes (64), f32 -> bf16 ones batched and the others cast one by one, aligned and not.
TEST(TrainOpsGpu, CastManyMatchesCpuBitForBit) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::vector<Dev> src, dst;
  std::vector<Tensor> want;
  const std::int64_t lengths[] = {0, 1, 7, 63, 65, 1000, 4099, 16 * 4096};
  for (int i = 0; i < 70; ++i) {
    const std::int64_t n = lengths[i % std::size(lengths)];
    const bool to_f32 = i % 9 == 4, misaligned = i % 3 == 1;
    const Tensor s = test::random_tensor(to_f32 ? DType::BF16 : DType::F32, {n}, 500 + i, -3.0f, 3.0f);
    want.emplace_back(to_f32 ? DType::F32 : DType::BF16, Shape{n});
    cast(cpu, s, want.back());
    src.push_back(on_device(s, misaligned));
    dst.push_back(device_tensor(want.back().dtype(), {n}, i % 5 == 2));
  }
  std::vector<TensorView> s, d;
  for (std::size_t i = 0; i < src.size(); ++i) s.push_back(src[i].view), d.push_back(dst[i].view);
  cast(gpu, s, d);
  gpu.synchronize();
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(test::bytes_equal(dst[i].view, want[i])) << "pair " << i << " n=" << want[i].numel();
}

TEST(TrainOpsGpu, AddMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 100;
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t n : kLengths)
      for (bool misaligned : {false, true}) {
        const float alpha = misaligned ? -0.375f : 1.0f;
        const Tensor a = test::random_tensor(dt, {n}, ++seed), b = test::random_tensor(dt, {n}, ++seed, -8.0f, 8.0f);
        Tensor ref(dt, {n});
        add(cpu, a, b, ref, alpha);
        Dev da = on_device(a, misaligned), db = on_device(b), out = device_tensor(dt, {n}, false);
        add(gpu, da.view, db.view, out.view, alpha);
        gpu.synchronize();
        EXPECT_TRUE(within_ulps(out.view, ref, 1)) << what(dt, n, misaligned);
        Dev da2 = on_device(a, misaligned);
        add(gpu, da.view, db.view, da.view, alpha);   // out = a
        add(gpu, da2.view, db.view, db.view, alpha);  // out = b
        gpu.synchronize();
        EXPECT_TRUE(within_ulps(da.view, ref, 1)) << "out = a, " << what(dt, n, misaligned);
        EXPECT_TRUE(within_ulps(db.view, ref, 1)) << "out = b, " << what(dt, n, misaligned);
      }
  const Tensor a = test::random_tensor(DType::BF16, {kLarge}, 7), b = test::random_tensor(DType::BF16, {kLarge}, 8);
  Tensor ref(DType::BF16, {kLarge});
  add(cpu, a, b, ref, 0.5f);
  Dev da = on_device(a), db = on_device(b), out = device_tensor(DType::BF16, {kLarge}, false);
  add(gpu, da.view, db.view, out.view, 0.5f);
  gpu.synchronize();
  EXPECT_TRUE(within_ulps(out.view, ref, 1)) << "large";
}

TEST(TrainOpsGpu, AddBiasMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  struct Combo {
    DType y, bias;
  };
  const Combo combos[] = {{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}};
  // Rows narrower than a vector (1, 3, 7 columns) wrap several times inside one vector.
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1, 1},    {5, 3},    {9, 7},   {7, 63},      {65, 7},
                                                          {3, 1000}, {2, 4099}, {63, 65}, {2048, 1536}, {17, 8960}};
  std::uint64_t seed = 200;
  for (const Combo& c : combos)
    for (const auto& [rows, cols] : shapes)
      for (bool misaligned : {false, true}) {
        const Tensor y = test::random_tensor(c.y, {rows, cols}, ++seed);
        const Tensor bias = test::random_tensor(c.bias, {cols}, ++seed, -4.0f, 4.0f);
        Tensor ref = test::host_copy(y);
        add_bias(cpu, ref, bias);
        Dev dy = on_device(y, misaligned), dbias = on_device(bias, misaligned);
        add_bias(gpu, dy.view, dbias.view);
        gpu.synchronize();
        EXPECT_TRUE(within_ulps(dy.view, ref, 1)) << dtype_name(c.y) << " y, " << dtype_name(c.bias) << " bias, "
                                                  << rows << "x" << cols << (misaligned ? " misaligned" : "");
      }
}

TEST(TrainOpsGpu, DropoutMatchesCpuBitForBit) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 300;
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t n : kLengthsAndLarge)
      for (float p : {0.0f, 0.1f, 0.5f, 0.9f})
        for (bool misaligned : {false, true}) {
          if (n == kLarge && (misaligned || p == 0.0f)) continue;
          const Tensor x = test::random_tensor(dt, {n}, ++seed);
          const std::uint64_t mask_seed = 0x5EED0000u + seed;
          Tensor ref(dt, {n});
          dropout(cpu, x, ref, p, mask_seed);
          Dev dx = on_device(x, misaligned), out = device_tensor(dt, {n}, false);
          dropout(gpu, dx.view, out.view, p, mask_seed);
          dropout(gpu, dx.view, dx.view, p, mask_seed);  // in place
          gpu.synchronize();
          const std::string w = what(dt, n, misaligned) + " p=" + std::to_string(p);
          EXPECT_TRUE(test::bytes_equal(out.view, ref)) << w;
          EXPECT_TRUE(test::bytes_equal(dx.view, ref)) << "in place, " << w;
        }
}

TEST(TrainOpsGpu, MseLossMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 400;
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t n : kLengthsAndLarge)
      for (bool misaligned : {false, true}) {
        const float scale = misaligned ? 0.25f : 1.0f;
        const Tensor y = test::random_tensor(dt, {n}, ++seed, -2.0f, 2.0f), t = test::random_tensor(dt, {n}, ++seed);
        Tensor loss(DType::F32, {1}), dy(dt, {n});
        mse_loss(cpu, y, t, loss, dy, scale);
        Dev gy = on_device(y, misaligned), gt = on_device(t), gdy = device_tensor(dt, {n}, misaligned);
        Dev gloss = device_tensor(DType::F32, {1}, false);
        mse_loss(gpu, gy.view, gt.view, gloss.view, gdy.view, scale);
        Dev gloss2 = device_tensor(DType::F32, {1}, false);
        mse_loss(gpu, gy.view, gt.view, gloss2.view, gy.view, scale);  // dy = y
        gpu.synchronize();
        const std::string w = what(dt, n, misaligned);
        EXPECT_TRUE(test::bytes_equal(gdy.view, dy)) << "dy " << w;
        EXPECT_TRUE(test::bytes_equal(gy.view, dy)) << "dy = y, " << w;
        EXPECT_TRUE(within_ulps(gloss.view, loss, 1)) << "loss " << w;
        EXPECT_TRUE(test::bytes_equal(gloss2.view, gloss.view)) << "loss with dy = y, " << w;
      }
}

// ---- grad_norm ----------------------------------------------------------------------------------------------------

// `count` tensors of ragged sizes (some empty, some bf16, some misaligned) as host tensors and device copies.
struct GradSet {
  std::vector<Tensor> host;
  std::vector<Dev> dev;
  std::vector<TensorView> host_views() const { return {host.begin(), host.end()}; }
  std::vector<TensorView> dev_views() const {
    std::vector<TensorView> v;
    for (const Dev& d : dev) v.push_back(d.view);
    return v;
  }
};
GradSet grad_set(int count, std::uint64_t seed, bool with_bf16) {
  GradSet s;
  for (int i = 0; i < count; ++i) {
    const std::int64_t n = kLengths[static_cast<std::size_t>(i) % kLengths.size()] + (i % 5 == 4 ? 0 : i % 3);
    const DType dt = with_bf16 && i % 3 == 1 ? DType::BF16 : DType::F32;
    s.host.push_back(i % 11 == 10 ? Tensor(dt, {0})
                                  : test::random_tensor(dt, {n}, seed + static_cast<std::uint64_t>(i), -0.1f, 0.1f));
    s.dev.push_back(on_device(s.host.back(), i % 4 == 3));
  }
  return s;
}

TEST(TrainOpsGpu, GradNormMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  // 1 and 6 tensors take one launch; 150 take three (64 per launch).
  for (int count : {1, 6, 64, 65, 150})
    for (bool with_bf16 : {false, true}) {
      const GradSet s = grad_set(count, 500 + static_cast<std::uint64_t>(count), with_bf16);
      Tensor ref(DType::F32, {1});
      grad_norm(cpu, s.host_views(), ref);
      Dev a = device_tensor(DType::F32, {1}, false), b = device_tensor(DType::F32, {1}, false);
      grad_norm(gpu, s.dev_views(), a.view);
      grad_norm(gpu, s.dev_views(), b.view);
      gpu.synchronize();
      const std::string w = std::to_string(count) + " tensors" + (with_bf16 ? " with bf16" : "");
      EXPECT_TRUE(within_ulps(a.view, ref, 1)) << w;
      EXPECT_TRUE(test::bytes_equal(a.view, b.view)) << "deterministic, " << w;
    }
  const Tensor big = test::random_tensor(DType::F32, {kLarge}, 9);
  const TensorView one[] = {big};
  Tensor ref(DType::F32, {1});
  grad_norm(cpu, one, ref);
  Dev g = on_device(big), norm = device_tensor(DType::F32, {1}, false);
  const TensorView dev_one[] = {g.view};
  grad_norm(gpu, dev_one, norm.view);
  gpu.synchronize();
  EXPECT_TRUE(within_ulps(norm.view, ref, 1)) << "large";
}

// ---- adamw_step ---------------------------------------------------------------------------------------------------

// GPU (fp32 arithmetic) against the CPU (fp64, one rounding per stored value), after each of several steps:
//  - m = b1*m + (1-b1)*g: a few fp32 roundings of terms of size |g| <= 0.05; where the two terms cancel the error
//    is absolute, ~2^-23 * 0.05: kAdamWMAtol. v has no cancellation (both terms >= 0).
//  - the update lr * m_hat / (sqrt(v_hat) + eps) carries ~10 fp32 roundings (~1e-6 relative) of a value of size
//    ~lr, and p itself one rounding per step: kAdamWPRtol relative plus lr * 1e-5 per step absolute.
//  - with clipping the coefficient comes from each side's own fp32 norm (1 ulp apart), which moves g by ~2^-23.
constexpr double kAdamWRtol = 1e-6;
constexpr double kAdamWMAtol = 2e-8;
constexpr double kAdamWVAtol = 1e-14;
constexpr double kAdamWPRtol = 1e-6;

struct OptState {
  std::vector<Tensor> p, g, m, v;   // host (the CPU oracle's own state)
  std::vector<Dev> dp, dg, dm, dv;  // device
  std::vector<AdamWParam> host_params() const {
    std::vector<AdamWParam> r;
    for (std::size_t i = 0; i < p.size(); ++i) r.push_back({p[i], g[i], m[i], v[i]});
    return r;
  }
  std::vector<AdamWParam> dev_params() const {
    std::vector<AdamWParam> r;
    for (std::size_t i = 0; i < p.size(); ++i) r.push_back({dp[i].view, dg[i].view, dm[i].view, dv[i].view});
    return r;
  }
};

// Fresh moments (zeros, as an optimizer starts), or warm ones as a resumed run has them: v in [1e-6, 1e-4] and
// |m| <= sqrt(v) / 2 (a real m never outgrows sqrt(v) by much), so m_hat / sqrt(v_hat) stays O(1) and the update
// ~lr, which the tolerances below assume.
OptState opt_state(const std::vector<Shape>& shapes, std::uint64_t seed, bool warm) {
  OptState s;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const bool misaligned = i % 5 == 2;
    s.p.push_back(test::random_tensor(DType::F32, shapes[i], ++seed));
    s.g.emplace_back(DType::F32, shapes[i]);
    s.m.push_back(test::filled(DType::F32, shapes[i], 0.0f));
    s.v.push_back(test::filled(DType::F32, shapes[i], 0.0f));
    if (warm) {
      const Tensor u = test::random_tensor(DType::F32, shapes[i], ++seed, -0.5f, 0.5f);
      const Tensor w = test::random_tensor(DType::F32, shapes[i], ++seed, 1e-6f, 1e-4f);
      for (std::int64_t k = 0; k < u.numel(); ++k) {
        s.v.back().data_as<float>()[k] = w.data_as<float>()[k];
        s.m.back().data_as<float>()[k] = u.data_as<float>()[k] * std::sqrt(w.data_as<float>()[k]);
      }
    }
    s.dp.push_back(on_device(s.p.back(), misaligned));
    s.dg.push_back(device_tensor(DType::F32, shapes[i], misaligned));
    s.dm.push_back(on_device(s.m.back(), misaligned));
    s.dv.push_back(on_device(s.v.back(), misaligned));
  }
  return s;
}

void new_grads(OptState& s, std::uint64_t seed) {
  for (std::size_t i = 0; i < s.g.size(); ++i) {
    s.g[i] = test::random_tensor(DType::F32, s.g[i].shape(), seed + i, -0.05f, 0.05f);
    copy(s.dg[i].view, s.g[i]);
  }
}

// Three steps from `first_step` (fresh moments when it is 1, warm ones otherwise), compared after each.
void check_adamw(const std::vector<Shape>& shapes, const AdamWOptions& o, bool want_norm, int first_step,
                 const std::string& name) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  OptState s = opt_state(shapes, 600, first_step > 1);
  for (int step = first_step; step < first_step + 3; ++step) {
    new_grads(s, 700 + static_cast<std::uint64_t>(step) * 1000);
    Tensor norm(DType::F32, {1});
    Dev dnorm = device_tensor(DType::F32, {1}, false);
    adamw_step(cpu, s.host_params(), o, step, want_norm ? norm.view() : TensorView());
    adamw_step(gpu, s.dev_params(), o, step, want_norm ? dnorm.view : TensorView());
    gpu.synchronize();
    const std::string w = name + " step " + std::to_string(step);
    if (want_norm) EXPECT_TRUE(within_ulps(dnorm.view, norm, 1)) << "norm, " << w;
    const test::Tolerance tol_p{1e-5 * o.lr * (step - first_step + 1), kAdamWPRtol, kAdamWPRtol};
    const test::Tolerance tol_m{kAdamWMAtol, kAdamWRtol, kAdamWRtol}, tol_v{kAdamWVAtol, kAdamWRtol, kAdamWRtol};
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const std::string at = w + " tensor " + std::to_string(i) + " " + shapes[i].str();
      EXPECT_TRUE(test::all_close(test::host_copy(s.dp[i].view), s.p[i], tol_p)) << "param, " << at;
      EXPECT_TRUE(test::all_close(test::host_copy(s.dm[i].view), s.m[i], tol_m)) << "m, " << at;
      EXPECT_TRUE(test::all_close(test::host_copy(s.dv[i].view), s.v[i], tol_v)) << "v, " << at;
      EXPECT_TRUE(test::bytes_equal(s.dg[i].view, s.g[i])) << "grad unchanged, " << at;
    }
  }
}

std::vector<Shape> ragged_shapes(int count) {
  std::vector<Shape> shapes;
  for (int i = 0; i < count; ++i)
    shapes.push_back(Shape{kLengths[static_cast<std::size_t>(i) % kLengths.size()] + i % 3});
  return shapes;
}

// Rank-16 LoRA factors of gate, up and down at Qwen2.5-1.5B's sizes (hidden 1536, intermediate 8960).
std::vector<Shape> mlp_adapter_shapes() {
  return {{16, 1536}, {8960, 16}, {16, 1536}, {8960, 16}, {16, 8960}, {1536, 16}};
}

TEST(TrainOpsGpu, AdamWMatchesCpu) {
  QMM_REQUIRE_GPU();
  // The gradients' norm: |g| ~ 0.05/sqrt(3) per element, so ~0.029 * sqrt(numel): max_grad_norm 0.1 always clips
  // these sets, 1e4 never does.
  const AdamWOptions plain{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0.0f};
  const AdamWOptions clipped{2e-3f, 0.9f, 0.95f, 1e-6f, 0.1f, 0.1f};
  const AdamWOptions unclipped{1e-3f, 0.8f, 0.99f, 1e-8f, 0.01f, 1e4f};
  check_adamw(ragged_shapes(7), plain, false, 1, "ragged, plain");
  check_adamw(ragged_shapes(7), clipped, true, 1, "ragged, clipping active");
  check_adamw(ragged_shapes(7), unclipped, true, 101, "ragged, clipping inactive, resumed");
  check_adamw(ragged_shapes(7), plain, true, 7, "ragged, norm only, resumed");
  check_adamw(mlp_adapter_shapes(), clipped, true, 1, "MLP adapters, clipping active");
  check_adamw(mlp_adapter_shapes(), plain, false, 50, "MLP adapters, plain, resumed");
}

TEST(TrainOpsGpu, AdamWManyTensorsSeveralLaunches) {
  QMM_REQUIRE_GPU();
  // 150 tensors: three update launches and three partial-sum launches feeding one clip coefficient.
  const AdamWOptions clipped{1e-3f, 0.9f, 0.999f, 1e-8f, 0.05f, 0.5f};
  check_adamw(ragged_shapes(150), clipped, true, 1, "150 tensors, clipping active");
  check_adamw(ragged_shapes(65), AdamWOptions{}, false, 20, "65 tensors, defaults, resumed");
}

TEST(TrainOpsGpu, ZeroWritesOnlyTheView) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::U8})
    for (std::int64_t n : kLengths)
      for (bool misaligned : {false, true}) {
        Dev d = device_tensor(dt, {n}, misaligned);  // the view poisoned, plus one guard element before or after
        const Tensor before = test::host_copy(d.storage);
        zero(gpu, d.view);
        gpu.synchronize();
        const Tensor after = test::host_copy(d.storage);
        const auto* was = before.data_as<std::uint8_t>();
        const auto* now = after.data_as<std::uint8_t>();
        const std::size_t es = dtype_size(dt), begin = misaligned ? es : 0,
                          end = begin + static_cast<std::size_t>(n) * es;
        std::int64_t wrong = 0;
        for (std::size_t i = 0; i < after.nbytes(); ++i)
          wrong += (i >= begin && i < end) ? now[i] != 0 : now[i] != was[i];
        EXPECT_EQ(wrong, 0) << what(dt, n, misaligned);
      }
}

TEST(TrainOpsGpu, HostTensorsAreRejected) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Tensor host = test::random_tensor(DType::F32, {8}, 1);
  Dev dev = on_device(host);
  EXPECT_TRUE(test::throws_error([&] { cast(gpu, host, dev.view); }, ErrorCode::DeviceMismatch, {"cast: src", "cpu"}));
  // The norm (and the loss) live on the context's device: a host scalar is rejected, nothing is enqueued.
  Dev g = on_device(host), m = on_device(host), v = on_device(host);
  Tensor norm(DType::F32, {1});
  const AdamWParam ps[] = {{dev.view, g.view, m.view, v.view}};
  EXPECT_TRUE(test::throws_error([&] { adamw_step(gpu, ps, {}, 1, norm); }, ErrorCode::DeviceMismatch,
                                 {"adamw_step: norm", "cpu"}));
  Tensor loss(DType::F32, {1});
  EXPECT_TRUE(test::throws_error([&] { mse_loss(gpu, dev.view, g.view, loss, m.view); }, ErrorCode::DeviceMismatch,
                                 {"mse_loss: loss", "cpu"}));
  gpu.synchronize();
  EXPECT_TRUE(test::bytes_equal(dev.view, host));
}

// rms_norm forward and backward on the GPU against the CPU oracle: rstd to fp32 sums' rounding (1e-5), dx to one
// rounding of its dtype beside the sums' order, y to two (rstd's last fp32 bit can move the rounding of x·rstd by
// one ulp, and the product with w by another: seen at 22 of 8M bf16 elements), dw (fp32 sums over rows in groups)
// to 1e-4 relative. Widths through every kernel: forward a warp per row (whole 16-byte packs, up to 16 per lane:
// 8, 64, 1536, 4096 bf16, up to 2048 f32) or a block per row (100; 4104 and 5120 bf16; 4096 f32); backward rows
// over one warp (up to 8 packs a lane: 2048 bf16, 1024 f32) or two (4096 bf16, 2048 and 1536 f32) with dw's
// partials in the same kernel, or a block per row (100, 4104, 5120; 4096 f32); groups of 16 rows ragged (1, 5, 7,
// 9, 33, 300 rows). y in place over x and dx over dy (with and without dw) give the same bytes, dw too.
// 4099 rows: more row steps than a persistent grid's blocks.
constexpr std::pair<std::int64_t, std::int64_t> kNormShapes[] = {
    {1, 64}, {7, 100}, {300, 1536}, {2048, 4096}, {1, 5120}, {5, 8}, {9, 4104}, {33, 2048}, {65, 1536}, {4099, 1536}};

TEST(TrainOpsGpu, RmsNormMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  std::uint64_t seed = 800;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [rows, hid] : kNormShapes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(hid));
      const Tensor x = test::random_tensor(dt, {rows, hid}, ++seed, -3.0f, 3.0f);
      const Tensor w = test::random_tensor(dt, {hid}, ++seed, 0.5f, 1.5f);
      const Tensor dy = test::random_tensor(dt, {rows, hid}, ++seed);
      Tensor y(dt, {rows, hid}), rstd(DType::F32, {rows}), dx(dt, {rows, hid}), dw = test::filled(DType::F32, {hid}, 0);
      rms_norm(Context::cpu(), x, w, y, rstd, 1e-6f);
      rms_norm_backward(Context::cpu(), x, w, rstd, dy, dx, dw);
      const Device dev = gpu.device();
      const Tensor y_d(dt, {rows, hid}, dev), rstd_d(DType::F32, {rows}, dev), dx_d(dt, {rows, hid}, dev);
      const Tensor dw_d = to_device(test::filled(DType::F32, {hid}, 0), dev), x_d = to_device(x, dev);
      rms_norm(gpu, x_d, to_device(w, dev), y_d, rstd_d, 1e-6f);
      rms_norm_backward(gpu, x_d, to_device(w, dev), rstd_d, to_device(dy, dev), dx_d, dw_d);
      gpu.synchronize();
      const double one = dt == DType::BF16 ? 1.0 / 128 : 1e-5;
      EXPECT_TRUE(test::all_close(test::host_copy(rstd_d), rstd, {0, 1e-5, 1e-6})) << "rstd";
      EXPECT_TRUE(test::all_close(test::host_copy(y_d), y, {1e-6, 2 * one, one})) << "y";
      EXPECT_TRUE(test::all_close(test::host_copy(dx_d), dx, {1e-4, one, one})) << "dx";
      EXPECT_TRUE(test::all_close(test::host_copy(dw_d), dw, {1e-4, 1e-4, 1e-5})) << "dw";
      const Tensor y_in = to_device(x, dev), dx_in = to_device(dy, dev), dx_in_dw = to_device(dy, dev);  // in place
      const Tensor dw_in = to_device(test::filled(DType::F32, {hid}, 0), dev);
      rms_norm(gpu, y_in, to_device(w, dev), y_in, {}, 1e-6f);
      rms_norm_backward(gpu, x_d, to_device(w, dev), rstd_d, dx_in, dx_in, {});
      rms_norm_backward(gpu, x_d, to_device(w, dev), rstd_d, dx_in_dw, dx_in_dw, dw_in);
      gpu.synchronize();
      EXPECT_TRUE(test::bytes_equal(test::host_copy(y_in), test::host_copy(y_d))) << "y in place";
      EXPECT_TRUE(test::bytes_equal(test::host_copy(dx_in), test::host_copy(dx_d))) << "dx in place";
      EXPECT_TRUE(test::bytes_equal(test::host_copy(dx_in_dw), test::host_copy(dx_d))) << "dx in place with dw";
      EXPECT_TRUE(test::bytes_equal(test::host_copy(dw_in), test::host_copy(dw_d))) << "dw again";
    }
}

// add_rms_norm and rms_norm_backward with dres on the GPU against the CPU oracle, through the same widths and kernels
// as RmsNormMatchesCpu: h = round(x + r) to the bit (both round the exact sum once), y, rstd, dx and dw to that
// test's tolerances; outputs poisoned first; in place (h over x, y over r; dx over dres, with and without dw) gives
// the same bytes.
TEST(TrainOpsGpu, AddRmsNormAndResidualGradientMatchCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  std::uint64_t seed = 1200;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [rows, hid] : kNormShapes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(hid));
      const Tensor x = test::random_tensor(dt, {rows, hid}, ++seed, -3.0f, 3.0f);
      const Tensor r = test::random_tensor(dt, {rows, hid}, ++seed, -3.0f, 3.0f);
      const Tensor w = test::random_tensor(dt, {hid}, ++seed, 0.5f, 1.5f);
      const Tensor dy = test::random_tensor(dt, {rows, hid}, ++seed),
                   dres = test::random_tensor(dt, {rows, hid}, ++seed);
      Tensor h(dt, {rows, hid}), y(dt, {rows, hid}), rstd(DType::F32, {rows}), dx(dt, {rows, hid});
      Tensor dw = test::filled(DType::F32, {hid}, 0);
      add_rms_norm(Context::cpu(), x, r, w, h, y, rstd, 1e-6f);
      rms_norm_backward(Context::cpu(), h, w, rstd, dy, dx, dw, dres);
      const Device dev = gpu.device();
      const Tensor poison = test::filled(dt, {rows, hid}, NAN);
      const Tensor h_d = to_device(poison, dev), y_d = to_device(poison, dev), dx_d = to_device(poison, dev);
      const Tensor rstd_d = to_device(test::filled(DType::F32, {rows}, NAN), dev);
      const Tensor dw_d = to_device(test::filled(DType::F32, {hid}, 0), dev), w_d = to_device(w, dev);
      const Tensor x_d = to_device(x, dev), r_d = to_device(r, dev), dy_d = to_device(dy, dev);
      const Tensor dres_d = to_device(dres, dev);
      add_rms_norm(gpu, x_d, r_d, w_d, h_d, y_d, rstd_d, 1e-6f);
      rms_norm_backward(gpu, h_d, w_d, rstd_d, dy_d, dx_d, dw_d, dres_d);
      gpu.synchronize();
      const double one = dt == DType::BF16 ? 1.0 / 128 : 1e-5;
      EXPECT_TRUE(test::bytes_equal(test::host_copy(h_d), h)) << "h";
      EXPECT_TRUE(test::all_close(test::host_copy(rstd_d), rstd, {0, 1e-5, 1e-6})) << "rstd";
      EXPECT_TRUE(test::all_close(test::host_copy(y_d), y, {1e-6, 2 * one, one})) << "y";
      EXPECT_TRUE(test::all_close(test::host_copy(dx_d), dx, {1e-4, one, one})) << "dx";
      EXPECT_TRUE(test::all_close(test::host_copy(dw_d), dw, {1e-4, 1e-4, 1e-5})) << "dw";
      const Tensor hx = to_device(x, dev), yr = to_device(r, dev);  // in place
      const Tensor dx_in = to_device(dres, dev), dx_in_dw = to_device(dres, dev);
      const Tensor dw_in = to_device(test::filled(DType::F32, {hid}, 0), dev);
      add_rms_norm(gpu, hx, yr, w_d, hx, yr, {}, 1e-6f);
      rms_norm_backward(gpu, h_d, w_d, rstd_d, dy_d, dx_in, {}, dx_in);
      rms_norm_backward(gpu, h_d, w_d, rstd_d, dy_d, dx_in_dw, dw_in, dx_in_dw);
      gpu.synchronize();
      EXPECT_TRUE(test::bytes_equal(test::host_copy(hx), test::host_copy(h_d))) << "h in place";
      EXPECT_TRUE(test::bytes_equal(test::host_copy(yr), test::host_copy(y_d))) << "y in place";
      EXPECT_TRUE(test::bytes_equal(test::host_copy(dx_in), test::host_copy(dx_d))) << "dx in place";
      EXPECT_TRUE(test::bytes_equal(test::host_copy(dx_in_dw), test::host_copy(dx_d))) << "dx in place with dw";
      EXPECT_TRUE(test::bytes_equal(test::host_copy(dw_in), test::host_copy(dw_d))) << "dw again";
    }
}

// rope on the GPU against the CPU oracle (fp64, rounded once): ragged shapes through every access width (16 bytes,
// two elements where D/2 is not a multiple of the wide vector or a pointer is misaligned, one where D/2 is odd),
// grouped-query heads, no k, cos and sin per sequence or broadcast, f32 cos with bf16 q, the inverse, in place, and
// outputs poisoned first. The GPU rounds x2·s1 (x1·s2) to fp32 before the fused multiply-add: a few fp32 ulps of
// the products, 1e-6 absolute at these magnitudes (< 4), plus one ulp of the output dtype where that moves its
// rounding (2.4e-7 f32, 2^-7 bf16).
TEST(TrainOpsGpu, RopeMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  struct Case {
    std::int64_t b, s, hq, hk, d;
    bool misaligned;
  };
  const Case cases[] = {{1, 1, 1, 1, 2, false},
                        {2, 7, 4, 2, 64, false},
                        {3, 65, 12, 2, 128, false},
                        {1, 300, 32, 8, 128, false},
                        {2, 33, 5, 3, 6, false},
                        {1, 17, 3, 0, 256, false},
                        {2, 9, 1, 7, 12, false},
                        {2, 65, 4, 2, 64, true},
                        {1, 4099, 2, 1, 2, false},
                        // one or two heads a token (several tokens a block; a last block part full): the [B·H, S,
                        // 1, D] view the package gives rope for a contiguous gradient
                        {24, 130, 1, 0, 128, false},
                        {6, 65, 1, 1, 64, false}};
  std::uint64_t seed = 1500;
  for (auto [dt, ct] : {std::pair{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}})
    for (const Case& c : cases)
      for (std::int64_t bc : {std::int64_t{1}, c.b})
        for (bool inverse : {false, true}) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " cos " + dtype_name(ct) + " B=" + std::to_string(c.b) +
                       " S=" + std::to_string(c.s) + " Hq=" + std::to_string(c.hq) + " Hk=" + std::to_string(c.hk) +
                       " D=" + std::to_string(c.d) + " Bc=" + std::to_string(bc) + (c.misaligned ? " misaligned" : "") +
                       (inverse ? " inverse" : ""));
          const Tensor q = test::random_tensor(dt, {c.b, c.s, c.hq, c.d}, ++seed, -2.0f, 2.0f);
          const Tensor k = c.hk ? test::random_tensor(dt, {c.b, c.s, c.hk, c.d}, ++seed, -2.0f, 2.0f) : Tensor();
          const Tensor cs = test::random_tensor(ct, {bc, c.s, c.d}, ++seed);
          const Tensor sn = test::random_tensor(ct, {bc, c.s, c.d}, ++seed);
          Tensor q_ref(dt, q.shape()), k_ref = c.hk ? Tensor(dt, k.shape()) : Tensor();
          rope(Context::cpu(), q, k, cs, sn, q_ref, k_ref, inverse);
          const Dev q_d = on_device(q, c.misaligned), cs_d = on_device(cs), sn_d = on_device(sn);
          const Dev q_out = device_tensor(dt, q.shape(), c.misaligned);
          Dev k_d, k_out;
          if (c.hk) {
            k_d = on_device(k, c.misaligned);
            k_out = device_tensor(dt, k.shape(), false);
          }
          rope(gpu, q_d.view, k_d.view, cs_d.view, sn_d.view, q_out.view, k_out.view, inverse);
          rope(gpu, q_d.view, k_d.view, cs_d.view, sn_d.view, q_d.view, k_d.view, inverse);  // in place
          gpu.synchronize();
          const test::Tolerance tol =
              dt == DType::BF16 ? test::Tolerance{1e-6, 1.0 / 128, 1.0 / 256} : test::Tolerance{1e-6, 2.4e-7, 1e-6};
          EXPECT_TRUE(test::all_close(test::host_copy(q_out.view), q_ref, tol)) << "q";
          EXPECT_TRUE(test::bytes_equal(test::host_copy(q_d.view), test::host_copy(q_out.view))) << "q in place";
          if (!c.hk) continue;
          EXPECT_TRUE(test::all_close(test::host_copy(k_out.view), k_ref, tol)) << "k";
          EXPECT_TRUE(test::bytes_equal(test::host_copy(k_d.view), test::host_copy(k_out.view))) << "k in place";
        }
}

// linear_cross_entropy on the GPU (chunked logits GEMMs and the row kernel) against the CPU oracle (fp64): ragged
// token counts over several chunks, ignored tokens (all of them in one case), both dtypes, labels checked on the
// host and not (the count n then comes from the device), dw accumulated onto zeros (checked cases) and written over
// NaN (accumulate_dw false: the unchecked ones). Both sides round the logits to the inputs' dtype; the
// GPU's fp32 sums may land a bf16 logit one unit off the oracle's, rarely the label's: the loss within 1e-5
// relative (f32) or 1e-4 (bf16). The gradient rows are rounded to the activations' dtype before their GEMMs (bf16:
// 2^-9 each, summed over V terms and T tokens): dh and dw within 1% (bf16) or 1e-4 (f32) Frobenius-relative of the
// oracle's, each element within 8x that relative to itself or 1x that of the largest (elements near 0 cancel).
// Unchecked, a label out of range gives the CPU backend's result: a NaN loss and NaN in its token's dh row, the
// others finite.
TEST(TrainOpsGpu, LinearCrossEntropyMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Device dev = gpu.device();
  std::uint64_t seed = 700;
  for (DType dt : {DType::F32, DType::BF16})
    for (auto [t, hidden, vocab, chunk] : {std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>{
             1, 64, 1, 0}, {7, 64, 130, 0}, {300, 128, 32003, 64}, {65, 64, 1000, 7}, {5, 64, 100, 0},
             {1000, 64, 4096, 384}})
      for (const bool checked : {true, false}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " T=" + std::to_string(t) + " V=" + std::to_string(vocab) +
                     (checked ? " checked" : " unchecked"));
        const Tensor h = test::random_tensor(dt, {t, hidden}, ++seed);
        const Tensor w = test::random_tensor(dt, {vocab, hidden}, ++seed);
        Tensor labels(DType::I32, {t});
        for (std::int64_t i = 0; i < t; ++i)  // T = 5: every token ignored
          labels.data_as<std::int32_t>()[i] =
              i % 4 == 3 || t == 5 ? -100 : static_cast<std::int32_t>((i * 7919 + 13) % vocab);
        CrossEntropyOptions opts;
        opts.chunk_tokens = chunk;
        opts.check_labels = checked;
        opts.accumulate_dw = checked;
        Tensor loss(DType::F32, {1}), dh(dt, {t, hidden}), dw = test::filled(DType::F32, {vocab, hidden}, 0.0f);
        linear_cross_entropy(Context::cpu(), h, w, labels, loss, dh, dw, opts);
        const Tensor loss_d = to_device(test::filled(DType::F32, {1}, NAN), dev);
        const Tensor dh_d = to_device(test::filled(dt, {t, hidden}, NAN), dev);
        const Tensor dw_d = to_device(test::filled(DType::F32, {vocab, hidden}, checked ? 0.0f : NAN), dev);
        linear_cross_entropy(gpu, to_device(h, dev), to_device(w, dev), to_device(labels, dev), loss_d, dh_d, dw_d,
                             opts);
        gpu.synchronize();
        EXPECT_NEAR(test::host_copy(loss_d).data_as<float>()[0], loss.data_as<float>()[0],
                    (dt == DType::BF16 ? 1e-4 : 1e-5) * std::abs(loss.data_as<float>()[0]));
        const double rel = dt == DType::BF16 ? 1e-2 : 1e-4;
        const auto largest = [](const Tensor& t) {
          double m = 0;
          for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(test::get_value(t, i)));
          return m;
        };
        EXPECT_TRUE(test::all_close(test::host_copy(dh_d), dh, {1e-6 + rel * largest(dh), 8 * rel, rel})) << "dh";
        EXPECT_TRUE(test::all_close(test::host_copy(dw_d), dw, {1e-6 + rel * largest(dw), 8 * rel, rel})) << "dw";
        if (checked || t < 7) continue;
        labels.data_as<std::int32_t>()[2] = static_cast<std::int32_t>(vocab);  // out of range, unchecked
        const Tensor bad_loss = to_device(test::filled(DType::F32, {1}, 0.0f), dev);
        linear_cross_entropy(gpu, to_device(h, dev), to_device(w, dev), to_device(labels, dev), bad_loss, dh_d, {},
                             opts);
        const Tensor dh_bad = test::host_copy(dh_d);
        EXPECT_TRUE(std::isnan(test::host_copy(bad_loss).data_as<float>()[0]));
        for (std::int64_t k = 0; k < hidden; ++k) {
          ASSERT_TRUE(std::isnan(test::get_value(dh_bad, 2 * hidden + k))) << k;
          ASSERT_TRUE(std::isfinite(test::get_value(dh_bad, k))) << k;
        }
      }
}

// linear_cross_entropy over vocabulary chunks (dh without dw: each row's running maximum and sum, dh's f32
// accumulator, the finishing step) against the CPU oracle: ragged chunks of tokens and of the vocabulary (down to
// one column, and a last chunk of one), ignored tokens (all of them in one case), the loss alone, and rows whose
// maximum jumps in the last chunk by far more than the rescaling slack (a planted logit near 40 in the last column
// against random ones within about +-10), with the label in that chunk and in the first. Tolerances as in
// LinearCrossEntropyMatchesCpu: the products' left operands exp(z - m) are rounded to h's dtype as the gradient
// rows are there.
TEST(TrainOpsGpu, LinearCrossEntropyVocabularyChunksMatchCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Device dev = gpu.device();
  std::uint64_t seed = 800;
  struct Case {
    std::int64_t t, hidden, vocab, chunk_tokens, chunk_vocab;
    bool planted;
  };
  for (DType dt : {DType::F32, DType::BF16})
    for (const Case& k :
         {Case{1, 64, 2, 0, 1, false}, Case{7, 64, 130, 0, 7, false}, Case{65, 64, 1000, 7, 100, true},
          Case{300, 128, 32003, 64, 1000, true}, Case{5, 64, 100, 0, 10, false}, Case{63, 64, 4097, 0, 4096, true},
          Case{1000, 64, 4096, 384, 1024, false}, Case{129, 64, 60001, 0, 20000, true}})
      for (const bool with_dh : {true, false}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " T=" + std::to_string(k.t) + " V=" + std::to_string(k.vocab) +
                     " chunks " + std::to_string(k.chunk_tokens) + " x " + std::to_string(k.chunk_vocab) +
                     (with_dh ? " dh" : " loss alone"));
        Tensor h = test::random_tensor(dt, {k.t, k.hidden}, ++seed);
        Tensor w = test::random_tensor(dt, {k.vocab, k.hidden}, ++seed);
        Tensor labels(DType::I32, {k.t});
        for (std::int64_t i = 0; i < k.t; ++i)  // T = 5: every token ignored
          labels.data_as<std::int32_t>()[i] =
              i % 4 == 3 || k.t == 5 ? -100 : static_cast<std::int32_t>((i * 7919 + 13) % k.vocab);
        if (k.planted) {  // the last column's logit near 40 for tokens 0 and 1 (the same h), labels there and at 0
          for (std::int64_t j = 0; j < k.hidden; ++j) test::set_value(h, k.hidden + j, test::get_value(h, j));
          double norm = 0;
          for (std::int64_t j = 0; j < k.hidden; ++j) norm += test::get_value(h, j) * test::get_value(h, j);
          for (std::int64_t j = 0; j < k.hidden; ++j)
            test::set_value(w, (k.vocab - 1) * k.hidden + j, 40.0 * test::get_value(h, j) / norm);
          labels.data_as<std::int32_t>()[0] = static_cast<std::int32_t>(k.vocab - 1);
          labels.data_as<std::int32_t>()[1] = 0;
        }
        CrossEntropyOptions opts;
        opts.chunk_tokens = k.chunk_tokens;
        opts.chunk_vocab = k.chunk_vocab;
        ASSERT_LT(linear_cross_entropy_chunks(k.t, k.hidden, k.vocab, dt, with_dh, false, opts).vocab, k.vocab);
        Tensor loss(DType::F32, {1}), dh(dt, {k.t, k.hidden});
        linear_cross_entropy(Context::cpu(), h, w, labels, loss, with_dh ? dh.view() : TensorView(), {}, opts);
        const Tensor loss_d = to_device(test::filled(DType::F32, {1}, NAN), dev);
        const Tensor dh_d = to_device(test::filled(dt, {k.t, k.hidden}, NAN), dev);
        linear_cross_entropy(gpu, to_device(h, dev), to_device(w, dev), to_device(labels, dev), loss_d,
                             with_dh ? dh_d.view() : TensorView(), {}, opts);
        gpu.synchronize();
        EXPECT_NEAR(test::host_copy(loss_d).data_as<float>()[0], loss.data_as<float>()[0],
                    (dt == DType::BF16 ? 1e-4 : 1e-5) * std::abs(loss.data_as<float>()[0]));
        if (!with_dh) continue;
        const double rel = dt == DType::BF16 ? 1e-2 : 1e-4;
        double largest = 0;
        for (std::int64_t i = 0; i < dh.numel(); ++i) largest = std::max(largest, std::abs(test::get_value(dh, i)));
        EXPECT_TRUE(test::all_close(test::host_copy(dh_d), dh, {1e-6 + rel * largest, 8 * rel, rel})) << "dh";
      }
}

}  // namespace
}  // namespace qmm
