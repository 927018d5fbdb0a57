// NF4 on the GPU: quantize and dequantize byte-identical to the CPU backend and to bitsandbytes' golden vectors
// (tests/data/nf4-bnb), and the dequantize + GEMM path of nf4_gemm, nf4_gemm_backward_a and nf4_gate_up against
// the CPU oracle (which multiplies the same bf16-rounded operands in fp64).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/test_util.h"
#include "core/nf4_forced.h"
#ifdef QMM_WITH_CUDA
#include "cuda/nf4/quantize.h"
#endif

namespace qmm {
namespace {

Device gpu_device() { return test::gpu_context()->device(); }

Nf4Tensor nf4_to(const Nf4Tensor& src, Device d) {
  Nf4Tensor out = src;  // shape, block size and offset
  out.codes = to_device(src.codes, d);
  out.absmax = to_device(src.absmax, d);
  if (src.absmax2.defined()) out.absmax2 = to_device(src.absmax2, d);
  if (src.code2.defined()) out.code2 = to_device(src.code2, d);
  return out;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Every byte of every field, and the offset bit for bit.
void expect_same_nf4(const Nf4Tensor& got, const Nf4Tensor& ref, const std::string& what) {
  EXPECT_TRUE(test::bytes_equal(got.codes, ref.codes)) << "codes, " << what;
  EXPECT_TRUE(test::bytes_equal(got.absmax, ref.absmax)) << "absmax, " << what;
  EXPECT_EQ(got.absmax2.defined(), ref.absmax2.defined()) << what;
  if (got.absmax2.defined() && ref.absmax2.defined()) {
    EXPECT_TRUE(test::bytes_equal(got.absmax2, ref.absmax2)) << "absmax2, " << what;
    EXPECT_TRUE(test::bytes_equal(got.code2, ref.code2)) << "code2, " << what;
    EXPECT_TRUE(same_bits(got.offset, ref.offset)) << "offset " << got.offset << " vs " << ref.offset << ", " << what;
  }
}

// A device view of n elements, optionally one element past an aligned address (defeats every vector path).
struct DeviceBuf {
  Tensor storage;
  TensorView view;
};
DeviceBuf device_buf(DType dt, Shape shape, bool misaligned) {
  DeviceBuf b;
  b.storage = Tensor(dt, {shape.numel() + 1}, gpu_device());
  b.view = TensorView(static_cast<char*>(b.storage.data()) + (misaligned ? dtype_size(dt) : 0), dt, shape,
                      gpu_device());
  return b;
}
DeviceBuf device_copy(const Tensor& host, bool misaligned) {
  DeviceBuf b = device_buf(host.dtype(), host.shape(), misaligned);
  copy(b.view, host);
  return b;
}

std::string describe(std::int64_t n, std::int64_t k, DType dt, bool dq, int bs) {
  return std::to_string(n) + "x" + std::to_string(k) + " " + dtype_name(dt) + (dq ? " double" : " plain") +
         " block " + std::to_string(bs);
}

// GPU and CPU dequantize of the same weight (on each side), f32 and bf16: byte-identical.
void expect_same_dequant(const Nf4Tensor& w_dev, const Nf4Tensor& w_host, const std::string& what,
                         bool misaligned = false) {
  Context& gpu = *test::gpu_context();
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor ref(dt, {w_host.rows, w_host.cols});
    nf4_dequantize(Context::cpu(), w_host, ref);
    DeviceBuf out = device_buf(dt, {w_host.rows, w_host.cols}, misaligned);
    test::poison(out.view);
    nf4_dequantize(gpu, w_dev, out.view);
    gpu.synchronize();
    EXPECT_TRUE(test::bytes_equal(test::host_copy(out.view), ref))
        << "dequantize to " << dtype_name(dt) << (misaligned ? " (misaligned output), " : ", ") << what;
  }
}

// ---- golden vectors -------------------------------------------------------------------------------------------

std::string golden_dir() { return test::data_dir() + "/nf4-bnb"; }

// The file names listed in manifest.json (a JSON array of strings).
std::vector<std::string> golden_files() {
  std::ifstream in(golden_dir() + "/manifest.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::vector<std::string> names;
  for (std::size_t at = text.find('"'); at != std::string::npos; at = text.find('"', at + 1)) {
    const std::size_t end = text.find('"', at + 1);
    if (end == std::string::npos) break;
    names.push_back(text.substr(at + 1, end - at - 1));
    at = end;
  }
  return names;
}

struct Golden {
  std::string name;
  SafetensorsFile file;
  std::int64_t n = 0, k = 0;
  int block_size = 0;
  bool dq = false;
};

Golden open_golden(const std::string& name) {
  Golden g{name, SafetensorsFile::open(golden_dir() + "/" + name)};
  const auto& meta = g.file.metadata();
  g.n = std::stoll(meta.at("N"));
  g.k = std::stoll(meta.at("K"));
  g.block_size = std::stoi(meta.at("blocksize"));
  g.dq = meta.at("double_quant") == "True";
  return g;
}

// The golden quantized weight, in host memory.
Nf4Tensor golden_weight(const Golden& g) {
  Nf4Tensor w;
  w.rows = g.n;
  w.cols = g.k;
  w.block_size = g.block_size;
  w.codes = g.file.tensor("codes", DType::U8);
  if (g.dq) {
    w.absmax = g.file.tensor("absmax_q", DType::U8);
    w.absmax2 = g.file.tensor("absmax2", DType::F32);
    w.code2 = g.file.tensor("code2", DType::F32);
    w.offset = g.file.tensor("offset", DType::F32).data_as<float>()[0];
  } else {
    w.absmax = g.file.tensor("absmax", DType::F32);
  }
  return w;
}

TEST(Nf4GoldenGpu, ManifestListsFiles) {
  QMM_REQUIRE_GPU();
  EXPECT_EQ(golden_files().size(), 10u);
}

// Every output field byte-identical to bitsandbytes (the offset too: the mean is computed as the producer does,
// sum * (1/n), see src/cpu/nf4_internal.h) and to the CPU backend.
TEST(Nf4GoldenGpu, QuantizeMatchesGoldenAndCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  for (const std::string& name : golden_files()) {
    const Golden g = open_golden(name);
    const Tensor input = g.file.tensor("input");
    Nf4Tensor got = nf4_quantize(gpu, to_device(input, gpu_device()), g.dq, g.block_size);
    gpu.synchronize();
    EXPECT_TRUE(test::bytes_equal(got.codes, g.file.tensor("codes", DType::U8))) << name;
    if (g.dq) {
      const float want = g.file.tensor("offset", DType::F32).data_as<float>()[0];
      EXPECT_TRUE(same_bits(got.offset, want)) << got.offset << " vs " << want << ", " << name;
      EXPECT_TRUE(test::bytes_equal(got.absmax, g.file.tensor("absmax_q", DType::U8))) << name;
      EXPECT_TRUE(test::bytes_equal(got.absmax2, g.file.tensor("absmax2", DType::F32))) << name;
      EXPECT_TRUE(test::bytes_equal(got.code2, g.file.tensor("code2", DType::F32))) << name;
    } else {
      EXPECT_TRUE(test::bytes_equal(got.absmax, g.file.tensor("absmax", DType::F32))) << name;
    }
    expect_same_nf4(got, nf4_quantize(Context::cpu(), input, g.dq, g.block_size), "vs CPU, " + name);
  }
}

#ifdef QMM_WITH_CUDA
// The double-quantization kernel alone: the exact fp32 absmax around bitsandbytes' own offset reproduces its
// absmax_q and absmax2 (independent of how the offset is computed).
TEST(Nf4GoldenGpu, DoubleQuantizationWithGoldenOffsetIsByteIdentical) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  int checked = 0;
  for (const std::string& name : golden_files()) {
    const Golden g = open_golden(name);
    if (!g.dq) continue;
    // The fp32 absmax of the plain quantization of the same input (checked byte-identical above).
    Nf4Tensor plain = nf4_quantize(gpu, to_device(g.file.tensor("input"), gpu_device()), false, g.block_size);
    Nf4Tensor t = Nf4Tensor::allocate(g.n, g.k, true, gpu_device(), g.block_size);
    Nf4Weight v = t.view();
    const float offset = g.file.tensor("offset", DType::F32).data_as<float>()[0];
    cuda::nf4_double_quantize(gpu, plain.absmax.data_as<const float>(), v.num_blocks(), offset, v);
    gpu.synchronize();
    EXPECT_TRUE(same_bits(v.offset, offset)) << name;
    EXPECT_TRUE(test::bytes_equal(t.absmax, g.file.tensor("absmax_q", DType::U8))) << name;
    EXPECT_TRUE(test::bytes_equal(t.absmax2, g.file.tensor("absmax2", DType::F32))) << name;
    EXPECT_TRUE(test::bytes_equal(t.code2, g.file.tensor("code2", DType::F32))) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 5);
}
#endif

// Dequantizing the golden weights gives bitsandbytes' `dequant` exactly (in the input's dtype), and the CPU's bytes.
TEST(Nf4GoldenGpu, DequantizeMatchesGoldenAndCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  for (const std::string& name : golden_files()) {
    const Golden g = open_golden(name);
    const Nf4Tensor host = golden_weight(g);
    const Nf4Tensor dev = nf4_to(host, gpu_device());
    expect_same_dequant(dev, host, name);

    const Tensor want = g.file.tensor("dequant");
    const DType out_dt = want.dtype() == DType::BF16 ? DType::BF16 : DType::F32;
    Tensor out(out_dt, {g.n, g.k}, gpu_device());
    test::poison(out);
    nf4_dequantize(gpu, dev, out);
    gpu.synchronize();
    Tensor got = test::host_copy(out);
    if (want.dtype() == DType::F16) {  // the golden is fp32 rounded to f16; round ours the same way
      Tensor h(DType::F16, {g.n, g.k});
      for (std::int64_t i = 0; i < got.numel(); ++i)
        h.data_as<std::uint16_t>()[i] = float_to_f16(got.data_as<float>()[i]);
      got = h;
    }
    EXPECT_TRUE(test::bytes_equal(got, want)) << name;
  }
}

// The offset inside the checkpoint's quant-state JSON text ("nested_offset": <number>).
float nested_offset(const Tensor& json_bytes) {
  const std::string text(json_bytes.data_as<const char>(), static_cast<std::size_t>(json_bytes.numel()));
  const std::string key = "\"nested_offset\":";
  const std::size_t at = text.find(key);
  if (at == std::string::npos) throw Error(ErrorCode::Io, "nested_offset missing from the quant state");
  return std::strtof(text.c_str() + at + key.size(), nullptr);
}

// A whole bitsandbytes Linear4bit checkpoint: its weight dequantizes to the stored reference exactly, and the
// layer's output (x bf16, bf16 compute) is reproduced by nf4_gemm plus the bias within a bf16 output rounding.
TEST(Nf4GoldenGpu, Linear4bitCheckpoint) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const SafetensorsFile f = SafetensorsFile::open(golden_dir() + "/linear4bit_state_dict.safetensors");
  Nf4Tensor host;
  host.rows = 256;
  host.cols = 512;
  host.block_size = 64;
  host.codes = f.tensor("weight", DType::U8);
  host.absmax = f.tensor("weight.absmax", DType::U8);
  host.absmax2 = f.tensor("weight.nested_absmax", DType::F32);
  host.code2 = f.tensor("weight.nested_quant_map", DType::F32);
  host.offset = nested_offset(f.tensor("weight.quant_state.bitsandbytes__nf4", DType::U8));
  const Nf4Tensor dev = nf4_to(host, gpu_device());

