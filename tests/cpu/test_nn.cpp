// LoRA layers on the CPU context: forward and backward against a naive fp64 evaluation of the formulas, gradients
// against central finite differences, bf16 activations within a bf16 tolerance, dropout, recompute and the fused
// NF4 gate/up path, dense and NF4 bases, every validation path, the optimizer, and a short training run.
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

const Context& cpu() {
  static const Context ctx = Context::cpu();
  return ctx;
}

// ---- a naive fp64 reference ----------------------------------------------------------------------------------

struct Mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Mat() = default;
  Mat(std::int64_t r, std::int64_t c) : rows(r), cols(c), v(static_cast<std::size_t>(r * c), 0.0) {}
  double& operator()(std::int64_t i, std::int64_t j) { return v[static_cast<std::size_t>(i * cols + j)]; }
  double operator()(std::int64_t i, std::int64_t j) const { return v[static_cast<std::size_t>(i * cols + j)]; }
};

Mat mat_of(const TensorView& t) {
  Mat m(t.dim(0), t.rank() == 2 ? t.dim(1) : 1);
  m.v = test::to_doubles(t);
  return m;
}

double round_to(double x, DType dt) {
  const float f = static_cast<float>(x);
  return dt == DType::BF16 ? bf16_to_float(float_to_bf16(f)) : f;
}

Mat rounded(Mat m, DType dt) {
  for (double& x : m.v) x = round_to(x, dt);
  return m;
}

Tensor tensor_of(const Mat& m, DType dt) {
  Tensor t(dt, {m.rows, m.cols});
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const float f = static_cast<float>(m.v[static_cast<std::size_t>(i)]);
    if (dt == DType::F32) t.data_as<float>()[i] = f;
    else t.data_as<std::uint16_t>()[i] = float_to_bf16(f);
  }
  return t;
}

// op(a)·op(b) with op(m) = m or mᵀ: the three products the layers need (x·Wᵀ, dy·B, dyᵀ·t).
Mat product(const Mat& a, bool ta, const Mat& b, bool tb) {
  const std::int64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols, n = tb ? b.rows : b.cols;
  Mat c(m, n);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t p = 0; p < k; ++p) c(i, j) += (ta ? a(p, i) : a(i, p)) * (tb ? b(j, p) : b(p, j));
  return c;
}
Mat mul_bt(const Mat& a, const Mat& b) { return product(a, false, b, true); }   // a [M,K] · b [N,K]ᵀ
Mat mul(const Mat& a, const Mat& b) { return product(a, false, b, false); }     // a [M,K] · b [K,N]
Mat mul_at(const Mat& a, const Mat& b) { return product(a, true, b, false); }   // a [M,K]ᵀ · b [M,N]
Mat plus(Mat a, const Mat& b, double s = 1.0) {
  for (std::size_t i = 0; i < a.v.size(); ++i) a.v[i] += s * b.v[i];
  return a;
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double silu_grad(double g) {
  const double s = 1.0 / (1.0 + std::exp(-g));
  return s + g * s * (1.0 - s);
}

// y = x·W0ᵀ + s·(dropout(x)·Aᵀ)·Bᵀ + bias in fp64, with the roundings the ops promise: an NF4 base GEMM sees its
// activation operand rounded to bf16 and the dequantized weight rounded to bf16 (ops.h).
struct RefLinear {
  Mat w, a, b;  // w as the base GEMM multiplies it
  std::vector<double> bias;
  double scale = 1.0, p = 0.0;
  bool nf4 = false, drop = false;
  std::uint64_t seed = 0;

  // The reference of `layer` as its last forward ran it (that forward's dropout mask).
  static RefLinear of(const LoraLinear& layer) {
    RefLinear r;
    r.nf4 = layer.base().is_nf4();
    if (r.nf4) {
      Tensor deq(DType::F32, {layer.out_features(), layer.in_features()});
      nf4_dequantize(cpu(), layer.base().nf4(), deq);
      r.w = rounded(mat_of(deq), DType::BF16);
    } else {
      r.w = mat_of(layer.base().dense());
    }
    r.a = mat_of(layer.lora_a());
    r.b = mat_of(layer.lora_b());
    if (!layer.bias().empty()) r.bias = test::to_doubles(layer.bias());
    r.scale = layer.scale();
    r.p = layer.config().dropout;
    r.drop = layer.dropout_active();
    r.seed = layer.dropout_seed();
    return r;
  }
  Mat base_operand(const Mat& m) const { return nf4 ? rounded(m, DType::BF16) : m; }
  // Inverted dropout with the library's mask (dropout_keep); the same function is its own gradient.
  Mat dropped(Mat m) const {
    if (!drop) return m;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(m.v.size()); ++i)
      m.v[static_cast<std::size_t>(i)] = dropout_keep(seed, i, static_cast<float>(p))
                                             ? m.v[static_cast<std::size_t>(i)] / (1.0 - static_cast<float>(p))
                                             : 0.0;
    return m;
  }
  Mat forward(const Mat& x) const {
    Mat y = plus(mul_bt(base_operand(x), w), mul_bt(mul_bt(dropped(x), a), b), scale);
    if (!bias.empty())
      for (std::int64_t i = 0; i < y.rows; ++i)
        for (std::int64_t j = 0; j < y.cols; ++j) y(i, j) += bias[static_cast<std::size_t>(j)];
    return y;
  }
  struct Grads {
    Mat dx, da, db;
  };
  Grads backward(const Mat& x, const Mat& dy) const {
    const Mat xd = dropped(x), t = mul_bt(xd, a);
    Mat dt = mul(dy, b);
    for (double& e : dt.v) e *= scale;
    Mat db = mul_at(dy, t);
    for (double& e : db.v) e *= scale;
    return {plus(mul(base_operand(dy), w), dropped(mul(dt, a))), mul_at(dt, xd), db};
  }
};

// The MLP in fp64; `store` rounds each activation the layer keeps in memory to the activation dtype (an NF4 GEMM
// then rounds that stored value to bf16, as the library does).
struct RefMlp {
  RefLinear gate, up, down;
  DType store = DType::F32;
  bool round_storage = true;

  static RefMlp of(const SwiGluMlp& mlp, bool round_storage) {
    return {RefLinear::of(mlp.gate()), RefLinear::of(mlp.up()), RefLinear::of(mlp.down()),
            mlp.gate().config().activations, round_storage};
  }
  Mat keep(Mat m) const { return round_storage ? rounded(std::move(m), store) : m; }
  struct Act {
    Mat g, u, h, y;
  };
  Act forward(const Mat& x) const {
    Act a{keep(gate.forward(x)), keep(up.forward(x)), {}, {}};
    a.h = a.g;
    for (std::size_t i = 0; i < a.h.v.size(); ++i) a.h.v[i] = silu(a.g.v[i]) * a.u.v[i];
    a.h = keep(a.h);
    a.y = down.forward(a.h);
    return a;
  }
  struct Grads {
    Mat dx;
    RefLinear::Grads gate, up, down;
  };
  Grads backward(const Mat& x, const Mat& dy) const {
    const Act a = forward(x);
    Grads g;
    g.down = down.backward(a.h, dy);
    const Mat dh = keep(g.down.dx);
    Mat dg = dh, du = dh;
    for (std::size_t i = 0; i < dh.v.size(); ++i) {
      dg.v[i] = dh.v[i] * a.u.v[i] * silu_grad(a.g.v[i]);
      du.v[i] = dh.v[i] * silu(a.g.v[i]);
    }
    g.gate = gate.backward(x, keep(dg));
    g.up = up.backward(x, keep(du));
    g.dx = plus(g.gate.dx, g.up.dx);
    return g;
  }
};

// ---- layers under test ---------------------------------------------------------------------------------------

struct Case {
  bool nf4 = false;
  DType act = DType::F32;
  MathMode math = MathMode::FP32;
  float dropout = 0.0f;
  bool bias = false;
};

