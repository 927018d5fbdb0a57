// The dense GEMM family on cuBLASLt: one GemmProblem (row-major, strided-batched) per call.
//
// Row-major onto column-major: a row-major [r,c] matrix is a column-major [c,r] one with the same leading
// dimension, so C = op(A)·op(B) (row-major) is computed as C^T = op(B)^T·op(A)^T (column-major): cuBLASLt's "A" is
// our B, its "B" is our A, its m is our n and its n our m. No data moves.
//
// Math modes (include/qmm/ops.h):
//  - f32, FP32: CUBLAS_COMPUTE_32F_PEDANTIC, "standard arithmetic" by contract (never TF32, BF16x9 emulation or
//    other split tricks, whatever environment variables say). Should cuBLASLt offer no pedantic algorithm for a
//    shape, CUBLAS_COMPUTE_32F is the fallback: for f32 operands it also multiplies in fp32 (only the _FAST_ types
//    down-convert inputs; BF16x9 emulation needs an explicit opt-in and Blackwell).
//  - f32, TF32: CUBLAS_COMPUTE_32F_FAST_TF32.
//  - f32, BF16: C = Σ trunc(A)·trunc(B). One conversion kernel truncates both operands into scratch (bf16), then a
//    bf16×bf16 GEMM with CUBLAS_COMPUTE_32F. (cuBLASLt's own FAST_16BF is not used: its rounding is not ours to
//    specify.) Products of two bf16 values are exact in fp32, so only the fp32 accumulation differs from the oracle.
//  - bf16 storage (any mode): bf16×bf16, CUBLAS_COMPUTE_32F, C bf16 or f32.
//
// Plans: descriptors, layouts and the heuristic's algorithm are made once per (GemmProblem::key(), pointer
// alignment class) and kept in the context's PlanCache, so a cached call creates no descriptor.
//
// Concurrency: a Context may be used from several host threads, all enqueueing on its one stream. The truncated
// operands live in a stream-ordered ScratchBuffer of this call's own, and the matmul is enqueued under
// CudaState::lt_mutex so that its kernels, which share the cuBLASLt workspace, are not interleaved with another's.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/context_impl.h"
#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"
#include "cuda/gemm/truncate.cuh"

namespace qmm::cuda {
namespace {

constexpr std::size_t kScratchAlign = 256;        // offset of the second operand in scratch
constexpr int kHeuristicResults = 8;

std::size_t round_up(std::size_t x, std::size_t to) { return (x + to - 1) / to * to; }

// cuBLASLt state of one plan. Created once, only read afterwards (cublasLtMatmul takes them as const input), so
// threads share a plan without locking; the one exception, a bias epilogue's pointer, is set under the launch's
// lock (cublasLtMatmul reads it when it launches).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lt_a = nullptr;  // cuBLASLt's A: our B
  cublasLtMatrixLayout_t lt_b = nullptr;  // cuBLASLt's B: our A
  cublasLtMatrixLayout_t lt_c = nullptr;  // C and D (in place)
  cublasLtMatmulAlgo_t algo{};
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  // The workspace the algorithm was chosen for, and is given at launch: one chosen without it also runs without
  // it (given the workspace anyway, such algorithms were seen to zero part of it first, a memset every launch).
  std::uint64_t workspace_bytes = 0;

  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() { release(); }

  void release() noexcept {
    if (lt_c) cublasLtMatrixLayoutDestroy(lt_c);
    if (lt_b) cublasLtMatrixLayoutDestroy(lt_b);
    if (lt_a) cublasLtMatrixLayoutDestroy(lt_a);
    if (desc) cublasLtMatmulDescDestroy(desc);
    lt_a = lt_b = lt_c = nullptr;
    desc = nullptr;
  }
};

struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
  }
};

// How the GEMM itself runs, derived from the problem.
struct Route {
  bool convert = false;  // f32 operands truncated to bf16 in scratch first (MathMode::BF16)
  cudaDataType_t ab_type = CUDA_R_32F;
  cudaDataType_t c_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  bool fp32_strict = false;  // try PEDANTIC, fall back to 32F
};

Route route_of(const GemmProblem& p) {
  Route r;
  r.c_type = p.c_dtype == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  if (p.ab_dtype == DType::BF16) {
    r.ab_type = CUDA_R_16BF;
    r.compute = CUBLAS_COMPUTE_32F;
    return r;
  }
  switch (p.math) {
    case MathMode::FP32:
      r.compute = CUBLAS_COMPUTE_32F_PEDANTIC;
      r.fp32_strict = true;
      break;
    case MathMode::TF32:
      r.compute = CUBLAS_COMPUTE_32F_FAST_TF32;
      break;
    case MathMode::BF16:
      r.convert = true;
      r.ab_type = CUDA_R_16BF;
      r.compute = CUBLAS_COMPUTE_32F;
      break;
  }
  return r;
}

