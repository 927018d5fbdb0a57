#include "core/validate.h"

#include <cstdint>

namespace qmm::detail {

void require_tensor(const Context& ctx, const char* op, const char* name, const TensorView& t) {
  require_tensor(ctx.device(), op, name, t);
}

void require_tensor(Device device, const char* op, const char* name, const TensorView& t) {
  QMM_REQUIRE(t.data() != nullptr || t.numel() == 0, ErrorCode::InvalidArgument, op,
              std::string(name) + " has null data");
  QMM_REQUIRE(t.device() == device, ErrorCode::DeviceMismatch, op,
              std::string(name) + " is on " + t.device().str() + " but the context runs on " + device.str());
}

void require_rank(const char* op, const char* name, const TensorView& t, int rank) {
  QMM_REQUIRE(t.rank() == rank, ErrorCode::ShapeMismatch, op,
              std::string(name) + " must have rank " + std::to_string(rank) + " but is " + t.shape().str());
}

void require_dtype(const char* op, const char* name, const TensorView& t, std::initializer_list<DType> allowed) {
  std::string list;
  for (DType d : allowed) {
    if (d == t.dtype()) return;
    list += (list.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  fail(ErrorCode::DTypeMismatch, op, std::string(name) + " is " + dtype_name(t.dtype()) + " but must be " + list);
}

void require_same_dtype(const char* op, const char* name_a, const TensorView& a, const char* name_b,
                        const TensorView& b) {
  QMM_REQUIRE(a.dtype() == b.dtype(), ErrorCode::DTypeMismatch, op,
              std::string(name_a) + " is " + dtype_name(a.dtype()) + " but " + name_b + " is " + dtype_name(b.dtype()));
}

void require_same_shape(const char* op, const char* name_a, const TensorView& a, const char* name_b,
                        const TensorView& b) {
  QMM_REQUIRE(a.shape() == b.shape(), ErrorCode::ShapeMismatch, op,
              std::string(name_a) + " is " + a.shape().str() + " but " + name_b + " is " + b.shape().str());
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.data() || !b.data() || !(a.device() == b.device())) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.data());
  const auto b0 = reinterpret_cast<std::uintptr_t>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void require_no_overlap(const char* op, const char* name_a, const TensorView& a, const char* name_b,
                        const TensorView& b) {
  QMM_REQUIRE(!overlaps(a, b), ErrorCode::InvalidArgument, op,
              std::string(name_a) + " and " + name_b + " overlap in memory");
}

}  // namespace qmm::detail
