// Host side of the small-M NF4 GEMM: preconditions, split-K sizing, launches.
#include "cuda/nf4/nf4_small_m.h"

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

  Scales sc{};
  if (w.double_quant()) {
    sc.q = w.absmax.data_as<std::uint8_t>();
    sc.absmax2 = w.absmax2.data_as<float>();
    sc.code2 = w.code2.data_as<float>();
    sc.offset = w.offset;
  } else {
    sc.absmax = w.absmax.data_as<float>();
  }
  sc.block_shift = log2_exact(w.block_size);

  const bool c_bf16 = c.dtype() == DType::BF16;
  cudaStream_t stream = stream_of(ctx);
  float* partial = nullptr;
  if (splits > 1)
    partial = static_cast<float*>(state(ctx).scratch_at_least(static_cast<std::size_t>(splits) * M * N * 4));
  kernel<<<grid, kThreads, smem, stream>>>(a.data(), M, N, K, w.codes.data_as<std::uint8_t>(), sc, partial,
                                           c.data(), c_bf16, alpha, beta);
  QMM_CUDA_CHECK_LAUNCH("nf4_gemm_small_m_kernel");
  if (splits > 1) {
    const std::int64_t mn = M * N;
    const int blocks = static_cast<int>(std::min<std::int64_t>((mn + 255) / 256, 8LL * state(ctx).sm_count()));
    nf4_split_k_reduce_kernel<<<blocks, 256, 0, stream>>>(partial, splits, mn, c.data(), c_bf16, alpha, beta);
    QMM_CUDA_CHECK_LAUNCH("nf4_split_k_reduce_kernel");
  }
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

void launch_nf4_gemm_small_m(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
                             float alpha, float beta) {
  set_device(ctx);
  const std::int64_t M = a.dim(0);
  if (M <= 16) launch_rows<1>(ctx, a, w, c, alpha, beta);
  else if (M <= 32) launch_rows<2>(ctx, a, w, c, alpha, beta);
  else launch_rows<4>(ctx, a, w, c, alpha, beta);
}

}  // namespace qmm::cuda