std::string describe(const Case& s) {
  return std::string(s.nf4 ? "nf4" : "dense") + " " + dtype_name(s.act) + " math " + math_mode_name(s.math) +
         " dropout " + std::to_string(s.dropout) + (s.bias ? " bias" : "");
}

// The frozen weights a layer views, kept alive next to it.
struct Frozen {
  Tensor dense, bias;
  Nf4Tensor nf4;
  BaseWeight base() const { return nf4.codes.defined() ? BaseWeight(nf4) : BaseWeight(dense); }
};

Frozen make_frozen(const Case& s, std::int64_t n, std::int64_t k, std::uint64_t seed) {
  Frozen f;
  if (s.nf4) f.nf4 = nf4_quantize(cpu(), test::random_tensor(DType::F32, {n, k}, seed, -0.5f, 0.5f), true);
  else f.dense = test::random_tensor(s.act, {n, k}, seed, -0.5f, 0.5f);
  if (s.bias) f.bias = test::random_tensor(s.act, {n}, seed + 1);
  return f;
}

LoraConfig config_of(const Case& s, int rank, std::uint64_t seed) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = 1.5f * static_cast<float>(rank);  // s = 1.5: a scale that is not 1 shows where it is missing
  c.dropout = s.dropout;
  c.activations = s.act;
  c.math = s.math;
  c.seed = seed;
  return c;
}

// Nonzero adapters (a fresh layer's B is 0, which would hide every adapter term but dB).
void randomize_adapters(LoraLinear& l, std::uint64_t seed) {
  const std::int64_t r = l.config().rank;
  l.load_adapters(test::random_tensor(DType::F32, {r, l.in_features()}, seed, -0.5f, 0.5f),
                  test::random_tensor(DType::F32, {l.out_features(), r}, seed + 1, -0.5f, 0.5f));
}

struct LinearUnderTest {
  Frozen frozen;
  std::unique_ptr<LoraLinear> layer;
};

LinearUnderTest make_linear(const Case& s, std::int64_t k, std::int64_t n, int rank, std::uint64_t seed) {
  LinearUnderTest t;
  t.frozen = make_frozen(s, n, k, seed);
  t.layer = std::make_unique<LoraLinear>(cpu(), t.frozen.base(), config_of(s, rank, seed + 2), t.frozen.bias);
  randomize_adapters(*t.layer, seed + 3);
  return t;
}

struct MlpUnderTest {
  Frozen gate, up, down;
  std::unique_ptr<SwiGluMlp> mlp;
};

MlpUnderTest make_mlp(const Case& s, std::int64_t h, std::int64_t i, int rank, std::uint64_t seed,
                      MlpOptions options = {}) {
  MlpUnderTest t;
  t.gate = make_frozen(s, i, h, seed);
  t.up = make_frozen(s, i, h, seed + 10);
  t.down = make_frozen(s, h, i, seed + 20);
  t.mlp = std::make_unique<SwiGluMlp>(cpu(), t.gate.base(), t.up.base(), t.down.base(), config_of(s, rank, seed),
                                      options);
  randomize_adapters(t.mlp->gate(), seed + 30);
  randomize_adapters(t.mlp->up(), seed + 40);
  randomize_adapters(t.mlp->down(), seed + 50);
  return t;
}

// Activations. With an NF4 base they are multiples of 1/32 in [-1, 1], so x and x ± 1/16, x ± 1/32 (the finite
// difference steps) are exact in bf16 and the NF4 GEMM's rounding of its input does not blur the differences.
Tensor make_input(DType dt, std::int64_t m, std::int64_t k, std::uint64_t seed, bool bf16_exact_steps) {
  if (!bf16_exact_steps) return test::random_tensor(dt, {m, k}, seed);
  Tensor t = test::random_int_tensor(DType::F32, {m, k}, seed, 32);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] /= 32.0f;
  return tensor_of(mat_of(t), dt);
}

// ---- tolerances ----------------------------------------------------------------------------------------------

// Layer outputs against the fp64 formula. atol is relative to the largest reference magnitude (close_to), since
// rounding errors scale with the terms summed and the values here reach O(10).
// f32 activations, FP32 math: the CPU ops accumulate in fp64 and round once to f32, so each stored intermediate
// (t, y; in the MLP also gate, up, h, dh) carries one f32 rounding (2^-24 relative) that later ops carry forward:
// a few ulps of the largest value (observed <= 2.4e-7 of it).
constexpr test::Tolerance kF32Layer{1e-6, 2e-5, 1e-5};
// bf16 activations (or f32 ones multiplied in BF16 math) against the unrounded formula: the working copies of A
// and B, t, the base output and the sum are each rounded to bf16 (2^-9 relative; truncation in BF16 math, 2^-8),
// in the MLP also gate, up, h and dh: up to ~8 roundings in sequence, and sums over rows and features that cancel.
// Observed: <= 1.3% of the largest value per element, <= 0.8% relative Frobenius error.
constexpr test::Tolerance kBf16Layer{3e-2, 2e-2, 1.5e-2};

// Finite differences: |fd - analytic| <= kFdAtol + kFdRtol·|analytic|. The loss sums ~20 outputs of O(1), each
// rounded to f32, so one evaluation is off by ~1e-6 at most; divided by the step (1/32 for the inner difference)
// and weighted by the Richardson step (4/3), that is < 1e-4. The truncation error of the extrapolated difference is
// O(h^4) ≈ 2e-5·f^(5) for the MLP and zero for LoraLinear, whose loss is linear in each single input or parameter.
// A real bug (a missing scale, mask or transpose) is off by O(|analytic|).
constexpr double kFdAtol = 1e-4;
constexpr double kFdRtol = 1e-3;
constexpr float kFdStep = 1.0f / 16.0f;

// ---- finite differences --------------------------------------------------------------------------------------

// sum(y·R): the scalar whose gradient backward computes when dy = R.
double weighted_sum(const TensorView& y, const Mat& r) {
  const std::vector<double> yv = test::to_doubles(y);
  double s = 0;
  for (std::size_t i = 0; i < yv.size(); ++i) s += yv[i] * r.v[i];
  return s;
}

// d loss / d *value by central differences with one Richardson step, (4·D(h/2) - D(h)) / 3.
double finite_difference(const std::function<double()>& loss, float* value, float h) {
  const float saved = *value;
  auto central = [&](float step) {
    *value = saved + step;
    const double hi = *value, lp = loss();
    *value = saved - step;
    const double lo = *value, lm = loss();
    *value = saved;
    return (lp - lm) / (hi - lo);
  };
  return (4.0 * central(h / 2) - central(h)) / 3.0;
}

// Every element of `values` (an f32 host tensor the loss reads) perturbed in turn, against `analytic`.
::testing::AssertionResult matches_fd(const std::function<double()>& loss, const TensorView& values,
                                      const TensorView& analytic, const std::string& what) {
  const std::vector<double> g = test::to_doubles(analytic);
  std::int64_t bad = 0;
  std::string first;
  for (std::int64_t i = 0; i < values.numel(); ++i) {
    const double fd = finite_difference(loss, values.data_as<float>() + i, kFdStep);
    const double an = g[static_cast<std::size_t>(i)];
    if (!(std::fabs(fd - an) <= kFdAtol + kFdRtol * std::fabs(an)) && bad++ < 4)
      first += "\n  [" + std::to_string(i) + "] analytic " + std::to_string(an) + " fd " + std::to_string(fd);
  }
  if (bad) return ::testing::AssertionFailure() << what << ": " << bad << " of " << values.numel() << " off" << first;
  return ::testing::AssertionSuccess();
}

// all_close with atol taken relative to the largest reference magnitude (at least 1): rounding errors scale with
// the size of the terms summed, and the outputs here reach O(10).
::testing::AssertionResult close_to(const TensorView& got, const Mat& ref, test::Tolerance tol) {
  double scale = 1.0;
  for (double v : ref.v) scale = std::max(scale, std::fabs(v));
  return test::all_close(got, tensor_of(ref, DType::F32), {tol.atol * scale, tol.rtol, tol.rel_fro});
}

