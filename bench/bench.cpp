// qmm bench: every op at the model shapes, timed with CUDA events (or a steady clock on the CPU), inputs rotated
// over several times the L2 size, median and spread, against a roofline whose ceilings are measured at the start
// of the run (a large device copy and large cuBLASLt GEMMs per math mode).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "commands.h"
#include "core/timing.h"
#include "cuda/nf4/nf4_plan.h"
#include "qmm/qmm.h"
#include "shapes.h"

namespace qmm::tool {
namespace {

using bench::Projection;

struct Ceilings {
  double copy_gbps = 0;  // bytes read + written per second / 1e9
  double bf16_tflops = 0, tf32_tflops = 0, fp32_tflops = 0;
  double tflops_for(const std::string& mode) const {
    if (mode == "fp32") return fp32_tflops;
    if (mode == "tf32") return tf32_tflops;
    return bf16_tflops;  // bf16 storage, BF16-compute, NF4 (bf16 tensor cores)
  }
};

// On the GPU, median/p10/p90 are device time per call from CUDA-graph replays (no host gaps between calls), where
// the op can be captured; eager_us is the median of calls timed one by one with events as a program issues them
// (it includes waiting for the host when the host enqueues slower than the GPU runs), host_us the host's enqueue
// time per call.
struct Stats {
  double median_us = 0, p10_us = 0, p90_us = 0;
  double host_us = 0;
  double eager_us = 0;
  bool graph = false;  // whether median/p10/p90 come from graph replays
};

Stats stats_of(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) { return ms[static_cast<std::size_t>(q * static_cast<double>(ms.size() - 1) + 0.5)] * 1e3; };
  return {at(0.5), at(0.1), at(0.9)};
}

struct Result {
  std::string op, mode, shape;
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  double flops = 0, bytes = 0;
  Stats t;
  double floor_us = 0;  // 0: no ceilings (CPU mode)
  std::string baseline;  // what `ratio` divides by
  double ratio = 0;      // this time / baseline time (0: none)
  std::int64_t tokens = 0;  // the model-level M (rows of activations) where m is not it (gemm_backward_b)
};

// A pool of random values, generated once, from which every input is copied (so inputs are never zeros and
// setting up a case costs a copy, not a random-number pass).
class InputPool {
 public:
  explicit InputPool(std::size_t bytes) : host_(DType::U8, {static_cast<std::int64_t>(bytes)}) {
    std::uint64_t s = 0x9E3779B97F4A7C15ull;
    auto* f = host_.data_as<std::uint16_t>();
    for (std::size_t i = 0; i < bytes / 2; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      // bf16 bit patterns of values in about [-1, 1) and, read as f32 pairs, finite numbers of modest size
      const float v = static_cast<float>(static_cast<std::int64_t>(s >> 40) - (1 << 23)) / static_cast<float>(1 << 23);
      f[i] = float_to_bf16(v);
    }
  }
  // A tensor on `device` filled from the pool starting at a seed-dependent offset.
  Tensor make(const Context& ctx, DType dtype, Shape shape, std::uint64_t seed) const {
    Tensor t(dtype, shape, ctx.device());
    const std::size_t total = t.nbytes(), pool = host_.nbytes();
    std::size_t done = 0, offset = (seed * 7919u * 64u) % (pool / 2) / 4 * 4;
    auto* dst = static_cast<std::uint8_t*>(t.data());
    while (done < total) {
      const std::size_t chunk = std::min(total - done, pool - offset);
      TensorView d(dst + done, DType::U8, {static_cast<std::int64_t>(chunk)}, ctx.device());
      TensorView s(static_cast<std::uint8_t*>(host_.data()) + offset, DType::U8, {static_cast<std::int64_t>(chunk)});
      copy(d, s);
      done += chunk;
      offset = 0;
    }
    return t;
  }

 private:
  // Read as f32, each pair of bf16 patterns is the high half's value in [-1, 1) plus random low mantissa bits:
  // finite, of modest size, and with the low bits that BF16-compute truncates.
  Tensor host_;
};

// The (op, shape label) pairs that the runs test with Bench::selected, in run order.
using Catalogue = std::vector<std::pair<std::string, std::string>>;

class Bench {
 public:
  Bench(const Context& ctx, const BenchOptions& opts) : ctx_(ctx), opts_(opts), pool_(std::in_place, pool_bytes(ctx)) {
    info_ = ctx.info();
    is_gpu_ = ctx.device().is_cuda();
    find_plan_device();
  }

  // What a run on a GPU (gpu) or on the CPU would select from: the run_* functions are walked with every case
  // declined, so --op and --shape are checked against the very names the runs use, before any work.
  static Catalogue catalogue(bool gpu) {
    const Context cpu = Context::cpu();  // never used for work: nothing is selected
    const BenchOptions none;
    Catalogue cases;
    Bench b(cpu, none, std::nullopt);
    b.is_gpu_ = gpu;
    b.catalogue_ = &cases;
    b.run_all();
    return cases;
  }

  bool selected(const std::string& op, const std::string& shape) const {
    if (catalogue_) {
      catalogue_->emplace_back(op, shape);
      return false;
    }
    if (!opts_.ops.empty() && std::find(opts_.ops.begin(), opts_.ops.end(), op) == opts_.ops.end()) return false;
    if (opts_.shapes.empty()) return true;
    for (const auto& s : opts_.shapes)
      if (shape.find(s) != std::string::npos) return true;
    return false;
  }

  // How many input sets to rotate over so that their total exceeds 4x the L2.
  int sets_for(double bytes) const {
    if (!is_gpu_) return 1;
    const double want = 4.0 * static_cast<double>(info_.l2_bytes);
    return static_cast<int>(std::clamp(std::ceil(want / std::max(bytes, 1.0)), 1.0, 32.0));
  }

  // Eager time (median of repeats after a warm-up) and, on a GPU, the host time per call.
  Stats time_eager(const std::function<void(int)>& fn) const {
    const int warmup = is_gpu_ ? 5 : 1;
    Stats st = stats_of(time_calls(ctx_, fn, warmup, opts_.repeats));
    st.eager_us = st.median_us;
    if (!is_gpu_) return st;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < opts_.repeats; ++i) fn(i);
    const auto t1 = std::chrono::steady_clock::now();
    ctx_.synchronize();
    st.host_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / opts_.repeats;
    return st;
  }

  // Calls per captured graph: each replay runs every input set at least twice.
  int graph_calls(int sets) const { return std::clamp(2 * sets, 10, std::max(10, opts_.repeats)); }

  // The device time from graph replays (ms per call) in place of the eager median and spread.
  static void take_graph_times(Stats& st, std::vector<double> ms) {
    const Stats g = stats_of(std::move(ms));
    st.median_us = g.median_us;
    st.p10_us = g.p10_us;
    st.p90_us = g.p90_us;
    st.graph = true;
  }

  // --hold-ms: replays fn back to back for that long (times dropped) right before it is timed. A large GEMM run
  // for ~1 s settles at the clocks the power limit leaves (H200: 1400-1700 MHz against 1980 in the first tens of
  // milliseconds), and a path that draws more power per call then slows more (src/cuda/dev/probes/sustained.cu).
  void hold(const std::function<void(int)>& fn, int sets, double eager_us) const {
    if (opts_.hold_ms <= 0) return;
    const int calls = graph_calls(sets);
    const double replay_us = std::max(eager_us, 1.0) * calls;
    time_graph(ctx_, fn, calls, static_cast<int>(std::ceil(opts_.hold_ms * 1000.0 / replay_us)));
  }

  Stats time(const std::function<void(int)>& fn, int sets = 1) const {
    Stats st = time_eager(fn);
    if (!is_gpu_) return st;
    try {
      hold(fn, sets, st.median_us);
      take_graph_times(st, time_graph(ctx_, fn, graph_calls(sets), 7));  // 7 replays: the median and the spread
    } catch (const Error& e) {
      if (e.code() != ErrorCode::Unsupported) throw;  // not capturable (it synchronizes): eager time stands
    }
    return st;
  }

