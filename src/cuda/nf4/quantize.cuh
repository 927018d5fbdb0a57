// Device code of NF4 quantize and dequantize (bitsandbytes-compatible; docs/FORMAT.md). The arithmetic matches the
// CPU backend (src/cpu/nf4.cpp) operation for operation, so results are byte-identical: every multiply and add
// that the CPU rounds separately is written with __fmul_rn / __fadd_rn here, which forbids nvcc's FMA contraction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/nf4_lut.h"  // scaled_word
#include "qmm/nf4.h"

namespace qmm::cuda::nf4_detail {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kQuantChunk = 8;     // elements per thread per step of quantize: 4 code bytes
constexpr int kDequantChunk = 8;  // elements per thread per step of dequantize: one 4-byte code load
constexpr int kCode2Size = kNf4Code2Size;

// ---- input element access -------------------------------------------------------------------------------------

template <class T>
struct In;

template <>
struct In<float> {
  __device__ __forceinline__ static float load(const float* p, std::int64_t i) { return p[i]; }
  // 8 elements from p (16-byte aligned).
  __device__ __forceinline__ static void load8(const float* p, float (&x)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  }
};

// 16-bit inputs: one 16-byte load of 8 elements; the low half of each 32-bit word has the lower index.
template <>
struct In<__nv_bfloat16> {
  __device__ __forceinline__ static float load(const __nv_bfloat16* p, std::int64_t i) {
    return __bfloat162float(p[i]);
  }
  __device__ __forceinline__ static void load8(const __nv_bfloat16* p, float (&x)[8]) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const std::uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = __uint_as_float(w[j] << 16);
      x[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  }
};

template <>
struct In<__half> {
  __device__ __forceinline__ static float load(const __half* p, std::int64_t i) { return __half2float(p[i]); }
  __device__ __forceinline__ static void load8(const __half* p, float (&x)[8]) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const std::uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[j]);
      const float2 f = __half22float2(h);  // .x = low half = lower index; exact
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  }
};

// Loads the 8 elements [e0, e0 + 8) (those below n; zeros beyond, which leave a block's absmax unchanged).
template <class T>
__device__ __forceinline__ void load_chunk(const T* w, std::int64_t e0, std::int64_t n, bool vec, float (&x)[8]) {
  if (vec && e0 + kQuantChunk <= n) {
    In<T>::load8(w + e0, x);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = (e0 + j < n) ? In<T>::load(w, e0 + j) : 0.0f;
  }
}

// ---- quantize -------------------------------------------------------------------------------------------------

// The code of one element: x * (1/absmax) to the nearest NF4 value, exactly as the CPU (and bitsandbytes) does.
// An all-zero block has inv = inf, 0 * inf = NaN, and NaN maps to code 0.
// `mid` is nf4_threshold(0..14) in shared memory plus a +inf sentinel: a four-step binary search counts the
// thresholds strictly below the value, the same number nf4_nearest_code counts in fifteen steps.
__device__ __forceinline__ std::uint32_t code_of(float x, float inv, const float* mid) {
  const float v = __fmul_rn(x, inv);
  int c = 0;
  c += (v > mid[c + 7]) ? 8 : 0;
  c += (v > mid[c + 3]) ? 4 : 0;
  c += (v > mid[c + 1]) ? 2 : 0;
  c += (v > mid[c]) ? 1 : 0;
  return static_cast<std::uint32_t>(c);
}