// ---- LoraLinear ----------------------------------------------------------------------------------------------

constexpr std::int64_t kM = 3, kK = 7, kN = 5;
constexpr std::int64_t kH = 6, kI = 5;  // the MLP's hidden and intermediate sizes
constexpr int kRank = 2;

TEST(LoraLinear, ForwardAndBackwardMatchNaiveFormula) {
  std::uint64_t seed = 100;
  for (bool nf4 : {false, true})
    for (bool bias : {false, true})
      for (float p : {0.0f, 0.3f}) {
        const Case s{nf4, DType::F32, MathMode::FP32, p, bias};
        LinearUnderTest t = make_linear(s, kK, kN, kRank, seed += 10);
        LoraLinear& l = *t.layer;
        const Tensor x = make_input(DType::F32, kM, kK, seed + 5, false);
        Tensor y(DType::F32, {kM, kN});
        test::poison(y);
        l.forward(x, y);
        EXPECT_EQ(l.dropout_active(), p > 0.0f);
        const RefLinear ref = RefLinear::of(l);
        EXPECT_TRUE(close_to(y, ref.forward(mat_of(x)), kF32Layer)) << describe(s);

        const Mat dy = mat_of(test::random_tensor(DType::F32, {kM, kN}, seed + 6));
        Tensor dx(DType::F32, {kM, kK});
        test::poison(dx);
        l.backward(x, tensor_of(dy, DType::F32), dx);
        const RefLinear::Grads g = ref.backward(mat_of(x), dy);
        EXPECT_TRUE(close_to(dx, g.dx, kF32Layer)) << "dx " << describe(s);
        EXPECT_TRUE(close_to(l.grad_a(), g.da, kF32Layer)) << "dA " << describe(s);
        EXPECT_TRUE(close_to(l.grad_b(), g.db, kF32Layer)) << "dB " << describe(s);
      }
}

TEST(LoraLinear, GradientsMatchFiniteDifferences) {
  std::uint64_t seed = 200;
  for (bool nf4 : {false, true})
    for (float p : {0.0f, 0.3f}) {
      const Case s{nf4, DType::F32, MathMode::FP32, p, true};
      LinearUnderTest t = make_linear(s, kK, kN, kRank, seed += 10);
      LoraLinear& l = *t.layer;
      const Tensor x = make_input(DType::F32, kM, kK, seed + 5, nf4);
      // R in multiples of 1/16: exact in bf16, so the NF4 input gradient (which rounds dy to bf16) sees R itself.
      const Mat r = mat_of(make_input(DType::F32, kM, kN, seed + 6, true));
      Tensor y(DType::F32, {kM, kN}), dx(DType::F32, {kM, kK});
      l.forward(x, y);  // draws the mask the differences below reuse (Recompute)
      l.backward(x, tensor_of(r, DType::F32), dx);
      auto loss = [&] {
        l.forward(x, y, ForwardMode::Recompute);
        return weighted_sum(y, r);
      };
      EXPECT_TRUE(matches_fd(loss, x, dx, "dx " + describe(s)));
      EXPECT_TRUE(matches_fd(loss, l.lora_a(), l.grad_a(), "dA " + describe(s)));
      EXPECT_TRUE(matches_fd(loss, l.lora_b(), l.grad_b(), "dB " + describe(s)));
    }
}

TEST(LoraLinear, BackwardAccumulatesGradientsAndOptionallyDx) {
  const Case s{false, DType::F32, MathMode::FP32, 0.25f, false};
  LinearUnderTest t = make_linear(s, kK, kN, kRank, 300);
  LoraLinear& l = *t.layer;
  const Tensor x = make_input(DType::F32, kM, kK, 301, false), dy = test::random_tensor(DType::F32, {kM, kN}, 302);
  Tensor y(DType::F32, {kM, kN}), dx(DType::F32, {kM, kK});
  l.forward(x, y);
  l.backward(x, dy, dx);
  const Tensor once_a = test::host_copy(l.grad_a()), once_b = test::host_copy(l.grad_b()), once_dx = test::host_copy(dx);
  // dx_beta = 1 adds to dx; the adapter gradients always add.
  l.backward(x, dy, dx, 1.0f);
  const Mat twice = plus(mat_of(once_dx), mat_of(once_dx));
  EXPECT_TRUE(close_to(dx, twice, kF32Layer));
  EXPECT_TRUE(close_to(l.grad_a(), plus(mat_of(once_a), mat_of(once_a)), kF32Layer));
  EXPECT_TRUE(close_to(l.grad_b(), plus(mat_of(once_b), mat_of(once_b)), kF32Layer));
  // Without dx only the adapter gradients change.
  l.zero_grad();
  EXPECT_TRUE(close_to(l.grad_a(), Mat(kRank, kK), {0, 0, 0}));
  l.backward(x, dy, TensorView{});
  EXPECT_TRUE(test::bytes_equal(l.grad_a(), once_a));
  EXPECT_TRUE(test::bytes_equal(l.grad_b(), once_b));
}

TEST(LoraLinear, Bf16ActivationsWithinBf16Tolerance) {
  std::uint64_t seed = 400;
  constexpr std::int64_t m = 9, k = 40, n = 24;
  for (bool nf4 : {false, true})
    for (DType act : {DType::BF16, DType::F32}) {
      // f32 activations here use the default math (BF16): the same tolerance applies.
      const Case s{nf4, act, act == DType::F32 ? LoraConfig{}.math : MathMode::FP32, 0.2f, true};
      LinearUnderTest t = make_linear(s, k, n, 4, seed += 10);
      LoraLinear& l = *t.layer;
      const Tensor x = make_input(act, m, k, seed + 5, false), dy = test::random_tensor(act, {m, n}, seed + 6);
      Tensor y(act, {m, n}), dx(act, {m, k});
      l.forward(x, y);
      l.backward(x, dy, dx);
      const RefLinear ref = RefLinear::of(l);
      const RefLinear::Grads g = ref.backward(mat_of(x), mat_of(dy));
      EXPECT_TRUE(close_to(y, ref.forward(mat_of(x)), kBf16Layer)) << "y " << describe(s);
      EXPECT_TRUE(close_to(dx, g.dx, kBf16Layer)) << "dx " << describe(s);
      EXPECT_TRUE(close_to(l.grad_a(), g.da, kBf16Layer)) << "dA " << describe(s);
      EXPECT_TRUE(close_to(l.grad_b(), g.db, kBf16Layer)) << "dB " << describe(s);
    }
}

TEST(LoraLinear, DropoutOnlyInTrainModeWithAFreshMaskPerForward) {
  const Case with{false, DType::F32, MathMode::FP32, 0.5f, false}, without{false, DType::F32, MathMode::FP32, 0.0f, false};
  LinearUnderTest a = make_linear(with, kK, kN, kRank, 500), b = make_linear(without, kK, kN, kRank, 500);
  const Tensor x = make_input(DType::F32, kM, kK, 501, false);
  Tensor ya(DType::F32, {kM, kN}), yb(DType::F32, {kM, kN}), y2(DType::F32, {kM, kN});
  // Eval: no dropout, the same as a layer without it.
  a.layer->forward(x, ya, ForwardMode::Eval);
  b.layer->forward(x, yb);
  EXPECT_FALSE(a.layer->dropout_active());
  EXPECT_FALSE(b.layer->dropout_active());
  EXPECT_TRUE(test::bytes_equal(ya, yb));
  // Train: a mask, a new one each forward; Recompute repeats the last one.
  a.layer->forward(x, ya);
  const std::uint64_t first = a.layer->dropout_seed();
  a.layer->forward(x, y2);
  EXPECT_NE(a.layer->dropout_seed(), first);
  EXPECT_FALSE(test::bytes_equal(ya, y2));
  EXPECT_FALSE(test::bytes_equal(ya, yb));
  a.layer->forward(x, ya, ForwardMode::Recompute);
  EXPECT_TRUE(test::bytes_equal(ya, y2));
}

