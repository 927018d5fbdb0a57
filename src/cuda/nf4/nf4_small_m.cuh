// Device code of the small-M NF4 GEMMs: the forward table kernel (M <= 32), the GEMV (M = 1), the input gradient
// (M <= 16) and the split-K reductions. Host side: nf4_small_m.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/nf4_lut.h"  // pack_bf16x2
#include "cuda/common/sm80_ptx.cuh"
#include "qmm/nf4.h"

namespace qmm::cuda::small_m {

using nf4_lut::pack_bf16x2;

constexpr int kCodebookBytes = 16 * 4 + 256;    // the 16 NF4 values (16 words in 16 banks), 256-byte aligned inside

// Scales of one weight, plain (absmax) or double-quantized (q, absmax2, code2, offset).
struct Scales {
  const float* absmax;
  const std::uint8_t* q;
  const float* absmax2;
  const float* code2;
  float offset;
  int block_shift;  // log2(block size)
};

// A block's scale is fetched in two steps so that no global load waits on another: load_scale issues the loads
// (absmax, or q and absmax2: independent of each other) together with the codes; finish_scale runs when the
// chunk is multiplied and looks code2[q] up in shared memory. The fp32 operation order and roundings are the
// CPU's (no fused multiply-add).
struct RawScale {
  float a;        // absmax (plain) or absmax2 of the block's group (double-quantized)
  std::uint32_t q;  // the block's code2 index (double-quantized)
};

// The Scales of w (device pointers), for a launch.
inline Scales scales_of(const Nf4Weight& w) {
  Scales sc{};
  if (w.double_quant()) {
    sc.q = w.absmax.data_as<std::uint8_t>();
    sc.absmax2 = w.absmax2.data_as<float>();
    sc.code2 = w.code2.data_as<float>();
    sc.offset = w.offset;
  } else {
    sc.absmax = w.absmax.data_as<float>();
  }
  while ((1 << sc.block_shift) < w.block_size) ++sc.block_shift;
  return sc;
}

__device__ __forceinline__ RawScale load_scale(const Scales& s, std::int64_t block) {
  if (s.absmax) return {__ldg(s.absmax + block), 0u};
  return {__ldg(s.absmax2 + (block >> 8)), __ldg(s.q + block)};  // 256 blocks per absmax2 group
}

__device__ __forceinline__ float finish_scale(const Scales& s, RawScale r, const float* code2_shared) {
  if (s.absmax) return r.a;
  return nf4_lut::dq_block_scale(code2_shared[r.q], r.a, s.offset);
}

// code2[q] for q = byte `byte` of a ring scale slot's q word, from the code2 table at shared address code2_at (q
// shifted into a byte offset: no separate mask and multiply).
__device__ __forceinline__ float code2_of_q_byte(std::uint32_t code2_at, std::uint32_t q_word, int byte) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(code2_at + (((q_word >> (8 * byte)) << 2) & 0x3FCu))
               : "memory");
  return v;
}

// Shared tables at the start of each kernel's shared memory: the 16 NF4 values (a warp's lookups hit 16 words in
// 16 banks) at the first 256-byte boundary, then code2 (filled only for double-quantized weights).
constexpr int kCode2Bytes = kNf4Code2Size * 4;
constexpr int kTablesBytes = kCodebookBytes + kCode2Bytes;

using common::pdl_launch_dependents;
using common::pdl_wait;
using common::shared_address;

// The codebook inside the first kCodebookBytes of shared memory, 256-byte aligned: a lookup's address is then one
// byte permute (code_at).
__device__ __forceinline__ float* aligned_codebook(unsigned char* smem) {
  return reinterpret_cast<float*>(smem + ((256u - (shared_address(smem) & 255u)) & 255u));
}

__device__ __forceinline__ void fill_tables(float* codebook, float* code2_shared, const Scales& s, int tid,
                                            int threads) {
  if (tid < 16) codebook[tid] = nf4_code_value(tid);
  if (!s.absmax)
    for (int i = tid; i < kNf4Code2Size; i += threads) code2_shared[i] = __ldg(s.code2 + i);
}

// Codebook lookups without per-element shifts, masks and address arithmetic: hi_offsets / lo_offsets turn a word
// of codes into byte offsets (4 x code) of each byte's high / low nibble, and code_at takes byte `b` of such a word
// as the low byte of the codebook's shared address (its other bytes come from the aligned base).
__device__ __forceinline__ std::uint32_t hi_offsets(std::uint32_t w) { return (w >> 2) & 0x3C3C3C3Cu; }
__device__ __forceinline__ std::uint32_t lo_offsets(std::uint32_t w) { return (w << 2) & 0x3C3C3C3Cu; }

