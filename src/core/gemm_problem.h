// One descriptor for every dense GEMM variant: strided-batched, row-major,
//   C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b],  op(A) [m,k], op(B) [k,n], C [m,n].
// A is stored [m,k], or [k,m] when trans_a; B is stored [k,n], or [n,k] when trans_b. The public ops map
// onto it in src/core/gemm_ops.cpp; backends implement it once.
#pragma once

#include <cstdint>
#include <string>

#include "qmm/ops.h"

namespace qmm {

struct GemmProblem {
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  DType ab_dtype = DType::F32;  // A and B
  DType c_dtype = DType::F32;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements between consecutive batches
  float alpha = 1.0f, beta = 0.0f;
  MathMode math = MathMode::FP32;

  std::int64_t lda() const { return trans_a ? m : k; }  // row-major leading dimensions
  std::int64_t ldb() const { return trans_b ? k : n; }
  std::int64_t ldc() const { return n; }
  std::string key() const;  // everything that selects a plan, without pointers or scalars
};

}  // namespace qmm
