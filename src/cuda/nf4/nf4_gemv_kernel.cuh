// The NF4 forward for one row of A (generation, evaluation): a GEMV on per-lane tables.
#pragma once

#include <cstdint>

#include "cuda/nf4/nf4_lane_tables.cuh"

namespace qmm::cuda::small_m {

// ---- forward with one row of A (M = 1: generation, evaluation): y[n] = sum_k a[k] * bf16(code * s) ---------
// Without a tensor-core tile to fill, the work per element is what decides: here one byte permute, one shared
// load and one FMA, plus the block's table (16 values per 64 elements). A lane's unit is a 64-element chunk of one
// weight row (32 code bytes, two 16-byte loads; one NF4 block, since blocks are >= 64 and chunk aligned). The 32
// lanes of a warp take 32 consecutive chunks (a k group of 2048) and keep a's 64 values of their chunk in registers
// while they walk the rows; per row a lane writes the block's lane table (above; tables 0 and 1 alternate between
// rows) and looks its 64 elements up in it.
constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvChunk = 64;                       // elements per lane and row
constexpr int kGemvGroupK = 32 * kGemvChunk;         // k per warp pass (2048)
constexpr int kGemvAhead = 4;                        // rows per warp in the code ring (kGemvAhead - 1 in flight)
constexpr int kGemvRingBytes = kGemvAhead * 32 * 32; // per warp: 32 code bytes per lane and row
constexpr int kGemvSums = 256;                       // (row, k group) pairs per block, 32 lane sums each
constexpr int kGemvSharedBytes =                     // 4096: alignment; code2 per warp
    4096 + kGemvWarps * (kLaneTablesBytes + kGemvRingBytes + kCode2Bytes) + kGemvSums * 32 * 4;

// Grid: x over blocks of `rows_per_block` weight rows (of w0, then of w1). Warp w takes k groups w % slots,
// + slots, ... (slots = min(groups, 8)) and every reps-th row of the block from w / slots, reps = 8 / slots;
// warps past slots * reps idle. The codes travel by cp.async into a per-warp ring of kGemvAhead rows (registers
// hold a's 64 values; the ring keeps three rows in flight per warp without costing registers), the block scales
// in registers. Nothing waits on another global load before the main loop (each warp copies code2 for itself,
// with its first rows already in flight), and no warp reduces per row: each lane leaves its (row, group) sum in
// shared memory, and at the end one thread per row adds them in a fixed order (deterministic) and writes C, or
// the raw sum to partial[which][n] (gate_up).
template <bool kAF32>
__global__ void __launch_bounds__(kGemvThreads, 2) nf4_gemv_kernel(
    const void* __restrict__ a, std::int64_t N, std::int64_t K, WeightArgs w0, WeightArgs w1, int blocks_per_weight,
    int rows_per_block, float* __restrict__ partial, void* __restrict__ c, bool c_bf16, float alpha, float beta) {
  pdl_launch_dependents();  // launched overlapping (launch_overlapping): the launch overlaps the previous kernel
  pdl_wait();
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* aligned = smem + ((4096u - (shared_address(smem) & 4095u)) & 4095u);
  unsigned char* rings = aligned + kGemvWarps * kLaneTablesBytes;
  float* sums = reinterpret_cast<float*>(rings + kGemvWarps * kGemvRingBytes);  // [row][group][lane]

  const int which = static_cast<int>(blockIdx.x) >= blocks_per_weight ? 1 : 0;
  const std::uint8_t* __restrict__ codes = which ? w1.codes : w0.codes;
  const Scales scales = which ? w1.scales : w0.scales;
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.x - which * blocks_per_weight) * rows_per_block;
  const int rows = static_cast<int>(min(static_cast<std::int64_t>(rows_per_block), N - row0));
  const int chunks = static_cast<int>(K / kGemvChunk), groups = (chunks + 31) / 32;
  const int slots = min(groups, kGemvWarps), reps = kGemvWarps / slots;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  float* code2_shared = sums + kGemvSums * 32 + warp * kNf4Code2Size;

  const std::uint32_t region = shared_address(aligned + warp * kLaneTablesBytes);
  const std::uint32_t region_bits = lane_table_region_bits(region);
  const std::uint32_t ring = shared_address(rings + warp * kGemvRingBytes) + 32u * lane;

