// Device code of the train ops: element-wise maps (add, add_bias, dropout) and the f32 <-> bf16 cast with 16-byte
// vectors where every pointer allows them and a scalar tail; deterministic reductions (sum of squares over many
// tensors, MSE) into per-block fp64 partials summed by one block in a fixed order; the fused multi-tensor AdamW.
// Outputs may be exactly an input (in place): each thread loads all of its elements before storing them and no
// thread touches another's, so pointers carry no __restrict__.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/train_math.h"
#include "cuda/common/elem.cuh"

namespace qmm::cuda::train_detail {

using common::Elem;

constexpr int kThreads = 256;
// Tensors per multi-tensor launch. The batch travels as a kernel parameter by value; 64 AdamW slots (48 bytes
// each) plus their block table stay under the classic 4 KiB parameter limit. More tensors: several launches.
constexpr int kMaxTensors = 64;

__device__ __forceinline__ std::int64_t global_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_threads() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

// The block's total of v, in a fixed order (shuffles down within each warp, then warp 0 over the warp totals), so
// the same inputs give the same bits every time. The result is valid in thread 0. Call once per kernel.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_totals[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  if (warp != 0) return 0.0;
  v = lane < kThreads / 32 ? warp_totals[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, o);
  return v;
}

// ---- element-wise maps ------------------------------------------------------------------------------------------

template <class T, int kIn>
struct MapArgs {
  const T* in[kIn];
  T* out;
  std::int64_t n;
  std::int64_t nvec;  // 16-byte vectors (0 when a pointer is misaligned); elements [nvec * kVec, n) go one by one
};

// out[i] = f(i, in_0[i], ..., in_{kIn-1}[i]) in fp32. F::apply<W>(first, x, r) computes the W consecutive results
// from element `first` (W = the vector width, or 1 in the tail).
template <class T, int kIn, class F>
__global__ void __launch_bounds__(kThreads) map_kernel(MapArgs<T, kIn> a, F f) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const std::int64_t stride = grid_threads();
  for (std::int64_t v = global_thread(); v < a.nvec; v += stride) {
    float x[kIn][V], r[V];
#pragma unroll
    for (int k = 0; k < kIn; ++k) E::load_vec(a.in[k], v, x[k]);
    f.template apply<V>(v * V, x, r);
    E::store_vec(a.out, v, r);
  }
  for (std::int64_t i = a.nvec * V + global_thread(); i < a.n; i += stride) {
    float x[kIn][1], r[1];
#pragma unroll
    for (int k = 0; k < kIn; ++k) x[k][0] = E::load(a.in[k], i);
    f.template apply<1>(i, x, r);
    E::store(a.out, i, r[0]);
  }
}

// a + alpha * b with one rounding (fma).
struct AddOp {
  float alpha;
  template <int W>
  __device__ __forceinline__ void apply(std::int64_t, const float (&x)[2][W], float (&r)[W]) const {
#pragma unroll
    for (int j = 0; j < W; ++j) r[j] = fmaf(alpha, x[1][j], x[0][j]);
  }
};

// y[i] + bias[i mod cols]: the column is found once per call and then stepped (any number of row wraps).
template <class B>
struct BiasOp {
  const B* bias;
  std::int64_t cols;
  template <int W>
  __device__ __forceinline__ void apply(std::int64_t first, const float (&x)[1][W], float (&r)[W]) const {
    std::int64_t col = first % cols;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      r[j] = x[0][j] + Elem<B>::load(bias, col);
      if (++col == cols) col = 0;
    }
  }
};

// Inverted dropout with the shared counter-based mask: one 64-bit hash serves an even/odd pair of elements.
// A kept element is x * scale in fp32 (one rounding, as the CPU reference), a dropped one +0.
struct DropoutOp {
  std::uint64_t key;
  std::uint32_t threshold;
  float scale;
  template <int W>
  __device__ __forceinline__ void apply(std::int64_t first, const float (&x)[1][W], float (&r)[W]) const {
    if constexpr (W == 1) {
      r[0] = train::dropout_keep_at(key, first, threshold) ? x[0][0] * scale : 0.0f;
    } else {
      static_assert(W % 2 == 0, "vectors hold whole pairs");  // and start at an even index (a multiple of W)
#pragma unroll
      for (int j = 0; j < W; j += 2) {
        const std::uint64_t bits = train::dropout_pair_bits(key, static_cast<std::uint64_t>(first + j) >> 1);
        r[j] = train::dropout_keep_bits(bits, first + j, threshold) ? x[0][j] * scale : 0.0f;
        r[j + 1] = train::dropout_keep_bits(bits, first + j + 1, threshold) ? x[0][j + 1] * scale : 0.0f;
      }
    }
  }
};

// ---- cast -------------------------------------------------------------------------------------------------------

