#include "qmm/context.h"

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

void Context::synchronize() const {
#ifdef QMM_WITH_CUDA
  if (impl_->device.is_cuda()) cuda::synchronize(*this);
#endif
}

}  // namespace qmm
