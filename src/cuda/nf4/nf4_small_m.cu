// Host side of the small-M NF4 GEMM: preconditions, split-K sizing, launches.
#include "cuda/nf4/nf4_small_m.h"

#include <algorithm>
#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/nf4/nf4_small_m.cuh"

namespace qmm::cuda {

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

int log2_exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

small_m::Scales scales_of(const Nf4Weight& w) {
  small_m::Scales sc{};
  if (w.double_quant()) {
    sc.q = w.absmax.data_as<std::uint8_t>();
    sc.absmax2 = w.absmax2.data_as<float>();
    sc.code2 = w.code2.data_as<float>();
    sc.offset = w.offset;
  } else {
    sc.absmax = w.absmax.data_as<float>();
  }
  sc.block_shift = log2_exact(w.block_size);
  return sc;
}

void launch_reduce(const Context& ctx, const float* partial, int splits, std::int64_t mn, const TensorView& c,
                   float alpha, float beta) {
  const int blocks = static_cast<int>(std::min<std::int64_t>((mn + 255) / 256, 8LL * state(ctx).sm_count()));
  small_m::nf4_split_k_reduce_kernel<<<blocks, 256, 0, stream_of(ctx)>>>(partial, splits, mn, c.data(),
                                                                        c.dtype() == DType::BF16, alpha, beta);
  QMM_CUDA_CHECK_LAUNCH("nf4_split_k_reduce_kernel");
}

template <int MT, bool kAF32>
void launch_tiles(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c, float alpha,
                  float beta) {
  using namespace small_m;
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w.rows;
  const int splits = static_cast<int>((K + kBlockK - 1) / kBlockK);
  const dim3 grid(static_cast<unsigned>((N + kBlockN - 1) / kBlockN), static_cast<unsigned>(splits));
  const int smem = kLutBytes + MT * 16 * kLdA * 2;
  auto kernel = nf4_gemm_small_m_kernel<MT, kAF32>;
  QMM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  const Scales sc = scales_of(w);
  const bool c_bf16 = c.dtype() == DType::BF16;
  cudaStream_t stream = stream_of(ctx);
  float* partial = nullptr;
  if (splits > 1)
    partial = static_cast<float*>(state(ctx).scratch_at_least(static_cast<std::size_t>(splits) * M * N * 4));
  kernel<<<grid, kThreads, smem, stream>>>(a.data(), M, N, K, w.codes.data_as<std::uint8_t>(), sc, partial,
                                           c.data(), c_bf16, alpha, beta);
  QMM_CUDA_CHECK_LAUNCH("nf4_gemm_small_m_kernel");
  if (splits > 1) launch_reduce(ctx, partial, splits, M * N, c, alpha, beta);
}

template <int MT8, bool kDcF32>
void launch_backward_tiles(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                           float alpha, float beta) {
  using namespace small_m;
  const std::int64_t M = dc.dim(0), N = dc.dim(1), K = w.cols;
  const std::int64_t k_blocks = (K + kBwdBlockK - 1) / kBwdBlockK;
  // Enough blocks for about four per SM; each warp then walks `groups` groups of 16 weight rows.
  const std::int64_t want_splits = std::max<std::int64_t>(1, 4LL * state(ctx).sm_count() / k_blocks);
  const std::int64_t rows_per_split = std::max<std::int64_t>(kBwdWarps * kBwdGroupN, (N + want_splits - 1) / want_splits);
  const int groups = static_cast<int>(std::min<std::int64_t>(8, (rows_per_split + kBwdWarps * kBwdGroupN - 1) /
                                                                    (kBwdWarps * kBwdGroupN)));
  const std::int64_t block_n = static_cast<std::int64_t>(kBwdWarps) * kBwdGroupN * groups;
  const int splits = static_cast<int>((N + block_n - 1) / block_n);
  const int ld_dc = static_cast<int>(block_n) + 8;
  const int smem = kLutBytes + ((MT8 * 8 * ld_dc * 2 + 15) / 16) * 16 + MT8 * 8 * kBwdBlockK * 4;
  auto kernel = nf4_gemm_backward_small_m_kernel<MT8, kDcF32>;
  QMM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  float* partial = nullptr;
  if (splits > 1)
    partial = static_cast<float*>(state(ctx).scratch_at_least(static_cast<std::size_t>(splits) * M * K * 4));
  const dim3 grid(static_cast<unsigned>(k_blocks), static_cast<unsigned>(splits));
  kernel<<<grid, kBwdThreads, smem, stream_of(ctx)>>>(dc.data(), M, N, K, w.codes.data_as<std::uint8_t>(),
                                                      scales_of(w), groups, partial, da.data(),
                                                      da.dtype() == DType::BF16, alpha, beta);
  QMM_CUDA_CHECK_LAUNCH("nf4_gemm_backward_small_m_kernel");
  if (splits > 1) launch_reduce(ctx, partial, splits, M * K, da, alpha, beta);
}

template <int MT>
void launch_rows(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c, float alpha,
                 float beta) {
  if (a.dtype() == DType::F32) launch_tiles<MT, true>(ctx, a, w, c, alpha, beta);
  else launch_tiles<MT, false>(ctx, a, w, c, alpha, beta);
}
}  // namespace

bool nf4_small_m_supported(const TensorView& a, const Nf4Weight& w) {
  const std::int64_t M = a.dim(0), K = a.dim(1);
  return M >= 1 && M <= kNf4SmallMMaxRows && K % 32 == 0 && w.block_size >= 32 && aligned16(a.data()) &&
         aligned16(w.codes.data()) && (a.dtype() == DType::F32 || a.dtype() == DType::BF16);
}

bool nf4_small_m_backward_supported(const TensorView& dc, const Nf4Weight& w) {
  const std::int64_t M = dc.dim(0);
  return M >= 1 && M <= kNf4SmallMBackwardMaxRows && w.cols % 32 == 0 && w.block_size >= 32 &&
         aligned16(w.codes.data()) && (dc.dtype() == DType::F32 || dc.dtype() == DType::BF16);
}

void launch_nf4_gemm_backward_small_m(const Context& ctx, const TensorView& dc, const Nf4Weight& w,
                                      const TensorView& da, float alpha, float beta) {
  set_device(ctx);
  const bool f32 = dc.dtype() == DType::F32;
  if (dc.dim(0) <= 8) f32 ? launch_backward_tiles<1, true>(ctx, dc, w, da, alpha, beta)
                          : launch_backward_tiles<1, false>(ctx, dc, w, da, alpha, beta);
  else f32 ? launch_backward_tiles<2, true>(ctx, dc, w, da, alpha, beta)
           : launch_backward_tiles<2, false>(ctx, dc, w, da, alpha, beta);
}

void launch_nf4_gemm_small_m(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
                             float alpha, float beta) {
  set_device(ctx);
  const std::int64_t M = a.dim(0);
  if (M <= 16) launch_rows<1>(ctx, a, w, c, alpha, beta);
  else if (M <= 32) launch_rows<2>(ctx, a, w, c, alpha, beta);
  else launch_rows<4>(ctx, a, w, c, alpha, beta);
}

}  // namespace qmm::cuda
