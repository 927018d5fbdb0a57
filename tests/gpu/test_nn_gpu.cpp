// LoRA layers on a CUDA context against the same layers on the CPU context (same seeds, same inputs, so the same
// A initialisation and dropout masks): LoraLinear and SwiGluMlp forward and backward at realistic sizes, f32 and
// bf16 activations, dense and NF4 bases; and a short training run on the device.
#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Tolerances of the device against the CPU layer, per element |d| <= atol·max|ref| + rtol·|ref|, and a relative
// Frobenius limit. Both sides apply the same operand roundings (the math-mode and NF4 contracts); they differ in
// accumulation (cuBLASLt fp32 vs the oracle's fp64, ~1e-6 relative) and in what that does downstream: a stored
// intermediate (t, gate, up, h, dh, dt) that lands on the other side of a bf16 rounding or truncation boundary
// differs by one bf16 ulp in one of K terms of the next GEMM, and a bf16 output can round one ulp apart.
//  - f32 activations, BF16 math (the default): outputs are f32, so only the boundary flips of truncated
//    intermediates show, ~2^-8 of one term among K or r: ~1e-3 of an output where the adapter term dominates;
//    where a gradient sums terms that cancel (dB over M rows of SwiGLU gradients), a few such flips reach
//    2^-8 = 3.9e-3 of the largest element (measured on the H200: 4.3e-3 of max in dB of up, M=130), hence 5e-3.
//  - bf16 activations: two bf16 ulps per element (the output rounding, after an intermediate that may itself be
//    one ulp apart), 2^-7 = 7.8e-3 each; where the stored base and adapter terms cancel, one ulp of the larger
//    term, hence atol relative to the largest magnitude.
struct Tol {
  double atol_of_max, rtol, rel_fro;
};
constexpr Tol kF32Tol{5e-3, 2e-3, 1e-3};
constexpr Tol kBf16Tol{1.6e-2, 1.6e-2, 5e-3};
Tol tol_for(DType act) { return act == DType::BF16 ? kBf16Tol : kF32Tol; }
// The MLP chains three bf16 layers, and on the GPU its accumulating bf16 GEMMs (each LoRA sum, on dense bases the
// base GEMM accumulating onto the adapter's product; the up projection's dx) go through cuBLASLt, which rounds the
// product to bf16 before adding beta*C, while the CPU rounds once: ~30% of those elements differ by one bf16 ulp
// (measured on the H200), and the MLP's outputs then differ by a relative Frobenius error of up to ~6e-3 (H200,
// the runs below).
constexpr Tol kBf16MlpTol{1.6e-2, 1.6e-2, 1e-2};
// f32 activations at M <= 16 take the NF4 pair kernel, whose weights enter as bf16(code) * scale, within 2^-9
// relative of the CPU's bf16(code * scale) (ops.h): through the block's three layers that is bf16-sized error
// (relative Frobenius ~0.004 measured), not fp32 accumulation's.
constexpr Tol kNf4PairF32Tol{5e-3, 2e-3, 1e-2};

::testing::AssertionResult matches(const TensorView& gpu_t, const TensorView& cpu_t, Tol tol) {
  double max_ref = 0;
  for (double v : test::to_doubles(cpu_t)) max_ref = std::max(max_ref, std::fabs(v));
  return test::all_close(gpu_t, cpu_t, {tol.atol_of_max * std::max(max_ref, 1e-30), tol.rtol, tol.rel_fro});
}

Nf4Tensor nf4_on(const Nf4Tensor& host, Device device) {
  Nf4Tensor d = Nf4Tensor::allocate(host.rows, host.cols, host.absmax.dtype() == DType::U8, device, host.block_size);
  copy(d.codes, host.codes);
  copy(d.absmax, host.absmax);
  if (host.absmax2.defined()) copy(d.absmax2, host.absmax2);
  if (host.code2.defined()) copy(d.code2, host.code2);
  d.offset = host.offset;
  return d;
}

