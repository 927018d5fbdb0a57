// Starting and supervising one process per GPU, for data-parallel jobs (qmm finetune --gpus N).
#pragma once

#include <string>
#include <vector>

namespace qmm::tool {

// Runs `world` copies of the program argv (argv[0] a path, or a name looked up on PATH) and waits for all of them.
// Rank r gets QMM_RANK=r, QMM_WORLD_SIZE=world and NCCL_NVLS_ENABLE=0 in its environment (the GPU machines forbid
// NVLink multicast), and is killed if this process dies. When a rank exits non-zero or is killed, the others get
// SIGTERM (SIGKILL after grace_ms) and an Error (Distributed) names the first rank that failed and how: a failed
// rank never leaves the others hanging. Returns when every rank exited with 0.
void run_ranks(const std::vector<std::string>& argv, int world, int grace_ms = 5000);

// This process's rank and world size from QMM_RANK / QMM_WORLD_SIZE (0 and 1 when unset); throws InvalidArgument
// on malformed values.
struct RankEnv {
  int rank = 0;
  int world = 1;
};
RankEnv rank_env();

}  // namespace qmm::tool
