// linear_cross_entropy's steps on the GPU. label_stats counts the tokens that are not ignored (n) and the labels out
// of range on the device, so that nothing waits for the host. The row step, one block per row of a chunk of fp32
// logits: a first pass keeps each thread's running maximum and sum of exponentials (rescaled when the maximum grows),
// the block combines them into the row's log-sum-exp, thread 0 writes the row's loss term, and a second pass writes
// the gradient row (softmax - onehot) / n in g's dtype; a label out of range gives a NaN loss term and gradient row.
// linear_cross_entropy (at the end) runs the chunks' GEMMs around them.
#include <cuda_bf16.h>

#include <algorithm>
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

// stats[0] = the count of labels equal to neither ignore_index nor out of [0, vocab), stats[1] = the count out of
// range (one block).
__global__ void __launch_bounds__(kThreads) label_stats_kernel(const std::int32_t* labels, std::int64_t count,
                                                               std::int64_t vocab, std::int32_t ignore_index,
                                                               long long* stats) {
  __shared__ long long warp_n[kThreads / 32], warp_bad[kThreads / 32];
  long long n = 0, bad = 0;
  for (std::int64_t i = threadIdx.x; i < count; i += kThreads) {
    const std::int32_t y = labels[i];
    if (y == ignore_index) continue;
    if (y >= 0 && y < vocab) ++n;
    else ++bad;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    n += __shfl_down_sync(0xFFFFFFFFu, n, o);
    bad += __shfl_down_sync(0xFFFFFFFFu, bad, o);
  }
  if ((threadIdx.x & 31) == 0) {
    warp_n[threadIdx.x >> 5] = n;
    warp_bad[threadIdx.x >> 5] = bad;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  n = bad = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    n += warp_n[w];
    bad += warp_bad[w];
  }
  stats[0] = n;
  stats[1] = bad;
}

template <class G>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(const float* logits, const std::int32_t* labels, std::int64_t vocab,
                              std::int32_t ignore_index, const long long* stats, G* g, double* row_loss) {
  const std::int64_t row = blockIdx.x;
  const float* z = logits + row * vocab;
  G* grow = g ? g + row * vocab : nullptr;
  const std::int32_t label = labels[row];
  if (label == ignore_index || label < 0 || label >= vocab) {
    const float fill = label == ignore_index ? 0.0f : NAN;
    if (threadIdx.x == 0) row_loss[row] = fill;
    if (grow)
      for (std::int64_t v = threadIdx.x; v < vocab; v += kThreads) store(grow + v, fill);
    return;
  }
  const float inv_n = 1.0f / static_cast<float>(stats[0]);  // n >= 1: this row counts
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

// out = sum(values) / n with n = stats[0] (0 where n = 0 and no label was out of range), one block, the values summed
// in a fixed order (the same bits every run).
__global__ void __launch_bounds__(kThreads) mean_kernel(const double* values, std::int64_t count,
                                                        const long long* stats, float* out) {
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
  const long long n = stats[0], bad = stats[1];
  *out = bad > 0 ? NAN : n == 0 ? 0.0f : static_cast<float>(total / static_cast<double>(n));
}

// stats (U8 [16], two int64) = {n, the count of labels out of range}, n the count of labels in [0, vocab) that are
// not ignore_index.
void label_stats(const Context& ctx, const TensorView& labels, std::int64_t vocab, std::int32_t ignore_index,
                 const TensorView& stats) {
  set_device(ctx);
  label_stats_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(labels.data_as<const std::int32_t>(), labels.numel(), vocab,
                                                         ignore_index, static_cast<long long*>(stats.data()));
  QMM_CUDA_CHECK_LAUNCH("label_stats_kernel");
}

// Over one chunk of fp32 logits [rows, V]: each row's loss term logsumexp(z) - z[label] into row_loss[row] (fp64; 0
// for an ignored row, NaN for a label out of range) and, where g is given (f32 or bf16 [rows, V]), the gradient rows
// g = (softmax(z) - onehot(label)) / n (0 for an ignored row, NaN for a label out of range).
void rows_step(const Context& ctx, const TensorView& logits, const TensorView& labels, std::int32_t ignore_index,
               const TensorView& stats, const TensorView& g, const TensorView& row_loss) {
  const std::int64_t rows = logits.dim(0), vocab = logits.dim(1);
  if (rows == 0) return;
  set_device(ctx);
  const auto* z = logits.data_as<const float>();
  const auto* lab = labels.data_as<const std::int32_t>();
  auto* out = static_cast<double*>(row_loss.data());
  const auto* st = static_cast<const long long*>(stats.data());
  const unsigned blocks = static_cast<unsigned>(rows);
  if (g.empty() || g.dtype() == DType::F32) {
    cross_entropy_rows_kernel<float><<<blocks, kThreads, 0, stream_of(ctx)>>>(
        z, lab, vocab, ignore_index, st, g.empty() ? nullptr : g.data_as<float>(), out);
  } else {
    cross_entropy_rows_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream_of(ctx)>>>(
        z, lab, vocab, ignore_index, st, static_cast<__nv_bfloat16*>(g.data()), out);
  }
  QMM_CUDA_CHECK_LAUNCH("cross_entropy_rows_kernel");
}

// loss[0] = sum(row_loss) / n, summed in a fixed order (row_loss f64 viewed as its bytes: U8 [8 * rows]); 0 where
// n = 0, NaN where a label was out of range.
void mean_step(const Context& ctx, const TensorView& row_loss, const TensorView& stats, const TensorView& loss) {
  set_device(ctx);
  mean_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(static_cast<const double*>(row_loss.data()), row_loss.numel() / 8,
                                                  static_cast<const long long*>(stats.data()), loss.data_as<float>());
  QMM_CUDA_CHECK_LAUNCH("mean_kernel");
}

}  // namespace

