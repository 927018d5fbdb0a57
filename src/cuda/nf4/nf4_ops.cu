// STUB: replaced by the NF4 kernels.
#include "cuda/cuda_backend.h"
#include "qmm/error.h"
namespace qmm::cuda {
void nf4_quantize(const Context&, const TensorView&, Nf4Weight&) { throw Error(ErrorCode::Unsupported, "nf4_quantize: CUDA path not built yet"); }
void nf4_dequantize(const Context&, const Nf4Weight&, const TensorView&) { throw Error(ErrorCode::Unsupported, "nf4_dequantize: CUDA path not built yet"); }
void nf4_gemm(const Context&, const TensorView&, const Nf4Weight&, const TensorView&, const Nf4GemmOptions&) { throw Error(ErrorCode::Unsupported, "nf4_gemm: CUDA path not built yet"); }
void nf4_gemm_backward_a(const Context&, const TensorView&, const Nf4Weight&, const TensorView&, const Nf4GemmOptions&) { throw Error(ErrorCode::Unsupported, "nf4_gemm_backward_a: CUDA path not built yet"); }
void nf4_gate_up(const Context&, const TensorView&, const Nf4Weight&, const Nf4Weight&, const GateUpOutputs&, const Nf4GemmOptions&) { throw Error(ErrorCode::Unsupported, "nf4_gate_up: CUDA path not built yet"); }
}  // namespace qmm::cuda
