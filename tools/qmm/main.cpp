// qmm: the command-line front end (check, bench, finetune).
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
  bench_cmd->add_option("--tokens", bench.tokens, "Token counts M to run instead of each op's built-in list (repeatable)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24));
  bench_cmd->add_option("--json", bench.json_path, "Write the results as JSON to this file");
  bench_cmd->add_option("--repeats", bench.repeats, "Timed repetitions per case")->check(CLI::Range(1, 100000));
  bench_cmd->add_option("--hold-ms", bench.hold_ms,
                        "Replay each GPU case back to back this long before timing it, so that it is timed at the "
                        "clocks of sustained load (the power limit) rather than those of a short burst")
      ->check(CLI::Range(0, 60000));
  bench_cmd->add_flag("--cpu", bench.cpu, "Benchmark the CPU backend even where a GPU is present");

  qmm::tool::FinetuneOptions ft;
  auto* ft_cmd = app.add_subcommand("finetune", "Train QLoRA adapters on a frozen NF4 base (an embedded model, or "
                                                "the base weights of a safetensors file)");
  ft_cmd->add_option("path", ft.path, "safetensors file: a bitsandbytes 4-bit layer, an MLP (gate/up/down_proj) "
                                      "or one 2-D weight; none: the embedded model");
  ft_cmd->add_option("--steps", ft.steps, "Optimizer steps (default: GPU 300, CPU 200)")->check(CLI::Range(1, 1000000));
  ft_cmd->add_option("--tokens", ft.tokens, "Tokens per step (default: GPU 2048, CPU 64)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24));
  ft_cmd->add_option("--hidden", ft.hidden, "Embedded MLP hidden size (default: GPU 1024, CPU 128)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  ft_cmd->add_option("--intermediate", ft.intermediate, "Embedded MLP intermediate size (default: GPU 2816, CPU 352)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  ft_cmd->add_option("--rank", ft.rank, "LoRA rank (alpha = 2 rank)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  ft_cmd->add_option("--lr", ft.lr, "AdamW peak learning rate")->capture_default_str()->check(CLI::PositiveNumber);
  ft_cmd->add_option("--seed", ft.seed, "Seed of the weights, the hidden change, the data and the adapters")
      ->capture_default_str();
  ft_cmd->add_flag("--cpu", ft.cpu, "Use the CPU backend even where a GPU is present");
  ft_cmd->add_option("--log-every", ft.log_every, "Steps between loss read-backs (each one waits for the device)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  ft_cmd->add_option("--gpus", ft.gpus, "Data parallel over this many GPUs: one process each, gradients averaged "
                                        "with NCCL; the batch (--tokens) is split evenly")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));

  CLI11_PARSE(app, argc, argv);
  try {
    if (*check_cmd) return qmm::tool::run_check(check);
    if (*bench_cmd) return qmm::tool::run_bench(bench);
    if (*ft_cmd) return qmm::tool::run_finetune(ft, std::vector<std::string>(argv, argv + argc));
  } catch (const qmm::Error& e) {
    std::cerr << "qmm: error (" << qmm::error_code_name(e.code()) << "): " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "qmm: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