  // Several ways to do one thing (the paths of an NF4 GEMM), timed in turns: eager times one after another as
  // in time(), then graph replays in three rounds, each round in a rotated order, so that a drift of the clocks
  // during the run spreads over all of them instead of favouring the first. Medians over all rounds.
  std::vector<Stats> time_interleaved(const std::vector<std::function<void(int)>>& fns, int sets) const {
    std::vector<Stats> st;
    for (const auto& fn : fns) st.push_back(time_eager(fn));
    if (!is_gpu_ || fns.empty()) return st;
    const std::size_t n = fns.size();
    std::vector<std::vector<double>> samples(n);
    std::vector<bool> capturable(n, true);
    for (std::size_t round = 0; round < 3; ++round)
      for (std::size_t j = 0; j < n; ++j) {
        const std::size_t i = (j + round) % n;
        if (!capturable[i]) continue;
        try {
          hold(fns[i], sets, st[i].median_us);
          const std::vector<double> ms = time_graph(ctx_, fns[i], graph_calls(sets), 3);
          samples[i].insert(samples[i].end(), ms.begin(), ms.end());
        } catch (const Error& e) {
          if (e.code() != ErrorCode::Unsupported) throw;
          capturable[i] = false;
        }
      }
    for (std::size_t i = 0; i < n; ++i)
      if (capturable[i] && !samples[i].empty()) take_graph_times(st[i], std::move(samples[i]));
    return st;
  }

  void measure_ceilings() {
    if (!is_gpu_) return;
    const std::int64_t n = 256ll << 20;  // 1 GiB of f32 each way
    Tensor a = pool_->make(ctx_, DType::F32, {n}, 1), b(DType::F32, {n}, ctx_.device());
    // Ceilings from eager timing: these calls are long enough that the host does not matter, and a copy captured
    // in a graph runs on a copy engine (about 2.7 TB/s here) rather than as the kernel a program gets.
    const Stats c = time([&](int) { copy(ctx_, b, a); });
    ceil_.copy_gbps = 2.0 * static_cast<double>(a.nbytes()) / (c.eager_us * 1e-6) / 1e9;
    auto gemm_rate = [&](DType dt, MathMode math, std::int64_t s) {
      Tensor x = pool_->make(ctx_, dt, {s, s}, 2), y = pool_->make(ctx_, dt, {s, s}, 3), z(dt, {s, s}, ctx_.device());
      const Stats st = time([&](int) { gemm(ctx_, x, y, z, {1, 0, math}); });
      return 2.0 * static_cast<double>(s) * s * s / (st.eager_us * 1e-6) / 1e12;
    };
    ceil_.bf16_tflops = gemm_rate(DType::BF16, MathMode::FP32, 8192);
    ceil_.tf32_tflops = gemm_rate(DType::F32, MathMode::TF32, 8192);
    ceil_.fp32_tflops = gemm_rate(DType::F32, MathMode::FP32, 4096);
    std::printf("ceilings: copy %.0f GB/s, bf16 GEMM %.0f TFLOP/s (8192^3), TF32 %.0f (8192^3), FP32 %.1f (4096^3)\n",
                ceil_.copy_gbps, ceil_.bf16_tflops, ceil_.tf32_tflops, ceil_.fp32_tflops);
  }

  void record(Result r) {
    if (is_gpu_ && ceil_.copy_gbps > 0) {
      const double t_flop = r.flops / (ceil_.tflops_for(r.mode) * 1e12);
      const double t_byte = r.bytes / (ceil_.copy_gbps * 1e9);
      r.floor_us = std::max(t_flop, t_byte) * 1e6;
    }
    print_row(r);
    results_.push_back(r);
  }

  const Result* find(const std::string& op, const std::string& mode, std::int64_t m, std::int64_t n,
                     std::int64_t k, std::int64_t tokens = 0) const {
    for (const auto& r : results_)
      if (r.op == op && r.mode == mode && r.m == m && r.n == n && r.k == k && r.batch == 1 &&
          (tokens == 0 || r.tokens == tokens))
        return &r;
    return nullptr;
  }

  void print_header() const {
    std::printf("\n%-17s %-9s %-22s %5s %6s %6s %10s %19s %8s %7s %8s %8s %6s %s\n", "op", "mode", "shape", "M", "N",
                "K", "median us", "p10-p90 us", "eager us", "host us", "TFLOP/s", "GB/s", "%roof", "ratio");
  }

  void print_row(const Result& r) const {
    const double s = r.t.median_us * 1e-6;
    char roof[16] = "   -", ratio[64] = "";
    if (r.floor_us > 0) std::snprintf(roof, sizeof roof, "%5.0f%%", 100.0 * r.floor_us / r.t.median_us);
    if (r.ratio > 0) std::snprintf(ratio, sizeof ratio, "%.2fx %s", r.ratio, r.baseline.c_str());
    std::printf("%-17s %-9s %-22s %5lld %6lld %6lld %9.1f%s %9.1f-%-9.1f %8.1f %7.1f %8.1f %8.0f %6s %s\n",
                r.op.c_str(), r.mode.c_str(), r.shape.c_str(), static_cast<long long>(r.m),
                static_cast<long long>(r.n), static_cast<long long>(r.k), r.t.median_us, r.t.graph ? "g" : " ",
                r.t.p10_us, r.t.p90_us, r.t.eager_us, r.t.host_us, r.flops / s / 1e12,
                r.bytes / s / 1e9, roof, ratio);
    std::fflush(stdout);
  }

  void print_ratios() const {
    std::printf("\nratios (this time / baseline time, same run):\n");
    print_header();
    for (const Result& r : results_)
      if (r.ratio > 0) print_row(r);
  }

  // --explain: the GPU whose plans are printed (this run's, or on the CPU backend the local one), or none.
  void find_plan_device() {
    if (!opts_.explain) return;
#ifdef QMM_WITH_CUDA
    if (is_gpu_) {
      plan_device_ = cuda::nf4_device(ctx_);
      plan_device_name_ = ctx_.device_name();
    } else if (Context::cuda_device_count() > 0) {
      const Context gpu = Context::cuda(0);
      plan_device_ = cuda::nf4_device(gpu);
      plan_device_name_ = gpu.device_name();
    }
#endif
    if (plan_device_) std::printf("plans (--explain) for %s\n", plan_device_name_.c_str());
#ifdef QMM_WITH_CUDA
    else std::printf("plans (--explain): none, no CUDA GPU on this machine\n");
#else
    else std::printf("plans (--explain): none, this build has no CUDA backend\n");
#endif
  }

  // The plan line printed under an NF4 row (--explain): the bench's weights are double-quantized with blocks of
  // 64 and its tensors freshly allocated (aligned).
  std::string plan_line(cuda::Nf4Op op, std::int64_t m, std::int64_t n, std::int64_t k, DType act,
                        Nf4Path path) const {
    if (!opts_.explain || !plan_device_) return {};  // without a GPU the header said so once
    const cuda::Nf4Problem p = cuda::nf4_problem_of_shape(op, m, n, k, act, true, path);
    return "  plan: " + cuda::nf4_plan_summary(cuda::plan_nf4(p, *plan_device_));
  }
  void print_plan(const std::string& line) const {
    if (!line.empty()) std::printf("%s\n", line.c_str());
  }

  void run_dense();
  void run_batched();
  void run_swiglu();
  void run_swiglu_adapters();
  void run_train();
  void record_stream(const std::string& op, const Result& like);
  void run_loss();
  void run_nf4();
  void run_mlp();
  void run_all() {  // every family, in the order of the table
    run_dense();
    run_batched();
    run_swiglu();
    run_swiglu_adapters();
    run_train();
    run_loss();
    run_nf4();
    run_mlp();
  }
  void add_ratios();
  void write_json(const std::string& path) const;

  // The token counts of the shape list; the CPU reference is slow: keep CPU mode to seconds.
  std::vector<std::int64_t> all_token_counts() const {
    return is_gpu_ ? bench::token_counts() : std::vector<std::int64_t>{1, 16};
  }
  std::vector<std::int64_t> token_counts() const { return requested_tokens_or(all_token_counts()); }
  // The token counts given with --tokens, any values (e.g. to find where a dispatch rule should switch), in
  // place of an op's built-in list `ms`.
  std::vector<std::int64_t> requested_tokens_or(std::vector<std::int64_t> ms) const {
    if (opts_.tokens.empty()) return ms;
    ms = opts_.tokens;
    std::sort(ms.begin(), ms.end());
    ms.erase(std::unique(ms.begin(), ms.end()), ms.end());
    return ms;
  }
  std::vector<Projection> projections() const {
    auto p = bench::projections();
    if (!is_gpu_) p.resize(2);
    return p;
  }

