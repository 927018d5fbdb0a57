// Per-lane tables of an NF4 block's 16 scaled values, shared by the small-M table kernel and the GEMV.
#pragma once

#include <cstdint>

#include "cuda/nf4/nf4_device.cuh"

namespace qmm::cuda::small_m {

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

}  // namespace qmm::cuda::small_m