TEST(LoraLinear, InitialisationCountsAndWorkingCopies) {
  const Case s{true, DType::BF16, MathMode::FP32, 0.0f, false};
  Frozen f = make_frozen(s, 64, 96, 600);
  LoraConfig c = config_of(s, 4, 601);
  LoraLinear l(cpu(), f.base(), c);
  // A ~ uniform(±1/sqrt(K)) and not constant; B = 0, so the layer starts as its base.
  const std::vector<double> a = test::to_doubles(l.lora_a());
  double lo = 1, hi = -1;
  for (double v : a) lo = std::min(lo, v), hi = std::max(hi, v);
  EXPECT_GE(lo, -1.0 / std::sqrt(96.0));
  EXPECT_LT(hi, 1.0 / std::sqrt(96.0));
  EXPECT_GT(hi - lo, 1.0 / std::sqrt(96.0));
  for (double v : test::to_doubles(l.lora_b())) EXPECT_EQ(v, 0.0);
  LoraLinear same_seed(cpu(), f.base(), c);
  EXPECT_TRUE(test::bytes_equal(same_seed.lora_a(), l.lora_a()));
  const Tensor x = make_input(DType::BF16, 5, 96, 602, false);
  Tensor y(DType::BF16, {5, 64}), base_only(DType::BF16, {5, 64});
  l.forward(x, y);
  nf4_gemm(cpu(), x, f.nf4, base_only);
  EXPECT_TRUE(test::bytes_equal(y, base_only));
  EXPECT_EQ(l.trainable_parameters(), 4 * (96 + 64));
  EXPECT_EQ(l.scale(), c.alpha / 4.0f);

  // The working copies follow the masters only when refreshed.
  const Tensor b_new = test::random_tensor(DType::F32, {64, 4}, 603);
  copy(l.lora_b(), b_new);
  Tensor y_stale(DType::BF16, {5, 64});
  l.forward(x, y_stale);
  EXPECT_TRUE(test::bytes_equal(y_stale, base_only));
  l.refresh_working_copies();
  l.forward(x, y_stale);
  EXPECT_FALSE(test::bytes_equal(y_stale, base_only));

  // QLoRA's memory figure: NF4 frozen weights at most 0.3x their bf16 bytes (double-quantized ~0.258, plain ~0.281).
  for (bool dq : {true, false}) {
    const Nf4Tensor big = Nf4Tensor::allocate(8960, 1536, dq);
    LoraLinear q(cpu(), BaseWeight(big), config_of(s, 16, 604));
    const double ratio = static_cast<double>(q.frozen_bytes()) / static_cast<double>(q.frozen_bf16_bytes());
    EXPECT_LE(ratio, 0.3) << (dq ? "double-quantized" : "plain");
    EXPECT_GT(ratio, 0.25);
  }
  EXPECT_EQ(l.frozen_bf16_bytes(), std::size_t{64 * 96 * 2});
}

TEST(LoraLinear, ValidationErrorsNameTheLayerAndArgument) {
  const Case s{false, DType::F32, MathMode::FP32, 0.0f, false};
  Frozen f = make_frozen(s, kN, kK, 700);
  const LoraConfig c = config_of(s, kRank, 701);
  auto with = [&](auto change) {
    LoraConfig cc = c;
    change(cc);
    return [&, cc] { (void)LoraLinear(cpu(), f.base(), cc); };
  };
  EXPECT_TRUE(test::throws_error(with([](LoraConfig& x) { x.rank = 0; }), ErrorCode::InvalidArgument, {"LoraLinear", "rank"}));
  EXPECT_TRUE(test::throws_error(with([](LoraConfig& x) { x.alpha = 0.0f; }), ErrorCode::InvalidArgument, {"LoraLinear", "alpha"}));
  EXPECT_TRUE(test::throws_error(with([](LoraConfig& x) { x.alpha = NAN; }), ErrorCode::InvalidArgument, {"alpha"}));
  EXPECT_TRUE(test::throws_error(with([](LoraConfig& x) { x.dropout = 1.0f; }), ErrorCode::InvalidArgument, {"dropout"}));
  EXPECT_TRUE(test::throws_error(with([](LoraConfig& x) { x.dropout = -0.1f; }), ErrorCode::InvalidArgument, {"dropout"}));
  EXPECT_TRUE(test::throws_error(with([](LoraConfig& x) { x.activations = DType::F16; }), ErrorCode::DTypeMismatch,
                     {"LoraLinear", "activations"}));
  EXPECT_TRUE(test::throws_error(with([](LoraConfig& x) { x.math = static_cast<MathMode>(9); }), ErrorCode::InvalidArgument,
                     {"math"}));
  // A dense base in another dtype than the activations, an empty one, a vector, one on another device.
  const Tensor w_bf16 = test::random_tensor(DType::BF16, {kN, kK}, 702);
  EXPECT_TRUE(test::throws_error([&] { (void)LoraLinear(cpu(), BaseWeight(w_bf16), c); }, ErrorCode::DTypeMismatch,
                     {"LoraLinear", "base", "bf16"}));
  EXPECT_TRUE(test::throws_error([&] { (void)LoraLinear(cpu(), BaseWeight(), c); }, ErrorCode::InvalidArgument, {"base", "empty"}));
  const Tensor w_vec = test::random_tensor(DType::F32, {kK}, 703);
  EXPECT_TRUE(test::throws_error([&] { (void)LoraLinear(cpu(), BaseWeight(w_vec), c); }, ErrorCode::ShapeMismatch, {"base", "rank"}));
  const TensorView w_elsewhere(f.dense.data(), DType::F32, {kN, kK}, Device::cuda(0));
  EXPECT_TRUE(test::throws_error([&] { (void)LoraLinear(cpu(), BaseWeight(w_elsewhere), c); }, ErrorCode::DeviceMismatch,
                     {"LoraLinear", "base", "cuda:0"}));
  const Tensor bias_long = test::random_tensor(DType::F32, {kN + 1}, 704), bias_u8(DType::U8, {kN});
  EXPECT_TRUE(test::throws_error([&] { (void)LoraLinear(cpu(), f.base(), c, bias_long); }, ErrorCode::ShapeMismatch, {"bias"}));
  EXPECT_TRUE(test::throws_error([&] { (void)LoraLinear(cpu(), f.base(), c, bias_u8); }, ErrorCode::DTypeMismatch, {"bias"}));

  LoraLinear l(cpu(), f.base(), c);
  const Tensor x = make_input(DType::F32, kM, kK, 705, false), x_bf16 = make_input(DType::BF16, kM, kK, 706, false);
  const Tensor x_wide = make_input(DType::F32, kM, kK + 1, 707, false), x3(DType::F32, {1, kM, kK});
  Tensor y(DType::F32, {kM, kN}), y_short(DType::F32, {kM - 1, kN}), dx(DType::F32, {kM, kK});
  const TensorView x_gpu(x.data(), DType::F32, {kM, kK}, Device::cuda(0)), x_null(nullptr, DType::F32, {kM, kK});
  const char* fwd = "LoraLinear::forward";
  test::poison(y);
  const Tensor y_before = test::host_copy(y);
  EXPECT_TRUE(test::throws_error([&] { l.backward(x, y, dx); }, ErrorCode::InvalidArgument, {"LoraLinear::backward", "forward"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x, y, ForwardMode::Recompute); }, ErrorCode::InvalidArgument, {fwd, "Recompute"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x_wide, y); }, ErrorCode::ShapeMismatch, {fwd, "x", "[M,7]"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x_bf16, y); }, ErrorCode::DTypeMismatch, {fwd, "x", "bf16"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x3, y); }, ErrorCode::ShapeMismatch, {fwd, "x", "rank"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x_gpu, y); }, ErrorCode::DeviceMismatch, {fwd, "x", "cuda:0"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x_null, y); }, ErrorCode::InvalidArgument, {fwd, "x", "null"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x, y_short); }, ErrorCode::ShapeMismatch, {fwd, "y"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x, TensorView(x.data(), DType::F32, {kM, kN})); }, ErrorCode::InvalidArgument,
                     {fwd, "overlap"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x, y, static_cast<ForwardMode>(7)); }, ErrorCode::InvalidArgument, {fwd, "mode"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward_on_base(x_wide, y); }, ErrorCode::ShapeMismatch,
                     {"LoraLinear::forward_on_base", "x"}));
  EXPECT_TRUE(test::bytes_equal(y, y_before)) << "a rejected call wrote its output";

  l.forward(x, y);
  const Tensor x_more = make_input(DType::F32, kM + 1, kK, 708, false);
  const char* bwd = "LoraLinear::backward";
  EXPECT_TRUE(test::throws_error([&] { l.backward(x_more, y, dx); }, ErrorCode::ShapeMismatch, {bwd, "x", "rows"}));
  EXPECT_TRUE(test::throws_error([&] { l.backward(x, y_short, dx); }, ErrorCode::ShapeMismatch, {bwd, "dy"}));
  EXPECT_TRUE(test::throws_error([&] { l.backward(x, y, x_bf16); }, ErrorCode::DTypeMismatch, {bwd, "dx"}));
  EXPECT_TRUE(test::throws_error([&] { l.backward(x, y, x); }, ErrorCode::InvalidArgument, {bwd, "dx", "x", "overlap"}));
  EXPECT_TRUE(test::throws_error([&] { l.backward(x, y, dx, NAN); }, ErrorCode::InvalidArgument, {bwd, "dx_beta"}));
  EXPECT_TRUE(test::throws_error([&] { l.forward(x_more, y_short, ForwardMode::Recompute); }, ErrorCode::ShapeMismatch,
                     {fwd, "y"}));
  const Tensor y_more(DType::F32, {kM + 1, kN});
  EXPECT_TRUE(test::throws_error([&] { l.forward(x_more, y_more, ForwardMode::Recompute); }, ErrorCode::ShapeMismatch,
                     {fwd, "Recompute", "rows"}));

  const char* load = "LoraLinear::load_adapters";
  const Tensor a_ok(DType::F32, {kRank, kK}), b_ok(DType::F32, {kN, kRank}), a_bf16(DType::BF16, {kRank, kK});
  EXPECT_TRUE(test::throws_error([&] { l.load_adapters(b_ok, b_ok); }, ErrorCode::ShapeMismatch, {load, "a"}));
  EXPECT_TRUE(test::throws_error([&] { l.load_adapters(a_ok, a_ok); }, ErrorCode::ShapeMismatch, {load, "b"}));
  EXPECT_TRUE(test::throws_error([&] { l.load_adapters(a_bf16, b_ok); }, ErrorCode::DTypeMismatch, {load, "a"}));
  EXPECT_TRUE(test::throws_error([&] { l.reserve(-1); }, ErrorCode::InvalidArgument, {"LoraLinear::reserve", "max_rows"}));
  EXPECT_TRUE(test::throws_error([&] { l.set_scratch(nullptr); }, ErrorCode::InvalidArgument, {"LoraLinear::set_scratch"}));
}

