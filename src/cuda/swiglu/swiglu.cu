// STUB: replaced by the SwiGLU kernels.
#include "cuda/cuda_backend.h"
#include "qmm/error.h"
namespace qmm::cuda {
void swiglu(const Context&, const TensorView&, const TensorView&, const TensorView&) {
  throw Error(ErrorCode::Unsupported, "swiglu: CUDA path not built yet");
}
void swiglu_backward(const Context&, const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                     const TensorView&) {
  throw Error(ErrorCode::Unsupported, "swiglu_backward: CUDA path not built yet");
}
}  // namespace qmm::cuda
