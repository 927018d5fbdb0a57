// Device code of the dense GEMM family's own kernels (cuBLASLt does the products):
//  - the BF16-compute conversion pass: f32 operands truncated to bf16 (low 16 bits cleared), the contract of
//    MathMode::BF16, bit-identical to qmm::float_to_bf16_trunc (NaN payloads included);
//  - C = beta * C for K == 0, which cuBLASLt does not take.
#pragma once

#include <cstdint>

namespace qmm::cuda {

// Elements per chunk: two 16-byte loads of f32 in, one 16-byte store of bf16 out.
constexpr int kTruncChunk = 8;
constexpr int kTruncThreads = 256;

// One contiguous f32 span to truncate into bf16. dst is 16-byte aligned (scratch offsets are 256-aligned);
// src may have any alignment (vector loads only when src_aligned16).
struct TruncSegment {
  const float* src;
  std::uint16_t* dst;
  std::int64_t n;
  bool src_aligned16;
};

// The high halves of two f32 words packed little-endian: element 0 in the low 16 bits.
__device__ __forceinline__ std::uint32_t pack_trunc2(std::uint32_t lo, std::uint32_t hi) {
  return __byte_perm(lo, hi, 0x7632);
}

__device__ __forceinline__ void trunc_chunk(const TruncSegment& s, std::int64_t chunk) {
  const std::int64_t base = chunk * kTruncChunk;
  if (base + kTruncChunk <= s.n) {
    std::uint32_t u[kTruncChunk];
    if (s.src_aligned16) {
      const float4* src4 = reinterpret_cast<const float4*>(s.src + base);
      const float4 v0 = __ldg(src4);
      const float4 v1 = __ldg(src4 + 1);
      u[0] = __float_as_uint(v0.x); u[1] = __float_as_uint(v0.y);
      u[2] = __float_as_uint(v0.z); u[3] = __float_as_uint(v0.w);
      u[4] = __float_as_uint(v1.x); u[5] = __float_as_uint(v1.y);
      u[6] = __float_as_uint(v1.z); u[7] = __float_as_uint(v1.w);
    } else {
#pragma unroll
      for (int i = 0; i < kTruncChunk; ++i) u[i] = __float_as_uint(__ldg(s.src + base + i));
    }
    uint4 out;
    out.x = pack_trunc2(u[0], u[1]);
    out.y = pack_trunc2(u[2], u[3]);
    out.z = pack_trunc2(u[4], u[5]);
    out.w = pack_trunc2(u[6], u[7]);
    *reinterpret_cast<uint4*>(s.dst + base) = out;
  } else {
    // The ragged tail of a span: fewer than kTruncChunk elements, one at a time.
    for (std::int64_t i = base; i < s.n; ++i)
      s.dst[i] = static_cast<std::uint16_t>(__float_as_uint(__ldg(s.src + i)) >> 16);
  }
}

// Truncates both operands in one launch: chunks [0, chunks_a) belong to `a`, the rest to `b`. Grid-stride, so any
// grid size covers any length. Static: a second file including this header gets its own copy, not a clash.
static __global__ void __launch_bounds__(kTruncThreads) truncate_bf16_kernel(TruncSegment a, TruncSegment b,
                                                                      std::int64_t chunks_a,
                                                                      std::int64_t chunks_total) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks_total;
       c += stride) {
    if (c < chunks_a) trunc_chunk(a, c);
    else trunc_chunk(b, c - chunks_a);
  }
}

// K == 0: the product is empty, so C = beta * C (beta == 0 writes zeros without reading C). Element e of batch
// entry bi lives at bi * stride_c + e.
template <class T>
__device__ __forceinline__ float load_c(const T* p);
template <>
__device__ __forceinline__ float load_c<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load_c<std::uint16_t>(const std::uint16_t* p) {
  return __uint_as_float(static_cast<std::uint32_t>(*p) << 16);
}

__device__ __forceinline__ void store_c(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_c(std::uint16_t* p, float v) {
  // Round to nearest even, NaN kept quiet: the same rule as qmm::float_to_bf16.
  const std::uint32_t u = __float_as_uint(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    *p = static_cast<std::uint16_t>((u >> 16) | 0x40);
    return;
  }
  *p = static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <class T>
__global__ void scale_c_kernel(const T* c_in, T* c, std::int64_t per_batch, std::int64_t stride_c, std::int64_t total,
                               float beta) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t at = (i / per_batch) * stride_c + (i % per_batch);
    store_c(c + at, beta == 0.0f ? 0.0f : beta * load_c(c_in + at));
  }
}

}  // namespace qmm::cuda
