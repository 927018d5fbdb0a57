// Probe (GPU machine): is a path's speed set by the SM clock it gets? For each shape and path (bf16 cuBLAS on the
// dequantized weight, dequantize + cuBLASLt, FusedShared), device times of calls run back to back for about a
// second, early and late, with the SM clock and the board power read through NVML (dlopen'd: no NVML header or
// library at build time) while they run. Build after scripts/device-check (libqmm in build-gpu-90a):
//   nvcc -std=c++20 -O2 -Iinclude -Isrc src/cuda/dev/probes/sustained.cu build-gpu-90a/libqmm.a -lcublasLt -lcuda -lgomp -ldl \
//     -o /tmp/sustained
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

#include "core/nf4_forced.h"
#include "probe_common.h"
#include "qmm/qmm.h"

using namespace qmm;
using probe::check;
using probe::random_bf16;

namespace {

// The four NVML calls this probe needs (nvml.h: nvmlReturn_t is an int, nvmlDevice_t a pointer, NVML_CLOCK_SM 1).
struct Nvml {
  using Init = int (*)();
  using Handle = int (*)(unsigned, void**);
  using Clock = int (*)(void*, int, unsigned*);
  using Power = int (*)(void*, unsigned*);
  Clock clock = nullptr;
  Power power = nullptr;
  void* dev = nullptr;
  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) return;
    auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
    auto handle = reinterpret_cast<Handle>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    clock = reinterpret_cast<Clock>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    power = reinterpret_cast<Power>(dlsym(lib, "nvmlDeviceGetPowerUsage"));
    if (!init || !handle || !clock || !power || init() != 0 || handle(0, &dev) != 0) dev = nullptr;
  }
  unsigned sm_mhz() const {
    unsigned v = 0;
    if (dev) clock(dev, 1, &v);
    return v;
  }
  unsigned watts() const {
    unsigned mw = 0;
    if (dev) power(dev, &mw);
    return mw / 1000;
  }
};

struct Timing {
  float early_us, hot_us;
  unsigned early_mhz, hot_mhz, early_watts, hot_watts;
};

// After 500 ms idle, ~1.2 s of calls back to back in blocks of 8 (two blocks in flight, so the GPU never waits
// for the host), each block's per-call time with the clock and power read when it ended: medians over the blocks
// that ended 20-120 ms in (early: the clocks the GPU starts at) and over the last half (hot: what the power limit
// leaves).
Timing measure(cudaStream_t s, const Nvml& nvml, const std::function<void()>& fn) {
  cudaEvent_t start[2], end[2];
  for (int i = 0; i < 2; ++i) {
    check(cudaEventCreate(&start[i]));
    check(cudaEventCreate(&end[i]));
  }
  fn();
  check(cudaStreamSynchronize(s));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  constexpr int kBlock = 8;
  struct Sample {
    double at_ms;
    float us;
    unsigned mhz, watts;
  };
  std::vector<Sample> samples;
  const auto t0 = std::chrono::steady_clock::now();
  auto ms_since = [&] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); };
  for (int b = 0;; ++b) {
    check(cudaEventRecord(start[b % 2], s));
    for (int i = 0; i < kBlock; ++i) fn();
    check(cudaEventRecord(end[b % 2], s));
    if (b == 0) continue;
    check(cudaEventSynchronize(end[(b - 1) % 2]));
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start[(b - 1) % 2], end[(b - 1) % 2]));
    samples.push_back({ms_since(), ms * 1000.0f / kBlock, nvml.sm_mhz(), nvml.watts()});
    if (ms_since() > 1200) break;
  }
  check(cudaStreamSynchronize(s));
  for (int i = 0; i < 2; ++i) {
    check(cudaEventDestroy(start[i]));
    check(cudaEventDestroy(end[i]));
  }
  auto median = [](std::vector<Sample> v, auto field) {
    if (v.empty()) return decltype(field(v[0])){};
    std::sort(v.begin(), v.end(), [&](const Sample& a, const Sample& b) { return field(a) < field(b); });
    return field(v[v.size() / 2]);
  };
  std::vector<Sample> early, hot;
  for (const Sample& x : samples) {
    if (x.at_ms >= 20 && x.at_ms <= 120) early.push_back(x);
    if (x.at_ms >= samples.back().at_ms / 2) hot.push_back(x);
  }
  auto us = [](const Sample& x) { return x.us; };
  auto mhz = [](const Sample& x) { return x.mhz; };
  auto watts = [](const Sample& x) { return x.watts; };
  return {median(early, us), median(hot, us), median(early, mhz), median(hot, mhz), median(early, watts),
          median(hot, watts)};
}

}  // namespace

int main() {
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Context ctx = Context::cuda(0, stream);
  const Nvml nvml;
  if (!nvml.dev) std::printf("(NVML not found: clocks and power read as 0)\n");
  struct Shape {
    const char* label;
    std::int64_t m, n, k;  // the layer: y [m, n] = x [m, k] W^T, W [n, k]
    bool backward;         // the input gradient dx [m, k] = dy [m, n] W instead
  };
  const Shape shapes[] = {{"llama gate_up fwd", 4096, 14336, 4096, false},
                          {"llama gate_up dA", 4096, 14336, 4096, true},
                          {"llama gate_up fwd", 2048, 14336, 4096, false},
                          {"qwen gate_up fwd", 2048, 8960, 1536, false},
                          {"qwen gate_up dA", 2048, 8960, 1536, true}};
  std::printf("%-18s %5s %-12s %9s %9s %9s %9s %8s %6s\n", "shape", "M", "path", "early us", "hot us",
              "early MHz", "hot MHz", "early W", "hot W");
  for (const Shape& s : shapes) {
    const std::int64_t in = s.backward ? s.n : s.k, out = s.backward ? s.k : s.n;
    const Tensor x = random_bf16(ctx, s.m, in, 1), w16 = random_bf16(ctx, s.n, s.k, 2);
    const Nf4Tensor q = nf4_quantize(ctx, w16, true);
    const Tensor y(DType::BF16, {s.m, out}, ctx.device());
    ctx.synchronize();
    const std::pair<const char*, std::function<void()>> paths[] = {
        {"cublas bf16", [&] { s.backward ? gemm(ctx, x, w16, y) : gemm_bt(ctx, x, w16, y); }},
        {"dequant", [&] {
           const Nf4GemmOptions o{1.0f, 0.0f, Nf4Path::DequantGemm};
           s.backward ? nf4_gemm_backward_a(ctx, x, q, y, o) : nf4_gemm(ctx, x, q, y, o);
         }},
        {"fused-shared", [&] {
           const Nf4GemmOptions o{1.0f, 0.0f, nf4_forced::kFusedShared};
           s.backward ? nf4_gemm_backward_a(ctx, x, q, y, o) : nf4_gemm(ctx, x, q, y, o);
         }}};
    for (const auto& [name, fn] : paths) {
      const Timing t = measure(stream, nvml, fn);
      std::printf("%-18s %5lld %-12s %9.1f %9.1f %9u %9u %8u %6u\n", s.label, static_cast<long long>(s.m), name,
                  t.early_us, t.hot_us, t.early_mhz, t.hot_mhz, t.early_watts, t.hot_watts);
      std::fflush(stdout);
    }
  }
  return 0;
}