void linear_cross_entropy(const Context& ctx, const TensorView& h, const TensorView& w, const TensorView& labels,
                          const TensorView& loss, const TensorView& dh, const TensorView& dw,
                          const CrossEntropyOptions& opts) {
  const std::int64_t t = h.dim(0), hidden = h.dim(1), vocab = w.dim(0);
  // The tokens go through in chunks: a chunk's logits [c, V] (fp32) come from one GEMM, its rows' loss terms and
  // gradient rows from rows_step, then its gradients' GEMMs. Memory: the logits and gradient rows of one chunk, by
  // default a 32nd of the tokens (at least 64): about 5% of the whole fp32 logits. The count of tokens n that the
  // mean divides by stays on the device: nothing here waits for it.
  if (t == 0) {
    qmm::zero(ctx, loss);
    return;
  }
  const Device dev = ctx.device();
  const std::int64_t chunk = opts.chunk_tokens > 0 ? std::min(opts.chunk_tokens, t)
                                                   : std::min(t, std::max<std::int64_t>(64, (t + 31) / 32));
  const bool grads = !dh.empty() || !dw.empty();
  // Temporaries from the stream-ordered pool: nothing waits for the device, and a graph capture can hold the call.
  // Each piece starts on a 256-byte boundary (the pool's blocks do): GEMM operands and fp64 sums stay aligned.
  const auto padded = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  const std::size_t logits_bytes = padded(static_cast<std::size_t>(chunk * vocab) * 4);
  const std::size_t g_bytes = grads ? padded(static_cast<std::size_t>(chunk * vocab) * dtype_size(h.dtype())) : 0;
  const std::size_t loss_bytes = padded(static_cast<std::size_t>(t) * 8);
  set_device(ctx);
  ScratchBuffer scratch(state(ctx), logits_bytes + g_bytes + loss_bytes + 16);
  auto* base = static_cast<std::uint8_t*>(scratch.data());
  const TensorView logits(base, DType::F32, {chunk, vocab}, dev);
  const TensorView g = grads ? TensorView(base + logits_bytes, h.dtype(), {chunk, vocab}, dev) : TensorView();
  const TensorView row_loss(base + logits_bytes + g_bytes, DType::U8, {8 * t}, dev);
  const TensorView stats(base + logits_bytes + g_bytes + loss_bytes, DType::U8, {16}, dev);
  label_stats(ctx, labels, vocab, opts.ignore_index, stats);
  const std::size_t h_row = static_cast<std::size_t>(hidden) * dtype_size(h.dtype());
  auto rows = [](const TensorView& base, std::int64_t first, std::size_t row_bytes, Shape shape) {
    return TensorView(static_cast<std::uint8_t*>(base.data()) + static_cast<std::size_t>(first) * row_bytes,
                      base.dtype(), shape, base.device());
  };
  for (std::int64_t first = 0; first < t; first += chunk) {
    const std::int64_t c = std::min(chunk, t - first);
    const TensorView hc = rows(h, first, h_row, {c, hidden}), zc = rows(logits, 0, 0, {c, vocab});
    const TensorView gc = grads ? rows(g, 0, 0, {c, vocab}) : TensorView();
    qmm::gemm_bt(ctx, hc, w, zc);
    rows_step(ctx, zc, rows(labels, first, 4, {c}), opts.ignore_index, stats, gc, rows(row_loss, first, 8, {8 * c}));
    if (!dh.empty()) qmm::gemm(ctx, gc, w, rows(dh, first, h_row, {c, hidden}));
    if (!dw.empty()) qmm::gemm_backward_b(ctx, gc, hc, dw, {1.0f, 1.0f});
  }
  mean_step(ctx, row_loss, stats, loss);
}

}  // namespace qmm::cuda