  Tensor w(DType::F32, {256, 512}, gpu_device());
  test::poison(w);
  nf4_dequantize(gpu, dev, w);
  gpu.synchronize();
  EXPECT_TRUE(test::bytes_equal(test::host_copy(w), f.tensor("_ref.weight_dequant", DType::F32)));

  const Tensor x = f.tensor("_ref.x", DType::BF16);
  Tensor y(DType::F32, {3, 256}, gpu_device());
  test::poison(y);
  nf4_gemm(gpu, to_device(x, gpu_device()), dev, y);
  gpu.synchronize();
  Tensor got = test::host_copy(y);
  const Tensor bias = f.tensor("bias", DType::F32);
  for (std::int64_t i = 0; i < 3; ++i)
    for (std::int64_t j = 0; j < 256; ++j) got.data_as<float>()[i * 256 + j] += bias.data_as<float>()[j];
  EXPECT_TRUE(test::all_close(got, f.tensor("_ref.y", DType::F32), test::bf16_output_tolerance(512)));
}

// ---- random weights against the CPU ---------------------------------------------------------------------------

// Values of several magnitudes (so blocks have different absmax), with some blocks all zero; rounded to dt.
Tensor random_weight(DType dt, std::int64_t n, std::int64_t k, int block_size, std::uint64_t seed) {
  Tensor f = test::random_tensor(DType::F32, {n, k}, seed, -1.0f, 1.0f);
  float* v = f.data_as<float>();
  const std::int64_t numel = n * k;
  for (std::int64_t e = 0; e < numel; ++e) {
    const std::int64_t b = e / block_size;
    if (b % 3 == 1) v[e] *= 1.0f / 1024.0f;  // a power of two: exact (f16 may go subnormal, same on both sides)
    if (b == 0 || b == 4) v[e] = 0.0f;       // all-zero blocks (the last, partial block too where it is block 4)
  }
  if (dt == DType::F32) return f;
  Tensor w(dt, {n, k});
  auto* bits = w.data_as<std::uint16_t>();
  for (std::int64_t e = 0; e < numel; ++e) bits[e] = dt == DType::BF16 ? float_to_bf16(v[e]) : float_to_f16(v[e]);
  return w;
}

void check_random_quantize(std::int64_t n, std::int64_t k, DType dt, bool dq, int bs, std::uint64_t seed) {
  Context& gpu = *test::gpu_context();
  const std::string what = describe(n, k, dt, dq, bs);
  const Tensor w = random_weight(dt, n, k, bs, seed);
  const Nf4Tensor ref = nf4_quantize(Context::cpu(), w, dq, bs);
  Nf4Tensor got = Nf4Tensor::allocate(n, k, dq, gpu_device(), bs);
  test::poison(got.codes);
  test::poison(got.absmax);
  if (dq) test::poison(got.absmax2);
  Nf4Weight view = got.view();
  nf4_quantize(gpu, to_device(w, gpu_device()), view);
  gpu.synchronize();
  got.offset = view.offset;
  expect_same_nf4(got, ref, what);
  expect_same_dequant(got, ref, what);
}

TEST(Nf4QuantizeGpu, RaggedShapesMatchCpu) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 1000;
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{1, 1}, {7, 100}, {33, 130}, {1000, 1000}};
  for (const auto& [n, k] : shapes)
    for (DType dt : {DType::F32, DType::BF16, DType::F16})
      for (bool dq : {false, true})
        for (int bs : {64, 128, 256, 512, 4096}) check_random_quantize(n, k, dt, dq, bs, ++seed);
}

