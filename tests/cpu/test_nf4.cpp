// NF4 on the CPU backend: byte identity with bitsandbytes' golden vectors (quantize, double quantization,
// dequantize, a whole Linear4bit checkpoint), the NF4 GEMMs against naive loops over the dequantized weight,
// gate_up against its parts, edge cases of the format, and every validation path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "core/nf4_forced.h"
#include "cpu/nf4_internal.h"

namespace qmm {
namespace {

using test::bits_of;

const Context& cpu_ctx() {
  static const Context ctx = Context::cpu();
  return ctx;
}

std::string golden_path(const std::string& name) { return test::data_dir() + "/nf4-bnb/" + name; }

std::vector<std::string> golden_files() {
  std::ifstream in(golden_path("manifest.json"));
  return nlohmann::json::parse(in).get<std::vector<std::string>>();
}

// Distance in representable floats (both finite).
std::int64_t ulp_distance(float a, float b) {
  auto key = [](float x) {
    const std::int64_t u = bits_of(x);
    return (u & 0x80000000) ? -(u & 0x7FFFFFFF) : u;
  };
  return std::llabs(key(a) - key(b));
}

// ---- golden vectors -------------------------------------------------------------------------------------------

struct Golden {
  SafetensorsFile file;
  std::int64_t n = 0, k = 0;
  bool dq = false;
  std::string dtype;

