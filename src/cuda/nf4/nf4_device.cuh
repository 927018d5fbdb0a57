// Device helpers every NF4 GEMM kernel shares: the weight's scales (plain or double-quantized) and their
// finishing, the code book and code2 tables in shared memory, code lookups, output stores. The kernels: the
// small-M ones (nf4_small_m.cuh) and the fused ones (nf4_fused.cu, nf4_fused_mma.cu).
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

}  // namespace qmm::cuda::small_m
