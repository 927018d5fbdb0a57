// RMSNorm on the GPU. Rows that a warp can hold in registers (16-byte packs, at most kMaxPacks per lane forward,
// kMaxPacksBackward backward, whose lanes hold x and dy) go one warp per row and are read once; other rows (odd
// widths, misaligned views, very wide rows) one block per row.
// The row's sum of squares (fp32, reduced in a fixed order) gives rstd; the forward writes
// y = w · round(x · rstd), the backward dx = rstd · (g − x̂ · mean(g · x̂)), g = dy · w.
// The weight gradient dw += Σ_rows dy · x̂ is summed without atomics, in a fixed order: each block of the first
// kernel sums a group of rows per column into a partial, a second kernel adds the groups' partials in group order.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/elem.cuh"
#include "cuda/cuda_backend.h"

namespace qmm::cuda {
namespace {

using common::Elem;
constexpr int kThreads = 256;
constexpr int kRowsPerGroup = 64;  // rows one dw partial sums

// The block's total of v in a fixed order; valid in every thread. Call once per kernel.
__device__ __forceinline__ float block_total(float v) {
  __shared__ float warp_totals[kThreads / 32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, o);
  if ((threadIdx.x & 31) == 0) warp_totals[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) t += warp_totals[w];
    total = t;
  }
  __syncthreads();
  return total;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const T* x, const T* w, T* y, float* rstd, std::int64_t hid, float eps) {
  using E = Elem<T>;
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * hid;
  float ss = 0.0f;
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads) {
    const float v = E::load(x, base + k);
    ss = fmaf(v, v, ss);
  }
  const float rs = rsqrtf(block_total(ss) / static_cast<float>(hid) + eps);
  if (rstd && threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads) {
    T xh;  // x · rstd rounded to the storage dtype first, as Hugging Face's module computes it
    E::store(&xh, 0, E::load(x, base + k) * rs);
    E::store(y, base + k, E::load(w, k) * E::load(&xh, 0));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) rms_norm_dx_kernel(const T* x, const T* w, const float* rstd,
                                                               const T* dy, T* dx, std::int64_t hid) {
  using E = Elem<T>;
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * hid;
  const float rs = rstd[blockIdx.x];
  float dot = 0.0f;
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads)
    dot = fmaf(E::load(dy, base + k) * E::load(w, k), E::load(x, base + k) * rs, dot);
  const float mean = block_total(dot) / static_cast<float>(hid);
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads) {
    const float g = E::load(dy, base + k) * E::load(w, k), xh = E::load(x, base + k) * rs;
    E::store(dx, base + k, rs * (g - xh * mean));
  }
}

// ---- one warp per row -------------------------------------------------------------------------------------------

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxPacks = 16;  // 16-byte packs a lane holds: rows up to 4096 bf16 or 2048 f32 elements
// The backward's lanes hold x's and dy's packs: at 16 of each the block-per-row kernel measured faster (occupancy).
constexpr int kMaxPacksBackward = 8;

// The warp's total of v, in every lane, in a fixed order.
__device__ __forceinline__ float warp_total(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Lane l holds packs l, l + 32, ... (kPacks of them, those past the row's `packs` unused).
template <class T, int kPacks>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    rms_norm_warp_kernel(const T* x, const T* w, T* y, float* rstd, std::int64_t rows, std::int64_t hid, float eps) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const int lane = threadIdx.x & 31;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together
  const std::int64_t packs = hid / V;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * hid);
  uint4 q[kPacks];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    if (lane + 32 * j >= packs) continue;
    q[j] = xr[lane + 32 * j];
    float v[V];
    E::unpack(q[j], v);
#pragma unroll
    for (int k = 0; k < V; ++k) ss = fmaf(v[k], v[k], ss);
  }
  const float rs = rsqrtf(warp_total(ss) / static_cast<float>(hid) + eps);
  if (rstd && lane == 0) rstd[row] = rs;
  T* yr = y + row * hid;  // y may be x: the row is in registers
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const std::int64_t p = lane + 32 * j;
    if (p >= packs) continue;
    float v[V], wv[V], out[V];
    E::unpack(q[j], v);
    E::load_vec(w, p, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      T xh;  // x · rstd rounded to the storage dtype first, as Hugging Face's module computes it
      E::store(&xh, 0, v[k] * rs);
      out[k] = wv[k] * E::load(&xh, 0);
    }
    E::store_vec(yr, p, out);
  }
}

