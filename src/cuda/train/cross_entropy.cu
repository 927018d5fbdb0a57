// linear_cross_entropy's steps on the GPU. label_stats counts the tokens that are not ignored (n) and the labels out
// of range on the device, so that nothing waits for the host. Two ways through the logits, by
// linear_cross_entropy_chunks' plan:
// - the vocabulary whole (dw wanted, or a chunk of tokens' whole rows fit in the memory budget): one block per row
//   of a chunk of logits (in h's dtype, as a model's head writes them); a first pass keeps each thread's running
//   maximum and sum of exponentials, the block combines them into the row's log-sum-exp (fp32), thread 0 writes the
//   row's loss term, and a second pass writes the gradient row (softmax - onehot) / n over the logits, which the
//   gradients' GEMMs then read;
// - the vocabulary in chunks: per chunk of a row, the chunk's maximum, then p = exp(z - m) over the logits with m
//   the row's running maximum (raised, and what came before rescaled, only when the chunk's exceeds it by more than
//   kShiftSlack), the label's p set aside; dh's f32 accumulator adds p·W_chunk (a GEMM), and a last step per row
//   makes dh = (acc + p_label·W_label) / l - W_label, scaled by 1/n, and the loss term m + log(l) - z_label.
// A label out of range gives a NaN loss term and gradient row.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

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

// Pack i of a row: kVec values 16 bytes at a time where kPacked, else one value.
template <class Z, bool kPacked, int kVec = kPacked ? Elem<Z>::kVec : 1>
__device__ __forceinline__ void load_pack(const Z* z, std::int64_t i, float (&v)[kVec]) {
  if constexpr (kPacked) Elem<Z>::load_vec(z, i, v);
  else v[0] = Elem<Z>::load(z, i);
}
template <class Z, bool kPacked, int kVec = kPacked ? Elem<Z>::kVec : 1>
__device__ __forceinline__ void store_pack(Z* z, std::int64_t i, const float (&v)[kVec]) {
  if constexpr (kPacked) Elem<Z>::store_vec(z, i, v);
  else Elem<Z>::store(z, i, v[0]);
}

