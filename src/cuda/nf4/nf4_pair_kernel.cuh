// The small-M forward for up to 16 rows of A: code-byte pairs on the tensor cores, the block scale applied after
// the product (and the kernel that packs A in fragment order for it).
#pragma once

#include <cstdint>

#include "cuda/nf4/nf4_device.cuh"

namespace qmm::cuda::small_m {

// ---- forward, M <= 16, A as bf16: code-byte pairs on the tensor cores, the block scale after the product ----
// Here each 64-element block's product is summed unscaled and then multiplied by the block's scale in fp32:
// s * sum(a * bf16(code)) rather than sum(a * bf16(code * s)) (both within 2^-9 relative of code * s per weight;
// see nf4_gemm in ops.h). The weight fragment then needs no per-block table: one 64 KB table of the 256 code
// bytes' value pairs (bf16x2, the high nibble's value in the low half, as the fragment wants) serves every block,
// in 32 copies side by side so that a warp's 32 lookups always hit 32 banks (byte b for lane L at 256 b + 4 L),
// at a 64 KB boundary of the shared window, so that a lookup's address is one byte permute (the code byte as byte
// 1, 4 L as byte 0, the table's upper bytes). Per two weight elements: one permute and one shared load; the mma
// does the products.
//
// Blocks of 64 and K a multiple of 256. Work: units of 16 weight rows (a row group) x a k range (split-K) of one
// weight, in rounds over a one-wave grid (one block of 16 warps per SM): a row group's units (every split, and
// both weights for gate_up) run in the same block and round, so the block adds them up itself in shared memory
// (no partials in global memory, no second kernel). A step is 256 k, four NF4 blocks:
// for block c, lane (g, t) takes elements 16 t .. 16 t + 15 of rows g and g + 8 (8 code bytes each); mma i (of 4)
// gives the fragment's slots {2t, 2t+1} and {2t+8, 2t+9} the bytes 2i and 2i + 1 of those, so A's fragment is the
// lane's 16 consecutive activations of the block (rows of A as the n8 columns). The four blocks' mma chains are
// independent and interleaved. Codes and scales travel by cp.async through a per-warp ring of steps that runs on
// across rounds (the codes past L1, which keeps A's rows). A is read from its rows, or (f32 A; many rows) from a
// copy in fragment order (nf4_pair_pack_a_kernel below; launch_pair in nf4_small_m.cu has the rule).
constexpr int kPairWarps = 16;
constexpr int kPairThreads = 32 * kPairWarps;
constexpr int kPairTableBytes = 256 * 256;
constexpr int kPairAhead = 4;  // ring steps per warp (kPairAhead - 1 in flight)
// A step's codes: 16 rows of 128 bytes, each row's 16-byte pieces swizzled (pair_piece) so that a half warp's
// 8-byte reads (rows g, 8 t bytes into a block) hit 32 different banks; then 16 bytes of scales per row: the four
// absmax, or q's four bytes (one aligned word) and absmax2.
constexpr int kPairRowBytes = 128;
constexpr int kPairCodeBytes = 16 * kPairRowBytes;
constexpr int kPairStepBytes = kPairCodeBytes + 16 * 16;
constexpr int kPairRingBytes = kPairAhead * kPairStepBytes;
// The table at the first 64 KB boundary of the block's shared window, the rings of the first warps in front of it
// (as many as fit), code2 of both weights and the other rings behind it. The table's rows use 128 of their 256
// bytes; the other halves hold each warp's sums of a round (pair_sum_at). Whatever the window's base, that fits in
// the table, code2 and one ring more than the warps have (the space in front lost to rounding is under one ring):
// 219 KB (sm_90 gives a block that much; sm_80/86/89 do not).
constexpr int kPairSharedBytes = kPairTableBytes + 2 * kCode2Bytes + (kPairWarps + 1) * kPairRingBytes;

// A warp's unit in a round: its weight, split, first row and steps [st0, st0 + steps) of 256 k; steps is 0
// where the warp has no unit in that round.
struct PairUnit {
  int which, split, st0, steps;
  std::int64_t n0;
};
// In round r, block b takes row groups (r * groups + i) * blocks + b, i < groups (the blocks take turns, so that
// a short last round spreads over every SM); warp w serves row group i = w / members as member w % members =
// which * splits + split. Warps past groups * members idle.
struct PairGrid {
  int weights, row_groups, splits, members, groups, rounds, steps_per_split, steps;  // steps: of a whole row
  __device__ PairUnit unit(int round, int block, int blocks, int warp) const {
    PairUnit p;
    const int group = warp / members, member = warp - group * members;
    const std::int64_t row_group = (static_cast<std::int64_t>(round) * groups + group) * blocks + block;
    p.which = member / splits;
    p.split = member - p.which * splits;
    p.n0 = row_group * 16;
    p.st0 = p.split * steps_per_split;
    p.steps = group < groups && row_group < row_groups ? max(0, min(steps - p.st0, steps_per_split)) : 0;
    return p;
  }
};

// Where the pair kernel writes: C (one weight) or gate_up's outputs (two), alpha * sum (+ beta * old).
struct PairOut {
  void* c;
  bool c_bf16;
  GateUpOut gate_up;
  float alpha, beta;
};

// Where piece p (16 bytes) of row r sits in its ring row: rows g, g + 1, g + 2, g + 3 of a half warp's reads move
// a block's two pieces to four different 32-byte places.
__device__ __forceinline__ int pair_piece(int r, int p) { return p ^ (2 * (r & 3)); }

// What lane L copies into the ring per step of a unit: half L & 1 of row L / 2's 128 code bytes (four 16-byte
// pieces) and half of its scale slot: absmax 2 (L & 1) and + 1, or (double-quantized) q's word (L even) or absmax2
// (L odd). Rows past N copy zeros. Built once per unit.
template <bool kDq>
struct PairIssue {
  const std::uint8_t* code;  // the lane's first piece at the unit's first step
  const void* scale;         // the scale array the lane copies from (absmax, q or absmax2)
  std::int64_t block;        // the row's first block at the unit's first step (a multiple of 4)
  int steps;                 // the unit's step count (0 past the warp's last unit)
  bool row_ok;

