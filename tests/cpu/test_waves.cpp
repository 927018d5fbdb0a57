// The row grouping of latency-bound kernels (src/cuda/common/waves.h): whole waves of blocks.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/common/waves.h"

namespace {

using qmm::cuda::tiles_per_row_group;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// What a grouping costs: waves x tiles a block, the model the choice minimises.
std::int64_t cost(std::int64_t column_blocks, std::int64_t tiles, std::int64_t wave, std::int64_t per) {
  return ceil_div(column_blocks * ceil_div(tiles, per), wave) * per;
}

TEST(Waves, GroupsRowsIntoWholeWaves) {
  // The SwiGLU-adapters kernel at Llama's 4096 x 14336 (112 blocks of 4 strips, 256 tiles of 16 rows) and Qwen's
  // 2048 x 8960 (70 blocks, 128 tiles) with 528 blocks a wave: rounding the grid up to two waves' warps gave 1120
  // blocks, a third wave of 64.
  EXPECT_EQ(tiles_per_row_group(112, 256, 528), 19);  // 14 groups, 1568 blocks: three waves of 19 tiles
  EXPECT_EQ(tiles_per_row_group(70, 128, 528), 9);    // 15 groups, 1050 blocks: two waves of 9 tiles
  EXPECT_LT(cost(112, 256, 528, 19), cost(112, 256, 528, 26));
  EXPECT_LT(cost(70, 128, 528, 9), cost(70, 128, 528, 8));
}

TEST(Waves, NoChoiceCostsMoreThanTheOthersItWeighs) {
  for (std::int64_t column_blocks : {1, 3, 70, 112, 527, 528, 529, 5000})
    for (std::int64_t tiles : {1, 2, 7, 63, 65, 128, 256, 1000})
      for (std::int64_t wave : {1, 132, 264, 528}) {
        const std::int64_t per = tiles_per_row_group(column_blocks, tiles, wave);
        ASSERT_GE(per, 1);
        ASSERT_LE(per, tiles);
        const std::int64_t got = cost(column_blocks, tiles, wave, per);
        EXPECT_LE(got, cost(column_blocks, tiles, wave, tiles)) << column_blocks << " " << tiles << " " << wave;
        for (std::int64_t waves = 1; waves <= 4; ++waves) {  // every grouping that fills whole waves
          const std::int64_t groups = std::min(tiles, waves * wave / column_blocks);
          if (groups >= 2)
            EXPECT_LE(got, cost(column_blocks, tiles, wave, ceil_div(tiles, groups)))
                << column_blocks << " " << tiles << " " << wave << " " << waves;
        }
      }
}

TEST(Waves, DegenerateShapesTakeOneGroup) {
  EXPECT_EQ(tiles_per_row_group(112, 1, 528), 1);
  EXPECT_EQ(tiles_per_row_group(112, 0, 528), 1);
  EXPECT_EQ(tiles_per_row_group(0, 5, 528), 5);
  EXPECT_EQ(tiles_per_row_group(2000, 64, 528), 64);  // a wave cannot hold two groups of the columns
  EXPECT_EQ(tiles_per_row_group(3, 100, 0), tiles_per_row_group(3, 100, 1));
}

}  // namespace