TEST(LoraLinear, ReserveAndSharedScratchDoNotChangeResults) {
  const Case s{true, DType::F32, MathMode::FP32, 0.3f, true};
  LinearUnderTest a = make_linear(s, kK, kN, kRank, 800), b = make_linear(s, kK, kN, kRank, 800);
  auto shared = std::make_shared<Scratch>();
  b.layer->set_scratch(shared);
  b.layer->reserve(16);
  EXPECT_GT(shared->bytes(), 0u);
  EXPECT_GE(b.layer->saved_bytes(), std::size_t{16 * kRank * 4});
  const Tensor x = make_input(DType::F32, kM, kK, 801, false), dy = test::random_tensor(DType::F32, {kM, kN}, 802);
  Tensor ya(DType::F32, {kM, kN}), yb(DType::F32, {kM, kN}), dxa(DType::F32, {kM, kK}), dxb(DType::F32, {kM, kK});
  const std::size_t reserved = shared->bytes();
  for (LinearUnderTest* t : {&a, &b}) {
    const bool is_a = t == &a;
    t->layer->forward(x, is_a ? ya : yb);
    t->layer->backward(x, dy, is_a ? dxa : dxb);
  }
  EXPECT_EQ(shared->bytes(), reserved) << "a call within the reserved rows allocated";
  EXPECT_TRUE(test::bytes_equal(ya, yb));
  EXPECT_TRUE(test::bytes_equal(dxa, dxb));
  EXPECT_TRUE(test::bytes_equal(a.layer->grad_a(), b.layer->grad_a()));
  EXPECT_TRUE(test::bytes_equal(a.layer->grad_b(), b.layer->grad_b()));
}

TEST(LoraLinear, ZeroRowsChangeNothing) {
  for (bool nf4 : {false, true}) {
    const Case s{nf4, DType::BF16, MathMode::FP32, 0.3f, true};
    LinearUnderTest t = make_linear(s, kK, kN, kRank, 900);
    const Tensor x(DType::BF16, {0, kK}), dy(DType::BF16, {0, kN});
    Tensor y(DType::BF16, {0, kN}), dx(DType::BF16, {0, kK});
    t.layer->forward(x, y);
    t.layer->backward(x, dy, dx);
    for (double v : test::to_doubles(t.layer->grad_a())) EXPECT_EQ(v, 0.0) << describe(s);
    MlpUnderTest mt = make_mlp(s, kH, kI, kRank, 901, {true, true});
    const Tensor xm(DType::BF16, {0, kH});
    Tensor ym(DType::BF16, {0, kH}), dxm(DType::BF16, {0, kH});
    mt.mlp->forward(xm, ym);
    mt.mlp->backward(xm, ym, dxm);
    for (double v : test::to_doubles(mt.mlp->down().grad_b())) EXPECT_EQ(v, 0.0) << describe(s);
    // Without dropout the adapters' terms go to the SwiGLU kernel: no rows there either.
    MlpUnderTest in_kernel = make_mlp({nf4, DType::BF16, MathMode::FP32, 0.0f, false}, kH, kI, kRank, 902);
    ASSERT_TRUE(in_kernel.mlp->adapters_in_swiglu());
    in_kernel.mlp->forward(xm, ym);
    in_kernel.mlp->backward(xm, ym, dxm);
    for (LoraLinear* l : {&in_kernel.mlp->gate(), &in_kernel.mlp->down()})
      for (double v : test::to_doubles(l->grad_a())) EXPECT_EQ(v, 0.0) << describe(s);
  }
}

// ---- SwiGluMlp -----------------------------------------------------------------------------------------------

TEST(SwiGluMlp, GradientsMatchFiniteDifferences) {
  std::uint64_t seed = 1000;
  for (bool recompute : {false, true})
    for (float p : {0.0f, 0.3f}) {
      const Case s{false, DType::F32, MathMode::FP32, p, false};
      MlpUnderTest t = make_mlp(s, kH, kI, kRank, seed += 100, {recompute, true});
      SwiGluMlp& mlp = *t.mlp;
      const Tensor x = make_input(DType::F32, kM, kH, seed + 60, false);
      const Mat r = mat_of(test::random_tensor(DType::F32, {kM, kH}, seed + 61));
      Tensor y(DType::F32, {kM, kH}), dx(DType::F32, {kM, kH});
      mlp.forward(x, y);  // draws the masks; the differences below reuse them (Recompute)
      mlp.backward(x, tensor_of(r, DType::F32), dx);
      auto loss = [&] {
        mlp.forward(x, y, ForwardMode::Recompute);
        return weighted_sum(y, r);
      };
      const std::string what = describe(s) + (recompute ? " recompute" : "");
      EXPECT_TRUE(matches_fd(loss, x, dx, "dx " + what));
      for (LoraLinear* l : {&mlp.gate(), &mlp.up(), &mlp.down()}) {
        const std::string name = l == &mlp.gate() ? " gate" : l == &mlp.up() ? " up" : " down";
        EXPECT_TRUE(matches_fd(loss, l->lora_a(), l->grad_a(), "dA" + name + " " + what));
        EXPECT_TRUE(matches_fd(loss, l->lora_b(), l->grad_b(), "dB" + name + " " + what));
      }
    }
}

