// One descriptor for every dense GEMM variant: strided-batched, row-major,
//   C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b] (+ bias),  op(A) [m,k], op(B) [k,n], C [m,n].
// A is stored [m,k], or [k,m] when trans_a; B is stored [k,n], or [n,k] when trans_b. The public ops map
// onto it in src/core/gemm_ops.cpp; backends implement it once.
#pragma once

#include <cstdint>
#include <span>
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
  // Row pitches (elements between consecutive stored rows) where a matrix is a block of columns of a wider one
  // (the library's grouped LoRA ops); 0: dense. Only bf16 operands without conversion take them, batch 1.
  std::int64_t pitch_a = 0, pitch_b = 0, pitch_c = 0;
  float alpha = 1.0f, beta = 0.0f;
  MathMode math = MathMode::FP32;
  // bias [n] in c_dtype, added to every row of C before C's one rounding (a linear layer's bias); batch 1, and on a
  // GPU k > 0 without conversion (cuBLASLt's bias epilogue).
  const void* bias = nullptr;
  // beta's operand where it is not C itself (GemmOptions::addend): C's layout, read before C is written.
  const void* c_in = nullptr;

  std::int64_t lda() const { return pitch_a ? pitch_a : trans_a ? m : k; }  // row-major leading dimensions
  std::int64_t ldb() const { return pitch_b ? pitch_b : trans_b ? k : n; }
  std::int64_t ldc() const { return pitch_c ? pitch_c : n; }
  bool dense() const { return pitch_a == 0 && pitch_b == 0 && pitch_c == 0; }
  std::string key() const;  // everything that selects a plan, without pointers or scalars
};

// One adapter's lora_backward_dy (ops.h) as the GPU backend takes it, validated: t's and dt's rows lie ld_t and
// ld_dt elements apart (column blocks of wider matrices; r where dense).
struct LoraDyProblem {
  TensorView dy, b, t;
  std::int64_t ld_t = 0;
  TensorView dt;
  std::int64_t ld_dt = 0;
  TensorView grad_b;
  float scale = 1.0f, beta = 1.0f;
};

namespace detail {

// p on the context's device (CPU reference or GPU backend), arguments already validated.
void run_gemm(const Context& ctx, const char* op, const GemmProblem& p);
// lora_backward_dy (ops.h) after validation, for t and dt whose rows lie ld_t and ld_dt elements apart (column
// blocks of wider matrices; r where dense).
void lora_backward_dy_pitched(const Context& ctx, const char* op, const TensorView& dy, const TensorView& b,
                              const TensorView& t, std::int64_t ld_t, const TensorView& dt, std::int64_t ld_dt,
                              const TensorView& grad_b, float scale, MathMode math, float beta);

// lora_adapters and its backward (ops.h) after validation (`op` names the caller in errors). The backward's M = 0
// writes zeros into grad_a and every grad_b (empty sums).
void lora_adapters_unchecked(const Context& ctx, const char* op, const TensorView& x, std::span<const LoraTerm> terms,
                             const TensorView& a, const TensorView& t);
void lora_adapters_backward_unchecked(const Context& ctx, const char* op, const TensorView& x,
                                      std::span<const LoraTermGrad> terms, const TensorView& a, const TensorView& t,
                                      const TensorView& dt, const TensorView& grad_a, const TensorView& dx,
                                      float dx_beta);

}  // namespace detail

}  // namespace qmm
