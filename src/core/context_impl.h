// Context::Impl: per-device state. A backend keeps its part (stream, handles) in `backend`; nothing here knows a
// backend's types.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "qmm/context.h"

namespace qmm {

// A backend's per-context state, released with the context (the CUDA backend's: src/cuda/common/cuda_state.h).
struct BackendState {
  virtual ~BackendState() = default;
};

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
  std::unique_ptr<BackendState> backend;
};

// The library's way into a Context's state (the public header keeps Impl opaque to programs).
struct ContextAccess {
  static Context::Impl& impl(const Context& ctx) { return *ctx.impl_; }
};

inline Context::Impl& impl_of(const Context& ctx) { return ContextAccess::impl(ctx); }

}  // namespace qmm
