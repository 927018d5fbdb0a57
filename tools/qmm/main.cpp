// qmm: the command-line front end (check, bench).
#include <CLI/CLI.hpp>
#include <iostream>

#include "commands.h"
#include "qmm/qmm.h"

int main(int argc, char** argv) {
  CLI::App app{"qmm: the matmul core of LoRA and QLoRA fine-tuning (dense GEMM, SwiGLU, NF4)"};
  app.require_subcommand(1);

  qmm::tool::CheckOptions check;
  auto* check_cmd = app.add_subcommand("check", "Run every op on every available device against the CPU oracle");
  check_cmd->add_flag("--cpu-only", check.cpu_only, "Check the CPU backend only, even where a GPU is present");
  check_cmd->add_flag("--quick", check.quick, "Smaller sizes");

  qmm::tool::BenchOptions bench;
  auto* bench_cmd = app.add_subcommand("bench", "Time every op at the model shapes against the roofline");
  bench_cmd->add_option("--op", bench.ops, "Only these ops (repeatable)");
  bench_cmd->add_option("--shape", bench.shapes, "Only shapes whose label contains this text (repeatable)");
  bench_cmd->add_option("--json", bench.json_path, "Write the results as JSON to this file");
  bench_cmd->add_option("--repeats", bench.repeats, "Timed repetitions per case")->check(CLI::Range(1, 100000));
  bench_cmd->add_flag("--cpu", bench.cpu, "Benchmark the CPU backend even where a GPU is present");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*check_cmd) return qmm::tool::run_check(check);
    if (*bench_cmd) return qmm::tool::run_bench(bench);
  } catch (const qmm::Error& e) {
    std::cerr << "qmm: error (" << qmm::error_code_name(e.code()) << "): " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "qmm: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
