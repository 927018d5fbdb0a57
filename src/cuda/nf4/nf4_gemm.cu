// NF4 GEMMs on the GPU, dispatched by Nf4GemmOptions::path.
//  DequantGemm: dequantize W to bf16 into scratch, round an f32 A to bf16 (nearest even) into the same scratch
//  allocation, then the dense bf16 GEMM (cuBLASLt, fp32 accumulation).
//  SmallM: the fused small-M kernels (nf4_small_m.cu) where their preconditions hold, Unsupported otherwise.
//  Auto: SmallM for few rows where it applies (wants_small_m below), the fused kernels at tens to hundreds of rows
//  where they measured faster and apply (fused_choice), DequantGemm otherwise.
//  Fused: the fused tensor-core kernels (nf4_fused.cu, sm_90a) for the forward and the input gradient where they
//  apply, Unsupported otherwise; FusedShared the same with each weight tile dequantized once per call (forced
//  only, see fused_choice); FusedMma the fused kernel on mma.sync (nf4_fused_mma.cu, any GPU from sm_80 on;
//  forced only). Reference: the CPU backend's, not a GPU path.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"
#include "cuda/nf4/nf4_fused.h"
#include "cuda/nf4/nf4_fused_mma.h"
#include "cuda/nf4/nf4_small_m.h"
#include "cuda/swiglu/swiglu.cuh"
#include "qmm/error.h"

namespace qmm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr std::size_t kScratchAlign = 256;  // every scratch region starts 256-byte aligned (cuBLASLt, vectors)

