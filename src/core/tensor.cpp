#include "qmm/tensor.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/gpu_backend.h"
#include "core/validate.h"
#include "qmm/context.h"
#include "qmm/error.h"

namespace qmm {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::U8: return "u8";
    case DType::I32: return "i32";
  }
  return "?";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::U8: return 1;
    case DType::I32: return 4;
  }
  return 0;
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

Shape::Shape(std::initializer_list<std::int64_t> d) {
  if (d.size() > static_cast<std::size_t>(kMaxRank))
    throw Error(ErrorCode::InvalidArgument, "Shape: rank " + std::to_string(d.size()) + " exceeds 4");
  for (std::int64_t extent : d) {
    if (extent < 0) throw Error(ErrorCode::InvalidArgument, "Shape: negative extent " + std::to_string(extent));
    dims[static_cast<std::size_t>(rank++)] = extent;
  }
}

std::int64_t Shape::numel() const {
  // dims is a public array: a rank set by hand must not index past it.
  if (rank < 0 || rank > kMaxRank)
    throw Error(ErrorCode::InvalidArgument, "Shape: rank " + std::to_string(rank) + " is outside 0..4");
  for (int i = 0; i < rank; ++i)
    if (dims[static_cast<std::size_t>(i)] == 0) return 0;  // empty, however large the other extents
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i)
    if (__builtin_mul_overflow(n, dims[static_cast<std::size_t>(i)], &n))
      throw Error(ErrorCode::InvalidArgument, "Shape " + str() + ": the element count overflows int64");
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (dims[static_cast<std::size_t>(i)] != o.dims[static_cast<std::size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < std::min(rank, kMaxRank); ++i) {  // error messages print shapes that failed validation
    if (i) s += ',';
    s += std::to_string(dims[static_cast<std::size_t>(i)]);  // appended alone: gcc 12 -Wrestrict misfires on "," + s
  }
  return s + "]";
}

std::size_t TensorView::nbytes() const {
  const std::int64_t n = numel();
  std::size_t bytes = 0;
  if (n < 0 || __builtin_mul_overflow(static_cast<std::size_t>(n), dtype_size(dtype_), &bytes))
    throw Error(ErrorCode::InvalidArgument, "TensorView " + str() + ": the byte size overflows");
  return bytes;
}

std::string TensorView::str() const {
  return std::string(dtype_name(dtype_)) + shape_.str() + "@" + device_.str();
}

Tensor::Tensor(DType dtype, Shape shape, Device device) {
  // Every size is checked before allocating: a wrapped byte count would allocate a wrong, small buffer.
  if (shape.rank < 0 || shape.rank > kMaxRank)
    throw Error(ErrorCode::InvalidArgument, "Tensor: rank " + std::to_string(shape.rank) + " is outside 0..4");
  for (int i = 0; i < shape.rank; ++i)
    if (shape[i] < 0)
      throw Error(ErrorCode::InvalidArgument, "Tensor: shape " + shape.str() + " has a negative extent");
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<std::size_t>(shape.numel()), dtype_size(dtype), &bytes) ||
      bytes > std::numeric_limits<std::size_t>::max() - 63)
    throw Error(ErrorCode::InvalidArgument, std::string("Tensor: ") + dtype_name(dtype) + shape.str() +
                                                " has a byte size that overflows size_t");
  const std::size_t alloc = bytes == 0 ? 64 : bytes;  // a real pointer even for empty tensors
  if (device.is_cpu()) {
    void* p = std::aligned_alloc(64, (alloc + 63) / 64 * 64);
    if (!p) throw Error(ErrorCode::InvalidArgument, "Tensor: cannot allocate " + std::to_string(bytes) + " bytes");
    storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    const GpuBackend* gpu = gpu_backend();
    if (!gpu)
      throw Error(ErrorCode::NoDevice, "Tensor: qmm was built without CUDA; cannot allocate on " + device.str());
    void* p = gpu->device_alloc(alloc, device.index);
    const int index = device.index;
    storage_ = std::shared_ptr<void>(p, [gpu, index](void* q) { gpu->device_free(q, index); });
  }
  view_ = TensorView(storage_.get(), dtype, shape, device);
}

