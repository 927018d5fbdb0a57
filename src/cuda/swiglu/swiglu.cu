// Host side of SwiGLU: vector width from pointer alignment, grid from the SM count, launches on ctx's stream.
#include "cuda/swiglu/swiglu.cuh"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"

namespace qmm::cuda {

namespace {

using namespace swiglu_detail;

bool all_aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

template <class T>
void launch_swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h) {
  const std::int64_t n = h.numel();
  constexpr int V = Elem<T>::kVec;
  const std::int64_t nvec = all_aligned16({gate.data(), up.data(), h.data()}) ? n / V : 0;
  const std::int64_t items = nvec + (n - nvec * V);  // vectors plus scalar elements
  swiglu_kernel<T><<<grid_for(ctx, swiglu_kernel<T>, kThreads, items), kThreads, 0, stream_of(ctx)>>>(
      gate.data_as<const T>(), up.data_as<const T>(), h.data_as<T>(), n, nvec);
  QMM_CUDA_CHECK_LAUNCH("swiglu_kernel");
}

template <class T>
void launch_swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                            const TensorView& dgate, const TensorView& dup) {
  const std::int64_t n = dgate.numel();
  constexpr int V = Elem<T>::kVec;
  const std::int64_t nvec =
      all_aligned16({gate.data(), up.data(), dh.data(), dgate.data(), dup.data()}) ? n / V : 0;
  const std::int64_t items = nvec + (n - nvec * V);
  swiglu_backward_kernel<T><<<grid_for(ctx, swiglu_backward_kernel<T>, kThreads, items), kThreads, 0, stream_of(ctx)>>>(
      gate.data_as<const T>(), up.data_as<const T>(), dh.data_as<const T>(), dgate.data_as<T>(), dup.data_as<T>(),
      n, nvec);
  QMM_CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

}  // namespace

void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h) {
  if (h.numel() == 0) return;
  set_device(ctx);
  if (h.dtype() == DType::BF16) launch_swiglu<__nv_bfloat16>(ctx, gate, up, h);
  else launch_swiglu<float>(ctx, gate, up, h);
}

void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                     const TensorView& dgate, const TensorView& dup) {
  if (dgate.numel() == 0) return;
  set_device(ctx);
  if (dgate.dtype() == DType::BF16) launch_swiglu_backward<__nv_bfloat16>(ctx, gate, up, dh, dgate, dup);
  else launch_swiglu_backward<float>(ctx, gate, up, dh, dgate, dup);
}

}  // namespace qmm::cuda
