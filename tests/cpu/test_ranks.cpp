// The rank supervisor of data-parallel jobs (tools/qmm/ranks.cpp), with shell one-liners as ranks.
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "ranks.h"

namespace qmm {
namespace {

std::vector<std::string> sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(Ranks, EveryRankRunsWithItsEnvironment) {
  // Each rank checks its own variables and leaves a file named after its rank.
  const std::string dir = ::testing::TempDir() + "qmm_ranks_env";
  ASSERT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  tool::run_ranks(sh("test \"$QMM_WORLD_SIZE\" = 3 && test \"$QMM_RANK\" -lt 3 && test \"$NCCL_NVLS_ENABLE\" = 0 && "
                     "touch " + dir + "/rank$QMM_RANK"),
                  3);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(std::system(("test -f " + dir + "/rank" + std::to_string(r)).c_str()), 0) << r;
}

TEST(Ranks, AFailingRankStopsTheOthersAndIsNamed) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(test::throws_error(
      [] { tool::run_ranks(sh("if [ \"$QMM_RANK\" = 1 ]; then exit 3; fi; exec sleep 60"), 3, 2000); },
      ErrorCode::Distributed, {"rank 1 of 3", "exited with code 3", "stopped"}));
  EXPECT_LT(seconds_since(t0), 20.0);  // not the 60 s the others would sleep
}

TEST(Ranks, ARankThatIgnoresTermIsKilledAfterTheGracePeriod) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(test::throws_error(
      [] { tool::run_ranks(sh("trap '' TERM; if [ \"$QMM_RANK\" = 0 ]; then exit 5; fi; exec sleep 60"), 2, 300); },
      ErrorCode::Distributed, {"rank 0 of 2", "exited with code 5"}));
  EXPECT_LT(seconds_since(t0), 20.0);
}

TEST(Ranks, KilledRanksAndMissingProgramsAreReported) {
  EXPECT_TRUE(test::throws_error([] { tool::run_ranks(sh("if [ \"$QMM_RANK\" = 1 ]; then kill -9 $$; fi"), 2); },
                                 ErrorCode::Distributed, {"rank 1", "killed by signal"}));
  EXPECT_TRUE(test::throws_error([] { tool::run_ranks({"/nonexistent/qmm-rank"}, 1); }, ErrorCode::Distributed,
                                 {"rank 0", "exited with code 127"}));
  EXPECT_TRUE(test::throws_error([] { tool::run_ranks({}, 2); }, ErrorCode::InvalidArgument, {"empty command"}));
  EXPECT_TRUE(test::throws_error([] { tool::run_ranks(sh("true"), 0); }, ErrorCode::InvalidArgument, {"world size"}));
}

TEST(Ranks, RankEnvironmentIsParsedAndChecked) {
  unsetenv("QMM_RANK");
  unsetenv("QMM_WORLD_SIZE");
  EXPECT_EQ(tool::rank_env().rank, 0);
  EXPECT_EQ(tool::rank_env().world, 1);
  setenv("QMM_RANK", "2", 1);
  setenv("QMM_WORLD_SIZE", "4", 1);
  EXPECT_EQ(tool::rank_env().rank, 2);
  EXPECT_EQ(tool::rank_env().world, 4);
  setenv("QMM_RANK", "4", 1);
  EXPECT_TRUE(test::throws_error([] { tool::rank_env(); }, ErrorCode::InvalidArgument, {"QMM_RANK 4"}));
  setenv("QMM_RANK", "x1", 1);
  EXPECT_TRUE(test::throws_error([] { tool::rank_env(); }, ErrorCode::InvalidArgument, {"QMM_RANK", "x1"}));
  unsetenv("QMM_RANK");
  unsetenv("QMM_WORLD_SIZE");
}

}  // namespace
}  // namespace qmm
