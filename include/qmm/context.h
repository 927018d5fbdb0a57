// Context: where ops run. A CPU context runs the reference backend; a CUDA context owns a stream binding,
// the cuBLASLt handle and workspace, device properties and a thread-safe plan cache.
// A Context may be used from several threads at once; work from all of them goes to its one stream.
// Copies of a Context share the same state.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "qmm/tensor.h"

namespace qmm {

struct DeviceInfo {
  std::string name;              // "cpu" or the GPU's name
  int compute_capability = 0;    // 90 for Hopper; 0 on the CPU
  int sm_count = 0;
  std::size_t l2_bytes = 0;
  std::size_t memory_bytes = 0;
};

class Context {
 public:
  // The CPU reference backend.
  static Context cpu();
  // A CUDA context on `device`, enqueueing on `stream` (a cudaStream_t; nullptr means the legacy default
  // stream). Throws Error(NoDevice) when qmm was built without CUDA or no such GPU is usable.
  static Context cuda(int device = 0, void* stream = nullptr);
  // A CUDA context on a new non-blocking stream of its own, destroyed with the last copy of the context. Unlike
  // the legacy default stream, such a stream can be captured into a CUDA graph (time_graph needs that).
  static Context cuda_with_new_stream(int device = 0);
  // Number of usable CUDA devices; 0 where there is no GPU, no driver, or no CUDA in this build.
  static int cuda_device_count();
  // Why no CUDA device is usable (empty when one is).
  static std::string cuda_unavailable_reason();

  Device device() const;
  void* stream() const;
  std::string device_name() const;  // "cpu" or the GPU's name
  DeviceInfo info() const;
  // Blocks until all work enqueued by this context is done (no-op on the CPU).
  void synchronize() const;
  // Runs fn(i) for i = 0 .. warmup+repeats-1 and returns the milliseconds of each of the last `repeats` calls:
  // on a CUDA context measured with events on its stream around each call, on the CPU with a steady clock.
  std::vector<double> time_calls(const std::function<void(int)>& fn, int warmup, int repeats) const;
  // Device time without host gaps: captures fn(0) .. fn(calls-1) into one CUDA graph, replays it `replays` times
  // and returns each replay's milliseconds per call. Small ops are timed as the GPU runs them, not as fast as the
  // host can enqueue them. Throws Error(Unsupported) on the CPU, on the legacy default stream, or when fn cannot
  // be captured (it synchronizes, say); the stream is usable again afterwards.
  std::vector<double> time_graph(const std::function<void(int)>& fn, int calls, int replays) const;

  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  explicit Context(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace qmm