// One frozen weight (and optional bias) on both devices.
struct Frozen {
  Tensor dense_host, dense_dev, bias_host, bias_dev;
  Nf4Tensor nf4_host, nf4_dev;
  bool nf4 = false;
  BaseWeight host() const { return nf4 ? BaseWeight(nf4_host) : BaseWeight(dense_host); }
  BaseWeight dev() const { return nf4 ? BaseWeight(nf4_dev) : BaseWeight(dense_dev); }
};

Frozen make_frozen(bool nf4, DType act, std::int64_t n, std::int64_t k, bool bias, std::uint64_t seed) {
  const Device dev = test::gpu_context()->device();
  // Weights of a trained layer's scale (|w| ~ 1/sqrt(K)) so activations stay O(1) through the MLP.
  const float bound = 2.0f / std::sqrt(static_cast<float>(k));
  Frozen f;
  f.nf4 = nf4;
  if (nf4) {
    f.nf4_host = nf4_quantize(cpu(), test::random_tensor(DType::F32, {n, k}, seed, -bound, bound), true);
    f.nf4_dev = nf4_on(f.nf4_host, dev);
  } else {
    f.dense_host = test::random_tensor(act, {n, k}, seed, -bound, bound);
    f.dense_dev = to_device(f.dense_host, dev);
  }
  if (bias) {
    f.bias_host = test::random_tensor(act, {n}, seed + 1);
    f.bias_dev = to_device(f.bias_host, dev);
  }
  return f;
}

LoraConfig config_of(DType act, int rank, float dropout, std::uint64_t seed) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = 2.0f * static_cast<float>(rank);
  c.dropout = dropout;
  c.activations = act;  // f32 keeps the default math (BF16)
  c.seed = seed;
  return c;
}

// The same nonzero adapters into both layers (B = 0 would hide the adapter terms).
void same_adapters(LoraLinear& on_cpu, LoraLinear& on_gpu, std::uint64_t seed) {
  const std::int64_t r = on_cpu.config().rank;
  const float a_bound = 1.0f / std::sqrt(static_cast<float>(on_cpu.in_features()));
  const Tensor a = test::random_tensor(DType::F32, {r, on_cpu.in_features()}, seed, -a_bound, a_bound);
  const Tensor b = test::random_tensor(DType::F32, {on_cpu.out_features(), r}, seed + 1, -0.2f, 0.2f);
  on_cpu.load_adapters(a, b);
  on_gpu.load_adapters(a, b);
}

struct Buffers {
  Tensor x_host, dy_host, x, dy, y, dx, y_cpu, dx_cpu;
};

Buffers make_buffers(DType act, std::int64_t m, std::int64_t k, std::int64_t n, std::uint64_t seed) {
  const Device dev = test::gpu_context()->device();
  Buffers b;
  b.x_host = test::random_tensor(act, {m, k}, seed);
  b.dy_host = test::random_tensor(act, {m, n}, seed + 1);
  b.x = to_device(b.x_host, dev);
  b.dy = to_device(b.dy_host, dev);
  b.y = Tensor(act, {m, n}, dev);
  b.dx = Tensor(act, {m, k}, dev);
  b.y_cpu = Tensor(act, {m, n});
  b.dx_cpu = Tensor(act, {m, k});
  test::poison(b.y);
  test::poison(b.dx);
  return b;
}

std::string describe(bool nf4, DType act, std::int64_t m) {
  return std::string(nf4 ? "nf4" : "dense") + " " + dtype_name(act) + " M=" + std::to_string(m);
}