TEST(Nf4QuantizeGpu, LargeMatchesCpu) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 2000;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (bool dq : {false, true}) check_random_quantize(4096, 4096, dt, dq, 64, ++seed);
  check_random_quantize(4096, 4096, DType::BF16, true, 128, ++seed);
}

// Non-finite weights are refused on the GPU as on the CPU (the scan copies W to the host in chunks of rows: a
// weight larger than one chunk puts the bad element in the second).
TEST(Nf4QuantizeGpu, RejectsNonFiniteWeightsNamingTheFirst) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  for (DType dt : {DType::F32, DType::BF16})
    for (bool dq : {false, true}) {
      const std::int64_t rows = 1100, cols = 4096;  // 16 MiB chunks: 1024 f32 rows, 2048 bf16 rows
      Tensor wt = test::random_tensor(dt, {rows, cols}, 9);
      test::set_value(wt, 1050 * cols + 33, std::nanf(""));
      const Tensor wd = to_device(wt, gpu_device());
      EXPECT_TRUE(test::throws_error([&] { nf4_quantize(gpu, wd, dq); }, ErrorCode::InvalidArgument,
                                     {"nf4_quantize", "row 1050, column 33"}))
          << dtype_name(dt) << (dq ? " double" : " plain");
    }
}

TEST(Nf4QuantizeGpu, AllZeroWeightMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  for (bool dq : {false, true})
    for (std::int64_t k : {std::int64_t{1}, std::int64_t{100}, std::int64_t{1000}}) {
      const Tensor w = test::filled(DType::F32, {7, k}, 0.0f);
      const Nf4Tensor ref = nf4_quantize(Context::cpu(), w, dq);
      const Nf4Tensor got = nf4_quantize(gpu, to_device(w, gpu_device()), dq);
      gpu.synchronize();
      const std::string what = describe(7, k, DType::F32, dq, 64) + " all zero";
      expect_same_nf4(got, ref, what);
      expect_same_dequant(got, ref, what);
    }
}

