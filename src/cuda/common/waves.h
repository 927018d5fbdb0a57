// How a latency-bound kernel's rows are shared out over its blocks. Plain C++ with no CUDA headers, so that the CPU
// tests pin the choice.
#pragma once

#include <algorithm>
#include <cstdint>

namespace qmm::cuda {

// Row tiles each block walks, for a grid of `column_blocks` x (row groups) blocks over `tiles` row tiles, `wave`
// blocks resident at once. A block's time goes with the tiles it walks (its warps wait on their own loads), so a
// last wave that is only partly filled costs as much as a full one: of the groupings that fill 1..max_waves waves,
// the one with the fewest (waves x tiles a block); fewer waves among equals (each block then loads its per-column
// data for more tiles). One group per column block where even one wave cannot hold two.
inline std::int64_t tiles_per_row_group(std::int64_t column_blocks, std::int64_t tiles, std::int64_t wave,
                                        int max_waves = 4) {
  const auto ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  if (tiles <= 0 || column_blocks <= 0) return std::max<std::int64_t>(tiles, 1);
  wave = std::max<std::int64_t>(wave, 1);
  std::int64_t best = tiles, best_cost = ceil_div(column_blocks, wave) * tiles;  // one group
  for (std::int64_t waves = 1; waves <= max_waves; ++waves) {
    const std::int64_t groups = std::min(tiles, waves * wave / column_blocks);
    if (groups < 2) continue;
    const std::int64_t per = ceil_div(tiles, groups);
    const std::int64_t cost = ceil_div(column_blocks * ceil_div(tiles, per), wave) * per;
    if (cost < best_cost) best = per, best_cost = cost;
  }
  return best;
}

}  // namespace qmm::cuda
