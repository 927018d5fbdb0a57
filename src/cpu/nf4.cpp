// CPU NF4: quantize (byte-identical to bitsandbytes, checked against its golden vectors), dequantize, and the
// NF4 GEMMs of the reference contract (bf16 operands, fp64 accumulation) through the blocked CPU GEMM.
// The arithmetic of each step is written down in docs/FORMAT.md.
#include "qmm/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/nf4_internal.h"
#include "qmm/tensor.h"

namespace qmm::cpu {
namespace {

constexpr int kCode2Size = 256;
// Below this many elements a parallel region costs more than it saves.
constexpr std::int64_t kParallelMin = 1 << 16;

// The 255 fp32 midpoints between neighbouring code2 values, computed as the producer does: (a + b) * 0.5.
struct Code2Midpoints {
  float mid[kCode2Size - 1];
  Code2Midpoints() {
    const float* c = nf4_code2_table();
    for (int j = 0; j + 1 < kCode2Size; ++j) mid[j] = (c[j] + c[j + 1]) * 0.5f;
  }
};

const Code2Midpoints& code2_midpoints() {
  static const Code2Midpoints m;
  return m;
}

float load_element(const void* base, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::BF16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::F16: return f16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::U8:
    case DType::I32: break;
  }
  return 0.0f;
}

// One block [begin, end) of W: its absmax and its packed codes. begin is even (block sizes are even), so the
// block owns whole bytes; an odd element count leaves the last low nibble, which gets the code of 0.0.
template <DType D>
float quantize_block(const void* w, std::int64_t begin, std::int64_t end, std::uint8_t* codes) {
  float amax = 0.0f;
  for (std::int64_t e = begin; e < end; ++e) {
    const float a = std::fabs(load_element(w, D, e));
    if (a > amax) amax = a;  // NaN inputs never raise the scale (as fmaxf)
  }
  // Multiply by the fp32 reciprocal, as the producer does. For an all-zero block 1/0 = inf and 0*inf = NaN, which
  // nf4_nearest_code maps to code 0; the scale is 0, so the block dequantizes to 0.
  const float inv = 1.0f / amax;
  for (std::int64_t e = begin; e < end; e += 2) {
    const int hi = nf4_nearest_code(load_element(w, D, e) * inv);
    const int lo = e + 1 < end ? nf4_nearest_code(load_element(w, D, e + 1) * inv) : kNf4ZeroCode;
    codes[e >> 1] = static_cast<std::uint8_t>((hi << 4) | lo);
  }
  return amax;
}

template <DType D>
void quantize_all(const TensorView& w, int block_size, std::uint8_t* codes, float* absmax) {
  const std::int64_t n = w.numel();
  const std::int64_t nblocks = (n + block_size - 1) / block_size;
  const void* src = w.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t b = 0; b < nblocks; ++b) {
    const std::int64_t begin = b * block_size;
    absmax[b] = quantize_block<D>(src, begin, std::min(n, begin + block_size), codes);
  }
}

template <class Store>
void dequantize_all(const Nf4Weight& w, Store store) {
  const std::int64_t n = w.numel();
  const std::int64_t nblocks = w.num_blocks();
  const std::uint8_t* codes = w.codes.data_as<const std::uint8_t>();
  // Scales first, serially: nf4_block_scale checks its arguments and must not throw inside a parallel region.
  std::vector<float> scales(static_cast<std::size_t>(nblocks));
  for (std::int64_t b = 0; b < nblocks; ++b) scales[static_cast<std::size_t>(b)] = nf4_block_scale(w, b);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t b = 0; b < nblocks; ++b) {
    const float scale = scales[static_cast<std::size_t>(b)];
    const std::int64_t end = std::min(n, (b + 1) * w.block_size);
    for (std::int64_t e = b * w.block_size; e < end; ++e) store(e, nf4_code_value(nf4_unpack(codes, e)) * scale);
  }
}

// W dequantized to bf16 (nearest even): the weight operand of the NF4 GEMM contract.
std::vector<std::uint16_t> dequantize_bf16(const Nf4Weight& w) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(w.numel()));
  std::uint16_t* p = out.data();
  dequantize_all(w, [p](std::int64_t e, float v) { p[e] = float_to_bf16(v); });
  return out;
}

// The activation operand in bf16: as given when bf16, else rounded to nearest even into `storage`.
const void* bf16_operand(const TensorView& x, std::vector<std::uint16_t>& storage) {
  if (x.dtype() == DType::BF16) return x.data();
  const std::int64_t n = x.numel();
  storage.resize(static_cast<std::size_t>(n));
  const float* src = x.data_as<const float>();
  std::uint16_t* dst = storage.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  return dst;
}

}  // namespace

float nf4_absmax_mean(const float* absmax, std::int64_t nblocks) {
  double sum = 0.0;
  for (std::int64_t c = 0; c < nblocks; c += kNf4MeanChunk) {
    double chunk = 0.0;
    for (std::int64_t i = c; i < std::min(nblocks, c + kNf4MeanChunk); ++i) chunk += static_cast<double>(absmax[i]);
    sum += chunk;
  }
  const float inv_count = 1.0f / static_cast<float>(nblocks);
  return static_cast<float>(sum) * inv_count;
}