  explicit Golden(const std::string& name) : file(SafetensorsFile::open(golden_path(name))) {
    n = std::stoll(file.metadata().at("N"));
    k = std::stoll(file.metadata().at("K"));
    dq = file.metadata().at("double_quant") == "True";
    dtype = file.metadata().at("dtype");
  }
  std::int64_t nblocks() const { return (n * k + 63) / 64; }
};

// An Nf4Weight over tensors read from a file; the tensors live as long as this.
struct HeldWeight {
  Tensor codes, absmax, absmax2, code2;
  Nf4Weight w;
};

HeldWeight golden_weight(const Golden& g) {
  HeldWeight h;
  h.codes = g.file.tensor("codes", DType::U8);
  h.absmax = g.dq ? g.file.tensor("absmax_q", DType::U8) : g.file.tensor("absmax", DType::F32);
  h.w.codes = h.codes;
  h.w.absmax = h.absmax;
  if (g.dq) {
    h.absmax2 = g.file.tensor("absmax2", DType::F32);
    h.code2 = g.file.tensor("code2", DType::F32);
    h.w.absmax2 = h.absmax2;
    h.w.code2 = h.code2;
    h.w.offset = g.file.tensor("offset", DType::F32).data_as<float>()[0];
  }
  h.w.rows = g.n;
  h.w.cols = g.k;
  h.w.block_size = 64;
  return h;
}

TEST(Nf4Golden, QuantizeIsByteIdentical) {
  for (const std::string& name : golden_files()) {
    SCOPED_TRACE(name);
    const Golden g(name);
    const Tensor input = g.file.tensor("input");
    ASSERT_EQ(input.shape(), (Shape{g.n, g.k}));
    const Nf4Tensor q = nf4_quantize(cpu_ctx(), input, g.dq);
    EXPECT_TRUE(test::bytes_equal(q.codes, g.file.tensor("codes", DType::U8))) << "codes";
    if (!g.dq) {
      EXPECT_TRUE(test::bytes_equal(q.absmax, g.file.tensor("absmax", DType::F32))) << "absmax";
      continue;
    }
    // The offset: the contract is within one ulp of the producer's mean; this arithmetic reproduces it exactly.
    const float golden_offset = g.file.tensor("offset", DType::F32).data_as<float>()[0];
    EXPECT_LE(ulp_distance(q.offset, golden_offset), 1) << q.offset << " vs " << golden_offset;
    EXPECT_EQ(bits_of(q.offset), bits_of(golden_offset)) << q.offset << " vs " << golden_offset;

    // q and absmax2 from our fp32 absmax and the golden offset, as the format defines them.
    const Nf4Tensor plain = nf4_quantize(cpu_ctx(), input, false);
    const std::int64_t nb = g.nblocks();
    Tensor qq(DType::U8, {nb}), a2(DType::F32, {(nb + 255) / 256});
    cpu::nf4_double_quantize(plain.absmax.data_as<float>(), nb, golden_offset, qq.data_as<std::uint8_t>(),
                             a2.data_as<float>());
    EXPECT_TRUE(test::bytes_equal(qq, g.file.tensor("absmax_q", DType::U8))) << "absmax_q given the golden offset";
    EXPECT_TRUE(test::bytes_equal(a2, g.file.tensor("absmax2", DType::F32))) << "absmax2 given the golden offset";

    // End to end (our own offset).
    EXPECT_TRUE(test::bytes_equal(q.absmax, g.file.tensor("absmax_q", DType::U8))) << "absmax_q";
    EXPECT_TRUE(test::bytes_equal(q.absmax2, g.file.tensor("absmax2", DType::F32))) << "absmax2";
    EXPECT_TRUE(test::bytes_equal(q.code2, g.file.tensor("code2", DType::F32))) << "code2";
  }
}

TEST(Nf4Golden, AbsmaxMeanMatchesTheProducerBitForBit) {
  for (const std::string& name : golden_files()) {
    const Golden g(name);
    if (!g.dq) continue;
    SCOPED_TRACE(name);
    const Nf4Tensor plain = nf4_quantize(cpu_ctx(), g.file.tensor("input"), false);
    const float mean = cpu::nf4_absmax_mean(plain.absmax.data_as<float>(), g.nblocks());
    EXPECT_EQ(bits_of(mean), bits_of(g.file.tensor("offset").data_as<float>()[0]));
  }
}

TEST(Nf4Golden, Code2TableIsBitExact) {
  const float* table = nf4_code2_table();
  for (int i = 1; i < 256; ++i) EXPECT_LT(table[i - 1], table[i]) << "ascending and distinct at " << i;
  EXPECT_EQ(table[255], 1.0f);
  int checked = 0;
  for (const std::string& name : golden_files()) {
    const Golden g(name);
    if (!g.dq) continue;
    const Tensor code2 = g.file.tensor("code2", DType::F32);
    ASSERT_EQ(code2.numel(), 256);
    for (int i = 0; i < 256; ++i)
      EXPECT_EQ(bits_of(table[i]), bits_of(code2.data_as<float>()[i])) << name << " [" << i << "]";
    ++checked;
  }
  EXPECT_EQ(checked, 5);
  const SafetensorsFile lin = SafetensorsFile::open(golden_path("linear4bit_state_dict.safetensors"));
  const Tensor nested = lin.tensor("weight.nested_quant_map", DType::F32);
  EXPECT_EQ(std::memcmp(nested.data(), table, 256 * sizeof(float)), 0);
  const Tensor quant_map = lin.tensor("weight.quant_map", DType::F32);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(quant_map.data_as<float>()[i], nf4_code_value(i)) << i;
}

TEST(Nf4Golden, DequantizeIsBitIdentical) {
  for (const std::string& name : golden_files()) {
    SCOPED_TRACE(name);
    const Golden g(name);
    const HeldWeight h = golden_weight(g);
    const Tensor ref = g.file.tensor("dequant");
    Tensor out32(DType::F32, {g.n, g.k});
    test::poison(out32);
    nf4_dequantize(cpu_ctx(), h.w, out32);
    if (g.dtype == "f32") {
      EXPECT_TRUE(test::bytes_equal(out32, ref));
    } else if (g.dtype == "bf16") {
      Tensor out16(DType::BF16, {g.n, g.k});
      test::poison(out16);
      nf4_dequantize(cpu_ctx(), h.w, out16);
      EXPECT_TRUE(test::bytes_equal(out16, ref));
    } else {
      // No f16 output dtype: the fp32 values rounded to f16 (nearest even) are the producer's f16 output.
      ASSERT_EQ(ref.dtype(), DType::F16);
      Tensor as_f16(DType::F16, {g.n, g.k});
      for (std::int64_t i = 0; i < out32.numel(); ++i)
        as_f16.data_as<std::uint16_t>()[i] = float_to_f16(out32.data_as<float>()[i]);
      EXPECT_TRUE(test::bytes_equal(as_f16, ref));
    }
    // bf16 output is the fp32 value rounded once (nearest even), for every file.
    Tensor out16(DType::BF16, {g.n, g.k});
    nf4_dequantize(cpu_ctx(), h.w, out16);
    for (std::int64_t i = 0; i < out32.numel(); ++i)
      ASSERT_EQ(out16.data_as<std::uint16_t>()[i], float_to_bf16(out32.data_as<float>()[i])) << i;

    if (g.dq) {  // the rebuilt scales
      const Tensor scales = g.file.tensor("absmax_dequant", DType::F32);
      for (std::int64_t b = 0; b < g.nblocks(); ++b)
        ASSERT_EQ(bits_of(nf4_block_scale(h.w, b)), bits_of(scales.data_as<float>()[b])) << "block " << b;
    }
  }
}

// The golden codebook next to the header's, and the decision thresholds: x gets the upper of two neighbouring
// codes iff x > T, T the fp32 value of bitsandbytes' decimal threshold (its dQuantizeNF4 constants). T lies within
// one fp32 step of the exact midpoint of the two codes; where the midpoint is an fp32 value T is the midpoint, so
// a value exactly on it goes to the lower code. NaN (an all-zero block) gives code 0.
TEST(Nf4Format, NearestCodeThresholds) {
  const Golden g("case0_64x64_f32.safetensors");
  const Tensor cb = g.file.tensor("codebook", DType::F32);
  for (int i = 0; i < 16; ++i) ASSERT_EQ(bits_of(cb.data_as<float>()[i]), bits_of(nf4_code_value(i)));
  constexpr float kThreshold[15] = {
      -0.8480964004993439f,  -0.6106329262256622f,   -0.4599952697753906f, -0.33967943489551544f, -0.23460740596055984f,
      -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,   0.2035212516784668f,
      0.2920137718319893f,   0.3893125355243683f,    0.5016634166240692f,  0.6427869200706482f,   0.8614784181118011f};
  int exact = 0;
  for (int i = 0; i < 15; ++i) {
    const float t = kThreshold[i];
    EXPECT_EQ(nf4_nearest_code(t), i) << "on threshold " << i;
    EXPECT_EQ(nf4_nearest_code(std::nextafter(t, 2.0f)), i + 1) << "above threshold " << i;
    const double mid = (static_cast<double>(nf4_code_value(i)) + nf4_code_value(i + 1)) / 2.0;
    EXPECT_LT(std::fabs(t - mid), std::fabs(std::nextafter(t, 2.0f) - t)) << "threshold " << i << " off the midpoint";
    exact += static_cast<double>(t) == mid;
    EXPECT_EQ(nf4_nearest_code(nf4_code_value(i)), i);
  }
  EXPECT_EQ(exact, 6) << "midpoints that are fp32 values (ties to the lower code)";
  EXPECT_EQ(nf4_nearest_code(1.0f), 15);
  EXPECT_EQ(nf4_nearest_code(-1.0f), 0);
  EXPECT_EQ(nf4_nearest_code(0.0f), 7);
  EXPECT_EQ(nf4_nearest_code(-0.0f), 7);
  EXPECT_EQ(nf4_nearest_code(std::numeric_limits<float>::quiet_NaN()), 0);

  // code2: exact midpoints go to the lower index, NaN to 0.
  const float* c2 = nf4_code2_table();
  for (int j = 0; j < 255; ++j) {
    const float mid = (c2[j] + c2[j + 1]) * 0.5f;
    EXPECT_EQ(cpu::nf4_nearest_code2(mid), j);
    EXPECT_EQ(cpu::nf4_nearest_code2(std::nextafter(mid, 2.0f)), j + 1);
    EXPECT_EQ(cpu::nf4_nearest_code2(c2[j]), j);
  }
  EXPECT_EQ(cpu::nf4_nearest_code2(std::numeric_limits<float>::quiet_NaN()), 0);
}

// A whole Linear4bit(512 -> 256) layer as checkpoints store it, read field by field.
TEST(Nf4Golden, Linear4bitCheckpoint) {
  const SafetensorsFile f = SafetensorsFile::open(golden_path("linear4bit_state_dict.safetensors"));
  const std::vector<std::uint8_t> qs_bytes = f.bytes("weight.quant_state.bitsandbytes__nf4");
  const nlohmann::json qs = nlohmann::json::parse(qs_bytes.begin(), qs_bytes.end());
  ASSERT_EQ(qs.at("quant_type"), "nf4");
  ASSERT_EQ(qs.at("nested_blocksize").get<int>(), kNf4NestedBlockSize);
  const auto shape = qs.at("shape").get<std::vector<std::int64_t>>();
  ASSERT_EQ(shape.size(), 2u);

  HeldWeight h;
  h.codes = f.tensor("weight", DType::U8);  // [65536, 1]: the packed bytes in a column
  h.absmax = f.tensor("weight.absmax", DType::U8);
  h.absmax2 = f.tensor("weight.nested_absmax", DType::F32);
  h.code2 = f.tensor("weight.nested_quant_map", DType::F32);
  h.w.codes = h.codes;
  h.w.absmax = h.absmax;
  h.w.absmax2 = h.absmax2;
  h.w.code2 = h.code2;
  h.w.offset = qs.at("nested_offset").get<float>();  // the fp32 offset, printed as a double: exact
  h.w.rows = shape[0];
  h.w.cols = shape[1];
  h.w.block_size = qs.at("blocksize").get<int>();

  const Tensor ref_w = f.tensor("_ref.weight_dequant", DType::F32);
  Tensor w(DType::F32, {h.w.rows, h.w.cols});
  test::poison(w);
  nf4_dequantize(cpu_ctx(), h.w, w);
  EXPECT_TRUE(test::bytes_equal(w, ref_w));

  // y = x W^T + bias: C starts as the bias, beta = 1 adds it to the fp64 sum of bf16 products.
  const Tensor x = f.tensor("_ref.x", DType::BF16);
  const Tensor bias = f.tensor("bias", DType::F32);
  const Tensor y_ref = f.tensor("_ref.y", DType::F32);
  const std::int64_t m = x.dim(0), n = h.w.rows;
  Tensor y(DType::F32, {m, n});
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) y.data_as<float>()[i * n + j] = bias.data_as<float>()[j];
  nf4_gemm(cpu_ctx(), x, h.w, y, {1.0f, 1.0f, Nf4Path::Auto});
  // The producer's y is bf16 (bf16 compute through a GPU bf16 GEMM), ours fp32 of the exact fp64 sum. Its error
  // is not relative to |y|: against the exact sum it reaches 0.0059 (at |y| = 1.09) and 0.0043 where |y| = 0.14,
  // i.e. about 2^-10 of sum_k |x_k w_k|, the mark of bf16 roundings of partial sums of magnitude ~1. So the bound
  // is one bf16 ulp at the output's scale (max |y| = 1.35: ulp 2^-7) absolute, plus one bf16 rounding of y
  // (2^-8) relative; the Frobenius limit is two bf16 roundings (2^-7; observed 0.0038).
  EXPECT_TRUE(test::all_close(y, y_ref, {1.0 / 128, 1.0 / 256, 1.0 / 128}));
}

// ---- naive references -----------------------------------------------------------------------------------------

double load(const TensorView& t, std::int64_t i) {
  return t.dtype() == DType::BF16 ? bf16_to_float(t.data_as<std::uint16_t>()[i]) : t.data_as<float>()[i];
}
double round_bf16(double x) { return bf16_to_float(float_to_bf16(static_cast<float>(x))); }

// W dequantized element by element (nibble, codebook, scale) and rounded to bf16: the GEMM's weight operand.
std::vector<double> weight_bf16(const Nf4Weight& w) {
  std::vector<double> out(static_cast<std::size_t>(w.numel()));
  const auto* codes = w.codes.data_as<const std::uint8_t>();
  for (std::int64_t e = 0; e < w.numel(); ++e) {
    const int code = (e % 2 == 0) ? codes[e / 2] >> 4 : codes[e / 2] & 15;
    out[static_cast<std::size_t>(e)] = round_bf16(nf4_code_value(code) * nf4_block_scale(w, e / w.block_size));
  }
  return out;
}

// out[i,j] = alpha * sum_p bf16(x[i,p]) * b(p, j) + beta * out_old[i,j], rounded to out's dtype.
Tensor naive(const TensorView& x, std::int64_t cols, std::int64_t depth,
             const std::function<double(std::int64_t, std::int64_t)>& b, const TensorView& out_old, float alpha,
             float beta) {
  const std::int64_t rows = x.dim(0);
  Tensor out(out_old.dtype(), {rows, cols});
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      double acc = 0;
      for (std::int64_t p = 0; p < depth; ++p) acc += round_bf16(load(x, i * depth + p)) * b(p, j);
      double v = static_cast<double>(alpha) * acc;
      if (beta != 0.0f) v += static_cast<double>(beta) * load(out_old, i * cols + j);
      if (out.dtype() == DType::BF16)
        out.data_as<std::uint16_t>()[i * cols + j] = float_to_bf16(static_cast<float>(v));
      else
        out.data_as<float>()[i * cols + j] = static_cast<float>(v);
    }
  return out;
}

// Both sides multiply the same bf16 operands exactly and sum in fp64; only an fp64 summation order could differ
// (1e-16 relative to the terms, hence the tiny atol), so results agree to within one rounding of the output:
// one ulp of f32 (2^-23) or of bf16 (2^-7) relative.
test::Tolerance same_operands(DType out) {
  return out == DType::BF16 ? test::Tolerance{1e-12, 1.0 / 128, 1.0 / 256} : test::Tolerance{1e-12, 1.2e-7, 1e-7};
}

struct GemmCase {
  std::int64_t m, n, k;
};
const GemmCase kRagged[] = {{1, 7, 100},   {7, 7, 100},  {65, 7, 100}, {1, 33, 130}, {7, 33, 130},
                            {65, 33, 130}, {1, 64, 192}, {7, 64, 192}, {65, 64, 192}};

