// The small-M slice forward (up to 16 rows of A, never taken by Auto: forced by tests and probes): each warp
// keeps a slice of K of A in registers and streams weight row groups past it. Shares the pair kernel's tables.
#pragma once

#include <cstdint>

#include "cuda/nf4/nf4_small_m.cuh"  // the pair kernel's table and ring, and their helpers

namespace qmm::cuda::small_m {

// ---- forward, M <= 16, A bf16 or f32: slices of K in registers, weight rows streamed past them ----------------
// The pair kernel's products (pair table, scale after each block's product, the same contract) in another order. The
// pair kernel gives a warp a unit of 16 weight rows x a k range and walks the k range, so every step reloads A's
// fragments and every round ends in a block barrier. Here a warp keeps one slice of 256 k (four NF4 blocks) for the
// whole launch, with A's values there as the mma's B fragments in registers (32 per lane and n8 tile: the two-tile
// instance, 9-16 rows, runs at the 128-register bound, with no spill in its loop), and walks
// row groups of 16 weight rows: per row group only the codes and scales (2.3 KB) arrive, by cp.async through a ring of
// kSliceDepth stages per warp laid out as the pair kernel's ring steps (the copy below). Warps leave each row
// group's sums in shared memory; once per pass (as many row groups as the sums area holds) the block adds its slices'
// sums in slice order and writes them (C, or gate_up's outputs, or fp32 partials [weight][split][M][N] for the split-K
// reduction): deterministic. One block of 16 warps per SM; the grid is x: blocks of row groups, y: k splits of at most
// 16 slices. A block's split has per_split slices; warp w takes slice w % per_split and every warps_per_slice-th row
// group from w / per_split on (K < 4096 leaves several warps per slice; warps past per_split x warps_per_slice, or past
// the last split's slices, idle). With two weights (gate_up) the groups interleave, group v being row group v / 2 of
// weight v % 2, and blocks and passes start at even groups, so that a pass holds both weights' sums of its rows and the
// block writes h itself.
constexpr int kSliceWarps = 16;
constexpr int kSliceThreads = 32 * kSliceWarps;
constexpr int kSliceMaxRows = 16;  // two n8 tiles of A rows
constexpr int kSliceK = 256;
constexpr int kSliceDepth = 3;  // ring stages per warp (kSliceDepth - 1 row groups in flight)
constexpr int kSliceRingBytes = kSliceDepth * kPairStepBytes;
// Layout as the pair kernel's: the table at the first 64 KB boundary, as many rings as fit in front of it, code2
// of both weights and the other rings behind it, then the sums. The table, code2 and one ring more than the warps
// have cover any window base (the space lost in front is under one ring).
constexpr int kSliceFixedBytes = kPairTableBytes + 2 * kCode2Bytes + (kSliceWarps + 1) * kSliceRingBytes;
static_assert(kSliceWarps == kPairWarps, "the pair table's fill takes 16 warps");
static_assert(kPairTableBytes / kSliceRingBytes < kSliceWarps, "fewer rings fit in front of the table than warps");
static_assert(kSliceThreads == 2 * kNf4Code2Size, "one code2 value of one weight per thread");

struct SliceGrid {
  int weights;           // 1, or 2 (gate_up)
  int slices;            // K / 256
  int per_split;         // slices per k split (the last split may have fewer)
  int warps_per_slice;   // 16 / per_split
  int groups;            // weights x ceil(N / 16) row groups
  int groups_per_block;  // of a split; a multiple of weights
  int pass_groups;       // per pass, a multiple of warps_per_slice (and of weights, or all of a block's)
};

// One weight: alpha * sum (+ beta * C) into C. Two: gate_up's outputs (alpha on gate and up, beta without h).
// With partial set (split K): the plain sums into partial[weight][split][M][N] instead.
struct SliceOut {
  void* c;
  bool c_bf16;
  GateUpOut gate_up;
  float* partial;
  int splits;
  float alpha, beta;
};

// Lane (g, t)'s B fragments of the slice starting at k0: per block c and n8 tile jt, A[8 jt + g][k0 + 64 c + 16 t
// .. + 15] as bf16 pairs (rounded to nearest even from f32), the pair kernel's order; zeros for rows past M.
template <int NT8, bool kAF32>
__device__ __forceinline__ void load_slice_fragments(std::uint32_t (&bf)[4][NT8][8], const void* a, int M,
                                                     std::int64_t K, std::int64_t k0, int g, int t, bool load) {
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int jt = 0; jt < NT8; ++jt) {
      const int row = 8 * jt + g;
      const std::int64_t at = static_cast<std::int64_t>(row) * K + k0 + 64 * c + 16 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // elements 8 h .. 8 h + 7
        uint4 v = make_uint4(0, 0, 0, 0);
        if (load && row < M) {
          if constexpr (kAF32) {
            const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(a) + at + 8 * h);
            const float4 lo = __ldg(p), hi = __ldg(p + 1);
            v = make_uint4(pack_bf16x2(lo.x, lo.y), pack_bf16x2(lo.z, lo.w), pack_bf16x2(hi.x, hi.y),
                           pack_bf16x2(hi.z, hi.w));
          } else {
            v = __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a) + at + 8 * h));
          }
        }
        std::uint32_t* f = bf[c][jt] + 4 * h;
        f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
      }
    }
}

