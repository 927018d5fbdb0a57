// The CUDA backend's entry points, callable from plain C++ (no CUDA headers). Arguments arrive validated and on
// ctx's device. Everything is enqueued on ctx's stream.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "core/gemm_problem.h"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"

namespace qmm::cuda {

// Device and memory (src/cuda/common/).
int device_count();
std::string unavailable_reason();
void init_context(Context::Impl& impl, int device, void* stream);  // fills impl.cuda, name
void* device_alloc(std::size_t bytes, int device);
void device_free(void* ptr, int device) noexcept;
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes);
void copy_bytes_async(const Context& ctx, void* dst, const void* src, std::size_t bytes);
void synchronize(const Context& ctx);
DeviceInfo device_info(const Context& ctx);
std::vector<double> time_calls(const Context& ctx, const std::function<void(int)>& fn, int warmup, int repeats);
std::vector<double> time_graph(const Context& ctx, const std::function<void(int)>& fn, int calls, int replays);
// Creates a non-blocking stream for impl (destroyed with its state) and returns it.
void* create_owned_stream(Context::Impl& impl);

void gemm(const Context& ctx, const GemmProblem& p);                       // gemm/
void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h);  // swiglu/
void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                     const TensorView& dgate, const TensorView& dup);
void nf4_quantize(const Context& ctx, const TensorView& w, Nf4Weight& out);  // nf4/
void nf4_dequantize(const Context& ctx, const Nf4Weight& w, const TensorView& out);
void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
              const Nf4GemmOptions& opts);
void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                         const Nf4GemmOptions& opts);
void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                 const GateUpOutputs& out, const Nf4GemmOptions& opts);

}  // namespace qmm::cuda
