// SwiGLU with adapters' low-rank terms added to its operands inside the kernel (ops.h, SwiGluAdapters):
//   g' = gate + sg·t_g·b_gᵀ,  u' = up + su·t_u·b_uᵀ  (and in the backward dh' = dh + dt_d·a_d),
// then h = silu(g')·u' (forward), or dgate, dup at (g', u') and dh' (backward, which may also write h again).
// The sums are never stored: the backward recomputes them from the same t and b, so an adapter's second product
// costs no pass over [M, N] of its own (a separate y += s·t·bᵀ GEMM reads and writes all of it).
//
// bf16 with ranks up to 32 (kMaxMmaRank): a warp owns a strip of 32 columns, holds that strip's b fragments in
// registers and walks 16-row tiles; each tile's terms are mma.sync m16n8k16 products (fp32 accumulation) whose
// column order is permuted so that every lane's accumulators are 8 consecutive columns of two rows, the 16-byte
// vectors it loads and stores (64-column strips held too many registers for enough resident warps to keep the
// loads in flight). Other cases (f32, larger ranks) run a plain kernel, one element a thread.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/elem.cuh"
#include "cuda/common/sm80_ptx.cuh"
#include "cuda/common/waves.h"
#include "cuda/cuda_backend.h"
#include "cuda/swiglu/swiglu.cuh"

