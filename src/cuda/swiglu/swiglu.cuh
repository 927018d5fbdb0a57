// Device code of SwiGLU forward and backward: fp32 math on f32 or bf16 storage, 16-byte vectors where every
// pointer allows them, a scalar loop for the tail (and for misaligned pointers).
// Outputs may be exactly the memory of an input (in place): each thread loads every input element it owns
// before it stores any output element, and no thread touches another thread's elements, so the pointers carry
// no __restrict__ and loads avoid the non-coherent (__ldg) path.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/elem.cuh"

namespace qmm::cuda::swiglu_detail {

using common::Elem;

constexpr int kThreads = 256;

// sigmoid(x) and 1 - sigmoid(x) from t = e^-|x| in (0, 1]: s = 1/(1+t) for x >= 0, t/(1+t) for x < 0, and the
// complement the other way round. e^-|x| never overflows (a naive 1/(1+e^-x) hits inf below x = -88.7 and returns
// 0 where the true value is still a normal float), and 1 - s never cancels. Finite for every finite x.
// expf (not __expf): its 2-ulp error keeps f32 outputs within ~1e-6 relative of the fp64 oracle.
struct Sigmoid {
  float s;    // sigmoid(x)
  float oms;  // 1 - sigmoid(x)
};
__device__ __forceinline__ Sigmoid sigmoid_pair(float x) {
  const float t = expf(-fabsf(x));
  const float r = 1.0f / (1.0f + t);
  const float tr = t * r;
  return x >= 0.0f ? Sigmoid{r, tr} : Sigmoid{tr, r};
}

// h = silu(g) * u, silu(g) = g * sigmoid(g)
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid_pair(g).s * u; }

// dgate = dh * u * silu'(g), silu'(g) = s * (1 + g * (1 - s)); dup = dh * silu(g).
__device__ __forceinline__ void swiglu_grad(float g, float u, float dh, float& dgate, float& dup) {
  const Sigmoid p = sigmoid_pair(g);
  dgate = dh * u * (p.s * (1.0f + g * p.oms));
  dup = dh * (g * p.s);
}

// Vectors [0, nvec) (nvec = 0 when a pointer is misaligned), then elements [nvec * kVec, n) one by one.
template <class T>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* gate, const T* up, T* h, std::int64_t n,
                                                          std::int64_t nvec) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t v = tid; v < nvec; v += stride) {
    float g[V], u[V], r[V];
    E::load_vec(gate, v, g);
    E::load_vec(up, v, u);
#pragma unroll
    for (int j = 0; j < V; ++j) r[j] = swiglu_value(g[j], u[j]);
    E::store_vec(h, v, r);
  }
  for (std::int64_t i = nvec * V + tid; i < n; i += stride) {
    const float g = E::load(gate, i), u = E::load(up, i);
    E::store(h, i, swiglu_value(g, u));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(const T* gate, const T* up, const T* dh,
                                                                   T* dgate, T* dup, std::int64_t n,
                                                                   std::int64_t nvec) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t v = tid; v < nvec; v += stride) {
    float g[V], u[V], d[V], rg[V], ru[V];
    E::load_vec(gate, v, g);
    E::load_vec(up, v, u);
    E::load_vec(dh, v, d);
#pragma unroll
    for (int j = 0; j < V; ++j) swiglu_grad(g[j], u[j], d[j], rg[j], ru[j]);
    E::store_vec(dgate, v, rg);
    E::store_vec(dup, v, ru);
  }
  for (std::int64_t i = nvec * V + tid; i < n; i += stride) {
    const float g = E::load(gate, i), u = E::load(up, i), d = E::load(dh, i);
    float rg, ru;
    swiglu_grad(g, u, d, rg, ru);
    E::store(dgate, i, rg);
    E::store(dup, i, ru);
  }
}

}  // namespace qmm::cuda::swiglu_detail