 private:
  static std::size_t pool_bytes(const Context& ctx) { return ctx.device().is_cuda() ? (256u << 20) : (16u << 20); }
  // For catalogue(): no input pool (16 MiB of random numbers) where nothing runs.
  Bench(const Context& ctx, const BenchOptions& opts, std::nullopt_t) : ctx_(ctx), opts_(opts) {}

  const Context& ctx_;
  const BenchOptions& opts_;
  std::optional<InputPool> pool_;  // empty in catalogue()'s dry walk
  DeviceInfo info_;
  std::optional<cuda::Nf4Device> plan_device_;  // --explain
  std::string plan_device_name_;
  bool is_gpu_ = false;
  Ceilings ceil_;
  std::vector<Result> results_;
  Catalogue* catalogue_ = nullptr;  // set: a dry walk that records what selected() is asked
};

struct DenseMode {
  const char* name;
  DType dtype;
  MathMode math;
};
constexpr DenseMode kDenseModes[] = {{"bf16", DType::BF16, MathMode::FP32},
                                     {"f32/bf16", DType::F32, MathMode::BF16},
                                     {"tf32", DType::F32, MathMode::TF32},
                                     {"fp32", DType::F32, MathMode::FP32}};

void Bench::run_dense() {
  // For a linear layer y = x W^T (W [N,K]): forward gemm_bt; dx = dy W is gemm; dW = dy^T x is gemm_backward_b;
  // gemm_backward_a (dA = dC B^T) is measured at the forward's shape.
  for (const Projection& p : projections())
    for (std::int64_t m : token_counts())
      for (const DenseMode& mode : kDenseModes) {
        const std::size_t es = dtype_size(mode.dtype);
        struct Variant {
          const char* op;
          std::int64_t rows_a, cols_a, rows_b, cols_b, rows_c, cols_c;  // stored shapes
          std::int64_t gm, gn, gk;                                       // GEMM m, n, k
        };
        const std::int64_t M = m, N = p.n, K = p.k;
        const Variant variants[] = {
            {"gemm_bt", M, K, N, K, M, N, M, N, K},
            {"gemm", M, N, N, K, M, K, M, K, N},
            {"gemm_backward_a", M, N, K, N, M, K, M, K, N},
            {"gemm_backward_b", M, N, M, K, N, K, N, K, M},
        };
        for (const Variant& v : variants) {
          if (!selected(v.op, p.label)) continue;
          const double bytes = static_cast<double>((v.rows_a * v.cols_a + v.rows_b * v.cols_b + v.rows_c * v.cols_c) * es);
          const int sets = sets_for(bytes);
          std::vector<Tensor> as, bs, cs;
          for (int s = 0; s < sets; ++s) {
            as.push_back(pool_->make(ctx_, mode.dtype, {v.rows_a, v.cols_a}, 10 + s));
            bs.push_back(pool_->make(ctx_, mode.dtype, {v.rows_b, v.cols_b}, 50 + s));
            cs.emplace_back(mode.dtype, Shape{v.rows_c, v.cols_c}, ctx_.device());
          }
          const GemmOptions o{1, 0, mode.math};
          const std::string op = v.op;
          auto fn = [&](int i) {
            const int s = i % sets;
            if (op == "gemm_bt") gemm_bt(ctx_, as[s], bs[s], cs[s], o);
            else if (op == "gemm") gemm(ctx_, as[s], bs[s], cs[s], o);
            else if (op == "gemm_backward_a") gemm_backward_a(ctx_, as[s], bs[s], cs[s], o);
            else gemm_backward_b(ctx_, as[s], bs[s], cs[s], o);
          };
          Result r{v.op, mode.name, p.label, 1, v.gm, v.gn, v.gk, 2.0 * v.gm * v.gn * v.gk, bytes, time(fn)};
          r.tokens = m;
          record(r);
        }
      }
}

void Bench::run_batched() {
  for (const auto& a : bench::attention_shapes()) {
    if (!is_gpu_) break;
    for (const DenseMode& mode : kDenseModes)
      for (bool qk : {true, false}) {
        const char* op = qk ? "batched_qk" : "batched_pv";
        if (!selected(op, a.label) && !selected("batched_gemm", a.label)) continue;
        const std::int64_t b = a.batch, h = a.heads, s = a.seq, d = a.head_dim;
        // Q*K^T: [b,h,s,d] x [b,h,s,d]^T -> [b,h,s,s];  P*V: [b,h,s,s] x [b,h,s,d] -> [b,h,s,d]
        const Shape sa = qk ? Shape{b, h, s, d} : Shape{b, h, s, s};
        const Shape sb = Shape{b, h, s, d};
        const Shape sc = qk ? Shape{b, h, s, s} : Shape{b, h, s, d};
        const std::size_t es = dtype_size(mode.dtype);
        const double bytes = static_cast<double>((sa.numel() + sb.numel() + sc.numel()) * static_cast<std::int64_t>(es));
        const int sets = sets_for(bytes);
        std::vector<Tensor> as, bs, cs;
        for (int i = 0; i < sets; ++i) {
          as.push_back(pool_->make(ctx_, mode.dtype, sa, 90 + i));
          bs.push_back(pool_->make(ctx_, mode.dtype, sb, 130 + i));
          cs.emplace_back(mode.dtype, sc, ctx_.device());
        }
        const GemmOptions o{1, 0, mode.math};
        auto fn = [&](int i) { batched_gemm(ctx_, as[i % sets], bs[i % sets], cs[i % sets], qk, o); };
        const std::int64_t gm = s, gn = qk ? s : d, gk = qk ? d : s;
        Result r{op, mode.name, a.label, b * h, gm, gn, gk, 2.0 * b * h * gm * gn * gk, bytes, time(fn)};
        record(r);
      }
  }
}

void Bench::run_swiglu() {
  std::vector<std::pair<std::string, std::int64_t>> sizes = {{"16M", 16ll << 20}, {"64M", 64ll << 20},
                                                             {"2048x8960", 2048ll * 8960}};
  if (!is_gpu_) sizes = {{"1M", 1ll << 20}};
  for (const auto& [label, n] : sizes)
    for (DType dt : {DType::BF16, DType::F32})
      for (bool backward : {false, true}) {
        const char* op = backward ? "swiglu_backward" : "swiglu";
        if (!selected(op, label)) continue;
        const double es = static_cast<double>(dtype_size(dt));
        const double bytes = es * static_cast<double>(n) * (backward ? 5 : 3);
        const int sets = sets_for(bytes);
        std::vector<Tensor> g, u, dh, o1, o2;
        for (int s = 0; s < sets; ++s) {
          g.push_back(pool_->make(ctx_, dt, {n}, 200 + s));
          u.push_back(pool_->make(ctx_, dt, {n}, 240 + s));
          if (backward) dh.push_back(pool_->make(ctx_, dt, {n}, 280 + s));
          o1.emplace_back(dt, Shape{n}, ctx_.device());
          if (backward) o2.emplace_back(dt, Shape{n}, ctx_.device());
        }
        auto fn = [&](int i) {
          const int s = i % sets;
          if (backward) swiglu_backward(ctx_, g[s], u[s], dh[s], o1[s], o2[s]);
          else swiglu(ctx_, g[s], u[s], o1[s]);
        };
        Result r{op, dtype_name(dt), label, 1, n, 1, 1, 0, bytes, time(fn)};
        record(r);
      }
}