  __device__ void start(const PairUnit& un, std::int64_t N, std::int64_t K, const WeightArgs& w0,
                        const WeightArgs& w1, int lane) {
    steps = un.steps;
    if (steps == 0) return;
    const WeightArgs w = un.which ? w1 : w0;
    const std::int64_t row = un.n0 + (lane >> 1);
    row_ok = row < N;
    block = (min(row, N - 1) * K + static_cast<std::int64_t>(un.st0) * 256) >> 6;
    code = w.codes + block * 32 + 64 * (lane & 1);
    if constexpr (kDq)
      scale = (lane & 1) ? static_cast<const void*>(w.scales.absmax2) : static_cast<const void*>(w.scales.q);
    else
      scale = w.scales.absmax;
  }

  __device__ void copy(int st, std::uint32_t dst, int lane) const {
    const std::uint32_t row_dst = dst + kPairRowBytes * (lane >> 1);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      cp_async_16_or_zero(row_dst + 16 * pair_piece(lane >> 1, 4 * (lane & 1) + i), code + 128 * st + 16 * i, row_ok);
    const std::uint32_t sdst = dst + kPairCodeBytes + 16 * (lane >> 1);
    const std::int64_t b = block + 4 * st;  // the step's first block
    if constexpr (kDq) {
      // q: the step's 4 bytes (one aligned word); absmax2: that of b's group of 256 blocks (all four share it).
      const void* src = (lane & 1) ? static_cast<const void*>(static_cast<const float*>(scale) + (b >> 8))
                                   : static_cast<const void*>(static_cast<const std::uint8_t*>(scale) + b);
      cp_async_ca_or_zero<4>(sdst + 4 * (lane & 1), src, row_ok);
    } else {
      cp_async_ca_or_zero<8>(sdst + 8 * (lane & 1), static_cast<const float*>(scale) + b + 2 * (lane & 1), row_ok);
    }
  }
};

// Fills the pair table at `table` (64 KB aligned) with 16 warps: warp w writes the bytes with low nibble w.
__device__ __forceinline__ void fill_pair_table(unsigned char* table, int warp, int lane) {
  float lo = 0.0f;  // nf4_code_value(warp), by selects rather than an indexed local array
#pragma unroll
  for (int code = 0; code < 16; ++code) lo = warp == code ? nf4_code_value(code) : lo;
#pragma unroll
  for (int hi = 0; hi < 16; ++hi)
    *reinterpret_cast<std::uint32_t*>(table + 256 * (16 * hi + warp) + 4 * lane) = pack_bf16x2(nf4_code_value(hi), lo);
}
static_assert(kPairWarps == 16, "fill_pair_table: one warp per low nibble");

// Warp w's sum for element e = 16 m + r (row r of its 16, row m of A) in the table's unused halves: 8 of its rows.
__device__ __forceinline__ float* pair_sum_at(unsigned char* table, int w, int e) {
  return reinterpret_cast<float*>(table + 256 * (8 * w + (e >> 5)) + 128 + 4 * (e & 31));
}

// A for the pair kernel in its fragment order, so that a warp's load of one block's B fragment reads two
// contiguous 512-byte runs (four cache lines each) rather than 16 bytes of each of 8 rows (8 lines per load,
// half of each used): per 64-element block b and n8 tile j, 1 KB, first every lane's activations 16 t .. 16 t + 7
// of row 8 j + g, then its 16 t + 8 .. 16 t + 15; rows past M zero. A piece (16 bytes) per thread. f32 A is
// rounded to bf16 here (nearest even, as every NF4 GEMM rounds A), so the pair kernel serves it too.
constexpr int kPairPackThreads = 256;
constexpr int kPairPackedBlockElems = 512;  // per 64-element block and n8 tile: 64 pieces
// The packed copy's 16-byte pieces for K columns and NT8 tiles (its size, and the pack kernel's work items).
__host__ __device__ constexpr std::int64_t pair_packed_pieces(std::int64_t K, int nt8) {
  return K / 64 * nt8 * (kPairPackedBlockElems / 8);
}
template <int NT8, bool kAF32>
__global__ void nf4_pair_pack_a_kernel(const void* __restrict__ a, int M, std::int64_t K,
                                       __nv_bfloat16* __restrict__ packed) {
  pdl_launch_dependents();  // launched overlapping (launch_overlapping)
  pdl_wait();
  const std::int64_t pieces = pair_packed_pieces(K, NT8);
  static_assert(kPairPackedBlockElems / 8 == 64, "a tile's pieces: two halves of 32 lanes");
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < pieces;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int lane = static_cast<int>(i & 31), half = static_cast<int>((i >> 5) & 1);
    const std::int64_t tile = i >> 6;  // b * NT8 + j
    const int row = 8 * static_cast<int>(tile % NT8) + (lane >> 2);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < M) {
      const std::int64_t at = row * K + 64 * (tile / NT8) + 16 * (lane & 3) + 8 * half;
      if constexpr (kAF32) {
        const float4 lo = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(a) + at));
        const float4 hi = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(a) + at) + 1);
        v = make_uint4(pack_bf16x2(lo.x, lo.y), pack_bf16x2(lo.z, lo.w), pack_bf16x2(hi.x, hi.y),
                       pack_bf16x2(hi.z, hi.w));
      } else {
        v = __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a) + at));
      }
    }
    reinterpret_cast<uint4*>(packed)[i] = v;
  }
}

