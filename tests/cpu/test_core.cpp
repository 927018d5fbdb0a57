// Core types: shapes, dtypes, scalar conversions, copies, contexts.
#include <cmath>
#include <cstring>

#include "common/test_util.h"

namespace qmm {
namespace {

TEST(Core, ShapeBasics) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s.str(), "[2,3,4]");
  EXPECT_TRUE(test::throws_error([] { Shape bad{1, 2, 3, 4, 5}; }, ErrorCode::InvalidArgument, {"rank 5"}));
  EXPECT_TRUE(test::throws_error([] { Shape bad{2, -1}; }, ErrorCode::InvalidArgument, {"negative"}));
}

TEST(Core, Bf16RoundingIsNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values: ties go to the even one (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3*2^-8 ties between 1+2^-7 (odd) and 1+2^-6 (even): goes up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(float_to_bf16_trunc(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
}

TEST(Core, Tf32Rounding) {
  const float x = 1.0f + std::ldexp(1.0f, -11);  // tie between 1 and 1+2^-10: to even (1.0)
  EXPECT_EQ(round_to_tf32(x), 1.0f);
  EXPECT_EQ(round_to_tf32(1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(round_to_tf32(0.1f), 0.0999755859375f);
}

TEST(Core, F16RoundTrip) {
  for (float v : {0.0f, 1.0f, -2.0f, 0.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f, 1000.5f}) {
    EXPECT_EQ(f16_to_float(float_to_f16(v)), v) << v;
  }
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie to even
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(1e6f))));
}

TEST(Core, HostTensorAndCopy) {
  Tensor a = test::random_tensor(DType::F32, {7, 5}, 1);
  Tensor b(DType::F32, {35});
  copy(b, a);
  EXPECT_TRUE(test::bytes_equal(b, Tensor(a)));
  Tensor c(DType::BF16, {35});
  EXPECT_TRUE(test::throws_error([&] { copy(c, a); }, ErrorCode::DTypeMismatch, {"copy"}));
  Tensor d(DType::F32, {36});
  EXPECT_TRUE(test::throws_error([&] { copy(d, a); }, ErrorCode::ShapeMismatch, {"copy"}));
}

TEST(Core, CpuContext) {
  Context ctx = Context::cpu();
  EXPECT_TRUE(ctx.device().is_cpu());
  EXPECT_EQ(ctx.device_name(), "cpu");
  ctx.synchronize();
  // The CPU backend keeps no device memory of its own.
  const MemoryStats m = ctx.memory_stats();
  EXPECT_EQ(m.fixed_bytes + m.scratch_reserved_bytes + m.scratch_reserved_peak_bytes + m.scratch_in_use_bytes +
                m.scratch_in_use_peak_bytes,
            0u);
  ctx.reset_peak_memory_stats();
  ctx.release_cached_memory();
}

TEST(Core, CudaContextWithoutGpuRaisesNoDevice) {
  if (Context::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present; the no-GPU path is not reachable here";
  EXPECT_TRUE(test::throws_error([] { Context::cuda(0); }, ErrorCode::NoDevice, {"Context::cuda"}));
  EXPECT_FALSE(Context::cuda_unavailable_reason().empty());
}

}  // namespace
}  // namespace qmm