struct MlpRun {
  Tensor y, dx;
  std::vector<Tensor> grads;  // dA, dB of gate, up, down
};

MlpRun run_mlp(SwiGluMlp& mlp, const Tensor& x, const Tensor& dy) {
  const DType act = x.dtype();
  MlpRun r{Tensor(act, {x.dim(0), mlp.hidden_features()}), Tensor(act, x.shape()), {}};
  test::poison(r.y);
  test::poison(r.dx);
  mlp.forward(x, r.y);
  mlp.backward(x, dy, r.dx);
  for (LoraLinear* l : {&mlp.gate(), &mlp.up(), &mlp.down()}) {
    r.grads.push_back(test::host_copy(l->grad_a()));
    r.grads.push_back(test::host_copy(l->grad_b()));
  }
  return r;
}

void expect_matches_ref(SwiGluMlp& mlp, const MlpRun& run, const Tensor& x, const Tensor& dy, bool round_storage,
                        test::Tolerance tol, const std::string& what) {
  const RefMlp ref = RefMlp::of(mlp, round_storage);
  const Mat xm = mat_of(x);
  EXPECT_TRUE(close_to(run.y, ref.forward(xm).y, tol)) << "y " << what;
  const RefMlp::Grads g = ref.backward(xm, mat_of(dy));
  EXPECT_TRUE(close_to(run.dx, g.dx, tol)) << "dx " << what;
  const RefLinear::Grads* parts[3] = {&g.gate, &g.up, &g.down};
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(close_to(run.grads[static_cast<std::size_t>(2 * i)], parts[i]->da, tol)) << "dA " << i << " " << what;
    EXPECT_TRUE(close_to(run.grads[static_cast<std::size_t>(2 * i + 1)], parts[i]->db, tol)) << "dB " << i << " " << what;
  }
}

TEST(SwiGluMlp, Nf4BasesMatchNaiveFormula) {
  // NF4 GEMMs round their inputs to bf16, which finite differences cannot see through; the fp64 formula applies
  // the same roundings instead. Fused (nf4_gate_up) and separate gate/up paths, with dropout, both recompute modes.
  std::uint64_t seed = 2000;
  constexpr std::int64_t m = 4, h = 24, i = 40;
  for (bool fuse : {true, false})
    for (bool recompute : {false, true}) {
      const Case s{true, DType::F32, MathMode::FP32, 0.2f, false};
      MlpUnderTest t = make_mlp(s, h, i, 3, seed += 100, {recompute, fuse});
      EXPECT_EQ(t.mlp->fused_gate_up(), fuse);
      const Tensor x = make_input(DType::F32, m, h, seed + 60, false), dy = test::random_tensor(DType::F32, {m, h}, seed + 61);
      const MlpRun run = run_mlp(*t.mlp, x, dy);
      expect_matches_ref(*t.mlp, run, x, dy, true, kF32Layer,
                         std::string(fuse ? "fused" : "separate") + (recompute ? " recompute" : ""));
    }
}

TEST(SwiGluMlp, Bf16ActivationsWithinBf16Tolerance) {
  std::uint64_t seed = 3000;
  constexpr std::int64_t m = 8, h = 32, i = 48;
  for (bool nf4 : {false, true}) {
    const Case s{nf4, DType::BF16, MathMode::FP32, 0.1f, false};
    MlpUnderTest t = make_mlp(s, h, i, 4, seed += 100);
    const Tensor x = make_input(DType::BF16, m, h, seed + 60, false), dy = test::random_tensor(DType::BF16, {m, h}, seed + 61);
    const MlpRun run = run_mlp(*t.mlp, x, dy);
    expect_matches_ref(*t.mlp, run, x, dy, false, kBf16Layer, describe(s));
  }
}

TEST(SwiGluMlp, RecomputeAndFusionChangeNoBits) {
  // The same layers (same seeds) with and without recompute, fused and not: identical outputs and gradients,
  // dropout included; recompute keeps less from forward to backward.
  constexpr std::int64_t m = 7, h = 16, i = 24;
  const Case s{true, DType::BF16, MathMode::FP32, 0.25f, false};
  MlpUnderTest base = make_mlp(s, h, i, 4, 4000, {false, true});
  const Tensor x = make_input(DType::BF16, m, h, 4001, false), dy = test::random_tensor(DType::BF16, {m, h}, 4002);
  const MlpRun ref = run_mlp(*base.mlp, x, dy);
  for (const MlpOptions o : {MlpOptions{true, true}, MlpOptions{false, false}, MlpOptions{true, false}}) {
    MlpUnderTest other = make_mlp(s, h, i, 4, 4000, o);
    const MlpRun got = run_mlp(*other.mlp, x, dy);
    const std::string what = std::string("recompute ") + (o.recompute ? "on" : "off") + ", fuse " +
                             (o.fuse_gate_up ? "on" : "off");
    EXPECT_TRUE(test::bytes_equal(got.y, ref.y)) << what;
    EXPECT_TRUE(test::bytes_equal(got.dx, ref.dx)) << what;
    for (std::size_t g = 0; g < ref.grads.size(); ++g) EXPECT_TRUE(test::bytes_equal(got.grads[g], ref.grads[g])) << what;
    if (o.recompute) EXPECT_LT(other.mlp->saved_bytes(), base.mlp->saved_bytes()) << what;
  }
  // Saved without recompute: gate and up [M,I] plus each projection's t [M,r], here at their exact sizes.
  EXPECT_EQ(base.mlp->saved_bytes(), std::size_t{(2 * m * i + 3 * m * 4) * 2});
}

// Gate's and up's adapter terms summed inside the SwiGLU kernel, and down's share of dh there too
// (adapters_in_swiglu): the same formula, dense and NF4, f32 and bf16; gate and up may drop out, down may not
// (then, or with a bias, the terms go onto gate and up as before). The sums go unrounded into the SwiGLU where the
// reference rounds gate and up to the activation dtype first: the tolerances of the other MLP tests hold.
TEST(SwiGluMlp, AdapterTermsInTheSwiGluKernelMatchTheFormula) {
  std::uint64_t seed = 7000;
  constexpr std::int64_t m = 6, h = 24, i = 40;
  for (bool nf4 : {false, true})
    for (DType act : {DType::F32, DType::BF16})
      for (float gate_up_dropout : {0.0f, 0.3f}) {
        const Case s{nf4, act, MathMode::FP32, 0.0f, false};
        Frozen g = make_frozen(s, i, h, seed += 100), u = make_frozen(s, i, h, seed + 10),
               d = make_frozen(s, h, i, seed + 20);
        LoraConfig cg = config_of(s, 3, seed + 30), cu = config_of(s, 5, seed + 31), cd = config_of(s, 4, seed + 32);
        cg.dropout = cu.dropout = gate_up_dropout;
        SwiGluMlp mlp(LoraLinear(cpu(), g.base(), cg), LoraLinear(cpu(), u.base(), cu),
                      LoraLinear(cpu(), d.base(), cd));
        randomize_adapters(mlp.gate(), seed + 40);
        randomize_adapters(mlp.up(), seed + 41);
        randomize_adapters(mlp.down(), seed + 42);
        ASSERT_TRUE(mlp.adapters_in_swiglu());
        const Tensor x = make_input(act, m, h, seed + 60, false), dy = test::random_tensor(act, {m, h}, seed + 61);
        const MlpRun run = run_mlp(mlp, x, dy);
        const bool f32 = act == DType::F32;
        expect_matches_ref(mlp, run, x, dy, f32, f32 ? kF32Layer : kBf16Layer,
                           describe(s) + " gate/up dropout " + std::to_string(gate_up_dropout));
      }
}

