// Context::Impl: per-device state. Backends reach their part through it; nothing here includes CUDA headers.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "qmm/context.h"

namespace qmm {

namespace cuda {
struct CudaState;  // defined in src/cuda/common/cuda_state.h
void destroy_state(CudaState* state);
}  // namespace cuda

// A thread-safe map from a plan key ("op|dtypes|shape|layout") to whatever the backend chose for it
// (a cuBLASLt algorithm, a kernel variant). Values are created once, by the first caller, under the lock.
class PlanCache {
 public:
  template <class T>
  std::shared_ptr<T> get_or_create(const std::string& key, const std::function<std::shared_ptr<T>()>& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return std::static_pointer_cast<T>(it->second);
    std::shared_ptr<T> plan = make();
    plans_.emplace(key, plan);
    return plan;
  }
  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return plans_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<void>> plans_;
};

struct Context::Impl {
  Device device;
  void* stream = nullptr;
  std::string name;
  PlanCache plans;
  std::unique_ptr<cuda::CudaState, void (*)(cuda::CudaState*)> cuda{nullptr, cuda::destroy_state};
};

// The library's way into a Context's state (the public header keeps Impl opaque to programs).
struct ContextAccess {
  static Context::Impl& impl(const Context& ctx) { return *ctx.impl_; }
};

inline Context::Impl& impl_of(const Context& ctx) { return ContextAccess::impl(ctx); }

}  // namespace qmm
