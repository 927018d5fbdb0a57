// RMSNorm on the GPU. Rows that one warp or two can hold in registers (16-byte packs, at most kMaxPacksForward per
// lane forward, where a lane also holds its share of the next row, kMaxPacksBackward backward, whose lanes hold x
// and dy) are read once; other rows (odd widths, misaligned views, very wide rows) go one block per row.
// The row's sum of squares (fp32, reduced in a fixed order) gives rstd; the forward writes
// y = w · round(x · rstd), the backward dx = rstd · (g − x̂ · mean(g · x̂)), g = dy · w. With a residual r (add_rms_norm)
// the forward normalizes h = round(x + r), writing h as it goes; with dres the backward adds it to dx before dx's
// rounding: the decoder layer's residual adds ride on the norms' passes over the row.
// The weight gradient dw += Σ_rows dy · x̂ is summed without atomics, in a fixed order, into one partial per group
// of rows, which a last kernel adds in group order. Where a row fits the registers of one warp or of two, the
// backward kernel that writes dx sums the partials too, from the x and dy it already holds (x and dy are read
// once); otherwise a kernel of its own reads x and dy again for them.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/elem.cuh"
#include "cuda/common/lane_sum.cuh"
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

// res and h null: y = norm(x); else h = round(x + res) first (each element written by the thread that reads it
// again: h may be x or res) and y = norm(h).
template <class T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const T* x, const T* res, const T* w, T* h, T* y, float* rstd, std::int64_t hid, float eps) {
  using E = Elem<T>;
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * hid;
  float ss = 0.0f;
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads) {
    float v = E::load(x, base + k);
    if (res) {
      T sum;  // rounded to the storage dtype: the norm reads h as stored
      E::store(&sum, 0, v + E::load(res, base + k));
      v = E::load(&sum, 0);
      E::store(h, base + k, v);
    }
    ss = fmaf(v, v, ss);
  }
  if (res) x = h;
  const float rs = rsqrtf(block_total(ss) / static_cast<float>(hid) + eps);
  if (rstd && threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads) {
    T xh;  // x · rstd rounded to the storage dtype first, as Hugging Face's module computes it
    E::store(&xh, 0, E::load(x, base + k) * rs);
    E::store(y, base + k, E::load(w, k) * E::load(&xh, 0));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_dx_kernel(const T* x, const T* w, const float* rstd, const T* dy, const T* dres, T* dx, std::int64_t hid) {
  using E = Elem<T>;
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * hid;
  const float rs = rstd[blockIdx.x];
  float dot = 0.0f;
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads)
    dot = fmaf(E::load(dy, base + k) * E::load(w, k), E::load(x, base + k) * rs, dot);
  const float mean = block_total(dot) / static_cast<float>(hid);
  for (std::int64_t k = threadIdx.x; k < hid; k += kThreads) {
    const float g = E::load(dy, base + k) * E::load(w, k), xh = E::load(x, base + k) * rs;
    E::store(dx, base + k, rs * (g - xh * mean) + (dres ? E::load(dres, base + k) : 0.0f));
  }
}

// ---- rows in the registers of one warp or two -----------------------------------------------------------------------

constexpr int kWarpsPerBlock = 8;
// 16-byte packs a lane holds forward, its share of this row and of the next (rows of up to 8 packs a lane over one
// warp, 16 over two: 4096 bf16 or 2048 f32 elements).
constexpr int kMaxPacksForward = 8;
// The backward's lanes hold x's and dy's packs: at 16 of each the block-per-row kernel measured faster (occupancy).
constexpr int kMaxPacksBackward = 8;

