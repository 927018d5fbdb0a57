// RMSNorm on the GPU, one block per row: the row's sum of squares (fp32, block-reduced in a fixed order) gives
// rstd; the forward writes y = w · round(x · rstd), the backward dx = rstd · (g − x̂ · mean(g · x̂)),
// g = dy · w.
// The weight gradient dw += Σ_rows dy · x̂ is summed without atomics, in a fixed order: each block of the first
// kernel sums a group of rows per column into a partial, a second kernel adds the groups' partials in group order.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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
  rms_norm_kernel<T><<<static_cast<unsigned>(x.dim(0)), kThreads, 0, stream_of(ctx)>>>(
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