void Bench::run_train() {
  // adamw_step over the rank-16 LoRA factors (A [16, in], B [out, 16]) of an MLP block's gate, up and down: per
  // parameter it reads p, g, m, v and writes p, m, v (28 bytes), and reads g once more for the clipping norm.
  struct AdapterSet {
    std::string label;
    std::int64_t hidden, inter;
  };
  const AdapterSet sets[] = {{"qwen2.5-1.5b mlp r16", 1536, 8960}};
  for (const AdapterSet& a : sets)
    for (bool clip : {false, true}) {
      if (!selected("adamw_step", a.label)) continue;
      const std::vector<Shape> shapes = {{16, a.hidden}, {a.inter, 16}, {16, a.hidden},
                                         {a.inter, 16},  {16, a.inter}, {a.hidden, 16}};
      std::int64_t params = 0;
      for (const Shape& s : shapes) params += s.numel();
      const double bytes = (clip ? 32.0 : 28.0) * static_cast<double>(params);
      const int nsets = sets_for(bytes);
      std::vector<Tensor> buffers;  // owns what the views in `groups` point at
      std::vector<std::vector<AdamWParam>> groups(static_cast<std::size_t>(nsets));
      for (int k = 0; k < nsets; ++k)
        for (std::size_t t = 0; t < shapes.size(); ++t) {
          const Tensor p = pool_->make(ctx_, DType::F32, shapes[t], 700 + t);
          const Tensor g = pool_->make(ctx_, DType::F32, shapes[t], 710 + t);
          const Tensor m = pool_->make(ctx_, DType::F32, shapes[t], 720 + t), v(DType::F32, shapes[t], ctx_.device());
          zero(ctx_, v);  // second moments must not be negative
          groups[static_cast<std::size_t>(k)].push_back({p, g, m, v});
          buffers.insert(buffers.end(), {p, g, m, v});
        }
      AdamWOptions o;
      o.weight_decay = 0.01f;
      o.max_grad_norm = clip ? 1.0f : 0.0f;
      int step = 0;
      const auto step_once = [&](int i) { adamw_step(ctx_, groups[static_cast<std::size_t>(i % nsets)], o, ++step); };
      record({"adamw_step", clip ? "clip" : "plain", a.label, 1, params, static_cast<std::int64_t>(shapes.size()), 1,
              0, bytes, time(step_once)});
    }

  // lora_backward_dy on the gate/up projections' output gradients (dy [M, out], rank 16, bf16) against the two
  // GEMMs it replaces, timed in turns. Bytes: dy once, plus t, b, dt and grad_b (read and written).
  for (const Projection& p : projections()) {
    if (p.label.find("gate_up") == std::string::npos || !selected("lora_backward_dy", p.label)) continue;
    const std::int64_t n = p.n, r = 16;
    for (std::int64_t m : requested_tokens_or(is_gpu_ ? std::vector<std::int64_t>{512, 2048, 4096}
                                                       : std::vector<std::int64_t>{16})) {
      const double bytes = 2.0 * m * n + 2.0 * (2 * m * r + n * r) + 8.0 * n * r;
      const int sets = sets_for(bytes);
      std::vector<Tensor> dy, t;
      for (int i = 0; i < sets; ++i) {
        dy.push_back(pool_->make(ctx_, DType::BF16, {m, n}, 800 + i));
        t.push_back(pool_->make(ctx_, DType::BF16, {m, r}, 840 + i));
      }
      const Tensor b = pool_->make(ctx_, DType::BF16, {n, r}, 880), dt(DType::BF16, {m, r}, ctx_.device());
      const Tensor gb(DType::F32, {n, r}, ctx_.device());
      zero(ctx_, gb);
      const std::vector<std::function<void(int)>> fns = {
          [&](int i) { lora_backward_dy(ctx_, dy[i % sets], b, t[i % sets], dt, gb, 2.0f); },
          [&](int i) {
            gemm(ctx_, dy[i % sets], b, dt, {2.0f, 0.0f});
            gemm_backward_b(ctx_, dy[i % sets], t[i % sets], gb, {2.0f, 1.0f});
          }};
      const std::vector<Stats> st = time_interleaved(fns, sets);
      const double flops = 4.0 * m * n * r;
      for (std::size_t i = 0; i < fns.size(); ++i)
        record({"lora_backward_dy", i == 0 ? "bf16" : "2 gemms", p.label + " r16", 1, m, n, r, flops, bytes, st[i]});
    }
  }
}

// SwiGLU with gate's and up's rank-16 adapter terms inside the kernel, at the gate/up shapes, each timed in turns
// with what it replaces: the forward against the two second-product GEMMs (y += s·t·Bᵀ) and the plain swiglu; the
// backward against the plain backward (the second products' sums were stored); and the backward as the train step
// runs it (the down adapter's share of dh, dh + dt_d·A_d, summed in the kernel, h written again) against that
// share's GEMM and the plain backward. Bytes: the [M, I] tensors once each.
void Bench::run_swiglu_adapters() {
  enum Kind { kForward, kBackward, kStepBackward };
  for (const Projection& p : projections()) {
    if (p.label.find("gate_up") == std::string::npos || !selected("swiglu_adapters", p.label)) continue;
    const std::int64_t n = p.n, r = 16;
    for (std::int64_t m :
         requested_tokens_or(is_gpu_ ? std::vector<std::int64_t>{2048, 4096} : std::vector<std::int64_t>{16})) {
      for (Kind kind : {kForward, kBackward, kStepBackward}) {
        const bool backward = kind != kForward, step = kind == kStepBackward;
        const double bytes = 2.0 * m * n * (step ? 6 : backward ? 5 : 3);
        const int sets = sets_for(bytes);
        std::vector<Tensor> g, u, dh, o1, o2, h;
        for (int i = 0; i < sets; ++i) {
          g.push_back(pool_->make(ctx_, DType::BF16, {m, n}, 900 + i));
          u.push_back(pool_->make(ctx_, DType::BF16, {m, n}, 940 + i));
          if (backward) dh.push_back(pool_->make(ctx_, DType::BF16, {m, n}, 980 + i));
          o1.emplace_back(DType::BF16, Shape{m, n}, ctx_.device());
          if (backward) o2.emplace_back(DType::BF16, Shape{m, n}, ctx_.device());
          if (step) h.emplace_back(DType::BF16, Shape{m, n}, ctx_.device());
        }
        const Tensor t = pool_->make(ctx_, DType::BF16, {m, 2 * r}, 1020),
                     tg = pool_->make(ctx_, DType::BF16, {m, r}, 1021),
                     tu = pool_->make(ctx_, DType::BF16, {m, r}, 1022);
        const Tensor bg = pool_->make(ctx_, DType::BF16, {n, r}, 1023),
                     bu = pool_->make(ctx_, DType::BF16, {n, r}, 1024);
        const Tensor td = pool_->make(ctx_, DType::BF16, {m, r}, 1025),
                     ad = pool_->make(ctx_, DType::BF16, {r, n}, 1026);
        SwiGluAdapters adapters{t, bg, 2.0f, bu, 2.0f};
        if (step) adapters.dh_t = td, adapters.dh_a = ad;
        std::vector<std::function<void(int)>> fns;
        if (step) {
          fns = {[&](int i) {
                   swiglu_backward(ctx_, g[i % sets], u[i % sets], dh[i % sets], o1[i % sets], o2[i % sets], adapters,
                                   h[i % sets]);
                 },
                 [&](int i) {
                   gemm(ctx_, td, ad, dh[i % sets], {1.0f, 1.0f});
                   swiglu_backward(ctx_, g[i % sets], u[i % sets], dh[i % sets], o1[i % sets], o2[i % sets]);
                 }};
        } else if (backward) {
          fns = {[&](int i) {
                   swiglu_backward(ctx_, g[i % sets], u[i % sets], dh[i % sets], o1[i % sets], o2[i % sets], adapters);
                 },
                 [&](int i) {
                   swiglu_backward(ctx_, g[i % sets], u[i % sets], dh[i % sets], o1[i % sets], o2[i % sets]);
                 }};
        } else {
          fns = {[&](int i) { swiglu(ctx_, g[i % sets], u[i % sets], o1[i % sets], adapters); },
                 [&](int i) {
                   gemm_bt(ctx_, tg, bg, g[i % sets], {2.0f, 1.0f});
                   gemm_bt(ctx_, tu, bu, u[i % sets], {2.0f, 1.0f});
                   swiglu(ctx_, g[i % sets], u[i % sets], o1[i % sets]);
                 }};
        }
        const std::vector<Stats> st = time_interleaved(fns, sets);
        const char* op = backward ? "swiglu_adapters_backward" : "swiglu_adapters";
        const std::string shape = p.label + (step ? " r16 +dh term +h" : " r16");
        record({op, "bf16", shape, 1, m, n, r, 0, bytes, st[0]});
        record({op,
                step       ? "gemm + plain swiglu"
                : backward ? "plain swiglu"
                           : "2 gemms + swiglu",
                shape, 1, m, n, r, 0, bytes, st[1]});
      }
    }
  }
}