// The warp's total of v, in every lane, in a fixed order.
__device__ __forceinline__ float warp_total(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// A row's total of v over its kWarpsPerRow warps, in every lane, in a fixed order. parts: the block's slots, one
// set per step parity (a step's writes never meet the previous step's reads). With two warps a row it is a barrier:
// every thread of the block calls it, live row or not.
template <int kWarpsPerRow>
__device__ __forceinline__ float row_total(float v, float (&parts)[2][kWarpsPerBlock], int parity) {
  v = warp_total(v);
  if constexpr (kWarpsPerRow > 1) {
    const int warp = threadIdx.x >> 5, slot = warp / kWarpsPerRow;
    if ((threadIdx.x & 31) == 0) parts[parity][warp] = v;
    __syncthreads();
    v = 0.0f;
#pragma unroll
    for (int part = 0; part < kWarpsPerRow; ++part) v += parts[parity][slot * kWarpsPerRow + part];
  }
  return v;
}

// Persistent forward: block b takes row steps b, b + gridDim.x, ...; a step is kSlots rows (kWarpsPerBlock /
// kWarpsPerRow), each row's packs split over kWarpsPerRow warps (pack p in lane p mod 32·kWarpsPerRow). A lane
// loads its share of the next step's row before it reduces and writes this one's, so the grid keeps loads in
// flight while it writes (the rows are in registers: y may be x). With kAdd a lane loads its packs of res for the
// row it reduces, and writes h = round(x + res) (h and y may be x or res: the row's packs are read before).
template <class T, int kPacks, int kWarpsPerRow, bool kAdd>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    rms_norm_rows_kernel(const T* x, const T* res, const T* w, T* h, T* y, float* rstd, std::int64_t rows,
                         std::int64_t hid, float eps) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  constexpr int kSlots = kWarpsPerBlock / kWarpsPerRow;
  constexpr int kRowLanes = 32 * kWarpsPerRow;
  __shared__ float row_parts[2][kWarpsPerBlock];  // each warp's share of a row's sum of squares, by step parity
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = warp / kWarpsPerRow, row_lane = (warp % kWarpsPerRow) * 32 + lane;
  const std::int64_t packs = hid / V, steps = (rows + kSlots - 1) / kSlots;
  const auto load = [&](std::int64_t step, uint4(&q)[kPacks]) {
    const std::int64_t row = step * kSlots + slot;
    if (step >= steps || row >= rows) return;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * hid);
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const std::int64_t p = row_lane + kRowLanes * j;
      if (p < packs) q[j] = xr[p];
    }
  };
  uint4 cur[kPacks], next[kPacks];
  load(blockIdx.x, cur);
  int parity = 0;
#pragma unroll 1
  for (std::int64_t step = blockIdx.x; step < steps; step += gridDim.x, parity ^= 1) {
    load(step + gridDim.x, next);
    const std::int64_t row = step * kSlots + slot;
    const bool live = row < rows;
    float ss = 0.0f;
    if constexpr (kAdd) {
      if (live) {
        uint4 qr[kPacks];
        const uint4* rr = reinterpret_cast<const uint4*>(res + row * hid);
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          const std::int64_t p = row_lane + kRowLanes * j;
          if (p < packs) qr[j] = rr[p];
        }
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          const std::int64_t p = row_lane + kRowLanes * j;
          if (p >= packs) continue;
          float v[V], rv[V];
          E::unpack(cur[j], v);
          E::unpack(qr[j], rv);
#pragma unroll
          for (int k = 0; k < V; ++k) v[k] += rv[k];
          cur[j] = E::pack(v);  // rounded: the norm reads h as stored
          reinterpret_cast<uint4*>(h + row * hid)[p] = cur[j];
        }
      }
    }
    if (live) {
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        if (row_lane + kRowLanes * j >= packs) continue;
        float v[V];
        E::unpack(cur[j], v);
#pragma unroll
        for (int k = 0; k < V; ++k) ss = fmaf(v[k], v[k], ss);
      }
    }
    ss = row_total<kWarpsPerRow>(ss, row_parts, parity);
    if (live) {
      const float rs = rsqrtf(ss / static_cast<float>(hid) + eps);
      if (rstd && row_lane == 0) rstd[row] = rs;
      T* yr = y + row * hid;
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        const std::int64_t p = row_lane + kRowLanes * j;
        if (p >= packs) continue;
        float v[V], wv[V], out[V];
        E::unpack(cur[j], v);
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
#pragma unroll
    for (int j = 0; j < kPacks; ++j) cur[j] = next[j];
  }
}