// Each block of `block_size` elements is handled by `lanes` (= min(32, block_size / 8)) lanes of one warp; lane l of
// the group takes chunks l, l + lanes, ... (`chunks` of them). kOneChunk (block_size <= 256): each lane has one chunk
// and keeps it in registers between the absmax pass and the code pass; otherwise the code pass reloads (from L1).
// Writes the fp32 absmax of every block to `absmax` and the packed codes.
template <class T, bool kOneChunk>
__global__ void __launch_bounds__(kThreads) nf4_quantize_kernel(const T* __restrict__ w, std::int64_t n,
                                                                int block_size, int lanes, int chunks, bool vec,
                                                                std::uint8_t* __restrict__ codes,
                                                                float* __restrict__ absmax, std::int64_t nblocks) {
  __shared__ float mid[16];
  if (threadIdx.x < 16) mid[threadIdx.x] = threadIdx.x < 15 ? nf4_threshold(static_cast<int>(threadIdx.x)) : INFINITY;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int group = lane / lanes, gl = lane % lanes;
  const int blocks_per_warp = 32 / lanes;
  const std::int64_t tasks = (nblocks + blocks_per_warp - 1) / blocks_per_warp;
  const std::int64_t warp0 = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  const std::int64_t code_bytes = (n + 1) / 2;
  const bool vec_codes = vec;  // codes 4-byte aligned is part of `vec`

  // The loop bound is the same for all lanes of a warp, so every shuffle below has all 32 lanes present.
  for (std::int64_t task = warp0; task < tasks; task += warps) {
    const std::int64_t b = task * blocks_per_warp + group;
    const bool live = b < nblocks;
    const std::int64_t base = b * block_size;  // first element of this block

    float x[8];
    float m = 0.0f;
    if (kOneChunk) {
      if (live) load_chunk(w, base + static_cast<std::int64_t>(gl) * kQuantChunk, n, vec, x);
      else
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(x[j]));
    } else if (live) {
      for (int c = 0; c < chunks; ++c) {
        load_chunk(w, base + static_cast<std::int64_t>(gl + c * lanes) * kQuantChunk, n, vec, x);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(x[j]));
      }
    }
    for (int o = lanes >> 1; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (!live) continue;  // no shuffles follow
    if (gl == 0) absmax[b] = m;
    const float inv = __fdiv_rn(1.0f, m);

    for (int c = 0; c < chunks; ++c) {
      const std::int64_t e0 = base + static_cast<std::int64_t>(gl + c * lanes) * kQuantChunk;
      if (e0 >= n) break;  // chunks only grow
      if (!kOneChunk) load_chunk(w, e0, n, vec, x);
      if (vec_codes && e0 + kQuantChunk <= n) {
        std::uint32_t word = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::uint32_t byte = (code_of(x[2 * j], inv, mid) << 4) | code_of(x[2 * j + 1], inv, mid);
          word |= byte << (8 * j);  // little-endian: byte j of the word is code byte e0/2 + j
        }
        *reinterpret_cast<std::uint32_t*>(codes + (e0 >> 1)) = word;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::int64_t e = e0 + 2 * j;
          if ((e >> 1) < code_bytes) {
            const std::uint32_t hi = code_of(x[2 * j], inv, mid);
            const std::uint32_t lo = (e + 1 < n) ? code_of(x[2 * j + 1], inv, mid) : kNf4ZeroCode;
            codes[e >> 1] = static_cast<std::uint8_t>((hi << 4) | lo);
          }
        }
      }
    }
  }
}

// Index of the code2 value nearest to x, as the CPU's nf4_nearest_code2 (src/cpu/nf4.cpp): the number of fp32
// midpoints (code2[j] + code2[j+1]) * 0.5 strictly below x, so a value exactly on a midpoint takes the lower
// index and NaN (below nothing) gives 0. `mid` holds the 255 midpoints, ascending.
__device__ __forceinline__ int nearest_code2(const float* __restrict__ mid, float x) {
  int lo = 0, hi = kCode2Size - 1;  // the first midpoint index not below x, in [0, 255]
  while (lo < hi) {
    const int m = (lo + hi) >> 1;
    if (x > mid[m]) lo = m + 1;
    else hi = m;
  }
  return lo;
}