TEST(Nf4Gemm, MatchesNaiveLoopOverDequantizedWeight) {
  std::uint64_t seed = 100;
  for (const GemmCase& s : kRagged)
    for (bool dq : {false, true}) {
      const Nf4Tensor w = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {s.n, s.k}, ++seed), dq);
      const std::vector<double> wb = weight_bf16(w);
      for (DType adt : {DType::F32, DType::BF16})
        for (DType cdt : {DType::F32, DType::BF16})
          for (float beta : {0.0f, 0.5f}) {
            const float alpha = 0.75f;
            SCOPED_TRACE(testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k << " dq=" << dq << " A="
                                            << dtype_name(adt) << " C=" << dtype_name(cdt) << " beta=" << beta);
            const Tensor a = test::random_tensor(adt, {s.m, s.k}, ++seed);
            const Tensor c0 = test::random_tensor(cdt, {s.m, s.n}, ++seed);
            const Tensor ref = naive(
                a, s.n, s.k, [&](std::int64_t p, std::int64_t j) { return wb[j * s.k + p]; }, c0, alpha, beta);
            Tensor c = test::host_copy(c0);
            if (beta == 0.0f) test::poison(c);  // beta = 0 must not read C
            nf4_gemm(cpu_ctx(), a, w, c, {alpha, beta, Nf4Path::Auto});
            EXPECT_TRUE(test::all_close(c, ref, same_operands(cdt)));
            Tensor c_ref = test::host_copy(c0);
            nf4_gemm(cpu_ctx(), a, w, c_ref, {alpha, beta, nf4_forced::kReference});
            EXPECT_TRUE(test::bytes_equal(c_ref, c)) << "Reference and Auto are one path on the CPU";
          }
    }
}

// The GPU tests' model of the small-M pair kernel's scale-after contract (ops.h): it must agree with the
// dequantized weight's product to bf16 weight rounding (both weights are within 2^-9 of code * scale), differ from
// it beyond fp32 accumulation (or the GPU tests could not tell the contracts apart), and equal it where no rounding
// happens: integer activations, codes 0 and 15 only (values -1 and 1) and scales exact in bf16.
TEST(Nf4Gemm, ScaleAfterReferenceIsTheDocumentedContract) {
  const std::int64_t m = 3, n = 37, k = 512;
  const Nf4Tensor w = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 310, -0.05f, 0.05f), true);
  const Tensor a = test::random_tensor(DType::BF16, {m, k}, 311);
  const Tensor c0 = test::random_tensor(DType::F32, {m, n}, 312);
  Tensor exact = test::host_copy(c0);
  nf4_gemm(cpu_ctx(), a, w, exact, {0.75f, 0.5f});
  const Tensor after = test::nf4_scale_after_reference(a, w, c0, 0.75f, 0.5f);
  EXPECT_TRUE(test::all_close(after, exact, test::bf16_output_tolerance(k)));
  EXPECT_FALSE(test::all_close(after, exact, test::fp32_accum_tolerance(k)));

  Nf4Tensor signs = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 314), false);
  auto* bytes = signs.codes.data_as<std::uint8_t>();
  for (std::int64_t i = 0; i < signs.codes.numel(); ++i) bytes[i] = (i % 3 == 0) ? 0x0F : (i % 3 == 1) ? 0xF0 : 0xFF;
  auto* scales = signs.absmax.data_as<float>();
  for (std::int64_t i = 0; i < signs.absmax.numel(); ++i) scales[i] = 0.25f * static_cast<float>(1 + i % 5);
  const Tensor ai = test::random_int_tensor(DType::BF16, {m, k}, 313);
  Tensor exact_signs(DType::F32, {m, n});
  nf4_gemm(cpu_ctx(), ai, signs, exact_signs);
  const Tensor zero = test::filled(DType::F32, {m, n}, 0.0f);
  EXPECT_TRUE(test::all_close(test::nf4_scale_after_reference(ai, signs, zero, 1.0f, 0.0f), exact_signs,
                              test::fp32_accum_tolerance(k)));
}

TEST(Nf4Gemm, BackwardMatchesNaiveLoopOverDequantizedWeight) {
  std::uint64_t seed = 200;
  for (const GemmCase& s : kRagged)
    for (bool dq : {false, true}) {
      const Nf4Tensor w = nf4_quantize(cpu_ctx(), test::random_tensor(DType::BF16, {s.n, s.k}, ++seed), dq);
      const std::vector<double> wb = weight_bf16(w);
      for (DType dt : {DType::F32, DType::BF16})
        for (float beta : {0.0f, 1.0f}) {
          const float alpha = 1.25f;
          SCOPED_TRACE(testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k << " dq=" << dq
                                          << " dtype=" << dtype_name(dt) << " beta=" << beta);
          const Tensor dc = test::random_tensor(dt, {s.m, s.n}, ++seed);
          const Tensor da0 = test::random_tensor(dt, {s.m, s.k}, ++seed);
          // dA[i,p] = sum_j dC[i,j] W[j,p]
          const Tensor ref = naive(
              dc, s.k, s.n, [&](std::int64_t j, std::int64_t p) { return wb[j * s.k + p]; }, da0, alpha, beta);
          Tensor da = test::host_copy(da0);
          if (beta == 0.0f) test::poison(da);
          nf4_gemm_backward_a(cpu_ctx(), dc, w, da, {alpha, beta, Nf4Path::Auto});
          EXPECT_TRUE(test::all_close(da, ref, same_operands(dt)));
        }
    }
}

// A Qwen2.5-1.5B-sized projection at M = 64 stays quick; rows checked against the naive loop.
TEST(Nf4Gemm, RealisticShapeRunsAndMatches) {
  const std::int64_t m = 64, n = 1536, k = 1536;
  const Nf4Tensor w = nf4_quantize(cpu_ctx(), test::random_tensor(DType::BF16, {n, k}, 301, -0.05f, 0.05f), true);
  const Tensor a = test::random_tensor(DType::BF16, {m, k}, 302);
  Tensor c(DType::F32, {m, n});
  test::poison(c);
  nf4_gemm(cpu_ctx(), a, w, c);
  const std::vector<double> wb = weight_bf16(w);
  for (std::int64_t i : {std::int64_t{0}, std::int64_t{37}, m - 1}) {
    const TensorView row(a.data_as<std::uint16_t>() + i * k, DType::BF16, {1, k});
    const Tensor zero = test::filled(DType::F32, {1, n}, 0.0f);
    const Tensor ref = naive(
        row, n, k, [&](std::int64_t p, std::int64_t j) { return wb[j * k + p]; }, zero, 1, 0);
    const TensorView got(c.data_as<float>() + i * n, DType::F32, {1, n});
    EXPECT_TRUE(test::all_close(got, ref, same_operands(DType::F32))) << "row " << i;
  }
}

// NF4 has no code for NaN or infinity: quantize names the first one (row and column) and writes nothing.
TEST(Nf4Quantize, RejectsNonFiniteWeightsNamingTheFirstAndWritesNothing) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (bool dq : {false, true})
      for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
        Tensor wt = test::random_tensor(dt, {9, 130}, 7);
        for (std::int64_t i : {std::int64_t{4 * 130 + 17}, std::int64_t{8 * 130 + 1}}) test::set_value(wt, i, bad);
        Nf4Tensor out = Nf4Tensor::allocate(9, 130, dq);
        std::fill_n(out.codes.data_as<std::uint8_t>(), out.codes.numel(), std::uint8_t{0xAB});
        Nf4Weight view = out.view();
        EXPECT_TRUE(test::throws_error([&] { nf4_quantize(cpu_ctx(), wt, view); }, ErrorCode::InvalidArgument,
                                       {"nf4_quantize", "index 537", "row 4, column 17", "NaN or infinity"}))
            << dtype_name(dt) << (dq ? " double" : " plain");
        for (std::int64_t i = 0; i < out.codes.numel(); ++i)
          ASSERT_EQ(out.codes.data_as<std::uint8_t>()[i], 0xAB) << "quantize wrote before failing";
      }
}

TEST(Nf4Gemm, EmptyMWritesNothing) {
  const Nf4Tensor w = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {8, 64}, 5), false);
  Tensor a(DType::F32, {0, 64}), c(DType::F32, {0, 8});
  EXPECT_NO_THROW(nf4_gemm(cpu_ctx(), a, w, c));
  EXPECT_NO_THROW(nf4_gemm_backward_a(cpu_ctx(), c, w, a));
}

