// Element access to f32 and bf16 storage for element-wise kernels: scalar, and as one 16-byte vector of kVec
// elements converted to and from fp32 (bf16 rounded to nearest even on store).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace qmm::cuda::common {

// Element access for one storage type, scalar and as one 16-byte vector of kVec elements.
template <class T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ __forceinline__ static float load(const float* p, std::int64_t i) { return p[i]; }
  __device__ __forceinline__ static void store(float* p, std::int64_t i, float v) { p[i] = v; }
  __device__ __forceinline__ static void load_vec(const float* p, std::int64_t v, float (&x)[kVec]) {
    const float4 q = reinterpret_cast<const float4*>(p)[v];
    x[0] = q.x;
    x[1] = q.y;
    x[2] = q.z;
    x[3] = q.w;
  }
  __device__ __forceinline__ static void store_vec(float* p, std::int64_t v, const float (&x)[kVec]) {
    reinterpret_cast<float4*>(p)[v] = make_float4(x[0], x[1], x[2], x[3]);
  }
  // fp32 values as the 16-byte vector store_vec writes.
  __device__ __forceinline__ static uint4 pack(const float (&x)[kVec]) {
    return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
  }
  // A 16-byte vector already loaded (as 4 words), as fp32 values.
  __device__ __forceinline__ static void unpack(const uint4& q, float (&x)[kVec]) {
    x[0] = __uint_as_float(q.x);
    x[1] = __uint_as_float(q.y);
    x[2] = __uint_as_float(q.z);
    x[3] = __uint_as_float(q.w);
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static float load(const __nv_bfloat16* p, std::int64_t i) {
    return __bfloat162float(p[i]);
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, std::int64_t i, float v) {
    p[i] = __float2bfloat16_rn(v);
  }
  __device__ __forceinline__ static void load_vec(const __nv_bfloat16* p, std::int64_t v, float (&x)[kVec]) {
    unpack(reinterpret_cast<const uint4*>(p)[v], x);
  }
  // A 16-byte vector already loaded (as 4 words), as fp32 values.
  __device__ __forceinline__ static void unpack(const uint4& q, float (&x)[kVec]) {
    const std::uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // The low half of each 32-bit word is the element with the lower index.
      x[2 * j] = __uint_as_float(w[j] << 16);
      x[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  }
  __device__ __forceinline__ static void store_vec(__nv_bfloat16* p, std::int64_t v, const float (&x)[kVec]) {
    reinterpret_cast<uint4*>(p)[v] = pack(x);
  }
  // fp32 values rounded to the 16-byte vector store_vec writes.
  __device__ __forceinline__ static uint4 pack(const float (&x)[kVec]) {
    std::uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);  // .x = low half = lower index
      w[j] = *reinterpret_cast<const std::uint32_t*>(&b);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

}  // namespace qmm::cuda::common