// Input, codes and outputs one element off their alignment: the scalar paths give the same bytes.
TEST(Nf4QuantizeGpu, MisalignedBuffersMatchCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  std::uint64_t seed = 3000;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (bool dq : {false, true})
      for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{33, 130}, {1000, 1000}}) {
        const std::string what = describe(n, k, dt, dq, 64) + " misaligned";
        const Tensor w = random_weight(dt, n, k, 64, ++seed);
        const Nf4Tensor ref = nf4_quantize(Context::cpu(), w, dq);
        DeviceBuf in = device_copy(w, true);
        Nf4Tensor got = Nf4Tensor::allocate(n, k, dq, gpu_device());
        DeviceBuf codes = device_buf(DType::U8, {(n * k + 1) / 2}, true);
        Nf4Weight view = got.view();
        view.codes = codes.view;
        nf4_quantize(gpu, in.view, view);
        gpu.synchronize();
        got.offset = view.offset;
        EXPECT_TRUE(test::bytes_equal(test::host_copy(codes.view), ref.codes)) << what;
        Nf4Tensor with_codes = got;
        with_codes.codes = test::host_copy(codes.view);  // expect_same_nf4 compares whole tensors
        expect_same_nf4(with_codes, ref, what);
        // Dequantize from the misaligned codes, into aligned and misaligned outputs.
        for (bool out_misaligned : {false, true})
          for (DType odt : {DType::F32, DType::BF16}) {
            Tensor r(odt, {n, k});
            nf4_dequantize(Context::cpu(), ref, r);
            DeviceBuf out = device_buf(odt, {n, k}, out_misaligned);
            test::poison(out.view);
            nf4_dequantize(gpu, view, out.view);
            gpu.synchronize();
            EXPECT_TRUE(test::bytes_equal(test::host_copy(out.view), r))
                << what << " dequantize to " << dtype_name(odt) << (out_misaligned ? " misaligned" : "");
          }
      }
}

// ---- NF4 GEMMs against the CPU oracle -------------------------------------------------------------------------

struct Weight {
  Nf4Tensor host, dev;
};
Weight make_weight(std::int64_t n, std::int64_t k, bool dq, std::uint64_t seed) {
  const Tensor w = test::random_tensor(DType::F32, {n, k}, seed, -0.05f, 0.05f);
  Weight out;
  out.host = nf4_quantize(Context::cpu(), w, dq);
  out.dev = nf4_to(out.host, gpu_device());
  return out;
}

// Both sides multiply the same bf16 operands; only the summation order (and an output rounding) differs.
test::Tolerance tolerance_for(DType out, std::int64_t k) {
  return out == DType::BF16 ? test::bf16_output_tolerance(k) : test::fp32_accum_tolerance(k);
}

using Mnk = std::tuple<std::int64_t, std::int64_t, std::int64_t>;  // M, N, K
const std::vector<Mnk> kGemmShapes = {
    {1, 100, 64},  {7, 100, 64},  {65, 100, 64},  {300, 100, 64},    {1, 130, 33},     {7, 130, 33},
    {65, 130, 33}, {300, 130, 33}, {1, 1536, 1000}, {7, 1536, 1000}, {65, 1536, 1000}, {300, 1536, 1000}};