  if (warp < slots * reps) {
    const int slot = warp % slots, rep = warp / slots;
    const int count = rows > rep ? (rows - rep + reps - 1) / reps : 0;  // rows rep, rep + reps, ...
    for (int g = slot; g < groups; g += slots) {
      const int chunk = 32 * g + lane;
      const bool active = chunk < chunks;
      const std::int64_t k0 = static_cast<std::int64_t>(chunk) * kGemvChunk;
      // Row i's codes into ring slot i % kGemvAhead, its scale into `scale`; one commit group per row, empty
      // past the end, so that wait_group counts rows.
      auto issue = [&](int i, RawScale& scale) {
        if (active && i < count) {
          const std::int64_t e = (row0 + rep + static_cast<std::int64_t>(i) * reps) * K + k0;
          const std::uint32_t dst = ring + 1024u * (i % kGemvAhead);
          cp_async_16(dst, codes + (e >> 1));
          cp_async_16(dst + 16, codes + (e >> 1) + 16);
          scale = load_scale(scales, e >> scales.block_shift);
        }
        cp_async_commit();
      };
      RawScale scale[kGemvAhead] = {};
#pragma unroll
      for (int j = 0; j + 1 < kGemvAhead; ++j) issue(j, scale[j]);
      if (g == slot && !scales.absmax) {  // first pass: this warp's code2
        const float4* src = reinterpret_cast<const float4*>(scales.code2) + 2 * lane;
        const float4 c0 = __ldg(src), c1 = __ldg(src + 1);
        reinterpret_cast<float4*>(code2_shared)[2 * lane] = c0;
        reinterpret_cast<float4*>(code2_shared)[2 * lane + 1] = c1;
        __syncwarp();
      }
      float x[kGemvChunk];  // a[k0 ..], rounded to bf16 as every path does
      if constexpr (kAF32) {
#pragma unroll
        for (int i = 0; i < kGemvChunk; i += 4) {
          const float4 v = active ? __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(a) + k0 + i))
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          x[i] = __bfloat162float(__float2bfloat16_rn(v.x));
          x[i + 1] = __bfloat162float(__float2bfloat16_rn(v.y));
          x[i + 2] = __bfloat162float(__float2bfloat16_rn(v.z));
          x[i + 3] = __bfloat162float(__float2bfloat16_rn(v.w));
        }
      } else {
#pragma unroll
        for (int i = 0; i < kGemvChunk; i += 8) {
          const uint4 v = active ? __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a) + k0 + i))
                                 : make_uint4(0, 0, 0, 0);
          const std::uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            x[i + 2 * j] = __uint_as_float(u[j] << 16);
            x[i + 2 * j + 1] = __uint_as_float(u[j] & 0xFFFF0000u);
          }
        }
      }
      auto multiply = [&](int i, const RawScale& raw) {
        float sum = 0.0f;
        if (active) {
          const float s = finish_scale(scales, raw, code2_shared);
          const std::uint32_t base = region + 128u * (i & 1) + 4u * lane;
          write_lane_table<true>(base, s);
          const std::uint32_t at = ring + 1024u * (i % kGemvAhead);
          std::uint32_t w[8];
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at) : "memory");
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(w[4]), "=r"(w[5]), "=r"(w[6]), "=r"(w[7]) : "r"(at + 16) : "memory");
          float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            // Element 8q + 2b is the high nibble of byte b, 8q + 2b + 1 the low.
            const std::uint32_t hi = lane_table_hi(w[q], region_bits), lo = lane_table_lo(w[q], region_bits);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              float vh, vl;
              asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(vh) : "r"(lane_table_address(hi, base, b)) : "memory");
              asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(vl) : "r"(lane_table_address(lo, base, b)) : "memory");
              acc[2 * b] = fmaf(x[8 * q + 2 * b], vh, acc[2 * b]);
              acc[2 * b + 1] = fmaf(x[8 * q + 2 * b + 1], vl, acc[2 * b + 1]);
            }
          }
          sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        }
        sums[((rep + i * reps) * groups + g) * 32 + lane] = sum;  // 32 lanes, 32 banks
      };
      for (int i0 = 0; i0 < count; i0 += kGemvAhead) {
#pragma unroll
        for (int j = 0; j < kGemvAhead; ++j) {
          const int i = i0 + j;
          if (i >= count) break;
          issue(i + kGemvAhead - 1, scale[(j + kGemvAhead - 1) % kGemvAhead]);
          cp_async_wait<kGemvAhead - 1>();  // row i's codes are in
          multiply(i, scale[j]);
        }
      }
      cp_async_wait<0>();  // the ring is reused by the next k group
    }
  }
  __syncthreads();
  for (int r = tid; r < rows; r += kGemvThreads) {
    // Lanes from r % 32 on, so that the threads of a warp (consecutive rows) read 32 different banks.
    float total = 0.0f;
    for (int g = 0; g < groups; ++g)
      for (int j = 0; j < 32; ++j) total += sums[(r * groups + g) * 32 + ((r + j) & 31)];
    const std::int64_t n = row0 + r;
    if (partial) partial[static_cast<std::int64_t>(which) * N + n] = total;
    else store_out(c, c_bf16, n, total, alpha, beta);
  }
}

}  // namespace qmm::cuda::small_m
