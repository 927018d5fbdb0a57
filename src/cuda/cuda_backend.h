// The CUDA backend's entry points, callable from plain C++ (no CUDA headers); cuda_backend.cu hands them to the
// core as its GpuBackend (core/gpu_backend.h). Arguments arrive validated and on ctx's device. Everything is
// enqueued on ctx's stream.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/gemm_problem.h"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/train_ops.h"

namespace qmm::cuda {

// Device and memory (src/cuda/common/).
int device_count();
std::string unavailable_reason();
void init_context(Context::Impl& impl, int device, void* stream);  // fills impl.backend, name
void* device_alloc(std::size_t bytes, int device);
void device_free(void* ptr, int device) noexcept;
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes);
void copy_bytes_async(const Context& ctx, void* dst, const void* src, std::size_t bytes);
void synchronize(const Context& ctx);
DeviceInfo device_info(const Context& ctx);
MemoryStats memory_stats(const Context& ctx);
void reset_peak_memory_stats(const Context& ctx);
void release_cached_memory(const Context& ctx);
std::vector<double> time_calls(const Context& ctx, const std::function<void(int)>& fn, int warmup, int repeats);
std::vector<double> time_graph(const Context& ctx, const std::function<void(int)>& fn, int calls, int replays);
// Creates a non-blocking stream for impl (destroyed with its state) and returns it.
void* create_owned_stream(Context::Impl& impl);

void gemm(const Context& ctx, const GemmProblem& p);                       // gemm/
// lora_backward_dy's one-pass kernel for adapters of one M, all in one launch, where it applies to every one (see
// GpuBackend::lora_backward_dy); false, having done nothing, where it does not.
bool lora_backward_dy_fused(const Context& ctx, std::span<const LoraDyProblem> adapters);
void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h);  // swiglu/
void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                     const TensorView& dgate, const TensorView& dup);
// SwiGLU with adapters' terms on its operands (ops.h, SwiGluAdapters); the backward may also write h.
void swiglu_adapters(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h,
                     const SwiGluAdapters& adapters);
void swiglu_adapters_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                              const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters,
                              const TensorView& h);
void nf4_quantize(const Context& ctx, const TensorView& w, Nf4Weight& out);  // nf4/
void nf4_dequantize(const Context& ctx, const Nf4Weight& w, const TensorView& out);
void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
              const Nf4GemmOptions& opts);
void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                         const Nf4GemmOptions& opts);
void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                 const GateUpOutputs& out, const Nf4GemmOptions& opts);
// Several NF4 products of one input (c_i = alpha·a·dequant(W_i)ᵀ + betas[i]·c_i), or several input gradients
// summed into one (da = alpha·Σ dc_i·dequant(W_i) + beta·da; empty dc_i skipped): one dequantize launch for all
// where every product takes DequantGemm, otherwise one call each.
void nf4_gemms(const Context& ctx, const TensorView& a, std::span<const Nf4Weight> ws, std::span<const TensorView> cs,
               std::span<const float> betas, std::span<const TensorView> biases, const Nf4GemmOptions& opts);
void nf4_gemms_backward_a(const Context& ctx, std::span<const TensorView> dcs, std::span<const Nf4Weight> ws,
                          const TensorView& da, const Nf4GemmOptions& opts);

// Train ops (train/). Reductions write per-block fp64 partials into stream-ordered scratch and sum them in one
// block in a fixed order; adamw_step reads its clip coefficient from device memory (no host round trip).
void cast(const Context& ctx, const TensorView& src, const TensorView& dst);
void cast(const Context& ctx, std::span<const TensorView> src, std::span<const TensorView> dst);
void add(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& out, float alpha);
void add_bias(const Context& ctx, const TensorView& y, const TensorView& bias);
void dropout(const Context& ctx, const TensorView& x, const TensorView& out, float p, std::uint64_t seed);
void mse_loss(const Context& ctx, const TensorView& y, const TensorView& target, const TensorView& loss,
              const TensorView& dy, float scale);
void grad_norm(const Context& ctx, std::span<const TensorView> grads, const TensorView& norm);
void adamw_step(const Context& ctx, std::span<const AdamWParam> params, const AdamWOptions& opts, int step,
                const TensorView& norm);
void zero(const Context& ctx, const TensorView& t);
// r and h are absent views (rank 0) without the residual add (rms_norm), dres without a second gradient.
void rms_norm(const Context& ctx, const TensorView& x, const TensorView& r, const TensorView& w, const TensorView& h,
              const TensorView& y, const TensorView& rstd, float eps);
void rms_norm_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                       const TensorView& dy, const TensorView& dx, const TensorView& dw, const TensorView& dres);
// k and k_out are absent views (rank 0) where there is no k.
void rope(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
          const TensorView& q_out, const TensorView& k_out, bool inverse);
// The labels arrive checked where the caller asked (see train_ops.h); the chunks' GEMMs run through qmm::gemm.
void linear_cross_entropy(const Context& ctx, const TensorView& h, const TensorView& w, const TensorView& labels,
                          const TensorView& loss, const TensorView& dh, const TensorView& dw,
                          const CrossEntropyOptions& opts);

}  // namespace qmm::cuda
