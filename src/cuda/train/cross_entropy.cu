// linear_cross_entropy's row step on the GPU: one block per row of a chunk of fp32 logits. A first pass keeps each
// thread's running maximum and sum of exponentials (rescaled when the maximum grows), the block combines them into
// the row's log-sum-exp, thread 0 writes the row's loss term, and a second pass writes the gradient row
// (softmax - onehot) * inv_n in g's dtype. The core (src/core/train_ops.cpp) runs the chunk's GEMMs around it.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"

namespace qmm::cuda {
namespace {

constexpr int kThreads = 256;

// (m, s) += (m2, s2): two partial (maximum, sum of exp(x - maximum)) pairs as one.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float top = fmaxf(m, m2);
  s = s * expf(m - top) + s2 * expf(m2 - top);
  m = top;
}

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <class G>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(const float* logits, const std::int32_t* labels, std::int64_t vocab,
                              std::int32_t ignore_index, float inv_n, G* g, double* row_loss) {
  const std::int64_t row = blockIdx.x;
  const float* z = logits + row * vocab;
  G* grow = g ? g + row * vocab : nullptr;
  const std::int32_t label = labels[row];
  if (label == ignore_index) {
    if (threadIdx.x == 0) row_loss[row] = 0.0;
    if (grow)
      for (std::int64_t v = threadIdx.x; v < vocab; v += kThreads) store(grow + v, 0.0f);
    return;
  }
  float m = -INFINITY, s = 0.0f;
  for (std::int64_t v = threadIdx.x; v < vocab; v += kThreads) combine(m, s, z[v], 1.0f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_down_sync(0xFFFFFFFFu, m, o), s2 = __shfl_down_sync(0xFFFFFFFFu, s, o);
    combine(m, s, m2, s2);
  }
  __shared__ float warp_m[kThreads / 32], warp_s[kThreads / 32];
  __shared__ float lse_shared;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = warp_m[0], bs = warp_s[0];
    for (int w = 1; w < kThreads / 32; ++w) combine(bm, bs, warp_m[w], warp_s[w]);
    const float lse = bm + logf(bs);
    lse_shared = lse;
    row_loss[row] = static_cast<double>(lse) - static_cast<double>(z[label]);
  }
  __syncthreads();
  if (!grow) return;
  const float lse = lse_shared;
  for (std::int64_t v = threadIdx.x; v < vocab; v += kThreads)
    store(grow + v, (expf(z[v] - lse) - (v == label ? 1.0f : 0.0f)) * inv_n);
}

// out = sum(values) / divisor, one block, the values summed in a fixed order (the same bits every run).
__global__ void __launch_bounds__(kThreads) mean_kernel(const double* values, std::int64_t count, double divisor,
                                                        float* out) {
  __shared__ double warp_totals[kThreads / 32];
  double acc = 0.0;
  for (std::int64_t i = threadIdx.x; i < count; i += kThreads) acc += values[i];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xFFFFFFFFu, acc, o);
  if ((threadIdx.x & 31) == 0) warp_totals[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x != 0) return;
  double total = 0.0;
  for (int w = 0; w < kThreads / 32; ++w) total += warp_totals[w];
  *out = static_cast<float>(total / divisor);
}

}  // namespace

void cross_entropy_rows(const Context& ctx, const TensorView& logits, const TensorView& labels,
                        std::int32_t ignore_index, float inv_n, const TensorView& g, const TensorView& row_loss) {
  const std::int64_t rows = logits.dim(0), vocab = logits.dim(1);
  if (rows == 0) return;
  set_device(ctx);
  const auto* z = logits.data_as<const float>();
  const auto* lab = labels.data_as<const std::int32_t>();
  auto* out = static_cast<double*>(row_loss.data());
  const unsigned blocks = static_cast<unsigned>(rows);
  if (g.empty() || g.dtype() == DType::F32) {
    cross_entropy_rows_kernel<float><<<blocks, kThreads, 0, stream_of(ctx)>>>(
        z, lab, vocab, ignore_index, inv_n, g.empty() ? nullptr : g.data_as<float>(), out);
  } else {
    cross_entropy_rows_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream_of(ctx)>>>(
        z, lab, vocab, ignore_index, inv_n, static_cast<__nv_bfloat16*>(g.data()), out);
  }
  QMM_CUDA_CHECK_LAUNCH("cross_entropy_rows_kernel");
}

void cross_entropy_mean(const Context& ctx, const TensorView& row_loss, double divisor, const TensorView& loss) {
  set_device(ctx);
  mean_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(static_cast<const double*>(row_loss.data()), row_loss.numel() / 8,
                                                  divisor, loss.data_as<float>());
  QMM_CUDA_CHECK_LAUNCH("mean_kernel");
}

}  // namespace qmm::cuda
