// Communicator: NCCL all-reduce between one process per GPU (built when CMake finds NCCL: QMM_WITH_NCCL).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/validate.h"
#include "qmm/dist.h"
#include "qmm/error.h"

#if defined(QMM_WITH_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace qmm {

namespace {

// Unused where NCCL is absent (every failure it reports is an NCCL one).
[[noreturn, maybe_unused]] void fail(const std::string& what) {
  throw Error(ErrorCode::Distributed, "Communicator: " + what);
}

// FNV-1a over the bytes of the tensors, copied to the host (one wait for all the copies).
std::uint64_t hash_tensors(const Context& ctx, const std::vector<TensorView>& tensors) {
  std::vector<Tensor> host;
  for (const TensorView& t : tensors) {
    host.emplace_back(t.dtype(), t.shape());
    copy(ctx, host.back(), t);
  }
  ctx.synchronize();
  std::uint64_t h = 1469598103934665603ull;
  for (const Tensor& t : host) {
    const auto* p = static_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

}  // namespace

struct Communicator::Impl {
  Context ctx;
  int rank = 0;
  int world = 1;
#if defined(QMM_WITH_NCCL)
  ncclComm_t comm = nullptr;
  cudaStream_t stream() const { return static_cast<cudaStream_t>(ctx.stream()); }
  void check(ncclResult_t r, const char* what) const {
    if (r != ncclSuccess) fail(std::string(what) + " failed: " + ncclGetErrorString(r));
  }
#endif
};

bool Communicator::available() {
#if defined(QMM_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

Communicator::Communicator(const Context& ctx, int rank, int world_size, const std::string& rendezvous,
                           double timeout_s)
    : impl_(std::make_unique<Impl>(Impl{ctx, rank, world_size})) {
  const char* op = "Communicator";
  QMM_REQUIRE(world_size >= 1, ErrorCode::InvalidArgument, op, "world_size " + std::to_string(world_size) + " < 1");
  QMM_REQUIRE(rank >= 0 && rank < world_size, ErrorCode::InvalidArgument, op,
              "rank " + std::to_string(rank) + " is not in [0, " + std::to_string(world_size) + ")");
  if (!ctx.device().is_cuda()) {
    QMM_REQUIRE(world_size == 1, ErrorCode::Unsupported, op, "a CPU context takes world size 1 only");
    return;
  }
#if !defined(QMM_WITH_NCCL)
  (void)rendezvous;
  (void)timeout_s;
  throw Error(ErrorCode::Unsupported, "Communicator: this build has no NCCL (CMake did not find nccl.h and libnccl)");
#else
  QMM_REQUIRE(world_size == 1 || !rendezvous.empty(), ErrorCode::InvalidArgument, op,
              "rendezvous: a file path shared by the ranks is needed for world size > 1");
  ncclUniqueId id{};
  if (rank == 0) {
    impl_->check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if (world_size > 1) {
      const std::string tmp = rendezvous + ".tmp";
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(id.internal, sizeof id.internal);
      f.close();
      if (!f || std::rename(tmp.c_str(), rendezvous.c_str()) != 0) fail("cannot write the rendezvous file " + rendezvous);
    }
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      std::ifstream f(rendezvous, std::ios::binary);
      if (f && f.read(id.internal, sizeof id.internal)) break;
      if (std::chrono::steady_clock::now() > deadline)
        fail("rank " + std::to_string(rank) + " waited " + std::to_string(timeout_s) + " s for rank 0's id in " +
             rendezvous);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (cudaSetDevice(ctx.device().index) != cudaSuccess) fail("cannot select " + ctx.device().str());
  impl_->check(ncclCommInitRank(&impl_->comm, world_size, id, rank), "ncclCommInitRank");
#endif
}

Communicator::~Communicator() {
#if defined(QMM_WITH_NCCL)
  if (impl_ && impl_->comm) ncclCommDestroy(impl_->comm);
#endif
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::world_size() const { return impl_->world; }
const Context& Communicator::context() const { return impl_->ctx; }

void Communicator::all_reduce_mean(const std::vector<TensorView>& tensors) {
  const char* op = "Communicator::all_reduce_mean";
  for (const TensorView& t : tensors) {
    QMM_REQUIRE(t.dtype() == DType::F32, ErrorCode::DTypeMismatch, op, "tensors must be f32");
    QMM_REQUIRE(t.device() == impl_->ctx.device(), ErrorCode::DeviceMismatch, op,
                "a tensor is on " + t.device().str() + ", the communicator on " + impl_->ctx.device().str());
  }
#if defined(QMM_WITH_NCCL)
  if (!impl_->comm) return;  // a CPU context of world size 1: the mean is the tensor itself
  impl_->check(ncclGroupStart(), "ncclGroupStart");
  for (const TensorView& t : tensors)
    impl_->check(ncclAllReduce(t.data(), t.data(), static_cast<std::size_t>(t.numel()), ncclFloat, ncclAvg,
                               impl_->comm, impl_->stream()),
                 "ncclAllReduce");
  impl_->check(ncclGroupEnd(), "ncclGroupEnd");
#endif
}

bool Communicator::same_on_all_ranks(const std::vector<TensorView>& tensors) {
  const std::uint64_t h = hash_tensors(impl_->ctx, tensors);
#if defined(QMM_WITH_NCCL)
  if (!impl_->comm) return true;
  // [min, max] of the hash over the ranks, in a small device buffer.
  std::uint64_t* buf = nullptr;
  if (cudaMalloc(&buf, 2 * sizeof(std::uint64_t)) != cudaSuccess) fail("cudaMalloc of 16 bytes failed");
  const std::uint64_t pair[2] = {h, h};
  std::uint64_t got[2] = {0, 0};
  bool ok = cudaMemcpyAsync(buf, pair, sizeof pair, cudaMemcpyHostToDevice, impl_->stream()) == cudaSuccess;
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) r = ncclAllReduce(buf, buf, 1, ncclUint64, ncclMin, impl_->comm, impl_->stream());
  if (r == ncclSuccess) r = ncclAllReduce(buf + 1, buf + 1, 1, ncclUint64, ncclMax, impl_->comm, impl_->stream());
  const ncclResult_t end = ncclGroupEnd();
  ok = ok && cudaMemcpyAsync(got, buf, sizeof got, cudaMemcpyDeviceToHost, impl_->stream()) == cudaSuccess &&
       cudaStreamSynchronize(impl_->stream()) == cudaSuccess;
  cudaFree(buf);
  impl_->check(r, "ncclAllReduce");
  impl_->check(end, "ncclGroupEnd");
  if (!ok) fail("copying the hashes failed");
  return got[0] == got[1];
#else
  (void)h;
  return true;
#endif
}

}  // namespace qmm
