// Shared test helpers: seeded random inputs, NaN poisoning, tolerance comparison, GPU skipping.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <string>
#include <vector>

#include "qmm/qmm.h"

namespace qmm::test {

// Tolerances, per element |got - ref| <= atol + rtol * |ref|, and ||got - ref||_F / ||ref||_F <= rel_fro.
// NaN or Inf in `got` where `ref` is finite never passes.
struct Tolerance {
  double atol;
  double rtol;
  double rel_fro;
};

// The reasons for these values:
//  - exact: both sides compute the same rounded operands; only the summation order differs (fp32 accumulate vs
//    the oracle's fp64), so errors are a few fp32 ulps of the running sum, scaled by sqrt(K).
//  - fp32 storage in bf16 output: one bf16 rounding of the result (2^-8 relative) dominates.
Tolerance fp32_accum_tolerance(std::int64_t k);  // fp32 accumulation of exact products over K terms, fp32 output
Tolerance bf16_output_tolerance(std::int64_t k); // the same with a bf16 output rounding on top
Tolerance tf32_tolerance(std::int64_t k);        // the GPU's own TF32 rounding against the oracle's

std::string data_dir();  // tests/data

// A float's bits and back: the tests restate rounding contracts bit by bit.
inline std::uint32_t bits_of(float x) { return std::bit_cast<std::uint32_t>(x); }
inline float float_of(std::uint32_t bits) { return std::bit_cast<float>(bits); }

// A host tensor of `dtype` filled with uniform values in [lo, hi) from `seed` (rounded to the dtype).
Tensor random_tensor(DType dtype, Shape shape, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f);
// A host tensor of small integers in [-range, range] (exact in every dtype, exact sums).
Tensor random_int_tensor(DType dtype, Shape shape, std::uint64_t seed, int range = 4);
// Fills a tensor (host or device) with NaN (or 0xFF bytes for u8) so an unwritten element fails the comparison.
void poison(const TensorView& t);
// A host copy of any tensor, as doubles.
std::vector<double> to_doubles(const TensorView& t);
// A host tensor of the same dtype and shape holding a copy.
Tensor host_copy(const TensorView& t);
Tensor filled(DType dtype, Shape shape, float value);
// Sets element i of a host tensor to v, rounded to its dtype (NaN and infinities included).
void set_value(const TensorView& t, std::int64_t i, double v);
double get_value(const TensorView& t, std::int64_t i);  // element i of a host tensor, as a double

// Compares got against ref element by element; reports the first failures and the norms.
::testing::AssertionResult all_close(const TensorView& got, const TensorView& ref, Tolerance tol);
// The NF4 forward's scale-after contract (nf4_gemm in ops.h; the small-M path with bf16 A): alpha * the sum over
// each row's NF4 blocks of scale * sum(bf16(a) * bf16(code value)) + beta * c0, in fp64, as a host tensor of
// c0's dtype and shape. w is host memory.
Tensor nf4_scale_after_reference(const TensorView& a, const Nf4Weight& w, const TensorView& c0, float alpha,
                                 float beta);
// alpha * sums + beta * c0 (host tensors, computed in fp64), as a host tensor of c0's dtype and shape: an output's
// expectation for any alpha and beta from one reference sum.
Tensor scaled_output(const TensorView& sums, const TensorView& c0, float alpha, float beta);
// Whether `got` matches one of the NF4 forward's two contracts to `tol`: `exact` (the dequantized weight's, the
// CPU oracle) or `scale_after` (above).
::testing::AssertionResult nf4_forward_close(const TensorView& got, const TensorView& exact,
                                             const TensorView& scale_after, Tolerance tol);
// Same bytes, element for element (for outputs that must not change, and for byte-identity).
::testing::AssertionResult bytes_equal(const TensorView& got, const TensorView& ref);

// Runs `fn` and checks that it throws qmm::Error with `code` and a message containing every `needle`.
template <class Fn>
::testing::AssertionResult throws_error(Fn&& fn, ErrorCode code, std::initializer_list<std::string> needles) {
  try {
    fn();
  } catch (const Error& e) {
    if (e.code() != code)
      return ::testing::AssertionFailure() << "code " << error_code_name(e.code()) << " instead of "
                                           << error_code_name(code) << ": " << e.what();
    for (const auto& n : needles)
      if (std::string(e.what()).find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << e.what() << "\" lacks \"" << n << "\"";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-qmm exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// The CUDA context for GPU tests, or nullptr (with the reason) where there is none.
Context* gpu_context();
std::string gpu_skip_reason();

}  // namespace qmm::test

// In a GPU test: skip (reported as skipped, not passed) when there is no usable GPU.
#define QMM_REQUIRE_GPU()                                                        \
  do {                                                                           \
    if (::qmm::test::gpu_context() == nullptr) GTEST_SKIP() << ::qmm::test::gpu_skip_reason(); \
  } while (0)