// NT8 n8 tiles of A rows (M <= 8 NT8); kDq: double-quantized scales. kPackedA: `a` is A packed by
// nf4_pair_pack_a_kernel; otherwise A itself (bf16 [M, K]; with one n8 tile lanes past M load nothing).
template <int NT8, bool kDq, bool kPackedA>
__global__ void __launch_bounds__(kPairThreads, 1) nf4_small_m_pair_kernel(
    const __nv_bfloat16* __restrict__ a, int M, std::int64_t N, std::int64_t K, WeightArgs w0, WeightArgs w1,
    PairGrid grid, PairOut out) {
  // Blocks of the step multiplied together: their B fragments (8 registers per n8 tile each) are loaded at once.
  constexpr int kGroup = NT8 == 1 ? 4 : 2;
  extern __shared__ __align__(16) unsigned char smem[];
  const std::uint32_t base = shared_address(smem);
  const std::uint32_t front = (0x10000u - (base & 0xFFFFu)) & 0xFFFFu;  // bytes in front of the table
  const std::uint32_t table = base + front;
  float* code2_shared = reinterpret_cast<float*>(smem + front + kPairTableBytes);  // [which][256]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rings_in_front = static_cast<int>(front / kPairRingBytes);
  const std::uint32_t ring = warp < rings_in_front
                                 ? base + warp * kPairRingBytes
                                 : table + kPairTableBytes + 2 * kCode2Bytes + (warp - rings_in_front) * kPairRingBytes;
  const int block = static_cast<int>(blockIdx.x), blocks = static_cast<int>(gridDim.x);

  // The issue side runs kPairAhead - 1 steps ahead of the multiplies, across rounds. One commit group per step,
  // empty where there is nothing to copy, so that wait_group counts steps.
  PairIssue<kDq> is;
  int issue_round = 0, issue_st = 0, issue_slot = 0;
  is.start(grid.unit(0, block, blocks, warp), N, K, w0, w1, lane);
  auto issue_next = [&] {
    if (issue_st < is.steps) is.copy(issue_st, ring + issue_slot * kPairStepBytes, lane);
    cp_async_commit();
    issue_slot = issue_slot + 1 == kPairAhead ? 0 : issue_slot + 1;
    if (++issue_st == grid.steps_per_split) {
      issue_st = 0;
      if (++issue_round < grid.rounds) is.start(grid.unit(issue_round, block, blocks, warp), N, K, w0, w1, lane);
      else is.steps = 0;
    }
  };
  // Launched overlapping (launch_overlapping): the table, which reads no global memory, is filled while the
  // stream's previous kernel drains; everything after pdl_wait reads what that kernel may have written. Then
  // code2 (thread t: value t % 256 of weight t / 256) and the first step of every warp go out before the other
  // steps: the first multiplies wait for those two (ncu had shown code2's loads, queued behind every warp's three
  // steps, holding up the block's first barrier).
  pdl_launch_dependents();
  fill_pair_table(smem + front, warp, lane);
  pdl_wait();
  static_assert(kPairThreads == 2 * kNf4Code2Size, "one code2 value per thread");
  float code2_value = 0.0f;
  if constexpr (kDq) {
    const float* code2 = tid < kNf4Code2Size ? w0.scales.code2 : w1.scales.code2;  // pointers, not the structs
    code2_value = __ldg(code2 + tid % kNf4Code2Size);
  }
  issue_next();
#pragma unroll 1
  for (int s = 1; s + 1 < kPairAhead; ++s) issue_next();
  if constexpr (kDq) code2_shared[tid] = code2_value;  // [which][256]
  __syncthreads();
  // The lookups (asm without memory effects) depend on lane_table, taken after the barrier, so they stay below it.
  std::uint32_t lane_table = table + 4u * lane;  // byte 1 is zero: the code byte goes there
  asm volatile("" : "+r"(lane_table)::"memory");

  // With two n8 tiles the lane's code words in a ring step come from two registers kept opaque to the compiler,
  // so that it holds them (and the ring) instead of rebuilding the addresses every step (block c's word at
  // lane_code + ((32 c) ^ piece_swap): pair_piece puts piece 2c + (t >> 1) of row g at 16 (2 (c ^ (g & 3)) +
  // (t >> 1)); row g + 8 is 8 rows on), and code2 is read by its shared address: 301 instead of 328 instructions
  // per step, and faster at M = 16. With one tile the same was slower at M = 1 (its registers go elsewhere), so
  // that instance keeps the plain expressions.
  std::uint32_t lane_code = ring + kPairRowBytes * g + 16 * (t >> 1) + 8 * (t & 1), piece_swap = 32 * (g & 3);
  if constexpr (NT8 == 2) asm volatile("" : "+r"(lane_code), "+r"(piece_swap));

  int slot = 0;
#pragma unroll 1
  for (int round = 0; round < grid.rounds; ++round) {
    const PairUnit un = grid.unit(round, block, blocks, warp);
    const int steps = un.steps;
    const float* code2 = code2_shared + un.which * kNf4Code2Size;
    const std::uint32_t code2_at = shared_address(code2);
    const float offset = un.which ? w1.scales.offset : w0.scales.offset;
    // Packed: the lane's activations at the current step (block 4 (st0 + st), tile 0), advanced per step so
    // that each block's and tile's loads are constant offsets from it. Direct: its row's at the unit's first step.
    const __nv_bfloat16* a_at[NT8];
    bool a_row[NT8];  // direct: whether the lane's row of A exists (the others' columns are never stored)
    if constexpr (kPackedA) {
      a_at[0] = a + static_cast<std::int64_t>(un.st0) * 4 * NT8 * kPairPackedBlockElems + 8 * lane;
    } else {
#pragma unroll
      for (int j = 0; j < NT8; ++j) {
        a_row[j] = 8 * j + g < M;
        a_at[j] = a + static_cast<std::int64_t>(min(8 * j + g, M - 1)) * K + un.st0 * 256 + 16 * t;
      }
    }
    float acc[NT8][4] = {};
#pragma unroll 1
    for (int st = 0; st < grid.steps_per_split; ++st) {
      __syncwarp();  // every lane is done with the slot that the next issue refills
      issue_next();
      if (st < steps) {
        cp_async_wait<kPairAhead - 1>();
        __syncwarp();  // the slot was filled by every lane of the warp
        const std::uint32_t at = ring + slot * kPairStepBytes;
        std::uint32_t sw[2][4];  // the scale slots of rows g and g + 8
#pragma unroll
        for (int half = 0; half < 2; ++half)
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(sw[half][0]), "=r"(sw[half][1]), "=r"(sw[half][2]), "=r"(sw[half][3])
                       : "r"(at + kPairCodeBytes + 16 * (g + 8 * half)) : "memory");
#pragma unroll
        for (int c0 = 0; c0 < 4; c0 += kGroup) {
          std::uint32_t bf[kGroup][NT8][8];  // B of each block of the group: the lane's 16 activations
#pragma unroll
          for (int c = 0; c < kGroup; ++c)
#pragma unroll
            for (int j = 0; j < NT8; ++j) {
              uint4 x = make_uint4(0, 0, 0, 0), y = x;
              if constexpr (kPackedA) {
                const __nv_bfloat16* p = a_at[0] + ((c0 + c) * NT8 + j) * kPairPackedBlockElems;
                x = __ldg(reinterpret_cast<const uint4*>(p));
                y = __ldg(reinterpret_cast<const uint4*>(p + kPairPackedBlockElems / 2));
              } else if (NT8 == 2 || a_row[j]) {  // one tile: lanes past M skip the data path (M = 1: 7/8)
                const uint4* p = reinterpret_cast<const uint4*>(a_at[j] + 256 * st + 64 * (c0 + c));
                x = __ldg(p);
                y = __ldg(p + 1);
              }
              bf[c][j][0] = x.x, bf[c][j][1] = x.y, bf[c][j][2] = x.z, bf[c][j][3] = x.w;
              bf[c][j][4] = y.x, bf[c][j][5] = y.y, bf[c][j][6] = y.z, bf[c][j][7] = y.w;
            }
          std::uint32_t cw[kGroup][4];  // rows g and g + 8: the block's code bytes 8t .. 8t + 7
#pragma unroll
          for (int c = 0; c < kGroup; ++c)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const std::uint32_t word_at =
                  NT8 == 2 ? lane_code + slot * kPairStepBytes + ((32u * (c0 + c)) ^ piece_swap) +
                                 kPairRowBytes * 8 * half
                           : at + kPairRowBytes * (g + 8 * half) + 16 * pair_piece(g, 2 * (c0 + c) + (t >> 1)) +
                                 8 * (t & 1);
              asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(cw[c][2 * half]), "=r"(cw[c][2 * half + 1])
                           : "r"(word_at) : "memory");
            }
          float part[kGroup][NT8][4] = {};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            // Fragment registers (g, 2t..), (g + 8, 2t..), (g, 2t+8..), (g + 8, 2t+8..): bytes 2i and 2i + 1 of
            // each row's 8, i.e. word i / 2 of the row, bytes 2 (i & 1) and 2 (i & 1) + 1.
            std::uint32_t wf[kGroup][4];
#pragma unroll
            for (int c = 0; c < kGroup; ++c)
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                const std::uint32_t word = cw[c][(r & 1) * 2 + (i >> 1)];
                const std::uint32_t b = 2 * (i & 1) + (r >> 1);
                const std::uint32_t addr = __byte_perm(word, lane_table, 0x7604u | (b << 4));
                asm("ld.shared.b32 %0, [%1];\n" : "=r"(wf[c][r]) : "r"(addr));
              }
#pragma unroll
            for (int c = 0; c < kGroup; ++c)
#pragma unroll
              for (int j = 0; j < NT8; ++j) mma_bf16_16816(part[c][j], wf[c], bf[c][j][2 * i], bf[c][j][2 * i + 1]);
          }