// A row's backward from registers, for the packs p = first + stride·j (j < kPacks, p < packs) that a lane holds.
// load_row_packs reads them and returns the lane's share of Σ g · x̂ (g = dy · w, x̂ = x · rstd).
template <class T, int kPacks>
__device__ __forceinline__ float load_row_packs(const T* x, const T* dy, const T* w, float rs, std::int64_t first,
                                                int stride, std::int64_t packs, uint4 (&qx)[kPacks],
                                                uint4 (&qdy)[kPacks]) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const std::int64_t p = first + stride * j;
    if (p >= packs) continue;
    qx[j] = reinterpret_cast<const uint4*>(x)[p];
    qdy[j] = reinterpret_cast<const uint4*>(dy)[p];
  }
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const std::int64_t p = first + stride * j;
    if (p >= packs) continue;
    float xv[V], dv[V], wv[V];
    E::unpack(qx[j], xv);
    E::unpack(qdy[j], dv);
    E::load_vec(w, p, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) dot = fmaf(dv[k] * wv[k], xv[k] * rs, dot);
  }
  return dot;
}

// dx = rstd · (g − x̂ · mean) (+ dres, the row of the second gradient where not null) for the same packs, written
// to the row dx (which may be dy: the row is in registers, or dres: a pack is read before it is written); with
// kWithDw also acc += dy · x̂ per element.
template <class T, int kPacks, bool kWithDw>
__device__ __forceinline__ void store_row_dx(const uint4 (&qx)[kPacks], const uint4 (&qdy)[kPacks], const T* w,
                                             const T* dres, float rs, float mean, T* dx, std::int64_t first, int stride,
                                             std::int64_t packs, float (&acc)[kPacks][Elem<T>::kVec]) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const std::int64_t p = first + stride * j;
    if (p >= packs) continue;
    float xv[V], dv[V], wv[V], out[V], rv[V] = {};
    E::unpack(qx[j], xv);
    E::unpack(qdy[j], dv);
    E::load_vec(w, p, wv);
    if (dres) E::load_vec(dres, p, rv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = dv[k] * wv[k], xh = xv[k] * rs;
      out[k] = rs * (g - xh * mean) + rv[k];
      if constexpr (kWithDw) acc[j][k] = fmaf(dv[k], xh, acc[j][k]);
    }
    E::store_vec(dx, p, out);
  }
}