// After the pass's barrier: every output of the pass's rows, its slices' sums added in slice order.
__device__ __forceinline__ void write_slice_pass(const float* sums, const SliceGrid& grid, const SliceOut& out, int M,
                                                 std::int64_t N, int group0, int groups_here, int slices_here,
                                                 int split, int tid) {
  const int W = grid.weights, pass_rows = 16 * grid.pass_groups;
  const int rows = 16 * groups_here / W;  // rows of each weight
  const std::int64_t mn = static_cast<std::int64_t>(M) * N;
  for (int e = tid; e < rows * M; e += kSliceThreads) {
    const int rr = e / M, m = e - rr * M, q = rr >> 4, r = rr & 15;
    const std::int64_t n = 16LL * (group0 / W + q) + r;
    if (n >= N) continue;
    float v[2] = {0.0f, 0.0f};  // weight 0 (C or gate), weight 1 (up)
    const std::int64_t idx = m * N + n;
#pragma unroll
    for (int wt = 0; wt < 2; ++wt) {
      if (wt == W) break;
      const int row = 16 * (W * q + wt) + r;  // in the pass's sums
      for (int k = 0; k < slices_here; ++k) v[wt] += sums[(k * pass_rows + row) * M + m];
      if (out.partial) out.partial[(static_cast<std::int64_t>(wt) * out.splits + split) * mn + idx] = v[wt];
    }
    if (out.partial) continue;  // written above
    if (W == 1) store_out(out.c, out.c_bf16, idx, v[0], out.alpha, out.beta);
    else store_gate_up(out.gate_up, idx, out.alpha * v[0], out.alpha * v[1], out.beta);
  }
}

