// Device buffers that the layers grow to the largest view asked of them: they allocate (which may synchronize the
// device) only when they grow.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qmm/tensor.h"

namespace qmm {

// A [rows, cols] view of dtype at the start of `storage`, which is (re)allocated on `device` first where it is
// too small or elsewhere. The view stays valid until the next call that grows the same storage.
TensorView grown_view(Tensor& storage, Device device, DType dtype, std::int64_t rows, std::int64_t cols);

// The bytes `storage` holds (0 before its first view).
std::size_t held_bytes(const Tensor& storage);

}  // namespace qmm
