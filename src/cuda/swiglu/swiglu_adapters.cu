// SwiGLU with the adapters' low-rank terms added to its inputs inside the kernel (ops.h, SwiGluAdapters):
//   g' = gate + sg·t_g·b_gᵀ,  u' = up + su·t_u·b_uᵀ,  then h = silu(g')·u' (forward) or dgate, dup at (g', u').
// The sums g' and u' are never stored: the backward recomputes them from the same t and b, so an adapter's second
// product costs no pass over [M, N] of its own (a separate y += s·t·bᵀ GEMM reads and writes all of it).
//
// bf16 with ranks up to 32 (kMaxMmaRank): a warp owns a strip of 64 columns, holds that strip's b fragments in
// registers and walks 16-row tiles; each tile's terms are mma.sync m16n8k16 products (fp32 accumulation) whose
// column order is permuted so that every lane's accumulators are 2 x 8 consecutive columns of two rows, the 16-byte
// vectors it loads and stores. Other cases (f32, larger ranks) run a plain kernel, one element a thread.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/elem.cuh"
#include "cuda/common/sm80_ptx.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/swiglu/swiglu.cuh"

namespace qmm::cuda {
namespace {

using common::Elem;
using common::mma_bf16_16816;
using swiglu_detail::swiglu_grad;
using swiglu_detail::swiglu_value;

constexpr int kMaxMmaRank = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kStripCols = 64;
constexpr int kTileRows = 16;

// One launch's operands: every [M, N] tensor dense (row stride N). Forward: out0 = h. Backward: out0 = dgate,
// out1 = dup (each may be exactly gate / up: every element is loaded before it is stored, by the same thread).
template <class T>
struct Args {
  const T* gate;
  const T* up;
  const T* dh;
  T* out0;
  T* out1;
  std::int64_t m, n;
  const T* t;  // [M, ldt]: t_g in columns [0, rg), t_u in [rg, rg + ru)
  std::int64_t ldt;
  const T* bg;  // [N, rg]
  const T* bu;  // [N, ru]
  int rg, ru;
  float sg, su;
  std::int64_t rows_per_group;  // a multiple of kTileRows
  bool vec;                     // 16-byte vectors: N % 8 == 0 and every [M, N] pointer 16-byte aligned
};

__device__ __forceinline__ std::uint32_t pack_bf16(const __nv_bfloat16* p, std::int64_t i, bool ok0, bool ok1) {
  const std::uint16_t lo = ok0 ? __bfloat16_as_ushort(p[i]) : 0, hi = ok1 ? __bfloat16_as_ushort(p[i + 1]) : 0;
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

// The strip's column for mma tile j's B column nl (0..7): lane q's accumulator columns 2q, 2q + 1 of tiles 0..3
// become columns 8q.. 8q + 7, and of tiles 4..7 columns 32 + 8q.., so each lane's values are two 16-byte runs.
__device__ __forceinline__ int strip_col(int j, int nl) { return 32 * (j / 4) + 8 * (nl / 2) + 2 * (j % 4) + nl % 2; }

// B fragments of one term for the strip at col0: b is [N, r] (the mma's column-major B, k contiguous).
template <int KS>
__device__ __forceinline__ void load_b_frags(std::uint32_t (&f)[8][KS > 0 ? KS : 1][2], const __nv_bfloat16* b, int r,
                                             std::int64_t col0, std::int64_t n, int lane) {
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::int64_t col = col0 + strip_col(j, g);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = ks * 16 + 8 * h + 2 * q;
        const bool in = col < n;
        f[j][ks][h] = pack_bf16(b, col * r + k, in && k < r, in && k + 1 < r);
      }
    }
  }
}

// The A fragments of one term for the tile at row0: t's columns c0.. c0 + r (zeros past r and past M).
template <int KS>
__device__ __forceinline__ void load_a_frags(std::uint32_t (&a)[KS > 0 ? KS : 1][4], const __nv_bfloat16* t,
                                             std::int64_t ldt, int c0, int r, std::int64_t row0, std::int64_t m,
                                             int lane) {
  const int g = lane / 4, q = lane % 4;
  const std::int64_t ra = row0 + g, rb = row0 + g + 8;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const int k = ks * 16 + 2 * q;
    a[ks][0] = pack_bf16(t, ra * ldt + c0 + k, ra < m && k < r, ra < m && k + 1 < r);
    a[ks][1] = pack_bf16(t, rb * ldt + c0 + k, rb < m && k < r, rb < m && k + 1 < r);
    a[ks][2] = pack_bf16(t, ra * ldt + c0 + k + 8, ra < m && k + 8 < r, ra < m && k + 9 < r);
    a[ks][3] = pack_bf16(t, rb * ldt + c0 + k + 8, rb < m && k + 8 < r, rb < m && k + 9 < r);
  }
}

// acc[jj] = the term's mma tiles 4 * half + jj (fp32).
template <int KS>
__device__ __forceinline__ void term_half(float (&acc)[4][4], const std::uint32_t (&a)[KS > 0 ? KS : 1][4],
                                          const std::uint32_t (&bf)[8][KS > 0 ? KS : 1][2], int half) {
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[jj][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) mma_bf16_16816(acc[jj], a[ks], bf[4 * half + jj][ks][0], bf[4 * half + jj][ks][1]);
  }
}

