// NF4 GEMMs on the GPU: validate (core), plan (nf4_plan.h: which kernel, why), launch the planned kernel.
//  DequantGemm: dequantize W to bf16 into scratch, round an f32 A to bf16 (nearest even) into the same scratch
//  allocation, then the dense bf16 GEMM (cuBLASLt, fp32 accumulation).
//  Small-M kernels: nf4_small_m.cu and nf4_slice.cu. Fused kernels: nf4_fused.cu (sm_90a wgmma),
//  dev/nf4_fused_mma.cu (mma.sync). The dev/ kernels are in QMM_DEV_KERNELS builds only.
// The plan is made again on every call rather than kept in the context's PlanCache: it is a handful of
// comparisons, cheaper than a PlanCache lookup (a string key, a lock, a hash); the cache serves cuBLASLt's
// heuristic query, which takes microseconds.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"
#include "cuda/nf4/nf4_fused.h"
#include "cuda/nf4/nf4_plan.h"
#include "cuda/nf4/nf4_slice.h"
#include "cuda/nf4/nf4_small_m.h"
#include "cuda/nf4/quantize.h"
#include "cuda/swiglu/swiglu.cuh"
#include "qmm/error.h"

namespace qmm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr std::size_t kScratchAlign = 256;  // every scratch region starts 256-byte aligned (cuBLASLt, vectors)

std::size_t align_up(std::size_t v) { return (v + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// The plan for a call; a forced path that cannot serve it throws Unsupported here, before anything runs.
Nf4Plan plan_or_throw(const Context& ctx, const Nf4Problem& p) {
  const Nf4Plan plan = plan_nf4(p, nf4_device(ctx));
  if (plan.kernel != Nf4Kernel::Unsupported) return plan;
  const std::string tail = p.path == nf4_forced::kReference
                               ? std::string(plan.why)
                               : std::string("does not support this problem (it needs ") + plan.why + ")";
  throw Error(ErrorCode::Unsupported, std::string(nf4_op_name(p.op)) + ": path " + nf4_path_name(p.path) + " " + tail);
}

bool is_fused(Nf4Kernel k) {
  return k == Nf4Kernel::FusedInLoop || k == Nf4Kernel::FusedShared || k == Nf4Kernel::FusedMma;
}

// The slice kernel: one weight, or gate and up (w1).
void launch_slice(const Context& ctx, const TensorView& a, const Nf4Weight& w0, const Nf4Weight* w1,
                  const TensorView& c, const GateUpOutputs* gate_up, const Nf4GemmOptions& opts) {
  if (w1) return launch_nf4_gate_up_small_m_slice(ctx, a, w0, *w1, *gate_up, opts.alpha, opts.beta);
  return launch_nf4_gemm_small_m_slice(ctx, a, w0, c, opts.alpha, opts.beta);
}

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

// C[m,n] = alpha * A[m,k] * B^T + beta * C (+ bias[n] on every row) with B stored [n,k] (trans_b), or * B with B
// stored [k,n].
void bf16_gemm(const Context& ctx, const void* a, const void* b, bool trans_b, const TensorView& c, std::int64_t m,
               std::int64_t n, std::int64_t k, float alpha, float beta, const void* bias = nullptr) {
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
  p.bias = bias;
  cuda::gemm(ctx, p);
}

// out[m,n] = alpha * act[m,k] * op(W) + beta * out through a bf16 copy of W (and of act where it is f32), regions
// of one scratch allocation: op(W) = W^T (W stored [n,k]) with transpose_w, else W (stored [k,n]).
void dequantize_then_gemm(const Context& ctx, const TensorView& act, const Nf4Weight& w, bool transpose_w,
                          const TensorView& out, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                          float beta) {
  ScratchPlan scratch;
  const std::size_t a_at = act.dtype() == DType::F32 ? scratch.reserve(static_cast<std::size_t>(m * k) * 2) : 0;
  const std::size_t w_at = scratch.reserve(static_cast<std::size_t>(w.rows * w.cols) * 2);
  scratch.commit(ctx);
  const void* a16 = bf16_operand(ctx, act, scratch, a_at);
  dequantize_bf16(ctx, w, scratch.at<void>(w_at));
  bf16_gemm(ctx, a16, scratch.at<void>(w_at), transpose_w, out, m, n, k, alpha, beta);
}

}  // namespace

Nf4Device nf4_device(const Context& ctx) {
  const cudaDeviceProp& props = state(ctx).props;
  Nf4Device d;
  d.cc = state(ctx).cc();
  d.sm_count = state(ctx).sm_count();
  d.l2_bytes = props.l2CacheSize;
  d.smem_per_block_optin = static_cast<std::int64_t>(props.sharedMemPerBlockOptin);
  d.smem_per_sm = static_cast<std::int64_t>(props.sharedMemPerMultiprocessor);
#if defined(QMM_HAVE_SM90A)
  d.sm90a_code = true;
#endif
#if defined(QMM_DEV_KERNELS)
  d.dev_kernels = true;
#endif
  return d;
}

void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
              const Nf4GemmOptions& opts) {
  const Nf4Plan plan = plan_or_throw(ctx, nf4_problem(Nf4Op::Forward, a, w, nullptr, c.dtype(), opts));
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w.rows;
  if (M == 0 || N == 0) return;
  set_device(ctx);
  if (plan.kernel == Nf4Kernel::SmallMSlice) return launch_slice(ctx, a, w, nullptr, c, nullptr, opts);
  if (plan.kernel != Nf4Kernel::DequantGemm && !is_fused(plan.kernel))
    return launch_nf4_gemm_small_m(ctx, plan, a, w, c, opts.alpha, opts.beta);
  if (is_fused(plan.kernel)) {
    ScratchPlan scratch;
    return launch_nf4_gemm_fused(ctx, plan, fused_operand(ctx, a, scratch), M, w, c, opts.alpha, opts.beta);
  }

  // C[M,N] = A[M,K] * W^T, W stored [N,K].
  dequantize_then_gemm(ctx, a, w, true, c, M, N, K, opts.alpha, opts.beta);
}

