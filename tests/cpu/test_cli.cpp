// The qmm command's handling of bad arguments (tools/qmm/main.cpp, bench/bench.cpp): each is refused with exit
// code 2 and a message that names the problem, before any work is done.
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <regex>
#include <sstream>
#include <string>

#include "common/test_util.h"

namespace qmm {
namespace {

struct Outcome {
  int code = -1;       // exit status; -1 when killed by a signal
  std::string output;  // stdout and stderr together
  double seconds = 0;
};

// Runs the built qmm with `args` (shell words).
Outcome qmm(const std::string& args) {
  const std::string cmd = std::string("'") + QMM_TOOL_PATH + "' " + args + " 2>&1 </dev/null";
  const auto t0 = std::chrono::steady_clock::now();
  std::FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return {};
  Outcome r;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// qmm `args` exits 2 at once, its message containing each of `mentions`, with no benchmark or training started.
void expect_refused(const std::string& args, std::initializer_list<std::string> mentions) {
  SCOPED_TRACE("qmm " + args);
  const Outcome r = qmm(args);
  EXPECT_EQ(r.code, 2) << r.output;
  for (const std::string& m : mentions) EXPECT_NE(r.output.find(m), std::string::npos) << "no \"" << m << "\" in:\n" << r.output;
  EXPECT_EQ(r.output.find("qmm bench on"), std::string::npos) << "the benchmark started:\n" << r.output;
  EXPECT_EQ(r.output.find("qmm finetune:"), std::string::npos) << "the fine-tune started:\n" << r.output;
  EXPECT_LT(r.seconds, 1.0);
  // Bounds are printed readably (CLI::PositiveNumber printed DBL_MAX in full, 309 digits).
  EXPECT_FALSE(std::regex_search(r.output, std::regex("[0-9]{21}"))) << r.output;
}

std::string temp_path(const std::string& name) {
  const std::string p = ::testing::TempDir() + name;
  std::filesystem::remove_all(p);
  return p;
}

TEST(Cli, UnknownSubcommandIsNamedWithTheValidOnes) {
  expect_refused("nosuchcmd", {"unknown subcommand 'nosuchcmd'", "check", "bench", "finetune"});
  expect_refused("", {"a subcommand is required", "check, bench, finetune"});
  expect_refused("--bogus", {"unknown option '--bogus'", "check, bench, finetune"});
}

TEST(Cli, HelpStillExitsZero) {
  const Outcome r = qmm("bench --help");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("--json"), std::string::npos) << r.output;
}

TEST(Cli, BenchOpThatNamesNoOp) {
  expect_refused("bench --cpu --op nosuchop", {"--op 'nosuchop' names no op", "gemm_bt", "nf4_gemm", "mlp_block"});
  // One bad name among good ones is still refused.
  expect_refused("bench --cpu --op swiglu --op swigl", {"'swigl'"});
  // An op that has no cases on the CPU backend would print empty tables too.
  expect_refused("bench --cpu --op batched_qk", {"'batched_qk' runs on a GPU only", "swiglu"});
}

TEST(Cli, BenchShapeThatMatchesNothing) {
  expect_refused("bench --cpu --shape 0x0", {"--shape '0x0' matches no shape", "qwen2.5-1.5b gate_up", "tiny mlp"});
  // It must match a shape of the selected ops, not of any op.
  expect_refused("bench --cpu --op swiglu --shape qwen", {"--shape 'qwen' matches no shape of swiglu", "shapes: 1M"});
  // nf4_gate_up runs on the gate_up projections only.
  expect_refused("bench --cpu --op nf4_gate_up --shape down", {"'down' matches no shape of nf4_gate_up"});
}

TEST(Cli, BenchJsonPathIsCheckedBeforeTheRun) {
  // This run would otherwise take a fraction of a second; the check must come first, not after it.
  const std::string missing = temp_path("qmm_cli_no_dir") + "/x.json";
  expect_refused("bench --cpu --op swiglu --shape 1M --repeats 1 --json '" + missing + "'",
                 {"cannot write --json " + missing, "No such file or directory"});
  const std::string dir = temp_path("qmm_cli_dir");
  std::filesystem::create_directories(dir);
  expect_refused("bench --cpu --op swiglu --shape 1M --repeats 1 --json '" + dir + "'", {dir, "is a directory"});
  expect_refused("bench --cpu --op swiglu --json ''", {"--json", "path is empty"});
}

TEST(Cli, BenchStillRunsAndWritesJson) {
  const std::string json = temp_path("qmm_cli_bench.json");
  const Outcome r = qmm("bench --cpu --op swiglu --shape 1M --repeats 1 --json '" + json + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("swiglu "), std::string::npos) << r.output;
  std::ifstream f(json);
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_NE(text.str().find("\"op\": \"swiglu\""), std::string::npos) << text.str();
}

TEST(Cli, FinetuneSeedIsRangeChecked) {
  // Both wrapped (-1) or clamped (2^64) silently before.
  expect_refused("finetune --cpu --seed -1", {"--seed: must be an integer from 0 to 18446744073709551615", "'-1'"});
  expect_refused("finetune --cpu --seed 18446744073709551616", {"--seed", "'18446744073709551616'"});
  expect_refused("finetune --cpu --seed 0x10", {"--seed", "'0x10'"});
}

TEST(Cli, FinetuneLearningRateMustBePositiveAndFinite) {
  for (const char* lr : {"-1", "0", "nan", "inf", "-inf", "abc"})
    expect_refused(std::string("finetune --cpu --lr ") + lr,
                   {"--lr: must be a positive finite number, got '" + std::string(lr) + "'"});
  // Positive, but 0 or infinite as a float.
  expect_refused("finetune --cpu --lr 1e-50", {"--lr", "outside the range of a float"});
  expect_refused("finetune --cpu --lr 1e50", {"--lr", "outside the range of a float"});
}

TEST(Cli, FinetuneEmptyPathIsNotTheEmbeddedModel) {
  expect_refused("finetune --cpu ''", {"path is empty"});
}

TEST(Cli, IntegerOptionsNameTheirRange) {
  struct Case {
    const char* args;
    const char* says;
  };
  const Case cases[] = {
      {"finetune --cpu --steps 0", "--steps: must be an integer from 1 to 1000000, got '0'"},
      {"finetune --cpu --steps 2147483648", "--steps: must be an integer from 1 to 1000000"},
      {"finetune --cpu --tokens 99999999999999999999", "--tokens: must be an integer from 1 to 16777216"},
      {"finetune --cpu --hidden 0", "--hidden: must be an integer from 1 to 1048576"},
      {"finetune --cpu --intermediate -1", "--intermediate: must be an integer from 1 to 1048576, got '-1'"},
      {"finetune --cpu --rank 4097", "--rank: must be an integer from 1 to 4096"},
      {"finetune --cpu --log-every 0", "--log-every: must be an integer from 1 to 1000000"},
      {"finetune --cpu --gpus 65", "--gpus: must be an integer from 1 to 64"},
      {"finetune --cpu --gpus 0x2", "--gpus: must be an integer from 1 to 64, got '0x2'"},  // hex was read as 2
      {"bench --cpu --repeats 0", "--repeats: must be an integer from 1 to 100000"},
      {"bench --cpu --hold-ms -1", "--hold-ms: must be an integer from 0 to 60000"},
      {"bench --cpu --tokens 16777217", "--tokens: must be an integer from 1 to 16777216"},
  };
  for (const Case& c : cases) expect_refused(c.args, {c.says});
}

TEST(Cli, IntegersAreDecimal) {
  // CLI11 alone reads "010" as octal 8; the header echoes the seed the run uses.
  const Outcome r = qmm("finetune --cpu --steps 1 --hidden 8 --intermediate 16 --tokens 4 --rank 2 --seed 010");
  EXPECT_NE(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("seed 10\n"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace qmm