// The block's (maximum, sum of exp(x - maximum)) over a row's packs, in thread 0's m and s (the other threads'
// are partial); one pass, one expf per value.
template <class Z, bool kPacked>
__device__ __forceinline__ void block_max_sum(const Z* z, std::int64_t packs, float& m, float& s) {
  constexpr int kVec = kPacked ? Elem<Z>::kVec : 1;
  m = -INFINITY;
  s = 0.0f;
  for (std::int64_t i = threadIdx.x; i < packs; i += kThreads) {
    float v[kVec];
    load_pack<Z, kPacked>(z, i, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) push(m, s, v[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_down_sync(0xFFFFFFFFu, m, o), s2 = __shfl_down_sync(0xFFFFFFFFu, s, o);
    combine(m, s, m2, s2);
  }
  __shared__ float warp_m[kThreads / 32], warp_s[kThreads / 32];
  if ((threadIdx.x & 31) == 0) {
    warp_m[threadIdx.x >> 5] = m;
    warp_s[threadIdx.x >> 5] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kThreads / 32; ++w) combine(m, s, warp_m[w], warp_s[w]);
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
  float m, s;
  block_max_sum<Z, kPacked>(z, packs, m, s);
  __shared__ float lse_shared;
  if (threadIdx.x == 0) {
    const float lse = m + logf(s);
    lse_shared = lse;
    row_loss[row] = static_cast<double>(lse) - static_cast<double>(E::load(z, label));
  }
  __syncthreads();  // z[label] is read before the gradient overwrites it
  if (!want_g) return;
  const float lse = lse_shared;
  const float inv_n = 1.0f / static_cast<float>(stats[0]);  // n >= 1: this row counts
  for (std::int64_t i = threadIdx.x; i < packs; i += kThreads) {
    float v[kVec];
    load_pack<Z, kPacked>(z, i, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = (expf(v[j] - lse) - (i * kVec + j == label ? 1.0f : 0.0f)) * inv_n;
    store_pack<Z, kPacked>(z, i, v);
  }
}

// The largest value, over the block (every thread gets it).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_v[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if ((threadIdx.x & 31) == 0) warp_v[threadIdx.x >> 5] = v;
  __syncthreads();
  v = warp_v[0];
  for (int w = 1; w < kThreads / 32; ++w) v = fmaxf(v, warp_v[w]);
  __syncthreads();  // warp_v free for the next call
  return v;
}

// The sum over the block, for thread 0.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_v[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, o);
  if ((threadIdx.x & 31) == 0) warp_v[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kThreads / 32; ++w) v += warp_v[w];
  return v;
}

// How far above the running maximum a chunk's maximum may lie before the row is rescaled to it: exp(z - m) then
// stays below e^16, far inside bf16's and fp32's range, and rows rarely pay for a rescale.
constexpr float kShiftSlack = 16.0f;

// A row's running state over vocabulary chunks: m the shift (the maximum so far, up to kShiftSlack below it), l the
// sum of exp(z - m), p_label = exp(z_label - m) once the label's chunk has passed (0 before), z_label that logit.
struct RowState {
  float m, l, p_label, z_label;
};

// One block per row of one vocabulary chunk of logits z [rows, cols] (columns first_col.. of the vocabulary).
// want_p: the chunk's maximum first, the shift raised where it exceeds the running one by more than kShiftSlack
// (l, p_label and the row of acc [rows, hidden] rescaled to it), then p = exp(z - m) written over z with the
// label's column set to 0 and kept in the state. Without: the chunk's (maximum, sum) in one pass, joined to the
// state. Ignored rows and labels out of range are left to the finishing step.
// kHeld > 0 (16-byte packs only): each thread keeps its packs tid, tid + kThreads, ... (at most kHeld) in registers
// between the maximum and the exponentials, so z is read once; 0: both passes read z.
template <class Z, bool kPacked, int kHeld>
__global__ void __launch_bounds__(kThreads)
    online_rows_kernel(Z* logits, std::int64_t cols, std::int64_t first_col, const std::int32_t* labels,
                       std::int64_t vocab, std::int32_t ignore_index, bool first_chunk, RowState* states, float* acc,
                       std::int64_t hidden, bool want_p) {
  using E = Elem<Z>;
  constexpr int kVec = kPacked ? E::kVec : 1;
  static_assert(kHeld == 0 || kPacked, "held packs are 16-byte packs");
  const std::int64_t row = blockIdx.x;
  const std::int32_t label = labels[row];
  if (label == ignore_index || label < 0 || label >= vocab) return;
  Z* z = logits + row * cols;
  const std::int64_t packs = cols / kVec, label_col = label - first_col;  // in this chunk where in [0, cols)
  __shared__ RowState st;
  __shared__ float scale_s;
  if (!want_p) {  // the loss alone: the chunk's (maximum, sum) in one pass, joined to the row's
    float m, s;
    block_max_sum<Z, kPacked>(z, packs, m, s);
    if (threadIdx.x != 0) return;
    RowState r = first_chunk ? RowState{-INFINITY, 0.0f, 0.0f, 0.0f} : states[row];
    combine(r.m, r.l, m, s);
    if (0 <= label_col && label_col < cols) r.z_label = E::load(z, label_col);
    states[row] = r;
    return;
  }
  uint4 held[kHeld > 0 ? kHeld : 1];
  float cm = -INFINITY;
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int j = 0; j < kHeld; ++j) {
      const std::int64_t i = threadIdx.x + std::int64_t{kThreads} * j;
      if (i >= packs) continue;
      held[j] = reinterpret_cast<const uint4*>(z)[i];
      float v[kVec];
      E::unpack(held[j], v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) cm = fmaxf(cm, v[k]);
    }
  } else {
    for (std::int64_t i = threadIdx.x; i < packs; i += kThreads) {
      float v[kVec];
      load_pack<Z, kPacked>(z, i, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) cm = fmaxf(cm, v[j]);
    }
  }
  cm = block_max(cm);
  if (threadIdx.x == 0) {
    RowState r = first_chunk ? RowState{cm, 0.0f, 0.0f, 0.0f} : states[row];
    float scale = 1.0f;
    if (!first_chunk && cm > r.m + kShiftSlack) {
      scale = expf(r.m - cm);
      r.m = cm;
      r.l *= scale;
      r.p_label *= scale;
    }
    st = r;
    scale_s = scale;
  }
  __syncthreads();
  const float m = st.m, scale = scale_s;
  if (scale != 1.0f && acc != nullptr)  // what the earlier chunks added, brought to the new shift
    for (std::int64_t k = threadIdx.x; k < hidden; k += kThreads) acc[row * hidden + k] *= scale;
  float sum = 0.0f;
  const auto exponentials = [&](std::int64_t i, float(&v)[kVec]) {  // pack i: p over z, the label's set aside
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float p = expf(v[j] - m);  // a NaN logit makes l NaN, and with it the loss and the dh row
      sum += p;
      if (i * kVec + j == label_col) {  // the label's term joins at the end, in fp32
        st.p_label = p;
        st.z_label = v[j];
        v[j] = 0.0f;
      } else {
        v[j] = p;
      }
    }
    store_pack<Z, kPacked>(z, i, v);
  };
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int j = 0; j < kHeld; ++j) {
      const std::int64_t i = threadIdx.x + std::int64_t{kThreads} * j;
      if (i >= packs) continue;
      float v[kVec];
      E::unpack(held[j], v);
      exponentials(i, v);
    }
  } else {
    for (std::int64_t i = threadIdx.x; i < packs; i += kThreads) {
      float v[kVec];
      load_pack<Z, kPacked>(z, i, v);
      exponentials(i, v);
    }
  }
  sum = block_sum(sum);  // its barrier also orders the label's st writes before thread 0's read
  if (threadIdx.x != 0) return;
  st.l += sum;
  states[row] = st;
}