// linear_cross_entropy at the lm heads of Llama-3-8B and Qwen2.5-1.5B against the bf16 GEMMs it contains, timed
// in turns: the logits GEMM (bf16 out) and the input gradient's GEMM, plus the weight gradient's where dW is asked
// (a frozen head, as in LoRA training, asks dh alone). Its extra memory (linear_cross_entropy_chunks) is printed
// against the whole fp32 logits.
void Bench::run_loss() {
  struct Head {
    std::string label;
    std::int64_t tokens, hidden, vocab;
  };
  std::vector<Head> heads = {{"llama3-8b head", 4096, 4096, 128256}, {"qwen2.5-1.5b head", 2048, 1536, 151936}};
  if (!is_gpu_) heads = {{"small head", 16, 64, 1000}};
  for (const Head& hd : heads)
    for (bool want_dw : {false, true}) {
      const std::string mode = want_dw ? "dh+dw" : "dh";
      if (!selected("linear_cross_entropy", hd.label + " " + mode)) continue;
      const std::int64_t t = hd.tokens, h = hd.hidden, v = hd.vocab;
      const Tensor x = pool_->make(ctx_, DType::BF16, {t, h}, 900), w = pool_->make(ctx_, DType::BF16, {v, h}, 901);
      Tensor labels(DType::I32, {t});
      for (std::int64_t i = 0; i < t; ++i) labels.data_as<std::int32_t>()[i] = static_cast<std::int32_t>((i * 7919) % v);
      const Tensor lab(DType::I32, {t}, ctx_.device()), loss(DType::F32, {1}, ctx_.device());
      copy(lab, labels);
      const Tensor dh(DType::BF16, {t, h}, ctx_.device());
      const Tensor dw = want_dw ? Tensor(DType::F32, {v, h}, ctx_.device()) : Tensor();
      const Tensor logits(DType::BF16, {t, v}, ctx_.device());
      // Against the GEMMs, and without dw against whole rows of 1024 tokens a chunk (no vocabulary chunks). The
      // labels unchecked, as a training step passes them: the calls wait for nothing, and are timed captured.
      CrossEntropyOptions opts, whole;
      opts.check_labels = whole.check_labels = false;
      whole.chunk_tokens = 1024;
      whole.chunk_vocab = v;
      std::vector<std::function<void(int)>> fns = {
          [&](int) { linear_cross_entropy(ctx_, x, w, lab, loss, dh, dw, opts); },
          [&](int) {
            gemm_bt(ctx_, x, w, logits);
            gemm(ctx_, logits, w, dh);
            if (want_dw) gemm_backward_b(ctx_, logits, x, dw, {1.0f, 1.0f});
          }};
      if (!want_dw) fns.push_back([&](int) { linear_cross_entropy(ctx_, x, w, lab, loss, dh, dw, whole); });
      const std::vector<Stats> st = time_interleaved(fns, 1);
      const double flops = 2.0 * (want_dw ? 3.0 : 2.0) * static_cast<double>(t) * h * v;
      const double bytes = 2.0 * static_cast<double>(v) * h * (want_dw ? 3.0 : 2.0);
      const char* names[] = {mode.c_str(), want_dw ? "3 gemms" : "2 gemms", "dh, 1024-token rows"};
      for (std::size_t i = 0; i < fns.size(); ++i)
        record({"linear_cross_entropy", names[i], hd.label, 1, t, v, h, flops, bytes, st[i]});
      const CrossEntropyChunks c = linear_cross_entropy_chunks(t, h, v, DType::BF16, true, want_dw);
      if (is_gpu_)
        std::printf("  linear_cross_entropy %s%s: extra memory %.1f MiB (chunks of %lld tokens x %lld of the "
                    "vocabulary), %.1f%% of the fp32 logits' %.1f MiB\n",
                    hd.label.c_str(), want_dw ? " with dw" : "", c.extra_bytes / 1048576.0,
                    static_cast<long long>(c.tokens), static_cast<long long>(c.vocab),
                    100.0 * c.extra_bytes / (t * v * 4.0), t * v * 4.0 / 1048576.0);
    }

  // rms_norm forward and backward (with dw) at the decoder's widths, bf16, against the copy bandwidth at the op's
  // least traffic: forward reads x and writes y; backward reads x and dy and writes dx (dw's partials are a few
  // percent of that; where a row does not fit the registers of two warps the kernels read x and dy twice). With the
  // residual add (add_rms_norm: reads x and r, writes h and y) and with the residual's gradient added to dx
  // (rms_norm_backward+dres: reads dres too), one pass more each, in place of an add's three.
  std::vector<std::pair<std::string, std::pair<std::int64_t, std::int64_t>>> norms = {
      {"llama3-8b 4096 tok", {4096, 4096}}, {"qwen2.5-1.5b 2048 tok", {2048, 1536}}};
  if (!is_gpu_) norms = {{"small", {16, 256}}};
  struct NormOp {
    const char* name;
    bool backward, residual;
  };
  for (const auto& [label, dims] : norms)
    for (const NormOp& nop : {NormOp{"rms_norm", false, false}, NormOp{"rms_norm_backward", true, false},
                              NormOp{"add_rms_norm", false, true}, NormOp{"rms_norm_backward+dres", true, true}}) {
      const char* op = nop.name;
      if (!selected(op, label)) continue;
      const auto [t, h] = dims;
      const double bytes = 2.0 * static_cast<double>(t) * h * ((nop.backward ? 3.0 : 2.0) + (nop.residual ? 1 : 0));
      const int sets = sets_for(bytes);
      std::vector<Tensor> x, dy, y, res, hs;  // res: the residual input or gradient; hs: the forward's h
      for (int i = 0; i < sets; ++i) {
        x.push_back(pool_->make(ctx_, DType::BF16, {t, h}, 950 + i));
        dy.push_back(pool_->make(ctx_, DType::BF16, {t, h}, 980 + i));
        y.emplace_back(DType::BF16, Shape{t, h}, ctx_.device());
        if (nop.residual) res.push_back(pool_->make(ctx_, DType::BF16, {t, h}, 1010 + i));
        if (nop.residual && !nop.backward) hs.emplace_back(DType::BF16, Shape{t, h}, ctx_.device());
      }
      const Tensor w = pool_->make(ctx_, DType::BF16, {h}, 990), rstd(DType::F32, {t}, ctx_.device());
      const Tensor dw(DType::F32, {h}, ctx_.device());
      zero(ctx_, dw);
      rms_norm(ctx_, x[0], w, y[0], rstd, 1e-6f);
      auto fn = [&](int i) {
        const int s = i % sets;
        if (nop.backward)
          rms_norm_backward(ctx_, x[s], w, rstd, dy[s], y[s], dw, nop.residual ? TensorView(res[s]) : TensorView{});
        else if (nop.residual)
          add_rms_norm(ctx_, x[s], res[s], w, hs[s], y[s], rstd, 1e-6f);
        else
          rms_norm(ctx_, x[s], w, y[s], rstd, 1e-6f);
      };
      record({op, "bf16", label, 1, t, h, 1, 0, bytes, time(fn, sets)});
      record_stream(op, results_.back());
    }

  // rope on q and k (one launch) at the decoders' heads, bf16, the tokens one sequence (cos and sin [1, S, D]),
  // against the copy bandwidth: reads q, k, cos and sin, writes q_out and k_out (out of place, as autograd runs it;
  // the backward is the same kernel). N is the heads' width (Hq + Hk)·D.
  struct Heads {
    std::string label;
    std::int64_t tokens, hq, hk, d;
  };
  std::vector<Heads> heads_of = {{"llama3-8b 4096 tok", 4096, 32, 8, 128}, {"qwen2.5-1.5b 2048 tok", 2048, 12, 2, 128}};
  if (!is_gpu_) heads_of = {{"small", 16, 4, 2, 64}};
  for (const Heads& hs : heads_of) {
    if (!selected("rope", hs.label)) continue;
    const std::int64_t t = hs.tokens, d = hs.d;
    const double bytes =
        2.0 * 2.0 * static_cast<double>(t) * (hs.hq + hs.hk) * d + 2.0 * 2.0 * static_cast<double>(t) * d;
    const int sets = sets_for(bytes);
    std::vector<Tensor> q, k, cs, sn, q_out, k_out;
    for (int i = 0; i < sets; ++i) {
      q.push_back(pool_->make(ctx_, DType::BF16, {1, t, hs.hq, d}, 1000 + i));
      k.push_back(pool_->make(ctx_, DType::BF16, {1, t, hs.hk, d}, 1040 + i));
      cs.push_back(pool_->make(ctx_, DType::BF16, {1, t, d}, 1080 + i));
      sn.push_back(pool_->make(ctx_, DType::BF16, {1, t, d}, 1120 + i));
      q_out.emplace_back(DType::BF16, Shape{1, t, hs.hq, d}, ctx_.device());
      k_out.emplace_back(DType::BF16, Shape{1, t, hs.hk, d}, ctx_.device());
    }
    auto fn = [&](int i) {
      const int s = i % sets;
      rope(ctx_, q[s], k[s], cs[s], sn[s], q_out[s], k_out[s]);
    };
    record({"rope", "bf16", hs.label, 1, t, (hs.hq + hs.hk) * d, 1, 0, bytes, time(fn, sets)});
    record_stream("rope", results_.back());
  }
}