#pragma unroll
          for (int c = 0; c < kGroup; ++c) {
            float s[2];  // the block's scales of rows g and g + 8
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              if constexpr (kDq) {
                const float v = NT8 == 2 ? code2_of_q_byte(code2_at, sw[half][0], c0 + c)
                                         : code2[(sw[half][0] >> (8 * (c0 + c))) & 0xFFu];  // code2[q]
                s[half] = nf4_lut::dq_block_scale(v, __uint_as_float(sw[half][1]), offset);
              } else {
                s[half] = __uint_as_float(sw[half][c0 + c]);
              }
            }
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
              for (int r = 0; r < 4; ++r) acc[j][r] = fmaf(s[r >> 1], part[c][j][r], acc[j][r]);
          }
        }
      }
      slot = slot + 1 == kPairAhead ? 0 : slot + 1;
      if constexpr (kPackedA) a_at[0] += 4 * NT8 * kPairPackedBlockElems;
    }
    // Fragment rows are weight rows (g, g + 8), columns rows of A (2t, 2t + 1 of each n8 tile). A row group of
    // one member (one weight, no split) is written at once; otherwise every member leaves its sums in shared
    // memory and member 0 adds them up in member order (weight 0's splits, then weight 1's) and writes them.
    if (grid.members == 1) {
      if (steps == 0) continue;
#pragma unroll
      for (int j = 0; j < NT8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = j * 8 + 2 * t + (i & 1);
          const std::int64_t n = un.n0 + g + 8 * (i >> 1);
          if (m < M && n < N) store_out(out.c, out.c_bf16, m * N + n, acc[j][i], out.alpha, out.beta);
        }
      continue;
    }
