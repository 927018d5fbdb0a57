// Scalar rules of the train ops that the CPU reference and the CUDA kernels must share bit for bit: the dropout
// mask (a counter-based hash of seed and flat index), the dropout scale, the gradient-clipping coefficient and
// the MSE gradient coefficient. Host and device compile this same code, so every backend draws the same mask.
#pragma once

#include <cstdint>

#ifndef QMM_HOST_DEVICE
#if defined(__CUDACC__)
#define QMM_HOST_DEVICE __host__ __device__
#else
#define QMM_HOST_DEVICE
#endif
#endif

namespace qmm::train {

// A 64-bit finalizer (xor-shift / multiply rounds with the constants of SplitMix64's output function): every
// input bit affects every output bit. Applied to a Weyl sequence it is SplitMix64.
QMM_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The per-call key: the seed scrambled once, so nearby seeds (seed, seed + 1, ...) give unrelated masks.
QMM_HOST_DEVICE inline std::uint64_t dropout_key(std::uint64_t seed) { return mix64(seed ^ 0x6A09E667F3BCC909ull); }

// 64 random bits for the pair of elements 2*pair (low 32 bits) and 2*pair + 1 (high 32 bits): one hash serves two
// elements. `pair` walks a Weyl sequence with the golden-ratio increment.
QMM_HOST_DEVICE inline std::uint64_t dropout_pair_bits(std::uint64_t key, std::uint64_t pair) {
  return mix64(key + (pair + 1) * 0x9E3779B97F4A7C15ull);
}

// An element is dropped when its 32 random bits fall below p * 2^32 (exact: a power-of-two scaling; p < 1 keeps
// the threshold below 2^32). p = 0 keeps everything.
QMM_HOST_DEVICE inline std::uint32_t dropout_threshold(float p) {
  return static_cast<std::uint32_t>(p * 4294967296.0f);
}

QMM_HOST_DEVICE inline bool dropout_keep_bits(std::uint64_t pair_bits, std::int64_t index, std::uint32_t threshold) {
  const std::uint32_t u =
      (index & 1) ? static_cast<std::uint32_t>(pair_bits >> 32) : static_cast<std::uint32_t>(pair_bits & 0xFFFFFFFFull);
  return u >= threshold;
}

QMM_HOST_DEVICE inline bool dropout_keep_at(std::uint64_t key, std::int64_t index, std::uint32_t threshold) {
  return dropout_keep_bits(dropout_pair_bits(key, static_cast<std::uint64_t>(index) >> 1), index, threshold);
}

// Kept elements are multiplied by this fp32 value (as PyTorch does), so a kept element is x * scale rounded once.
QMM_HOST_DEVICE inline float dropout_scale(float p) { return 1.0f / (1.0f - p); }

// Gradient clipping: min(1, max_norm / (norm + 1e-6)) in fp32 from the fp32 norm. A NaN norm gives 1 (no scaling;
// the NaN gradients then show in the parameters), an infinite one gives 0.
QMM_HOST_DEVICE inline float clip_coefficient(float norm, float max_norm) {
  const float c = max_norm / (norm + 1e-6f);
  return c < 1.0f ? c : 1.0f;
}

// dy = coef * (y - target), coef = scale * 2 / numel, in double.
inline double mse_grad_coef(float scale, std::int64_t numel) {
  return static_cast<double>(scale) * 2.0 / static_cast<double>(numel);
}

}  // namespace qmm::train