// A plain streaming kernel moving the bytes an op of `like`'s row moves (add on bf16: two reads and a write of
// bytes / 6 elements), timed the same way: the bandwidth a kernel reaches at that size, launch and tail included,
// which the large copy of the ceilings does not show. Recorded as op "stream", mode `op`, `like`'s m, n and k.
void Bench::record_stream(const std::string& op, const Result& like) {
  if (!is_gpu_) return;
  const std::int64_t n = static_cast<std::int64_t>(like.bytes / 6.0);
  const int sets = sets_for(like.bytes);
  std::vector<Tensor> a, b, out;
  for (int i = 0; i < sets; ++i) {
    a.push_back(pool_->make(ctx_, DType::BF16, {n}, 1200 + i));
    b.push_back(pool_->make(ctx_, DType::BF16, {n}, 1240 + i));
    out.emplace_back(DType::BF16, Shape{n}, ctx_.device());
  }
  auto fn = [&](int i) {
    const int s = i % sets;
    add(ctx_, a[s], b[s], out[s]);
  };
  record({"stream", op, like.shape, 1, like.m, like.n, like.k, 0, 6.0 * static_cast<double>(n), time(fn, sets)});
}

double nf4_bytes(std::int64_t n, std::int64_t k, bool dq) {
  const double blocks = std::ceil(static_cast<double>(n * k) / 64.0);
  return static_cast<double>(n * k) / 2.0 + (dq ? blocks + std::ceil(blocks / 256.0) * 4.0 + 1024.0 : 4.0 * blocks);
}

void Bench::run_nf4() {
  // Quantize/dequantize of the weights (the MLP's and attention's), then the NF4 GEMMs with bf16 activations and
  // double-quantized weights.
  std::vector<Projection> weights = projections();
  if (is_gpu_)
    for (const Projection& p : bench::attention_projections()) weights.push_back(p);
  for (const Projection& p : weights) {
    const std::int64_t N = p.n, K = p.k;
    if (p.label.find("down") != std::string::npos) continue;  // same element count as gate_up
    const std::string label = p.label.substr(0, p.label.find(' ')) + " " + std::to_string(N) + "x" + std::to_string(K);
    for (bool dq : {false, true}) {
      const std::string mode = dq ? "dq" : "plain";
      const bool deq = selected("nf4_dequantize", label), quant = selected("nf4_quantize", label);
      if (!deq && !quant) continue;  // quantizing the weight is work: only for a selected case
      Tensor w = pool_->make(ctx_, DType::BF16, {N, K}, 300);
      Nf4Tensor q = nf4_quantize(ctx_, w, dq);
      Tensor out(DType::BF16, {N, K}, ctx_.device());
      if (deq) {
        const double bytes = nf4_bytes(N, K, dq) + 2.0 * N * K;
        record({"nf4_dequantize", mode, label, 1, N, K, 1, 0, bytes,
                time([&](int) { nf4_dequantize(ctx_, q, out); })});
      }
      if (quant) {
        const double bytes = nf4_bytes(N, K, dq) + 2.0 * N * K;
        Nf4Tensor q2 = Nf4Tensor::allocate(N, K, dq, ctx_.device());
        Nf4Weight qv = q2.view();
        record({"nf4_quantize", mode, label, 1, N, K, 1, 0, bytes,
                time([&](int) { nf4_quantize(ctx_, w, qv); })});
      }
    }
  }
  // Whether this build and GPU run a forced path (Fused: sm_90a on Hopper; the development kernels FusedShared,
  // FusedMma and the small-M slice kernel: a QMM_DEV_KERNELS build, on Hopper and from sm_80 for FusedMma): one that
  // cannot raises Unsupported.
  auto runs = [&](Nf4Path path) {
    if (!is_gpu_ || catalogue_) return false;
    try {
      Nf4Tensor w = nf4_quantize(ctx_, pool_->make(ctx_, DType::BF16, {64, 256}, 399), false);
      Tensor a(DType::BF16, {1, 256}, ctx_.device()), c(DType::BF16, {1, 64}, ctx_.device());
      nf4_gemm(ctx_, a, w, c, {1.0f, 0.0f, path});
    } catch (const Error& e) {
      if (e.code() != ErrorCode::Unsupported) throw;
      return false;
    }
    return true;
  };
  const bool fused_ok = runs(Nf4Path::Fused), shared_ok = runs(nf4_forced::kFusedShared),
             mma_ok = runs(nf4_forced::kFusedMma), slice_ok = runs(nf4_forced::kSmallMSlice);
  // The usual token counts plus 8 and 32, where the dispatcher's small-M thresholds are decided, 256, inside the
  // range where Auto takes the fused forward on large weights, and 1024, between it and the shared-dequantization
  // kernel's range.
  std::vector<std::int64_t> nf4_tokens = all_token_counts();
  nf4_tokens.insert(nf4_tokens.end(), {8, 32});
  if (is_gpu_) nf4_tokens.insert(nf4_tokens.end(), {256, 1024});
  std::sort(nf4_tokens.begin(), nf4_tokens.end());
  nf4_tokens = requested_tokens_or(nf4_tokens);
  for (const Projection& p : projections())
    for (std::int64_t m : nf4_tokens) {
      const std::int64_t M = m, N = p.n, K = p.k;
      const bool fwd = selected("nf4_gemm", p.label), bwd = selected("nf4_gemm_backward_a", p.label);
      const bool gu = p.label.find("gate_up") != std::string::npos && selected("nf4_gate_up", p.label) &&
                      (M <= 64 || M == 2048);
      if (!fwd && !bwd && !gu) continue;
      const double wbytes = nf4_bytes(N, K, true);
      const int sets = sets_for(wbytes + 2.0 * (M * K + M * N));
      std::vector<Nf4Tensor> ws, ws2;
      std::vector<Tensor> as, as32, cs, dcs, das, hs;
      // f32 activations too where the small-M kernels serve them (Auto; they round A to bf16 as every path does).
      const bool f32_a = fwd && is_gpu_ && M <= 16;
      for (int s = 0; s < sets; ++s) {
        Tensor w = pool_->make(ctx_, DType::BF16, {N, K}, 400 + s);
        ws.push_back(nf4_quantize(ctx_, w, true));
        if (gu) ws2.push_back(nf4_quantize(ctx_, pool_->make(ctx_, DType::BF16, {N, K}, 450 + s), true));
        as.push_back(pool_->make(ctx_, DType::BF16, {M, K}, 500 + s));
        if (f32_a) as32.push_back(pool_->make(ctx_, DType::F32, {M, K}, 520 + s));
        cs.emplace_back(DType::BF16, Shape{M, N}, ctx_.device());
        if (bwd) {
          dcs.push_back(pool_->make(ctx_, DType::BF16, {M, N}, 540 + s));
          das.emplace_back(DType::BF16, Shape{M, K}, ctx_.device());
        }
        if (gu) hs.emplace_back(DType::BF16, Shape{M, N}, ctx_.device());
      }
      const double flops = 2.0 * M * N * K;
      const double io = wbytes + 2.0 * (M * K + M * N);
      // Auto, plus each path forced where several could serve (so the dispatcher's thresholds can be checked).
      std::vector<std::pair<std::string, Nf4Path>> paths = {{"auto", Nf4Path::Auto}};
      // (The CPU backend runs Auto only.)
      if (M <= 64 && is_gpu_)
        paths.insert(paths.end(), {{"dequant", Nf4Path::DequantGemm}, {"small-m", nf4_forced::kSmallM}});
      if (M <= 16 && slice_ok) paths.push_back({"small-m-slice", nf4_forced::kSmallMSlice});
      if (M >= 256 && (fused_ok || mma_ok)) paths.push_back({"dequant", Nf4Path::DequantGemm});
      if (M >= 32 && fused_ok) paths.push_back({"fused", Nf4Path::Fused});
      if (M >= 256 && shared_ok) paths.push_back({"fused-shared", nf4_forced::kFusedShared});
      if (M >= 32 && mma_ok) paths.push_back({"fused-mma", nf4_forced::kFusedMma});
      // The paths of each op are timed in turns (time_interleaved), so that they can be compared.
      std::vector<Result> fwd_rows, bwd_rows;
      std::vector<std::string> fwd_plans, bwd_plans;  // --explain
      std::vector<std::function<void(int)>> fwd_fns, bwd_fns;
      for (const auto& [pname, path] : paths) {
        const Nf4GemmOptions po{1.0f, 0.0f, path};
        // Forced small-M paths only where they apply: up to 32 rows forward, 16 for the input gradient.
        if (fwd && (path != nf4_forced::kSmallM || M <= 32)) {
          fwd_rows.push_back({"nf4_gemm", "dq " + pname, p.label, 1, M, N, K, flops, io});
          fwd_plans.push_back(plan_line(cuda::Nf4Op::Forward, M, N, K, DType::BF16, path));
          fwd_fns.push_back([&, po](int i) { nf4_gemm(ctx_, as[i % sets], ws[i % sets], cs[i % sets], po); });
        }
        if (bwd && (path != nf4_forced::kSmallM || M <= 16) && path != nf4_forced::kSmallMSlice) {
          bwd_rows.push_back({"nf4_gemm_backward_a", "dq " + pname, p.label, 1, M, K, N, flops, io});
          bwd_plans.push_back(plan_line(cuda::Nf4Op::BackwardA, M, N, K, DType::BF16, path));
          bwd_fns.push_back(
              [&, po](int i) { nf4_gemm_backward_a(ctx_, dcs[i % sets], ws[i % sets], das[i % sets], po); });
        }
      }
      if (f32_a) {
        const double io32 = wbytes + 4.0 * M * K + 2.0 * M * N;
        fwd_rows.push_back({"nf4_gemm", "dq auto a-f32", p.label, 1, M, N, K, flops, io32});
        fwd_plans.push_back(plan_line(cuda::Nf4Op::Forward, M, N, K, DType::F32, Nf4Path::Auto));
        fwd_fns.push_back([&](int i) { nf4_gemm(ctx_, as32[i % sets], ws[i % sets], cs[i % sets]); });
      }
      for (auto [rows, fns, plans] :
           {std::tuple{&fwd_rows, &fwd_fns, &fwd_plans}, std::tuple{&bwd_rows, &bwd_fns, &bwd_plans}}) {
        const std::vector<Stats> st = time_interleaved(*fns, sets);
        for (std::size_t i = 0; i < rows->size(); ++i) {
          (*rows)[i].t = st[i];
          record((*rows)[i]);
          print_plan((*plans)[i]);
        }
      }
      if (gu) {  // Auto, and the slice kernel in turns with it where the build has it
        std::vector<std::pair<std::string, Nf4Path>> gu_paths = {{"auto", Nf4Path::Auto}};
        if (M <= 16 && slice_ok) gu_paths.push_back({"small-m-slice", nf4_forced::kSmallMSlice});
        std::vector<std::function<void(int)>> gu_fns;
        for (const auto& [pname, path] : gu_paths) {
          const Nf4GemmOptions po{1.0f, 0.0f, path};
          gu_fns.push_back([&, po](int i) {
            nf4_gate_up(ctx_, as[i % sets], ws[i % sets], ws2[i % sets], {TensorView(), TensorView(), hs[i % sets]},
                        po);
          });
        }
        const std::vector<Stats> st = time_interleaved(gu_fns, sets);
        for (std::size_t i = 0; i < gu_paths.size(); ++i) {
          record({"nf4_gate_up", "dq " + gu_paths[i].first + " h", p.label, 1, M, N, K, 2 * flops,
                  2 * wbytes + 2.0 * (M * K + M * N), st[i]});
          print_plan(plan_line(cuda::Nf4Op::GateUp, M, N, K, DType::BF16, gu_paths[i].second));
        }
      }
    }
}

