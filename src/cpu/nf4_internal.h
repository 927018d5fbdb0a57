// Pieces of the CPU NF4 quantizer exposed for tests (byte-identity of double quantization given the producer's
// offset) and for other backends that want the same arithmetic. Not public API.
#pragma once

#include <cstdint>

namespace qmm::cpu {

// The double-quantization offset: the fp32 absmax values summed in double, in chunks of kNf4MeanChunk (qmm/nf4.h)
// summed in index order and then the chunk sums in order (a fixed order the GPU reproduces exactly, with one
// thread per chunk), the sum rounded to fp32, times the fp32 reciprocal of the count, rounded to fp32. This is the
// producer's mean (torch's sum * (1/n)); it reproduces the golden `offset` of every file bit for bit.
float nf4_absmax_mean(const float* absmax, std::int64_t nblocks);

// Index of the code2 value nearest to x: code2 midpoints (a+b)/2 in fp32; a value exactly on a midpoint goes to
// the lower index; NaN gives 0.
int nf4_nearest_code2(float x);

// Double quantization of nblocks fp32 scales with a given offset: for each group of 256 blocks,
// absmax2 = max |absmax - offset| (the difference rounded to fp32), q = nf4_nearest_code2((absmax - offset) *
// (1 / absmax2)) with the reciprocal and the product each rounded to fp32.
void nf4_double_quantize(const float* absmax, std::int64_t nblocks, float offset, std::uint8_t* q, float* absmax2);

}  // namespace qmm::cpu