// Largest power of two dividing x, capped at 256 (cuBLASLt's default assumption); 256 for x == 0.
std::uint32_t pow2_alignment(std::uintptr_t x) {
  if (x == 0) return 256;
  const std::uintptr_t low = x & (~x + 1);
  return static_cast<std::uint32_t>(std::min<std::uintptr_t>(low, 256));
}

// The alignment every batch entry of an operand shares: its base pointer's, and its batch stride's in bytes.
// Bucketed to the values the heuristics distinguish (below 16 bytes, 16 for vector/TMA access, 256), so that
// views at assorted offsets do not multiply plans.
std::uint32_t alignment_class(const void* ptr, std::int64_t batch, std::int64_t stride, std::size_t elem) {
  std::uint32_t a = pow2_alignment(reinterpret_cast<std::uintptr_t>(ptr));
  if (batch > 1 && stride != 0) a = std::min(a, pow2_alignment(static_cast<std::uintptr_t>(stride) * elem));
  return a < 16 ? a : (a < 256 ? 16u : 256u);
}

// Elements of one operand touched over all batch entries (dense matrices of `per` elements, batch stride s).
std::int64_t span_elems(std::int64_t batch, std::int64_t stride, std::int64_t per) {
  return batch > 1 ? (batch - 1) * stride + per : per;
}

std::string shape_text(const GemmProblem& p) {
  return "batch " + std::to_string(p.batch) + ", m " + std::to_string(p.m) + ", n " + std::to_string(p.n) +
         ", k " + std::to_string(p.k) + ", " + (p.trans_a ? "A^T" : "A") + "·" + (p.trans_b ? "B^T" : "B") + ", " +
         dtype_name(p.ab_dtype) + "->" + dtype_name(p.c_dtype) + ", math " + math_mode_name(p.math);
}

void set_layout_batch(cublasLtMatrixLayout_t layout, std::int64_t batch, std::int64_t stride) {
  if (batch <= 1) return;
  const std::int32_t count = static_cast<std::int32_t>(batch);
  QMM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                    sizeof(count)));
  QMM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                    sizeof(stride)));
}

struct Alignments {
  std::uint32_t a, b, c;  // of OUR A, B, C as cuBLASLt will see them (scratch copies for converted operands)
};

// Builds descriptors and layouts for `compute` and asks the heuristic; false when it offers no algorithm.
bool try_make_plan(const CudaState& st, const GemmProblem& p, const Route& r, cublasComputeType_t compute,
                   const Alignments& al, std::uint64_t workspace_bytes, LtPlan& plan) {
  plan.release();
  plan.compute = compute;
  const cublasStatus_t ds = cublasLtMatmulDescCreate(&plan.desc, compute, CUDA_R_32F);
  if (ds == CUBLAS_STATUS_NOT_SUPPORTED || ds == CUBLAS_STATUS_INVALID_VALUE) return false;  // compute type refused
  QMM_CUBLAS_CHECK(ds);
  const cublasOperation_t op_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t op_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  QMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  QMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (p.bias) {  // cuBLASLt's rows are our columns: its bias, one value a row of D, is ours, one a column
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = r.c_type;
    QMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    QMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }

  // Column-major views of the row-major buffers: rows = the row-major column count = the leading dimension.
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  // Our B, stored [k,n] (or [n,k] with trans_b), seen as column-major [n,k] (or [k,n]).
  QMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_a, r.ab_type, u(p.trans_b ? p.k : p.n),
                                              u(p.trans_b ? p.n : p.k), p.ldb()));
  // Our A, stored [m,k] (or [k,m] with trans_a), seen as column-major [k,m] (or [m,k]).
  QMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_b, r.ab_type, u(p.trans_a ? p.m : p.k),
                                              u(p.trans_a ? p.k : p.m), p.lda()));
  // C [m,n] row-major, seen as column-major [n,m].
  QMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_c, r.c_type, u(p.n), u(p.m), p.ldc()));
  set_layout_batch(plan.lt_a, p.batch, p.stride_b);
  set_layout_batch(plan.lt_b, p.batch, p.stride_a);
  set_layout_batch(plan.lt_c, p.batch, p.stride_c);

  PreferenceGuard pg;
  QMM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pg.pref));
  QMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pg.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &workspace_bytes, sizeof(workspace_bytes)));
  // The default assumes 256-byte aligned pointers; tell the heuristic what ours really are.
  QMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pg.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al.b,
                                                        sizeof(al.b)));
  QMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pg.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al.a,
                                                        sizeof(al.a)));
  QMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pg.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al.c,
                                                        sizeof(al.c)));
  QMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pg.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al.c,
                                                        sizeof(al.c)));

  cublasLtMatmulHeuristicResult_t results[kHeuristicResults] = {};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(st.lt, plan.desc, plan.lt_a, plan.lt_b, plan.lt_c,
                                                           plan.lt_c, pg.pref, kHeuristicResults, results, &found);
  if (hs == CUBLAS_STATUS_NOT_SUPPORTED) return false;  // "no algorithm for this configuration"
  QMM_CUBLAS_CHECK(hs);
  for (int i = 0; i < found; ++i) {  // best first
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace_bytes) {
      plan.algo = results[i].algo;
      plan.workspace_bytes = workspace_bytes;
      return true;
    }
  }
  return false;
}