// 8 consecutive bf16 elements (row, col..) of an [M, N] tensor: one 16-byte load where it fits, else one by one
// (zeros outside the tensor).
__device__ __forceinline__ uint4 load8(const __nv_bfloat16* p, std::int64_t row, std::int64_t col, std::int64_t m,
                                       std::int64_t n, bool vec) {
  if (row < m && vec && col + 8 <= n) return *reinterpret_cast<const uint4*>(p + row * n + col);
  std::uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e)
    w[e] = pack_bf16(p, row * n + col + 2 * e, row < m && col + 2 * e < n, row < m && col + 2 * e + 1 < n);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, std::int64_t row, std::int64_t col, std::int64_t m,
                                       std::int64_t n, bool vec, const float (&x)[8]) {
  using E = Elem<__nv_bfloat16>;
  if (row >= m) return;
  if (vec && col + 8 <= n) {
    E::store_vec(p + row * n + col, 0, x);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (col + e < n) E::store(p, row * n + col + e, x[e]);
}

template <int KG, int KU, bool kBackward>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) swiglu_adapters_mma_kernel(Args<__nv_bfloat16> p) {
  using E = Elem<__nv_bfloat16>;
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const std::int64_t strip = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const std::int64_t col0 = strip * kStripCols;
  if (col0 >= p.n) return;  // a whole warp: nothing below synchronizes the block
  std::uint32_t bg[8][KG > 0 ? KG : 1][2], bu[8][KU > 0 ? KU : 1][2];
  load_b_frags<KG>(bg, p.bg, p.rg, col0, p.n, lane);
  load_b_frags<KU>(bu, p.bu, p.ru, col0, p.n, lane);
  const std::int64_t group_end = (static_cast<std::int64_t>(blockIdx.y) + 1) * p.rows_per_group;
  const std::int64_t row_end = group_end < p.m ? group_end : p.m;
  for (std::int64_t row0 = blockIdx.y * p.rows_per_group; row0 < row_end; row0 += kTileRows) {
    // The lane's runs c: row g + 8 * (c / 2), columns 32 * (c % 2) + 8q.. (every load issued before any math).
    uint4 gr[4], ur[4], dr[kBackward ? 4 : 1];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const std::int64_t row = row0 + g + 8 * (c / 2), col = col0 + 32 * (c % 2) + 8 * q;
      gr[c] = load8(p.gate, row, col, p.m, p.n, p.vec);
      ur[c] = load8(p.up, row, col, p.m, p.n, p.vec);
      if constexpr (kBackward) dr[c] = load8(p.dh, row, col, p.m, p.n, p.vec);
    }
    std::uint32_t ag[KG > 0 ? KG : 1][4], au[KU > 0 ? KU : 1][4];
    load_a_frags<KG>(ag, p.t, p.ldt, 0, p.rg, row0, p.m, lane);
    load_a_frags<KU>(au, p.t, p.ldt, p.rg, p.ru, row0, p.m, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float accg[4][4], accu[4][4];
      term_half<KG>(accg, ag, bg, half);
      term_half<KU>(accu, au, bu, half);
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const int c = 2 * rh + half;
        float gv[8], uv[8], dv[8], o0[8], o1[8];
        E::unpack(gr[c], gv);
        E::unpack(ur[c], uv);
        if constexpr (kBackward) E::unpack(dr[c], dv);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          // run c's element e is tile 4 * half + e / 2's accumulator 2 * rh + e % 2
          const float gp = KG > 0 ? gv[e] + p.sg * accg[e / 2][2 * rh + e % 2] : gv[e];
          const float up = KU > 0 ? uv[e] + p.su * accu[e / 2][2 * rh + e % 2] : uv[e];
          if constexpr (kBackward)
            swiglu_grad(gp, up, dv[e], o0[e], o1[e]);
          else
            o0[e] = swiglu_value(gp, up);
        }
        const std::int64_t row = row0 + g + 8 * rh, col = col0 + 32 * half + 8 * q;
        store8(p.out0, row, col, p.m, p.n, p.vec, o0);
        if constexpr (kBackward) store8(p.out1, row, col, p.m, p.n, p.vec, o1);
      }
    }
  }
}

// Any dtype and rank: one element a thread (grid-stride), the terms summed in k order in fp32.
template <class T, bool kBackward>
__global__ void __launch_bounds__(256) swiglu_adapters_plain_kernel(Args<T> p) {
  using E = Elem<T>;
  const std::int64_t total = p.m * p.n, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t row = i / p.n, col = i % p.n;
    float sg = 0.0f, su = 0.0f;
    for (int k = 0; k < p.rg; ++k) sg += E::load(p.t, row * p.ldt + k) * E::load(p.bg, col * p.rg + k);
    for (int k = 0; k < p.ru; ++k) su += E::load(p.t, row * p.ldt + p.rg + k) * E::load(p.bu, col * p.ru + k);
    const float gp = E::load(p.gate, i) + p.sg * sg, up = E::load(p.up, i) + p.su * su;
    if constexpr (kBackward) {
      float dg, du;
      swiglu_grad(gp, up, E::load(p.dh, i), dg, du);
      E::store(p.out0, i, dg);
      E::store(p.out1, i, du);
    } else {
      E::store(p.out0, i, swiglu_value(gp, up));
    }
  }
}

