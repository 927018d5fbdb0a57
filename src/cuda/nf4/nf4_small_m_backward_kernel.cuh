// The small-M input gradient, up to 16 rows of dC: dA^T = W^T dC^T on the tensor cores.
#pragma once

#include <cstdint>

#include "cuda/nf4/nf4_device.cuh"

namespace qmm::cuda::small_m {

// ---- input gradient: dA[M,K] = dC[M,N] * dequant(W), M <= 16 -----------------------------------------------
// Computed transposed, dA^T = W^T dC^T, so that the weight is the mma's A operand and its 16-byte row loads fit:
// thread (g, t) loads codes k0 + 32g .. k0 + 32g + 31 of weight rows n0 + {2t, 2t+1, 2t+8, 2t+9} (the fragment's
// reduction slots). Byte p of those loads is output-row slot g of m16 tile p (element k0 + 32g + 2p) and slot g+8
// (element + 1). dC^T is the B operand: its fragment pairs are consecutive n of one dC row, read from shared memory.
constexpr int kBwdWarps = 8;
constexpr int kBwdThreads = kBwdWarps * 32;
constexpr int kBwdBlockK = 256;   // output columns per block: 8 g x 32 codes
constexpr int kBwdGroupN = 16;    // weight rows per mma group

// Shared memory after the tables: the dC tile [MT8*8][block_n + 8] bf16, then the reduction tile.
__host__ __device__ constexpr int bwd_dc_tile_bytes(int mt8, int block_n) {
  return ((mt8 * 8 * (block_n + 8) * 2 + 15) / 16) * 16;
}
// The reduction tile holds output (row m, column 32g + j). Lane (g, t) writes row 2t (+1, +8 per m8 tile) and
// columns 32g + j for one j at a time: with 33 words per g and 292 (= 4 mod 32) per row, its bank is
// 8t + g + j (mod 32), different for all 32 lanes.
constexpr int kBwdRedRowWords = 292;
__host__ __device__ constexpr int bwd_red_index(int m, int g, int j) { return m * kBwdRedRowWords + g * 33 + j; }
__host__ __device__ constexpr int bwd_red_bytes(int mt8) { return mt8 * 8 * kBwdRedRowWords * 4; }

template <int MT8, bool kDcF32>
__global__ void __launch_bounds__(kBwdThreads) nf4_gemm_backward_small_m_kernel(
    const void* __restrict__ dc, std::int64_t M, std::int64_t N, std::int64_t K,
    const std::uint8_t* __restrict__ codes, Scales scales, int groups_per_warp, float* __restrict__ partial,
    void* __restrict__ da, bool da_bf16, float alpha, float beta) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* codebook = aligned_codebook(smem);
  float* code2_shared = reinterpret_cast<float*>(smem + kCodebookBytes);
  const int block_n = kBwdWarps * kBwdGroupN * groups_per_warp;  // weight rows (reduction) of this block
  const int ld_dc = block_n + 8;                                  // bf16 elements per shared dC row
  __nv_bfloat16* dcs = reinterpret_cast<__nv_bfloat16*>(smem + kTablesBytes);
  float* red = reinterpret_cast<float*>(smem + kTablesBytes + bwd_dc_tile_bytes(MT8, block_n));

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.x) * kBwdBlockK;
  const std::int64_t n_begin = static_cast<std::int64_t>(blockIdx.y) * block_n;

  fill_tables(codebook, code2_shared, scales, tid, kBwdThreads);
  // dC tile [MT8*8][block_n] as bf16 pairs, zero outside M and N.
  for (int i = tid; i < MT8 * 8 * (block_n / 2); i += kBwdThreads) {
    const int row = i / (block_n / 2), col = (i % (block_n / 2)) * 2;
    const std::int64_t n = n_begin + col;
    float x0 = 0.0f, x1 = 0.0f;
    if (row < M) {
      if constexpr (kDcF32) {
        const float* src = static_cast<const float*>(dc) + row * N + n;
        if (n < N) x0 = src[0];
        if (n + 1 < N) x1 = src[1];
      } else {
        const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(dc) + row * N + n;
        if (n < N) x0 = __bfloat162float(src[0]);
        if (n + 1 < N) x1 = __bfloat162float(src[1]);
      }
    }
    *reinterpret_cast<std::uint32_t*>(dcs + row * ld_dc + col) = pack_bf16x2(x0, x1);
  }
  __syncthreads();
  const std::uint32_t cb = codebook_base_after_barrier(codebook);

  float acc[16][MT8][4];
#pragma unroll
  for (int p = 0; p < 16; ++p)