TEST(NnGpu, LoraLinearMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  constexpr std::int64_t m = 130, k = 1536, n = 1000;
  constexpr int rank = 16;
  std::uint64_t seed = 100;
  for (bool nf4 : {false, true})
    for (DType act : {DType::F32, DType::BF16}) {
      const Frozen f = make_frozen(nf4, act, n, k, true, seed += 10);
      const LoraConfig c = config_of(act, rank, 0.1f, seed + 2);
      LoraLinear on_cpu(cpu(), f.host(), c, f.bias_host), on_gpu(gpu, f.dev(), c, f.bias_dev);
      same_adapters(on_cpu, on_gpu, seed + 3);
      Buffers b = make_buffers(act, m, k, n, seed + 5);
      on_cpu.forward(b.x_host, b.y_cpu);
      on_cpu.backward(b.x_host, b.dy_host, b.dx_cpu);
      on_gpu.forward(b.x, b.y);
      on_gpu.backward(b.x, b.dy, b.dx);
      gpu.synchronize();
      const std::string what = describe(nf4, act, m);
      const Tol tol = tol_for(act);
      EXPECT_EQ(on_gpu.dropout_seed(), on_cpu.dropout_seed()) << what;
      EXPECT_TRUE(matches(b.y, b.y_cpu, tol)) << "y " << what;
      EXPECT_TRUE(matches(b.dx, b.dx_cpu, tol)) << "dx " << what;
      EXPECT_TRUE(matches(on_gpu.grad_a(), on_cpu.grad_a(), tol)) << "dA " << what;
      EXPECT_TRUE(matches(on_gpu.grad_b(), on_cpu.grad_b(), tol)) << "dB " << what;
    }
}

TEST(NnGpu, SwiGluMlpMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  constexpr std::int64_t h = 1536, i = 1000;
  constexpr int rank = 16;
  std::uint64_t seed = 200;
  struct Run {
    bool nf4;
    DType act;
    std::int64_t m;
    bool recompute;
    float dropout = 0.1f;
  };
  // M = 7 takes the small-M NF4 kernels (fused gate/up included) where the dispatcher picks them. Without
  // dropout the adapters' terms go into the SwiGLU kernel (adapters_in_swiglu: bf16 on the GPU; on the CPU bf16 or
  // f32 under FP32 math, which these configs' default BF16 math is not: both devices take the same formula).
  const std::vector<Run> runs = {{false, DType::F32, 130, false},       {false, DType::BF16, 130, true},
                                 {true, DType::F32, 130, true},         {true, DType::BF16, 130, false},
                                 {true, DType::BF16, 7, false},         {true, DType::F32, 7, true},
                                 {true, DType::BF16, 130, false, 0.0f}, {false, DType::BF16, 130, true, 0.0f},
                                 {true, DType::BF16, 7, true, 0.0f},    {true, DType::F32, 130, false, 0.0f}};
  for (const Run& r : runs) {
    const Frozen g = make_frozen(r.nf4, r.act, i, h, false, seed += 10), u = make_frozen(r.nf4, r.act, i, h, false, seed + 3),
                 d = make_frozen(r.nf4, r.act, h, i, false, seed + 6);
    const LoraConfig c = config_of(r.act, rank, r.dropout, seed + 8);
    const MlpOptions o{r.recompute, true};
    SwiGluMlp on_cpu(cpu(), g.host(), u.host(), d.host(), c, o), on_gpu(gpu, g.dev(), u.dev(), d.dev(), c, o);
    EXPECT_EQ(on_gpu.adapters_in_swiglu(), r.dropout == 0.0f && r.act == DType::BF16);
    EXPECT_EQ(on_cpu.adapters_in_swiglu(), on_gpu.adapters_in_swiglu());
    same_adapters(on_cpu.gate(), on_gpu.gate(), seed + 9);
    same_adapters(on_cpu.up(), on_gpu.up(), seed + 11);
    same_adapters(on_cpu.down(), on_gpu.down(), seed + 13);
    Buffers b = make_buffers(r.act, r.m, h, h, seed + 15);
    on_cpu.forward(b.x_host, b.y_cpu);
    on_cpu.backward(b.x_host, b.dy_host, b.dx_cpu);
    on_gpu.forward(b.x, b.y);
    on_gpu.backward(b.x, b.dy, b.dx);
    gpu.synchronize();
    const std::string what =
        describe(r.nf4, r.act, r.m) + (r.recompute ? " recompute" : "") + (r.dropout == 0.0f ? " no dropout" : "");
    const Tol tol = r.act == DType::BF16 ? kBf16MlpTol : r.nf4 && r.m <= 16 ? kNf4PairF32Tol : kF32Tol;
    EXPECT_TRUE(matches(b.y, b.y_cpu, tol)) << "y " << what;
    EXPECT_TRUE(matches(b.dx, b.dx_cpu, tol)) << "dx " << what;
    const LoraLinear* cpu_parts[3] = {&on_cpu.gate(), &on_cpu.up(), &on_cpu.down()};
    const LoraLinear* gpu_parts[3] = {&on_gpu.gate(), &on_gpu.up(), &on_gpu.down()};
    const char* names[3] = {"gate", "up", "down"};
    for (int p = 0; p < 3; ++p) {
      EXPECT_TRUE(matches(gpu_parts[p]->grad_a(), cpu_parts[p]->grad_a(), tol)) << "dA " << names[p] << " " << what;
      EXPECT_TRUE(matches(gpu_parts[p]->grad_b(), cpu_parts[p]->grad_b(), tol)) << "dB " << names[p] << " " << what;
    }
  }
}