std::size_t align_up(std::size_t v) { return (v + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

const char* path_label(Nf4Path p) {
  switch (p) {
    case Nf4Path::Auto: return "Auto";
    case Nf4Path::Reference: return "Reference";
    case Nf4Path::DequantGemm: return "DequantGemm";
    case Nf4Path::SmallM: return "SmallM";
    case Nf4Path::Fused: return "Fused";
    case Nf4Path::FusedShared: return "FusedShared";
    case Nf4Path::FusedMma: return "FusedMma";
  }
  return "?";
}

[[noreturn]] void unsupported(const char* op, Nf4Path p, const std::string& why) {
  throw Error(ErrorCode::Unsupported, std::string(op) + ": path " + path_label(p) + " " + why);
}

// Whether a forced (or chosen) fast path can serve the problem, and what it needs when it cannot.
struct PathFit {
  bool ok = false;
  std::string needs;
};

// Paths other than Auto, DequantGemm and the fast paths that fit end here.
void check_path(const char* op, Nf4Path p, const PathFit& small_m, const PathFit& fused) {
  switch (p) {
    case Nf4Path::Auto:
    case Nf4Path::DequantGemm: return;
    case Nf4Path::SmallM:
      if (small_m.ok) return;
      unsupported(op, p, "does not support this problem (it needs " + small_m.needs + ")");
    case Nf4Path::Fused:
    case Nf4Path::FusedShared:
    case Nf4Path::FusedMma:
      if (fused.ok) return;
      unsupported(op, p, "does not support this problem (it needs " + fused.needs + ")");
    case Nf4Path::Reference: unsupported(op, p, "runs on the CPU backend only (use a CPU context)");
  }
  unsupported(op, p, "is unknown");
}

PathFit fused_fit(const Context& ctx, const TensorView& activations, const Nf4Weight& w, bool backward,
                  FusedKernel kernel) {
  const char* why = nullptr;
  PathFit f;
  f.ok = kernel == FusedKernel::Mma ? nf4_fused_mma_supported(ctx, activations, w, backward, &why)
                                    : nf4_fused_supported(ctx, activations, w, backward, &why);
  if (!f.ok) f.needs = why;
  return f;
}

constexpr const char* kSmallMNeeds =
    "M <= 32, K a multiple of 64, NF4 blocks of at least 64, 16-byte aligned A and codes";
constexpr const char* kSmallMBackwardNeeds =
    "M <= 16, K a multiple of 32, 16-byte aligned codes";

// ---- kernels --------------------------------------------------------------------------------------------------

// f32 -> bf16, round to nearest even (the NF4 GEMMs' operand contract). dst is 16-byte aligned scratch; src is
// read with 16-byte vectors when it is 16-byte aligned too.
__global__ void __launch_bounds__(kThreads) round_to_bf16_kernel(const float* __restrict__ src,
                                                                 __nv_bfloat16* __restrict__ dst, std::int64_t n,
                                                                 std::int64_t nvec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t v = tid; v < nvec; v += stride) {  // 8 elements each
    const float4 a = __ldg(reinterpret_cast<const float4*>(src) + 2 * v);
    const float4 b = __ldg(reinterpret_cast<const float4*>(src) + 2 * v + 1);
    const __nv_bfloat162 p0 = __floats2bfloat162_rn(a.x, a.y), p1 = __floats2bfloat162_rn(a.z, a.w);
    const __nv_bfloat162 p2 = __floats2bfloat162_rn(b.x, b.y), p3 = __floats2bfloat162_rn(b.z, b.w);
    reinterpret_cast<uint4*>(dst)[v] =
        make_uint4(*reinterpret_cast<const std::uint32_t*>(&p0), *reinterpret_cast<const std::uint32_t*>(&p1),
                   *reinterpret_cast<const std::uint32_t*>(&p2), *reinterpret_cast<const std::uint32_t*>(&p3));
  }
  for (std::int64_t i = nvec * 8 + tid; i < n; i += stride) dst[i] = __float2bfloat16_rn(src[i]);
}

// gate_up's last step when h is wanted. g and u are the fp32 GEMM results (scratch, or the caller's f32 outputs
// themselves); writes the bf16 gate/up outputs the caller asked for (null when not asked for, or f32 and already
// written) and h = silu(g) * u from the fp32 values.
__global__ void __launch_bounds__(kThreads) gate_up_epilogue_kernel(const float* g, const float* u,
                                                                    __nv_bfloat16* gate_bf16,
                                                                    __nv_bfloat16* up_bf16, void* h, bool h_bf16,
                                                                    std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float gv = g[i], uv = u[i];
    if (gate_bf16) gate_bf16[i] = __float2bfloat16_rn(gv);
    if (up_bf16) up_bf16[i] = __float2bfloat16_rn(uv);
    const float hv = swiglu_detail::swiglu_value(gv, uv);
    if (h_bf16) static_cast<__nv_bfloat16*>(h)[i] = __float2bfloat16_rn(hv);
    else static_cast<float*>(h)[i] = hv;
  }
}

// ---- host helpers ---------------------------------------------------------------------------------------------

// Carves one stream-ordered scratch allocation into consecutive 256-byte aligned regions: sizes are summed
// first (reserve), then the allocation is taken once (commit) and lives as long as the plan.
class ScratchPlan {
 public:
  std::size_t reserve(std::size_t bytes) {
    const std::size_t at = total_;
    total_ += align_up(bytes);
    return at;
  }
  void commit(const Context& ctx) { buffer_ = std::make_unique<ScratchBuffer>(state(ctx), total_); }
  template <class T>
  T* at(std::size_t offset) const { return buffer_->at<T>(offset); }

 private:
  std::size_t total_ = 0;
  std::unique_ptr<ScratchBuffer> buffer_;
};

void launch_round_to_bf16(const Context& ctx, const TensorView& src, __nv_bfloat16* dst) {
  const std::int64_t n = src.numel();
  if (n == 0) return;
  const bool vec = aligned16(src.data());
  const std::int64_t nvec = vec ? n / 8 : 0;
  round_to_bf16_kernel<<<grid_for(ctx, round_to_bf16_kernel, kThreads, nvec + (n - nvec * 8)), kThreads, 0, stream_of(ctx)>>>(
      src.data_as<const float>(), dst, n, nvec);
  QMM_CUDA_CHECK_LAUNCH("round_to_bf16_kernel");
}