// NT8 n8 tiles of A rows (M <= 8 NT8); kDq: double-quantized scales (both weights); kAF32: A f32 (else bf16).
template <int NT8, bool kDq, bool kAF32>
__global__ void __launch_bounds__(kSliceThreads, 1) nf4_small_m_slice_kernel(
    const void* __restrict__ a, int M, std::int64_t N, std::int64_t K, WeightArgs w0, WeightArgs w1, SliceGrid grid,
    SliceOut out) {
  extern __shared__ __align__(16) unsigned char smem[];
  const std::uint32_t base = shared_address(smem);
  const std::uint32_t front = (0x10000u - (base & 0xFFFFu)) & 0xFFFFu;  // bytes in front of the table
  const std::uint32_t table = base + front;
  float* code2_shared = reinterpret_cast<float*>(smem + front + kPairTableBytes);  // [weight][256]
  unsigned char* behind = smem + front + kPairTableBytes + 2 * kCode2Bytes;
  const int rings_in_front = static_cast<int>(front / kSliceRingBytes);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const std::uint32_t ring = warp < rings_in_front
                                 ? base + warp * kSliceRingBytes
                                 : shared_address(behind) + (warp - rings_in_front) * kSliceRingBytes;
  float* sums = reinterpret_cast<float*>(behind + (kSliceWarps - rings_in_front) * kSliceRingBytes);

  const int split = static_cast<int>(blockIdx.y);
  const int slice0 = split * grid.per_split;
  const int slices_here = min(grid.per_split, grid.slices - slice0);
  const int wk = warp % grid.per_split, wr = warp / grid.per_split, WR = grid.warps_per_slice, W = grid.weights;
  const bool active = wr < WR && wk < slices_here;
  const int group_begin = static_cast<int>(blockIdx.x) * grid.groups_per_block;
  const int group_end = min(grid.groups, group_begin + grid.groups_per_block);
  const int pass_iters = grid.pass_groups / WR, pass_rows = 16 * grid.pass_groups;
  const int passes = (group_end - group_begin + grid.pass_groups - 1) / grid.pass_groups;
  // The warp's item i (item j of pass p = i / pass_iters) is group v = group_begin + wr + WR i (a pass's
  // pass_groups = pass_iters x WR groups are consecutive): row group v >> wshift of weight v & wshift (W is 1 or
  // 2). Only the last pass can be short, so the items that exist are the first n_mine.
  const int wshift = W - 1;
  int n_mine = 0;
  if (active) {
    const int span = group_end - group_begin, full = span / grid.pass_groups, rem = span - full * grid.pass_groups;
    n_mine = full * pass_iters + (rem > wr ? (rem - wr + WR - 1) / WR : 0);
  }
  // What lane L copies per item, the pair kernel's ring step for one slice (PairIssue's split of the work): half
  // L & 1 of row r = L / 2's 128 code bytes, its pieces 4 (L & 1) + i at pair_piece's places, 16 ((4 (L & 1) + i)
  // ^ 2 (r & 3)) = 64 ((L & 1) ^ (r >> 1 & 1)) + (16 i ^ 32 (r & 1)), and half of the row's scale slot: absmax
  // 2 (L & 1) and + 1, or (double-quantized) q's word (L even) or absmax2 (L odd). Rows past N copy zeros.
  // The shared addresses are kept in registers opaque to the compiler (copy_code: the first piece's place in
  // stage 0, copy_swap, copy_scale), which would otherwise rebuild them from the thread index every item.
  const int copy_row = lane >> 1, copy_half = lane & 1;
  std::uint32_t copy_code = ring + kPairRowBytes * copy_row + 64 * (copy_half ^ ((copy_row >> 1) & 1));
  std::uint32_t copy_swap = 32 * (copy_row & 1);
  std::uint32_t copy_scale = ring + kPairCodeBytes + 16 * copy_row + (kDq ? 4 : 8) * copy_half;
  asm volatile("" : "+r"(copy_code), "+r"(copy_swap), "+r"(copy_scale));
  const std::int64_t slice_k = static_cast<std::int64_t>(slice0 + wk) * kSliceK;
  // One commit group per item, empty past the last, so that wait_group counts items.
  auto issue = [&](int i, int slot) {
    if (i < n_mine) {
      const int v = group_begin + wr + WR * i;
      const bool second = (v & wshift) != 0;
      const std::int64_t row = 16LL * (v >> wshift) + copy_row;
      const bool ok = row < N;
      const std::int64_t at = (ok ? row : N - 1) * K + slice_k;  // the row's first element of the slice
      const std::uint32_t stage = slot * kPairStepBytes;
      const std::uint8_t* src = (second ? w1.codes : w0.codes) + (at >> 1) + 64 * copy_half;
#pragma unroll
      for (int p = 0; p < 4; ++p) cp_async_16_or_zero(copy_code + stage + ((16u * p) ^ copy_swap), src + 16 * p, ok);
      const std::int64_t b = at >> 6;  // the slice's first block in the row (its four share an absmax2)
      if constexpr (kDq) {  // pointers chosen one by one: a select of the structs would put them in local memory
        const float* absmax2 = second ? w1.scales.absmax2 : w0.scales.absmax2;
        const std::uint8_t* q = second ? w1.scales.q : w0.scales.q;
        const void* s = copy_half ? static_cast<const void*>(absmax2 + (b >> 8)) : static_cast<const void*>(q + b);
        cp_async_ca_or_zero<4>(copy_scale + stage, s, ok);
      } else {
        cp_async_ca_or_zero<8>(copy_scale + stage, (second ? w1.scales.absmax : w0.scales.absmax) + b + 2 * copy_half,
                               ok);
      }
    }
    cp_async_commit();
  };

  // Launched overlapping (launch_overlapping): the table, which reads no global memory, is filled while the
  // stream's previous kernel drains; everything after pdl_wait may read what that kernel wrote.
  pdl_launch_dependents();
  fill_pair_table(smem + front, warp, lane);
  pdl_wait();
  float code2_value = 0.0f;  // thread t: value t % 256 of weight t / 256
  if (kDq && tid < W * kNf4Code2Size)
    code2_value = __ldg((tid < kNf4Code2Size ? w0.scales.code2 : w1.scales.code2) + tid % kNf4Code2Size);
#pragma unroll
  for (int d = 0; d + 1 < kSliceDepth; ++d) issue(d, d);
  // Blocks whose products are formed together: their code words and partial sums are live at once.
  constexpr int kGroup = NT8 == 1 ? 4 : 2;
  std::uint32_t bf[4][NT8][8];
  load_slice_fragments<NT8, kAF32>(bf, a, M, K, slice_k, g, t, active);
  if (kDq) code2_shared[tid] = code2_value;
  __syncthreads();
  // The lookups (asm without memory effects) depend on lane_table, taken after the barrier, so they stay below it.
  std::uint32_t lane_table = table + 4u * lane;
  asm volatile("" : "+r"(lane_table)::"memory");
  // The lane's reads of a ring stage as offsets from two registers kept opaque to the compiler, which would
  // otherwise rebuild them from the thread index every item (registers are short): block c's code words of row
  // g at lane_code + ((32 c) ^ piece_swap) (pair_piece puts piece 2c + (t >> 1) of row g at 16 (2 (c ^ (g & 3)) +
  // (t >> 1))), row g + 8 eight rows on; the scale slot of row g at lane_code + lane_scale.
  std::uint32_t lane_code = ring + kPairRowBytes * g + 16 * (t >> 1) + 8 * (t & 1), piece_swap = 32 * (g & 3);
  asm volatile("" : "+r"(lane_code), "+r"(piece_swap));
  const std::uint32_t lane_scale = kPairCodeBytes + 16 * g - (kPairRowBytes * g + 16 * (t >> 1) + 8 * (t & 1));

  int slot = 0;
#pragma unroll 1
  for (int p = 0; p < passes; ++p) {
#pragma unroll 1
    for (int j = 0; j < pass_iters; ++j) {
      const int i = p * pass_iters + j;
      if (i >= n_mine) break;
      __syncwarp();  // every lane is done with the slot that this issue refills
      issue(i + kSliceDepth - 1, slot == 0 ? kSliceDepth - 1 : slot - 1);
      cp_async_wait<kSliceDepth - 1>();
      __syncwarp();  // the slot was filled by every lane of the warp
      const std::uint32_t at = lane_code + slot * kPairStepBytes;  // the lane's first code word in the stage
      std::uint32_t sw[2][4];  // the scale slots of rows g and g + 8
#pragma unroll
      for (int half = 0; half < 2; ++half)
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(sw[half][0]), "=r"(sw[half][1]), "=r"(sw[half][2]), "=r"(sw[half][3])
                     : "r"(at + lane_scale + 128 * half) : "memory");
      // Double-quantized: lane (g, t) forms block t's scales of rows g and g + 8 (the CPU's operation order), and
      // the lanes of row g share them by shuffles rather than each forming all four blocks' scales.
      float lane_sc[2] = {0.0f, 0.0f};
      if constexpr (kDq) {
        const int which = (group_begin + wr + WR * i) & wshift;
        const std::uint32_t code2_at = shared_address(code2_shared) + which * kCode2Bytes;
        const float offset = which ? w1.scales.offset : w0.scales.offset;
#pragma unroll
        for (int half = 0; half < 2; ++half)
          lane_sc[half] =
              nf4_lut::dq_block_scale(code2_of_q_byte(code2_at, sw[half][0], t), __uint_as_float(sw[half][1]), offset);
      }
      float acc[NT8][4] = {};
#pragma unroll
      for (int c0 = 0; c0 < 4; c0 += kGroup) {  // blocks c0 .. c0 + kGroup - 1, their mma chains interleaved
        std::uint32_t cw[kGroup][4];  // rows g and g + 8, code bytes 8t .. 8t + 7
#pragma unroll
        for (int c = 0; c < kGroup; ++c)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(cw[c][2 * half]), "=r"(cw[c][2 * half + 1])
                         : "r"(at + kPairRowBytes * 8 * half + ((32u * (c0 + c)) ^ piece_swap)) : "memory");
        float part[kGroup][NT8][4] = {};
#pragma unroll
        for (int s = 0; s < 4; ++s) {  // mma step s: bytes 2s and 2s + 1 of each row's 8 (the pair kernel's order)
#pragma unroll
          for (int c = 0; c < kGroup; ++c) {
            std::uint32_t wf[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const std::uint32_t word = cw[c][(r & 1) * 2 + (s >> 1)];
              const std::uint32_t b = 2 * (s & 1) + (r >> 1);
              asm("ld.shared.b32 %0, [%1];\n" : "=r"(wf[r]) : "r"(__byte_perm(word, lane_table, 0x7604u | (b << 4))));
            }
#pragma unroll
            for (int jt = 0; jt < NT8; ++jt)
              mma_bf16_16816(part[c][jt], wf, bf[c0 + c][jt][2 * s], bf[c0 + c][jt][2 * s + 1]);
          }
        }
#pragma unroll
        for (int c = 0; c < kGroup; ++c) {
          const int blk = c0 + c;
          float sc[2];  // the block's scales of rows g and g + 8
#pragma unroll
          for (int half = 0; half < 2; ++half)
            sc[half] =
                kDq ? __shfl_sync(0xFFFFFFFFu, lane_sc[half], (lane & ~3) | blk) : __uint_as_float(sw[half][blk]);
#pragma unroll
          for (int jt = 0; jt < NT8; ++jt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[jt][r] = fmaf(sc[r >> 1], part[c][jt][r], acc[jt][r]);
        }
      }
      // Fragment rows are weight rows (g, g + 8), columns rows of A (8 jt + 2t, + 1): sums[slice][row][m].
      const int rl = 16 * (wr + WR * j);
#pragma unroll
      for (int jt = 0; jt < NT8; ++jt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int m = 8 * jt + 2 * t + (r & 1);
          if (m < M) sums[(wk * pass_rows + rl + g + 8 * (r >> 1)) * M + m] = acc[jt][r];
        }
      slot = slot + 1 == kSliceDepth ? 0 : slot + 1;
    }
    __syncthreads();
    const int group0 = group_begin + p * grid.pass_groups;
    write_slice_pass(sums, grid, out, M, N, group0, min(grid.pass_groups, group_end - group0), slices_here, split, tid);
    __syncthreads();  // the sums are read before the next pass writes them
  }
  cp_async_wait<0>();
}

}  // namespace qmm::cuda::small_m