// Round to nearest even, the host's float_to_bf16 bit for bit (a NaN keeps its payload's top bits and turns quiet).
__device__ __forceinline__ std::uint32_t bf16_bits(float x) {
  const std::uint32_t u = __float_as_uint(x);
  if (isnan(x)) return (u >> 16) | 0x40u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// Elements start, start + stride, ... of src converted into dst; 8 per step (two float4 on the f32 side, one uint4
// on the bf16 side) over the first nvec8 groups of 8.
__device__ __forceinline__ void cast_f32_to_bf16_strided(const float* src, std::uint16_t* dst, std::int64_t n,
                                                         std::int64_t nvec8, std::int64_t start, std::int64_t stride) {
  for (std::int64_t v = start; v < nvec8; v += stride) {
    const float4 a = reinterpret_cast<const float4*>(src)[2 * v];
    const float4 b = reinterpret_cast<const float4*>(src)[2 * v + 1];
    // The lower index goes into the low half of each 32-bit word.
    reinterpret_cast<uint4*>(dst)[v] =
        make_uint4(bf16_bits(a.x) | bf16_bits(a.y) << 16, bf16_bits(a.z) | bf16_bits(a.w) << 16,
                   bf16_bits(b.x) | bf16_bits(b.y) << 16, bf16_bits(b.z) | bf16_bits(b.w) << 16);
  }
  for (std::int64_t i = nvec8 * 8 + start; i < n; i += stride) dst[i] = static_cast<std::uint16_t>(bf16_bits(src[i]));
}

__global__ void __launch_bounds__(kThreads)
    cast_f32_to_bf16_kernel(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t nvec8) {
  cast_f32_to_bf16_strided(src, dst, n, nvec8, global_thread(), grid_threads());
}

__global__ void __launch_bounds__(kThreads)
    cast_bf16_to_f32_kernel(const std::uint16_t* src, float* dst, std::int64_t n, std::int64_t nvec8) {
  const std::int64_t stride = grid_threads();
  for (std::int64_t v = global_thread(); v < nvec8; v += stride) {
    const uint4 q = reinterpret_cast<const uint4*>(src)[v];
    const std::uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float f[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[2 * j] = __uint_as_float(w[j] << 16);
      f[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
    reinterpret_cast<float4*>(dst)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(dst)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
  }
  for (std::int64_t i = nvec8 * 8 + global_thread(); i < n; i += stride)
    dst[i] = __uint_as_float(static_cast<std::uint32_t>(src[i]) << 16);
}

// ---- multi-tensor launches --------------------------------------------------------------------------------------
// A batch names up to kMaxTensors tensors; tensor k owns the blocks [block_end[k-1], block_end[k]) of the launch
// and walks its elements grid-stride over just those blocks.

struct NormSlot {
  const void* data;
  std::int64_t n;
  int bf16;  // else f32
  int vec;   // 16-byte aligned
};

struct AdamWSlot {
  float* param;
  const float* grad;
  float* m;
  float* v;
  std::int64_t n;
  int vec;  // all four 16-byte aligned
};

template <class Slot>
struct Batch {
  Slot t[kMaxTensors];
  int block_end[kMaxTensors];
  int count;
};

// This block's tensor, its first block and its block count.
struct Share {
  int slot;
  std::int64_t local;   // block index within the tensor
  std::int64_t blocks;  // blocks the tensor owns
};
template <class Slot>
__device__ __forceinline__ Share share_of_block(const Batch<Slot>& b) {
  const int block = static_cast<int>(blockIdx.x);
  int lo = 0, hi = b.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (block < b.block_end[mid])
      hi = mid;
    else
      lo = mid + 1;
  }
  const int first = lo == 0 ? 0 : b.block_end[lo - 1];
  return {lo, block - first, b.block_end[lo] - first};
}

template <class T>
__device__ __forceinline__ double sum_squares_of(const NormSlot& t, const Share& s) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const T* x = static_cast<const T*>(t.data);
  const std::int64_t nvec = t.vec ? t.n / V : 0;
  const std::int64_t start = s.local * kThreads + threadIdx.x, stride = s.blocks * kThreads;
  double acc = 0.0;
  for (std::int64_t v = start; v < nvec; v += stride) {
    float q[V];
    E::load_vec(x, v, q);
#pragma unroll
    for (int j = 0; j < V; ++j) acc = fma(static_cast<double>(q[j]), static_cast<double>(q[j]), acc);
  }
  for (std::int64_t i = nvec * V + start; i < t.n; i += stride) {
    const double q = E::load(x, i);
    acc = fma(q, q, acc);
  }
  return acc;
}

// partials[block] = sum of squares of this block's share of its tensor, accumulated in fp64.
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const __grid_constant__ Batch<NormSlot> batch, double* partials) {
  const Share s = share_of_block(batch);
  const NormSlot& t = batch.t[s.slot];
  const double acc = t.bf16 ? sum_squares_of<__nv_bfloat16>(t, s) : sum_squares_of<float>(t, s);
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// One block: the partials summed in a fixed order; `out` = sqrt(total) (a norm) or total / divisor (a mean), as
// f32; `clip_out` (optional) = the clip coefficient of that norm.
__global__ void __launch_bounds__(kThreads)
    finish_sum_kernel(const double* partials, int count, int take_sqrt, double divisor, float* out, float* clip_out,
                      float max_norm) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) acc += partials[i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) {
    const float value = static_cast<float>(take_sqrt ? sqrt(total) : total / divisor);
    if (out) *out = value;
    if (clip_out) *clip_out = train::clip_coefficient(value, max_norm);
  }
}

