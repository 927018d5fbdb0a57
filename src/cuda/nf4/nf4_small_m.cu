// Host side of the small-M NF4 GEMM: preconditions, split-K sizing, launches.
#include "cuda/nf4/nf4_small_m.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/nf4/nf4_small_m.cuh"
#include "cuda/nf4/nf4_small_m_host.h"
#include "qmm/error.h"

namespace qmm::cuda {

// nf4_plan.cpp plans with these kernels' requirements: they must stay in step.
static_assert(small_m::kPairSharedBytes == 224256 && small_m::kGemvSharedBytes == 110592,
              "nf4_plan.cpp's kPairSharedBytes / kGemvSharedBytes");
static_assert(small_m::kGemvChunk == 64 && small_m::kGemvGroupK == 2048 && small_m::kGemvSums == 256,
              "nf4_plan.cpp's gemv_fits");
static_assert(kNf4SmallMMaxRows == 32 && kNf4SmallMBackwardMaxRows == 16, "nf4_plan.cpp's kSmallM*MaxRows");

namespace {

// Reductions of split-K partials: a warp per output once there are enough splits to keep 32 loads busy, but
// only over few outputs (the small-M shapes: at most M x N = 64 K). A warp per output reads one 4-byte value per
// split from lines that neighbouring outputs' warps also fetch; over many outputs (the fused kernel's split-K at
// M = 256 on the Qwen shapes: 393 K outputs, 11 splits) a thread per output reads whole lines instead (measured
// about twice as fast there: docs/history/benchmarks-notebook-2026-12.md).
constexpr int kWarpReduceSplits = 8;
constexpr std::int64_t kWarpReduceMaxOutputs = 64 * 1024;

constexpr int kReduceThreads = 256;

// Calls launch(lanes, blocks) with lanes a std::integral_constant (32 or 1) for the reduce kernel's template and
// the grid size for mn outputs.
template <class Launch>
void launch_by_lanes(const Context& ctx, int splits, std::int64_t mn, Launch launch) {
  auto blocks = [&](std::int64_t threads) {
    return static_cast<unsigned>(std::max<std::int64_t>(
        1, std::min<std::int64_t>((threads + kReduceThreads - 1) / kReduceThreads, 8LL * state(ctx).sm_count())));
  };
  if (splits >= kWarpReduceSplits && mn <= kWarpReduceMaxOutputs)
    launch(std::integral_constant<int, 32>{}, blocks(32 * mn));
  else
    launch(std::integral_constant<int, 1>{}, blocks(mn));
}

}  // namespace

void launch_nf4_split_k_reduce(const Context& ctx, const float* partial, int splits, std::int64_t mn,
                               const TensorView& c, float alpha, float beta) {
  const bool bf16 = c.dtype() == DType::BF16;
  launch_by_lanes(ctx, splits, mn, [&](auto lanes, unsigned blocks) {
    QMM_CUDA_CHECK(launch_overlapping(ctx, small_m::nf4_split_k_reduce_kernel<decltype(lanes)::value>, blocks,
                                      kReduceThreads, 0, partial, splits, mn, c.data(), bf16, alpha, beta));
  });
}

namespace small_m {

// The forward kernels' view of a weight.
WeightArgs weight_args(const Nf4Weight& w) {
  return {w.codes.data_as<std::uint8_t>(), scales_of(w)};
}

// Scratch for `floats` fp32 partial sums (split-K, or gate and up for the reduction), owned by `scratch`.
float* new_partials(const Context& ctx, std::unique_ptr<ScratchBuffer>& scratch, std::int64_t floats) {
  scratch = std::make_unique<ScratchBuffer>(state(ctx), static_cast<std::size_t>(floats) * 4);
  return scratch->at<float>(0);
}

// The pair kernel's preconditions beyond the small-M ones: M <= 16 (A bf16, or f32 rounded to bf16 when it is
// packed), blocks of 64, K a multiple of 256,
// absmax read in aligned pairs (plain: 8 bytes) or q in aligned words (double-quantized: 4 bytes), and a GPU that
// gives a block the kernel's shared memory (sm_90 does; elsewhere, and for other shapes, the table kernel). Where
// it fits it beats the table kernel and the GEMV on every shape measured (docs/BENCHMARKS.md, NF4 GEMMs by M),
// the wide down projections above one row included since its sums became block-local, so the planner
// (nf4_plan.cpp) takes it whenever it fits.
bool pair_fits(const Context& ctx, const TensorView& a, const Nf4Weight& w) {
  const std::uintptr_t scale_align = w.double_quant() ? 4 : 8;
  return a.dim(0) <= 16 && w.block_size == 64 && w.cols % 256 == 0 &&
         reinterpret_cast<std::uintptr_t>(w.absmax.data()) % scale_align == 0 &&
         state(ctx).props.sharedMemPerBlockOptin >= static_cast<std::size_t>(kPairSharedBytes);
}

// gate_up's reduction of split-K partials [weight][split][M][N] into its outputs.
void launch_gate_up_reduce(const Context& ctx, const float* partial, int splits, std::int64_t mn,
                           const GateUpOut& o, float alpha, float beta) {
  launch_by_lanes(ctx, splits, mn, [&](auto lanes, unsigned blocks) {
    QMM_CUDA_CHECK(launch_overlapping(ctx, nf4_gate_up_reduce_kernel<decltype(lanes)::value>, blocks,
                                      kReduceThreads, 0, partial, splits, mn, o, alpha, beta));
  });
}

// gate_up's outputs as the kernels take them.
GateUpOut gate_up_out(const GateUpOutputs& out) {
  auto ptr = [](const TensorView& v) { return v.empty() ? nullptr : v.data(); };
  return {ptr(out.gate), ptr(out.up), ptr(out.h), out.gate.dtype() == DType::BF16, out.up.dtype() == DType::BF16,
          out.h.dtype() == DType::BF16};
}

}  // namespace small_m

namespace {

using small_m::ForwardOut;
using small_m::gate_up_out;
using small_m::launch_gate_up_reduce;
using small_m::new_partials;
using small_m::pair_fits;
using small_m::weight_args;

// Split-K for the table kernel: the A tile (a_rows x spans * 256 bf16) must fit kTabMaxSharedA (and the GPU's
// shared memory per block); among the span counts that fit, the one with the shortest modelled time, waves x
// (spans + 1) (the 1: a block's fixed cost, staging A and the first loads' latency), fewest splits on ties.
struct TableSplit {
  int spans;  // 256-element k spans per block
  int splits;
  int smem;   // dynamic shared memory per block
};
TableSplit table_split(const Context& ctx, std::int64_t N, std::int64_t K, int weights, int nt8) {
  using namespace small_m;
  const std::int64_t total = (K + kSpanK - 1) / kSpanK;
  const std::int64_t blocks_n = weights * ((N + kTabBlockN - 1) / kTabBlockN);
  const int a_rows = 8 * nt8;
  const auto& props = state(ctx).props;
  const std::int64_t max_a = std::min<std::int64_t>(
      kTabMaxSharedA, static_cast<std::int64_t>(props.sharedMemPerBlockOptin) - kTabSharedFixed);
  const std::int64_t max_spans = std::clamp<std::int64_t>((max_a / a_rows - 127) / kSpanBytesA, 1, total);
  TableSplit best{};
  std::int64_t best_cost = -1;
  for (std::int64_t spans = max_spans; spans >= 1; --spans) {
    const std::int64_t splits = (total + spans - 1) / spans;
    const std::int64_t smem = kTabSharedFixed + a_rows * tab_a_row_bytes(static_cast<int>(spans));
    const std::int64_t per_sm = std::clamp<std::int64_t>(
        static_cast<std::int64_t>(props.sharedMemPerMultiprocessor) / (smem + 1024), 1, tab_blocks_per_sm(nt8));
    const std::int64_t slots = per_sm * props.multiProcessorCount;
    const std::int64_t cost = (blocks_n * splits + slots - 1) / slots * (spans + 1);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = {static_cast<int>(spans), static_cast<int>(splits), static_cast<int>(smem)};
    }
  }
  return best;
}

// One launch over `weights` (1, or 2 for gate and up) weights of W's shape. With one weight and no split the
// kernel writes C itself; otherwise it writes fp32 partials to scratch, returned for the caller's reduction.
template <int NT8, bool kAF32>
float* launch_table(const Context& ctx, const TensorView& a, const Nf4Weight& w0, const Nf4Weight& w1, int weights,
                    const TensorView& c, float alpha, float beta, std::unique_ptr<ScratchBuffer>& scratch,
                    int* splits_out) {
  using namespace small_m;
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w0.rows;
  const TableSplit ts = table_split(ctx, N, K, weights, NT8);
  const int blocks_n = static_cast<int>((N + kTabBlockN - 1) / kTabBlockN);
  const dim3 grid(static_cast<unsigned>(blocks_n * weights), static_cast<unsigned>(ts.splits));
  auto kernel = nf4_small_m_table_kernel<NT8, kAF32>;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), ts.smem);
  float* partial =
      ts.splits > 1 || weights > 1 ? new_partials(ctx, scratch, weights * ts.splits * M * N) : nullptr;
  QMM_CUDA_CHECK(launch_overlapping(ctx, kernel, grid, kTabThreads, ts.smem, a.data(), M, N, K, weight_args(w0),
                                    weight_args(w1), blocks_n, ts.spans, partial,
                                    c.empty() ? nullptr : c.data(), c.dtype() == DType::BF16, alpha, beta));
  *splits_out = ts.splits;
  return partial;
}

