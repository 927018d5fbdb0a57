// Probe: does cuBLASLt's CUBLAS_COMPUTE_32F_FAST_16BF truncate f32 operands to bf16 or round them?
// C = A*B with 1x1x1 shapes and crafted values; prints which rounding reproduces the product.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstring>
#include <cstdint>

static float trunc_bf16(float x) { uint32_t u; memcpy(&u, &x, 4); u &= 0xFFFF0000u; memcpy(&x, &u, 4); return x; }
static float rne_bf16(float x) { uint32_t u; memcpy(&u, &x, 4); u += 0x7FFF + ((u >> 16) & 1); u &= 0xFFFF0000u; memcpy(&x, &u, 4); return x; }

int main() {
  const int K = 64;  // per-k products summed; values chosen with low bits set above the half-way point
  float hA[K], hB[K];
  for (int i = 0; i < K; ++i) { hA[i] = 1.0f + 0.0078125f * (i % 7) + 0.0029f; hB[i] = 1.0f + 0.0039f * (i % 5) + 0.0019f; }
  double t = 0, r = 0, e = 0;
  for (int i = 0; i < K; ++i) { t += (double)trunc_bf16(hA[i]) * trunc_bf16(hB[i]); r += (double)rne_bf16(hA[i]) * rne_bf16(hB[i]); e += (double)hA[i] * hB[i]; }
  float *A, *B, *C; cudaMalloc(&A, K * 4); cudaMalloc(&B, K * 4); cudaMalloc(&C, 4);
  cudaMemcpy(A, hA, K * 4, cudaMemcpyHostToDevice); cudaMemcpy(B, hB, K * 4, cudaMemcpyHostToDevice);
  cublasLtHandle_t lt; cublasLtCreate(&lt);
  cublasLtMatmulDesc_t d; cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F_FAST_16BF, CUDA_R_32F);
  cublasLtMatrixLayout_t la, lb, lc;  // column-major: A 1xK (ld 1), B Kx1, C 1x1
  cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, 1, K, 1);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, K, 1, K);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 1, 1, 1);
  float alpha = 1, beta = 0; void* ws; size_t wsb = 32 << 20; cudaMalloc(&ws, wsb);
  cublasLtMatmulPreference_t p; cublasLtMatmulPreferenceCreate(&p);
  cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
  cublasLtMatmulHeuristicResult_t h[8]; int n = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, lc, lc, p, 8, h, &n);
  printf("heuristic status %d, %d algos\n", (int)st, n);
  for (int i = 0; i < n; ++i) {
    st = cublasLtMatmul(lt, d, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &h[i].algo, ws, wsb, 0);
    float c = 0; cudaMemcpy(&c, C, 4, cudaMemcpyDeviceToHost);
    printf("algo %d: status %d  got %.9g  trunc %.9g  rne %.9g  exact %.9g -> %s\n", i, (int)st, c, t, r, e,
           fabs(c - t) < fabs(c - r) ? "TRUNCATES" : "ROUNDS");
  }
  return 0;
}
