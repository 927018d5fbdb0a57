// Probe (GPU machine): does an NF4 dequantization on a second, lower-priority stream hide under a bf16 cuBLAS
// GEMM on the first (in the GEMM's last, partly empty wave)? Times, per shape, the GEMM alone, the dequantization
// alone, both in sequence on one stream, and both concurrently (dequantization enqueued before or after the GEMM,
// with and without stream priorities). Build after scripts/device-check (libqmm in build-gpu-90a):
//   nvcc -std=c++20 -O2 -Iinclude src/cuda/dev/probes/overlap.cu build-gpu-90a/libqmm.a -lcublasLt -lgomp -o /tmp/overlap
// `/tmp/overlap once` runs one GEMM per shape and nothing else (for ncu's launch figures).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "probe_common.h"
#include "qmm/qmm.h"

using namespace qmm;
using probe::check;
using probe::random_bf16;

namespace {

// Median microseconds of fn over 30 runs (after 5 warm-ups), timed by events on stream s.
double median_us(cudaStream_t s, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a));
  check(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < 35; ++i) {
    check(cudaEventRecord(a, s));
    fn();
    check(cudaEventRecord(b, s));
    check(cudaEventSynchronize(b));
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b));
    if (i >= 5) t.push_back(ms * 1000.0f);
  }
  std::sort(t.begin(), t.end());
  check(cudaEventDestroy(a));
  check(cudaEventDestroy(b));
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const bool once = argc > 1;  // one GEMM per shape and nothing else (for ncu's launch figures)
  int lo = 0, hi = 0;
  check(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t s_main, s_low, s_same;
  check(cudaStreamCreateWithPriority(&s_main, cudaStreamNonBlocking, hi));
  check(cudaStreamCreateWithPriority(&s_low, cudaStreamNonBlocking, lo));
  check(cudaStreamCreateWithPriority(&s_same, cudaStreamNonBlocking, hi));
  const Context main_ctx = Context::cuda(0, s_main), low_ctx = Context::cuda(0, s_low),
                same_ctx = Context::cuda(0, s_same);
  cudaEvent_t fork, join;
  check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

  struct Shape {
    const char* label;
    std::int64_t m, n, k;
    bool bt;  // gemm_bt (forward) or gemm (input gradient: B [k, n] = W [N, K] read as is)
  };
  const Shape shapes[] = {{"qwen gate fwd", 2048, 8960, 1536, true},   {"qwen down fwd", 2048, 1536, 8960, true},
                          {"qwen gate dA", 2048, 1536, 8960, false},   {"qwen down dA", 2048, 8960, 1536, false},
                          {"llama gate fwd", 4096, 14336, 4096, true}, {"llama down fwd", 4096, 4096, 14336, true},
                          {"llama gate fwd 2048", 2048, 14336, 4096, true}};
  std::printf("%-20s %8s %8s %8s %8s %8s %8s %8s\n", "shape", "gemm", "dequant", "serial", "conc-pre",
              "conc-post", "same-pri", "hidden%");
  for (const Shape& s : shapes) {
    const std::int64_t wn = s.bt ? s.n : s.k, wk = s.bt ? s.k : s.n;  // the weight [N, K] of the layer
    const Tensor x = random_bf16(main_ctx, s.m, s.k, 1), w16 = random_bf16(main_ctx, wn, wk, 2);
    const Tensor c(DType::BF16, {s.m, s.n}, main_ctx.device());
    const Nf4Tensor q = nf4_quantize(main_ctx, random_bf16(main_ctx, wn, wk, 3), true);
    const Tensor buf(DType::BF16, {wn, wk}, main_ctx.device());
    main_ctx.synchronize();
    auto gemm_on = [&](const Context& ctx) {
      if (s.bt) gemm_bt(ctx, x, w16, c);
      else gemm(ctx, x, w16, c);
    };
    auto concurrent = [&](const Context& side, bool dequant_first) {
      check(cudaEventRecord(fork, s_main));
      check(cudaStreamWaitEvent(static_cast<cudaStream_t>(side.stream()), fork));
      if (dequant_first) nf4_dequantize(side, q, buf);
      gemm_on(main_ctx);
      if (!dequant_first) nf4_dequantize(side, q, buf);
      check(cudaEventRecord(join, static_cast<cudaStream_t>(side.stream())));
      check(cudaStreamWaitEvent(s_main, join));
    };
    if (once) {
      gemm_on(main_ctx);
      main_ctx.synchronize();
      continue;
    }
    const double g = median_us(s_main, [&] { gemm_on(main_ctx); });
    const double d = median_us(s_main, [&] { nf4_dequantize(main_ctx, q, buf); });
    const double serial = median_us(s_main, [&] {
      nf4_dequantize(main_ctx, q, buf);
      gemm_on(main_ctx);
    });
    const double pre = median_us(s_main, [&] { concurrent(low_ctx, true); });
    const double post = median_us(s_main, [&] { concurrent(low_ctx, false); });
    const double same = median_us(s_main, [&] { concurrent(same_ctx, true); });
    const double best = std::min({pre, post, same});
    std::printf("%-20s %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %7.0f%%\n", s.label, g, d, serial, pre, post, same,
                100.0 * (serial - best) / d);
  }
  return 0;
}