TEST(SwiGluMlp, AdapterTermsGoToTheKernelOnlyWhereTheyMay) {
  const Case s{false, DType::F32, MathMode::FP32, 0.0f, false};
  Frozen g = make_frozen(s, kI, kH, 7500), u = make_frozen(s, kI, kH, 7501), d = make_frozen(s, kH, kI, 7502);
  const Case with_bias{false, DType::F32, MathMode::FP32, 0.0f, true};
  Frozen gb = make_frozen(with_bias, kI, kH, 7503);
  LoraConfig c = config_of(s, kRank, 7504), dropping = c;
  dropping.dropout = 0.2f;
  SwiGluMlp plain(LoraLinear(cpu(), g.base(), c), LoraLinear(cpu(), u.base(), c), LoraLinear(cpu(), d.base(), c));
  SwiGluMlp down_drops(LoraLinear(cpu(), g.base(), c), LoraLinear(cpu(), u.base(), c),
                       LoraLinear(cpu(), d.base(), dropping));
  SwiGluMlp biased(LoraLinear(cpu(), gb.base(), c, gb.bias), LoraLinear(cpu(), u.base(), c),
                   LoraLinear(cpu(), d.base(), c));
  EXPECT_TRUE(plain.adapters_in_swiglu());
  EXPECT_FALSE(down_drops.adapters_in_swiglu());
  EXPECT_TRUE(down_drops.adapters_in_swiglu(ForwardMode::Eval));  // nothing dropped in an Eval forward
  EXPECT_FALSE(biased.adapters_in_swiglu());
  // f32 activations whose adapters' GEMMs truncate their operands (MathMode::BF16): the kernel's exact sums would
  // differ from those GEMMs by a bf16 rounding, so the terms stay on gate and up.
  LoraConfig truncating = c;
  truncating.math = MathMode::BF16;
  SwiGluMlp reduced(LoraLinear(cpu(), g.base(), truncating), LoraLinear(cpu(), u.base(), c),
                    LoraLinear(cpu(), d.base(), c));
  EXPECT_FALSE(reduced.adapters_in_swiglu());
  // Down dropping out: the terms go onto gate and up, and the result is still the formula.
  randomize_adapters(down_drops.gate(), 7505);
  randomize_adapters(down_drops.up(), 7506);
  randomize_adapters(down_drops.down(), 7507);
  const Tensor x = make_input(DType::F32, kM, kH, 7508, false), dy = test::random_tensor(DType::F32, {kM, kH}, 7509);
  expect_matches_ref(down_drops, run_mlp(down_drops, x, dy), x, dy, true, kF32Layer, "down drops out");
}

TEST(SwiGluMlp, AdapterTermsInTheKernelWithRecomputeAndFusionChangeNoBits) {
  constexpr std::int64_t m = 7, h = 16, i = 24;
  const Case s{true, DType::BF16, MathMode::FP32, 0.0f, false};
  MlpUnderTest base = make_mlp(s, h, i, 4, 7600, {false, true});
  ASSERT_TRUE(base.mlp->adapters_in_swiglu());
  const Tensor x = make_input(DType::BF16, m, h, 7601, false), dy = test::random_tensor(DType::BF16, {m, h}, 7602);
  const MlpRun ref = run_mlp(*base.mlp, x, dy);
  for (const MlpOptions o : {MlpOptions{true, true}, MlpOptions{false, false}, MlpOptions{true, false}}) {
    MlpUnderTest other = make_mlp(s, h, i, 4, 7600, o);
    const MlpRun got = run_mlp(*other.mlp, x, dy);
    const std::string what =
        std::string("recompute ") + (o.recompute ? "on" : "off") + ", fuse " + (o.fuse_gate_up ? "on" : "off");
    EXPECT_TRUE(test::bytes_equal(got.y, ref.y)) << what;
    EXPECT_TRUE(test::bytes_equal(got.dx, ref.dx)) << what;
    for (std::size_t g = 0; g < ref.grads.size(); ++g)
      EXPECT_TRUE(test::bytes_equal(got.grads[g], ref.grads[g])) << what;
  }
}

TEST(SwiGluMlp, EvalModeAndBackwardConsumesTheForward) {
  const Case s{false, DType::F32, MathMode::FP32, 0.4f, false};
  MlpUnderTest a = make_mlp(s, kH, kI, kRank, 5000), b = make_mlp({false, DType::F32, MathMode::FP32, 0.0f, false},
                                                                  kH, kI, kRank, 5000);
  const Tensor x = make_input(DType::F32, kM, kH, 5001, false), dy = test::random_tensor(DType::F32, {kM, kH}, 5002);
  Tensor ya(DType::F32, {kM, kH}), yb(DType::F32, {kM, kH}), dx(DType::F32, {kM, kH});
  a.mlp->forward(x, ya, ForwardMode::Eval);
  b.mlp->forward(x, yb);
  EXPECT_TRUE(test::bytes_equal(ya, yb));
  // Train, backward; a second backward has nothing left; a Recompute forward rebuilds the same activations.
  Tensor dx2(DType::F32, {kM, kH});
  a.mlp->forward(x, ya);
  a.mlp->backward(x, dy, dx);
  EXPECT_TRUE(test::throws_error([&] { a.mlp->backward(x, dy, dx); }, ErrorCode::InvalidArgument,
                                 {"SwiGluMlp::backward", "forward"}));
  a.mlp->forward(x, yb, ForwardMode::Recompute);
  EXPECT_TRUE(test::bytes_equal(ya, yb));
  a.mlp->backward(x, dy, dx2);
  EXPECT_TRUE(test::bytes_equal(dx, dx2));
  const Tensor x_more = make_input(DType::F32, kM + 1, kH, 5003, false);
  Tensor y_more(DType::F32, {kM + 1, kH});
  EXPECT_TRUE(test::throws_error([&] { a.mlp->forward(x_more, y_more, ForwardMode::Recompute); },
                                 ErrorCode::InvalidArgument, {"SwiGluMlp::forward", "Recompute"}));
}

