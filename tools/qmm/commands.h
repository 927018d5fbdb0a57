// The qmm tool's subcommands. Each returns the process exit code.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace qmm::tool {

struct CheckOptions {
  bool cpu_only = false;
  bool quick = false;  // smaller sizes (used by the test suite)
};
int run_check(const CheckOptions& opts);

struct BenchOptions {
  std::vector<std::string> ops;     // empty: all
  std::vector<std::string> shapes;  // empty: all
  std::vector<std::int64_t> tokens;  // empty: all token counts (M) of the shape list
  std::string json_path;
  int repeats = 50;
  int hold_ms = 0;   // > 0: each GPU case replayed back to back this long before it is timed (sustained clocks)
  bool cpu = false;  // force the CPU backend
  bool explain = false;  // print each NF4 case's plan (kernel, tiles, why) under its row
};
int run_bench(const BenchOptions& opts);

// qmm finetune: QLoRA adapters trained on a frozen NF4 base to learn a hidden low-rank change of it.
// Zero or empty fields take the device's defaults (tools/qmm/finetune.cpp).
struct FinetuneOptions {
  std::string path;               // empty: the embedded seeded MLP; else a safetensors file of base weights
  int steps = 0;                  // GPU 300, CPU 200
  std::int64_t tokens = 0;        // rows per step; GPU 2048, CPU 64
  std::int64_t hidden = 0;        // embedded MLP sizes: GPU 1024 x 2816, CPU 128 x 352
  std::int64_t intermediate = 0;
  int rank = 16;                  // LoRA rank (alpha = 2 rank); the hidden change has rank max(1, rank/2)
  float lr = 3e-3f;               // AdamW peak learning rate (linear warmup, cosine decay)
  std::uint64_t seed = 0;
  bool cpu = false;               // force the CPU backend
  int log_every = 10;             // steps between loss read-backs (each one synchronizes)
  int gpus = 1;                   // > 1: data parallel, one process per GPU (tools/qmm/ranks.h)
};
// Mean losses over held-out batches (not trained on).
struct FinetuneResult {
  double start_loss = 0;  // the untrained student: the NF4 base alone
  double final_loss = 0;  // after training
  double floor_loss = 0;  // the NF4 base with the exact hidden change as adapters: what the adapters can reach
};
// Runs the job, printing to `out` (a progress bar when `tty`); throws qmm::Error on bad options or files.
FinetuneResult finetune(const FinetuneOptions& opts, std::ostream& out, bool tty = false);
// The command: 0 when the final loss fell below the start loss, 1 otherwise. With opts.gpus > 1 in a process
// that is not yet a rank, starts and supervises the ranks (this program again, `argv`) and returns 0 when all
// succeed; inside a rank (QMM_RANK / QMM_WORLD_SIZE set) it trains its share of each batch.
int run_finetune(const FinetuneOptions& opts, const std::vector<std::string>& argv);

}  // namespace qmm::tool