// gate_up against two nf4_gemm calls and a naive SwiGLU of their fp32 values, for every output combination.
TEST(Nf4GateUp, EveryOutputCombinationMatchesItsParts) {
  const std::int64_t m = 7, n = 33, k = 130;
  const float alpha = 0.5f;
  for (bool dq : {false, true})
    for (DType adt : {DType::F32, DType::BF16}) {
      const Nf4Tensor wg = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 401), dq);
      const Nf4Tensor wu = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 402), dq);
      // gate spans the sigmoid's tails: scale A up.
      const Tensor a = test::random_tensor(adt, {m, k}, 403, -3.0f, 3.0f);
      Tensor g32(DType::F32, {m, n}), u32(DType::F32, {m, n});
      nf4_gemm(cpu_ctx(), a, wg, g32, {alpha, 0.0f, Nf4Path::Auto});
      nf4_gemm(cpu_ctx(), a, wu, u32, {alpha, 0.0f, Nf4Path::Auto});
      for (DType odt : {DType::F32, DType::BF16}) {
        // References in the output dtype: gate and up rounded once, h from the fp32 gate and up in double.
        Tensor g_ref(odt, {m, n}), u_ref(odt, {m, n}), h_ref(odt, {m, n});
        for (std::int64_t i = 0; i < m * n; ++i) {
          const double gv = g32.data_as<float>()[i], uv = u32.data_as<float>()[i];
          const double hv = gv / (1.0 + std::exp(-gv)) * uv;
          if (odt == DType::F32) {
            g_ref.data_as<float>()[i] = static_cast<float>(gv);
            u_ref.data_as<float>()[i] = static_cast<float>(uv);
            h_ref.data_as<float>()[i] = static_cast<float>(hv);
          } else {
            g_ref.data_as<std::uint16_t>()[i] = float_to_bf16(static_cast<float>(gv));
            u_ref.data_as<std::uint16_t>()[i] = float_to_bf16(static_cast<float>(uv));
            h_ref.data_as<std::uint16_t>()[i] = float_to_bf16(static_cast<float>(hv));
          }
        }
        for (int mask = 1; mask < 8; ++mask) {
          SCOPED_TRACE(testing::Message()
                       << "dq=" << dq << " A=" << dtype_name(adt) << " out=" << dtype_name(odt) << " mask=" << mask);
          Tensor g(odt, {m, n}), u(odt, {m, n}), h(odt, {m, n});
          test::poison(g);
          test::poison(u);
          test::poison(h);
          const Tensor g_before = test::host_copy(g), u_before = test::host_copy(u), h_before = test::host_copy(h);
          const GateUpOutputs out{(mask & 1) ? TensorView(g) : TensorView(), (mask & 2) ? TensorView(u) : TensorView(),
                                  (mask & 4) ? TensorView(h) : TensorView()};
          nf4_gate_up(cpu_ctx(), a, wg, wu, out, {alpha, 0.0f, Nf4Path::Auto});
          EXPECT_TRUE(test::bytes_equal(g, (mask & 1) ? g_ref : g_before)) << "gate";
          EXPECT_TRUE(test::bytes_equal(u, (mask & 2) ? u_ref : u_before)) << "up";
          if (mask & 4) {
            // exp() and the order of the double operations may move h by one output rounding.
            const double ulp = odt == DType::BF16 ? 1.0 / 128 : 1.2e-7;
            EXPECT_TRUE(test::all_close(h, h_ref, {1e-30, ulp, ulp})) << "h";
          } else {
            EXPECT_TRUE(test::bytes_equal(h, h_before)) << "h untouched";
          }
        }
      }
    }
}

// Mixed output dtypes: a bf16 gate does not feed h rounded; h still comes from the fp32 values.
TEST(Nf4GateUp, HIsComputedFromFp32GateAndUpWhateverTheirDtype) {
  const std::int64_t m = 3, n = 7, k = 100;
  const Nf4Tensor wg = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 411), false);
  const Nf4Tensor wu = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 412), false);
  const Tensor a = test::random_tensor(DType::BF16, {m, k}, 413);
  Tensor g_bf(DType::BF16, {m, n}), u_f32(DType::F32, {m, n}), h_a(DType::F32, {m, n}), h_b(DType::F32, {m, n});
  nf4_gate_up(cpu_ctx(), a, wg, wu, {g_bf, u_f32, h_a});
  nf4_gate_up(cpu_ctx(), a, wg, wu, {TensorView(), TensorView(), h_b});
  EXPECT_TRUE(test::bytes_equal(h_a, h_b));
}

// beta != 0 (no h): gate and up accumulate exactly as two nf4_gemm calls with the same beta.
TEST(Nf4GateUp, BetaAccumulatesLikeNf4Gemm) {
  const std::int64_t m = 5, n = 9, k = 192;
  const Nf4Tensor wg = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 421), true);
  const Nf4Tensor wu = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {n, k}, 422), true);
  const Tensor a = test::random_tensor(DType::BF16, {m, k}, 423);
  for (DType odt : {DType::F32, DType::BF16}) {
    const Tensor g0 = test::random_tensor(odt, {m, n}, 424), u0 = test::random_tensor(odt, {m, n}, 425);
    Tensor g = test::host_copy(g0), u = test::host_copy(u0), g_ref = test::host_copy(g0), u_ref = test::host_copy(u0);
    nf4_gate_up(cpu_ctx(), a, wg, wu, {g, u, TensorView()}, {0.5f, 1.0f});
    nf4_gemm(cpu_ctx(), a, wg, g_ref, {0.5f, 1.0f});
    nf4_gemm(cpu_ctx(), a, wu, u_ref, {0.5f, 1.0f});
    EXPECT_TRUE(test::bytes_equal(g, g_ref)) << dtype_name(odt);
    EXPECT_TRUE(test::bytes_equal(u, u_ref)) << dtype_name(odt);
    EXPECT_FALSE(test::bytes_equal(g, g0)) << "the product was added";
  }
}

// ---- format edge cases ----------------------------------------------------------------------------------------

TEST(Nf4Format, AllZeroBlocks) {
  // Block 1 of 3 is all zeros (plus -0.0), the others random.
  Tensor w = test::random_tensor(DType::F32, {3, 64}, 501);
  for (int e = 64; e < 128; ++e) w.data_as<float>()[e] = (e % 3 == 0) ? -0.0f : 0.0f;
  const Nf4Tensor plain = nf4_quantize(cpu_ctx(), w, false);
  EXPECT_EQ(plain.absmax.data_as<float>()[1], 0.0f);
  for (int b = 32; b < 64; ++b) EXPECT_EQ(plain.codes.data_as<std::uint8_t>()[b], 0) << "NaN scaled value -> code 0";
  Tensor out(DType::F32, {3, 64});
  nf4_dequantize(cpu_ctx(), plain, out);
  for (int e = 64; e < 128; ++e) EXPECT_EQ(out.data_as<float>()[e], 0.0f) << e;
  Tensor out16(DType::BF16, {3, 64});
  nf4_dequantize(cpu_ctx(), plain, out16);
  for (int e = 64; e < 128; ++e) EXPECT_EQ(bf16_to_float(out16.data_as<std::uint16_t>()[e]), 0.0f) << e;

  // Double-quantized, the rebuilt scale is code2[q]*absmax2 + offset, close to but not exactly 0, and the codes
  // (0, i.e. -1.0) give -scale: bitsandbytes' own output for such a block (see the golden files' first block).
  const Nf4Tensor dq = nf4_quantize(cpu_ctx(), w, true);
  nf4_dequantize(cpu_ctx(), dq, out);
  const float scale = nf4_block_scale(dq, 1);
  EXPECT_LT(std::fabs(scale), 0.01f * std::max(plain.absmax.data_as<float>()[0], plain.absmax.data_as<float>()[2]));
  for (int e = 64; e < 128; ++e) EXPECT_EQ(out.data_as<float>()[e], -scale) << e;

  // A weight of zeros only: every scale 0 (offset 0, absmax2 0) and every value 0.
  const Tensor zeros = test::filled(DType::BF16, {2, 100}, 0.0f);
  for (bool d : {false, true}) {
    const Nf4Tensor z = nf4_quantize(cpu_ctx(), zeros, d);
    Tensor zo(DType::F32, {2, 100});
    nf4_dequantize(cpu_ctx(), z, zo);
    for (std::int64_t e = 0; e < 200; ++e) ASSERT_EQ(zo.data_as<float>()[e], 0.0f) << "dq=" << d << " " << e;
  }
}

TEST(Nf4Format, OddElementCountPadsWithTheZeroCode) {
  for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{7, 9}, {1, 1}, {3, 65}}) {
    const Tensor w = test::random_tensor(DType::F16, {n, k}, 600 + n);
    for (bool dq : {false, true}) {
      const Nf4Tensor q = nf4_quantize(cpu_ctx(), w, dq);
      ASSERT_EQ(q.codes.numel(), (n * k + 1) / 2);
      EXPECT_EQ(q.codes.data_as<std::uint8_t>()[q.codes.numel() - 1] & 15, kNf4ZeroCode) << n << "x" << k;
      // The last real element is in the high nibble: the same as quantizing it alone in its block.
      const float x = f16_to_float(w.data_as<std::uint16_t>()[n * k - 1]);
      const std::int64_t b = (n * k - 1) / 64;
      float amax = 0;
      for (std::int64_t e = b * 64; e < n * k; ++e)
        amax = std::max(amax, std::fabs(f16_to_float(w.data_as<std::uint16_t>()[e])));
      EXPECT_EQ(q.codes.data_as<std::uint8_t>()[q.codes.numel() - 1] >> 4, nf4_nearest_code(x * (1.0f / amax)));
    }
  }
}

