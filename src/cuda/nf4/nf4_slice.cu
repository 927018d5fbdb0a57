// Host side of the small-M slice kernel (nf4_slice.h): preconditions, grid and pass sizing, launches. Shares the
// small-M launches' helpers (nf4_small_m_host.h).
#include "cuda/nf4/nf4_slice.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/nf4/nf4_slice_kernel.cuh"
#include "cuda/nf4/nf4_small_m.h"
#include "cuda/nf4/nf4_small_m_host.h"
#include "qmm/error.h"

namespace qmm::cuda {

// nf4_plan.cpp plans the forced slice kernel with the pair kernel's conditions and these rows.
static_assert(small_m::kSliceMaxRows == 16, "nf4_plan.cpp's kSliceMaxRows");
static_assert(small_m::kSliceFixedBytes + 2 * small_m::kSliceWarps * 16 * small_m::kSliceMaxRows * 4 <=
                  small_m::kPairSharedBytes,
              "nf4_plan.cpp's slice_fits takes pair_fits' shared memory as enough");

namespace {

// The slice kernel's preconditions: the pair kernel's (its ring steps and table) and shared memory for the fixed
// layout plus the smallest pass: two row groups (a two-weight pass) of 16 slices' sums at 16 rows.
bool slice_fits(const Context& ctx, const TensorView& a, const Nf4Weight& w) {
  using namespace small_m;
  return a.dim(0) <= kSliceMaxRows && pair_fits(ctx, a, w) &&
         state(ctx).props.sharedMemPerBlockOptin >=
             static_cast<std::size_t>(kSliceFixedBytes + 2 * kSliceWarps * 16 * kSliceMaxRows * 4);
}

// At most 16 slices per split (one per warp), as few splits as that allows and the slices spread evenly over
// them; a block per SM, each taking an even share of a split's row groups; passes as long as the shared memory
// left for sums holds (with two weights, an even number of groups unless one pass takes all of a block's).
struct SliceLaunch {
  small_m::SliceGrid grid;
  int splits, blocks, smem;
};
SliceLaunch slice_launch(const Context& ctx, std::int64_t M, std::int64_t N, std::int64_t K, int weights) {
  using namespace small_m;
  SliceLaunch l{};
  SliceGrid& g = l.grid;
  g.weights = weights;
  g.slices = static_cast<int>(K / kSliceK);
  l.splits = (g.slices + kSliceWarps - 1) / kSliceWarps;
  g.per_split = (g.slices + l.splits - 1) / l.splits;
  g.warps_per_slice = kSliceWarps / g.per_split;
  g.groups = weights * static_cast<int>((N + 15) / 16);
  const int per_split_blocks = std::max(1, state(ctx).sm_count() / l.splits);
  g.groups_per_block = (g.groups + per_split_blocks - 1) / per_split_blocks;
  g.groups_per_block += g.groups_per_block % weights;
  l.blocks = (g.groups + g.groups_per_block - 1) / g.groups_per_block;
  const std::int64_t group_sum_bytes = static_cast<std::int64_t>(g.per_split) * 16 * M * 4;
  const std::int64_t free_bytes = static_cast<std::int64_t>(state(ctx).props.sharedMemPerBlockOptin) - kSliceFixedBytes;
  const int iters_needed = (g.groups_per_block + g.warps_per_slice - 1) / g.warps_per_slice;
  int pass_iters = static_cast<int>(std::clamp<std::int64_t>(
      free_bytes / (group_sum_bytes * g.warps_per_slice), 1, iters_needed));
  // An odd pass of two weights' groups would split a row's gate and up over two passes: one group less, or (a
  // single group per pass) two, which slice_fits leaves room for.
  if (weights == 2 && pass_iters * g.warps_per_slice % 2 == 1 && pass_iters < iters_needed)
    pass_iters = pass_iters > 1 ? pass_iters - 1 : 2;
  g.pass_groups = pass_iters * g.warps_per_slice;
  l.smem = static_cast<int>(kSliceFixedBytes + g.pass_groups * group_sum_bytes);
  return l;
}

template <int NT8, bool kDq, bool kAF32>
void launch_slice(const Context& ctx, const TensorView& a, const Nf4Weight& w0, const Nf4Weight& w1, int weights,
                  const small_m::ForwardOut& o) {
  using namespace small_m;
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w0.rows;
  const SliceLaunch l = slice_launch(ctx, M, N, K, weights);
  std::unique_ptr<ScratchBuffer> scratch;
  float* partial = l.splits > 1 ? new_partials(ctx, scratch, weights * l.splits * M * N) : nullptr;
  auto kernel = nf4_small_m_slice_kernel<NT8, kDq, kAF32>;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), l.smem);
  const SliceOut out{o.c.empty() ? nullptr : o.c.data(), o.c.dtype() == DType::BF16, o.gate_up, partial, l.splits,
                     o.alpha, o.beta};
  QMM_CUDA_CHECK(launch_overlapping(ctx, kernel, dim3(static_cast<unsigned>(l.blocks), static_cast<unsigned>(l.splits)),
                                    kSliceThreads, l.smem, a.data(), static_cast<int>(M), N, K, weight_args(w0),
                                    weight_args(w1), l.grid, out));
  if (!partial) return;
  if (weights == 1) launch_nf4_split_k_reduce(ctx, partial, l.splits, M * N, o.c, o.alpha, o.beta);
  else launch_gate_up_reduce(ctx, partial, l.splits, M * N, o.gate_up, o.alpha, o.beta);
}