// One wave of blocks (two per SM, which __launch_bounds__ guarantees by registers), each taking an even share of
// the rows of all weights.
template <bool kAF32>
float* launch_gemv(const Context& ctx, const TensorView& a, const Nf4Weight& w0, const Nf4Weight& w1, int weights,
                   const TensorView& c, float alpha, float beta, std::unique_ptr<ScratchBuffer>& scratch) {
  using namespace small_m;
  const std::int64_t K = a.dim(1), N = w0.rows;
  const std::int64_t groups = (K + kGemvGroupK - 1) / kGemvGroupK;
  const std::int64_t wave = 2LL * state(ctx).sm_count();
  const std::int64_t rows = std::clamp<std::int64_t>((weights * N + wave - 1) / wave, 1, kGemvSums / groups);
  const int blocks_n = static_cast<int>((N + rows - 1) / rows);
  auto kernel = nf4_gemv_kernel<kAF32>;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), kGemvSharedBytes);
  float* partial = weights > 1 ? new_partials(ctx, scratch, weights * N) : nullptr;
  QMM_CUDA_CHECK(launch_overlapping(ctx, kernel, static_cast<unsigned>(blocks_n * weights), kGemvThreads,
                                    kGemvSharedBytes, a.data(), N, K, weight_args(w0), weight_args(w1), blocks_n,
                                    static_cast<int>(rows), partial, c.empty() ? nullptr : c.data(),
                                    c.dtype() == DType::BF16, alpha, beta));
  return partial;
}