// dy = coef * (y - target) and the block's sum of (y - target)^2, both from the difference in fp64 (exact for f32
// and bf16 inputs of similar magnitude), so dy is the CPU reference's value bit for bit.
template <class T>
__global__ void __launch_bounds__(kThreads) mse_loss_kernel(const T* y, const T* target, T* dy, std::int64_t n,
                                                            std::int64_t nvec, double coef, double* partials) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const std::int64_t stride = grid_threads();
  double acc = 0.0;
  for (std::int64_t v = global_thread(); v < nvec; v += stride) {
    float a[V], b[V], r[V];
    E::load_vec(y, v, a);
    E::load_vec(target, v, b);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const double d = static_cast<double>(a[j]) - static_cast<double>(b[j]);
      acc = fma(d, d, acc);
      r[j] = static_cast<float>(coef * d);
    }
    E::store_vec(dy, v, r);
  }
  for (std::int64_t i = nvec * V + global_thread(); i < n; i += stride) {
    const double d = static_cast<double>(E::load(y, i)) - static_cast<double>(E::load(target, i));
    acc = fma(d, d, acc);
    E::store(dy, i, static_cast<float>(coef * d));
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// ---- AdamW ------------------------------------------------------------------------------------------------------

// ---- batched cast ------------------------------------------------------------------------------------------------

struct CastSlot {
  const float* src;
  std::uint16_t* dst;  // bf16 bits
  std::int64_t n;
  std::int64_t nvec8;  // groups of 8 taken as vectors (0 unless both are 16-byte aligned)
};

__global__ void __launch_bounds__(kThreads) cast_batch_f32_to_bf16_kernel(const __grid_constant__ Batch<CastSlot> batch) {
  const Share sh = share_of_block(batch);
  const CastSlot& t = batch.t[sh.slot];
  cast_f32_to_bf16_strided(t.src, t.dst, t.n, t.nvec8, sh.local * kThreads + threadIdx.x, sh.blocks * kThreads);
}

// ---- AdamW ------------------------------------------------------------------------------------------------------

// Step constants, computed once on the host (bias corrections in fp64, then rounded to fp32).
struct AdamWScalars {
  float lr_wd;  // lr * weight_decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float eps;
};

// p -= lr*wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2; p -= lr * (m/bc1) / (sqrt(v/bc2) + eps).
__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v, const AdamWScalars& s) {
  p = fmaf(-s.lr_wd, p, p);
  m = fmaf(s.beta1, m, s.one_minus_beta1 * g);
  v = fmaf(s.beta2, v, s.one_minus_beta2 * g * g);
  p -= s.step_size * m / (sqrtf(v) * s.inv_sqrt_bc2 + s.eps);
}

// Every tensor of the batch in one launch. `clip` (device memory, written by finish_sum_kernel earlier on the
// stream) scales the gradients; nullptr means no clipping.
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const __grid_constant__ Batch<AdamWSlot> batch, AdamWScalars s, const float* clip) {
  const float c = clip ? *clip : 1.0f;
  const Share sh = share_of_block(batch);
  const AdamWSlot& t = batch.t[sh.slot];
  const std::int64_t nvec = t.vec ? t.n / 4 : 0;
  const std::int64_t start = sh.local * kThreads + threadIdx.x, stride = sh.blocks * kThreads;
  for (std::int64_t i = start; i < nvec; i += stride) {
    float4 p = reinterpret_cast<const float4*>(t.param)[i];
    const float4 g = reinterpret_cast<const float4*>(t.grad)[i];
    float4 m = reinterpret_cast<const float4*>(t.m)[i];
    float4 v = reinterpret_cast<const float4*>(t.v)[i];
    adamw_update(p.x, g.x * c, m.x, v.x, s);
    adamw_update(p.y, g.y * c, m.y, v.y, s);
    adamw_update(p.z, g.z * c, m.z, v.z, s);
    adamw_update(p.w, g.w * c, m.w, v.w, s);
    reinterpret_cast<float4*>(t.param)[i] = p;
    reinterpret_cast<float4*>(t.m)[i] = m;
    reinterpret_cast<float4*>(t.v)[i] = v;
  }
  for (std::int64_t i = nvec * 4 + start; i < t.n; i += stride) {
    float p = t.param[i], m = t.m[i], v = t.v[i];
    adamw_update(p, t.grad[i] * c, m, v, s);
    t.param[i] = p;
    t.m[i] = m;
    t.v[i] = v;
  }
}

}  // namespace qmm::cuda::train_detail