namespace qmm::cuda {
namespace {

using common::Elem;
using common::mma_bf16_16816;
using swiglu_detail::Sigmoid;
using swiglu_detail::sigmoid_pair;

constexpr int kMaxMmaRank = kSwiGluAdaptersMmaRank;
// Four warps a block with two tiles in flight each: more warps an SM than fewer, deeper pipelines, whose slots
// (the backward's gate, up, dh and three t runs a row) would limit the blocks an SM holds.
constexpr int kWarpsPerBlock = 4;
constexpr int kStages = 2;  // tiles in flight per warp
constexpr int kStripCols = 32;
constexpr int kTiles = kStripCols / 8;  // the strip's n8 mma tiles
constexpr int kTileRows = 16;

// One low-rank term t·bᵀ over [M, N]: t's row m at t + m·ldt (r columns), b's element (n, k) at b[n·bn + k·bk]
// (an adapter's B [N, r]: bn = r, bk = 1; its A [r, N]: bn = 1, bk = N). r = 0: no term.
template <class T>
struct Term {
  const T* t = nullptr;
  std::int64_t ldt = 0;
  const T* b = nullptr;
  std::int64_t bn = 0, bk = 0;
  int r = 0;
  int align = 0;  // t's rows hold vectors of this many elements (ldt and t 2·align-byte aligned); 0: none
  float scale = 1.0f;
};

// One launch's operands: every [M, N] tensor dense (row stride N). Forward: out0 = h. Backward: out0 = dgate,
// out1 = dup, hout = h where asked (dgate and dup may be exactly gate and up: every element is loaded before it is
// stored, by the same thread).
template <class T>
struct Args {
  const T* gate;
  const T* up;
  const T* dh;
  T* out0;
  T* out1;
  T* hout;
  std::int64_t m, n;
  Term<T> tg, tu, td;
  std::int64_t rows_per_group;  // a multiple of kTileRows
  bool vec;                     // 16-byte vectors: N % 8 == 0 and every [M, N] pointer 16-byte aligned
};

// silu(g)·u and, for the backward, dgate = dh·u·silu'(g), dup = dh·silu(g) (swiglu.cuh's formulas).
__device__ __forceinline__ void swiglu_all(float g, float u, float dh, float& dgate, float& dup, float& h) {
  const Sigmoid p = sigmoid_pair(g);
  const float silu = g * p.s;
  h = silu * u;
  dgate = dh * u * (p.s * (1.0f + g * p.oms));
  dup = dh * silu;
}

__device__ __forceinline__ std::uint32_t pack_bf16(const __nv_bfloat16* p, std::int64_t i0, std::int64_t i1, bool ok0,
                                                   bool ok1) {
  const std::uint16_t lo = ok0 ? __bfloat16_as_ushort(p[i0]) : 0, hi = ok1 ? __bfloat16_as_ushort(p[i1]) : 0;
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

// The strip's column for mma tile j's B column nl (0..7): lane q's accumulator columns 2q, 2q + 1 of tiles 0..3
// become columns 8q.. 8q + 7, so each lane's values in a row are one 16-byte run.
__device__ __forceinline__ int strip_col(int j, int nl) { return 8 * (nl / 2) + 2 * j + nl % 2; }

// The mma's k order is free as long as A and B agree: k-step ks, half h (k 8h + 2q, 8h + 2q + 1 of the step) of
// lane q is t's column pair a_col(..), so that a lane's A words of a row are one run of t.
__device__ __forceinline__ int a_col(int ks_count, int ks, int h, int q) { return 4 * ks_count * q + 4 * ks + 2 * h; }

// A term's B fragments for the strip at col0 (the mma's column-major B: k down a column).
template <int KS>
__device__ __forceinline__ void load_b_frags(std::uint32_t (&f)[kTiles][KS][2], const Term<__nv_bfloat16>& tm,
                                             std::int64_t col0, std::int64_t n, int lane) {
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const std::int64_t col = col0 + strip_col(j, g);
    const bool in = col < n && tm.r > 0;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = a_col(KS, ks, h, q);
        f[j][ks][h] =
            pack_bf16(tm.b, col * tm.bn + k * tm.bk, col * tm.bn + (k + 1) * tm.bk, in && k < tm.r, in && k + 1 < tm.r);
      }
  }
}

// Stages a term's t run for one row of a tile (lane q's columns k0 = 4·KS·q .. k0 + 4·KS - 1, see a_col) into
// the lane's slot: one 8- or 16-byte copy where t's layout allows, else element by element; zeros past r and M.
template <int KS>
__device__ __forceinline__ void stage_t(uint4* slot, const Term<__nv_bfloat16>& tm, std::int64_t row, std::int64_t m,
                                        int k0) {
  constexpr int kRun = 4 * KS;
  const __nv_bfloat16* at = tm.t + row * tm.ldt + k0;
  if (row < m && tm.align >= kRun && k0 + kRun <= tm.r) {
    common::cp_async_ca_or_zero<2 * kRun>(common::shared_address(slot), at, true);
    return;
  }
  std::uint32_t w[4] = {};
#pragma unroll
  for (int i = 0; i < 2 * KS; ++i) {
    const int k = k0 + 2 * i;
    w[i] = pack_bf16(at, 2 * i, 2 * i + 1, row < m && k < tm.r, row < m && k + 1 < tm.r);
  }
  *slot = make_uint4(w[0], w[1], w[2], w[3]);
}

// A term's A fragments from its two staged rows (g, g + 8).
template <int KS>
__device__ __forceinline__ void a_frags(std::uint32_t (&a)[KS][4], const uint4& row_g, const uint4& row_g8) {
  const std::uint32_t w[2][4] = {{row_g.x, row_g.y, row_g.z, row_g.w}, {row_g8.x, row_g8.y, row_g8.z, row_g8.w}};
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) a[ks][c + 2 * h] = w[c][2 * ks + h];  // registers: rows g / g + 8, k halves 0 / 1
}

// acc[j] = the term's mma tile j (fp32).
template <int KS>
__device__ __forceinline__ void term_tiles(float (&acc)[kTiles][4], const std::uint32_t (&a)[KS][4],
                                           const std::uint32_t (&bf)[kTiles][KS][2]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) mma_bf16_16816(acc[j], a[ks], bf[j][ks][0], bf[j][ks][1]);
  }
}

