// CUDA and cuBLASLt status checks: every call goes through one of these, turning failures into qmm::Error.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "qmm/error.h"

namespace qmm::cuda {

[[noreturn]] void throw_cuda(cudaError_t err, const char* what, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t st, const char* what, const char* file, int line);

}  // namespace qmm::cuda

#define QMM_CUDA_CHECK(expr)                                                        \
  do {                                                                              \
    cudaError_t qmm_err_ = (expr);                                                  \
    if (qmm_err_ != cudaSuccess) ::qmm::cuda::throw_cuda(qmm_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define QMM_CUBLAS_CHECK(expr)                                                      \
  do {                                                                              \
    cublasStatus_t qmm_st_ = (expr);                                                \
    if (qmm_st_ != CUBLAS_STATUS_SUCCESS) ::qmm::cuda::throw_cublas(qmm_st_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: a bad configuration shows up here, not later at an unrelated call. cudaGetLastError
// (not Peek) clears a launch error, so the next, unrelated launch does not report it again.
#define QMM_CUDA_CHECK_LAUNCH(name) QMM_CUDA_CHECK(cudaGetLastError())