// Other block sizes: absmax is the block's max |x|, each code is a nearest codebook value, and the round trip
// error is bounded by the largest half-gap of the codebook (0.1519, between -1.0 and -0.6962) times the scale.
TEST(Nf4Format, BlockSizes128And256RoundTrip) {
  for (int bs : {128, 256, 4096})
    for (bool dq : {false, true}) {
      SCOPED_TRACE(testing::Message() << "block " << bs << " dq " << dq);
      const std::int64_t n = 37, k = 300;  // 11100 elements: a partial last block for every size
      const Tensor w = test::random_tensor(DType::F32, {n, k}, 700 + bs);
      const Nf4Tensor q = nf4_quantize(cpu_ctx(), w, dq, bs);
      ASSERT_EQ(q.block_size, bs);
      ASSERT_EQ(q.absmax.numel(), (n * k + bs - 1) / bs);
      const Nf4Tensor plain = nf4_quantize(cpu_ctx(), w, false, bs);
      Tensor out(DType::F32, {n, k});
      nf4_dequantize(cpu_ctx(), q, out);
      const float* x = w.data_as<float>();
      for (std::int64_t b = 0; b * bs < n * k; ++b) {
        float amax = 0;
        const std::int64_t end = std::min(n * k, (b + 1) * bs);
        for (std::int64_t e = b * bs; e < end; ++e) amax = std::max(amax, std::fabs(x[e]));
        ASSERT_EQ(plain.absmax.data_as<float>()[b], amax) << b;
        const float scale = nf4_block_scale(q, b);
        if (dq) {  // the rebuilt scale: within half the widest code2 gap near +-1 (0.0071) of absmax2
          const float a2 = q.absmax2.data_as<float>()[b / 256];
          ASSERT_LE(std::fabs(scale - amax), 0.0075f * a2 + 1e-7f) << b;
        }
        for (std::int64_t e = b * bs; e < end; ++e) {
          const int code = nf4_unpack(q.codes.data_as<std::uint8_t>(), e);
          const double s = x[e] * (1.0f / amax);
          for (int j = 0; j < 16; ++j)
            ASSERT_LE(std::fabs(nf4_code_value(code) - s), std::fabs(nf4_code_value(j) - s) + 1e-6) << e;
          ASSERT_LE(std::fabs(out.data_as<float>()[e] - x[e]),
                    0.152f * std::fabs(scale) + std::fabs(scale - amax) + 1e-6f)
              << e;
        }
      }
    }
}

// ---- validation -----------------------------------------------------------------------------------------------

// Runs fn, which must throw `code` with every needle, and checks that none of `outputs` changed (they are
// poisoned first: NaN, or 0xFF bytes for u8).
::testing::AssertionResult rejected(const std::function<void()>& fn, ErrorCode code,
                                    const std::vector<std::string>& needles, const std::vector<TensorView>& outputs) {
  std::vector<Tensor> before;
  for (const TensorView& o : outputs) {
    test::poison(o);
    before.push_back(test::host_copy(o));
  }
  try {
    fn();
    return ::testing::AssertionFailure() << "did not throw";
  } catch (const Error& e) {
    if (e.code() != code)
      return ::testing::AssertionFailure()
             << "code " << error_code_name(e.code()) << " instead of " << error_code_name(code) << ": " << e.what();
    for (const auto& n : needles)
      if (std::string(e.what()).find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << e.what() << "\" lacks \"" << n << "\"";
  }
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (!test::bytes_equal(outputs[i], before[i])) return ::testing::AssertionFailure() << "output " << i << " changed";
  return ::testing::AssertionSuccess();
}

struct Operands {
  std::int64_t m = 3, n = 8, k = 128;
  Nf4Tensor w = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {8, 128}, 801), false);
  Nf4Tensor wdq = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {8, 128}, 802), true);
  Tensor a = test::random_tensor(DType::F32, {3, 128}, 803);
  Tensor c = Tensor(DType::F32, {3, 8});
};

// Broken variants of a valid weight, each with the fault its message must name.
struct BadWeight {
  const char* what;
  Nf4Weight w;
  ErrorCode code;
  std::vector<std::string> needles;
};

std::vector<BadWeight> bad_weights(const Operands& o) {
  std::vector<BadWeight> out;
  auto add = [&](const char* what, const Nf4Weight& w, ErrorCode code, std::vector<std::string> needles) {
    out.push_back({what, w, code, std::move(needles)});
  };
  Nf4Weight w = o.w.view(), d = o.wdq.view();
  Nf4Weight x = w;
  x.block_size = 48;
  add("block 48", x, ErrorCode::InvalidArgument, {"block size 48", "power of two", "[64, 4096]"});
  x = w;
  x.block_size = 8192;
  add("block 8192", x, ErrorCode::InvalidArgument, {"block size 8192", "[64, 4096]"});
  x = w;
  x.block_size = 96;
  add("block 96", x, ErrorCode::InvalidArgument, {"block size 96", "power of two"});
  x = w;
  x.rows = 0;
  add("rows 0", x, ErrorCode::InvalidArgument, {"rows and cols must be >= 1"});
  x = w;
  x.cols = -4;
  add("cols < 0", x, ErrorCode::InvalidArgument, {"rows and cols"});
  x = w;
  x.codes = TensorView(w.codes.data(), DType::U8, {w.codes.numel() - 1});
  add("codes short", x, ErrorCode::ShapeMismatch, {".codes", "511 bytes", "512"});
  x = w;
  x.codes = TensorView(w.codes.data(), DType::F32, {128});
  add("codes f32", x, ErrorCode::DTypeMismatch, {".codes", "f32"});
  x = w;
  x.codes = TensorView(nullptr, DType::U8, {512});
  add("codes null", x, ErrorCode::InvalidArgument, {".codes", "null"});
  x = w;
  x.codes = TensorView(w.codes.data(), DType::U8, {512}, Device::cuda(0));
  add("codes on cuda", x, ErrorCode::DeviceMismatch, {".codes", "cuda:0"});
  x = w;
  x.absmax = TensorView();
  add("absmax missing", x, ErrorCode::InvalidArgument, {".absmax is missing"});
  x = w;
  x.absmax = TensorView(w.absmax.data(), DType::F32, {15});
  add("absmax short", x, ErrorCode::ShapeMismatch, {".absmax", "15", "16 blocks"});
  x = w;
  x.absmax = TensorView(w.absmax.data(), DType::BF16, {16});
  add("absmax bf16", x, ErrorCode::DTypeMismatch, {".absmax", "bf16", "f32 (plain) or u8"});
  x = d;
  x.absmax2 = TensorView();
  add("absmax2 missing", x, ErrorCode::InvalidArgument, {".absmax2 is missing", "double-quantized"});
  x = d;
  x.code2 = TensorView();
  add("code2 missing", x, ErrorCode::InvalidArgument, {".code2 is missing"});
  x = d;
  x.absmax2 = TensorView(d.absmax2.data(), DType::F32, {2});
  add("absmax2 size", x, ErrorCode::ShapeMismatch, {".absmax2", "2 elements"});
  x = d;
  x.absmax2 = TensorView(d.absmax2.data(), DType::BF16, {1});
  add("absmax2 dtype", x, ErrorCode::DTypeMismatch, {".absmax2", "bf16"});
  x = d;
  x.code2 = TensorView(d.code2.data(), DType::F32, {255});
  add("code2 size", x, ErrorCode::ShapeMismatch, {".code2", "255", "256"});
  x = d;
  x.offset = std::numeric_limits<float>::quiet_NaN();
  add("offset NaN", x, ErrorCode::InvalidArgument, {".offset", "finite"});
  x = d;
  x.offset = std::numeric_limits<float>::infinity();
  add("offset inf", x, ErrorCode::InvalidArgument, {".offset", "finite"});
  return out;
}

TEST(Nf4Validation, EveryWeightFieldIsChecked) {
  const Operands o;
  const Tensor a_bf = test::random_tensor(DType::BF16, {3, 128}, 5);
  const Tensor dc = test::random_tensor(DType::F32, {3, 8}, 6);
  const Tensor w_in = test::random_tensor(DType::F32, {8, 128}, 7);
  // The bad views alias these buffers; as the quantizer's output none of them may be written.
  const std::vector<TensorView> weight_memory{o.w.codes,    o.w.absmax,    o.wdq.codes,
                                              o.wdq.absmax, o.wdq.absmax2, o.wdq.code2};
  std::vector<Tensor> weight_before;
  for (const TensorView& t : weight_memory) weight_before.push_back(test::host_copy(t));
  for (const BadWeight& b : bad_weights(o)) {
    SCOPED_TRACE(b.what);
    auto with = [&](const char* op, const char* name) {
      std::vector<std::string> v{op, name};
      v.insert(v.end(), b.needles.begin(), b.needles.end());
      return v;
    };
    Tensor c(DType::F32, {3, 8}), da(DType::F32, {3, 128}), deq(DType::F32, {8, 128});
    EXPECT_TRUE(rejected([&] { nf4_gemm(cpu_ctx(), o.a, b.w, c); }, b.code, with("nf4_gemm:", "W"), {c}));
    EXPECT_TRUE(rejected([&] { nf4_gemm_backward_a(cpu_ctx(), dc, b.w, da); }, b.code,
                         with("nf4_gemm_backward_a:", "W"), {da}));
    EXPECT_TRUE(rejected([&] { nf4_dequantize(cpu_ctx(), b.w, deq); }, b.code, with("nf4_dequantize:", "W"), {deq}));
    EXPECT_TRUE(rejected(
        [&] {
          nf4_gate_up(cpu_ctx(), a_bf, o.w, b.w, {c, TensorView(), TensorView()});
        },
        b.code, with("nf4_gate_up:", "w_up"), {c}));
    EXPECT_TRUE(rejected(
        [&] {
          nf4_gate_up(cpu_ctx(), a_bf, b.w, o.w, {TensorView(), c, TensorView()});
        },
        b.code, with("nf4_gate_up:", "w_gate"), {c}));
    Nf4Weight out = b.w;
    EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), w_in, out); }, b.code, with("nf4_quantize:", "out"), {}));
  }
  for (std::size_t i = 0; i < weight_memory.size(); ++i)
    EXPECT_TRUE(test::bytes_equal(weight_memory[i], weight_before[i])) << "weight buffer " << i;
}