TEST(NnGpu, TrainingOnNf4BasesReducesLoss) {
  // The CPU training test's setup on the device, bf16 activations: a student learns a teacher's hidden low-rank
  // change to the same NF4 base; the loss is read back only at the start and the end.
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  constexpr std::int64_t h = 256, i = 512, rows = 256;
  const DType act = DType::BF16;
  const Frozen g = make_frozen(true, act, i, h, false, 300), u = make_frozen(true, act, i, h, false, 301),
               d = make_frozen(true, act, h, i, false, 302);
  const LoraConfig c = config_of(act, 8, 0.0f, 303);
  SwiGluMlp teacher(gpu, g.dev(), u.dev(), d.dev(), c), student(gpu, g.dev(), u.dev(), d.dev(), c);
  for (LoraLinear* l : {&teacher.gate(), &teacher.up(), &teacher.down()})
    l->load_adapters(test::random_tensor(DType::F32, l->lora_a().shape(), 304 + l->in_features(), -0.1f, 0.1f),
                     test::random_tensor(DType::F32, l->lora_b().shape(), 305 + l->out_features(), -0.2f, 0.2f));
  std::vector<Tensor> xs, targets;
  for (int b = 0; b < 4; ++b) {
    xs.push_back(to_device(test::random_tensor(act, {rows, h}, 310 + static_cast<std::uint64_t>(b)), gpu.device()));
    targets.emplace_back(act, Shape{rows, h}, gpu.device());
    teacher.forward(xs.back(), targets.back(), ForwardMode::Eval);
  }
  AdamW opt(gpu, AdamWOptions{.lr = 1e-2f, .max_grad_norm = 1.0f});
  opt.add(student);
  Tensor y(act, {rows, h}, gpu.device()), dy(act, {rows, h}, gpu.device()), loss(DType::F32, {1}, gpu.device());
  auto mean_loss = [&] {
    double sum = 0;
    for (std::size_t b = 0; b < xs.size(); ++b) {
      student.forward(xs[b], y, ForwardMode::Eval);
      mse_loss(gpu, y, targets[b], loss, dy);
      sum += test::to_doubles(loss)[0];
    }
    return sum / static_cast<double>(xs.size());
  };
  const double initial = mean_loss();
  for (int step = 0; step < 150; ++step) {
    const std::size_t b = static_cast<std::size_t>(step) % xs.size();
    opt.zero_grad();
    student.forward(xs[b], y);
    mse_loss(gpu, y, targets[b], loss, dy);
    student.backward(xs[b], dy, TensorView{});
    opt.step();
  }
  const double final_loss = mean_loss();
  EXPECT_GT(initial, 1e-4) << "the hidden change is too small to learn";
  EXPECT_LT(final_loss, initial / 10.0) << "initial " << initial << " final " << final_loss;
  std::printf("[ training  ] loss %.4g -> %.4g in 150 AdamW steps on %s\n", initial, final_loss,
              gpu.device_name().c_str());
}

}  // namespace
}  // namespace qmm
