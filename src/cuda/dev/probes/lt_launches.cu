// Probe (GPU machine): what cuBLASLt launches for the LoRA GEMMs of a decoder layer, and what each choice costs.
// A training step's layer runs ~20 device memsets and split-K reduce kernels beside its GEMMs at Llama's sizes
// (bench/layer_kernels.py); they come with the heuristic's split-K and cooperative algorithms for the adapters'
// skinny products. Per shape (row-major, as qmm's GemmProblem states them) and per preference (workspace 32 MiB or
// none; reduction schemes all, all but in-place, none), the heuristic's first algorithms: the graph nodes one matmul
// captures (kernels, memsets, others) and its time, from a graph of 20 matmuls replayed (median of 15 replays).
//   nvcc -std=c++20 -O2 -arch=sm_90a src/cuda/dev/probes/lt_launches.cu -lcublasLt -o /tmp/lt_launches
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void check(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}
void check(cublasStatus_t s) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cuBLASLt status " + std::to_string(static_cast<int>(s)));
}

// C[m, n] (+)= A·B in row-major terms: A [m, k] (or [k, m] with trans_a, rows lda apart), B [k, n] (or [n, k]).
struct Shape {
  const char* what;
  std::int64_t m, n, k;
  bool trans_a, trans_b;
  std::int64_t lda;  // 0: dense
  bool f32_out;
  float beta;
};

struct Preference {
  const char* what;
  std::size_t workspace;
  std::uint32_t reduction_mask;
};

struct Counts {
  int kernels = 0, memsets = 0, others = 0;
};

Counts count_nodes(cudaGraph_t graph) {
  std::size_t n = 0;
  check(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  check(cudaGraphGetNodes(graph, nodes.data(), &n));
  Counts c;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    check(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeKernel)
      ++c.kernels;
    else if (type == cudaGraphNodeTypeMemset)
      ++c.memsets;
    else
      ++c.others;
  }
  return c;
}

}  // namespace