TEST(Nf4Validation, GemmArguments) {
  const Operands o;
  Tensor c(DType::F32, {3, 8});
  const auto gemm = [&](const TensorView& a, const TensorView& cc, Nf4GemmOptions opts = {}) {
    return [&, a, cc, opts] { nf4_gemm(cpu_ctx(), a, o.w, cc, opts); };
  };
  const Tensor a3(DType::F32, {1, 3, 128}), a_f16(DType::F16, {3, 128}), a_k(DType::F32, {3, 100});
  EXPECT_TRUE(rejected(gemm(a3, c), ErrorCode::ShapeMismatch, {"nf4_gemm:", "A", "rank 2"}, {c}));
  EXPECT_TRUE(rejected(gemm(a_f16, c), ErrorCode::DTypeMismatch, {"nf4_gemm:", "A is f16"}, {c}));
  EXPECT_TRUE(rejected(gemm(a_k, c), ErrorCode::ShapeMismatch, {"nf4_gemm:", "A is [3,100]", "W is [8,128]"}, {c}));
  Tensor c_bad(DType::F32, {3, 9}), c_u8(DType::U8, {3, 8}), c_r1(DType::F32, {24});
  EXPECT_TRUE(rejected(gemm(o.a, c_bad), ErrorCode::ShapeMismatch, {"nf4_gemm:", "C is [3,9]", "[3,8]"}, {c_bad}));
  EXPECT_TRUE(rejected(gemm(o.a, c_u8), ErrorCode::DTypeMismatch, {"nf4_gemm:", "C is u8"}, {c_u8}));
  EXPECT_TRUE(rejected(gemm(o.a, c_r1), ErrorCode::ShapeMismatch, {"nf4_gemm:", "C", "rank 2"}, {c_r1}));
  const TensorView a_null(nullptr, DType::F32, {3, 128}), a_dev(o.a.data(), DType::F32, {3, 128}, Device::cuda(1));
  EXPECT_TRUE(rejected(gemm(a_null, c), ErrorCode::InvalidArgument, {"nf4_gemm:", "A has null data"}, {c}));
  EXPECT_TRUE(rejected(gemm(a_dev, c), ErrorCode::DeviceMismatch, {"nf4_gemm:", "A is on cuda:1"}, {c}));
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(rejected(gemm(o.a, c, {nan, 0, Nf4Path::Auto}), ErrorCode::InvalidArgument, {"nf4_gemm:", "alpha"}, {c}));
  EXPECT_TRUE(rejected(gemm(o.a, c, {1, inf, Nf4Path::Auto}), ErrorCode::InvalidArgument, {"nf4_gemm:", "beta"}, {c}));
  EXPECT_TRUE(rejected(gemm(o.a, c, {1, 0, static_cast<Nf4Path>(9)}), ErrorCode::InvalidArgument,
                       {"nf4_gemm:", "path 9 is unknown"}, {c}));
  for (Nf4Path p : {Nf4Path::DequantGemm, Nf4Path::Fused, nf4_forced::kSmallM, nf4_forced::kFusedShared,
                    nf4_forced::kFusedMma, nf4_forced::kSmallMSlice})
    EXPECT_TRUE(rejected(gemm(o.a, c, {1, 0, p}), ErrorCode::Unsupported,
                         {"nf4_gemm:", std::string("path ") + nf4_path_name(p), "CPU"}, {c}));

  // C overlapping A, or a weight field.
  Tensor buf(DType::F32, {3 * 128});
  const TensorView a_in(buf.data(), DType::F32, {3, 128});
  const TensorView c_in(buf.data_as<float>() + 100, DType::F32, {3, 8});
  EXPECT_TRUE(rejected(gemm(a_in, c_in), ErrorCode::InvalidArgument, {"nf4_gemm:", "C and A overlap"}, {}));
  const TensorView c_on_absmax(o.w.absmax.data(), DType::F32, {2, 8});
  const Tensor a2 = test::random_tensor(DType::F32, {2, 128}, 9);
  EXPECT_TRUE(rejected(gemm(a2, c_on_absmax), ErrorCode::InvalidArgument, {"nf4_gemm:", "C and W.absmax overlap"}, {}));
}

TEST(Nf4Validation, BackwardArguments) {
  const Operands o;
  Tensor da(DType::F32, {3, 128});
  const Tensor dc = test::random_tensor(DType::BF16, {3, 8}, 10), dc_n(DType::F32, {3, 9}), dc_f16(DType::F16, {3, 8});
  auto bwd = [&](const TensorView& d, const TensorView& out, Nf4GemmOptions opts = {}) {
    return [&, d, out, opts] { nf4_gemm_backward_a(cpu_ctx(), d, o.w, out, opts); };
  };
  EXPECT_TRUE(
      rejected(bwd(dc_n, da), ErrorCode::ShapeMismatch, {"nf4_gemm_backward_a:", "dC is [3,9]", "W is [8,128]"}, {da}));
  EXPECT_TRUE(rejected(bwd(dc_f16, da), ErrorCode::DTypeMismatch, {"nf4_gemm_backward_a:", "dC is f16"}, {da}));
  Tensor da_bad(DType::BF16, {3, 127});
  EXPECT_TRUE(rejected(bwd(dc, da_bad), ErrorCode::ShapeMismatch, {"nf4_gemm_backward_a:", "dA is [3,127]", "[3,128]"},
                       {da_bad}));
  EXPECT_TRUE(rejected(bwd(dc, da, {1, 0, nf4_forced::kSmallM}), ErrorCode::Unsupported,
                       {"nf4_gemm_backward_a:", "small_m"}, {da}));
  Tensor buf(DType::F32, {3 * 128 + 24});
  const TensorView da_in(buf.data(), DType::F32, {3, 128}),
      dc_in(buf.data_as<float>() + 3 * 128 - 4, DType::F32, {3, 8});
  EXPECT_TRUE(
      rejected(bwd(dc_in, da_in), ErrorCode::InvalidArgument, {"nf4_gemm_backward_a:", "dA and dC overlap"}, {}));
}

TEST(Nf4Validation, GateUpArguments) {
  const Operands o;
  const Tensor a = test::random_tensor(DType::BF16, {3, 128}, 11);
  Tensor g(DType::F32, {3, 8}), u(DType::BF16, {3, 8}), h(DType::F32, {3, 8});
  auto gu = [&](const GateUpOutputs& out, Nf4GemmOptions opts = {}, const Nf4Weight* wu = nullptr) {
    const Nf4Weight up = wu ? *wu : o.wdq.view();
    return [&, out, opts, up] { nf4_gate_up(cpu_ctx(), a, o.w, up, out, opts); };
  };
  EXPECT_TRUE(rejected(gu({}), ErrorCode::InvalidArgument, {"nf4_gate_up:", "no output", "gate, up, h"}, {}));
  EXPECT_TRUE(rejected(gu({g, u, h}, {1, 0.5f, Nf4Path::Auto}), ErrorCode::InvalidArgument,
                       {"nf4_gate_up:", "beta", "must be 0 when h is requested"}, {g, u, h}));
  EXPECT_TRUE(
      rejected(gu({g, u, h}, {1, 0, Nf4Path::Fused}), ErrorCode::Unsupported, {"nf4_gate_up:", "fused"}, {g, u, h}));
  const Nf4Tensor other = nf4_quantize(cpu_ctx(), test::random_tensor(DType::F32, {9, 128}, 12), false);
  const Nf4Weight other_w = other.view();
  EXPECT_TRUE(rejected(gu({g, u, h}, {}, &other_w), ErrorCode::ShapeMismatch,
                       {"nf4_gate_up:", "w_gate is [8,128]", "w_up is [9,128]"}, {g, u, h}));
  Tensor h_bad(DType::F32, {3, 7}), h_f16(DType::F16, {3, 8});
  EXPECT_TRUE(rejected(gu({g, u, h_bad}), ErrorCode::ShapeMismatch, {"nf4_gate_up:", "h is [3,7]"}, {g, u, h_bad}));
  EXPECT_TRUE(
      rejected(gu({g, TensorView(), h_f16}), ErrorCode::DTypeMismatch, {"nf4_gate_up:", "h is f16"}, {g, h_f16}));
  const Tensor a_k(DType::BF16, {3, 64});
  EXPECT_TRUE(rejected(
      [&] {
        nf4_gate_up(cpu_ctx(), a_k, o.w, o.w, {g, u, h});
      },
      ErrorCode::ShapeMismatch, {"nf4_gate_up:", "A is [3,64]"}, {g, u, h}));
  // Outputs overlapping each other or an input.
  Tensor buf(DType::F32, {40});
  const TensorView g_in(buf.data(), DType::F32, {3, 8}), h_in(buf.data_as<float>() + 16, DType::F32, {3, 8});
  EXPECT_TRUE(rejected(gu({g_in, u, h_in}), ErrorCode::InvalidArgument, {"nf4_gate_up:", "gate and h overlap"}, {u}));
  EXPECT_TRUE(
      rejected(gu({g, g, TensorView()}), ErrorCode::InvalidArgument, {"nf4_gate_up:", "gate and up overlap"}, {g}));
  const TensorView h_on_a(a.data(), DType::F32, {3, 8});
  EXPECT_TRUE(rejected(gu({g, u, h_on_a}), ErrorCode::InvalidArgument, {"nf4_gate_up:", "h and A overlap"}, {g, u}));
  const TensorView u_on_code2(o.wdq.code2.data(), DType::BF16, {3, 8});
  EXPECT_TRUE(rejected(gu({g, u_on_code2, h}), ErrorCode::InvalidArgument,
                       {"nf4_gate_up:", "up and w_up.code2 overlap"}, {g, h}));
}