#pragma unroll
    for (int mt = 0; mt < MT8; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[p][mt][i] = 0.0f;

  const std::int64_t k = k0 + 32 * g;
  const int row_slot[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
  auto load_group = [&](int gi, uint4 (&w)[4], RawScale (&rs)[4]) {
    const int nl = (gi * kBwdWarps + warp) * kBwdGroupN;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const std::int64_t n = n_begin + nl + row_slot[r];
      if (gi < groups_per_warp && n < N && k < K) {
        const std::int64_t e = n * K + k;
        w[r] = __ldg(reinterpret_cast<const uint4*>(codes + (e >> 1)));
        rs[r] = load_scale(scales, e >> scales.block_shift);
      } else {
        w[r] = make_uint4(0x77777777u, 0x77777777u, 0x77777777u, 0x77777777u);
        rs[r] = {0.0f, 0u};
      }
    }
  };
  // Register double buffering: group gi + 1's loads are in flight while group gi is multiplied.
  uint4 w[4], w_next[4];
  RawScale raw[4], raw_next[4];
  load_group(0, w, raw);
  for (int gi = 0; gi < groups_per_warp; ++gi) {
    const int nl = (gi * kBwdWarps + warp) * kBwdGroupN;  // first weight row of the group, within the block
    load_group(gi + 1, w_next, raw_next);
    float sc[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) sc[r] = finish_scale(scales, raw[r], code2_shared);
    std::uint32_t bf[MT8][2];
#pragma unroll
    for (int mt = 0; mt < MT8; ++mt) {
      const __nv_bfloat16* row = dcs + (mt * 8 + g) * ld_dc + nl + 2 * t;
      bf[mt][0] = *reinterpret_cast<const std::uint32_t*>(row);
      bf[mt][1] = *reinterpret_cast<const std::uint32_t*>(row + 8);
    }
#pragma unroll
    for (int p = 0; p < 16; ++p) {
      float2 l[4];  // (even element, odd element) of byte p of each of the four rows
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const std::uint32_t word = (p >> 2) == 0 ? w[r].x : (p >> 2) == 1 ? w[r].y : (p >> 2) == 2 ? w[r].z : w[r].w;
        l[r] = make_float2(code_at(hi_offsets(word), p & 3, cb), code_at(lo_offsets(word), p & 3, cb));
      }
      const std::uint32_t af[4] = {pack_bf16x2(l[0].x * sc[0], l[1].x * sc[1]),
                                   pack_bf16x2(l[0].y * sc[0], l[1].y * sc[1]),
                                   pack_bf16x2(l[2].x * sc[2], l[3].x * sc[3]),
                                   pack_bf16x2(l[2].y * sc[2], l[3].y * sc[3])};
#pragma unroll
      for (int mt = 0; mt < MT8; ++mt) mma_bf16_16816(acc[p][mt], af, bf[mt][0], bf[mt][1]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      w[r] = w_next[r];
      raw[r] = raw_next[r];
    }
  }

  // Sum the warps' partial tiles in a fixed order (deterministic), in shared memory laid out by bwd_red_index so
  // that the 32 lanes of a warp write 32 different banks.
  for (int wv = 0; wv < kBwdWarps; ++wv) {
    if (warp == wv) {
#pragma unroll
      for (int p = 0; p < 16; ++p)
#pragma unroll
        for (int mt = 0; mt < MT8; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int m = mt * 8 + 2 * t + (i & 1);
            float& r = red[bwd_red_index(m, g, 2 * p + (i >> 1))];
            r = (wv == 0 ? 0.0f : r) + acc[p][mt][i];
          }
    }
    __syncthreads();
  }
  for (int i = tid; i < MT8 * 8 * kBwdBlockK; i += kBwdThreads) {
    const int m = i / kBwdBlockK, kl = i % kBwdBlockK;
    const std::int64_t kk = k0 + kl;
    if (m >= M || kk >= K) continue;
    const float v = red[bwd_red_index(m, kl / 32, kl % 32)];
    if (partial) partial[(static_cast<std::int64_t>(blockIdx.y) * M + m) * K + kk] = v;
    else store_out(da, da_bf16, m * K + kk, v, alpha, beta);
  }
}

// Split-K partials are [splits][mn]. kLanes lanes sum one output (kLanes = 32 when there are many splits, so the
// loads of one output are in flight together rather than one after another); lane 0's shuffle tree is fixed, so
// the sum, and the result, is the same on every run.
template <int kLanes>
__device__ __forceinline__ float sum_splits(const float* __restrict__ p, int splits, std::int64_t mn,
                                            std::int64_t i, int lane) {
  float s = 0.0f;
  for (int sp = lane; sp < splits; sp += kLanes) s += p[sp * mn + i];
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
  return s;
}

// A grid-stride walk over outputs with kLanes threads per output: this thread's first output, the stride, and its
// lane in the group. The walk is uniform across each group (a warp or a single thread).
template <int kLanes>
struct LaneGroups {
  std::int64_t first, step;
  int lane;
  __device__ LaneGroups()
      : first((blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / kLanes),
        step(static_cast<std::int64_t>(gridDim.x) * blockDim.x / kLanes),
        lane(static_cast<int>(threadIdx.x % kLanes)) {}
};

// Writes alpha*sum + beta*C.
template <int kLanes>
__global__ void nf4_split_k_reduce_kernel(const float* __restrict__ partial, int splits, std::int64_t mn,
                                          void* __restrict__ c, bool c_bf16, float alpha, float beta) {
  pdl_launch_dependents();  // launched overlapping (launch_overlapping): the launch overlaps the kernel it sums
  pdl_wait();
  const LaneGroups<kLanes> w;
  const int lane = w.lane;
  for (std::int64_t i = w.first; i < mn; i += w.step) {
    const float sum = sum_splits<kLanes>(partial, splits, mn, i, lane);
    if (lane == 0) store_out(c, c_bf16, i, sum, alpha, beta);
  }
}

// gate_up: sums both weights' partials, then writes gate, up (alpha applied) and h = silu(gate)*up where asked.
template <int kLanes>
__global__ void nf4_gate_up_reduce_kernel(const float* __restrict__ partial, int splits, std::int64_t mn,
                                          GateUpOut out, float alpha, float beta) {
  pdl_launch_dependents();  // launched overlapping (launch_overlapping): the launch overlaps the kernel it sums
  pdl_wait();
  const float* pu = partial + static_cast<std::int64_t>(splits) * mn;
  const LaneGroups<kLanes> w;
  const int lane = w.lane;
  for (std::int64_t i = w.first; i < mn; i += w.step) {
    const float gs = alpha * sum_splits<kLanes>(partial, splits, mn, i, lane);
    const float us = alpha * sum_splits<kLanes>(pu, splits, mn, i, lane);
    if (lane == 0) store_gate_up(out, i, gs, us, beta);
  }
}

}  // namespace qmm::cuda::small_m
