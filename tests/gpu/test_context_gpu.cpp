// The CUDA context: creation, device memory, copies both ways.
#include "common/test_util.h"

namespace qmm {
namespace {

TEST(GpuContext, CreatesAndCopiesRoundTrip) {
  QMM_REQUIRE_GPU();
  Context& ctx = *test::gpu_context();
  EXPECT_TRUE(ctx.device().is_cuda());
  EXPECT_FALSE(ctx.device_name().empty());
  Tensor h = test::random_tensor(DType::BF16, {1000, 7}, 3);
  Tensor d = to_device(h, ctx.device());
  Tensor back = test::host_copy(d);
  EXPECT_TRUE(test::bytes_equal(back, h));
}

TEST(GpuContext, BadDeviceIndexRaisesNoDevice) {
  QMM_REQUIRE_GPU();
  EXPECT_TRUE(test::throws_error([] { Context::cuda(1000); }, ErrorCode::NoDevice, {"device 1000"}));
}

}  // namespace
}  // namespace qmm