// One block per row, after the last vocabulary chunk: the row's loss term m + log(l) - z_label into row_loss (0 for
// an ignored row, NaN for a label out of range) and, where dh is given, its row (acc / l + (p_label / l - 1)·w[label])
// / n in h's dtype (0 for an ignored row, NaN for a label out of range).
template <class Z>
__global__ void __launch_bounds__(kThreads)
    online_finish_kernel(const RowState* states, const float* acc, const Z* w, const std::int32_t* labels,
                         std::int64_t vocab, std::int32_t ignore_index, std::int64_t hidden, const long long* stats,
                         Z* dh, double* row_loss) {
  using E = Elem<Z>;
  const std::int64_t row = blockIdx.x;
  const std::int32_t label = labels[row];
  if (label == ignore_index || label < 0 || label >= vocab) {
    const float fill = label == ignore_index ? 0.0f : NAN;
    if (threadIdx.x == 0) row_loss[row] = fill;
    if (dh != nullptr)
      for (std::int64_t k = threadIdx.x; k < hidden; k += kThreads) E::store(dh, row * hidden + k, fill);
    return;
  }
  const RowState r = states[row];
  if (threadIdx.x == 0)
    row_loss[row] = static_cast<double>(r.m) + std::log(static_cast<double>(r.l)) - static_cast<double>(r.z_label);
  if (dh == nullptr) return;
  const float inv_l = 1.0f / r.l, inv_n = 1.0f / static_cast<float>(stats[0]);  // n >= 1: this row counts
  const float label_coef = r.p_label * inv_l - 1.0f;
  const Z* wl = w + static_cast<std::int64_t>(label) * hidden;
  for (std::int64_t k = threadIdx.x; k < hidden; k += kThreads)
    E::store(dh, row * hidden + k, (acc[row * hidden + k] * inv_l + label_coef * E::load(wl, k)) * inv_n);
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

// One vocabulary chunk's rows (online_rows_kernel) over its logits z [rows, cols], columns first_col.. .
void online_rows_step(const Context& ctx, const TensorView& logits, std::int64_t first_col, std::int64_t vocab,
                      const TensorView& labels, std::int32_t ignore_index, bool first_chunk, RowState* states,
                      float* acc, std::int64_t hidden, bool want_p) {
  const std::int64_t rows = logits.dim(0), cols = logits.dim(1);
  const auto* lab = labels.data_as<const std::int32_t>();
  const bool packed = (cols * static_cast<std::int64_t>(dtype_size(logits.dtype()))) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(logits.data()) % 16 == 0;
  const auto launch = [&](auto* z) {
    using Z = std::remove_pointer_t<decltype(z)>;
    // The exponentials' pass from registers where a thread's share of the chunk fits 8 or 16 packs.
    const std::int64_t packs = cols / Elem<Z>::kVec;
    const auto kernel = !packed                                ? online_rows_kernel<Z, false, 0>
                        : !want_p                              ? online_rows_kernel<Z, true, 0>
                        : packs <= std::int64_t{8} * kThreads  ? online_rows_kernel<Z, true, 8>
                        : packs <= std::int64_t{16} * kThreads ? online_rows_kernel<Z, true, 16>
                                                               : online_rows_kernel<Z, true, 0>;
    kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream_of(ctx)>>>(
        z, cols, first_col, lab, vocab, ignore_index, first_chunk, states, acc, hidden, want_p);
  };
  if (logits.dtype() == DType::F32) launch(logits.data_as<float>());
  else launch(static_cast<__nv_bfloat16*>(logits.data()));
  QMM_CUDA_CHECK_LAUNCH("online_rows_kernel");
}

// The rows' loss terms and, where dh is given, their dh rows, from their states after the last vocabulary chunk.
void online_finish_step(const Context& ctx, const RowState* states, const float* acc, const TensorView& w,
                        const TensorView& labels, std::int32_t ignore_index, const TensorView& stats,
                        const TensorView& dh, double* row_loss) {
  const std::int64_t rows = labels.dim(0), vocab = w.dim(0), hidden = w.dim(1);
  const auto* lab = labels.data_as<const std::int32_t>();
  const auto* st = static_cast<const long long*>(stats.data());
  const auto launch = [&](auto* wp) {
    using Z = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    online_finish_kernel<Z><<<static_cast<unsigned>(rows), kThreads, 0, stream_of(ctx)>>>(
        states, acc, wp, lab, vocab, ignore_index, hidden, st, dh.empty() ? nullptr : static_cast<Z*>(dh.data()),
        row_loss);
  };
  if (w.dtype() == DType::F32) launch(w.data_as<const float>());
  else launch(static_cast<const __nv_bfloat16*>(w.data()));
  QMM_CUDA_CHECK_LAUNCH("online_finish_kernel");
}

}  // namespace