TEST(Nf4GemmGpu, DequantGemmMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 5000;
  for (const auto& [m, n, k] : kGemmShapes)
    for (bool dq : {false, true}) {
      const Weight w = make_weight(n, k, dq, ++seed);
      for (DType adt : {DType::F32, DType::BF16})
        for (DType cdt : {DType::F32, DType::BF16}) {
          const Tensor a = test::random_tensor(adt, {m, k}, ++seed);
          const Tensor c0 = test::random_tensor(cdt, {m, n}, ++seed);
          const Tensor ad = to_device(a, gpu_device());
          for (auto [alpha, beta] : {std::pair<float, float>{0.75f, 0.0f}, {1.25f, 1.0f}}) {
            Tensor ref = test::host_copy(c0);
            nf4_gemm(cpu, a, w.host, ref, {alpha, beta, Nf4Path::Auto});
            Tensor c = to_device(c0, gpu_device());
            if (beta == 0.0f) test::poison(c);
            nf4_gemm(gpu, ad, w.dev, c, {alpha, beta, Nf4Path::DequantGemm});
            gpu.synchronize();
            EXPECT_TRUE(test::all_close(test::host_copy(c), ref, tolerance_for(cdt, k)))
                << "M=" << m << " N=" << n << " K=" << k << " dq=" << dq << " A " << dtype_name(adt) << " C "
                << dtype_name(cdt) << " alpha=" << alpha << " beta=" << beta;
          }
        }
    }
}

TEST(Nf4GemmGpu, AutoPathMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  std::uint64_t seed = 6000;
  for (const auto& [m, n, k] : {Mnk{1, 130, 33}, Mnk{65, 1536, 1000}, Mnk{16, 256, 512}}) {
    const Weight w = make_weight(n, k, true, ++seed);
    const Tensor a = test::random_tensor(DType::BF16, {m, k}, ++seed);
    Tensor ref(DType::F32, {m, n});
    nf4_gemm(Context::cpu(), a, w.host, ref);
    Tensor c(DType::F32, {m, n}, gpu_device());
    test::poison(c);
    nf4_gemm(gpu, to_device(a, gpu_device()), w.dev, c);
    gpu.synchronize();
    // M = 16 with bf16 A may take the small-M path's scale-after contract (ops.h).
    const Tensor after = test::nf4_scale_after_reference(a, w.host, ref, 1.0f, 0.0f);
    EXPECT_TRUE(test::nf4_forward_close(test::host_copy(c), ref, after, test::fp32_accum_tolerance(k)))
        << "M=" << m << " N=" << n << " K=" << k;
  }
}

TEST(Nf4GemmGpu, BackwardMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 7000;
  for (const auto& [m, n, k] : kGemmShapes)
    for (bool dq : {false, true}) {
      const Weight w = make_weight(n, k, dq, ++seed);
      for (DType dt : {DType::F32, DType::BF16})
        for (DType odt : {DType::F32, DType::BF16}) {
          const Tensor dc = test::random_tensor(dt, {m, n}, ++seed);
          const Tensor da0 = test::random_tensor(odt, {m, k}, ++seed);
          const Tensor dcd = to_device(dc, gpu_device());
          for (auto [alpha, beta] : {std::pair<float, float>{1.0f, 0.0f}, {0.5f, 1.0f}}) {
            Tensor ref = test::host_copy(da0);
            nf4_gemm_backward_a(cpu, dc, w.host, ref, {alpha, beta, Nf4Path::Auto});
            Tensor da = to_device(da0, gpu_device());
            if (beta == 0.0f) test::poison(da);
            nf4_gemm_backward_a(gpu, dcd, w.dev, da, {alpha, beta, Nf4Path::DequantGemm});
            gpu.synchronize();
            EXPECT_TRUE(test::all_close(test::host_copy(da), ref, tolerance_for(odt, n)))
                << "M=" << m << " N=" << n << " K=" << k << " dq=" << dq << " dC " << dtype_name(dt) << " dA "
                << dtype_name(odt) << " alpha=" << alpha << " beta=" << beta;
          }
        }
    }
}

// Every subset of outputs, mixed output dtypes, f32 and bf16 A: each output matches the CPU's.
TEST(Nf4GemmGpu, GateUpMatchesCpu) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  std::uint64_t seed = 8000;
  using Dts = std::tuple<DType, DType, DType>;  // gate, up, h
  const std::vector<Dts> dtype_sets = {{DType::F32, DType::F32, DType::F32},
                                       {DType::BF16, DType::BF16, DType::BF16},
                                       {DType::F32, DType::BF16, DType::BF16},
                                       {DType::BF16, DType::F32, DType::F32}};
  for (const auto& [m, n, k] : {Mnk{1, 130, 33}, Mnk{7, 100, 64}, Mnk{65, 1536, 1000}, Mnk{300, 130, 33}})
    for (DType adt : {DType::F32, DType::BF16}) {
      const bool dq = adt == DType::BF16;
      const Weight wg = make_weight(n, k, dq, ++seed), wu = make_weight(n, k, dq, ++seed);
      const Tensor a = test::random_tensor(adt, {m, k}, ++seed);
      const Tensor ad = to_device(a, gpu_device());
      for (const auto& [gdt, udt, hdt] : dtype_sets) {
        Tensor rg(gdt, {m, n}), ru(udt, {m, n}), rh(hdt, {m, n});
        nf4_gate_up(cpu, a, wg.host, wu.host, {rg, ru, rh}, {0.5f, 0.0f, Nf4Path::Auto});
        for (int mask = 1; mask < 8; ++mask) {
          Tensor g(gdt, {m, n}, gpu_device()), u(udt, {m, n}, gpu_device()), h(hdt, {m, n}, gpu_device());
          test::poison(g);
          test::poison(u);
          test::poison(h);
          const GateUpOutputs out{(mask & 1) ? TensorView(g) : TensorView(), (mask & 2) ? TensorView(u) : TensorView(),
                                  (mask & 4) ? TensorView(h) : TensorView()};
          nf4_gate_up(gpu, ad, wg.dev, wu.dev, out, {0.5f, 0.0f, Nf4Path::DequantGemm});
          gpu.synchronize();
          std::ostringstream what;
          what << "M=" << m << " N=" << n << " K=" << k << " A " << dtype_name(adt) << " outputs "
               << dtype_name(gdt) << "/" << dtype_name(udt) << "/" << dtype_name(hdt) << " mask " << mask;
          if (mask & 1) {
            EXPECT_TRUE(test::all_close(test::host_copy(g), rg, tolerance_for(gdt, k))) << "gate, " << what.str();
          }
          if (mask & 2) {
            EXPECT_TRUE(test::all_close(test::host_copy(u), ru, tolerance_for(udt, k))) << "up, " << what.str();
          }
          if (mask & 4) {
            EXPECT_TRUE(test::all_close(test::host_copy(h), rh, tolerance_for(hdt, k))) << "h, " << what.str();
          }
        }
      }
    }
}

