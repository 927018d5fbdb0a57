// The CUDA part of a Context: stream, cuBLASLt handle and workspace, device properties.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>

#include "core/context_impl.h"

namespace qmm::cuda {

struct CudaState final : BackendState {
  CudaState() = default;
  CudaState(const CudaState&) = delete;
  CudaState& operator=(const CudaState&) = delete;
  ~CudaState() override;  // waits for the stream, then releases everything below

  int device = 0;
  cudaStream_t stream = nullptr;
  bool owns_stream = false;  // created by Context::cuda_with_new_stream, destroyed with this state
  cudaDeviceProp props{};
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt workspace, used only by work on `stream`, so calls never race on it
  std::size_t workspace_bytes = 0;

  float* code2 = nullptr;  // the 256 double-quantization values (nf4_code2_table), uploaded once
  cudaMemPool_t pool = nullptr;  // this context's stream-ordered pool for ScratchBuffer (keeps its memory)
  // cuBLASLt may enqueue several kernels per matmul that share `workspace`; this lock keeps one matmul's kernels
  // together on the stream when several host threads use the context.
  std::mutex lt_mutex;

  int sm_count() const { return props.multiProcessorCount; }
  int cc() const { return props.major * 10 + props.minor; }
};

// Temporary device memory for one op, stream-ordered: taken from the context's pool on its stream and given back
// on the stream when this object dies, so it is reused only after every kernel enqueued before that has finished.
// Threads sharing a context never share scratch, and no call needs to synchronize to grow it.
class ScratchBuffer {
 public:
  ScratchBuffer(const CudaState& st, std::size_t bytes);
  ~ScratchBuffer();
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  void* data() const { return ptr_; }
  template <class T>
  T* at(std::size_t byte_offset) const { return reinterpret_cast<T*>(static_cast<char*>(ptr_) + byte_offset); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// A CUDA context's state (only the CUDA backend makes CUDA contexts, so its state is a CudaState).
inline CudaState& state(const Context& ctx) { return static_cast<CudaState&>(*impl_of(ctx).backend); }
inline cudaStream_t stream_of(const Context& ctx) { return state(ctx).stream; }

// Makes ctx's device current for the calling thread (cheap when it already is).
void set_device(const Context& ctx);

// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device (raised once, then cached).
void allow_dynamic_shared(const void* kernel, int bytes);

// Whether the current device runs `kernel` from code compiled for sm_90 or later (cudaFuncGetAttributes'
// ptxVersion, cached per kernel and device): only there does pdl_wait wait. A build for sm_80 alone, which a
// Hopper GPU runs through the driver's JIT, has no wait in its kernels and must not be launched overlapping.
bool kernel_has_pdl_wait(const void* kernel);

// Launches `kernel` with programmatic dependent launch: on sm_90 it may start while the stream's previous kernel
// drains (that kernel's blocks exit or call pdl_launch_dependents), so its launch and its prologue overlap that
// kernel's tail. The kernel must call pdl_wait (sm80_ptx.cuh) before it reads or writes global memory. Where its
// code predates sm_90 the launch is an ordinary one.
template <class... Params, class... Args>
cudaError_t launch_overlapping(const Context& ctx, void (*kernel)(Params...), dim3 grid, unsigned threads,
                               int shared_bytes, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<std::size_t>(shared_bytes);
  config.stream = stream_of(ctx);
  config.attrs = &attr;
  config.numAttrs = kernel_has_pdl_wait(reinterpret_cast<const void*>(kernel)) ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Blocks of `kernel` (`threads` each, no dynamic shared memory) resident at once across ctx's GPU, from its
// occupancy (queried once per kernel, block size and device): a grid-stride kernel given more would run them as a
// partial second wave.
std::int64_t wave_blocks(const Context& ctx, const void* kernel, int threads);
template <class Kernel>
std::int64_t wave_blocks(const Context& ctx, Kernel kernel, int threads) {
  return wave_blocks(ctx, reinterpret_cast<const void*>(kernel), threads);
}

// Grid size of a grid-stride launch over `items` (one per thread): one wave at most, never more blocks than the
// work needs, at least one.
template <class Kernel>
unsigned grid_for(const Context& ctx, Kernel kernel, int threads, std::int64_t items) {
  const std::int64_t need = (items + threads - 1) / threads;
  return static_cast<unsigned>(std::max<std::int64_t>(1, std::min(need, wave_blocks(ctx, kernel, threads))));
}

}  // namespace qmm::cuda
