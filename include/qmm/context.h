// Context: where ops run. A CPU context runs the reference backend; a CUDA context owns a stream binding,
// the cuBLASLt handle and workspace, device properties and a thread-safe plan cache.
// A Context may be used from several threads at once; work from all of them goes to its one stream.
// Copies of a Context share the same state.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "qmm/tensor.h"

namespace qmm {

struct DeviceInfo {
  std::string name;              // "cpu" or the GPU's name
  int compute_capability = 0;    // 90 for Hopper; 0 on the CPU
  int sm_count = 0;
  std::size_t l2_bytes = 0;
  std::size_t memory_bytes = 0;
};

// Device memory a context holds beyond its callers' tensors (all zero for a CPU context). Ops take their scratch
// (an NF4 weight's bf16 copy, a loss's chunk of logits) from the context's own stream-ordered pool, which keeps
// what it has reserved between calls (scratch sizes repeat from step to step) until release_cached_memory. Memory
// that a CUDA graph captured with qmm ops holds belongs to the graph, not to the pool.
struct MemoryStats {
  std::size_t fixed_bytes = 0;                  // the cuBLASLt workspace and tables, for the context's life
  std::size_t scratch_reserved_bytes = 0;       // the pool's device memory now
  std::size_t scratch_reserved_peak_bytes = 0;  // its most since the context was made or the peaks were reset
  std::size_t scratch_in_use_bytes = 0;         // of the reserved memory, what ops in flight hold now
  std::size_t scratch_in_use_peak_bytes = 0;
};

class Context {
 public:
  // The CPU reference backend.
  static Context cpu();
  // A CUDA context on `device`, enqueueing on `stream` (a cudaStream_t; nullptr means the legacy default
  // stream). Throws Error(NoDevice) when qmm was built without CUDA or no such GPU is usable.
  static Context cuda(int device = 0, void* stream = nullptr);
  // A CUDA context on a new non-blocking stream of its own, destroyed with the last copy of the context. Unlike
  // the legacy default stream, such a stream can be captured into a CUDA graph.
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

  MemoryStats memory_stats() const;
  // The peaks start again from the current values.
  void reset_peak_memory_stats() const;
  // Waits for the context's stream, then gives the scratch pool's memory back to the device (the next op that
  // needs scratch reserves it again).
  void release_cached_memory() const;

  struct Impl;  // the backends' state, opaque here

 private:
  friend struct ContextAccess;  // the library's own access to Impl (src/core/context_impl.h)
  explicit Context(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace qmm
