// Internal pieces of the CUDA NF4 quantizer that tests reach directly (plain C++ declarations).
#pragma once

#include <cstdint>
#include <span>

#include "qmm/context.h"
#include "qmm/nf4.h"

namespace qmm::cuda {

// Double quantization of `nblocks` fp32 absmax values (device memory on ctx's device) around a given `offset`:
// fills out.absmax (u8 indices into code2), out.absmax2 and out.code2, and sets out.offset. nf4_quantize calls it
// with the mean it computes; tests call it with bitsandbytes' own offset to check the bytes against the goldens.
void nf4_double_quantize(const Context& ctx, const float* absmax, std::int64_t nblocks, float offset,
                         Nf4Weight& out);

// The weights dequantized to bf16 one after another into out (each [rows, cols], row-major), in one launch per
// eight weights.
void nf4_dequantize_many(const Context& ctx, std::span<const Nf4Weight> ws, void* out);

}  // namespace qmm::cuda