void Bench::run_mlp() {
  // The SwiGLU MLP block with LoRA (rank 16, alpha 32, no dropout) on gate, up and down, bf16 activations:
  // forward + backward (dx and every adapter gradient), with an NF4 (double-quantized) or a bf16 frozen base.
  struct Block {
    std::string label;
    std::int64_t h, i, m;
  };
  std::vector<Block> blocks = {{"qwen2.5-1.5b mlp", 1536, 8960, 2048}, {"llama3-8b mlp", 4096, 14336, 4096}};
  if (!is_gpu_) blocks = {{"tiny mlp", 64, 160, 16}};
  for (const Block& b : blocks)
    for (bool nf4 : {false, true}) {
      const std::string mode = nf4 ? "nf4" : "bf16";
      if (!selected("mlp_block", b.label)) continue;
      const Tensor wg = pool_->make(ctx_, DType::BF16, {b.i, b.h}, 600), wu = pool_->make(ctx_, DType::BF16, {b.i, b.h}, 601),
                   wd = pool_->make(ctx_, DType::BF16, {b.h, b.i}, 602);
      Nf4Tensor qg, qu, qd;
      if (nf4) {
        qg = nf4_quantize(ctx_, wg, true);
        qu = nf4_quantize(ctx_, wu, true);
        qd = nf4_quantize(ctx_, wd, true);
      }
      auto base = [&](const Tensor& w, const Nf4Tensor& q) { return nf4 ? BaseWeight(q) : BaseWeight(w); };
      LoraConfig cfg;
      cfg.rank = 16;
      cfg.alpha = 32.0f;
      cfg.activations = DType::BF16;
      SwiGluMlp mlp(ctx_, base(wg, qg), base(wu, qu), base(wd, qd), cfg);
      for (LoraLinear* l : {&mlp.gate(), &mlp.up(), &mlp.down()}) {  // nonzero adapters, as after some training
        const std::int64_t r = cfg.rank, k = l->in_features(), n = l->out_features();
        l->load_adapters(pool_->make(ctx_, DType::F32, {r, k}, 610), pool_->make(ctx_, DType::F32, {n, r}, 611));
      }
      mlp.reserve(b.m);
      const Tensor x = pool_->make(ctx_, DType::BF16, {b.m, b.h}, 620), dy = pool_->make(ctx_, DType::BF16, {b.m, b.h}, 621);
      const Tensor y(DType::BF16, {b.m, b.h}, ctx_.device()), dx(DType::BF16, {b.m, b.h}, ctx_.device());
      // Base GEMMs: 3 forward + 3 input-gradient, 2*M*H*I each; the rank-16 adapters add about 3% more.
      const double flops = 12.0 * b.m * b.h * b.i;
      const double bytes = static_cast<double>(mlp.frozen_bytes()) + 2.0 * 4 * b.m * b.h + 2.0 * 4 * b.m * b.i;
      Result r{"mlp_block", mode, b.label, 1, b.m, b.i, b.h, flops, bytes, time([&](int) {
                 mlp.forward(x, y);
                 mlp.backward(x, dy, dx);
               })};
      std::printf("  %s %s base: frozen weights %.1f MB = %.3f of bf16\n", b.label.c_str(), mode.c_str(),
                  static_cast<double>(mlp.frozen_bytes()) / 1e6,
                  static_cast<double>(mlp.frozen_bytes()) / static_cast<double>(mlp.frozen_bf16_bytes()));
      record(r);
    }
}

