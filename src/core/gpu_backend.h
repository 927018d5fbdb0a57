// How the core reaches a GPU. The core validates every argument, hands CPU work to the ReferenceBackend
// (core/reference_backend.h) and GPU work to the one GpuBackend linked into the build: src/cuda/cuda_backend.cu
// where CUDA was found, src/core/no_gpu.cpp (no backend) otherwise. No core file includes a backend's headers; a
// backend includes the core's.
// Arguments arrive validated and on the context's device; everything is enqueued on the context's stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/context_impl.h"
#include "core/gemm_problem.h"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/train_ops.h"

namespace qmm {

class GpuBackend {
 public:
  virtual ~GpuBackend() = default;

  // Devices, contexts and memory.
  virtual int device_count() const = 0;
  virtual std::string unavailable_reason() const = 0;
  virtual void init_context(Context::Impl& impl, int device, void* stream) const = 0;  // fills impl.backend, name
  virtual void* create_owned_stream(Context::Impl& impl) const = 0;  // a stream destroyed with impl's state
  virtual void* device_alloc(std::size_t bytes, int device) const = 0;
  virtual void device_free(void* ptr, int device) const noexcept = 0;
  virtual void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                          std::size_t bytes) const = 0;
  virtual void copy_bytes_async(const Context& ctx, void* dst, const void* src, std::size_t bytes) const = 0;
  virtual void synchronize(const Context& ctx) const = 0;
  virtual DeviceInfo device_info(const Context& ctx) const = 0;
  virtual MemoryStats memory_stats(const Context& ctx) const = 0;
  virtual void reset_peak_memory_stats(const Context& ctx) const = 0;
  virtual void release_cached_memory(const Context& ctx) const = 0;
  virtual std::vector<double> time_calls(const Context& ctx, const std::function<void(int)>& fn, int warmup,
                                         int repeats) const = 0;
  virtual std::vector<double> time_graph(const Context& ctx, const std::function<void(int)>& fn, int calls,
                                         int replays) const = 0;

  // GEMMs, SwiGLU and NF4 (ops.h, nf4.h).
  virtual void gemm(const Context& ctx, const GemmProblem& p) const = 0;
  // lora_backward_dy's one-pass kernel for these adapters of one M (one launch for all, and one for their partial
  // sums) where it applies to every one of them; false, having done nothing, where it does not.
  virtual bool lora_backward_dy(const Context& ctx, std::span<const LoraDyProblem> adapters) const = 0;
  virtual void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h,
                      const SwiGluAdapters& adapters) const = 0;
  virtual void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                               const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters,
                               const TensorView& h) const = 0;
  virtual void nf4_quantize(const Context& ctx, const TensorView& w, Nf4Weight& out) const = 0;
  virtual void nf4_dequantize(const Context& ctx, const Nf4Weight& w, const TensorView& out) const = 0;
  virtual void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
                        const Nf4GemmOptions& opts) const = 0;
  virtual void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w,
                                   const TensorView& da, const Nf4GemmOptions& opts) const = 0;
  virtual void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                           const GateUpOutputs& out, const Nf4GemmOptions& opts) const = 0;
  // Several NF4 products of one input, or several input gradients summed into one (ops.h, lora_nf4_linears_*):
  // c_i = alpha·a·dequant(W_i)ᵀ + betas[i]·c_i (+ biases[i] on every row, where not empty);
  // da = alpha·Σ dc_i·dequant(W_i) + beta·da (empty dc_i skipped).
  virtual void nf4_gemms(const Context& ctx, const TensorView& a, std::span<const Nf4Weight> ws,
                         std::span<const TensorView> cs, std::span<const float> betas,
                         std::span<const TensorView> biases, const Nf4GemmOptions& opts) const = 0;
  virtual void nf4_gemms_backward_a(const Context& ctx, std::span<const TensorView> dcs, std::span<const Nf4Weight> ws,
                                    const TensorView& da, const Nf4GemmOptions& opts) const = 0;

  // Train ops (train_ops.h).
  virtual void cast(const Context& ctx, std::span<const TensorView> src, std::span<const TensorView> dst) const = 0;
  virtual void add(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& out,
                   float alpha) const = 0;
  virtual void add_bias(const Context& ctx, const TensorView& y, const TensorView& bias) const = 0;
  virtual void dropout(const Context& ctx, const TensorView& x, const TensorView& out, float p,
                       std::uint64_t seed) const = 0;
  virtual void mse_loss(const Context& ctx, const TensorView& y, const TensorView& target, const TensorView& loss,
                        const TensorView& dy, float scale) const = 0;
  virtual void grad_norm(const Context& ctx, std::span<const TensorView> grads, const TensorView& norm) const = 0;
  virtual void adamw_step(const Context& ctx, std::span<const AdamWParam> params, const AdamWOptions& opts,
                          int step, const TensorView& norm) const = 0;
  virtual void zero(const Context& ctx, const TensorView& t) const = 0;
  // r and h are absent views (rank 0) without the residual add (rms_norm), dres without a second gradient.
  virtual void rms_norm(const Context& ctx, const TensorView& x, const TensorView& r, const TensorView& w,
                        const TensorView& h, const TensorView& y, const TensorView& rstd, float eps) const = 0;
  virtual void rms_norm_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                                 const TensorView& dy, const TensorView& dx, const TensorView& dw,
                                 const TensorView& dres) const = 0;
  // k and k_out are absent views (rank 0) where there is no k.
  virtual void rope(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos,
                    const TensorView& sin, const TensorView& q_out, const TensorView& k_out, bool inverse) const = 0;
  // The labels are not checked here (the core did, where asked).
  virtual void linear_cross_entropy(const Context& ctx, const TensorView& h, const TensorView& w,
                                    const TensorView& labels, const TensorView& loss, const TensorView& dh,
                                    const TensorView& dw, const CrossEntropyOptions& opts) const = 0;
};

// The GPU backend of this build, or nullptr where it has none.
const GpuBackend* gpu_backend();
// The GPU backend, or a NoDevice error naming `op` where this build has none.
const GpuBackend& require_gpu_backend(const char* op);

}  // namespace qmm