// Double quantization of the fp32 absmax values, one thread block per group of 256 blocks (one thread per block).
// absmax2[g] = max |absmax - offset| over the group; q = nearest code2 index of (absmax - offset) * (1/absmax2).
// The double-quantization offset, summed in exactly cpu::nf4_absmax_mean's order so both backends agree bit for
// bit: one thread sums each chunk in double, then one thread sums the chunk sums and forms sum * (1/n) in fp32.
// The sums must be the CPU's, bit for bit: each chunk summed from its first value to its last in double. A warp
// per chunk stages the chunk in shared memory with coalesced loads; then one lane adds it up in order (a chain of
// double adds from shared memory, not of dependent global loads).
constexpr int kSumWarps = 4;  // chunks per block of the chunk-sum kernel

template <class T>
__device__ __forceinline__ double ordered_sum(const T* __restrict__ src, std::int64_t n, T* stage, int lane) {
  double s = 0.0;
  for (std::int64_t done = 0; done < n; done += kNf4MeanChunk) {
    const int len = static_cast<int>(min(static_cast<std::int64_t>(kNf4MeanChunk), n - done));
    for (int j = lane; j < len; j += 32) stage[j] = src[done + j];
    __syncwarp();
    if (lane == 0)
      for (int j = 0; j < len; ++j) s = __dadd_rn(s, static_cast<double>(stage[j]));
    __syncwarp();
  }
  return s;
}

__global__ void __launch_bounds__(kSumWarps * 32) nf4_absmax_chunk_sum_kernel(const float* __restrict__ absmax,
                                                                              std::int64_t nblocks,
                                                                              double* __restrict__ chunk_sums) {
  __shared__ float stage[kSumWarps][kNf4MeanChunk];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kSumWarps + warp;
  const std::int64_t begin = c * kNf4MeanChunk;
  if (begin >= nblocks) return;  // the whole warp: begin is uniform
  const double s = ordered_sum(absmax + begin, min(static_cast<std::int64_t>(kNf4MeanChunk), nblocks - begin), stage[warp],
                               lane);
  if (lane == 0) chunk_sums[c] = s;
}

// One warp: the chunk sums in order, then the mean as the CPU computes it.
__global__ void nf4_absmax_mean_kernel(const double* __restrict__ chunk_sums, std::int64_t chunks,
                                       std::int64_t nblocks, float* __restrict__ offset) {
  __shared__ double stage[kNf4MeanChunk];
  const double s = ordered_sum(chunk_sums, chunks, stage, static_cast<int>(threadIdx.x));
  if (threadIdx.x == 0) *offset = __fmul_rn(__double2float_rn(s), __fdiv_rn(1.0f, static_cast<float>(nblocks)));
}

// offset_dev, when given, holds the offset (computed on the device); otherwise offset_host is used.
__global__ void __launch_bounds__(kNf4NestedBlockSize) nf4_double_quant_kernel(
    const float* __restrict__ absmax, std::int64_t nblocks, const float* __restrict__ offset_dev, float offset_host,
    const float* __restrict__ code2_global, std::uint8_t* __restrict__ q, float* __restrict__ absmax2) {
  const float offset = offset_dev ? *offset_dev : offset_host;
  __shared__ float code2[kCode2Size];
  __shared__ float mid[kCode2Size - 1];
  __shared__ float warp_max[kNf4NestedBlockSize / 32];
  const int t = threadIdx.x;
  code2[t] = code2_global[t];  // blockDim.x == 256 == kCode2Size
  __syncthreads();
  if (t + 1 < kCode2Size) mid[t] = __fmul_rn(__fadd_rn(code2[t], code2[t + 1]), 0.5f);
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kNf4NestedBlockSize + t;
  const float d = i < nblocks ? __fsub_rn(absmax[i], offset) : 0.0f;
  float m = fabsf(d);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if ((t & 31) == 0) warp_max[t >> 5] = m;
  __syncthreads();
  m = warp_max[0];
#pragma unroll
  for (int j = 1; j < kNf4NestedBlockSize / 32; ++j) m = fmaxf(m, warp_max[j]);
  if (t == 0) absmax2[blockIdx.x] = m;
  if (i < nblocks) {
    const float inv = __fdiv_rn(1.0f, m);
    q[i] = static_cast<std::uint8_t>(nearest_code2(mid, __fmul_rn(d, inv)));
  }
}

