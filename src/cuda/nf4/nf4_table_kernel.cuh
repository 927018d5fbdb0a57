// The small-M forward for up to 32 rows of A: per-lane tables of scaled values, tensor-core products.
#pragma once

#include <cstdint>

#include "cuda/nf4/nf4_lane_tables.cuh"

namespace qmm::cuda::small_m {

// ---- forward, M <= 32: per-lane tables of scaled values, tensor-core products ----------------------------------
// The k order inside an mma is free, so lane (g, t) of a warp takes a whole 64-element block of a weight row per
// 256-k span (block t of the span; weight rows g and g + 8 of the warp's 16) and writes each block's 16 scaled
// values into a lane table (above; table u = row half u). Per element that leaves a permute, a shared load and
// half a pack; the mma does the multiply-adds. The weight is the mma's A operand (16 rows) and the activations'
// rows are its n8 columns, so M <= 8 costs one mma per 16 x 16 weight elements. mma step s (of 16 per span) gives
// the fragment's k slots {2t, 2t+1, 2t+8, 2t+9} the elements 4s .. 4s+3 of the lane's block; A's fragments are
// read from shared memory with the same mapping (k = span + 64 t + 4 s + {0, 1, 2, 3}).
constexpr int kTabWarps = 8;
constexpr int kTabThreads = 32 * kTabWarps;
constexpr int kTabBlockN = kTabWarps * 16;  // 128 weight rows per block
constexpr int kSpanK = 256;                 // k per span: 4 lanes x one 64-element block
// Shared A: per row and span four 64-element blocks, each followed by 8 bytes of padding, and rows padded to 32
// (mod 128) bytes: lane (g, t)'s 8-byte fragment read at step s then sits in banks 8g + 2t + 2s (+1) (mod 32),
// all different within a half warp.
constexpr int kSpanBytesA = 4 * (64 * 2 + 8);
constexpr int kTabMaxSharedA = 72 * 1024;  // bytes of staged activations per block, at most (two blocks fit an SM)
constexpr int kTabSharedFixed = 4096 + kTabWarps * kLaneTablesBytes + kCode2Bytes;  // 4096: alignment

// Blocks per SM for __launch_bounds__: three with two n8 tiles of A (80 registers, no spills; measured faster on
// Llama-3-8B shapes: gate/up M = 16 30.7 vs 32.7 µs, within 2% on Qwen2.5-1.5B), two otherwise (with one tile,
// three per SM were no faster and pushed the split model to more splits: Llama down M = 8 28.7 vs 26.6).
__host__ __device__ constexpr int tab_blocks_per_sm(int nt8) { return nt8 == 2 ? 3 : 2; }

__host__ __device__ constexpr int tab_a_row_bytes(int spans) {
  return spans * kSpanBytesA + (160 - spans * kSpanBytesA % 128) % 128;
}

// Grid: x over blocks of 128 weight rows (of w0, then of w1), y over k ranges of `spans` * 256 (split-K). NT8 n8
// tiles cover M <= 8 NT8 rows of A, all staged (zero past M). Each warp owns 16 weight rows and walks the block's
// spans; a span's codes (32 bytes per lane and row) and scales are loaded one span ahead into registers.
template <int NT8, bool kAF32>
__global__ void __launch_bounds__(kTabThreads, tab_blocks_per_sm(NT8)) nf4_small_m_table_kernel(
    const void* __restrict__ a, std::int64_t M, std::int64_t N, std::int64_t K, WeightArgs w0, WeightArgs w1,
    int blocks_per_weight, int spans, float* __restrict__ partial, void* __restrict__ c, bool c_bf16, float alpha,
    float beta) {
  pdl_launch_dependents();  // launched overlapping (launch_overlapping): the launch overlaps the previous kernel
  pdl_wait();
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* aligned = smem + ((4096u - (shared_address(smem) & 4095u)) & 4095u);
  float* code2_shared = reinterpret_cast<float*>(aligned + kTabWarps * kLaneTablesBytes);
  unsigned char* as = aligned + kTabWarps * kLaneTablesBytes + kCode2Bytes;
  const int row_bytes = tab_a_row_bytes(spans);

  const int which = static_cast<int>(blockIdx.x) >= blocks_per_weight ? 1 : 0;
  const std::uint8_t* __restrict__ codes = which ? w1.codes : w0.codes;
  const Scales scales = which ? w1.scales : w0.scales;
  if (partial) partial += static_cast<std::int64_t>(which) * gridDim.y * M * N;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const std::int64_t n_warp =
      static_cast<std::int64_t>(blockIdx.x - which * blocks_per_weight) * kTabBlockN + warp * 16;
  const std::int64_t k_block = static_cast<std::int64_t>(blockIdx.y) * spans * kSpanK;
  const int my_spans = static_cast<int>(min(static_cast<std::int64_t>(spans), (K - k_block + kSpanK - 1) / kSpanK));

  // Rows g (half 0) and g + 8 (half 1) of the warp's 16.
  auto load_span = [&](int sp, uint4 (&w)[2][2], RawScale (&s)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t n = n_warp + half * 8 + g;
      const std::int64_t k = k_block + static_cast<std::int64_t>(sp) * kSpanK + 64 * t;
      if (sp < my_spans && n < N && k < K) {
        const std::int64_t e = n * K + k;
        const uint4* p = reinterpret_cast<const uint4*>(codes + (e >> 1));
        w[half][0] = __ldg(p);
        w[half][1] = __ldg(p + 1);
        s[half] = load_scale(scales, e >> scales.block_shift);
      } else {
        w[half][0] = w[half][1] = make_uint4(0x77777777u, 0x77777777u, 0x77777777u, 0x77777777u);  // 0.0
        s[half] = {0.0f, 0u};
      }
    }
  };
  uint4 wa[2][2], wb[2][2];
  RawScale sa[2], sb[2];
  load_span(0, wa, sa);
  load_span(1, wb, sb);

