// Rotary position embedding on the GPU, a block per token (b, s), or per few tokens where they have few heads, over
// every head of q and k in one launch.
// Thread (x, y) of a block owns V consecutive columns j of the first half (and their partners j + D/2): it loads
// the token's cos and sin there once into registers, then rotates those columns in heads y, y + blockDim.y, ...
// Each load and store is V elements wide: 16 bytes where D/2 and the pointers allow, else two elements (bf16x2,
// float2), else one. A warp reads whole 16-byte pieces of a head's halves: memory-bound, near copy bandwidth.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/elem.cuh"
#include "cuda/cuda_backend.h"

namespace qmm::cuda {
namespace {

using common::Elem;
constexpr int kMaxThreads = 256;
// At least 4 full blocks per SM (half its threads) caps registers at 64: the 16-byte path needs ~72 otherwise, and
// then fewer loads would be in flight than Hopper's copy bandwidth needs (it does not spill at 64).
constexpr int kMinBlocks = 4;

// V elements loaded or stored as one aligned access (the caller checks the alignment).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V, class T>
__device__ __forceinline__ void load_pack(const T* p, float (&x)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) x[i] = Elem<T>::load(pk.v, i);
}

template <int V, class T>
__device__ __forceinline__ void store_pack(T* p, const float (&x)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int i = 0; i < V; ++i) Elem<T>::store(pk.v, i, x[i]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

// y1 = x1·c1 − x2·a, y2 = x2·c2 + x1·b with (a, b) = (s1, s2) forward and (−s2, −s1) inverse (the transpose).
// q and q_out (k and k_out) may be the same memory: each element is read by the one thread that writes it.
template <class T, class C, int V>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    rope_kernel(const T* q, const T* k, const C* __restrict__ cos, const C* __restrict__ sin, T* q_out, T* k_out,
                std::int64_t tokens, std::int64_t seq, std::int64_t heads_q, std::int64_t heads_k, std::int64_t half,
                bool per_batch, bool inverse) {
  const std::int64_t dim = 2 * half;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.z + threadIdx.z; t < tokens;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.z) {
    const std::int64_t row = (per_batch ? t : t % seq) * dim;
    for (std::int64_t j = static_cast<std::int64_t>(threadIdx.x) * V; j < half; j += std::int64_t{blockDim.x} * V) {
      float c1[V], c2[V], s1[V], s2[V], a[V], b[V];
      load_pack<V>(cos + row + j, c1);
      load_pack<V>(cos + row + half + j, c2);
      load_pack<V>(sin + row + j, s1);
      load_pack<V>(sin + row + half + j, s2);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        a[i] = inverse ? -s2[i] : s1[i];
        b[i] = inverse ? -s1[i] : s2[i];
      }
      for (std::int64_t h = threadIdx.y; h < heads_q + heads_k; h += blockDim.y) {
        const bool in_q = h < heads_q;
        const std::int64_t at = in_q ? (t * heads_q + h) * dim + j : (t * heads_k + (h - heads_q)) * dim + j;
        const T* x = (in_q ? q : k) + at;
        T* y = (in_q ? q_out : k_out) + at;
        float x1[V], x2[V], y1[V], y2[V];
        load_pack<V>(x, x1);
        load_pack<V>(x + half, x2);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          y1[i] = fmaf(x1[i], c1[i], -(x2[i] * a[i]));
          y2[i] = fmaf(x2[i], c2[i], x1[i] * b[i]);
        }
        store_pack<V>(y, y1);
        store_pack<V>(y + half, y2);
      }
    }
  }
}

bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

template <class T, class C, int V>
void launch(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
            const TensorView& q_out, const TensorView& k_out, bool inverse) {
  const bool has_k = k.rank() == 4;
  const std::int64_t tokens = q.dim(0) * q.dim(1), half = q.dim(3) / 2;
  const std::int64_t heads_q = q.dim(2), heads_k = has_k ? k.dim(2) : 0, heads = heads_q + heads_k;
  if (heads == 0 || tokens == 0) return;
  // x threads across the columns, y threads across the heads, as few head rounds as fit kMaxThreads and every round
  // as full as the others (40 heads in 20 rows of 2, not 32 rows then 8), z threads across tokens where a token's
  // heads leave room (one head a token, as rope's [B·H, S, 1, D] view of a contiguous gradient has, would otherwise
  // make blocks of 8 threads).
  const std::int64_t tx = std::min<std::int64_t>(half / V, kMaxThreads);
  const std::int64_t rounds = (heads + kMaxThreads / tx - 1) / (kMaxThreads / tx);
  const std::int64_t ty = (heads + rounds - 1) / rounds;
  const std::int64_t tz = std::clamp<std::int64_t>(kMaxThreads / (tx * ty), 1, std::min<std::int64_t>(tokens, 64));
  const auto blocks =
      static_cast<unsigned>(std::min<std::int64_t>((tokens + tz - 1) / tz, std::numeric_limits<int>::max()));
  const dim3 threads(static_cast<unsigned>(tx), static_cast<unsigned>(ty), static_cast<unsigned>(tz));
  rope_kernel<T, C, V><<<blocks, threads, 0, stream_of(ctx)>>>(
      q.data_as<const T>(), has_k ? k.data_as<const T>() : nullptr, cos.data_as<const C>(), sin.data_as<const C>(),
      q_out.data_as<T>(), has_k ? k_out.data_as<T>() : nullptr, tokens, q.dim(1), heads_q, heads_k, half,
      cos.dim(0) != 1, inverse);
  QMM_CUDA_CHECK_LAUNCH("rope_kernel");
}

// The widest access that D/2 and every pointer allow: 16 bytes of x, else two elements, else one.
template <class T, class C>
void dispatch(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos,
              const TensorView& sin, const TensorView& q_out, const TensorView& k_out, bool inverse) {
  const std::int64_t half = q.dim(3) / 2;
  const auto fits = [&](int v) {
    const std::size_t xb = sizeof(T) * static_cast<std::size_t>(v), cb = sizeof(C) * static_cast<std::size_t>(v);
    return half % v == 0 && aligned(q.data(), xb) && aligned(q_out.data(), xb) && aligned(k.data(), xb) &&
           aligned(k_out.data(), xb) && aligned(cos.data(), cb) && aligned(sin.data(), cb);
  };
  constexpr int kWide = 16 / static_cast<int>(sizeof(T));
  if (fits(kWide))
    launch<T, C, kWide>(ctx, q, k, cos, sin, q_out, k_out, inverse);
  else if (fits(2))
    launch<T, C, 2>(ctx, q, k, cos, sin, q_out, k_out, inverse);
  else
    launch<T, C, 1>(ctx, q, k, cos, sin, q_out, k_out, inverse);
}

}  // namespace

void rope(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
          const TensorView& q_out, const TensorView& k_out, bool inverse) {
  set_device(ctx);
  if (q.dtype() == DType::F32)
    dispatch<float, float>(ctx, q, k, cos, sin, q_out, k_out, inverse);
  else if (cos.dtype() == DType::F32)
    dispatch<__nv_bfloat16, float>(ctx, q, k, cos, sin, q_out, k_out, inverse);
  else
    dispatch<__nv_bfloat16, __nv_bfloat16>(ctx, q, k, cos, sin, q_out, k_out, inverse);
}

}  // namespace qmm::cuda