int nf4_nearest_code2(float x) {
  const float* mid = code2_midpoints().mid;
  // The number of midpoints strictly below x: exactly on a midpoint stays below it (the lower index); NaN is
  // below nothing and gives 0.
  const float* first_not_below = std::partition_point(mid, mid + (kCode2Size - 1), [x](float m) { return x > m; });
  return static_cast<int>(first_not_below - mid);
}

void nf4_double_quantize(const float* absmax, std::int64_t nblocks, float offset, std::uint8_t* q, float* absmax2) {
  const std::int64_t groups = (nblocks + kNf4NestedBlockSize - 1) / kNf4NestedBlockSize;
#pragma omp parallel for schedule(static) if (nblocks >= kParallelMin)
  for (std::int64_t g = 0; g < groups; ++g) {
    const std::int64_t begin = g * kNf4NestedBlockSize, end = std::min(nblocks, begin + kNf4NestedBlockSize);
    float amax = 0.0f;
    for (std::int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(absmax[i] - offset));
    absmax2[g] = amax;
    // A group whose scales all equal the offset has amax 0: 0 * inf = NaN gives index 0, and the rebuilt scale
    // code2[0] * 0 + offset is the offset again.
    const float inv = 1.0f / amax;
    for (std::int64_t i = begin; i < end; ++i) {
      const float d = absmax[i] - offset;
      q[i] = static_cast<std::uint8_t>(nf4_nearest_code2(d * inv));
    }
  }
}

void nf4_quantize(const TensorView& w, Nf4Weight& out) {
  const std::int64_t nblocks = out.num_blocks();
  std::uint8_t* codes = out.codes.data_as<std::uint8_t>();
  std::vector<float> scratch;
  float* absmax = out.absmax.data_as<float>();
  if (out.double_quant()) {
    scratch.resize(static_cast<std::size_t>(nblocks));
    absmax = scratch.data();
  }
  switch (w.dtype()) {
    case DType::F32: quantize_all<DType::F32>(w, out.block_size, codes, absmax); break;
    case DType::BF16: quantize_all<DType::BF16>(w, out.block_size, codes, absmax); break;
    case DType::F16: quantize_all<DType::F16>(w, out.block_size, codes, absmax); break;
    case DType::U8:
    case DType::I32: return;  // rejected by validation
  }
  if (!out.double_quant()) return;
  const float offset = nf4_absmax_mean(absmax, nblocks);
  nf4_double_quantize(absmax, nblocks, offset, out.absmax.data_as<std::uint8_t>(), out.absmax2.data_as<float>());
  std::memcpy(out.code2.data(), nf4_code2_table(), kCode2Size * sizeof(float));
  out.offset = offset;
}

void nf4_dequantize(const Nf4Weight& w, const TensorView& out) {
  if (out.dtype() == DType::BF16) {
    std::uint16_t* p = out.data_as<std::uint16_t>();
    dequantize_all(w, [p](std::int64_t e, float v) { p[e] = float_to_bf16(v); });
  } else {
    float* p = out.data_as<float>();
    dequantize_all(w, [p](std::int64_t e, float v) { p[e] = v; });
  }
}

void nf4_gemm(const TensorView& a, const Nf4Weight& w, const TensorView& c, float alpha, float beta,
              const TensorView& bias) {
  const std::vector<std::uint16_t> w16 = dequantize_bf16(w);
  std::vector<std::uint16_t> a_storage;
  GemmProblem p;
  p.m = a.dim(0);
  p.n = w.rows;
  p.k = w.cols;
  p.a = bf16_operand(a, a_storage);
  p.b = w16.data();
  p.trans_b = true;  // C[M,N] = A[M,K] * W^T, W stored [N,K]
  p.c = c.data();
  p.ab_dtype = DType::BF16;  // exact in the oracle: bf16 products summed in fp64
  p.c_dtype = c.dtype();
  p.alpha = alpha;
  p.beta = beta;
  p.bias = bias.empty() ? nullptr : bias.data();
  gemm(p);
}

void nf4_gemm_backward_a(const TensorView& dc, const Nf4Weight& w, const TensorView& da, float alpha, float beta) {
  const std::vector<std::uint16_t> w16 = dequantize_bf16(w);
  std::vector<std::uint16_t> dc_storage;
  GemmProblem p;
  p.m = dc.dim(0);
  p.n = w.cols;
  p.k = w.rows;
  p.a = bf16_operand(dc, dc_storage);
  p.b = w16.data();  // dA[M,K] = dC[M,N] * W, W stored [N,K] = B [k,n]
  p.c = da.data();
  p.ab_dtype = DType::BF16;
  p.c_dtype = da.dtype();
  p.alpha = alpha;
  p.beta = beta;
  gemm(p);
}

}  // namespace qmm::cpu