// Split-K for the pair kernel: a row group's units (splits x weights, at most the block's 16 warps) share a block
// and a round, so that the block sums them. Among the split counts, the one with the shortest modelled time,
// rounds x (steps per split + one step of per-round cost), fewest splits on ties.
small_m::PairGrid pair_grid(const Context& ctx, std::int64_t N, std::int64_t K, int weights) {
  using small_m::kPairWarps;
  const std::int64_t blocks = state(ctx).sm_count();
  const std::int64_t row_groups = (N + 15) / 16, steps = K / 256;
  small_m::PairGrid best{};
  std::int64_t best_cost = -1;
  for (std::int64_t splits = 1; splits <= std::min<std::int64_t>(steps, kPairWarps / weights); ++splits) {
    const std::int64_t per_split = (steps + splits - 1) / splits;
    if ((steps + per_split - 1) / per_split != splits) continue;  // the same split as fewer splits, one left empty
    const std::int64_t members = weights * splits, groups = kPairWarps / members;
    const std::int64_t rounds = (row_groups + blocks * groups - 1) / (blocks * groups);
    const std::int64_t cost = rounds * (per_split + 1);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = {weights, static_cast<int>(row_groups), static_cast<int>(splits), static_cast<int>(members),
              static_cast<int>(groups), static_cast<int>(rounds), static_cast<int>(per_split),
              static_cast<int>(steps)};
    }
  }
  return best;
}