int main() {
  const std::int64_t T = 4096, H = 4096, I = 14336, t = 2048, h = 1536, i = 8960;
  const std::vector<Shape> shapes = {
      {"llama t = x A_qkv^T", T, 48, H, false, true, 0, false, 0.0f},
      {"llama t = x A_gu^T", T, 32, H, false, true, 0, false, 0.0f},
      {"llama t = h A_down^T", T, 16, I, false, true, 0, false, 0.0f},
      {"llama y_q += t_q B_q^T", T, H, 16, false, true, 48, false, 1.0f},
      {"llama y_k += t_k B_k^T", T, 1024, 16, false, true, 48, false, 1.0f},
      {"llama y_gate += t B^T", T, I, 16, false, true, 32, false, 1.0f},
      {"llama grad_a_qkv = dt^T x", 48, H, T, true, false, 0, true, 0.0f},
      {"llama grad_a_down = dt^T h", 16, I, T, true, false, 0, true, 0.0f},
      {"llama dx += dt A_qkv", T, H, 48, false, false, 0, false, 1.0f},
      {"qwen t = x A_qkv^T", t, 48, h, false, true, 0, false, 0.0f},
      {"qwen t = h A_down^T", t, 16, i, false, true, 0, false, 0.0f},
      {"qwen y_gate += t B^T", t, i, 16, false, true, 32, false, 1.0f},
      {"qwen grad_a_qkv = dt^T x", 48, h, t, true, false, 0, true, 0.0f},
      {"qwen grad_a_down = dt^T h", 16, i, t, true, false, 0, true, 0.0f},
  };
  const std::vector<Preference> prefs = {
      {"ws 32M, any reduction", 32u << 20, CUBLASLT_REDUCTION_SCHEME_MASK},
      {"ws 32M, no in-place", 32u << 20,
       CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE},
      {"ws 32M, no split-K", 32u << 20, CUBLASLT_REDUCTION_SCHEME_NONE},
      {"no workspace", 0, CUBLASLT_REDUCTION_SCHEME_MASK},
  };
  constexpr int kAlgos = 3, kCalls = 20, kReplays = 15;

  cublasLtHandle_t lt;
  check(cublasLtCreate(&lt));
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* workspace = nullptr;
  check(cudaMalloc(&workspace, 32u << 20));
  std::size_t biggest = 0;
  for (const Shape& s : shapes)
    biggest = std::max<std::size_t>(biggest, static_cast<std::size_t>(std::max({s.m * s.k * 3, s.k * s.n, s.m * s.n})));
  void *a, *b, *c;
  check(cudaMalloc(&a, biggest * 2));
  check(cudaMalloc(&b, biggest * 2));
  check(cudaMalloc(&c, biggest * 4));
  check(cudaMemset(a, 0, biggest * 2));  // zeros: the values do not change what runs
  check(cudaMemset(b, 0, biggest * 2));
  check(cudaMemset(c, 0, biggest * 4));
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0));
  check(cudaEventCreate(&e1));
  cudaDeviceProp props;
  check(cudaGetDeviceProperties(&props, 0));
  std::printf("%s, cuBLASLt %zu\n%-28s %-22s %4s %7s %7s %6s %9s\n", props.name, cublasLtGetVersion(), "shape",
              "preference", "algo", "kernels", "memsets", "others", "us");

  for (const Shape& s : shapes) {
    cublasLtMatmulDesc_t desc;
    check(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
    const cublasOperation_t op_b = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    const std::int64_t ldb = s.trans_b ? s.k : s.n, lda = s.lda ? s.lda : (s.trans_a ? s.m : s.k);
    cublasLtMatrixLayout_t la, lb, lc;
    check(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.trans_b ? s.k : s.n, s.trans_b ? s.n : s.k, ldb));
    check(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.trans_a ? s.m : s.k, s.trans_a ? s.k : s.m, lda));
    check(cublasLtMatrixLayoutCreate(&lc, s.f32_out ? CUDA_R_32F : CUDA_R_16BF, s.n, s.m, s.n));
    for (const Preference& p : prefs) {
      cublasLtMatmulPreference_t pref;
      check(cublasLtMatmulPreferenceCreate(&pref));
      check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &p.workspace,
                                                 sizeof(p.workspace)));
      check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &p.reduction_mask,
                                                 sizeof(p.reduction_mask)));
      cublasLtMatmulHeuristicResult_t results[kAlgos] = {};
      int found = 0;
      const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, kAlgos, results, &found);
      if (hs != CUBLAS_STATUS_SUCCESS || found == 0) std::printf("%-28s %-22s none\n", s.what, p.what);
      for (int r = 0; r < found; ++r) {
        const float alpha = 1.0f;
        auto matmul = [&] {
          check(cublasLtMatmul(lt, desc, &alpha, b, la, a, lb, &s.beta, c, lc, c, lc, &results[r].algo, workspace,
                               p.workspace, stream));
        };
        cudaGraph_t one, many;
        check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        matmul();
        check(cudaStreamEndCapture(stream, &one));
        const Counts n = count_nodes(one);
        check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int call = 0; call < kCalls; ++call) matmul();
        check(cudaStreamEndCapture(stream, &many));
        cudaGraphExec_t exec;
        check(cudaGraphInstantiate(&exec, many, 0));
        std::vector<float> ms;
        for (int rep = 0; rep < kReplays + 2; ++rep) {
          check(cudaEventRecord(e0, stream));
          check(cudaGraphLaunch(exec, stream));
          check(cudaEventRecord(e1, stream));
          check(cudaEventSynchronize(e1));
          float v = 0;
          check(cudaEventElapsedTime(&v, e0, e1));
          if (rep >= 2) ms.push_back(v);
        }
        std::sort(ms.begin(), ms.end());
        std::printf("%-28s %-22s %4d %7d %7d %6d %9.1f\n", s.what, p.what, r, n.kernels, n.memsets, n.others,
                    ms[ms.size() / 2] * 1e3 / kCalls);
        check(cudaGraphExecDestroy(exec));
        check(cudaGraphDestroy(many));
        check(cudaGraphDestroy(one));
      }
      check(cublasLtMatmulPreferenceDestroy(pref));
    }
    check(cublasLtMatrixLayoutDestroy(la));
    check(cublasLtMatrixLayoutDestroy(lb));
    check(cublasLtMatrixLayoutDestroy(lc));
    check(cublasLtMatmulDescDestroy(desc));
  }
  return 0;
}
