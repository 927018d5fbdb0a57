// The fused GPU kernels dequantize NF4 through per-block byte-plane tables and byte permutes (src/core/nf4_lut.h).
// The same code compiled for the host must give bf16(nf4_code_value(code) * scale) for every code at every position
// of a word, for every scale, bit for bit: the dequantization contract (nf4_dequantize). Exhaustive over the 65536
// codes of a half word (both halves), for scales of both signs, zero, subnormal, tiny, large and random.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/nf4_lut.h"
#include "qmm/nf4.h"
#include "qmm/tensor.h"

namespace qmm {
namespace {

// Element e (0..7) of a word of 8 codes: byte e / 2, the even element in the high nibble.
int code_at(std::uint32_t word, int e) { return static_cast<int>((word >> (8 * (e / 2) + (e % 2 ? 0 : 4))) & 15u); }

// Half h of bf16 pair p of dequant_word's result: element 2p + h.
std::uint16_t bf16_at(const nf4_lut::Bf16x8& v, int e) {
  return static_cast<std::uint16_t>(v.w[e / 2] >> (16 * (e % 2)));
}

TEST(Nf4Lut, EveryCodeAtEveryPositionIsCodeTimesScaleInBf16) {
  std::vector<float> scales = {1.0f, -1.0f, 0.75f, -0.3f, 0.0f, -0.0f, 1e-3f, 1e-38f, 1e-45f, 3e38f, 65504.0f};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int i = 0; i < 8; ++i) scales.push_back(u(rng) * std::ldexp(1.0f, i * 9 - 40));
  for (float s : scales) {
    const nf4_lut::BlockTable t = nf4_lut::block_table(s);
    std::uint16_t want[16];
    for (int c = 0; c < 16; ++c) want[c] = float_to_bf16(nf4_code_value(c) * s);
    int bad = 0;
    for (std::uint32_t half = 0; half < 65536 && bad < 5; ++half) {
      // Every half word in the low half; in the high half the same codes in another order.
      const std::uint32_t word = half | (((half * 40503u) & 0xFFFFu) << 16);
      const nf4_lut::Bf16x8 got = nf4_lut::dequant_word(word, t);
      for (int e = 0; e < 8; ++e) {
        const int c = code_at(word, e);
        if (bf16_at(got, e) != want[c]) {
          ++bad;
          ADD_FAILURE() << "scale " << s << " word 0x" << std::hex << word << std::dec << " element " << e
                        << " code " << c << ": got 0x" << std::hex << bf16_at(got, e) << " want 0x" << want[c];
        }
      }
    }
  }
}

// The forward's register fragments: lane t's pair j is the dequantized elements k = 8j + 2t and 8j + 2t + 1 of
// the row (code byte k / 2, the even element in its high nibble), for random rows and scales.
TEST(Nf4Lut, RowFragmentHoldsTheWgmmaALayout) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::uint32_t v[8];
    for (std::uint32_t& w : v) w = static_cast<std::uint32_t>(rng());
    const float s = std::ldexp(static_cast<float>(rng() % 2000) / 1000.0f - 1.0f, static_cast<int>(rng() % 40) - 20);
    const nf4_lut::BlockTable tb = nf4_lut::block_table(s);
    auto element = [&](int k) {
      const std::uint32_t byte = (v[k / 8] >> (8 * ((k / 2) % 4))) & 0xFFu;
      const int code = static_cast<int>(k % 2 ? byte & 15u : byte >> 4);
      return float_to_bf16(nf4_code_value(code) * s);
    };
    for (int t = 0; t < 4; ++t) {
      std::uint32_t out[8];
      nf4_lut::row_fragment(v, t, tb, out);
      for (int j = 0; j < 8; ++j) {
        const int k = 8 * j + 2 * t;
        EXPECT_EQ(out[j] & 0xFFFFu, element(k)) << "trial " << trial << " t " << t << " j " << j;
        EXPECT_EQ(out[j] >> 16, element(k + 1)) << "trial " << trial << " t " << t << " j " << j;
      }
    }
  }
}

// The host form of the byte permute against its definition on a few selectors the kernels use.
TEST(Nf4Lut, BytePermuteSelectsBytesOfBothWords) {
  const std::uint32_t x = 0x33221100u, y = 0x77665544u;
  EXPECT_EQ(nf4_lut::byte_perm(x, y, 0x3210), x);
  EXPECT_EQ(nf4_lut::byte_perm(x, y, 0x7654), y);
  EXPECT_EQ(nf4_lut::byte_perm(x, y, 0x6420), 0x66442200u);
  EXPECT_EQ(nf4_lut::byte_perm(x, y, 0x4051), 0x44005511u);
  EXPECT_EQ(nf4_lut::byte_perm(x, y, 0xFFFF0000u), 0x00000000u);  // the upper 16 selector bits are ignored
}

}  // namespace
}  // namespace qmm
