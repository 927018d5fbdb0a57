// Element types, devices, the non-owning TensorView and the owning Tensor.
// Tensors are dense and row-major (the last dimension is contiguous); rank 0 to 4.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

namespace qmm {

enum class DType { F32, BF16, F16, U8, I32 };  // I32: labels (token ids)

const char* dtype_name(DType dtype);  // "f32", "bf16", "f16", "u8", "i32"
std::size_t dtype_size(DType dtype);

enum class DeviceType { Cpu, Cuda };

struct Device {
  DeviceType type = DeviceType::Cpu;
  int index = 0;

  static Device cpu() { return {DeviceType::Cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::Cuda, index}; }
  bool is_cpu() const { return type == DeviceType::Cpu; }
  bool is_cuda() const { return type == DeviceType::Cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:0"
};

constexpr int kMaxRank = 4;

struct Shape {
  int rank = 0;
  std::array<std::int64_t, kMaxRank> dims{};

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> d);  // throws InvalidArgument on rank > 4 or a negative extent
  std::int64_t operator[](int i) const { return dims[static_cast<std::size_t>(i)]; }
  // The element count: 0 when any extent is 0 (whatever the others), else the product; throws InvalidArgument
  // naming the shape when that product overflows int64, so no caller ever sees a wrapped count.
  std::int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[64,32]"
};

// A view of memory owned elsewhere. Copying a view copies the pointer, never the data.
class TensorView {
 public:
  TensorView() = default;
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu())
      : data_(data), dtype_(dtype), shape_(shape), device_(device) {}

  void* data() const { return data_; }
  template <class T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank; }
  std::int64_t dim(int i) const { return shape_[i]; }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t nbytes() const;  // numel() * dtype size; throws InvalidArgument naming the view if that overflows
  Device device() const { return device_; }
  // A default-constructed "absent" view (rank 0 with null data: a rank-0 shape otherwise counts one element).
  bool empty() const { return data_ == nullptr && (shape_.rank == 0 || numel() == 0); }
  std::string str() const;  // "f32[64,32]@cpu"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Shape shape_{};
  Device device_{};
};

// Owns its memory: 64-byte aligned host memory, or device memory from cudaMalloc.
class Tensor {
 public:
  Tensor() = default;
  // Uninitialised contents. Throws InvalidArgument naming the shape for a negative extent, a rank outside 0..4 or
  // a byte size that overflows (checked before anything is allocated).
  Tensor(DType dtype, Shape shape, Device device = Device::cpu());

  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: a Tensor is usable wherever a view is
  void* data() const { return view_.data(); }
  template <class T>
  T* data_as() const { return view_.data_as<T>(); }
  DType dtype() const { return view_.dtype(); }
  const Shape& shape() const { return view_.shape(); }
  std::int64_t dim(int i) const { return view_.dim(i); }
  std::int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return view_.nbytes(); }
  Device device() const { return view_.device(); }
  bool defined() const { return storage_ != nullptr; }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Copies src into dst (same dtype and element count) between any two devices; blocks until done.
void copy(const TensorView& dst, const TensorView& src);

class Context;
// The same, enqueued on ctx's stream (asynchronous where both sides are device memory).
void copy(const Context& ctx, const TensorView& dst, const TensorView& src);

// A copy of `src` on `device`.
Tensor to_device(const TensorView& src, Device device);

// Scalar conversions used by every backend and by tests.
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float x);        // round to nearest even; NaN stays NaN
std::uint16_t float_to_bf16_trunc(float x);  // clear the low 16 bits (the BF16-compute contract)
float round_to_tf32(float x);                // round to nearest even at tf32's 10-bit mantissa
float f16_to_float(std::uint16_t bits);
std::uint16_t float_to_f16(float x);  // round to nearest even

}  // namespace qmm