// The bf16 operand for A: A itself when it is bf16, else its rounded copy in the region reserved at `offset`.
const void* bf16_operand(const Context& ctx, const TensorView& a, const ScratchPlan& plan, std::size_t offset) {
  if (a.dtype() == DType::BF16) return a.data();
  __nv_bfloat16* dst = plan.at<__nv_bfloat16>(offset);
  launch_round_to_bf16(ctx, a, dst);
  return dst;
}

// The dispatcher: Auto takes the fused small-M kernels up to these row counts (where their preconditions hold),
// the fused tensor-core kernels or dequantize + cuBLASLt above. The choice is made again on every call rather than
// kept in the context's PlanCache: it is a handful of comparisons, and a PlanCache lookup (a string key, a lock,
// a hash) costs more (78 ns per lookup of such a key, measured on the development machine's CPU); the cache serves
// cuBLASLt's heuristic query, which takes microseconds. Set from `qmm bench` device times on an H200
// (docs/BENCHMARKS.md): the forward (table kernel, GEMV at M = 1) wins up to its limit of 32 rows on every
// measured shape but one (M = 32: Qwen2.5-1.5B gate/up 14.3 vs 19.0 µs for dequantize + GEMM, down 18.4 vs 18.9
// for the fused kernel; Llama-3-8B gate/up 44.5 vs 48.8 fused; Llama down loses, 47.6 vs 45.8, session 16). The
// input gradient wins only on large weights, up to M = 8 (66 vs 81 µs at M = 8, 96 vs 81 at M = 16; on
// Qwen2.5-1.5B dequantize + GEMM is faster even at M = 1: 21 vs 28 µs).
constexpr std::int64_t kAutoSmallMRows = 32;  // forward and gate_up, every weight
constexpr std::int64_t kAutoSmallMBackwardRowsLarge = 8;
constexpr std::int64_t kLargeWeightElements = 32ll << 20;  // between the two measured sizes (13.8M and 58.7M)

// The input gradient's limit; the forward and gate_up take kAutoSmallMRows.
std::int64_t auto_small_m_backward_rows(const Nf4Weight& w) {
  return w.numel() >= kLargeWeightElements ? kAutoSmallMBackwardRowsLarge : 0;
}

bool wants_small_m(Nf4Path path, std::int64_t m, std::int64_t auto_max_rows) {
  return path == Nf4Path::SmallM || (path == Nf4Path::Auto && m <= auto_max_rows);
}