  // While the first loads fly: code2 and the activation tile (bf16, zero outside M and K).
  if (!scales.absmax)
    for (int i = tid; i < kNf4Code2Size; i += kTabThreads) code2_shared[i] = __ldg(scales.code2 + i);
  const int vec_per_row = spans * (kSpanK / 4);
  for (int i = tid; i < NT8 * 8 * vec_per_row; i += kTabThreads) {
    const int row = i / vec_per_row, col = (i % vec_per_row) * 4;
    const std::int64_t k = k_block + col;
    uint2 v = make_uint2(0u, 0u);
    if (row < M && k < K) {  // K % 64 == 0, so all 4 are in range
      if constexpr (kAF32) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(a) + row * K + k));
        v = make_uint2(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w));
      } else {
        v = __ldg(reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(a) + row * K + k));
      }
    }
    *reinterpret_cast<uint2*>(as + row * row_bytes + (col / 64) * (kSpanBytesA / 4) + (col % 64) * 2) = v;
  }
  __syncthreads();
  // Taken after the barrier (see codebook_base_after_barrier): A's fragment loads are not volatile and must not
  // move above it.
  std::uint32_t a_base = shared_address(as) + g * row_bytes + (kSpanBytesA / 4) * t;
  asm volatile("" : "+r"(a_base)::"memory");

  const std::uint32_t region = shared_address(aligned + warp * kLaneTablesBytes);
  const std::uint32_t region_bits = lane_table_region_bits(region);
  const std::uint32_t table[2] = {region + 4u * lane, region + 128u + 4u * lane};

  float acc[NT8][4];
#pragma unroll
  for (int j = 0; j < NT8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;

  auto multiply_span = [&](int sp, const uint4 (&w)[2][2], const RawScale (&raw)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
      write_lane_table<false>(table[half], finish_scale(scales, raw[half], code2_shared));
    const std::uint32_t a_span = a_base + static_cast<std::uint32_t>(sp) * kSpanBytesA;
#pragma unroll
    for (int step = 0; step < 16; ++step) {
      // The weight fragment: slots (row g, 2t..2t+1), (g + 8, 2t..), (g, 2t+8..), (g + 8, 2t+8..).
      std::uint32_t wf[4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint4& q = w[half][step >> 3];
        const int wi = (step >> 1) & 3;
        const std::uint32_t word = wi == 0 ? q.x : wi == 1 ? q.y : wi == 2 ? q.z : q.w;
        // Bytes 2 (step & 1) and 2 (step & 1) + 1 of the word: elements 4 step .. 4 step + 3 of the block, high
        // nibble first.
        const std::uint32_t hi = lane_table_hi(word, region_bits), lo = lane_table_lo(word, region_bits);
        std::uint32_t v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const std::uint32_t b = 2 * (step & 1) + (e >> 1);
          const std::uint32_t addr = lane_table_address((e & 1) ? lo : hi, table[half], b);
          asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v[e]) : "r"(addr));  // ordered after the stores
        }
        wf[half] = __byte_perm(v[0], v[1], 0x7632u);
        wf[half + 2] = __byte_perm(v[2], v[3], 0x7632u);
      }
#pragma unroll
      for (int j = 0; j < NT8; ++j) {
        std::uint32_t b0, b1;
        asm("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(a_span + j * 8 * row_bytes + 8 * step));
        mma_bf16_16816(acc[j], wf, b0, b1);
      }
    }
  };
  for (int sp = 0; sp < my_spans; sp += 2) {
    multiply_span(sp, wa, sa);
    load_span(sp + 2, wa, sa);
    if (sp + 1 < my_spans) {
      multiply_span(sp + 1, wb, sb);
      load_span(sp + 3, wb, sb);
    }
  }

  // The mma's rows are weight rows (g, g + 8), its columns rows of A (2t, 2t + 1 of each n8 tile).
#pragma unroll
  for (int j = 0; j < NT8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::int64_t m = j * 8 + 2 * t + (i & 1);
      const std::int64_t n = n_warp + g + (i >= 2 ? 8 : 0);
      if (m >= M || n >= N) continue;
      if (partial) partial[(static_cast<std::int64_t>(blockIdx.y) * M + m) * N + n] = acc[j][i];
      else store_out(c, c_bf16, m * N + n, acc[j][i], alpha, beta);
    }
}

using common::cp_async_16;
using common::cp_async_16_or_zero;
using common::cp_async_ca_or_zero;
using common::cp_async_commit;
using common::cp_async_wait;

}  // namespace qmm::cuda::small_m