void copy(const TensorView& dst, const TensorView& src) {
  QMM_REQUIRE(dst.dtype() == src.dtype(), ErrorCode::DTypeMismatch, "copy",
              "dst is " + dst.str() + " but src is " + src.str());
  QMM_REQUIRE(dst.numel() == src.numel(), ErrorCode::ShapeMismatch, "copy",
              "dst is " + dst.str() + " but src is " + src.str());
  if (dst.numel() == 0) return;
  QMM_REQUIRE(dst.data() && src.data(), ErrorCode::InvalidArgument, "copy", "null data pointer");
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    std::memmove(dst.data(), src.data(), src.nbytes());
    return;
  }
  require_gpu_backend("copy").copy_bytes(dst.data(), dst.device(), src.data(), src.device(), src.nbytes());
}

void copy(const Context& ctx, const TensorView& dst, const TensorView& src) {
  if (dst.device().is_cpu() && src.device().is_cpu()) return copy(dst, src);
  QMM_REQUIRE(dst.dtype() == src.dtype(), ErrorCode::DTypeMismatch, "copy",
              "dst is " + dst.str() + " but src is " + src.str());
  QMM_REQUIRE(dst.numel() == src.numel(), ErrorCode::ShapeMismatch, "copy",
              "dst is " + dst.str() + " but src is " + src.str());
  QMM_REQUIRE((dst.device().is_cpu() || dst.device() == ctx.device()) &&
                      (src.device().is_cpu() || src.device() == ctx.device()),
                  ErrorCode::DeviceMismatch, "copy", "device tensors must be on the context's " + ctx.device().str());
  if (dst.numel() == 0) return;
  QMM_REQUIRE(dst.data() && src.data(), ErrorCode::InvalidArgument, "copy", "null data pointer");
  require_gpu_backend("copy").copy_bytes_async(ctx, dst.data(), src.data(), src.nbytes());
}

Tensor to_device(const TensorView& src, Device device) {
  Tensor out(src.dtype(), src.shape(), device);
  copy(out, src);
  return out;
}

namespace {
std::uint32_t bits_of(float x) { return std::bit_cast<std::uint32_t>(x); }
float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }
}  // namespace

float bf16_to_float(std::uint16_t bits) { return float_of(static_cast<std::uint32_t>(bits) << 16); }

std::uint16_t float_to_bf16(float x) {
  std::uint32_t u = bits_of(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // stay a quiet NaN
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<std::uint16_t>(u >> 16);
}

std::uint16_t float_to_bf16_trunc(float x) { return static_cast<std::uint16_t>(bits_of(x) >> 16); }

float round_to_tf32(float x) {
  if (!std::isfinite(x)) return x;
  std::uint32_t u = bits_of(x);
  u += 0xFFF + ((u >> 13) & 1);
  return float_of(u & 0xFFFFE000u);
}

float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  const int exp = (h >> 10) & 0x1F;
  const std::uint32_t mant = h & 0x3FF;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return float_of(sign | 0x7F800000u | (mant << 13));
  return float_of(sign | (static_cast<std::uint32_t>(exp + 112) << 23) | (mant << 13));
}

std::uint16_t float_to_f16(float x) {
  const std::uint32_t u = bits_of(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000);
  if (std::isnan(x)) return static_cast<std::uint16_t>(sign | 0x7E00);
  const float a = std::fabs(x);
  if (a >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (a < 6.103515625e-05f) {                                           // subnormal range: units of 2^-24
    const float q = std::nearbyint(a * 16777216.0f);                    // round half to even (default mode)
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(q));
  }
  std::uint32_t v = (u & 0x7FFFFFFFu) - (112u << 23);  // rebias exponent
  v += 0xFFF + ((v >> 13) & 1);
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(v >> 13));
}

}  // namespace qmm
