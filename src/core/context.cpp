#include "qmm/context.h"

#include <chrono>

#include "core/context_impl.h"
#include "qmm/error.h"
#ifdef QMM_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace qmm {

#ifndef QMM_WITH_CUDA
namespace cuda {
void destroy_state(CudaState*) {}
}  // namespace cuda
#endif

Context Context::cpu() {
  auto impl = std::make_shared<Impl>();
  impl->device = Device::cpu();
  impl->name = "cpu";
  return Context(std::move(impl));
}

Context Context::cuda(int device, void* stream) {
#ifdef QMM_WITH_CUDA
  auto impl = std::make_shared<Impl>();
  impl->device = Device::cuda(device);
  impl->stream = stream;
  cuda::init_context(*impl, device, stream);
  return Context(std::move(impl));
#else
  (void)device;
  (void)stream;
  throw Error(ErrorCode::NoDevice, "Context::cuda: qmm was built without CUDA (nvcc was not found at configure time)");
#endif
}

Context Context::cuda_with_new_stream(int device) {
  Context ctx = cuda(device);  // throws NoDevice where there is no CUDA
#ifdef QMM_WITH_CUDA
  ctx.impl_->stream = cuda::create_owned_stream(*ctx.impl_);
#endif
  return ctx;
}

int Context::cuda_device_count() {
#ifdef QMM_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

std::string Context::cuda_unavailable_reason() {
#ifdef QMM_WITH_CUDA
  return cuda::unavailable_reason();
#else
  return "qmm was built without CUDA";
#endif
}

Device Context::device() const { return impl_->device; }
void* Context::stream() const { return impl_->stream; }
std::string Context::device_name() const { return impl_->name; }

DeviceInfo Context::info() const {
#ifdef QMM_WITH_CUDA
  if (impl_->device.is_cuda()) return cuda::device_info(*this);
#endif
  DeviceInfo d;
  d.name = "cpu";
  return d;
}

std::vector<double> Context::time_calls(const std::function<void(int)>& fn, int warmup, int repeats) const {
  if (warmup < 0 || repeats < 1)
    throw Error(ErrorCode::InvalidArgument, "Context::time_calls: warmup must be >= 0 and repeats >= 1");
#ifdef QMM_WITH_CUDA
  if (impl_->device.is_cuda()) return cuda::time_calls(*this, fn, warmup, repeats);
#endif
  std::vector<double> ms;
  for (int i = 0; i < warmup + repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(i);
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return ms;
}

std::vector<double> Context::time_graph(const std::function<void(int)>& fn, int calls, int replays) const {
  if (calls < 1 || replays < 1)
    throw Error(ErrorCode::InvalidArgument, "Context::time_graph: calls and replays must be >= 1");
#ifdef QMM_WITH_CUDA
  if (impl_->device.is_cuda()) return cuda::time_graph(*this, fn, calls, replays);
#endif
  (void)fn;
  throw Error(ErrorCode::Unsupported, "Context::time_graph: CUDA graphs need a CUDA context");
}

void Context::synchronize() const {
#ifdef QMM_WITH_CUDA
  if (impl_->device.is_cuda()) cuda::synchronize(*this);
#endif
}

}  // namespace qmm
