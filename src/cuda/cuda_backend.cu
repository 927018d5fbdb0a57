// The CUDA backend as the core sees it (core/gpu_backend.h): each method hands its call to cuda_backend.h's entry
// point. CMake compiles this file where CUDA was found; it then defines gpu_backend().
#include "core/gpu_backend.h"
#include "cuda/cuda_backend.h"

namespace qmm {
namespace {

class CudaBackend final : public GpuBackend {
 public:
  int device_count() const override { return cuda::device_count(); }
  std::string unavailable_reason() const override { return cuda::unavailable_reason(); }
  void init_context(Context::Impl& impl, int device, void* stream) const override {
    cuda::init_context(impl, device, stream);
  }
  void* create_owned_stream(Context::Impl& impl) const override { return cuda::create_owned_stream(impl); }
  void* device_alloc(std::size_t bytes, int device) const override { return cuda::device_alloc(bytes, device); }
  void device_free(void* ptr, int device) const noexcept override { cuda::device_free(ptr, device); }
  void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                  std::size_t bytes) const override {
    cuda::copy_bytes(dst, dst_device, src, src_device, bytes);
  }
  void copy_bytes_async(const Context& ctx, void* dst, const void* src, std::size_t bytes) const override {
    cuda::copy_bytes_async(ctx, dst, src, bytes);
  }
  void synchronize(const Context& ctx) const override { cuda::synchronize(ctx); }
  DeviceInfo device_info(const Context& ctx) const override { return cuda::device_info(ctx); }
  MemoryStats memory_stats(const Context& ctx) const override { return cuda::memory_stats(ctx); }
  void reset_peak_memory_stats(const Context& ctx) const override { cuda::reset_peak_memory_stats(ctx); }
  void release_cached_memory(const Context& ctx) const override { cuda::release_cached_memory(ctx); }
  std::vector<double> time_calls(const Context& ctx, const std::function<void(int)>& fn, int warmup,
                                 int repeats) const override {
    return cuda::time_calls(ctx, fn, warmup, repeats);
  }
  std::vector<double> time_graph(const Context& ctx, const std::function<void(int)>& fn, int calls,
                                 int replays) const override {
    return cuda::time_graph(ctx, fn, calls, replays);
  }

  void gemm(const Context& ctx, const GemmProblem& p) const override { cuda::gemm(ctx, p); }
  bool lora_backward_dy(const Context& ctx, std::span<const LoraDyProblem> adapters) const override {
    return cuda::lora_backward_dy_fused(ctx, adapters);
  }
  void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h,
              const SwiGluAdapters& adapters) const override {
    if (adapters.empty())
      cuda::swiglu(ctx, gate, up, h);
    else
      cuda::swiglu_adapters(ctx, gate, up, h, adapters);
  }
  void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                       const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters,
                       const TensorView& h) const override {
    if (adapters.empty() && h.empty())
      cuda::swiglu_backward(ctx, gate, up, dh, dgate, dup);
    else
      cuda::swiglu_adapters_backward(ctx, gate, up, dh, dgate, dup, adapters, h);
  }
  void nf4_quantize(const Context& ctx, const TensorView& w, Nf4Weight& out) const override {
    cuda::nf4_quantize(ctx, w, out);
  }
  void nf4_dequantize(const Context& ctx, const Nf4Weight& w, const TensorView& out) const override {
    cuda::nf4_dequantize(ctx, w, out);
  }
  void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
                const Nf4GemmOptions& opts) const override {
    cuda::nf4_gemm(ctx, a, w, c, opts);
  }
  void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                           const Nf4GemmOptions& opts) const override {
    cuda::nf4_gemm_backward_a(ctx, dc, w, da, opts);
  }
  void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                   const GateUpOutputs& out, const Nf4GemmOptions& opts) const override {
    cuda::nf4_gate_up(ctx, a, w_gate, w_up, out, opts);
  }
  void nf4_gemms(const Context& ctx, const TensorView& a, std::span<const Nf4Weight> ws, std::span<const TensorView> cs,
                 std::span<const float> betas, std::span<const TensorView> biases,
                 const Nf4GemmOptions& opts) const override {
    cuda::nf4_gemms(ctx, a, ws, cs, betas, biases, opts);
  }
  void nf4_gemms_backward_a(const Context& ctx, std::span<const TensorView> dcs, std::span<const Nf4Weight> ws,
                            const TensorView& da, const Nf4GemmOptions& opts) const override {
    cuda::nf4_gemms_backward_a(ctx, dcs, ws, da, opts);
  }

  void cast(const Context& ctx, std::span<const TensorView> src, std::span<const TensorView> dst) const override {
    cuda::cast(ctx, src, dst);
  }
  void add(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& out,
           float alpha) const override {
    cuda::add(ctx, a, b, out, alpha);
  }
  void add_bias(const Context& ctx, const TensorView& y, const TensorView& bias) const override {
    cuda::add_bias(ctx, y, bias);
  }
  void dropout(const Context& ctx, const TensorView& x, const TensorView& out, float p,
               std::uint64_t seed) const override {
    cuda::dropout(ctx, x, out, p, seed);
  }
  void mse_loss(const Context& ctx, const TensorView& y, const TensorView& target, const TensorView& loss,
                const TensorView& dy, float scale) const override {
    cuda::mse_loss(ctx, y, target, loss, dy, scale);
  }
  void grad_norm(const Context& ctx, std::span<const TensorView> grads, const TensorView& norm) const override {
    cuda::grad_norm(ctx, grads, norm);
  }
  void adamw_step(const Context& ctx, std::span<const AdamWParam> params, const AdamWOptions& opts, int step,
                  const TensorView& norm) const override {
    cuda::adamw_step(ctx, params, opts, step, norm);
  }
  void zero(const Context& ctx, const TensorView& t) const override { cuda::zero(ctx, t); }
  void rms_norm(const Context& ctx, const TensorView& x, const TensorView& r, const TensorView& w, const TensorView& h,
                const TensorView& y, const TensorView& rstd, float eps) const override {
    cuda::rms_norm(ctx, x, r, w, h, y, rstd, eps);
  }
  void rms_norm_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                         const TensorView& dy, const TensorView& dx, const TensorView& dw,
                         const TensorView& dres) const override {
    cuda::rms_norm_backward(ctx, x, w, rstd, dy, dx, dw, dres);
  }
  void rope(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos,
            const TensorView& sin, const TensorView& q_out, const TensorView& k_out, bool inverse) const override {
    cuda::rope(ctx, q, k, cos, sin, q_out, k_out, inverse);
  }
  void linear_cross_entropy(const Context& ctx, const TensorView& h, const TensorView& w, const TensorView& labels,
                            const TensorView& loss, const TensorView& dh, const TensorView& dw,
                            const CrossEntropyOptions& opts) const override {
    cuda::linear_cross_entropy(ctx, h, w, labels, loss, dh, dw, opts);
  }
};

}  // namespace

const GpuBackend* gpu_backend() {
  static const CudaBackend backend;
  return &backend;
}

}  // namespace qmm