template <int KG, int KU, bool kBackward>
void launch_mma(const Context& ctx, Args<__nv_bfloat16> p) {
  const auto kernel = swiglu_adapters_mma_kernel<KG, KU, kBackward>;
  const std::int64_t strips = (p.n + kStripCols - 1) / kStripCols, tiles = (p.m + kTileRows - 1) / kTileRows;
  // Enough warps to fill the GPU twice over, each walking as many row tiles as that leaves (its b fragments are
  // loaded once per strip and row group).
  const std::int64_t want_warps = 2 * wave_blocks(ctx, kernel, kWarpsPerBlock * 32) * kWarpsPerBlock;
  const std::int64_t groups =
      std::clamp<std::int64_t>((want_warps + strips - 1) / strips, 1, std::min<std::int64_t>(tiles, 65535));
  p.rows_per_group = (tiles + groups - 1) / groups * kTileRows;
  const dim3 grid(static_cast<unsigned>((strips + kWarpsPerBlock - 1) / kWarpsPerBlock),
                  static_cast<unsigned>((p.m + p.rows_per_group - 1) / p.rows_per_group));
  kernel<<<grid, kWarpsPerBlock * 32, 0, stream_of(ctx)>>>(p);
  QMM_CUDA_CHECK_LAUNCH("swiglu_adapters_mma_kernel");
}

template <int KG, bool kBackward>
void launch_mma_ku(const Context& ctx, const Args<__nv_bfloat16>& p) {
  const int ku = (p.ru + 15) / 16;
  if (ku == 0)
    launch_mma<KG, 0, kBackward>(ctx, p);
  else if (ku == 1)
    launch_mma<KG, 1, kBackward>(ctx, p);
  else
    launch_mma<KG, 2, kBackward>(ctx, p);
}

template <bool kBackward>
void launch_mma_any(const Context& ctx, const Args<__nv_bfloat16>& p) {
  const int kg = (p.rg + 15) / 16;
  if (kg == 0)
    launch_mma_ku<0, kBackward>(ctx, p);
  else if (kg == 1)
    launch_mma_ku<1, kBackward>(ctx, p);
  else
    launch_mma_ku<2, kBackward>(ctx, p);
}

template <class T, bool kBackward>
void launch(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
            const TensorView& out0, const TensorView& out1, const SwiGluAdapters& ad) {
  Args<T> p{};
  p.gate = gate.data_as<const T>();
  p.up = up.data_as<const T>();
  p.dh = kBackward ? dh.data_as<const T>() : nullptr;
  p.out0 = out0.data_as<T>();
  p.out1 = kBackward ? out1.data_as<T>() : nullptr;
  p.m = gate.dim(0);
  p.n = gate.dim(1);
  p.t = ad.t.data_as<const T>();
  p.ldt = ad.t.dim(1);
  p.rg = ad.b_gate.empty() ? 0 : static_cast<int>(ad.b_gate.dim(1));
  p.ru = ad.b_up.empty() ? 0 : static_cast<int>(ad.b_up.dim(1));
  p.bg = p.rg > 0 ? ad.b_gate.data_as<const T>() : nullptr;
  p.bu = p.ru > 0 ? ad.b_up.data_as<const T>() : nullptr;
  p.sg = ad.gate_scale;
  p.su = ad.up_scale;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (p.rg <= kMaxMmaRank && p.ru <= kMaxMmaRank) {
      p.vec = p.n % 8 == 0 && aligned16(p.gate) && aligned16(p.up) && aligned16(p.out0) &&
              (!kBackward || (aligned16(p.dh) && aligned16(p.out1)));
      launch_mma_any<kBackward>(ctx, p);
      return;
    }
  }
  const auto kernel = swiglu_adapters_plain_kernel<T, kBackward>;
  kernel<<<grid_for(ctx, kernel, 256, p.m * p.n), 256, 0, stream_of(ctx)>>>(p);
  QMM_CUDA_CHECK_LAUNCH("swiglu_adapters_plain_kernel");
}

}  // namespace

void swiglu_adapters(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h,
                     const SwiGluAdapters& adapters) {
  set_device(ctx);
  if (h.dtype() == DType::BF16)
    launch<__nv_bfloat16, false>(ctx, gate, up, {}, h, {}, adapters);
  else
    launch<float, false>(ctx, gate, up, {}, h, {}, adapters);
}

void swiglu_adapters_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                              const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters) {
  set_device(ctx);
  if (dgate.dtype() == DType::BF16)
    launch<__nv_bfloat16, true>(ctx, gate, up, dh, dgate, dup, adapters);
  else
    launch<float, true>(ctx, gate, up, dh, dgate, dup, adapters);
}

}  // namespace qmm::cuda
