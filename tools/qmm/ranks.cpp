// One process per rank, supervised: fork + exec, poll for exits, stop the others on the first failure.
#include "ranks.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "qmm/error.h"

namespace qmm::tool {
namespace {

constexpr auto kPoll = std::chrono::milliseconds(20);

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "ended with status " + std::to_string(status);
}

// In the child: the rank's environment, death with the supervisor, then the program. Only async-signal-safe
// calls would be strictly allowed after fork in a threaded parent; setenv is used before exec as every launcher
// does, and _exit(127) reports an exec failure (the shell's convention).
[[noreturn]] void exec_rank(const std::vector<std::string>& argv, int rank, int world, pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(126);  // the supervisor died before prctl took effect
  setenv("QMM_RANK", std::to_string(rank).c_str(), 1);
  setenv("QMM_WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execvp(args[0], args.data());
  _exit(127);
}

}  // namespace

void run_ranks(const std::vector<std::string>& argv, int world, int grace_ms) {
  const char* op = "run_ranks";
  if (argv.empty() || argv[0].empty()) throw Error(ErrorCode::InvalidArgument, std::string(op) + ": empty command");
  if (world < 1) throw Error(ErrorCode::InvalidArgument, std::string(op) + ": world size " + std::to_string(world) + " < 1");

  struct Rank {
    pid_t pid = -1;
    bool done = false;
  };
  std::vector<Rank> ranks(static_cast<std::size_t>(world));
  const pid_t self = getpid();
  int first_failed = -1;
  std::string failure;
  auto stop_all = [&](int sig) {
    for (const Rank& r : ranks)
      if (r.pid > 0 && !r.done) kill(r.pid, sig);
  };
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) exec_rank(argv, r, world, self);
    if (pid < 0) {
      first_failed = r;
      failure = std::string("could not be started: ") + std::strerror(errno);
      break;
    }
    ranks[static_cast<std::size_t>(r)].pid = pid;
  }

  auto reap = [&]() {  // collects exits; records the first failure
    bool any_live = false;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      Rank& rk = ranks[r];
      if (rk.pid <= 0 || rk.done) continue;
      int status = 0;
      const pid_t got = waitpid(rk.pid, &status, WNOHANG);
      if (got == 0) {
        any_live = true;
        continue;
      }
      rk.done = true;
      const bool ok = got == rk.pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && first_failed < 0) {
        first_failed = static_cast<int>(r);
        failure = got == rk.pid ? describe(status) : std::string("could not be waited for: ") + std::strerror(errno);
      }
    }
    return any_live;
  };

  if (first_failed >= 0) stop_all(SIGTERM);
  while (reap() && first_failed < 0) std::this_thread::sleep_for(kPoll);
  if (first_failed >= 0) {
    stop_all(SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
    while (reap() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(kPoll);
    stop_all(SIGKILL);
    while (reap()) std::this_thread::sleep_for(kPoll);
    throw Error(ErrorCode::Distributed, "rank " + std::to_string(first_failed) + " of " + std::to_string(world) +
                                            " (" + argv[0] + ") " + failure + "; the other ranks were stopped");
  }
}

RankEnv rank_env() {
  auto read = [](const char* name, int fallback) {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (*end != '\0' || x < 0 || x > 1 << 20)
      throw Error(ErrorCode::InvalidArgument, std::string("rank_env: ") + name + "=\"" + v + "\" is not a count");
    return static_cast<int>(x);
  };
  RankEnv e;
  e.rank = read("QMM_RANK", 0);
  e.world = read("QMM_WORLD_SIZE", 1);
  if (e.world < 1 || e.rank >= e.world)
    throw Error(ErrorCode::InvalidArgument, "rank_env: QMM_RANK " + std::to_string(e.rank) + " is not below QMM_WORLD_SIZE " +
                                                std::to_string(e.world));
  return e;
}

}  // namespace qmm::tool