void linear_cross_entropy(const Context& ctx, const TensorView& h, const TensorView& w, const TensorView& labels,
                          const TensorView& loss, const TensorView& dh, const TensorView& dw,
                          const CrossEntropyOptions& opts) {
  const std::int64_t t = h.dim(0), hidden = h.dim(1), vocab = w.dim(0);
  // Chunks of tokens and of the vocabulary (linear_cross_entropy_chunks): a chunk's logits in h's dtype come from
  // one GEMM (fp32 sums), then a row kernel, then the gradients' GEMMs. The count of tokens n that the mean divides
  // by stays on the device: nothing here waits for it.
  if (t == 0) {
    qmm::zero(ctx, loss);
    if (!dw.empty() && !opts.accumulate_dw) qmm::zero(ctx, dw);  // written: a zero gradient
    return;
  }
  const Device dev = ctx.device();
  const CrossEntropyChunks plan =
      linear_cross_entropy_chunks(t, hidden, vocab, h.dtype(), !dh.empty(), !dw.empty(), opts);
  const std::int64_t chunk = plan.tokens, cols = plan.vocab, es = static_cast<std::int64_t>(dtype_size(h.dtype()));
  const bool split = cols < vocab, grads = !dh.empty() || !dw.empty();
  // Temporaries from the stream-ordered pool: nothing waits for the device, and a graph capture can hold the call.
  // The pieces linear_cross_entropy_chunks counts, each on a 256-byte boundary (the pool's blocks start on one):
  // GEMM operands and fp64 sums stay aligned.
  const auto padded = [](std::int64_t bytes) { return static_cast<std::size_t>((bytes + 255) / 256 * 256); };
  set_device(ctx);
  ScratchBuffer scratch(state(ctx), static_cast<std::size_t>(plan.extra_bytes));
  auto* next = static_cast<std::uint8_t*>(scratch.data());
  const auto carve = [&next](std::size_t bytes) { return std::exchange(next, next + bytes); };
  std::uint8_t* logits_base = carve(padded(chunk * cols * es));
  const TensorView row_loss(carve(padded(t * 8)), DType::U8, {8 * t}, dev);
  float* acc = split && !dh.empty() ? reinterpret_cast<float*>(carve(padded(chunk * hidden * 4))) : nullptr;
  auto* states = split ? reinterpret_cast<RowState*>(carve(padded(chunk * 16))) : nullptr;
  const TensorView stats(carve(16), DType::U8, {16}, dev);
  label_stats(ctx, labels, vocab, opts.ignore_index, stats);
  const std::size_t h_row = static_cast<std::size_t>(hidden) * static_cast<std::size_t>(es);
  auto rows = [](const TensorView& base, std::int64_t first, std::size_t row_bytes, Shape shape) {
    return TensorView(static_cast<std::uint8_t*>(base.data()) + static_cast<std::size_t>(first) * row_bytes,
                      base.dtype(), shape, base.device());
  };
  for (std::int64_t first = 0; first < t; first += chunk) {
    const std::int64_t c = std::min(chunk, t - first);
    const TensorView hc = rows(h, first, h_row, {c, hidden}), lc = rows(labels, first, 4, {c});
    if (!split) {
      const TensorView zc(logits_base, h.dtype(), {c, vocab}, dev);
      qmm::gemm_bt(ctx, hc, w, zc);
      rows_step(ctx, zc, lc, opts.ignore_index, stats, grads, rows(row_loss, first, 8, {8 * c}));
      if (!dh.empty()) qmm::gemm(ctx, zc, w, rows(dh, first, h_row, {c, hidden}));
      const float dw_beta = first == 0 && !opts.accumulate_dw ? 0.0f : 1.0f;  // the first chunk overwrites, or adds
      if (!dw.empty()) qmm::gemm_backward_b(ctx, zc, hc, dw, {1.0f, dw_beta});
      continue;
    }
    const TensorView acc_c = acc == nullptr ? TensorView() : TensorView(acc, DType::F32, {c, hidden}, dev);
    for (std::int64_t v0 = 0; v0 < vocab; v0 += cols) {
      const std::int64_t vc = std::min(cols, vocab - v0);
      const TensorView zc(logits_base, h.dtype(), {c, vc}, dev), wc = rows(w, v0, h_row, {vc, hidden});
      qmm::gemm_bt(ctx, hc, wc, zc);
      online_rows_step(ctx, zc, v0, vocab, lc, opts.ignore_index, v0 == 0, states, acc, hidden, acc != nullptr);
      if (acc != nullptr) qmm::gemm(ctx, zc, wc, acc_c, {1.0f, v0 == 0 ? 0.0f : 1.0f});
    }
    online_finish_step(ctx, states, acc, w, lc, opts.ignore_index, stats,
                       dh.empty() ? dh : rows(dh, first, h_row, {c, hidden}),
                       reinterpret_cast<double*>(rows(row_loss, first, 8, {8 * c}).data()));
  }
  mean_step(ctx, row_loss, stats, loss);
}

}  // namespace qmm::cuda
