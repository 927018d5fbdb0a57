// Links qmm::qmm and runs an NF4 GEMM and a dense GEMM on the CPU against sums computed here, and one bad call:
// what a trainer embedding qmm relies on (headers, library and link dependencies found through CMake alone).
#include <qmm/qmm.h>

#include <cmath>
#include <cstdio>

int main() {
  qmm::Context cpu = qmm::Context::cpu();
  const int m = 3, n = 5, k = 64;
  qmm::Tensor a(qmm::DType::F32, {m, k}), w(qmm::DType::F32, {n, k}), c(qmm::DType::F32, {m, n});
  for (int i = 0; i < m * k; ++i) a.data_as<float>()[i] = std::sin(0.37f * i);
  for (int i = 0; i < n * k; ++i) w.data_as<float>()[i] = std::cos(0.11f * i);

  qmm::gemm_bt(cpu, a, w, c);  // C = A W^T, f32, the CPU oracle's fp64 sums
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double sum = 0;
      for (int p = 0; p < k; ++p) sum += double(a.data_as<float>()[i * k + p]) * w.data_as<float>()[j * k + p];
      if (std::fabs(c.data_as<float>()[i * n + j] - sum) > 1e-5 * (1 + std::fabs(sum))) {
        std::printf("consumer: gemm_bt C[%d,%d] = %g, expected %g\n", i, j, c.data_as<float>()[i * n + j], sum);
        return 1;
      }
    }

  // NF4: the GEMM on the quantized weight against fp64 sums of its contract's operands (A and the dequantized
  // weight rounded to bf16).
  qmm::Nf4Tensor w4 = qmm::nf4_quantize(cpu, w, /*double_quant=*/true);
  qmm::Tensor wd(qmm::DType::F32, {n, k}), c4(qmm::DType::F32, {m, n});
  qmm::nf4_dequantize(cpu, w4, wd);
  qmm::nf4_gemm(cpu, a, w4, c4);
  auto bf16 = [](float x) { return double(qmm::bf16_to_float(qmm::float_to_bf16(x))); };
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double sum = 0;
      for (int p = 0; p < k; ++p) sum += bf16(a.data_as<float>()[i * k + p]) * bf16(wd.data_as<float>()[j * k + p]);
      if (std::fabs(c4.data_as<float>()[i * n + j] - sum) > 1e-5 * (1 + std::fabs(sum))) {
        std::printf("consumer: nf4_gemm C[%d,%d] = %g, expected %g\n", i, j, c4.data_as<float>()[i * n + j], sum);
        return 1;
      }
    }

  try {
    qmm::gemm_bt(cpu, a, a, c);  // C is [3,5], A Aᵀ is [3,3]
    std::printf("consumer: a shape mismatch was not reported\n");
    return 1;
  } catch (const qmm::Error& e) {
    if (e.code() != qmm::ErrorCode::ShapeMismatch) {
      std::printf("consumer: wrong error: %s\n", e.what());
      return 1;
    }
  }
#ifdef QMM_WITH_CUDA
  std::printf("consumer: ok (qmm with its CUDA backend)\n");
#else
  std::printf("consumer: ok (qmm for the CPU)\n");
#endif
  return 0;
}
