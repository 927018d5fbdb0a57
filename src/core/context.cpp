#include "qmm/context.h"

#include "core/context_impl.h"
#include "core/gpu_backend.h"
#include "core/validate.h"
#include "qmm/error.h"

namespace qmm {

const GpuBackend& require_gpu_backend(const char* op) {
  const GpuBackend* backend = gpu_backend();
  if (!backend)
    detail::fail(ErrorCode::NoDevice, op, "qmm was built without CUDA (nvcc was not found at configure time)");
  return *backend;
}

Context Context::cpu() {
  auto impl = std::make_shared<Impl>();
  impl->device = Device::cpu();
  impl->name = "cpu";
  return Context(std::move(impl));
}

Context Context::cuda(int device, void* stream) {
  const GpuBackend& gpu = require_gpu_backend("Context::cuda");
  auto impl = std::make_shared<Impl>();
  impl->device = Device::cuda(device);
  impl->stream = stream;
  gpu.init_context(*impl, device, stream);
  return Context(std::move(impl));
}

Context Context::cuda_with_new_stream(int device) {
  Context ctx = cuda(device);  // throws NoDevice where there is no CUDA
  ctx.impl_->stream = require_gpu_backend("Context::cuda_with_new_stream").create_owned_stream(*ctx.impl_);
  return ctx;
}

int Context::cuda_device_count() {
  const GpuBackend* gpu = gpu_backend();
  return gpu ? gpu->device_count() : 0;
}

std::string Context::cuda_unavailable_reason() {
  const GpuBackend* gpu = gpu_backend();
  return gpu ? gpu->unavailable_reason() : "qmm was built without CUDA";
}

Device Context::device() const { return impl_->device; }
void* Context::stream() const { return impl_->stream; }
std::string Context::device_name() const { return impl_->name; }

DeviceInfo Context::info() const {
  if (impl_->device.is_cuda()) return require_gpu_backend("Context::info").device_info(*this);
  DeviceInfo d;
  d.name = "cpu";
  return d;
}

void Context::synchronize() const {
  if (impl_->device.is_cuda()) require_gpu_backend("Context::synchronize").synchronize(*this);
}

MemoryStats Context::memory_stats() const {
  if (impl_->device.is_cuda()) return require_gpu_backend("Context::memory_stats").memory_stats(*this);
  return {};
}

void Context::reset_peak_memory_stats() const {
  if (impl_->device.is_cuda()) require_gpu_backend("Context::reset_peak_memory_stats").reset_peak_memory_stats(*this);
}

void Context::release_cached_memory() const {
  if (impl_->device.is_cuda()) require_gpu_backend("Context::release_cached_memory").release_cached_memory(*this);
}

}  // namespace qmm
