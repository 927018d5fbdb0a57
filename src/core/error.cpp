#include "qmm/error.h"

#include "core/validate.h"

namespace qmm {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidArgument: return "InvalidArgument";
    case ErrorCode::ShapeMismatch: return "ShapeMismatch";
    case ErrorCode::DTypeMismatch: return "DTypeMismatch";
    case ErrorCode::DeviceMismatch: return "DeviceMismatch";
    case ErrorCode::Unsupported: return "Unsupported";
    case ErrorCode::NoDevice: return "NoDevice";
    case ErrorCode::Cuda: return "Cuda";
    case ErrorCode::Cublas: return "Cublas";
    case ErrorCode::Io: return "Io";
    case ErrorCode::Distributed: return "Distributed";
    case ErrorCode::Internal: return "Internal";
  }
  return "Unknown";
}

namespace detail {
void fail(ErrorCode code, const char* op, const std::string& message) {
  throw Error(code, std::string(op) + ": " + message);
}
}  // namespace detail

}  // namespace qmm