// `b` (0..3) is a constant in the unrolled loops that call this, so the selector is an immediate.
__device__ __forceinline__ float code_at(std::uint32_t offsets, int b, std::uint32_t codebook_base) {
  const std::uint32_t addr = __byte_perm(offsets, codebook_base, 0x7650u | static_cast<std::uint32_t>(b));
  float v;
  asm("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));  // not volatile: free to move among the mma
  return v;
}

// The codebook's shared address for code_at, taken after the barrier that publishes the codebook: the lookups
// (asm without memory side effects) depend on it and so cannot be scheduled before that barrier.
__device__ __forceinline__ std::uint32_t codebook_base_after_barrier(const float* codebook) {
  std::uint32_t cb = shared_address(codebook);
  asm volatile("" : "+r"(cb)::"memory");
  return cb;
}

using common::mma_bf16_16816;

__device__ __forceinline__ void store_out(void* c, bool c_bf16, std::int64_t idx, float v, float alpha, float beta) {
  if (c_bf16) {
    auto* p = static_cast<__nv_bfloat16*>(c) + idx;
    float r = alpha * v;
    if (beta != 0.0f) r += beta * __bfloat162float(*p);
    *p = __float2bfloat16_rn(r);
  } else {
    auto* p = static_cast<float*>(c) + idx;
    float r = alpha * v;
    if (beta != 0.0f) r += beta * *p;
    *p = r;
  }
}

// gate_up's outputs: gate, up and h = silu(gate) * up, each optional.
struct GateUpOut {
  void* gate;
  void* up;
  void* h;
  bool gate_bf16, up_bf16, h_bf16;
};

// Writes output i of gate_up from the sums gs and us (alpha applied); beta != 0 only without h.
__device__ __forceinline__ void store_gate_up(const GateUpOut& out, std::int64_t i, float gs, float us, float beta) {
  if (out.gate) store_out(out.gate, out.gate_bf16, i, gs, 1.0f, beta);
  if (out.up) store_out(out.up, out.up_bf16, i, us, 1.0f, beta);
  if (out.h) store_out(out.h, out.h_bf16, i, gs / (1.0f + __expf(-gs)) * us, 1.0f, 0.0f);
}

// Two weights of one shape may share a launch (gate and up): blocks [0, blocks_per_weight) take w0, the rest w1,
// and the partials of w1 follow those of w0.
struct WeightArgs {
  const std::uint8_t* codes;
  Scales scales;
};

// ---- per-lane tables of a block's 16 scaled values (the table kernel and the GEMV) ---------------------------
// The contract's value bf16(code * s) computed 16 times per NF4 block instead of once per element. Value j of
// table u (0 or 1) of lane L sits at byte 256 j + 128 u + 4 L of its warp's 4 KB region (4096-aligned): whatever
// the codes, a warp's 32 lookups hit 32 different banks, and a lookup's address is one byte permute, the code as
// byte 1 and the lane's base (byte 0: 128 u + 4 L; bytes 2 and 3: the region's) around it. The region's byte 1 (a
// multiple of 16) is ORed into the codes' bytes through region_bits.
constexpr int kLaneTablesBytes = 16 * 256;  // per warp

__device__ __forceinline__ std::uint32_t lane_table_region_bits(std::uint32_t region) {
  return ((region >> 8) & 0xF0u) * 0x01010101u;
}

// A word of packed codes as lookup bytes: byte b's high nibble (element 2b of the word's 8), or its low (2b + 1).
__device__ __forceinline__ std::uint32_t lane_table_hi(std::uint32_t w, std::uint32_t region_bits) {
  return ((w >> 4) & 0x0F0F0F0Fu) | region_bits;
}
__device__ __forceinline__ std::uint32_t lane_table_lo(std::uint32_t w, std::uint32_t region_bits) {
  return (w & 0x0F0F0F0Fu) | region_bits;
}

// The shared address of the value for byte b (0..3, a constant in the callers' unrolled loops) of `codes`.
__device__ __forceinline__ std::uint32_t lane_table_address(std::uint32_t codes, std::uint32_t base, std::uint32_t b) {
  return __byte_perm(codes, base, 0x7604u | (b << 4));
}

// Writes the table at `base` for scale s, values 2j and 2j + 1 rounded as a pair, each in the high half of its
// word. kFp32: the low half zeroed, so the word is the value as an fp32 (the GEMV's FMAs); otherwise the low half
// is left as it comes (the table kernel packs the high halves for the mma).
template <bool kFp32>
__device__ __forceinline__ void write_lane_table(std::uint32_t base, float s) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::uint32_t p = pack_bf16x2(nf4_code_value(2 * j) * s, nf4_code_value(2 * j + 1) * s);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(base + 512u * j), "r"(p << 16) : "memory");
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(base + 512u * j + 256u), "r"(kFp32 ? p & 0xFFFF0000u : p)
                 : "memory");
  }
}

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