void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                         const Nf4GemmOptions& opts) {
  const Nf4Plan plan = plan_or_throw(ctx, nf4_problem(Nf4Op::BackwardA, dc, w, nullptr, da.dtype(), opts));
  const std::int64_t M = dc.dim(0), N = w.rows, K = w.cols;
  if (M == 0 || K == 0) return;
  set_device(ctx);
  if (plan.kernel == Nf4Kernel::SmallMBackward)
    return launch_nf4_gemm_backward_small_m(ctx, plan, dc, w, da, opts.alpha, opts.beta);
  if (is_fused(plan.kernel)) {
    ScratchPlan scratch;
    return launch_nf4_gemm_backward_fused(ctx, plan, fused_operand(ctx, dc, scratch), M, w, da, opts.alpha,
                                          opts.beta);
  }

  // dA[M,K] = dC[M,N] * W, W stored [N,K] = B [k=N, n=K], not transposed.
  dequantize_then_gemm(ctx, dc, w, false, da, M, K, N, opts.alpha, opts.beta);
}

void nf4_gemms(const Context& ctx, const TensorView& a, std::span<const Nf4Weight> ws, std::span<const TensorView> cs,
               std::span<const float> betas, std::span<const TensorView> biases, const Nf4GemmOptions& opts) {
  auto one = [&](std::size_t i) { return Nf4GemmOptions{opts.alpha, betas[i], opts.path}; };
  bool grouped = ws.size() > 1 && a.dim(0) > 0;
  for (std::size_t i = 0; i < ws.size(); ++i)  // every plan first: a forced path that cannot serve one throws here
    grouped = plan_or_throw(ctx, nf4_problem(Nf4Op::Forward, a, ws[i], nullptr, cs[i].dtype(), one(i))).kernel ==
                  Nf4Kernel::DequantGemm &&
              grouped;
  // Grouped, the GEMMs add the biases in their epilogue; apart (the small-M kernels), a launch of its own each.
  if (!grouped) {
    for (std::size_t i = 0; i < ws.size(); ++i) {
      cuda::nf4_gemm(ctx, a, ws[i], cs[i], one(i));
      if (!biases[i].empty() && a.dim(0) > 0) cuda::add_bias(ctx, cs[i], biases[i]);
    }
    return;
  }
  set_device(ctx);
  const std::int64_t M = a.dim(0), K = a.dim(1);
  ScratchPlan scratch;
  const std::size_t a_at = a.dtype() == DType::F32 ? scratch.reserve(static_cast<std::size_t>(M * K) * 2) : 0;
  std::size_t elems = 0;
  for (const Nf4Weight& w : ws) elems += static_cast<std::size_t>(w.numel());
  const std::size_t w_at = scratch.reserve(elems * 2);
  scratch.commit(ctx);
  const void* a16 = bf16_operand(ctx, a, scratch, a_at);
  auto* w16 = scratch.at<__nv_bfloat16>(w_at);
  nf4_dequantize_many(ctx, ws, w16);
  for (std::size_t i = 0; i < ws.size(); ++i) {
    bf16_gemm(ctx, a16, w16, true, cs[i], M, ws[i].rows, K, opts.alpha, betas[i],
              biases[i].empty() ? nullptr : biases[i].data());
    w16 += ws[i].numel();
  }
}