TEST(Nf4Validation, QuantizeAndDequantizeArguments) {
  const Operands o;
  Nf4Tensor dst = Nf4Tensor::allocate(8, 128, true);
  Nf4Weight out = dst.view();
  const std::vector<TensorView> outs{dst.codes, dst.absmax, dst.absmax2, dst.code2};
  const Tensor w_r1(DType::F32, {1024}), w_u8(DType::U8, {8, 128}), w_empty(DType::F32, {0, 128}),
      w_shape(DType::F32, {8, 64});
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), w_r1, out); }, ErrorCode::ShapeMismatch,
                       {"nf4_quantize:", "W", "rank 2"}, outs));
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), w_u8, out); }, ErrorCode::DTypeMismatch,
                       {"nf4_quantize:", "W is u8", "f32 or bf16 or f16"}, outs));
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), w_empty, out); }, ErrorCode::InvalidArgument,
                       {"nf4_quantize:", "W is [0,128]"}, outs));
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), w_shape, out); }, ErrorCode::ShapeMismatch,
                       {"nf4_quantize:", "W is [8,64]", "out is sized for [8,128]"}, outs));
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), w_shape, false, 32); }, ErrorCode::InvalidArgument,
                       {"nf4_quantize:", "block size 32", "power of two"}, {}));
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), w_empty, false); }, ErrorCode::InvalidArgument,
                       {"nf4_quantize:", "W is [0,128]"}, {}));
  // The input sharing memory with an output.
  Tensor big(DType::F32, {8, 128});
  Nf4Weight on_input = out;
  on_input.codes = TensorView(big.data(), DType::U8, {512});
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), big, on_input); }, ErrorCode::InvalidArgument,
                       {"nf4_quantize:", "out.codes and W overlap"}, {dst.absmax, dst.absmax2}));
  Nf4Weight self = out;
  self.absmax2 = TensorView(dst.codes.data(), DType::F32, {1});
  EXPECT_TRUE(rejected([&] { nf4_quantize(cpu_ctx(), big, self); }, ErrorCode::InvalidArgument,
                       {"nf4_quantize:", "out.codes and out.absmax2 overlap"}, {dst.absmax}));

  Tensor deq(DType::F32, {8, 128}), deq_f16(DType::F16, {8, 128}), deq_t(DType::F32, {128, 8});
  EXPECT_TRUE(rejected([&] { nf4_dequantize(cpu_ctx(), o.w, deq_f16); }, ErrorCode::DTypeMismatch,
                       {"nf4_dequantize:", "out is f16"}, {deq_f16}));
  EXPECT_TRUE(rejected([&] { nf4_dequantize(cpu_ctx(), o.w, deq_t); }, ErrorCode::ShapeMismatch,
                       {"nf4_dequantize:", "out is [128,8]", "[8,128]"}, {deq_t}));
  const TensorView on_codes(o.w.codes.data(), DType::F32, {1, 128});
  Nf4Weight small = o.w.view();
  small.rows = 1;  // 1 x 128: 64 code bytes, 2 blocks
  small.codes = TensorView(o.w.codes.data(), DType::U8, {64});
  small.absmax = TensorView(o.w.absmax.data(), DType::F32, {2});
  EXPECT_TRUE(rejected([&] { nf4_dequantize(cpu_ctx(), small, on_codes); }, ErrorCode::InvalidArgument,
                       {"nf4_dequantize:", "out and W.codes overlap"}, {}));

  EXPECT_TRUE(rejected([&] { Nf4Tensor::allocate(0, 4, false); }, ErrorCode::InvalidArgument,
                       {"Nf4Tensor::allocate", "rows, cols >= 1"}, {}));
  EXPECT_TRUE(rejected([&] { Nf4Tensor::allocate(4, 64, false, Device::cpu(), 100); }, ErrorCode::InvalidArgument,
                       {"Nf4Tensor::allocate", "block size 100"}, {}));
  EXPECT_TRUE(rejected([&] { nf4_block_scale(o.w, 16); }, ErrorCode::InvalidArgument,
                       {"nf4_block_scale", "block 16", "[0, 16)"}, {}));
}

TEST(Nf4Paths, Names) {
  EXPECT_STREQ(nf4_path_name(Nf4Path::Auto), "auto");
  EXPECT_STREQ(nf4_path_name(nf4_forced::kReference), "reference");
  EXPECT_STREQ(nf4_path_name(Nf4Path::DequantGemm), "dequant_gemm");
  EXPECT_STREQ(nf4_path_name(nf4_forced::kSmallM), "small_m");
  EXPECT_STREQ(nf4_path_name(Nf4Path::Fused), "fused");
  EXPECT_STREQ(nf4_path_name(nf4_forced::kFusedShared), "fused_shared");
  EXPECT_STREQ(nf4_path_name(nf4_forced::kFusedMma), "fused_mma");
  EXPECT_STREQ(nf4_path_name(nf4_forced::kSmallMSlice), "small_m_slice");
  for (Nf4Path p : nf4_forced::kAllPaths) EXPECT_STRNE(nf4_path_name(p), "?") << static_cast<int>(p);
}

TEST(Nf4Tensor, AllocateSizesEveryField) {
  const Nf4Tensor p = Nf4Tensor::allocate(7, 100, false);
  EXPECT_EQ(p.codes.numel(), 350);
  EXPECT_EQ(p.absmax.dtype(), DType::F32);
  EXPECT_EQ(p.absmax.numel(), 11);
  EXPECT_FALSE(p.absmax2.defined());
  EXPECT_FALSE(p.view().double_quant());
  EXPECT_TRUE(p.view().absmax2.empty());
  const Nf4Tensor d = Nf4Tensor::allocate(300, 128, true, Device::cpu(), 64);  // 600 blocks: 3 groups
  EXPECT_EQ(d.absmax.dtype(), DType::U8);
  EXPECT_EQ(d.absmax.numel(), 600);
  EXPECT_EQ(d.absmax2.numel(), 3);
  EXPECT_EQ(d.code2.numel(), 256);
  EXPECT_EQ(std::memcmp(d.code2.data(), nf4_code2_table(), 1024), 0);
  EXPECT_TRUE(d.view().double_quant());
  EXPECT_EQ(d.view().num_groups(), 3);
}

// ---- lora_nf4_linears: several projections of one input, adapters stacked -------------------------------------------
// Against the same products composed from the per-projection ops (nf4_gemm, gemm_bt, lora_backward_dy, ...): the
// grouped op sums the same terms, the adapters' in one GEMM over all ranks, so fp32 sums may differ in order.
struct LinearsCase {
  std::int64_t m, k;
  std::vector<std::int64_t> n, r;  // r 0: no adapter
};

