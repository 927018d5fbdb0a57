// Sums of partial results laid out [count][stride] (a split's or a row group's partials one after another), added
// by several threads per sum so that a sum's loads are in flight together, in a fixed order.
#pragma once

#include <cstdint>

namespace qmm::cuda::common {

// A lane_sum block: kLaneSumCols sums, each over kLaneSumLanes threads.
constexpr int kLaneSumCols = 32, kLaneSumLanes = 32, kLaneSumThreads = kLaneSumCols * kLaneSumLanes;
using LaneSums = float[kLaneSumLanes][kLaneSumCols + 1];  // the block's shared scratch

// In a block of kLaneSumThreads threads, thread (column threadIdx.x % kLaneSumCols, lane threadIdx.x /
// kLaneSumCols): the sum over g < count of p[g * stride], lane j adding the terms j, j + kLaneSumLanes, ... and the
// lanes' sums then added in lane order (the same order on every run). Warps load kLaneSumCols consecutive columns at
// once. Every thread of the block calls it once (it synchronizes the block); the result is valid in lane 0
// (threadIdx.x < kLaneSumCols), and a thread with valid false adds nothing.
__device__ __forceinline__ float lane_sum(const float* p, std::int64_t count, std::int64_t stride, bool valid,
                                          LaneSums& sums) {
  const int col = threadIdx.x % kLaneSumCols, lane = threadIdx.x / kLaneSumCols;
  float acc = 0.0f;
  if (valid) {
#pragma unroll 4
    for (std::int64_t g = lane; g < count; g += kLaneSumLanes) acc += p[g * stride];
  }
  sums[lane][col] = acc;
  __syncthreads();
  float total = 0.0f;
  if (lane == 0)
    for (int j = 0; j < kLaneSumLanes; ++j) total += sums[j][col];
  return total;
}

}  // namespace qmm::cuda::common