void nf4_gemms_backward_a(const Context& ctx, std::span<const TensorView> dcs, std::span<const Nf4Weight> ws,
                          const TensorView& da, const Nf4GemmOptions& opts) {
  // The first product present writes da with opts.beta, the others add to it.
  std::vector<Nf4GemmOptions> each;
  float beta = opts.beta;
  bool grouped = true;
  std::size_t present = 0;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    each.push_back({opts.alpha, beta, opts.path});
    if (dcs[i].empty()) continue;
    ++present;
    beta = 1.0f;
    grouped = plan_or_throw(ctx, nf4_problem(Nf4Op::BackwardA, dcs[i], ws[i], nullptr, da.dtype(), each[i])).kernel ==
                  Nf4Kernel::DequantGemm &&
              dcs[i].dtype() == DType::BF16 && grouped;
  }
  if (!grouped || present < 2 || da.dim(0) == 0) {
    for (std::size_t i = 0; i < ws.size(); ++i)
      if (!dcs[i].empty()) cuda::nf4_gemm_backward_a(ctx, dcs[i], ws[i], da, each[i]);
    return;
  }
  set_device(ctx);
  std::vector<Nf4Weight> used;
  for (std::size_t i = 0; i < ws.size(); ++i)
    if (!dcs[i].empty()) used.push_back(ws[i]);
  std::size_t elems = 0;
  for (const Nf4Weight& w : used) elems += static_cast<std::size_t>(w.numel());
  ScratchPlan scratch;
  const std::size_t w_at = scratch.reserve(elems * 2);
  scratch.commit(ctx);
  auto* w16 = scratch.at<__nv_bfloat16>(w_at);
  nf4_dequantize_many(ctx, used, w16);
  const std::int64_t M = da.dim(0), K = da.dim(1);
  for (std::size_t i = 0; i < ws.size(); ++i) {
    if (dcs[i].empty()) continue;
    bf16_gemm(ctx, dcs[i].data(), w16, false, da, M, K, ws[i].rows, opts.alpha, each[i].beta);
    w16 += ws[i].numel();
  }
}