// Calls back to back without a sync: the second grows the scratch the first is still using (the context waits
// before freeing it), and each call's regions are its own.
TEST(Nf4GemmGpu, BackToBackCallsShareScratchSafely) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const Weight small_g = make_weight(130, 33, false, 9001), small_u = make_weight(130, 33, true, 9002);
  const Weight big = make_weight(2048, 1536, true, 9003);
  const Tensor a1 = test::random_tensor(DType::F32, {65, 33}, 9004);
  const Tensor a2 = test::random_tensor(DType::F32, {300, 1536}, 9005);
  Tensor r1(DType::F32, {65, 130}), r2(DType::BF16, {300, 2048}), r3(DType::F32, {65, 130});
  nf4_gate_up(cpu, a1, small_g.host, small_u.host, {TensorView(), TensorView(), r1});
  nf4_gemm(cpu, a2, big.host, r2);
  nf4_gemm(cpu, a1, small_u.host, r3);
  Tensor h1(DType::F32, {65, 130}, gpu_device()), c2(DType::BF16, {300, 2048}, gpu_device()),
      c3(DType::F32, {65, 130}, gpu_device());
  test::poison(h1);
  test::poison(c2);
  test::poison(c3);
  const Tensor a1d = to_device(a1, gpu_device()), a2d = to_device(a2, gpu_device());
  nf4_gate_up(gpu, a1d, small_g.dev, small_u.dev, {TensorView(), TensorView(), h1},
              {1.0f, 0.0f, Nf4Path::DequantGemm});
  nf4_gemm(gpu, a2d, big.dev, c2, {1.0f, 0.0f, Nf4Path::DequantGemm});
  nf4_gemm(gpu, a1d, small_u.dev, c3, {1.0f, 0.0f, Nf4Path::DequantGemm});
  gpu.synchronize();
  EXPECT_TRUE(test::all_close(test::host_copy(h1), r1, test::fp32_accum_tolerance(33)));
  EXPECT_TRUE(test::all_close(test::host_copy(c2), r2, test::bf16_output_tolerance(1536)));
  EXPECT_TRUE(test::all_close(test::host_copy(c3), r3, test::fp32_accum_tolerance(33)));
}

TEST(Nf4GemmGpu, UnavailablePathsRaiseUnsupported) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  const Weight w = make_weight(64, 96, false, 9100);
  Tensor a(DType::BF16, {4, 96}, gpu_device()), c(DType::F32, {4, 64}, gpu_device());
  // The forward and input-gradient Fused paths: FusedPath.* in test_nf4_fast_paths_gpu.cpp.
  EXPECT_TRUE(test::throws_error(
      [&] { nf4_gate_up(gpu, a, w.dev, w.dev, {c, TensorView(), TensorView()}, {1, 0, Nf4Path::Fused}); },
      ErrorCode::Unsupported, {"nf4_gate_up", "path fused"}));
  EXPECT_TRUE(test::throws_error([&] { nf4_gemm(gpu, a, w.dev, c, {1, 0, nf4_forced::kReference}); },
                                 ErrorCode::Unsupported, {"nf4_gemm", "path reference"}));
}

// ---- lora_nf4_linears ---------------------------------------------------------------------------------------------
// The GPU's grouped projections (one dequantize launch at M > 32, the adapters' first products as one GEMM, their
// second products and lora_backward_dy on column blocks of t and dt) against references built on the CPU from the
// GPU's own intermediates and in the GPU's order of roundings, so that each step of an output differs only by one
// rounding of its own sum: t against the CPU's t (one rounding of a sum over K); y as the base product rounded
// into y, then scale·t_i·b_iᵀ from the GPU's t added and rounded again (two roundings; the NF4 base by either of
// its contracts: at M <= 16 the small-M kernels scale after the sum); dt and grad_b against the CPU's from the same
// t; grad_a from the GPU's dt; dx as each projection's input gradient added and rounded in turn, then dt·a from
// the GPU's dt (one rounding per product). f32 gradients are sums of up to M products of unit-size terms and
// more: their absolute tolerance scales with the reference's largest magnitude.
test::Tolerance roundings(test::Tolerance tol, int n) { return {tol.atol * n, tol.rtol * n, tol.rel_fro * n}; }