template <class T, int kPacks>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    rms_norm_dx_warp_kernel(const T* x, const T* w, const float* rstd, const T* dy, T* dx, std::int64_t rows,
                            std::int64_t hid) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const int lane = threadIdx.x & 31;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const std::int64_t packs = hid / V;
  const float rs = rstd[row];
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * hid);
  const uint4* dyr = reinterpret_cast<const uint4*>(dy + row * hid);
  uint4 qx[kPacks], qdy[kPacks];
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const std::int64_t p = lane + 32 * j;
    if (p >= packs) continue;
    qx[j] = xr[p];
    qdy[j] = dyr[p];
    float xv[V], dv[V], wv[V];
    E::unpack(qx[j], xv);
    E::unpack(qdy[j], dv);
    E::load_vec(w, p, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) dot = fmaf(dv[k] * wv[k], xv[k] * rs, dot);
  }
  const float mean = warp_total(dot) / static_cast<float>(hid);
  T* dxr = dx + row * hid;  // dx may be dy: the row is in registers
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const std::int64_t p = lane + 32 * j;
    if (p >= packs) continue;
    float xv[V], dv[V], wv[V], out[V];
    E::unpack(qx[j], xv);
    E::unpack(qdy[j], dv);
    E::load_vec(w, p, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = dv[k] * wv[k], xh = xv[k] * rs;
      out[k] = rs * (g - xh * mean);
    }
    E::store_vec(dxr, p, out);
  }
}

// The packs per lane the warp kernels take for rows of hid elements of T (1, 2, 4, 8 or 16), or 0 where a row is
// not whole 16-byte packs, a pointer is not 16-byte aligned, or the row is wider than kMax packs per lane.
template <class T, int kMax>
int warp_packs(std::int64_t hid, std::initializer_list<const void*> pointers) {
  constexpr int V = Elem<T>::kVec;
  if (hid % V != 0) return 0;
  for (const void* p : pointers)
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return 0;
  const std::int64_t per_lane = (hid / V + 31) / 32;
  for (int k = 1; k <= kMax; k *= 2)
    if (per_lane <= k) return k;
  return 0;
}

// Calls f(std::integral_constant<int, kPacks>) for kPacks in {1, 2, 4, ..., kMax} (packs, a power of 2 <= kMax).
template <int kMax, class F>
void with_packs(int packs, F&& f) {
  if constexpr (kMax > 1) {
    if (packs < kMax) return with_packs<kMax / 2>(packs, f);
  }
  f(std::integral_constant<int, kMax>{});
}

unsigned warp_blocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// partial[group][k] = Σ over the group's rows, in order, of dy · x · rstd; grid (column blocks, groups).
template <class T>
__global__ void __launch_bounds__(kThreads) rms_norm_dw_partial_kernel(const T* x, const float* rstd, const T* dy,
                                                                       float* partial, std::int64_t rows,
                                                                       std::int64_t hid) {
  using E = Elem<T>;
  const std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= hid) return;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.y) * kRowsPerGroup;
  const std::int64_t last = first + kRowsPerGroup < rows ? first + kRowsPerGroup : rows;
  float acc = 0.0f;
  for (std::int64_t r = first; r < last; ++r)
    acc = fmaf(E::load(dy, r * hid + k), E::load(x, r * hid + k) * rstd[r], acc);
  partial[static_cast<std::int64_t>(blockIdx.y) * hid + k] = acc;
}

__global__ void __launch_bounds__(kThreads) rms_norm_dw_finish_kernel(const float* partial, std::int64_t groups,
                                                                      std::int64_t hid, float* dw) {
  const std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= hid) return;
  float acc = 0.0f;
  for (std::int64_t g = 0; g < groups; ++g) acc += partial[g * hid + k];
  dw[k] += acc;
}