template <class T, int kPacks>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    rms_norm_dx_warp_kernel(const T* x, const T* w, const float* rstd, const T* dy, const T* dres, T* dx,
                            std::int64_t rows, std::int64_t hid) {
  const int lane = threadIdx.x & 31;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const std::int64_t packs = hid / Elem<T>::kVec;
  const float rs = rstd[row];
  uint4 qx[kPacks], qdy[kPacks];
  const float dot = load_row_packs<T, kPacks>(x + row * hid, dy + row * hid, w, rs, lane, 32, packs, qx, qdy);
  float unused[kPacks][Elem<T>::kVec];
  store_row_dx<T, kPacks, false>(qx, qdy, w, dres ? dres + row * hid : nullptr, rs,
                                 warp_total(dot) / static_cast<float>(hid), dx + row * hid, lane, 32, packs, unused);
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

// How the row kernels hold rows of hid elements of T: up to kMax packs a lane over one warp, else over two warps
// (the row's packs split between their lanes); packs 0 where neither fits.
struct RowSplit {
  int packs = 0;  // a power of 2
  int warps = 1;  // a row's warps, 1 or 2
};
template <class T, int kMax>
RowSplit row_split(std::int64_t hid, std::initializer_list<const void*> pointers) {
  if (const int one = warp_packs<T, kMax>(hid, pointers)) return {one, 1};
  if (const int two = warp_packs<T, 2 * kMax>(hid, pointers)) return {std::max(1, two / 2), 2};
  return {};
}

// Calls f(packs, warps a row) as std::integral_constants for a split that fits.
template <int kMax, class F>
void with_row_split(RowSplit split, F&& f) {
  with_packs<kMax>(split.packs, [&](auto k) {
    if (split.warps == 1)
      f(k, std::integral_constant<int, 1>{});
    else
      f(k, std::integral_constant<int, 2>{});
  });
}

// ---- the backward with the weight gradient's partials, rows split over one or two warps -------------------------

constexpr int kGroupRows = 16;  // rows per block and per partial: enough blocks for the GPU at a few thousand rows

// Block b takes rows 16 b.. (its group), kSlots rows at a time, each row's packs split over kWarpsPerRow warps
// (pack p in lane p mod 32·kWarpsPerRow). With kWithDw each lane sums dy · x̂ for its columns over its slot's rows;
// the slots then add their sums in slot order into shared memory ([hid] floats, dynamic) and the block writes them
// to partial[b]. dx may be dy: a row is in registers before any of it is written.
template <class T, int kPacks, int kWarpsPerRow, bool kWithDw>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    rms_norm_backward_rows_kernel(const T* x, const T* w, const float* rstd, const T* dy, const T* dres, T* dx,
                                  float* partial, std::int64_t rows, std::int64_t hid) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  constexpr int kSlots = kWarpsPerBlock / kWarpsPerRow;
  constexpr int kRowLanes = 32 * kWarpsPerRow;
  static_assert(kGroupRows % kSlots == 0, "whole steps per group");
  __shared__ float row_parts[2][kWarpsPerBlock];  // each warp's share of a row's dot, double-buffered by step
  extern __shared__ float dw_sum[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = warp / kWarpsPerRow, row_lane = (warp % kWarpsPerRow) * 32 + lane;
  const std::int64_t packs = hid / V;
  float acc[kPacks][V] = {};
#pragma unroll 1
  for (int step = 0; step < kGroupRows / kSlots; ++step) {
    const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kGroupRows + step * kSlots + slot;
    const bool live = row < rows;
    uint4 qx[kPacks], qdy[kPacks];
    float dot = 0.0f, rs = 0.0f;
    if (live) {
      rs = rstd[row];
      dot = load_row_packs<T, kPacks>(x + row * hid, dy + row * hid, w, rs, row_lane, kRowLanes, packs, qx, qdy);
    }
    dot = row_total<kWarpsPerRow>(dot, row_parts, step & 1);
    if (live)
      store_row_dx<T, kPacks, kWithDw>(qx, qdy, w, dres ? dres + row * hid : nullptr, rs, dot / static_cast<float>(hid),
                                       dx + row * hid, row_lane, kRowLanes, packs, acc);
  }
  if constexpr (kWithDw) {
    for (int s = 0; s < kSlots; ++s) {
      if (slot == s) {
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          const std::int64_t p = row_lane + kRowLanes * j;
          if (p >= packs) continue;
#pragma unroll
          for (int k = 0; k < V; ++k) dw_sum[p * V + k] = s == 0 ? acc[j][k] : dw_sum[p * V + k] + acc[j][k];
        }
      }
      __syncthreads();
    }
    for (std::int64_t k = threadIdx.x; k < hid; k += blockDim.x) partial[blockIdx.x * hid + k] = dw_sum[k];
  }
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

// dw[k] += Σ_g partial[g][k], a lane_sum block's columns a block.
__global__ void __launch_bounds__(common::kLaneSumThreads)
    rms_norm_dw_finish_kernel(const float* partial, std::int64_t groups, std::int64_t hid, float* dw) {
  __shared__ common::LaneSums sums;
  const std::int64_t k =
      static_cast<std::int64_t>(blockIdx.x) * common::kLaneSumCols + threadIdx.x % common::kLaneSumCols;
  const bool valid = k < hid;
  const float total = common::lane_sum(partial + (valid ? k : 0), groups, hid, valid, sums);
  if (threadIdx.x < common::kLaneSumCols && valid) dw[k] += total;
}

template <class T>
void launch_forward(const Context& ctx, const TensorView& x, const TensorView& res, const TensorView& w,
                    const TensorView& h, const TensorView& y, const TensorView& rstd, float eps) {
  const std::int64_t rows = x.dim(0), hid = x.dim(1);
  const T* res_p = res.empty() ? nullptr : res.data_as<const T>();
  T* h_p = h.empty() ? nullptr : h.data_as<T>();
  float* rstd_p = rstd.empty() ? nullptr : rstd.data_as<float>();
  if (const RowSplit split = row_split<T, kMaxPacksForward>(hid, {x.data(), res_p, w.data(), h_p, y.data()});
      split.packs) {
    with_row_split<kMaxPacksForward>(split, [&](auto packs, auto warps_per_row) {
      constexpr int kWarpsPerRow = decltype(warps_per_row)::value;
      const auto launch = [&](auto add) {
        const auto kernel = rms_norm_rows_kernel<T, decltype(packs)::value, kWarpsPerRow, decltype(add)::value>;
        const std::int64_t steps = (rows + kWarpsPerBlock / kWarpsPerRow - 1) / (kWarpsPerBlock / kWarpsPerRow);
        kernel<<<grid_for(ctx, kernel, 32 * kWarpsPerBlock, steps * 32 * kWarpsPerBlock), 32 * kWarpsPerBlock, 0,
                 stream_of(ctx)>>>(x.data_as<const T>(), res_p, w.data_as<const T>(), h_p, y.data_as<T>(), rstd_p, rows,
                                   hid, eps);
      };
      if (res_p)
        launch(std::true_type{});
      else
        launch(std::false_type{});
    });
    QMM_CUDA_CHECK_LAUNCH("rms_norm_rows_kernel");
    return;
  }
  rms_norm_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream_of(ctx)>>>(
      x.data_as<const T>(), res_p, w.data_as<const T>(), h_p, y.data_as<T>(), rstd_p, hid, eps);
  QMM_CUDA_CHECK_LAUNCH("rms_norm_kernel");
}

// The weight gradient's last step: dw += the groups' partials, added in a fixed order.
void finish_dw(const Context& ctx, const float* partial, std::int64_t groups, std::int64_t hid, const TensorView& dw) {
  const unsigned col_blocks = static_cast<unsigned>((hid + common::kLaneSumCols - 1) / common::kLaneSumCols);
  rms_norm_dw_finish_kernel<<<col_blocks, common::kLaneSumThreads, 0, stream_of(ctx)>>>(partial, groups, hid,
                                                                                        dw.data_as<float>());
  QMM_CUDA_CHECK_LAUNCH("rms_norm_dw_finish_kernel");
}

// rms_norm_backward_rows_kernel where a row fits the registers of one warp (kWarpsPerRow 1) or two, both x and dy
// 16-byte packs; false, launching nothing, otherwise. Without dw, rows one warp holds take the warp-per-row
// kernel instead (a warp per row, more blocks).
template <class T>
bool launch_backward_rows(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                          const TensorView& dy, const TensorView& dx, const TensorView& dw, const T* dres) {
  const std::int64_t rows = x.dim(0), hid = x.dim(1);
  const RowSplit split = row_split<T, kMaxPacksBackward>(hid, {x.data(), w.data(), dy.data(), dx.data(), dres});
  if (dx.empty() || split.packs == 0 || (split.warps == 1 && dw.empty())) return false;
  const unsigned groups = static_cast<unsigned>((rows + kGroupRows - 1) / kGroupRows);
  std::unique_ptr<ScratchBuffer> partial;
  if (!dw.empty())
    partial = std::make_unique<ScratchBuffer>(state(ctx), static_cast<std::size_t>(groups * hid) * sizeof(float));
  // At most 16 KB (2 x 8 packs of 16 bytes a lane, 64 lanes): under the 48 KB a launch may take without opting in.
  const int dw_bytes = dw.empty() ? 0 : static_cast<int>(hid * sizeof(float));
  auto run = [&](auto packs, auto warps_per_row, auto with_dw) {
    const auto kernel = rms_norm_backward_rows_kernel<T, decltype(packs)::value, decltype(warps_per_row)::value,
                                                      decltype(with_dw)::value>;
    kernel<<<groups, 32 * kWarpsPerBlock, dw_bytes, stream_of(ctx)>>>(
        x.data_as<const T>(), w.data_as<const T>(), rstd.data_as<const float>(), dy.data_as<const T>(), dres,
        dx.data_as<T>(), partial ? partial->at<float>(0) : nullptr, rows, hid);
  };
  with_row_split<kMaxPacksBackward>(split, [&](auto packs, auto warps_per_row) {
    if constexpr (decltype(warps_per_row)::value == 1)  // one warp a row takes this kernel only with dw
      run(packs, warps_per_row, std::true_type{});
    else if (dw.empty())
      run(packs, warps_per_row, std::false_type{});
    else
      run(packs, warps_per_row, std::true_type{});
  });
  QMM_CUDA_CHECK_LAUNCH("rms_norm_backward_rows_kernel");
  if (!dw.empty()) finish_dw(ctx, partial->at<float>(0), groups, hid, dw);
  return true;
}

template <class T>
void launch_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                     const TensorView& dy, const TensorView& dx, const TensorView& dw, const TensorView& dres) {
  const std::int64_t rows = x.dim(0), hid = x.dim(1);
  const T* dres_p = dres.empty() ? nullptr : dres.data_as<const T>();
  if (launch_backward_rows<T>(ctx, x, w, rstd, dy, dx, dw, dres_p)) return;
  if (!dw.empty()) {  // first: dx may be dy
    const std::int64_t groups = (rows + kRowsPerGroup - 1) / kRowsPerGroup;
    const unsigned col_blocks = static_cast<unsigned>((hid + kThreads - 1) / kThreads);
    ScratchBuffer partial(state(ctx), static_cast<std::size_t>(groups * hid) * sizeof(float));
    rms_norm_dw_partial_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(groups)), kThreads, 0, stream_of(ctx)>>>(
        x.data_as<const T>(), rstd.data_as<const float>(), dy.data_as<const T>(), partial.at<float>(0), rows, hid);
    QMM_CUDA_CHECK_LAUNCH("rms_norm_dw_partial_kernel");
    finish_dw(ctx, partial.at<float>(0), groups, hid, dw);
  }
  if (dx.empty()) return;
  if (const int packs = warp_packs<T, kMaxPacksBackward>(hid, {x.data(), w.data(), dy.data(), dx.data(), dres_p})) {
    with_packs<kMaxPacksBackward>(packs, [&](auto k) {
      rms_norm_dx_warp_kernel<T, decltype(k)::value><<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream_of(ctx)>>>(
          x.data_as<const T>(), w.data_as<const T>(), rstd.data_as<const float>(), dy.data_as<const T>(), dres_p,
          dx.data_as<T>(), rows, hid);
    });
    QMM_CUDA_CHECK_LAUNCH("rms_norm_dx_warp_kernel");
    return;
  }
  rms_norm_dx_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream_of(ctx)>>>(
      x.data_as<const T>(), w.data_as<const T>(), rstd.data_as<const float>(), dy.data_as<const T>(), dres_p,
      dx.data_as<T>(), hid);
  QMM_CUDA_CHECK_LAUNCH("rms_norm_dx_kernel");
}

}  // namespace

void rms_norm(const Context& ctx, const TensorView& x, const TensorView& r, const TensorView& w, const TensorView& h,
              const TensorView& y, const TensorView& rstd, float eps) {
  set_device(ctx);
  if (x.dtype() == DType::BF16)
    launch_forward<__nv_bfloat16>(ctx, x, r, w, h, y, rstd, eps);
  else
    launch_forward<float>(ctx, x, r, w, h, y, rstd, eps);
}

void rms_norm_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                       const TensorView& dy, const TensorView& dx, const TensorView& dw, const TensorView& dres) {
  set_device(ctx);
  if (x.dtype() == DType::BF16)
    launch_backward<__nv_bfloat16>(ctx, x, w, rstd, dy, dx, dw, dres);
  else
    launch_backward<float>(ctx, x, w, rstd, dy, dx, dw, dres);
}

}  // namespace qmm::cuda
