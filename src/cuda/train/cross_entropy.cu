// linear_cross_entropy's steps on the GPU. label_stats counts the tokens that are not ignored (n) and the labels out
// of range on the device, so that nothing waits for the host. The row step, one block per row of a chunk of logits
// (in h's dtype, as a model's head writes them): a first pass keeps each thread's running maximum and sum of
// exponentials (rescaled when the maximum grows), the block combines them into the row's log-sum-exp (fp32), thread
// 0 writes the row's loss term, and a second pass writes the gradient row (softmax - onehot) / n over the logits; a
// label out of range gives a NaN loss term and gradient row. linear_cross_entropy (at the end) runs the chunks'
// GEMMs around them.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/elem.cuh"
#include "cuda/cuda_backend.h"

namespace qmm::cuda {
namespace {

using common::Elem;
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

// (m, s) with s the sum of exp(x - m) over the values seen, m their maximum: one more value x, one expf.
__device__ __forceinline__ void push(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;  // m = -inf at first: s = 0 * 0 + 1
    m = x;
  } else if (x != -INFINITY) {
    s += expf(x - m);  // NaN x falls here and makes s NaN
  }
}

// One block per row of a chunk's logits z [rows, V] (Z = f32 or bf16): the row's loss term logsumexp(z) - z[label]
// into row_loss[row] and, with want_g, the gradient row (softmax(z) - onehot(label)) / n written over z in place.
// kPacked (16-byte accesses) needs V * sizeof(Z) a multiple of 16 and z 16-byte aligned.
template <class Z, bool kPacked>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(Z* logits, const std::int32_t* labels, std::int64_t vocab, std::int32_t ignore_index,
                              const long long* stats, bool want_g, double* row_loss) {
  using E = Elem<Z>;
  constexpr int kVec = kPacked ? E::kVec : 1;
  const std::int64_t row = blockIdx.x;
  Z* z = logits + row * vocab;
  const std::int32_t label = labels[row];
  if (label == ignore_index || label < 0 || label >= vocab) {
    const float fill = label == ignore_index ? 0.0f : NAN;
    if (threadIdx.x == 0) row_loss[row] = fill;
    if (want_g)
      for (std::int64_t v = threadIdx.x; v < vocab; v += kThreads) E::store(z, v, fill);
    return;
  }
  const std::int64_t packs = vocab / kVec;
  float m = -INFINITY, s = 0.0f;
  for (std::int64_t i = threadIdx.x; i < packs; i += kThreads) {
    float v[kVec];
    if constexpr (kPacked) E::load_vec(z, i, v);
    else v[0] = E::load(z, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) push(m, s, v[j]);
  }
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
    row_loss[row] = static_cast<double>(lse) - static_cast<double>(E::load(z, label));
  }
  __syncthreads();  // z[label] is read before the gradient overwrites it
  if (!want_g) return;
  const float lse = lse_shared;
  const float inv_n = 1.0f / static_cast<float>(stats[0]);  // n >= 1: this row counts
  for (std::int64_t i = threadIdx.x; i < packs; i += kThreads) {
    float v[kVec];
    if constexpr (kPacked) E::load_vec(z, i, v);
    else v[0] = E::load(z, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = (expf(v[j] - lse) - (i * kVec + j == label ? 1.0f : 0.0f)) * inv_n;
    if constexpr (kPacked) E::store_vec(z, i, v);
    else E::store(z, i, v[0]);
  }
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

// Over one chunk of logits z [rows, V] (f32 or bf16): each row's loss term logsumexp(z) - z[label] into
// row_loss[row] (fp64; 0 for an ignored row, NaN for a label out of range) and, with want_g, the gradient rows
// (softmax(z) - onehot(label)) / n written over z (0 for an ignored row, NaN for a label out of range).
void rows_step(const Context& ctx, const TensorView& logits, const TensorView& labels, std::int32_t ignore_index,
               const TensorView& stats, bool want_g, const TensorView& row_loss) {
  const std::int64_t rows = logits.dim(0), vocab = logits.dim(1);
  if (rows == 0) return;
  set_device(ctx);
  const auto* lab = labels.data_as<const std::int32_t>();
  auto* out = static_cast<double*>(row_loss.data());
  const auto* st = static_cast<const long long*>(stats.data());
  const unsigned blocks = static_cast<unsigned>(rows);
  // 16-byte accesses where every row starts on a 16-byte boundary (the chunk's buffer does)
  const bool packed = (vocab * static_cast<std::int64_t>(dtype_size(logits.dtype()))) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(logits.data()) % 16 == 0;
  const auto launch = [&](auto* z) {
    using Z = std::remove_pointer_t<decltype(z)>;
    const auto kernel = packed ? cross_entropy_rows_kernel<Z, true> : cross_entropy_rows_kernel<Z, false>;
    kernel<<<blocks, kThreads, 0, stream_of(ctx)>>>(z, lab, vocab, ignore_index, st, want_g, out);
  };
  if (logits.dtype() == DType::F32) launch(logits.data_as<float>());
  else launch(static_cast<__nv_bfloat16*>(logits.data()));
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
  // The tokens go through in chunks: a chunk's logits [c, V] in h's dtype come from one GEMM (fp32 sums), its rows'
  // loss terms and gradient rows (written over the logits) from rows_step, then its gradients' GEMMs. Each chunk
  // reads the whole head again: chunks large enough to keep the GEMMs compute-bound (see
  // linear_cross_entropy_chunk_tokens). The count of tokens n that the mean divides by stays on the device: nothing
  // here waits for it.
  if (t == 0) {
    qmm::zero(ctx, loss);
    if (!dw.empty() && !opts.accumulate_dw) qmm::zero(ctx, dw);  // written: a zero gradient
    return;
  }
  const Device dev = ctx.device();
  const std::int64_t row_bytes = vocab * static_cast<std::int64_t>(dtype_size(h.dtype()));
  const std::int64_t chunk = opts.chunk_tokens > 0
                                 ? std::min(opts.chunk_tokens, t)
                                 : linear_cross_entropy_chunk_tokens(t, vocab, h.dtype(), !dw.empty());
  const bool grads = !dh.empty() || !dw.empty();
  // Temporaries from the stream-ordered pool: nothing waits for the device, and a graph capture can hold the call.
  // Each piece starts on a 256-byte boundary (the pool's blocks do): GEMM operands and fp64 sums stay aligned.
  const auto padded = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  const std::size_t logits_bytes = padded(static_cast<std::size_t>(chunk * row_bytes));
  const std::size_t loss_bytes = padded(static_cast<std::size_t>(t) * 8);
  set_device(ctx);
  ScratchBuffer scratch(state(ctx), logits_bytes + loss_bytes + 16);
  auto* base = static_cast<std::uint8_t*>(scratch.data());
  const TensorView logits(base, h.dtype(), {chunk, vocab}, dev);
  const TensorView row_loss(base + logits_bytes, DType::U8, {8 * t}, dev);
  const TensorView stats(base + logits_bytes + loss_bytes, DType::U8, {16}, dev);
  label_stats(ctx, labels, vocab, opts.ignore_index, stats);
  const std::size_t h_row = static_cast<std::size_t>(hidden) * dtype_size(h.dtype());
  auto rows = [](const TensorView& base, std::int64_t first, std::size_t row_bytes, Shape shape) {
    return TensorView(static_cast<std::uint8_t*>(base.data()) + static_cast<std::size_t>(first) * row_bytes,
                      base.dtype(), shape, base.device());
  };
  for (std::int64_t first = 0; first < t; first += chunk) {
    const std::int64_t c = std::min(chunk, t - first);
    const TensorView hc = rows(h, first, h_row, {c, hidden}), zc = rows(logits, 0, 0, {c, vocab});
    qmm::gemm_bt(ctx, hc, w, zc);
    rows_step(ctx, zc, rows(labels, first, 4, {c}), opts.ignore_index, stats, grads,
              rows(row_loss, first, 8, {8 * c}));
    if (!dh.empty()) qmm::gemm(ctx, zc, w, rows(dh, first, h_row, {c, hidden}));
    const float dw_beta = first == 0 && !opts.accumulate_dw ? 0.0f : 1.0f;  // the first chunk overwrites, or adds
    if (!dw.empty()) qmm::gemm_backward_b(ctx, zc, hc, dw, {1.0f, dw_beta});
  }
  mean_step(ctx, row_loss, stats, loss);
}

}  // namespace qmm::cuda
