// Argument checks shared by the layers in src/nn/. Each throws qmm::Error "Layer::method: argument ...".
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "core/validate.h"
#include "qmm/context.h"
#include "qmm/tensor.h"

namespace qmm::nn_detail {

inline std::string dims(std::int64_t rows, std::int64_t cols) {
  std::string s = rows < 0 ? std::string("M") : std::to_string(rows);  // built in steps: GCC 12 warns on "[" + ...
  s.insert(0, 1, '[');
  s += ',';
  s += std::to_string(cols);
  s += ']';
  return s;
}

// An activation matrix [rows, cols] (rows < 0: any number of rows) of `dtype` on the context's device.
inline void require_activation(const Context& ctx, const char* op, const char* name, const TensorView& t,
                               DType dtype, std::int64_t rows, std::int64_t cols) {
  detail::require_tensor(ctx, op, name, t);
  detail::require_rank(op, name, t, 2);
  detail::require_dtype(op, name, t, {dtype});
  QMM_REQUIRE((rows < 0 || t.dim(0) == rows) && t.dim(1) == cols, ErrorCode::ShapeMismatch, op,
              std::string(name) + " is " + t.shape().str() + " but must be " + dims(rows, cols));
}

inline void require_finite_beta(const char* op, float beta) {
  QMM_REQUIRE(std::isfinite(beta), ErrorCode::InvalidArgument, op,
              "dx_beta is " + std::to_string(beta) + " but must be finite");
}

}  // namespace qmm::nn_detail