#pragma unroll
    for (int j = 0; j < NT8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        *pair_sum_at(smem + front, warp, 16 * (j * 8 + 2 * t + (i & 1)) + g + 8 * (i >> 1)) = acc[j][i];
    __syncthreads();
    if (steps > 0 && warp % grid.members == 0) {
      const int rows = static_cast<int>(min(static_cast<std::int64_t>(16), N - un.n0));
      for (int e = lane; e < 16 * M; e += 32) {
        const int m = e >> 4, r = e & 15;
        if (r >= rows) continue;
        float gs = 0.0f, us = 0.0f;  // weight 0 (C or gate), weight 1 (up)
        for (int sp = 0; sp < grid.splits; ++sp) gs += *pair_sum_at(smem + front, warp + sp, e);
        const std::int64_t i = m * N + un.n0 + r;
        if (grid.weights == 1) {
          store_out(out.c, out.c_bf16, i, gs, out.alpha, out.beta);
        } else {
          for (int sp = 0; sp < grid.splits; ++sp) us += *pair_sum_at(smem + front, warp + grid.splits + sp, e);
          store_gate_up(out.gate_up, i, out.alpha * gs, out.alpha * us, out.beta);
        }
      }
    }
    __syncthreads();  // the sums are read before the next round writes them
  }
  cp_async_wait<0>();
}

}  // namespace qmm::cuda::small_m