template <class T>
void launch_forward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& y,
                    const TensorView& rstd, float eps) {
  const std::int64_t rows = x.dim(0), hid = x.dim(1);
  if (const int packs = warp_packs<T, kMaxPacks>(hid, {x.data(), w.data(), y.data()})) {
    with_packs<kMaxPacks>(packs, [&](auto k) {
      rms_norm_warp_kernel<T, decltype(k)::value><<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream_of(ctx)>>>(
          x.data_as<const T>(), w.data_as<const T>(), y.data_as<T>(), rstd.empty() ? nullptr : rstd.data_as<float>(),
          rows, hid, eps);
    });
    QMM_CUDA_CHECK_LAUNCH("rms_norm_warp_kernel");
    return;
  }
  rms_norm_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream_of(ctx)>>>(
      x.data_as<const T>(), w.data_as<const T>(), y.data_as<T>(), rstd.empty() ? nullptr : rstd.data_as<float>(),
      x.dim(1), eps);
  QMM_CUDA_CHECK_LAUNCH("rms_norm_kernel");
}

template <class T>
void launch_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                     const TensorView& dy, const TensorView& dx, const TensorView& dw) {
  const std::int64_t rows = x.dim(0), hid = x.dim(1);
  if (!dw.empty()) {  // first: dx may be dy
    const std::int64_t groups = (rows + kRowsPerGroup - 1) / kRowsPerGroup;
    const unsigned col_blocks = static_cast<unsigned>((hid + kThreads - 1) / kThreads);
    ScratchBuffer partial(state(ctx), static_cast<std::size_t>(groups * hid) * sizeof(float));
    rms_norm_dw_partial_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(groups)), kThreads, 0, stream_of(ctx)>>>(
        x.data_as<const T>(), rstd.data_as<const float>(), dy.data_as<const T>(), partial.at<float>(0), rows, hid);
    QMM_CUDA_CHECK_LAUNCH("rms_norm_dw_partial_kernel");
    rms_norm_dw_finish_kernel<<<col_blocks, kThreads, 0, stream_of(ctx)>>>(partial.at<float>(0), groups, hid,
                                                                         dw.data_as<float>());
    QMM_CUDA_CHECK_LAUNCH("rms_norm_dw_finish_kernel");
  }
  if (dx.empty()) return;
  if (const int packs = warp_packs<T, kMaxPacksBackward>(hid, {x.data(), w.data(), dy.data(), dx.data()})) {
    with_packs<kMaxPacksBackward>(packs, [&](auto k) {
      rms_norm_dx_warp_kernel<T, decltype(k)::value><<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream_of(ctx)>>>(
          x.data_as<const T>(), w.data_as<const T>(), rstd.data_as<const float>(), dy.data_as<const T>(),
          dx.data_as<T>(), rows, hid);
    });
    QMM_CUDA_CHECK_LAUNCH("rms_norm_dx_warp_kernel");
    return;
  }
  rms_norm_dx_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream_of(ctx)>>>(
      x.data_as<const T>(), w.data_as<const T>(), rstd.data_as<const float>(), dy.data_as<const T>(), dx.data_as<T>(),
      hid);
  QMM_CUDA_CHECK_LAUNCH("rms_norm_dx_kernel");
}

}  // namespace

void rms_norm(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& y,
              const TensorView& rstd, float eps) {
  set_device(ctx);
  if (x.dtype() == DType::BF16) launch_forward<__nv_bfloat16>(ctx, x, w, y, rstd, eps);
  else launch_forward<float>(ctx, x, w, y, rstd, eps);
}

void rms_norm_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                       const TensorView& dy, const TensorView& dx, const TensorView& dw) {
  set_device(ctx);
  if (x.dtype() == DType::BF16) launch_backward<__nv_bfloat16>(ctx, x, w, rstd, dy, dx, dw);
  else launch_backward<float>(ctx, x, w, rstd, dy, dx, dw);
}

}  // namespace qmm::cuda