double largest_magnitude(const Tensor& t) {
  double most = 0.0;
  for (double v : test::to_doubles(t)) most = std::max(most, std::fabs(v));
  return most;
}

test::Tolerance scaled_to(test::Tolerance tol, const Tensor& ref) {
  return {tol.atol * std::max(1.0, largest_magnitude(ref)), tol.rtol, tol.rel_fro};
}

// Where a partial sum outgrows the output (the base product rounded into y before an adapter's term joins it, dx's
// products rounded in turn), a rounding of it may differ by an ulp of that partial, not of the output: each
// rounding's absolute tolerance is at least an ulp (2^-7 relative in bf16, 2^-23 in f32) of the largest partial.
test::Tolerance with_partials(test::Tolerance tol, DType dtype, double largest_partial) {
  const double ulp = largest_partial * (dtype == DType::BF16 ? 0x1p-7 : 0x1p-23);
  return {std::max(tol.atol, ulp), tol.rtol, tol.rel_fro};
}

// Columns col.. (r of them) of a host matrix [rows, R], dense.
Tensor host_columns(const Tensor& m, std::int64_t col, std::int64_t r) {
  Tensor out(m.dtype(), {m.dim(0), r});
  for (std::int64_t i = 0; i < m.dim(0); ++i)
    for (std::int64_t j = 0; j < r; ++j) test::set_value(out, i * r + j, test::get_value(m, i * m.dim(1) + col + j));
  return out;
}

