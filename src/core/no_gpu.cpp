// The GPU backend of a build without CUDA: none (see core/gpu_backend.h). CMake compiles this file only then.
#include "core/gpu_backend.h"

namespace qmm {

const GpuBackend* gpu_backend() { return nullptr; }

}  // namespace qmm
