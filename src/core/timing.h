// Timing of calls on a context: what the benchmark (qmm bench) and the tests measure with. Internal: programs that
// embed qmm time their own work.
#pragma once

#include <functional>
#include <vector>

#include "qmm/context.h"

namespace qmm {

// Runs fn(i) for i = 0 .. warmup+repeats-1 and returns the milliseconds of each of the last `repeats` calls: on a
// CUDA context measured with events on its stream around each call, on the CPU with a steady clock.
std::vector<double> time_calls(const Context& ctx, const std::function<void(int)>& fn, int warmup, int repeats);

// Device time without host gaps: captures fn(0) .. fn(calls-1) into one CUDA graph, replays it `replays` times and
// returns each replay's milliseconds per call. Small ops are timed as the GPU runs them, not as fast as the host can
// enqueue them. Throws Error(Unsupported) on the CPU, on the legacy default stream, or when fn cannot be captured
// (it synchronizes, say); the stream is usable again afterwards.
std::vector<double> time_graph(const Context& ctx, const std::function<void(int)>& fn, int calls, int replays);

}  // namespace qmm