// Auto takes the fused tensor-core kernels (sm_90a, nf4_fused.cu) where they measured faster than dequantize +
// cuBLASLt (H200, device µs, docs/BENCHMARKS.md; commit 8ade442, paths timed in turns); the in-loop kernel never
// above 512 rows (at M >= 2048 it loses: 1.04-1.45x):
//  - on large weights (Llama-3-8B sizes), where dequantizing costs ~40 µs, from just above the small-M range:
//    forward 32-512 rows (M = 32-64: 45-49 vs 79-84; M = 256: 50-53 vs 90-94; M = 512: 105 vs 128-136), input
//    gradient 9-512 (M = 16: 52-57 vs 81; M = 32-64: 53-58 vs 81-83; M = 256: 61 vs 93-97; M = 512: 117-125 vs
//    127-136);
//  - on smaller weights (Qwen2.5-1.5B sizes) from 32 rows, and only when the fused grid keeps the GPU at least 90%
//    busy (kMinWaveFill): Qwen down forward and gate/up input gradient (12 tiles per 256 rows, split over the
//    long k to fill 132 SMs) win or tie at M = 32 (18.9 vs 20.3, 20.2 vs 20.1), 64 (16.7 vs 20.9, 18.0 vs 20.7),
//    256 (21.5 vs 27.4, 22.9 vs 28.4) and 512 (31.8 vs 33.8, 35.2 vs 37.4); Qwen gate/up forward and down input
//    gradient (70 tiles per 256 rows: 53% of one wave) lose (20.6 vs 18.9 and 24.2 vs 19.0 at M = 32; 42.3 vs
//    32.1 and 48.8 vs 34.8 at 512).
struct RowRange {
  std::int64_t min, max;
};
// [backward]: the forward takes over where the small-M kernel stops; the input gradient's small-M range is
// excluded by fused_choice's small_m argument.
constexpr RowRange kAutoFusedRowsLarge[2] = {{kAutoSmallMRows + 1, 512}, {0, 512}};
constexpr RowRange kAutoFusedRows = {32, 512};                       // smaller weights, either direction
constexpr double kMinWaveFill = 0.9;
// Auto never takes the shared-dequantization kernel (FusedShared). It wins per op only in the first ~100 ms of
// back-to-back calls; under sustained load, at the power limit, it draws more power per product than cuBLAS and
// runs slower than dequantize + cuBLASLt (H200, session 26: Llama-3-8B gate/up forward M = 4096 776 vs 751 µs),
// and every MLP block measured with Auto taking it was slower (sessions 18-25). History: docs/BENCHMARKS.md.
// The fused kernel a path takes for this problem, if any: forced (Fused, FusedShared) or chosen by Auto.
std::optional<FusedKernel> fused_choice(const Context& ctx, Nf4Path path, std::int64_t m, const Nf4Weight& w,
                                        bool small_m, bool backward) {
  if (path == Nf4Path::Fused) return FusedKernel::InLoop;
  if (path == Nf4Path::FusedShared) return FusedKernel::SharedDequant;
  if (path == Nf4Path::FusedMma) return FusedKernel::Mma;
  if (path != Nf4Path::Auto || small_m) return std::nullopt;
  const bool large = w.numel() >= kLargeWeightElements;
  const RowRange r = large ? kAutoFusedRowsLarge[backward ? 1 : 0] : kAutoFusedRows;
  if (m < r.min || m > r.max) return std::nullopt;
  if (!large && nf4_fused_wave_fill(ctx, m, w, backward) < kMinWaveFill) return std::nullopt;
  return FusedKernel::InLoop;
}

// The bf16 activations for a fused launch: x itself, or its rounded copy in plan's scratch (f32 x).
const void* fused_operand(const Context& ctx, const TensorView& x, ScratchPlan& plan) {
  if (x.dtype() == DType::BF16) return x.data();
  const std::size_t at = plan.reserve(static_cast<std::size_t>(x.numel()) * 2);
  plan.commit(ctx);
  return bf16_operand(ctx, x, plan, at);
}

void dequantize_bf16(const Context& ctx, const Nf4Weight& w, void* dst) {
  cuda::nf4_dequantize(ctx, w, TensorView(dst, DType::BF16, {w.rows, w.cols}, Device::cuda(state(ctx).device)));
}

// C[m,n] = alpha * A[m,k] * B^T + beta * C with B stored [n,k] (trans_b), or * B with B stored [k,n].
void bf16_gemm(const Context& ctx, const void* a, const void* b, bool trans_b, const TensorView& c, std::int64_t m,
               std::int64_t n, std::int64_t k, float alpha, float beta) {
  GemmProblem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.trans_b = trans_b;
  p.a = a;
  p.b = b;
  p.c = c.data();
  p.ab_dtype = DType::BF16;
  p.c_dtype = c.dtype();
  p.alpha = alpha;
  p.beta = beta;
  p.math = MathMode::FP32;  // bf16 storage: bf16 operands, fp32 accumulation in any mode
  cuda::gemm(ctx, p);
}

}  // namespace

