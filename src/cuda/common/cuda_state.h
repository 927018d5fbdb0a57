// The CUDA part of a Context: stream, cuBLASLt handle and workspace, device properties.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>

#include "core/context_impl.h"

namespace qmm::cuda {

struct CudaState {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaDeviceProp props{};
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt workspace, used only by work on `stream`, so calls never race on it
  std::size_t workspace_bytes = 0;

  // Scratch memory for ops (e.g. a dequantized weight). Grows on demand; stream-ordered reuse is safe because
  // every op runs on `stream`. The lock only guards the pointer swap.
  std::mutex scratch_mutex;
  void* scratch = nullptr;
  std::size_t scratch_bytes = 0;
  void* scratch_at_least(std::size_t bytes);

  int sm_count() const { return props.multiProcessorCount; }
  int cc() const { return props.major * 10 + props.minor; }
};

inline CudaState& state(const Context& ctx) { return *ctx.impl().cuda; }
inline cudaStream_t stream_of(const Context& ctx) { return ctx.impl().cuda->stream; }

// Makes ctx's device current for the calling thread (cheap when it already is).
void set_device(const Context& ctx);

}  // namespace qmm::cuda
