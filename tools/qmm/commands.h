// The qmm tool's subcommands. Each returns the process exit code.
#pragma once

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
  std::string json_path;
  int repeats = 50;
  bool cpu = false;  // force the CPU backend
};
int run_bench(const BenchOptions& opts);

}  // namespace qmm::tool