// bf16 A is read as it is, or packed in fragment order first by a small kernel (f32 A always is: the pair kernel
// reads bf16); the plan says which (nf4_plan.cpp).
template <int NT8, bool kDq>
void launch_pair(const Context& ctx, bool packed, const TensorView& a, const Nf4Weight& w0, const Nf4Weight& w1,
                 int weights, const ForwardOut& o, std::unique_ptr<ScratchBuffer>& scratch) {
  using namespace small_m;
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w0.rows;
  const PairGrid grid = pair_grid(ctx, N, K, weights);
  const PairOut out{o.c.empty() ? nullptr : o.c.data(), o.c.dtype() == DType::BF16, o.gate_up, o.alpha, o.beta};
  const void* a_arg = a.data();
  if (packed) {  // a kernel of its own, overlapping like the pair kernel
    const std::int64_t pieces = pair_packed_pieces(K, NT8);
    scratch = std::make_unique<ScratchBuffer>(state(ctx), static_cast<std::size_t>(pieces) * 16);
    a_arg = scratch->data();
    const auto pack_blocks = static_cast<unsigned>(
        std::min<std::int64_t>((pieces + kPairPackThreads - 1) / kPairPackThreads, 4LL * state(ctx).sm_count()));
    auto pack = a.dtype() == DType::F32 ? nf4_pair_pack_a_kernel<NT8, true> : nf4_pair_pack_a_kernel<NT8, false>;
    QMM_CUDA_CHECK(launch_overlapping(ctx, pack, pack_blocks, kPairPackThreads, 0, a.data(), static_cast<int>(M), K,
                                      scratch->at<__nv_bfloat16>(0)));
  }
  auto kernel = packed ? nf4_small_m_pair_kernel<NT8, kDq, true> : nf4_small_m_pair_kernel<NT8, kDq, false>;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), kPairSharedBytes);
  QMM_CUDA_CHECK(launch_overlapping(ctx, kernel, state(ctx).sm_count(), kPairThreads, kPairSharedBytes,
                                    static_cast<const __nv_bfloat16*>(a_arg), static_cast<int>(M), N, K,
                                    weight_args(w0), weight_args(w1), grid, out));
}

template <int NT8>
void launch_pair_scales(const Context& ctx, bool packed, const TensorView& a, const Nf4Weight& w0,
                        const Nf4Weight& w1, int weights, const ForwardOut& o,
                        std::unique_ptr<ScratchBuffer>& scratch) {
  if (w0.double_quant()) launch_pair<NT8, true>(ctx, packed, a, w0, w1, weights, o, scratch);
  else launch_pair<NT8, false>(ctx, packed, a, w0, w1, weights, o, scratch);
}

// The planned kernel (nf4_plan.cpp: pair where it fits, GEMV at one row, the table kernel otherwise).
template <bool kAF32>
float* launch_planned(const Context& ctx, const Nf4Plan& plan, const TensorView& a, const Nf4Weight& w0,
                      const Nf4Weight& w1, int weights, const ForwardOut& o, std::unique_ptr<ScratchBuffer>& scratch,
                      int* splits) {
  const TensorView& c = o.c;
  const float alpha = o.alpha, beta = o.beta;
  switch (plan.kernel) {
    case Nf4Kernel::SmallMPair:
      if (plan.n8_tiles == 1) launch_pair_scales<1>(ctx, plan.packed_a, a, w0, w1, weights, o, scratch);
      else launch_pair_scales<2>(ctx, plan.packed_a, a, w0, w1, weights, o, scratch);
      return nullptr;
    case Nf4Kernel::SmallMGemv:
      *splits = 1;
      return launch_gemv<kAF32>(ctx, a, w0, w1, weights, c, alpha, beta, scratch);
    case Nf4Kernel::SmallMTable:
      if (plan.n8_tiles == 1) return launch_table<1, kAF32>(ctx, a, w0, w1, weights, c, alpha, beta, scratch, splits);
      if (plan.n8_tiles == 2) return launch_table<2, kAF32>(ctx, a, w0, w1, weights, c, alpha, beta, scratch, splits);
      return launch_table<4, kAF32>(ctx, a, w0, w1, weights, c, alpha, beta, scratch, splits);
    default:
      throw Error(ErrorCode::Internal, std::string("small-M forward launched with plan ") + nf4_kernel_name(plan.kernel));
  }
}