// ---- dequantize -----------------------------------------------------------------------------------------------

// Scales of one weight: plain (absmax) or double-quantized (q, absmax2, code2, offset).
struct Scales {
  const float* absmax;  // null when double-quantized
  const std::uint8_t* q;
  const float* absmax2;
  const float* code2;
  float offset;
};

// The rebuilt scale, as nf4_block_scale (src/core/nf4.cpp) computes it: code2[q]*absmax2[g] + offset, rounded
// after the multiply and after the add. code2_s is the table in shared memory.
__device__ __forceinline__ float block_scale(const Scales& s, const float* code2_s, std::int64_t block) {
  if (s.absmax) return __ldg(s.absmax + block);
  return nf4_lut::dq_block_scale(code2_s[__ldg(s.q + block)], __ldg(s.absmax2 + (block >> 8)), s.offset);
}

template <class T>
struct Out;

template <>
struct Out<float> {
  __device__ __forceinline__ static void store(float* p, std::int64_t i, float v) { p[i] = v; }
  // 8 elements to p (16-byte aligned).
  __device__ __forceinline__ static void store8(float* p, const float (&v)[8]) {
    float4* q = reinterpret_cast<float4*>(p);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};

template <>
struct Out<__nv_bfloat16> {
  __device__ __forceinline__ static void store(__nv_bfloat16* p, std::int64_t i, float v) {
    p[i] = __float2bfloat16_rn(v);
  }
  __device__ __forceinline__ static void store8(__nv_bfloat16* p, const float (&v)[8]) {
    std::uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);  // .x (low half) = lower index
      w[j] = *reinterpret_cast<const std::uint32_t*>(&b);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// Dequantizes chunk c (8 elements: 4 code bytes, one scale; a block holds at least 64 elements, so chunks never
// straddle one). Consecutive lanes take consecutive chunks, so a warp's loads (4 bytes each) and stores (16 or 32
// bytes each) are contiguous. `vec`: codes 4-byte and out 16-byte aligned; without it, or past n, one by one.
template <class T>
__device__ __forceinline__ void dequantize_chunk(const std::uint8_t* __restrict__ codes, const Scales& s,
                                                 const float* code2_s, const float* codebook, int block_shift,
                                                 std::int64_t n, bool vec, std::int64_t c, T* __restrict__ out) {
  const std::int64_t e0 = c * kDequantChunk;
  const float scale = block_scale(s, code2_s, e0 >> block_shift);
  if (vec && e0 + kDequantChunk <= n) {
    const std::uint32_t word = __ldg(reinterpret_cast<const std::uint32_t*>(codes + (e0 >> 1)));
    float v[8];
    nf4_lut::scaled_word(word, scale, codebook, v);
    Out<T>::store8(out + e0, v);
  } else {
    for (int j = 0; j < kDequantChunk && e0 + j < n; ++j) {
      const std::int64_t e = e0 + j;
      Out<T>::store(out, e, __fmul_rn(codebook[nf4_unpack(codes, e)], scale));
    }
  }
}

// One weight's dequantization by the blocks `block` of `blocks` (the grid, or its share of it): see the kernels
// below. codebook and code2_s are the block's shared tables, filled (code2_s only for double quantization).
template <class T>
__device__ __forceinline__ void dequantize_blocks(const std::uint8_t* __restrict__ codes, const Scales& s,
                                                  const float* code2_s, const float* codebook, int block_shift,
                                                  std::int64_t n, bool vec, T* __restrict__ out, unsigned block,
                                                  unsigned blocks) {
  constexpr int kRound = 4;
  const std::int64_t nchunks = (n + kDequantChunk - 1) / kDequantChunk;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const std::int64_t warp = (static_cast<std::int64_t>(block) * blockDim.x + threadIdx.x) >> 5;
  const std::int64_t nwarps = (static_cast<std::int64_t>(blocks) * blockDim.x) >> 5;
  const std::int64_t groups = vec ? n / (kDequantChunk * 32 * kRound) : 0;  // rounds wholly inside n
  const auto* words = reinterpret_cast<const std::uint32_t*>(codes);
  for (std::int64_t g = warp; g < groups; g += nwarps) {
    const std::int64_t c0 = g * (32 * kRound) + lane;
    std::uint32_t word[kRound];
    float scale[kRound];
#pragma unroll
    for (int u = 0; u < kRound; ++u) word[u] = __ldg(words + c0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kRound; ++u)
      scale[u] = block_scale(s, code2_s, ((c0 + 32 * u) * kDequantChunk) >> block_shift);
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      float v[8];
      nf4_lut::scaled_word(word[u], scale[u], codebook, v);
      Out<T>::store8(out + (c0 + 32 * u) * kDequantChunk, v);
    }
  }
  const std::int64_t stride = static_cast<std::int64_t>(blocks) * blockDim.x;
  for (std::int64_t c = groups * (32 * kRound) + static_cast<std::int64_t>(block) * blockDim.x + threadIdx.x;
       c < nchunks; c += stride)
    dequantize_chunk(codes, s, code2_s, codebook, block_shift, n, vec, c, out);
}

__device__ __forceinline__ void load_dequantize_tables(const Scales& s, float* codebook, float* code2_s) {
  if (threadIdx.x < 16) codebook[threadIdx.x] = nf4_code_value(static_cast<int>(threadIdx.x));
  for (int i = threadIdx.x; i < kCode2Size; i += blockDim.x)
    if (!s.absmax) code2_s[i] = s.code2[i];
  __syncthreads();
}

// Warp-tiled grid-stride rounds: a warp takes 4 x 32 consecutive chunks, issues their four coalesced 128-byte
// code loads and their scales before the first store, and each store instruction writes 512 contiguous bytes
// (bf16). Chunks past the last whole round go one per thread. The 16-entry codebook in shared memory makes every
// lookup conflict-free (16 words in 16 banks). (Measured against one chunk per thread and step with four steps a
// grid stride apart: docs/BENCHMARKS.md, NF4 conversion.)
template <class T>
__global__ void __launch_bounds__(kThreads)
    nf4_dequantize_kernel(const std::uint8_t* __restrict__ codes, Scales s, int block_shift, std::int64_t n, bool vec,
                          T* __restrict__ out) {
  __shared__ float codebook[16];
  __shared__ float code2_s[kCode2Size];
  load_dequantize_tables(s, codebook, code2_s);
  dequantize_blocks(codes, s, code2_s, codebook, block_shift, n, vec, out, blockIdx.x, gridDim.x);
}

// Several weights in one launch (a layer's q, k and v before their GEMMs): grid row y takes weight y.
constexpr int kDequantManyMax = 8;
struct DequantPart {
  const std::uint8_t* codes;
  Scales s;
  int block_shift;
  std::int64_t n;
  bool vec;
  __nv_bfloat16* out;
};
struct DequantParts {
  DequantPart part[kDequantManyMax];
};

__global__ void __launch_bounds__(kThreads) nf4_dequantize_many_kernel(const DequantParts parts) {
  __shared__ float codebook[16];
  __shared__ float code2_s[kCode2Size];
  const DequantPart& p = parts.part[blockIdx.y];
  load_dequantize_tables(p.s, codebook, code2_s);
  dequantize_blocks(p.codes, p.s, code2_s, codebook, p.block_shift, p.n, p.vec, p.out, blockIdx.x, gridDim.x);
}

}  // namespace qmm::cuda::nf4_detail
