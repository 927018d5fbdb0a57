// qmm::Error: the one exception type of the public API.
#pragma once

#include <stdexcept>
#include <string>

namespace qmm {

enum class ErrorCode {
  InvalidArgument,  // a value out of range, a null pointer, a bad option
  ShapeMismatch,    // tensor shapes that do not fit together
  DTypeMismatch,    // a dtype the op does not take, or dtypes that differ where they must agree
  DeviceMismatch,   // tensors on different devices, or not on the context's device
  Unsupported,      // valid request that this build or backend cannot serve
  NoDevice,         // no GPU, no driver, or a build without CUDA
  Cuda,             // a CUDA runtime call failed
  Cublas,           // a cuBLASLt call failed
  Io,               // file missing, unreadable or malformed
  Distributed,      // a rank of a multi-process job failed, or a collective (NCCL) failed
  Internal,         // a bug in qmm
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace qmm
