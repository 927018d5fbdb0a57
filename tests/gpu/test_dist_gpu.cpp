// Data parallelism: the NCCL path at world size 1 must give exactly the single-process results; with two or more
// GPUs, N ranks (threads here, one GPU each) on shards of a batch must reach the adapters one GPU reaches on the
// whole batch, within fp32 reduction-order tolerance.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

struct Trained {
  std::vector<Tensor> adapters;  // host copies of every fp32 master
};

// Three AdamW steps of a small SwiGLU MLP with LoRA on NF4 bases on `gpu`, with or without a communicator. The
// batch is rows [row0, row0 + m) of one fixed 96-row batch; dy is scaled by dy_scale (a rank of N takes N times
// its shard's dy, so that the mean over the ranks of their gradients is the whole batch's gradient).
Trained train(const Context& gpu, Communicator* comm, std::int64_t row0 = 0, std::int64_t m = 96,
              float dy_scale = 1.0f) {
  const Context cpu = Context::cpu();
  const std::int64_t h = 128, i = 320, batch = 96;
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
  if (comm) opt.all_reduce_with(comm);
  // The shard of the fixed batch (bf16 times a power of two is exact).
  auto shard = [&](std::uint64_t seed, float scale) {
    const Tensor all = test::random_tensor(DType::BF16, {batch, h}, seed);
    Tensor part(DType::BF16, {m, h}, cpu.device());
    const std::uint16_t* from = all.data_as<std::uint16_t>() + row0 * h;
    for (std::int64_t e = 0; e < m * h; ++e)
      part.data_as<std::uint16_t>()[e] = float_to_bf16(bf16_to_float(from[e]) * scale);
    return to_device(part, gpu.device());
  };
  const Tensor x = shard(11, 1.0f), dy = shard(12, dy_scale);
  const Tensor y(DType::BF16, {m, h}, gpu.device()), dx(DType::BF16, {m, h}, gpu.device());
  for (int step = 0; step < 3; ++step) {
    mlp.forward(x, y);
    mlp.backward(x, dy, dx);
    opt.step();
    opt.zero_grad();
  }
  if (comm) {
    std::vector<TensorView> all;
    for (const AdamWParam& p : mlp.parameters()) all.push_back(p.param);
    EXPECT_TRUE(comm->same_on_all_ranks(all));
  }
  Trained t;
  for (const AdamWParam& p : mlp.parameters()) t.adapters.push_back(test::host_copy(p.param));
  return t;
}

TEST(DistGpu, NcclAtWorldSizeOneIsBitIdenticalToOneProcess) {
  QMM_REQUIRE_GPU();
  if (!Communicator::available()) GTEST_SKIP() << "built without NCCL";
  Context& gpu = *test::gpu_context();
  Communicator comm(gpu, 0, 1);
  const Trained plain = train(gpu, nullptr), nccl = train(gpu, &comm);
  ASSERT_EQ(plain.adapters.size(), nccl.adapters.size());
  for (std::size_t k = 0; k < plain.adapters.size(); ++k)
    EXPECT_EQ(std::memcmp(plain.adapters[k].data(), nccl.adapters[k].data(), plain.adapters[k].nbytes()), 0) << k;
}

// Tolerance of N ranks against one GPU after 3 AdamW steps: the ranks' GEMMs see fewer rows (other cuBLASLt
// algorithms, other fp32 summation orders, an occasional bf16 activation one ulp apart) and the gradient mean is
// summed in another order; AdamW's first steps move each weight by about lr whatever the gradient's size, so a
// gradient that changes sign near zero can move one element by up to 2 lr. Bound: 2 lr + 1e-4 per element, and
// the adapters' relative Frobenius difference below 1e-2.
TEST(DistGpu, NRanksMatchOneGpuOnTheSameGlobalBatch) {
  QMM_REQUIRE_GPU();
  if (!Communicator::available()) GTEST_SKIP() << "built without NCCL";
  const int world = Context::cuda_device_count();
  if (world < 2) GTEST_SKIP() << "needs two or more GPUs (this machine has " << world << ")";
  const std::int64_t batch = 96;
  int n = std::min(world, 8);
  while (batch % n != 0) --n;  // the most GPUs that split the batch evenly (2, 3, 4, 6 or 8)
  const std::int64_t rows = batch / n;
  const Trained one = train(*test::gpu_context(), nullptr);

  const std::string rendezvous = "/tmp/qmm-test-dist-" + std::to_string(::getpid());
  std::vector<Trained> ranks(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        const Context ctx = Context::cuda(r);
        Communicator comm(ctx, r, n, rendezvous, 60.0);
        ranks[r] = train(ctx, &comm, r * rows, rows, static_cast<float>(n));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  std::remove(rendezvous.c_str());
  for (int r = 0; r < n; ++r)
    if (errors[r]) {
      try {
        std::rethrow_exception(errors[r]);
      } catch (const std::exception& e) {
        FAIL() << "rank " << r << ": " << e.what();
      }
    }
  const double lr = 1e-2;
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(ranks[r].adapters.size(), one.adapters.size());
    for (std::size_t k = 0; k < one.adapters.size(); ++k)
      EXPECT_TRUE(test::all_close(ranks[r].adapters[k], one.adapters[k], {2 * lr + 1e-4, 0.0, 1e-2}))
          << "rank " << r << " adapter " << k;
  }
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