void expect_linears_gpu_matches_cpu(DType dtype, std::int64_t m, std::int64_t k, const std::vector<std::int64_t>& ns,
                                    const std::vector<std::int64_t>& rs, std::uint64_t seed) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const Device d = gpu.device();
  const std::size_t np = ns.size();
  std::int64_t rank = 0, n_all = 0;
  for (std::size_t i = 0; i < np; ++i) rank += rs[i], n_all += ns[i];
  const float a_range = 2.0f / std::sqrt(static_cast<float>(k));
  const Tensor x = test::random_tensor(dtype, {m, k}, seed);
  const Tensor a = test::random_tensor(dtype, {rank, k}, seed + 1, -a_range, a_range);
  const Tensor x_d = to_device(x, d), a_d = to_device(a, d);
  std::vector<Nf4Tensor> ws, ws_d;
  std::vector<Tensor> bs, bs_d, y0s, y_gpu, dys, dys_d, gb_gpu, biases, biases_d;
  std::vector<Nf4Projection> pg;
  const float scales[] = {2.0f, 0.5f, 1.0f};
  for (std::size_t i = 0; i < np; ++i) {
    ws.push_back(nf4_quantize(cpu, test::random_tensor(DType::F32, {ns[i], k}, seed + 10 + i), true));
    ws_d.push_back(nf4_to(ws[i], d));
    bs.push_back(rs[i] ? test::random_tensor(dtype, {ns[i], rs[i]}, seed + 20 + i, -0.5f, 0.5f) : Tensor());
    bs_d.push_back(rs[i] ? to_device(bs[i], d) : Tensor());
    y0s.push_back(test::random_tensor(dtype, {m, ns[i]}, seed + 30 + i));
    y_gpu.push_back(to_device(y0s[i], d));
    if (i != 1) test::poison(y_gpu[i]);  // projection 1 accumulates onto its "bias"
    dys.push_back(test::random_tensor(dtype, {m, ns[i]}, seed + 40 + i));
    dys_d.push_back(to_device(dys[i], d));
    // Every projection but the third adds a bias (in the GEMM's epilogue, or a launch after a small-M kernel).
    biases.push_back(i != 2 ? test::random_tensor(dtype, {ns[i]}, seed + 60 + i) : Tensor());
    biases_d.push_back(i != 2 ? to_device(biases[i], d) : Tensor());
    pg.push_back({ws_d[i].view(), y_gpu[i], i == 1 ? 1.0f : 0.0f, bs_d[i], scales[i % 3], biases_d[i]});
  }
  Tensor t(dtype, {m, rank}), t_d(dtype, {m, rank}, d);
  test::poison(t_d);
  gemm_bt(cpu, x, a, t);
  lora_nf4_linears(gpu, x_d, pg, a_d, t_d);
  gpu.synchronize();
  const std::string what = std::string(dtype_name(dtype)) + " m " + std::to_string(m) + " k " + std::to_string(k) +
                           " n_all " + std::to_string(n_all) + " rank " + std::to_string(rank);
  const auto out_tol = [&](std::int64_t len) {
    return dtype == DType::BF16 ? test::bf16_output_tolerance(len) : test::fp32_accum_tolerance(len);
  };
  const Tensor t_got = test::host_copy(t_d);
  EXPECT_TRUE(test::all_close(t_got, t, out_tol(k))) << what << ": t";
  std::int64_t col = 0;
  for (std::size_t i = 0; i < np; ++i) {
    const float beta = i == 1 ? 1.0f : 0.0f;
    Tensor exact = test::host_copy(y0s[i]);
    nf4_gemm(cpu, x, ws[i].view(), exact, {1.0f, beta});
    Tensor after = test::nf4_scale_after_reference(x, ws[i].view(), y0s[i], 1.0f, beta);
    if (!biases[i].view().empty()) {
      add_bias(cpu, exact, biases[i]);
      add_bias(cpu, after, biases[i]);
    }
    double partial = std::max(largest_magnitude(exact), largest_magnitude(after));
    if (rs[i]) {
      const Tensor ti = host_columns(t_got, col, rs[i]);
      gemm_bt(cpu, ti, bs[i], exact, {scales[i % 3], 1.0f});
      gemm_bt(cpu, ti, bs[i], after, {scales[i % 3], 1.0f});
      col += rs[i];
    }
    partial = std::max({partial, largest_magnitude(exact), largest_magnitude(after)});
    EXPECT_TRUE(test::nf4_forward_close(test::host_copy(y_gpu[i]), exact, after,
                                        roundings(with_partials(out_tol(k + rs[i]), dtype, partial),
                                                  1 + (rs[i] ? 1 : 0) + (biases[i].view().empty() ? 0 : 1))))
        << what << ": y " << i;
  }

  // The backward, from the CPU's t on both devices.
  const Tensor t_in = to_device(t, d);
  Tensor dt(dtype, {m, rank}), dt_d(dtype, {m, rank}, d), ga_d(DType::F32, {rank, k}, d);
  const Tensor dx0 = test::random_tensor(dtype, {m, k}, seed + 50);
  Tensor dx_d = to_device(dx0, d);
  test::poison(dt_d);
  test::poison(ga_d);
  std::vector<Nf4ProjectionGrad> gg;
  for (std::size_t i = 0; i < np; ++i) {
    gb_gpu.push_back(rs[i] ? Tensor(DType::F32, {ns[i], rs[i]}, d) : Tensor());
    if (rs[i]) test::poison(gb_gpu[i]);
    gg.push_back({ws_d[i].view(), dys_d[i], bs_d[i], scales[i % 3], gb_gpu[i]});
  }
  lora_nf4_linears_backward(gpu, x_d, gg, a_d, t_in, dt_d, ga_d, dx_d, 0.5f);
  gpu.synchronize();
  const Tensor dt_got = test::host_copy(dt_d);
  Tensor dx_ref = test::host_copy(dx0);
  col = 0;
  double dx_partial = 0.0;
  for (std::size_t i = 0; i < np; ++i) {
    nf4_gemm_backward_a(cpu, dys[i], ws[i].view(), dx_ref, {1.0f, i == 0 ? 0.5f : 1.0f});
    dx_partial = std::max(dx_partial, largest_magnitude(dx_ref));
    if (!rs[i]) continue;
    Tensor dti(dtype, {m, rs[i]}), gb(DType::F32, {ns[i], rs[i]});
    lora_backward_dy(cpu, dys[i], bs[i], host_columns(t, col, rs[i]), dti, gb, scales[i % 3], MathMode::FP32, 0.0f);
    EXPECT_TRUE(test::all_close(host_columns(dt_got, col, rs[i]), dti, out_tol(ns[i]))) << what << ": dt " << i;
    EXPECT_TRUE(test::all_close(test::host_copy(gb_gpu[i]), gb, scaled_to(test::fp32_accum_tolerance(m), gb)))
        << what << ": grad_b " << i;
    col += rs[i];
  }
  Tensor ga_ref(DType::F32, {rank, k});
  gemm_backward_b(cpu, dt_got, x, ga_ref);
  gemm(cpu, dt_got, a, dx_ref, {1.0f, 1.0f});
  dx_partial = std::max(dx_partial, largest_magnitude(dx_ref));
  EXPECT_TRUE(test::all_close(test::host_copy(ga_d), ga_ref, scaled_to(test::fp32_accum_tolerance(m), ga_ref)))
      << what << ": grad_a";
  EXPECT_TRUE(
      test::all_close(test::host_copy(dx_d), dx_ref,
                      roundings(with_partials(out_tol(n_all + rank), dtype, dx_partial), static_cast<int>(np) + 1)))
      << what << ": dx";
}

TEST(GpuNf4Linears, MatchCpuOnRaggedShapes) {
  QMM_REQUIRE_GPU();
  std::uint64_t seed = 9500;
  // M 1 and 7 take the small-M kernels one projection at a time; 65 and 1000 one dequantize launch for all.
  // Ranks 16/8/8 take the one-pass lora_backward_dy on column blocks, one launch each; equal ranks one launch for
  // all the adapters (q/k/v-like widths, four adapters, one N % 8 != 0 sending the whole group to the fallback);
  // 4 the two-GEMM fallback.
  for (DType dtype : {DType::BF16, DType::F32})
    for (std::int64_t m : {1, 7, 65, 1000}) {
      expect_linears_gpu_matches_cpu(dtype, m, 256, {256, 64, 64}, {16, 8, 8}, seed += 10);
      expect_linears_gpu_matches_cpu(dtype, m, 192, {136, 64}, {4, 0}, seed += 10);
      expect_linears_gpu_matches_cpu(dtype, m, 256, {1536, 256, 264}, {16, 16, 16}, seed += 10);
      expect_linears_gpu_matches_cpu(dtype, m, 128, {520, 64, 72, 8}, {8, 8, 8, 8}, seed += 10);
      expect_linears_gpu_matches_cpu(dtype, m, 128, {256, 65}, {16, 16}, seed += 10);
    }
}

}  // namespace
}  // namespace qmm