void launch_slice_for(const Context& ctx, const TensorView& a, const Nf4Weight& w0, const Nf4Weight& w1, int weights,
                      const small_m::ForwardOut& o) {
  set_device(ctx);
  const bool f32 = a.dtype() == DType::F32, dq = w0.double_quant();
  auto launch = [&](auto nt8) {
    constexpr int NT8 = decltype(nt8)::value;
    if (dq) f32 ? launch_slice<NT8, true, true>(ctx, a, w0, w1, weights, o)
                : launch_slice<NT8, true, false>(ctx, a, w0, w1, weights, o);
    else f32 ? launch_slice<NT8, false, true>(ctx, a, w0, w1, weights, o)
             : launch_slice<NT8, false, false>(ctx, a, w0, w1, weights, o);
  };
  if (a.dim(0) <= 8) launch(std::integral_constant<int, 1>{});
  else launch(std::integral_constant<int, 2>{});
}

// The small-M forward kernels' problem conditions (nf4_plan.cpp's small_m_fits, the slice kernel's).
bool nf4_small_m_supported(const TensorView& a, const Nf4Weight& w) {
  const std::int64_t M = a.dim(0), K = a.dim(1);
  return M >= 1 && M <= kNf4SmallMMaxRows && K % 64 == 0 && w.block_size >= 64 && aligned16(a.data()) &&
         aligned16(w.codes.data()) && (a.dtype() == DType::F32 || a.dtype() == DType::BF16);
}

// Whether the slice kernel can take a launch over these weights (one, or gate and up with one scale format).
bool slice_fits_all(const Context& ctx, const TensorView& a, const Nf4Weight& w0, const Nf4Weight& w1) {
  return nf4_small_m_supported(a, w0) && nf4_small_m_supported(a, w1) && slice_fits(ctx, a, w0) &&
         slice_fits(ctx, a, w1) && w0.double_quant() == w1.double_quant();
}

// A forced slice kernel where it does not fit: Unsupported, before anything is launched.
void check_slice_fits(const char* op, const Context& ctx, const TensorView& a, const Nf4Weight& w0,
                      const Nf4Weight& w1) {
  if (!slice_fits_all(ctx, a, w0, w1))
    throw Error(ErrorCode::Unsupported, std::string(op) + ": the small-M slice kernel does not support this problem "
                                        "(it needs M <= 16, blocks of 64, K a multiple of 256, one scale format and "
                                        "sm_90's shared memory)");
}

}  // namespace

bool nf4_small_m_slice_supported(const Context& ctx, const TensorView& a, const Nf4Weight& w) {
  return slice_fits_all(ctx, a, w, w);
}

void launch_nf4_gemm_small_m_slice(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
                                   float alpha, float beta) {
  check_slice_fits("nf4_gemm", ctx, a, w, w);
  launch_slice_for(ctx, a, w, w, 1, {c, {}, alpha, beta});
}

void launch_nf4_gate_up_small_m_slice(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate,
                                      const Nf4Weight& w_up, const GateUpOutputs& out, float alpha, float beta) {
  check_slice_fits("nf4_gate_up", ctx, a, w_gate, w_up);
  launch_slice_for(ctx, a, w_gate, w_up, 2, {TensorView(), small_m::gate_up_out(out), alpha, beta});
}

}  // namespace qmm::cuda
