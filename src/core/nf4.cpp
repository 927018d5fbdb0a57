// NF4 storage: allocation and views, bitsandbytes' 8-bit map for double quantization, the rebuilt block scale,
// and the one check of every field of an NF4 weight (docs/FORMAT.md).
#include "qmm/nf4.h"

#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "core/nf4_lut.h"  // dq_block_scale
#include "core/validate.h"
#include "qmm/error.h"

namespace qmm {
namespace {

constexpr int kCode2Size = kNf4Code2Size;
constexpr int kMinBlockSize = 64;  // bitsandbytes' 4-bit block sizes: powers of two in [64, 4096]
constexpr int kMaxBlockSize = 4096;

bool valid_block_size(int b) { return b >= kMinBlockSize && b <= kMaxBlockSize && (b & (b - 1)) == 0; }

std::string block_size_rule() {
  return "a power of two in [" + std::to_string(kMinBlockSize) + ", " + std::to_string(kMaxBlockSize) +
         "] (bitsandbytes' range)";
}

// The signed dynamic map: for i = 0..6, 2^i + 1 points spaced evenly from 0.1 to 1, the 2^i midpoints of
// neighbouring points, times 10^(i-6), with both signs; then 0 and 1; ascending. The arithmetic is the producer's
// (fp32 throughout): point k = 0.1 + step*k for the first half and 1 - step*(n-1-k) for the rest, each with one
// rounding (a fused multiply-add), midpoint = (a + b) / 2, value = float(10^(i-6)) * midpoint. Checked bit for
// bit against the golden `code2` tensors.
std::array<float, kCode2Size> make_code2() {
  std::array<float, kCode2Size> out{};
  int count = 0;
  for (int i = 0; i < 7; ++i) {
    const int n = (1 << i) + 1;
    const float start = 0.1f, stop = 1.0f;
    const float step = (stop - start) / static_cast<float>(n - 1);
    float points[65];
    for (int k = 0; k < n; ++k)
      points[k] = k < n / 2 ? std::fma(step, static_cast<float>(k), start)
                            : std::fma(-step, static_cast<float>(n - 1 - k), stop);
    const float scale = static_cast<float>(std::pow(10.0, i - 6));
    for (int k = 0; k + 1 < n; ++k) {
      const float mid = (points[k] + points[k + 1]) / 2.0f;
      const float v = scale * mid;
      out[static_cast<std::size_t>(count++)] = v;
      out[static_cast<std::size_t>(count++)] = -v;
    }
  }
  out[static_cast<std::size_t>(count++)] = 0.0f;
  out[static_cast<std::size_t>(count++)] = 1.0f;
  // count == 256; insertion sort keeps this free of <algorithm> and runs once.
  for (int a = 1; a < kCode2Size; ++a)
    for (int b = a; b > 0 && out[static_cast<std::size_t>(b - 1)] > out[static_cast<std::size_t>(b)]; --b)
      std::swap(out[static_cast<std::size_t>(b - 1)], out[static_cast<std::size_t>(b)]);
  return out;
}

}  // namespace

const float* nf4_code2_table() {
  static const std::array<float, kCode2Size> table = make_code2();
  return table.data();
}

Nf4Tensor Nf4Tensor::allocate(std::int64_t rows, std::int64_t cols, bool double_quant, Device device, int block_size) {
  const char* op = "Nf4Tensor::allocate";
  if (rows < 1 || cols < 1)
    detail::fail(ErrorCode::InvalidArgument, op,
                 "shape [" + std::to_string(rows) + "," + std::to_string(cols) + "] must have rows, cols >= 1");
  if (rows > std::numeric_limits<std::int64_t>::max() / cols)
    detail::fail(ErrorCode::InvalidArgument, op,
                 "shape [" + std::to_string(rows) + "," + std::to_string(cols) + "] overflows");
  if (!valid_block_size(block_size))
    detail::fail(ErrorCode::InvalidArgument, op,
                 "block size " + std::to_string(block_size) + " must be " + block_size_rule());
  Nf4Tensor t;
  t.rows = rows;
  t.cols = cols;
  t.block_size = block_size;
  const Nf4Weight shape_only = [&] {
    Nf4Weight w;
    w.rows = rows;
    w.cols = cols;
    w.block_size = block_size;
    return w;
  }();
  t.codes = Tensor(DType::U8, {(rows * cols + 1) / 2}, device);
  if (double_quant) {
    t.absmax = Tensor(DType::U8, {shape_only.num_blocks()}, device);
    t.absmax2 = Tensor(DType::F32, {shape_only.num_groups()}, device);
    t.code2 = Tensor(DType::F32, {kCode2Size}, device);
    // The map is a constant of the format; filling it here makes a fresh tensor self-consistent.
    copy(t.code2, TensorView(const_cast<float*>(nf4_code2_table()), DType::F32, {kCode2Size}));
  } else {
    t.absmax = Tensor(DType::F32, {shape_only.num_blocks()}, device);
  }
  return t;
}

Nf4Weight Nf4Tensor::view() const {
  Nf4Weight w;
  w.codes = codes.view();
  w.absmax = absmax.view();
  if (absmax2.defined()) w.absmax2 = absmax2.view();
  if (code2.defined()) w.code2 = code2.view();
  w.offset = offset;
  w.rows = rows;
  w.cols = cols;
  w.block_size = block_size;
  return w;
}

float nf4_block_scale(const Nf4Weight& w, std::int64_t block) {
  const char* op = "nf4_block_scale";
  if (!w.absmax.device().is_cpu() || w.absmax.data() == nullptr)
    detail::fail(ErrorCode::InvalidArgument, op, "the weight's scales must be in host memory");
  if (block < 0 || block >= w.num_blocks() || block >= w.absmax.numel())
    detail::fail(ErrorCode::InvalidArgument, op,
                 "block " + std::to_string(block) + " is out of range [0, " + std::to_string(w.num_blocks()) + ")");
  if (!w.double_quant()) return w.absmax.data_as<const float>()[block];
  const std::int64_t group = block / kNf4NestedBlockSize;
  if (!w.absmax2.device().is_cpu() || !w.code2.device().is_cpu() || !w.absmax2.data() || !w.code2.data() ||
      group >= w.absmax2.numel() || w.code2.numel() != kCode2Size)
    detail::fail(ErrorCode::InvalidArgument, op, "the double-quantization fields must be complete, in host memory");
  const float c = w.code2.data_as<const float>()[w.absmax.data_as<const std::uint8_t>()[block]];
  return nf4_lut::dq_block_scale(c, w.absmax2.data_as<const float>()[group], w.offset);
}

namespace detail {

void require_nf4_weight(const Context& ctx, const char* op, const char* name, const Nf4Weight& w) {
  require_nf4_weight(ctx.device(), op, name, w);
}

void require_nf4_weight(Device device, const char* op, const char* name, const Nf4Weight& w) {
  // Messages are built only on failure: this runs on every NF4 call, some of them microsecond kernels.
  const std::string n(name);
  auto shape = [&] { return std::string("[") + std::to_string(w.rows) + "," + std::to_string(w.cols) + "]"; };
  if (w.rows < 1 || w.cols < 1)
    fail(ErrorCode::InvalidArgument, op, n + " is " + shape() + " but rows and cols must be >= 1");
  if (w.rows > std::numeric_limits<std::int64_t>::max() / w.cols)
    fail(ErrorCode::InvalidArgument, op, n + " is " + shape() + ": its element count overflows");
  if (!valid_block_size(w.block_size))
    fail(ErrorCode::InvalidArgument, op,
         n + " has block size " + std::to_string(w.block_size) + " but it must be " + block_size_rule());

  require_tensor(device, op, (n + ".codes").c_str(), w.codes);
  require_dtype(op, (n + ".codes").c_str(), w.codes, {DType::U8});
  const std::int64_t want_codes = (w.numel() + 1) / 2;
  if (w.codes.numel() != want_codes)
    fail(ErrorCode::ShapeMismatch, op,
         n + ".codes has " + std::to_string(w.codes.numel()) + " bytes but a " + shape() + " weight packs into " +
             std::to_string(want_codes) + " (two codes per byte)");

  if (w.absmax.empty()) fail(ErrorCode::InvalidArgument, op, n + ".absmax is missing");
  require_tensor(device, op, (n + ".absmax").c_str(), w.absmax);
  if (w.absmax.dtype() != DType::F32 && w.absmax.dtype() != DType::U8)
    fail(ErrorCode::DTypeMismatch, op,
         n + ".absmax is " + dtype_name(w.absmax.dtype()) + " but must be f32 (plain) or u8 (double-quantized)");
  const std::int64_t nblocks = w.num_blocks();
  if (w.absmax.numel() != nblocks)
    fail(ErrorCode::ShapeMismatch, op,
         n + ".absmax has " + std::to_string(w.absmax.numel()) + " elements but a " + shape() +
             " weight in blocks of " + std::to_string(w.block_size) + " has " + std::to_string(nblocks) + " blocks");
  if (!w.double_quant()) return;  // absmax2, code2 and offset are unused then

  if (w.absmax2.empty())
    fail(ErrorCode::InvalidArgument, op, n + ".absmax is u8 (double-quantized) but " + n + ".absmax2 is missing");
  if (w.code2.empty())
    fail(ErrorCode::InvalidArgument, op, n + ".absmax is u8 (double-quantized) but " + n + ".code2 is missing");
  require_tensor(device, op, (n + ".absmax2").c_str(), w.absmax2);
  require_dtype(op, (n + ".absmax2").c_str(), w.absmax2, {DType::F32});
  if (w.absmax2.numel() != w.num_groups())
    fail(ErrorCode::ShapeMismatch, op,
         n + ".absmax2 has " + std::to_string(w.absmax2.numel()) + " elements but " + std::to_string(nblocks) +
             " blocks make " + std::to_string(w.num_groups()) + " groups of " + std::to_string(kNf4NestedBlockSize));
  require_tensor(device, op, (n + ".code2").c_str(), w.code2);
  require_dtype(op, (n + ".code2").c_str(), w.code2, {DType::F32});
  if (w.code2.numel() != kCode2Size)
    fail(ErrorCode::ShapeMismatch, op,
         n + ".code2 has " + std::to_string(w.code2.numel()) + " elements but must have " + std::to_string(kCode2Size));
  if (!std::isfinite(w.offset))
    fail(ErrorCode::InvalidArgument, op, n + ".offset is " + std::to_string(w.offset) + " but must be finite");
}

}  // namespace detail
void validate_nf4_weight(const Nf4Weight& w, const std::string& op) {
  detail::require_nf4_weight(w.codes.device(), op.c_str(), "W", w);
}

}  // namespace qmm