// 8 consecutive bf16 elements (row, col..) of an [M, N] tensor: one 16-byte load where it fits, else one by one
// (zeros outside the tensor).
__device__ __forceinline__ uint4 load8(const __nv_bfloat16* p, std::int64_t row, std::int64_t col, std::int64_t m,
                                       std::int64_t n, bool vec) {
  if (row < m && vec && col + 8 <= n) return *reinterpret_cast<const uint4*>(p + row * n + col);
  std::uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const std::int64_t at = row * n + col + 2 * e;
    w[e] = pack_bf16(p, at, at + 1, row < m && col + 2 * e < n, row < m && col + 2 * e + 1 < n);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stages load8's 8 elements into the lane's slot: one 16-byte copy where vectors fit (zeros past M and N).
__device__ __forceinline__ void stage8(uint4* slot, const __nv_bfloat16* p, std::int64_t row, std::int64_t col,
                                       std::int64_t m, std::int64_t n, bool vec) {
  if (vec) {
    const bool in = row < m && col < n;  // vec: N % 8 == 0, so a run that starts inside N ends inside it
    common::cp_async_16_or_zero(common::shared_address(slot), in ? p + row * n + col : p, in);
  } else {
    *slot = load8(p, row, col, m, n, false);
  }
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

// K: k-steps of 16 for gate's and up's terms (the larger rank), KD for dh's (0: none; backward only).
// Each warp walks its row tiles through a kStages-deep cp.async pipeline: a lane copies the runs it will read
// (gate, up, dh and the terms' t) into its own shared-memory slots, so no barrier is needed and the loads of the
// next tiles are in flight while this one is computed.
template <int K, int KD, bool kBackward>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 16 / kWarpsPerBlock) swiglu_adapters_mma_kernel(Args<__nv_bfloat16> p) {
  using E = Elem<__nv_bfloat16>;
  constexpr int KDA = KD > 0 ? KD : 1;
  constexpr int kData = kBackward ? 3 : 2;          // gate, up (, dh)
  constexpr int kTerms = 2 + (KD > 0 ? 1 : 0);      // t_g, t_u (, t_d)
  constexpr int kItems = 2 * (kData + kTerms);      // each for rows g and g + 8
  __shared__ uint4 stage[kWarpsPerBlock][kStages][kItems][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
  const std::int64_t strip = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  const std::int64_t col0 = strip * kStripCols;
  if (col0 >= p.n) return;  // a whole warp: nothing below synchronizes the block
  const bool has_g = p.tg.r > 0, has_u = p.tu.r > 0;
  std::uint32_t bg[kTiles][K][2], bu[kTiles][K][2], bd[kTiles][KDA][2];
  load_b_frags<K>(bg, p.tg, col0, p.n, lane);
  load_b_frags<K>(bu, p.tu, col0, p.n, lane);
  if constexpr (KD > 0) load_b_frags<KD>(bd, p.td, col0, p.n, lane);
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.y) * p.rows_per_group;
  const std::int64_t last = std::min(first + p.rows_per_group, p.m);
  const int tiles = static_cast<int>((last - first + kTileRows - 1) / kTileRows);
  const std::int64_t col = col0 + 8 * q;
  // Item order in a slot set: data d, row half c at 2d + c; term e's t at 2(kData + e) + c.
  const auto issue = [&](int tile) {
    uint4(*slots)[32] = stage[warp][tile % kStages];
    const std::int64_t row0 = first + static_cast<std::int64_t>(tile) * kTileRows;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const std::int64_t row = row0 + g + 8 * c;
      stage8(&slots[c][lane], p.gate, row, col, p.m, p.n, p.vec);
      stage8(&slots[2 + c][lane], p.up, row, col, p.m, p.n, p.vec);
      if constexpr (kBackward) stage8(&slots[4 + c][lane], p.dh, row, col, p.m, p.n, p.vec);
      stage_t<K>(&slots[2 * kData + c][lane], p.tg, row, p.m, 4 * K * q);
      stage_t<K>(&slots[2 * kData + 2 + c][lane], p.tu, row, p.m, 4 * K * q);
      if constexpr (KD > 0) stage_t<KD>(&slots[2 * kData + 4 + c][lane], p.td, row, p.m, 4 * KD * q);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) issue(s);
    common::cp_async_commit();
  }
  for (int tile = 0; tile < tiles; ++tile) {
    if (tile + kStages - 1 < tiles) issue(tile + kStages - 1);
    common::cp_async_commit();
    common::cp_async_wait<kStages - 1>();  // this tile's copies (the lane's own) have landed
    const uint4(*slots)[32] = stage[warp][tile % kStages];
    std::uint32_t ag[K][4], au[K][4], ad[KDA][4];
    a_frags<K>(ag, slots[2 * kData][lane], slots[2 * kData + 1][lane]);
    a_frags<K>(au, slots[2 * kData + 2][lane], slots[2 * kData + 3][lane]);
    if constexpr (KD > 0) a_frags<KD>(ad, slots[2 * kData + 4][lane], slots[2 * kData + 5][lane]);
    float accg[kTiles][4] = {}, accu[kTiles][4] = {}, accd[kTiles][4] = {};
    if (has_g) term_tiles<K>(accg, ag, bg);
    if (has_u) term_tiles<K>(accu, au, bu);
    if constexpr (KD > 0) term_tiles<KD>(accd, ad, bd);
    const std::int64_t row0 = first + static_cast<std::int64_t>(tile) * kTileRows;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float gv[8], uv[8], dv[8], o0[8], o1[8], hv[8];
      E::unpack(slots[c][lane], gv);
      E::unpack(slots[2 + c][lane], uv);
      if constexpr (kBackward) E::unpack(slots[4 + c][lane], dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        // run c's element e is tile e / 2's accumulator 2c + e % 2
        const int j = e / 2, reg = 2 * c + e % 2;
        const float gp = gv[e] + p.tg.scale * accg[j][reg], up = uv[e] + p.tu.scale * accu[j][reg];
        if constexpr (kBackward)
          swiglu_all(gp, up, dv[e] + accd[j][reg], o0[e], o1[e], hv[e]);
        else
          o0[e] = gp * sigmoid_pair(gp).s * up;
      }
      const std::int64_t row = row0 + g + 8 * c;
      store8(p.out0, row, col, p.m, p.n, p.vec, o0);
      if constexpr (kBackward) {
        store8(p.out1, row, col, p.m, p.n, p.vec, o1);
        if (p.hout) store8(p.hout, row, col, p.m, p.n, p.vec, hv);
      }
    }
  }
}

