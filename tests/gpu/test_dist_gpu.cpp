// Data parallelism on one GPU: the NCCL path at world size 1 must give exactly the single-process results.
#include <cstring>
#include <optional>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

struct Trained {
  std::vector<Tensor> adapters;  // host copies of every fp32 master
};

// Three AdamW steps of a small SwiGLU MLP with LoRA on NF4 bases, with or without a world-size-1 communicator.
Trained train(bool with_comm) {
  Context& gpu = *test::gpu_context();
  const Context cpu = Context::cpu();
  const std::int64_t h = 128, i = 320, m = 96;
  auto nf4 = [&](Shape s, std::uint64_t seed) {
    Nf4Tensor w = nf4_quantize(cpu, test::random_tensor(DType::BF16, s, seed, -0.05f, 0.05f), true);
    Nf4Tensor d = w;
    d.codes = to_device(w.codes, gpu.device());
    d.absmax = to_device(w.absmax, gpu.device());
    d.absmax2 = to_device(w.absmax2, gpu.device());
    d.code2 = to_device(w.code2, gpu.device());
    return d;
  };
  const Nf4Tensor g = nf4({i, h}, 1), u = nf4({i, h}, 2), d = nf4({h, i}, 3);
  LoraConfig cfg;
  cfg.rank = 8;
  cfg.alpha = 16.0f;
  cfg.activations = DType::BF16;
  cfg.seed = 7;
  SwiGluMlp mlp(gpu, BaseWeight(g), BaseWeight(u), BaseWeight(d), cfg);
  AdamWOptions o;
  o.lr = 1e-2f;
  AdamW opt(gpu, o);
  opt.add(mlp);
  std::optional<Communicator> comm;
  if (with_comm) {
    comm.emplace(gpu, 0, 1);
    opt.all_reduce_with(&*comm);
  }
  const Tensor x = to_device(test::random_tensor(DType::BF16, {m, h}, 11), gpu.device());
  const Tensor dy = to_device(test::random_tensor(DType::BF16, {m, h}, 12), gpu.device());
  const Tensor y(DType::BF16, {m, h}, gpu.device()), dx(DType::BF16, {m, h}, gpu.device());
  for (int step = 0; step < 3; ++step) {
    mlp.forward(x, y);
    mlp.backward(x, dy, dx);
    opt.step();
    opt.zero_grad();
  }
  if (comm) EXPECT_TRUE(comm->same_on_all_ranks({mlp.gate().parameters()[0].param}));
  Trained t;
  for (const AdamWParam& p : mlp.parameters()) t.adapters.push_back(test::host_copy(p.param));
  return t;
}

TEST(DistGpu, NcclAtWorldSizeOneIsBitIdenticalToOneProcess) {
  QMM_REQUIRE_GPU();
  if (!Communicator::available()) GTEST_SKIP() << "built without NCCL";
  const Trained plain = train(false), nccl = train(true);
  ASSERT_EQ(plain.adapters.size(), nccl.adapters.size());
  for (std::size_t k = 0; k < plain.adapters.size(); ++k)
    EXPECT_EQ(std::memcmp(plain.adapters[k].data(), nccl.adapters[k].data(), plain.adapters[k].nbytes()), 0) << k;
}

TEST(DistGpu, BadArgumentsAreRefused) {
  QMM_REQUIRE_GPU();
  Context& gpu = *test::gpu_context();
  EXPECT_TRUE(test::throws_error([&] { Communicator c(gpu, 2, 2, "/tmp/x"); }, ErrorCode::InvalidArgument,
                                 {"rank 2"}));
  if (!Communicator::available()) return;
  EXPECT_TRUE(test::throws_error([&] { Communicator c(gpu, 0, 2); }, ErrorCode::InvalidArgument, {"rendezvous"}));
  // A rank that waits for an id nobody writes gives up with the path in the message.
  EXPECT_TRUE(test::throws_error([&] { Communicator c(gpu, 1, 2, "/tmp/qmm-no-such-rendezvous", 0.2); },
                                 ErrorCode::Distributed, {"waited", "qmm-no-such-rendezvous"}));
}

}  // namespace
}  // namespace qmm