void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
              const Nf4GemmOptions& opts) {
  const char* op = "nf4_gemm";
  const bool small_m =
      wants_small_m(opts.path, a.dim(0), kAutoSmallMRows) && nf4_small_m_supported(a, w);
  // Where Auto would take it but it cannot serve (another GPU, a build without sm_90a, K % 64 != 0...),
  // dequantize + cuBLASLt runs instead.
  const std::optional<FusedKernel> kernel = fused_choice(ctx, opts.path, a.dim(0), w, small_m, false);
  const PathFit fused = kernel ? fused_fit(ctx, a, w, false, *kernel) : PathFit{};
  check_path(op, opts.path, {small_m, kSmallMNeeds}, fused);
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w.rows;
  if (M == 0 || N == 0) return;
  set_device(ctx);
  if (small_m) return launch_nf4_gemm_small_m(ctx, a, w, c, opts.alpha, opts.beta);
  if (fused.ok) {
    ScratchPlan plan;
    return launch_nf4_gemm_fused(ctx, fused_operand(ctx, a, plan), M, w, c, opts.alpha, opts.beta, *kernel);
  }

  // Scratch use inside this call: [bf16 A (when A is f32)] [bf16 W], regions of one allocation. The dense GEMM
  // takes bf16 operands as they are and needs no scratch of its own.
  ScratchPlan plan;
  const std::size_t a_at = a.dtype() == DType::F32 ? plan.reserve(static_cast<std::size_t>(M * K) * 2) : 0;
  const std::size_t w_at = plan.reserve(static_cast<std::size_t>(N * K) * 2);
  plan.commit(ctx);
  const void* a16 = bf16_operand(ctx, a, plan, a_at);
  dequantize_bf16(ctx, w, plan.at<void>(w_at));
  // C[M,N] = A[M,K] * W^T, W stored [N,K].
  bf16_gemm(ctx, a16, plan.at<void>(w_at), true, c, M, N, K, opts.alpha, opts.beta);
}

void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                         const Nf4GemmOptions& opts) {
  const char* op = "nf4_gemm_backward_a";
  const bool small_m =
      wants_small_m(opts.path, dc.dim(0), auto_small_m_backward_rows(w)) &&
      nf4_small_m_backward_supported(dc, w);
  const std::optional<FusedKernel> kernel = fused_choice(ctx, opts.path, dc.dim(0), w, small_m, true);
  const PathFit fused = kernel ? fused_fit(ctx, dc, w, true, *kernel) : PathFit{};
  check_path(op, opts.path, {small_m, kSmallMBackwardNeeds}, fused);
  const std::int64_t M = dc.dim(0), N = w.rows, K = w.cols;
  if (M == 0 || K == 0) return;
  set_device(ctx);
  if (small_m) return launch_nf4_gemm_backward_small_m(ctx, dc, w, da, opts.alpha, opts.beta);
  if (fused.ok) {
    ScratchPlan plan;
    return launch_nf4_gemm_backward_fused(ctx, fused_operand(ctx, dc, plan), M, w, da, opts.alpha, opts.beta,
                                          *kernel);
  }

  ScratchPlan plan;
  const std::size_t a_at = dc.dtype() == DType::F32 ? plan.reserve(static_cast<std::size_t>(M * N) * 2) : 0;
  const std::size_t w_at = plan.reserve(static_cast<std::size_t>(N * K) * 2);
  plan.commit(ctx);
  const void* dc16 = bf16_operand(ctx, dc, plan, a_at);
  dequantize_bf16(ctx, w, plan.at<void>(w_at));
  // dA[M,K] = dC[M,N] * W, W stored [N,K] = B [k=N, n=K], not transposed.
  bf16_gemm(ctx, dc16, plan.at<void>(w_at), false, da, M, K, N, opts.alpha, opts.beta);
}

