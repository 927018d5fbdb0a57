// Timing of calls on a context, for the benchmark and the tests.
#include "core/timing.h"

#include <chrono>

#include "core/gpu_backend.h"
#include "qmm/error.h"

namespace qmm {

std::vector<double> time_calls(const Context& ctx, const std::function<void(int)>& fn, int warmup, int repeats) {
  if (warmup < 0 || repeats < 1)
    throw Error(ErrorCode::InvalidArgument, "time_calls: warmup must be >= 0 and repeats >= 1");
  if (ctx.device().is_cuda()) return require_gpu_backend("time_calls").time_calls(ctx, fn, warmup, repeats);
  std::vector<double> ms;
  for (int i = 0; i < warmup + repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(i);
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return ms;
}

std::vector<double> time_graph(const Context& ctx, const std::function<void(int)>& fn, int calls, int replays) {
  if (calls < 1 || replays < 1)
    throw Error(ErrorCode::InvalidArgument, "time_graph: calls and replays must be >= 1");
  if (ctx.device().is_cuda()) return require_gpu_backend("time_graph").time_graph(ctx, fn, calls, replays);
  (void)fn;
  throw Error(ErrorCode::Unsupported, "time_graph: CUDA graphs need a CUDA context");
}

}  // namespace qmm