void expect_linears_match_composition(const LinearsCase& c, std::uint64_t seed) {
  const Context& cpu = cpu_ctx();
  const std::size_t np = c.n.size();
  const Tensor x = test::random_tensor(DType::F32, {c.m, c.k}, seed);
  std::int64_t rank = 0;
  for (std::int64_t r : c.r) rank += r;
  const Tensor a = test::random_tensor(DType::F32, {rank, c.k}, seed + 1);
  std::vector<Nf4Tensor> ws;
  std::vector<Tensor> bs, y0s, dys, biases;
  for (std::size_t i = 0; i < np; ++i) {
    ws.push_back(nf4_quantize(cpu, test::random_tensor(DType::F32, {c.n[i], c.k}, seed + 10 + i), i % 2 == 0));
    bs.push_back(c.r[i] ? test::random_tensor(DType::F32, {c.n[i], c.r[i]}, seed + 20 + i) : Tensor());
    // Every projection but the third has a bias (the second's accumulates onto y too).
    biases.push_back(i != 2 ? test::random_tensor(DType::F32, {c.n[i]}, seed + 60 + i) : Tensor());
    y0s.push_back(test::random_tensor(DType::F32, {c.m, c.n[i]}, seed + 30 + i));
    dys.push_back(test::random_tensor(DType::F32, {c.m, c.n[i]}, seed + 40 + i));
  }
  const float scales[] = {0.5f, 2.0f, 0.125f, 1.0f};
  // The composition.
  std::vector<Tensor> y_ref, gb_ref;
  Tensor dx_ref = test::random_tensor(DType::F32, {c.m, c.k}, seed + 50);
  const Tensor dx0 = test::host_copy(dx_ref);
  Tensor ga_ref(DType::F32, {rank, c.k});
  std::int64_t row = 0;
  float dx_beta = 0.5f;
  for (std::size_t i = 0; i < np; ++i) {
    Tensor y = test::host_copy(y0s[i]);
    const float beta = i == 1 ? 1.0f : 0.0f;
    nf4_gemm(cpu, x, ws[i].view(), y, {1.0f, beta});
    if (!biases[i].view().empty()) add_bias(cpu, y, biases[i]);
    nf4_gemm_backward_a(cpu, dys[i], ws[i].view(), dx_ref, {1.0f, i == 0 ? dx_beta : 1.0f});
    if (c.r[i]) {
      const TensorView ai(static_cast<float*>(a.data()) + row * c.k, DType::F32, {c.r[i], c.k});
      Tensor t(DType::F32, {c.m, c.r[i]}), dt(DType::F32, {c.m, c.r[i]}), gb(DType::F32, {c.n[i], c.r[i]});
      gemm_bt(cpu, x, ai, t);
      gemm_bt(cpu, t, bs[i], y, {scales[i], 1.0f});
      lora_backward_dy(cpu, dys[i], bs[i], t, dt, gb, scales[i], MathMode::FP32, 0.0f);
      const TensorView gai(static_cast<float*>(ga_ref.data()) + row * c.k, DType::F32, {c.r[i], c.k});
      gemm_backward_b(cpu, dt, x, gai);
      Tensor extra(DType::F32, {c.m, c.k});
      gemm(cpu, dt, ai, extra);
      add(cpu, dx_ref, extra, dx_ref);
      gb_ref.push_back(std::move(gb));
      row += c.r[i];
    } else {
      gb_ref.push_back(Tensor());
    }
    y_ref.push_back(std::move(y));
  }
  // The grouped op.
  std::vector<Tensor> ys;
  std::vector<Nf4Projection> ps;
  for (std::size_t i = 0; i < np; ++i) {
    ys.push_back(test::host_copy(y0s[i]));
    ps.push_back({ws[i].view(), ys[i], i == 1 ? 1.0f : 0.0f, bs[i], scales[i], biases[i]});
  }
  Tensor t(DType::F32, {c.m, rank}), dt(DType::F32, {c.m, rank}), ga(DType::F32, {rank, c.k});
  Tensor dx = test::host_copy(dx0);
  test::poison(t);
  test::poison(dt);
  test::poison(ga);
  lora_nf4_linears(cpu, x, ps, rank ? a.view() : TensorView(), rank ? t.view() : TensorView());
  std::vector<Tensor> gbs;
  std::vector<Nf4ProjectionGrad> gs;
  for (std::size_t i = 0; i < np; ++i) {
    gbs.push_back(c.r[i] ? Tensor(DType::F32, {c.n[i], c.r[i]}) : Tensor());
    if (c.r[i]) test::poison(gbs[i]);
    gs.push_back({ws[i].view(), dys[i], bs[i], scales[i], gbs[i]});
  }
  lora_nf4_linears_backward(cpu, x, gs, rank ? a.view() : TensorView(), rank ? t.view() : TensorView(),
                            rank ? dt.view() : TensorView(), rank ? ga.view() : TensorView(), dx, dx_beta);
  const std::string what = "m " + std::to_string(c.m) + " k " + std::to_string(c.k) + " projections " +
                           std::to_string(np) + " rank " + std::to_string(rank);
  const test::Tolerance tol = test::fp32_accum_tolerance(c.k + rank);
  for (std::size_t i = 0; i < np; ++i) {
    EXPECT_TRUE(test::all_close(ys[i], y_ref[i], tol)) << what << ": y " << i;
    if (c.r[i])
      EXPECT_TRUE(test::all_close(gbs[i], gb_ref[i], test::fp32_accum_tolerance(c.m))) << what << ": grad_b " << i;
  }
  if (rank) EXPECT_TRUE(test::all_close(ga, ga_ref, test::fp32_accum_tolerance(c.m))) << what << ": grad_a";
  EXPECT_TRUE(test::all_close(dx, dx_ref, test::fp32_accum_tolerance(c.k + rank))) << what << ": dx";
}

TEST(Nf4Linears, MatchThePerProjectionOpsOnRaggedShapes) {
  std::uint64_t seed = 9100;
  for (const LinearsCase& c :
       {LinearsCase{1, 64, {64, 128, 64}, {8, 16, 8}}, LinearsCase{7, 128, {192, 64, 64}, {4, 4, 4}},
        LinearsCase{65, 64, {64, 128}, {16, 0}}, LinearsCase{63, 192, {128, 64, 64}, {0, 0, 0}},
        LinearsCase{33, 64, {64, 64, 64, 128}, {8, 0, 16, 12}}})
    expect_linears_match_composition(c, seed += 100);
}

TEST(Nf4Linears, RefuseBadArgumentsBeforeWriting) {
  const Context& cpu = cpu_ctx();
  const Nf4Tensor w = nf4_quantize(cpu, test::random_tensor(DType::F32, {64, 64}, 1), true);
  const Tensor x = test::random_tensor(DType::F32, {5, 64}, 2), b = test::random_tensor(DType::F32, {64, 8}, 3);
  const Tensor a = test::random_tensor(DType::F32, {8, 64}, 4);
  Tensor y(DType::F32, {5, 64}), t(DType::F32, {5, 8}), y_bad(DType::F32, {5, 63});
  test::poison(y);
  const Tensor y_before = test::host_copy(y);
  const Nf4Projection good{w.view(), y, 0.0f, b, 2.0f};
  auto call = [&](std::vector<Nf4Projection> ps, const TensorView& av, const TensorView& tv) {
    return [=, &cpu] { lora_nf4_linears(cpu, x, ps, av, tv); };
  };
  EXPECT_TRUE(test::throws_error(call({}, a, t), ErrorCode::InvalidArgument, {"lora_nf4_linears", "no projections"}));
  EXPECT_TRUE(test::throws_error(call({{w.view(), y_bad, 0.0f, b, 2.0f}}, a, t), ErrorCode::ShapeMismatch,
                                 {"projection 0 y", "[5,64]"}));
  EXPECT_TRUE(test::throws_error(call({good}, test::random_tensor(DType::F32, {16, 64}, 5), t),
                                 ErrorCode::ShapeMismatch, {"a is", "[8,64]"}));
  EXPECT_TRUE(test::throws_error(call({{w.view(), y, 0.5f, b, 2.0f}}, a, t), ErrorCode::InvalidArgument, {"beta"}));
  EXPECT_TRUE(test::throws_error(call({{w.view(), y, 0.0f, b, 2.0f, Tensor(DType::F32, {63})}}, a, t),
                                 ErrorCode::ShapeMismatch, {"projection 0 bias is [63]", "[64]"}));
  EXPECT_TRUE(test::throws_error(call({{w.view(), y, 0.0f, b, 2.0f, Tensor(DType::F32, {1, 64})}}, a, t),
                                 ErrorCode::ShapeMismatch, {"projection 0 bias"}));
  EXPECT_TRUE(test::throws_error(call({{w.view(), y, 0.0f, b, 2.0f, Tensor(DType::BF16, {64})}}, a, t),
                                 ErrorCode::DTypeMismatch, {"projection 0 bias"}));
  EXPECT_TRUE(test::throws_error(call({{w.view(), y, 0.0f, b, 2.0f, TensorView(y.data(), DType::F32, {64})}}, a, t),
                                 ErrorCode::InvalidArgument, {"overlap"}));
  EXPECT_TRUE(test::throws_error(call({good}, a, TensorView()), ErrorCode::InvalidArgument, {"t has null data"}));
  EXPECT_TRUE(test::throws_error(call({{w.view(), x, 0.0f, b, 2.0f}}, a, t), ErrorCode::InvalidArgument,
                                 {"projection 0 y and x overlap"}));
  // Two outputs in one buffer.
  EXPECT_TRUE(
      test::throws_error(call({good, good}, test::random_tensor(DType::F32, {16, 64}, 6), Tensor(DType::F32, {5, 16})),
                         ErrorCode::InvalidArgument, {"overlap"}));
  EXPECT_TRUE(test::bytes_equal(y, y_before));
  // The backward: a projection with an adapter needs its dy.
  Tensor dt(DType::F32, {5, 8}), gb(DType::F32, {64, 8}), dx(DType::F32, {5, 64});
  const std::vector<Nf4ProjectionGrad> no_dy{{w.view(), TensorView(), b, 2.0f, gb}};
  EXPECT_TRUE(test::throws_error([&] { lora_nf4_linears_backward(cpu, x, no_dy, a, t, dt, TensorView(), dx); },
                                 ErrorCode::InvalidArgument, {"lora_nf4_linears_backward", "no dy"}));
  const std::vector<Nf4ProjectionGrad> gb_f32_wrong{{w.view(), y, b, 2.0f, Tensor(DType::BF16, {64, 8})}};
  EXPECT_TRUE(test::throws_error([&] { lora_nf4_linears_backward(cpu, x, gb_f32_wrong, a, t, dt, TensorView(), dx); },
                                 ErrorCode::DTypeMismatch, {"grad_b"}));
}

}  // namespace
}  // namespace qmm