template <class T>
__device__ __forceinline__ float term_at(const Term<T>& tm, std::int64_t row, std::int64_t col) {
  using E = Elem<T>;
  float s = 0.0f;
  for (int k = 0; k < tm.r; ++k) s += E::load(tm.t, row * tm.ldt + k) * E::load(tm.b, col * tm.bn + k * tm.bk);
  return s;
}

// Any dtype and rank: one element a thread (grid-stride), each term summed in k order in fp32.
template <class T, bool kBackward>
__global__ void __launch_bounds__(256) swiglu_adapters_plain_kernel(Args<T> p) {
  using E = Elem<T>;
  const std::int64_t total = p.m * p.n, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t row = i / p.n, col = i % p.n;
    const float gp = E::load(p.gate, i) + p.tg.scale * term_at(p.tg, row, col);
    const float up = E::load(p.up, i) + p.tu.scale * term_at(p.tu, row, col);
    if constexpr (kBackward) {
      float dg, du, h;
      swiglu_all(gp, up, E::load(p.dh, i) + term_at(p.td, row, col), dg, du, h);
      E::store(p.out0, i, dg);
      E::store(p.out1, i, du);
      if (p.hout) E::store(p.hout, i, h);
    } else {
      E::store(p.out0, i, gp * sigmoid_pair(gp).s * up);
    }
  }
}

template <int K, int KD, bool kBackward>
void launch_mma(const Context& ctx, Args<__nv_bfloat16> p) {
  const auto kernel = swiglu_adapters_mma_kernel<K, KD, kBackward>;
  const std::int64_t strips = (p.n + kStripCols - 1) / kStripCols, tiles = (p.m + kTileRows - 1) / kTileRows;
  const std::int64_t column_blocks = (strips + kWarpsPerBlock - 1) / kWarpsPerBlock;
  // Whole waves of blocks, each walking a group of row tiles (its b fragments loaded once per group).
  p.rows_per_group =
      tiles_per_row_group(column_blocks, tiles, wave_blocks(ctx, kernel, kWarpsPerBlock * 32)) * kTileRows;
  const dim3 grid(static_cast<unsigned>(column_blocks),
                  static_cast<unsigned>((p.m + p.rows_per_group - 1) / p.rows_per_group));
  kernel<<<grid, kWarpsPerBlock * 32, 0, stream_of(ctx)>>>(p);
  QMM_CUDA_CHECK_LAUNCH("swiglu_adapters_mma_kernel");
}