void Bench::add_ratios() {
  // NF4 GEMMs against the bf16 GEMM on the dequantized weight (same shape, same run); BF16-compute against
  // bf16 storage and TF32; gate+up against two nf4_gemm calls.
  for (Result& r : results_) {
    const Result* base = nullptr;
    if (r.op == "nf4_gemm") base = find("gemm_bt", "bf16", r.m, r.n, r.k), r.baseline = "gemm_bt bf16";
    else if (r.op == "nf4_gemm_backward_a") base = find("gemm", "bf16", r.m, r.n, r.k), r.baseline = "gemm bf16";
    else if (r.op == "lora_backward_dy") {
      if (r.mode == "bf16") base = find(r.op, "2 gemms", r.m, r.n, r.k), r.baseline = "2 gemms";
    } else if (r.op == "swiglu_adapters" || r.op == "swiglu_adapters_backward") {
      if (r.mode == "bf16") {
        const bool step = r.shape.find("+dh term") != std::string::npos;
        r.baseline = r.op == "swiglu_adapters" ? "2 gemms + swiglu" : step ? "gemm + plain swiglu" : "plain swiglu";
        base = find(r.op, r.baseline, r.m, r.n, r.k);
      }
    } else if (r.op == "linear_cross_entropy") {
      if (r.mode == "dh" || r.mode == "dh, 1024-token rows")
        base = find(r.op, "2 gemms", r.m, r.n, r.k), r.baseline = "2 gemms";
      if (r.mode == "dh+dw") base = find(r.op, "3 gemms", r.m, r.n, r.k), r.baseline = "3 gemms";
    } else if (r.op == "rms_norm" || r.op == "rms_norm_backward" || r.op == "add_rms_norm" ||
               r.op == "rms_norm_backward+dres" || r.op == "rope") {
      base = find("stream", r.op, r.m, r.n, r.k), r.baseline = "stream, same bytes";
    } else if (r.op == "mlp_block") {
      if (r.mode != "bf16") base = find("mlp_block", "bf16", r.m, r.n, r.k), r.baseline = "bf16 base";
    } else if (r.op == "nf4_gate_up") {
      if (const Result* one = find("nf4_gemm", "dq auto", r.m, r.n, r.k)) {
        r.baseline = "2x nf4_gemm";
        r.ratio = r.t.median_us / (2 * one->t.median_us);
      }
      continue;
    } else if (r.mode == "f32/bf16")
      base = find(r.op, "bf16", r.m, r.n, r.k), r.baseline = "bf16 storage";
    else if (r.mode == "tf32" || r.mode == "fp32") base = find(r.op, "f32/bf16", r.m, r.n, r.k), r.baseline = "f32/bf16";
    if (base) r.ratio = r.t.median_us / base->t.median_us;
    else r.baseline.clear();
  }
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

void Bench::write_json(const std::string& path) const {
  nlohmann::json j;
  j["device"] = info_.name;
  j["compute_capability"] = info_.compute_capability;
  j["date"] = now_utc();
  const char* commit = std::getenv("QMM_COMMIT");
  j["commit"] = commit ? commit : "unknown";
  j["repeats"] = opts_.repeats;
  j["hold_ms"] = opts_.hold_ms;
  j["ceilings"] = {{"copy_GBps", ceil_.copy_gbps},
                   {"bf16_TFLOPs", ceil_.bf16_tflops},
                   {"tf32_TFLOPs", ceil_.tf32_tflops},
                   {"fp32_TFLOPs", ceil_.fp32_tflops}};
  for (const Result& r : results_) {
    const double s = r.t.median_us * 1e-6;
    nlohmann::json e = {{"op", r.op},       {"mode", r.mode},          {"shape", r.shape},
                        {"batch", r.batch}, {"m", r.m},                {"n", r.n},
                        {"k", r.k},         {"median_us", r.t.median_us}, {"p10_us", r.t.p10_us},
                        {"p90_us", r.t.p90_us}, {"host_us", r.t.host_us}, {"eager_us", r.t.eager_us}, {"graph", r.t.graph}, {"flops", r.flops},    {"bytes", r.bytes},
                        {"tflops", r.flops / s / 1e12}, {"gbps", r.bytes / s / 1e9}, {"floor_us", r.floor_us}};
    if (r.floor_us > 0) e["roofline_fraction"] = r.floor_us / r.t.median_us;
    e["tokens"] = r.tokens > 0 ? r.tokens : r.m;
    if (r.ratio > 0) e["ratio"] = {{"vs", r.baseline}, {"value", r.ratio}};
    j["results"].push_back(e);
  }
  std::ofstream f(path);
  if (!f) throw Error(ErrorCode::Io, "bench: cannot write " + path);
  f << j.dump(1) << "\n";
  f.close();
  if (!f) throw Error(ErrorCode::Io, "bench: writing " + path + " failed (disk full?)");
  std::printf("\nwrote %zu results to %s\n", results_.size(), path.c_str());
}

template <class Item, class Range>
bool contains(const Range& r, const Item& x) {
  return std::find(r.begin(), r.end(), x) != r.end();
}

std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (const std::string& i : items) s += (s.empty() ? "" : ", ") + i;
  return s;
}

// The distinct ops of a catalogue, in run order.
std::vector<std::string> ops_of(const Catalogue& c) {
  std::vector<std::string> ops;
  for (const auto& [op, label] : c)
    if (!contains(ops, op)) ops.push_back(op);
  return ops;
}
// The distinct shape labels of the ops in `of` (of every op when empty), in run order.
std::vector<std::string> labels_of(const Catalogue& c, const std::vector<std::string>& of) {
  std::vector<std::string> labels;
  for (const auto& [op, label] : c)
    if ((of.empty() || contains(of, op)) && !contains(labels, label)) labels.push_back(label);
  return labels;
}

// An --op that names no op, or a --shape that matches no shape of the selected ops, would run nothing and print
// empty tables: a typo. Each filter must select something on this backend.
void check_selection(const BenchOptions& o, bool gpu) {
  const Catalogue here = Bench::catalogue(gpu);
  const std::vector<std::string> ops = ops_of(here);
  for (const std::string& op : o.ops) {
    if (contains(ops, op)) continue;
    const std::vector<std::string> all = gpu ? ops : ops_of(Bench::catalogue(true));
    if (contains(all, op))
      throw Error(ErrorCode::InvalidArgument, "bench: --op '" + op + "' runs on a GPU only; ops on the CPU backend: " +
                                                  joined(ops));
    throw Error(ErrorCode::InvalidArgument, "bench: --op '" + op + "' names no op; ops: " + joined(all));
  }
  const std::vector<std::string> labels = labels_of(here, o.ops);
  for (const std::string& text : o.shapes) {
    if (std::any_of(labels.begin(), labels.end(), [&](const std::string& l) { return l.find(text) != l.npos; }))
      continue;
    throw Error(ErrorCode::InvalidArgument,
                "bench: --shape '" + text + "' matches no shape of " + (o.ops.empty() ? "any op" : joined(o.ops)) +
                    (gpu ? "" : " on the CPU backend") + " (a shape is selected when its label contains the text); "
                    "shapes: " + joined(labels));
  }
}

// --json is written after the run: check now that it can be, rather than fail after minutes of timing. A file
// that this check creates is removed again.
void check_writable(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(ErrorCode::Io, "bench: cannot write --json " + path + ": it is a directory");
  const bool existed = std::filesystem::exists(path, ec);
  std::FILE* f = std::fopen(path.c_str(), "a");  // appends nothing: an existing file is left as it is
  if (!f) throw Error(ErrorCode::Io, "bench: cannot write --json " + path + ": " + std::strerror(errno));
  std::fclose(f);
  if (!existed) std::filesystem::remove(path, ec);
}

}  // namespace

int run_bench(const BenchOptions& opts) {
  const bool gpu = !opts.cpu && Context::cuda_device_count() > 0;
  check_selection(opts, gpu);
  if (!opts.json_path.empty()) check_writable(opts.json_path);
  const Context ctx = gpu ? Context::cuda_with_new_stream(0) : Context::cpu();  // a stream that graphs can capture
  BenchOptions o = opts;
  if (!gpu && o.repeats > 3) o.repeats = 3;  // the CPU reference backend is a correctness tool, not a fast path
  std::printf("qmm bench on %s%s, %d repeats per case", ctx.device_name().c_str(),
              gpu ? "" : " (CPU reference backend: small shapes only)", o.repeats);
  if (gpu && o.hold_ms > 0) std::printf(", each held %d ms before timing", o.hold_ms);
  if (!gpu && o.hold_ms > 0) std::printf(", --hold-ms ignored (GPU only)");
  std::printf("\n");
  Bench b(ctx, o);
  b.measure_ceilings();
  b.print_header();
  b.run_all();
  b.add_ratios();
  b.print_ratios();
  if (!o.json_path.empty()) b.write_json(o.json_path);
  return 0;
}

}  // namespace qmm::tool
