// qmm: the command-line front end (check, bench, finetune).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "commands.h"
#include "qmm/qmm.h"

namespace {

// CLI11 reads integers with strtoll/strtoull in base 0: "010" is 8, "0x10" 16, "-1" wraps an unsigned option and a
// value past 64 bits clamps. This reads decimal only, rejects values outside [lo, hi] naming the bounds, and hands
// CLI11 the canonical decimal text.
template <class T>
CLI::Validator integer_in(T lo, T hi) {
  const std::string range = "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        T value{};
        const char* end = s.data() + s.size();
        const auto [ptr, ec] = std::from_chars(s.data(), end, value);
        if (ec != std::errc() || ptr != end || value < lo || value > hi) return "must be " + range + ", got '" + s + "'";
        s = std::to_string(value);
        return {};
      },
      std::string(std::is_signed_v<T> ? "INT" : "UINT") + " in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

// CLI::PositiveNumber prints its bounds as 300-digit doubles and passes nan, inf and values that round to 0 as a
// float.
CLI::Validator positive_finite_float() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        float value = 0;
        const char* end = s.data() + s.size();
        const auto [ptr, ec] = std::from_chars(s.data(), end, value);
        if (ec == std::errc::result_out_of_range && ptr == end)
          return "'" + s + "' is outside the range of a float (about 1.2e-38 to 3.4e38)";
        if (ec != std::errc() || ptr != end || !std::isfinite(value) || !(value > 0))
          return "must be a positive finite number, got '" + s + "'";
        return {};
      },
      "POSITIVE");
}

// An empty path given explicitly is a mistake (an unset variable in a script), not a request for the default.
CLI::Validator non_empty_path() {
  return CLI::Validator([](std::string& s) { return s.empty() ? std::string("the path is empty") : std::string(); }, "");
}

// CLI11 reports a mistyped subcommand ("qmm chek") or a stray option before one as a missing subcommand; say
// what was wrong and name the subcommands.
bool report_missing_subcommand(const CLI::App& app) {
  if (!app.get_subcommands().empty()) return false;
  std::string valid;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    valid += (valid.empty() ? "" : ", ") + sub->get_name();
  const std::vector<std::string> rest = app.remaining();
  const auto word = std::find_if(rest.begin(), rest.end(), [](const std::string& a) { return a.empty() || a[0] != '-'; });
  if (word != rest.end()) std::cerr << "qmm: unknown subcommand '" << *word << "'";
  else if (!rest.empty()) std::cerr << "qmm: unknown option '" << rest[0] << "' before the subcommand";
  else std::cerr << "qmm: a subcommand is required";
  std::cerr << " (valid: " << valid << "; see qmm --help)\n";
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qmm: the matmul core of LoRA and QLoRA fine-tuning (dense GEMM, SwiGLU, NF4)"};
  app.require_subcommand(1);

  qmm::tool::CheckOptions check;
  auto* check_cmd = app.add_subcommand("check", "Run every op on every available device against the CPU oracle");
  check_cmd->add_flag("--cpu-only", check.cpu_only, "Check the CPU backend only, even where a GPU is present");
  check_cmd->add_flag("--quick", check.quick, "Smaller sizes");

  using std::int64_t;
  qmm::tool::BenchOptions bench;
  auto* bench_cmd = app.add_subcommand("bench", "Time every op at the model shapes against the roofline");
  bench_cmd->add_option("--op", bench.ops, "Only these ops (repeatable)");
  bench_cmd->add_option("--shape", bench.shapes, "Only shapes whose label contains this text (repeatable)");
  bench_cmd->add_option("--tokens", bench.tokens, "Token counts M to run instead of each op's built-in list (repeatable)")
      ->transform(integer_in<int64_t>(1, int64_t{1} << 24));
  bench_cmd->add_option("--json", bench.json_path, "Write the results as JSON to this file")
      ->check(non_empty_path());
  bench_cmd->add_option("--repeats", bench.repeats, "Timed repetitions per case (the CPU backend runs at most 3)")
      ->capture_default_str()
      ->transform(integer_in(1, 100000));
  bench_cmd->add_option("--hold-ms", bench.hold_ms,
                        "Replay each GPU case back to back this long before timing it, so that it is timed at the "
                        "clocks of sustained load (the power limit) rather than those of a short burst")
      ->transform(integer_in(0, 60000));
  bench_cmd->add_flag("--cpu", bench.cpu, "Benchmark the CPU backend even where a GPU is present");
  bench_cmd->add_flag("--explain", bench.explain,
                      "Print each NF4 case's plan (kernel, tiles, split-K, why) under its row; on the CPU backend, "
                      "the plan the local GPU would get, or that there is none");

  qmm::tool::FinetuneOptions ft;
  auto* ft_cmd = app.add_subcommand("finetune", "Train QLoRA adapters on a frozen NF4 base (an embedded model, or "
                                                "the base weights of a safetensors file)");
  ft_cmd->add_option("path", ft.path, "safetensors file: a bitsandbytes 4-bit layer, an MLP (gate/up/down_proj) "
                                      "or one 2-D weight; none: the embedded model")
      ->check(non_empty_path());
  ft_cmd->add_option("--steps", ft.steps, "Optimizer steps (default: GPU 300, CPU 200)")
      ->transform(integer_in(1, 1000000));
  ft_cmd->add_option("--tokens", ft.tokens, "Tokens per step (default: GPU 2048, CPU 64)")
      ->transform(integer_in<int64_t>(1, int64_t{1} << 24));
  ft_cmd->add_option("--hidden", ft.hidden, "Embedded MLP hidden size (default: GPU 1024, CPU 128)")
      ->transform(integer_in<int64_t>(1, int64_t{1} << 20));
  ft_cmd->add_option("--intermediate", ft.intermediate, "Embedded MLP intermediate size (default: GPU 2816, CPU 352)")
      ->transform(integer_in<int64_t>(1, int64_t{1} << 20));
  ft_cmd->add_option("--rank", ft.rank, "LoRA rank (alpha = 2 rank)")
      ->capture_default_str()
      ->transform(integer_in(1, 4096));
  ft_cmd->add_option("--lr", ft.lr, "AdamW peak learning rate")->capture_default_str()->check(positive_finite_float());
  ft_cmd->add_option("--seed", ft.seed, "Seed of the weights, the hidden change, the data and the adapters")
      ->capture_default_str()
      ->transform(integer_in<std::uint64_t>(0, std::numeric_limits<std::uint64_t>::max()));
  ft_cmd->add_flag("--cpu", ft.cpu, "Use the CPU backend even where a GPU is present");
  ft_cmd->add_option("--log-every", ft.log_every, "Steps between loss read-backs (each one waits for the device)")
      ->capture_default_str()
      ->transform(integer_in(1, 1000000));
  ft_cmd->add_option("--gpus", ft.gpus, "Data parallel over this many GPUs: one process each, gradients averaged "
                                        "with NCCL; the batch (--tokens) is split evenly")
      ->capture_default_str()
      ->transform(integer_in(1, 64));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (dynamic_cast<const CLI::RequiredError*>(&e) && report_missing_subcommand(app)) return 2;
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;  // --help exits 0; every usage error exits 2, as the tool's other bad input does
  }
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