// Returns the partials (in `scratch`) when the caller must reduce them into `o`, else nullptr.
float* launch_forward(const Context& ctx, const Nf4Plan& plan, const TensorView& a, const Nf4Weight& w0,
                      const Nf4Weight& w1, int weights, const ForwardOut& o, std::unique_ptr<ScratchBuffer>& scratch,
                      int* splits) {
  set_device(ctx);
  return a.dtype() == DType::F32 ? launch_planned<true>(ctx, plan, a, w0, w1, weights, o, scratch, splits)
                                 : launch_planned<false>(ctx, plan, a, w0, w1, weights, o, scratch, splits);
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
  const int smem = kTablesBytes + bwd_dc_tile_bytes(MT8, static_cast<int>(block_n)) + bwd_red_bytes(MT8);
  auto kernel = nf4_gemm_backward_small_m_kernel<MT8, kDcF32>;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), smem);
  std::unique_ptr<ScratchBuffer> scratch;
  float* partial = splits > 1 ? new_partials(ctx, scratch, splits * M * K) : nullptr;
  const dim3 grid(static_cast<unsigned>(k_blocks), static_cast<unsigned>(splits));
  kernel<<<grid, kBwdThreads, smem, stream_of(ctx)>>>(dc.data(), M, N, K, w.codes.data_as<std::uint8_t>(),
                                                      small_m::scales_of(w), groups, partial, da.data(),
                                                      da.dtype() == DType::BF16, alpha, beta);
  QMM_CUDA_CHECK_LAUNCH("nf4_gemm_backward_small_m_kernel");
  if (splits > 1) launch_nf4_split_k_reduce(ctx, partial, splits, M * K, da, alpha, beta);
}

}  // namespace

void launch_nf4_gemm_backward_small_m(const Context& ctx, const Nf4Plan& plan, const TensorView& dc,
                                      const Nf4Weight& w, const TensorView& da, float alpha, float beta) {
  set_device(ctx);
  const bool f32 = dc.dtype() == DType::F32;
  if (plan.n8_tiles == 1) f32 ? launch_backward_tiles<1, true>(ctx, dc, w, da, alpha, beta)
                          : launch_backward_tiles<1, false>(ctx, dc, w, da, alpha, beta);
  else f32 ? launch_backward_tiles<2, true>(ctx, dc, w, da, alpha, beta)
           : launch_backward_tiles<2, false>(ctx, dc, w, da, alpha, beta);
}

void launch_nf4_gemm_small_m(const Context& ctx, const Nf4Plan& plan, const TensorView& a, const Nf4Weight& w,
                             const TensorView& c, float alpha, float beta) {
  int splits = 1;
  std::unique_ptr<ScratchBuffer> scratch;
  const float* partial = launch_forward(ctx, plan, a, w, w, 1, {c, {}, alpha, beta}, scratch, &splits);
  if (partial) launch_nf4_split_k_reduce(ctx, partial, splits, a.dim(0) * w.rows, c, alpha, beta);
}

void launch_nf4_gate_up_small_m(const Context& ctx, const Nf4Plan& plan, const TensorView& a,
                                const Nf4Weight& w_gate, const Nf4Weight& w_up, const GateUpOutputs& out, float alpha,
                                float beta) {
  const small_m::GateUpOut o = gate_up_out(out);
  int splits = 1;
  std::unique_ptr<ScratchBuffer> scratch;
  const float* partial = launch_forward(ctx, plan, a, w_gate, w_up, 2, {TensorView(), o, alpha, beta}, scratch, &splits);
  if (partial) launch_gate_up_reduce(ctx, partial, splits, a.dim(0) * w_gate.rows, o, alpha, beta);
}

}  // namespace qmm::cuda