// Products over a short K (an adapter's second product t·Bᵀ, its share of the input gradient dt·A) have nothing
// worth splitting: offered the workspace, the heuristic picks kernels that zero part of it first (a device memset
// before every launch) and that ran no faster than the plain kernel it picks without one (docs/BENCHMARKS.md).
constexpr std::int64_t kShortK = 256;

std::shared_ptr<LtPlan> make_plan(const CudaState& st, const GemmProblem& p, const Route& r, const Alignments& al) {
  auto plan = std::make_shared<LtPlan>();
  std::vector<std::uint64_t> workspaces{st.workspace_bytes};
  if (p.k <= kShortK) workspaces.insert(workspaces.begin(), 0);  // the workspace only where no algorithm goes without
  std::vector<cublasComputeType_t> computes{r.compute};
  if (r.fp32_strict) computes.push_back(CUBLAS_COMPUTE_32F);
  for (const cublasComputeType_t compute : computes)
    for (const std::uint64_t ws : workspaces)
      if (try_make_plan(st, p, r, compute, al, ws, *plan)) return plan;
  throw Error(ErrorCode::Unsupported, "gemm: cuBLASLt offers no algorithm for " + shape_text(p) + " (alignment A " +
                                          std::to_string(al.a) + ", B " + std::to_string(al.b) + ", C " +
                                          std::to_string(al.c) + " bytes) on " + st.props.name);
}

void launch_truncate_bf16(const CudaState& st, const float* a, std::int64_t na, std::uint16_t* a_dst,
                          const float* b, std::int64_t nb, std::uint16_t* b_dst) {
  const auto aligned16 = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
  const TruncSegment sa{a, a_dst, na, aligned16(a)};
  const TruncSegment sb{b, b_dst, nb, aligned16(b)};
  const std::int64_t chunks_a = (na + kTruncChunk - 1) / kTruncChunk;
  const std::int64_t chunks = chunks_a + (nb + kTruncChunk - 1) / kTruncChunk;
  const std::int64_t want = (chunks + kTruncThreads - 1) / kTruncThreads;
  // Enough resident blocks to saturate bandwidth; the grid-stride loop does the rest.
  const std::int64_t cap = static_cast<std::int64_t>(std::max(st.sm_count(), 1)) * 8;
  const unsigned grid = static_cast<unsigned>(std::max<std::int64_t>(1, std::min(want, cap)));
  truncate_bf16_kernel<<<grid, kTruncThreads, 0, st.stream>>>(sa, sb, chunks_a, chunks);
  QMM_CUDA_CHECK_LAUNCH("truncate_bf16_kernel");
}

void launch_scale_c(const CudaState& st, const GemmProblem& p) {
  const std::int64_t per = p.m * p.n, total = p.batch * per;
  constexpr int kThreads = 256;
  const std::int64_t cap = static_cast<std::int64_t>(std::max(st.sm_count(), 1)) * 8;
  const unsigned grid =
      static_cast<unsigned>(std::max<std::int64_t>(1, std::min((total + kThreads - 1) / kThreads, cap)));
  if (p.c_dtype == DType::F32) {
    scale_c_kernel<float><<<grid, kThreads, 0, st.stream>>>(static_cast<const float*>(p.c_in ? p.c_in : p.c),
                                                            static_cast<float*>(p.c), per, p.stride_c, total, p.beta);
  } else {
    scale_c_kernel<std::uint16_t>
        <<<grid, kThreads, 0, st.stream>>>(static_cast<const std::uint16_t*>(p.c_in ? p.c_in : p.c),
                                           static_cast<std::uint16_t*>(p.c), per, p.stride_c, total, p.beta);
  }
  QMM_CUDA_CHECK_LAUNCH("scale_c_kernel");
}

}  // namespace