int k_steps(int r) { return (r + 15) / 16; }

// The backward's instance for K gate/up k-steps and dh's (0 to 2).
template <int K>
void launch_backward_mma(const Context& ctx, const Args<__nv_bfloat16>& p) {
  const int kd = k_steps(p.td.r);
  if (kd == 0)
    launch_mma<K, 0, true>(ctx, p);
  else if (kd == 1)
    launch_mma<K, 1, true>(ctx, p);
  else
    launch_mma<K, 2, true>(ctx, p);
}

template <bool kBackward>
void launch_mma_any(const Context& ctx, const Args<__nv_bfloat16>& p) {
  const bool two = k_steps(std::max(p.tg.r, p.tu.r)) > 1;
  if constexpr (kBackward) {
    if (two)
      launch_backward_mma<2>(ctx, p);
    else
      launch_backward_mma<1>(ctx, p);
  } else {
    if (two)
      launch_mma<2, 0, false>(ctx, p);
    else
      launch_mma<1, 0, false>(ctx, p);
  }
}

template <class T>
Term<T> term_of(const TensorView& t, std::int64_t col, const TensorView& b, bool b_is_a, float scale) {
  Term<T> tm;
  if (b.empty()) return tm;
  tm.r = static_cast<int>(b_is_a ? b.dim(0) : b.dim(1));
  tm.t = t.data_as<const T>() + col;
  tm.ldt = t.dim(1);
  const auto at = reinterpret_cast<std::uintptr_t>(tm.t);
  tm.align = tm.ldt % 8 == 0 && at % 16 == 0 ? 8 : tm.ldt % 4 == 0 && at % 8 == 0 ? 4 : 0;
  tm.b = b.data_as<const T>();
  tm.bn = b_is_a ? 1 : tm.r;
  tm.bk = b_is_a ? b.dim(1) : 1;
  tm.scale = scale;
  return tm;
}

template <class T, bool kBackward>
void launch(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
            const TensorView& out0, const TensorView& out1, const TensorView& hout, const SwiGluAdapters& ad) {
  Args<T> p{};
  p.gate = gate.data_as<const T>();
  p.up = up.data_as<const T>();
  p.dh = kBackward ? dh.data_as<const T>() : nullptr;
  p.out0 = out0.data_as<T>();
  p.out1 = kBackward ? out1.data_as<T>() : nullptr;
  p.hout = hout.empty() ? nullptr : hout.data_as<T>();
  p.m = gate.dim(0);
  p.n = gate.dim(1);
  p.tg = term_of<T>(ad.t, 0, ad.b_gate, false, ad.gate_scale);
  p.tu = ad.t_up.empty() ? term_of<T>(ad.t, p.tg.r, ad.b_up, false, ad.up_scale)
                         : term_of<T>(ad.t_up, 0, ad.b_up, false, ad.up_scale);
  if (kBackward) p.td = term_of<T>(ad.dh_t, 0, ad.dh_a, true, 1.0f);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (std::max({p.tg.r, p.tu.r, p.td.r}) <= kMaxMmaRank) {
      p.vec = p.n % 8 == 0 && aligned16(p.gate) && aligned16(p.up) && aligned16(p.out0) &&
              (!kBackward || (aligned16(p.dh) && aligned16(p.out1) && (!p.hout || aligned16(p.hout))));
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
    launch<__nv_bfloat16, false>(ctx, gate, up, {}, h, {}, {}, adapters);
  else
    launch<float, false>(ctx, gate, up, {}, h, {}, {}, adapters);
}

void swiglu_adapters_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                              const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters,
                              const TensorView& h) {
  set_device(ctx);
  if (dgate.dtype() == DType::BF16)
    launch<__nv_bfloat16, true>(ctx, gate, up, dh, dgate, dup, h, adapters);
  else
    launch<float, true>(ctx, gate, up, dh, dgate, dup, h, adapters);
}

}  // namespace qmm::cuda
