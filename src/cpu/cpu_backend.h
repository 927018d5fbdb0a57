// The CPU reference backend: the oracle for every test. Arguments arrive validated.
// Accumulates in fp64; inputs are rounded exactly as the op's contract says before they are multiplied.
#pragma once

#include "core/gemm_problem.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"

namespace qmm::cpu {

void gemm(const GemmProblem& p);
void swiglu(const TensorView& gate, const TensorView& up, const TensorView& h);
void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dh, const TensorView& dgate,
                     const TensorView& dup);
void nf4_quantize(const TensorView& w, Nf4Weight& out);
void nf4_dequantize(const Nf4Weight& w, const TensorView& out);
void nf4_gemm(const TensorView& a, const Nf4Weight& w, const TensorView& c, float alpha, float beta);
void nf4_gemm_backward_a(const TensorView& dc, const Nf4Weight& w, const TensorView& da, float alpha, float beta);

}  // namespace qmm::cpu