void gemm(const Context& ctx, const GemmProblem& p) {
  if (p.batch <= 0 || p.m <= 0 || p.n <= 0) return;
  set_device(ctx);
  CudaState& st = state(ctx);

  // Batches of C must not share elements: cuBLASLt (and the K == 0 pass) would write them concurrently.
  if (p.batch > 1 && p.stride_c < p.m * p.n)
    throw Error(ErrorCode::Unsupported, "gemm: C batch stride " + std::to_string(p.stride_c) +
                                            " is below m*n = " + std::to_string(p.m * p.n) + " for " +
                                            shape_text(p) + ": batches of C would overlap");
  const Route r = route_of(p);
  // Row pitches and a bias (the bias epilogue) take one product that cuBLASLt runs on the operands as given.
  const bool one_plain_product = p.batch == 1 && p.k > 0 && !r.convert;
  if (!p.dense() && !one_plain_product)
    throw Error(ErrorCode::Unsupported, "gemm: row pitches need one bf16 product with k > 0 (" + shape_text(p) + ")");
  if (p.bias && !one_plain_product)
    throw Error(ErrorCode::Unsupported,
                "gemm: a bias needs one product with k > 0 and no conversion (" + shape_text(p) + ")");
  if (p.k == 0) {  // an empty product: C = beta * C, which cuBLASLt does not take (k must be positive)
    launch_scale_c(st, p);
    return;
  }
  if (p.batch > INT32_MAX)
    throw Error(ErrorCode::Unsupported, "gemm: batch " + std::to_string(p.batch) +
                                            " exceeds cuBLASLt's int32 batch count for " + shape_text(p));

  const std::size_t ab_elem = r.ab_type == CUDA_R_16BF ? 2 : 4;
  const std::size_t c_elem = p.c_dtype == DType::BF16 ? 2 : 4;
  Alignments al{};
  if (r.convert) {
    // Scratch copies keep the layout and batch strides; their base pointers are 256-byte aligned.
    al.a = alignment_class(nullptr, p.batch, p.stride_a, ab_elem);
    al.b = alignment_class(nullptr, p.batch, p.stride_b, ab_elem);
  } else {
    al.a = alignment_class(p.a, p.batch, p.stride_a, ab_elem);
    al.b = alignment_class(p.b, p.batch, p.stride_b, ab_elem);
  }
  al.c = alignment_class(p.c, p.batch, p.stride_c, c_elem);
  if (p.c_in) al.c = std::min(al.c, alignment_class(p.c_in, p.batch, p.stride_c, c_elem));
  // A row pitch moves every row start: the alignment is also the pitch's (a dense matrix's rows are its own).
  const auto pitched = [](std::uint32_t a, std::int64_t pitch, std::size_t elem) {
    return pitch ? std::min(a, alignment_class(nullptr, 2, pitch, elem)) : a;
  };
  al.a = pitched(al.a, p.pitch_a, ab_elem);
  al.b = pitched(al.b, p.pitch_b, ab_elem);
  al.c = pitched(al.c, p.pitch_c, c_elem);

  const std::string key = "cublaslt|" + p.key() + "|align" + std::to_string(al.a) + "," + std::to_string(al.b) +
                          "," + std::to_string(al.c);
  const std::shared_ptr<LtPlan> plan =
      impl_of(ctx).plans.get_or_create<LtPlan>(key, [&] { return make_plan(st, p, r, al); });

  const float alpha = p.alpha, beta = p.beta;  // host scalars (cuBLASLt's default pointer mode)
  const void* a = p.a;
  const void* b = p.b;
  std::unique_ptr<ScratchBuffer> scratch;
  if (r.convert) {
    const std::int64_t na = span_elems(p.batch, p.stride_a, p.m * p.k);
    const std::int64_t nb = span_elems(p.batch, p.stride_b, p.k * p.n);
    const std::size_t b_off = round_up(static_cast<std::size_t>(na) * 2, kScratchAlign);
    const std::size_t bytes = b_off + static_cast<std::size_t>(nb) * 2;
    scratch = std::make_unique<ScratchBuffer>(st, bytes);
    auto* a16 = scratch->at<std::uint16_t>(0);
    auto* b16 = scratch->at<std::uint16_t>(b_off);
    launch_truncate_bf16(st, static_cast<const float*>(p.a), na, a16, static_cast<const float*>(p.b), nb, b16);
    a = a16;
    b = b16;
  }
  // cuBLASLt's A is our B and its B our A (see the top). beta == 0: cuBLASLt does not read C (the addend where
  // given; D is always p.c).
  std::lock_guard<std::mutex> lock(st.lt_mutex);
  if (p.bias)
    QMM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias)));
  QMM_CUBLAS_CHECK(cublasLtMatmul(st.lt, plan->desc, &alpha, b, plan->lt_a, a, plan->lt_b, &beta, p.c_in ? p.c_in : p.c,
                                  plan->lt_c, p.c, plan->lt_c, &plan->algo,
                                  plan->workspace_bytes ? st.workspace : nullptr, plan->workspace_bytes, st.stream));
}

}  // namespace qmm::cuda