void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                 const GateUpOutputs& out, const Nf4GemmOptions& opts) {
  // gate_up's outputs share one dtype only where the caller gave them so; the planner reads no output dtype yet.
  const DType out_dtype = !out.gate.empty() ? out.gate.dtype() : !out.up.empty() ? out.up.dtype() : out.h.dtype();
  const Nf4Plan plan = plan_or_throw(ctx, nf4_problem(Nf4Op::GateUp, a, w_gate, &w_up, out_dtype, opts));
  const std::int64_t M = a.dim(0), K = a.dim(1), N = w_gate.rows;
  if (M == 0 || N == 0) return;
  set_device(ctx);
  if (plan.kernel == Nf4Kernel::SmallMSlice) return launch_slice(ctx, a, w_gate, &w_up, TensorView(), &out, opts);
  if (plan.kernel != Nf4Kernel::DequantGemm && !is_fused(plan.kernel))
    return launch_nf4_gate_up_small_m(ctx, plan, a, w_gate, w_up, out, opts.alpha, opts.beta);
  // Fused: the fused forward once per projection.
  const bool fused = is_fused(plan.kernel);

  // With h: both GEMMs write fp32 (into the caller's f32 output, else into a scratch region), h comes from those
  // fp32 values (never from a rounded bf16 gate or up) and bf16 outputs are rounded once, in the epilogue; the CPU
  // backend does the same. Without h: each requested output takes its GEMM directly (accumulating with beta),
  // rounded once to its dtype. beta != 0 comes only without h (checked by the caller).
  const bool want_h = !out.h.empty();
  auto is_f32 = [](const TensorView& v) { return !v.empty() && v.dtype() == DType::F32; };
  const bool g_tmp = want_h && !is_f32(out.gate), u_tmp = want_h && !is_f32(out.up);
  const std::size_t mn = static_cast<std::size_t>(M * N);
  ScratchPlan scratch;
  const std::size_t a_at = a.dtype() == DType::F32 ? scratch.reserve(static_cast<std::size_t>(M * K) * 2) : 0;
  // Where both products are wanted, both bf16 weights in one region, dequantized by one launch; else the one
  // wanted. None on the fused path.
  const bool want_g = want_h || !out.gate.empty(), want_u = want_h || !out.up.empty(), both = want_g && want_u;
  const std::int64_t w_elems = both ? w_gate.numel() + w_up.numel() : want_g ? w_gate.numel() : w_up.numel();
  const std::size_t w_at = fused ? 0 : scratch.reserve(static_cast<std::size_t>(w_elems) * 2);
  const std::size_t g_at = g_tmp ? scratch.reserve(mn * 4) : 0;
  const std::size_t u_at = u_tmp ? scratch.reserve(mn * 4) : 0;
  scratch.commit(ctx);

  const Device dev = Device::cuda(state(ctx).device);
  const TensorView g_dst = g_tmp ? TensorView(scratch.at<void>(g_at), DType::F32, {M, N}, dev) : out.gate;
  const TensorView u_dst = u_tmp ? TensorView(scratch.at<void>(u_at), DType::F32, {M, N}, dev) : out.up;
  const void* a16 = bf16_operand(ctx, a, scratch, a_at);
  auto* w16 = fused ? nullptr : scratch.at<__nv_bfloat16>(w_at);
  if (!fused && both) {
    const Nf4Weight ws[2] = {w_gate, w_up};
    nf4_dequantize_many(ctx, ws, w16);
  }
  auto project = [&](const Nf4Weight& w, const TensorView& dst, const __nv_bfloat16* w_bf16) {
    if (dst.empty()) return;
    if (fused) return launch_nf4_gemm_fused(ctx, plan, a16, M, w, dst, opts.alpha, opts.beta);
    if (!both) dequantize_bf16(ctx, w, w16);
    bf16_gemm(ctx, a16, w_bf16, true, dst, M, N, K, opts.alpha, opts.beta);
  };
  project(w_gate, g_dst, w16);
  project(w_up, u_dst, both && !fused ? w16 + w_gate.numel() : w16);
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