void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                 const GateUpOutputs& out, const Nf4GemmOptions& opts) {
  const char* op = "nf4_gate_up";
  const bool small_m = wants_small_m(opts.path, a.dim(0), kAutoSmallMRows) &&
                       nf4_small_m_supported(a, w_gate) &&
                       nf4_small_m_supported(a, w_up) && w_gate.rows == w_up.rows;
  // Fused: the fused tensor-core forward once per projection, where nf4_gemm's Auto would take it (or forced).
  const std::optional<FusedKernel> kernel = fused_choice(ctx, opts.path, a.dim(0), w_gate, small_m, false);
  PathFit fused;
  if (kernel) {
    fused = fused_fit(ctx, a, w_gate, false, *kernel);
    if (fused.ok) fused = fused_fit(ctx, a, w_up, false, *kernel);
  }
  check_path(op, opts.path, {small_m, kSmallMNeeds}, fused);
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w_gate.rows;
  if (M == 0 || N == 0) return;
  set_device(ctx);
  if (small_m) return launch_nf4_gate_up_small_m(ctx, a, w_gate, w_up, out, opts.alpha, opts.beta);

  // With h: both GEMMs write fp32 (into the caller's f32 output, else into a scratch region), h comes from those
  // fp32 values (never from a rounded bf16 gate or up) and bf16 outputs are rounded once, in the epilogue; the CPU
  // backend does the same. Without h: each requested output takes its GEMM directly (accumulating with beta),
  // rounded once to its dtype. beta != 0 comes only without h (checked by the caller).
  const bool want_h = !out.h.empty();
  auto is_f32 = [](const TensorView& v) { return !v.empty() && v.dtype() == DType::F32; };
  const bool g_tmp = want_h && !is_f32(out.gate), u_tmp = want_h && !is_f32(out.up);
  const std::size_t mn = static_cast<std::size_t>(M * N);
  ScratchPlan plan;
  const std::size_t a_at = a.dtype() == DType::F32 ? plan.reserve(static_cast<std::size_t>(M * K) * 2) : 0;
  // One bf16 weight region, reused for the up weight after the gate GEMM (stream order makes that safe); none
  // on the fused path.
  const std::size_t w_at =
      fused.ok ? 0 : plan.reserve(static_cast<std::size_t>(std::max(w_gate.numel(), w_up.numel())) * 2);
  const std::size_t g_at = g_tmp ? plan.reserve(mn * 4) : 0;
  const std::size_t u_at = u_tmp ? plan.reserve(mn * 4) : 0;
  plan.commit(ctx);

  const Device dev = Device::cuda(state(ctx).device);
  const TensorView g_dst = g_tmp ? TensorView(plan.at<void>(g_at), DType::F32, {M, N}, dev) : out.gate;
  const TensorView u_dst = u_tmp ? TensorView(plan.at<void>(u_at), DType::F32, {M, N}, dev) : out.up;
  const void* a16 = bf16_operand(ctx, a, plan, a_at);
  auto project = [&](const Nf4Weight& w, const TensorView& dst) {
    if (dst.empty()) return;
    if (fused.ok) return launch_nf4_gemm_fused(ctx, a16, M, w, dst, opts.alpha, opts.beta, *kernel);
    void* w16 = plan.at<void>(w_at);
    dequantize_bf16(ctx, w, w16);
    bf16_gemm(ctx, a16, w16, true, dst, M, N, K, opts.alpha, opts.beta);
  };
  project(w_gate, g_dst);
  project(w_up, u_dst);
  if (!want_h) return;

  auto bf16_out = [](const TensorView& v) {
    return !v.empty() && v.dtype() == DType::BF16 ? v.data_as<__nv_bfloat16>() : nullptr;
  };
  const unsigned grid = grid_for(ctx, gate_up_epilogue_kernel, kThreads, static_cast<std::int64_t>(mn));
  gate_up_epilogue_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
      g_dst.data_as<const float>(), u_dst.data_as<const float>(), bf16_out(out.gate), bf16_out(out.up),
      out.h.data(), out.h.dtype() == DType::BF16, static_cast<std::int64_t>(mn));
  QMM_CUDA_CHECK_LAUNCH("gate_up_epilogue_kernel");
}

}  // namespace qmm::cuda
