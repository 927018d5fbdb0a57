// NF4 dequantization helpers shared by the GPU kernels: the contract's fp32 product per code word (nf4_dequantize,
// the shared-dequantization kernel) and per-block byte-plane tables looked up with byte permutes (PRMT; the fused
// kernels in src/cuda/nf4/nf4_fused.cu), which a CPU test checks for every code at every position against
// bf16(nf4_code_value(code) * scale), the dequantization contract. Host and device compile this same code; only
// the byte permute, the multiply and the bf16 rounding have a host and a device form.
#pragma once

#include <cstdint>

#include "qmm/nf4.h"  // nf4_code_value, QMM_HOST_DEVICE
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif
#if !defined(__CUDA_ARCH__)
#include "qmm/tensor.h"  // float_to_bf16
#endif

// The loops below unroll in device code (a pragma the host compiler does not know).
#if defined(__CUDA_ARCH__)
#define QMM_NF4_LUT_UNROLL _Pragma("unroll")
#else
#define QMM_NF4_LUT_UNROLL
#endif

namespace qmm::nf4_lut {

// PRMT in its default mode with selector nibbles of 0..7 (bit 3, sign replication, is never used here): result
// byte i is byte ((s >> 4i) & 7) of the 8 bytes {x, y}; the selector's upper 16 bits are ignored.
QMM_HOST_DEVICE inline std::uint32_t byte_perm(std::uint32_t x, std::uint32_t y, std::uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const std::uint64_t v = (static_cast<std::uint64_t>(y) << 32) | x;
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<std::uint32_t>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

// One code word's 8 elements times the block's scale in fp32: the dequantization contract's product, before its
// bf16 rounding. Byte b holds element 2b in its high nibble and 2b + 1 in its low (bitsandbytes' order);
// `codebook` holds the 16 code values (nf4_code_value), in shared memory on the GPU.
QMM_HOST_DEVICE inline void scaled_word(std::uint32_t word, float scale, const float* codebook, float (&v)[8]) {
QMM_NF4_LUT_UNROLL
  for (int b = 0; b < 4; ++b) {
#if defined(__CUDA_ARCH__)
    v[2 * b] = __fmul_rn(codebook[(word >> (8 * b + 4)) & 15u], scale);  // no FMA contraction, as on the CPU
    v[2 * b + 1] = __fmul_rn(codebook[(word >> (8 * b)) & 15u], scale);
#else
    v[2 * b] = codebook[(word >> (8 * b + 4)) & 15u] * scale;
    v[2 * b + 1] = codebook[(word >> (8 * b)) & 15u] * scale;
#endif
  }
}

// A double-quantized block's scale from its parts, code2[q] * absmax2 + offset: two roundings (multiply, then add),
// never a fused multiply-add, the producer's arithmetic. nf4_block_scale and every GPU kernel use it.
QMM_HOST_DEVICE inline float dq_block_scale(float code2_value, float absmax2, float offset) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(code2_value, absmax2), offset);
#else
  const float product = code2_value * absmax2;
  return product + offset;
#endif
}

// Two floats rounded to bf16 (nearest even), lo in the low half.
QMM_HOST_DEVICE inline std::uint32_t pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
#else
  return static_cast<std::uint32_t>(float_to_bf16(lo)) | (static_cast<std::uint32_t>(float_to_bf16(hi)) << 16);
#endif
}

// The 16 values of one NF4 block, bf16(code value * scale) rounded as nf4_dequantize does, as byte planes: lo[j]
// holds the low bytes of values 4j..4j+3, hi[j] their high bytes. 16 multiplies per block instead of one per element.
struct BlockTable {
  std::uint32_t lo[4], hi[4];
};

QMM_HOST_DEVICE inline BlockTable block_table(float s) {
  BlockTable t;
QMM_NF4_LUT_UNROLL
  for (int j = 0; j < 4; ++j) {
    const std::uint32_t p0 = pack_bf16x2(nf4_code_value(4 * j) * s, nf4_code_value(4 * j + 1) * s);
    const std::uint32_t p1 = pack_bf16x2(nf4_code_value(4 * j + 2) * s, nf4_code_value(4 * j + 3) * s);
    t.lo[j] = byte_perm(p0, p1, 0x6420);
    t.hi[j] = byte_perm(p0, p1, 0x7531);
  }
  return t;
}

// One plane's bytes at four 4-bit codes: sel7 holds the codes' low 3 bits (one nibble each, output byte i from
// nibble i), merge picks per byte from the lookup in entries 0-7 or 8-15 (nibble i = i, + 4 where bit 3 is set).
QMM_HOST_DEVICE inline std::uint32_t plane_lookup(const std::uint32_t (&p)[4], std::uint32_t sel7,
                                                  std::uint32_t merge) {
  return byte_perm(byte_perm(p[0], p[1], sel7), byte_perm(p[2], p[3], sel7), merge);
}

// 8 codes (one 32-bit word; the first element in the high nibble of the first byte) -> 8 bf16 as 4 bf16 pairs
// (element 2i in the low half of word i). A word's low 16 bits, read as four selector nibbles, are the codes of
// elements 1, 0, 3, 2; its high 16 bits those of 5, 4, 7, 6.
struct Bf16x8 {
  std::uint32_t w[4];
};

QMM_HOST_DEVICE inline Bf16x8 dequant_word(std::uint32_t w, const BlockTable& t) {
  const std::uint32_t sel7 = w & 0x77777777u;
  const std::uint32_t merge = ((w >> 1) & 0x44444444u) | 0x32103210u;
  Bf16x8 out;
QMM_NF4_LUT_UNROLL
  for (int h = 0; h < 2; ++h) {
    const std::uint32_t s7 = h ? sel7 >> 16 : sel7, m = h ? merge >> 16 : merge;
    const std::uint32_t lo = plane_lookup(t.lo, s7, m), hi = plane_lookup(t.hi, s7, m);  // bytes of e1, e0, e3, e2
    out.w[2 * h] = byte_perm(lo, hi, 0x4051);      // e0 | e1 << 16
    out.w[2 * h + 1] = byte_perm(lo, hi, 0x6273);  // e2 | e3 << 16
  }
  return out;
}

// One row of T as a quad lane's share of wgmma A fragments (RS form, mma.m16n8k16's A layout): lane t (lane % 4)
// holds k 2t, 2t + 1 and 2t + 8, 2t + 9 of each 16. From the row's 64 codes of a stage (32 bytes as 8 words):
// out[j] = the bf16 pair at k 8j + 2t (low half) and 8j + 2t + 1, i.e. kk = j / 2's first (j even) or second pair.
// The pair at k 8j + 2t is code byte 4j + t: byte t of each word, gathered, then looked up.
QMM_HOST_DEVICE inline void row_fragment(const std::uint32_t (&v)[8], int t, const BlockTable& tb,
                                         std::uint32_t (&out)[8]) {
  const std::uint32_t sel = static_cast<std::uint32_t>(t | ((t + 4) << 4));
QMM_NF4_LUT_UNROLL
  for (int h = 0; h < 2; ++h) {
    const std::uint32_t w =
        byte_perm(byte_perm(v[4 * h], v[4 * h + 1], sel), byte_perm(v[4 * h + 2], v[4 * h + 3], sel), 0x5410);
    const Bf16x8 d = dequant_word(w, tb);
QMM_NF4_LUT_UNROLL
    for (int j = 0; j < 4; ++j) out[4 * h + j] = d.w[j];
  }
}

}  // namespace qmm::nf4_lut
