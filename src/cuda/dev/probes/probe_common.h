// What the CUDA probes beside this file share: a CUDA error check and random bf16 device matrices.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <stdexcept>

#include "qmm/qmm.h"

namespace probe {

inline void check(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}

// A [rows, cols] bf16 matrix on ctx's device, uniform in [-1, 1) from seed.
inline qmm::Tensor random_bf16(const qmm::Context& ctx, std::int64_t rows, std::int64_t cols, unsigned seed) {
  qmm::Tensor host(qmm::DType::BF16, {rows, cols});
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  auto* p = host.data_as<std::uint16_t>();
  for (std::int64_t i = 0; i < rows * cols; ++i) p[i] = qmm::float_to_bf16(d(g));
  qmm::Tensor t(qmm::DType::BF16, {rows, cols}, ctx.device());
  qmm::copy(t, host);
  return t;
}

}  // namespace probe