TEST(SwiGluMlp, ValidationErrorsNameTheLayerAndArgument) {
  const Case s{false, DType::F32, MathMode::FP32, 0.0f, false};
  Frozen g = make_frozen(s, kI, kH, 6000), u = make_frozen(s, kI, kH, 6001), d = make_frozen(s, kH, kI, 6002);
  Frozen u_wrong = make_frozen(s, kI + 1, kH, 6003), d_wrong = make_frozen(s, kI, kH, 6004);
  const LoraConfig c = config_of(s, kRank, 6005);
  EXPECT_TRUE(test::throws_error([&] { (void)SwiGluMlp(cpu(), g.base(), u_wrong.base(), d.base(), c); }, ErrorCode::ShapeMismatch,
                     {"SwiGluMlp", "up"}));
  EXPECT_TRUE(test::throws_error([&] { (void)SwiGluMlp(cpu(), g.base(), u.base(), d_wrong.base(), c); }, ErrorCode::ShapeMismatch,
                     {"SwiGluMlp", "down"}));
  EXPECT_TRUE(test::throws_error([&] { (void)SwiGluMlp(cpu(), g.base(), BaseWeight(), d.base(), c); }, ErrorCode::InvalidArgument,
                     {"SwiGluMlp (up)", "base"}));
  LoraConfig c_bf16 = c;
  c_bf16.activations = DType::BF16;
  Frozen d_bf16 = make_frozen({false, DType::BF16}, kH, kI, 6006);
  EXPECT_TRUE(test::throws_error(
      [&] {
        (void)SwiGluMlp(LoraLinear(cpu(), g.base(), c), LoraLinear(cpu(), u.base(), c), LoraLinear(cpu(), d_bf16.base(), c_bf16));
      },
      ErrorCode::DTypeMismatch, {"SwiGluMlp", "activations"}));

  SwiGluMlp mlp(cpu(), g.base(), u.base(), d.base(), c);
  const Tensor x = make_input(DType::F32, kM, kH, 6007, false), x_bf16 = make_input(DType::BF16, kM, kH, 6008, false);
  const Tensor x_wide = make_input(DType::F32, kM, kH + 1, 6009, false);
  Tensor y(DType::F32, {kM, kH}), y_short(DType::F32, {kM - 1, kH}), dx(DType::F32, {kM, kH});
  const char* fwd = "SwiGluMlp::forward";
  const char* bwd = "SwiGluMlp::backward";
  EXPECT_TRUE(test::throws_error([&] { mlp.backward(x, y, dx); }, ErrorCode::InvalidArgument, {bwd, "forward"}));
  EXPECT_TRUE(test::throws_error([&] { mlp.forward(x_wide, y); }, ErrorCode::ShapeMismatch, {fwd, "x"}));
  EXPECT_TRUE(test::throws_error([&] { mlp.forward(x_bf16, y); }, ErrorCode::DTypeMismatch, {fwd, "x"}));
  EXPECT_TRUE(test::throws_error([&] { mlp.forward(x, y_short); }, ErrorCode::ShapeMismatch, {fwd, "y"}));
  const TensorView x_gpu(x.data(), DType::F32, {kM, kH}, Device::cuda(0));
  EXPECT_TRUE(test::throws_error([&] { mlp.forward(x_gpu, y); }, ErrorCode::DeviceMismatch, {fwd, "x"}));
  mlp.forward(x, y);
  EXPECT_TRUE(test::throws_error([&] { mlp.backward(x, y_short, dx); }, ErrorCode::ShapeMismatch, {bwd, "dy"}));
  EXPECT_TRUE(test::throws_error([&] { mlp.backward(x, y, dx, INFINITY); }, ErrorCode::InvalidArgument, {bwd, "dx_beta"}));
  EXPECT_TRUE(test::throws_error([&] { mlp.backward(x, y, y); }, ErrorCode::InvalidArgument, {bwd, "dx", "overlap"}));
  EXPECT_TRUE(test::throws_error([&] { mlp.reserve(-2); }, ErrorCode::InvalidArgument, {"SwiGluMlp::reserve"}));
  EXPECT_TRUE(test::throws_error([&] { mlp.set_scratch(nullptr); }, ErrorCode::InvalidArgument, {"SwiGluMlp::set_scratch"}));
}

// ---- AdamW and training --------------------------------------------------------------------------------------

TEST(AdamW, StepsEveryAdapterThenRefreshesWorkingCopies) {
  const Case s{true, DType::BF16, MathMode::FP32, 0.0f, false};
  MlpUnderTest t = make_mlp(s, 16, 24, 2, 7000);
  SwiGluMlp& mlp = *t.mlp;
  AdamW opt(cpu(), AdamWOptions{.lr = 1e-2f});
  opt.add(mlp);
  EXPECT_EQ(mlp.parameters().size(), 6u);
  EXPECT_TRUE(test::throws_error([&] { opt.add(mlp.up()); }, ErrorCode::InvalidArgument, {"AdamW::add", "already"}));
  AdamW empty(cpu(), {});
  EXPECT_TRUE(test::throws_error([&] { empty.step(); }, ErrorCode::InvalidArgument, {"AdamW::step"}));

  const Tensor x = make_input(DType::BF16, 5, 16, 7001, false), dy = test::random_tensor(DType::BF16, {5, 16}, 7002);
  Tensor y(DType::BF16, {5, 16}), y_after(DType::BF16, {5, 16}), dx(DType::BF16, {5, 16});
  mlp.forward(x, y);
  mlp.backward(x, dy, dx);
  std::vector<Tensor> before;
  for (const AdamWParam& p : mlp.parameters()) before.push_back(test::host_copy(p.param));
  opt.step();
  EXPECT_EQ(opt.steps(), 1);
  const std::vector<AdamWParam> after = mlp.parameters();
  for (std::size_t i = 0; i < after.size(); ++i)
    EXPECT_FALSE(test::bytes_equal(after[i].param, before[i])) << "parameter " << i << " did not move";
  // The bf16 forward sees the new masters without a manual refresh.
  mlp.forward(x, y_after, ForwardMode::Eval);
  EXPECT_FALSE(test::bytes_equal(y_after, y));
  opt.zero_grad();
  for (const AdamWParam& p : mlp.parameters())
    for (double v : test::to_doubles(p.grad)) EXPECT_EQ(v, 0.0);
}

TEST(SwiGluMlp, TrainingOnNf4BasesRecoversALowRankChange) {
  // A teacher MLP is the frozen NF4 base plus a hidden low-rank change (nonzero adapters); a student on the same
  // base starts from B = 0 and learns the change from the teacher's outputs with AdamW.
  constexpr std::int64_t h = 32, i = 64, rows = 64;
  constexpr int rank = 4;
  const Case s{true, DType::F32, MathMode::BF16, 0.0f, false};
  Frozen g = make_frozen(s, i, h, 8000), u = make_frozen(s, i, h, 8001), d = make_frozen(s, h, i, 8002);
  const LoraConfig c = config_of(s, rank, 8003);
  SwiGluMlp teacher(cpu(), g.base(), u.base(), d.base(), c), student(cpu(), g.base(), u.base(), d.base(), c);
  for (LoraLinear* l : {&teacher.gate(), &teacher.up(), &teacher.down()})
    l->load_adapters(test::random_tensor(DType::F32, l->lora_a().shape(), 8004 + l->in_features(), -0.4f, 0.4f),
                     test::random_tensor(DType::F32, l->lora_b().shape(), 8005 + l->out_features(), -0.4f, 0.4f));
  std::vector<Tensor> xs, targets;
  for (int b = 0; b < 4; ++b) {
    xs.push_back(test::random_tensor(DType::F32, {rows, h}, 8100 + static_cast<std::uint64_t>(b)));
    targets.emplace_back(DType::F32, Shape{rows, h});
    teacher.forward(xs.back(), targets.back(), ForwardMode::Eval);
  }
  AdamW opt(cpu(), AdamWOptions{.lr = 1e-2f, .max_grad_norm = 1.0f});
  opt.add(student);
  Tensor y(DType::F32, {rows, h}), dy(DType::F32, {rows, h}), loss(DType::F32, {1});
  auto epoch_loss = [&] {
    double sum = 0;
    for (std::size_t b = 0; b < xs.size(); ++b) {
      student.forward(xs[b], y, ForwardMode::Eval);
      mse_loss(cpu(), y, targets[b], loss, dy);
      sum += loss.data_as<float>()[0];
    }
    return sum / static_cast<double>(xs.size());
  };
  const double initial = epoch_loss();
  for (int step = 0; step < 120; ++step) {
    const Tensor& x = xs[static_cast<std::size_t>(step) % xs.size()];
    opt.zero_grad();
    student.forward(x, y);
    mse_loss(cpu(), y, targets[static_cast<std::size_t>(step) % xs.size()], loss, dy);
    student.backward(x, dy, TensorView{});
    opt.step();
  }
  const double final_loss = epoch_loss();
  EXPECT_GT(initial, 1e-3) << "the hidden change is too small to learn";
  EXPECT_LT(final_loss, initial / 20.0) << "initial " << initial << " final " << final_loss;
  std::printf("[ training  ] loss %.4g -> %.4g in 120 AdamW steps\n", initial, final_loss);
}

}  // namespace
}  // namespace qmm
