// The NF4 GEMM planner: which GPU kernel serves an nf4_gemm, nf4_gemm_backward_a or nf4_gate_up call, and why.
// A pure host function of the problem (shapes, dtypes, the weights' format and pointer alignment, the requested
// path) and the device's capabilities. Plain C++ with no CUDA headers: it names the CUDA backend's kernels, so it
// lives on the CUDA side, but it is built into every qmm library so that the CPU tests pin its choices and
// `qmm bench --explain` can print them anywhere. Every threshold is in nf4_plan.cpp's table.
#pragma once

#include <cstdint>
#include <string>

#include "core/nf4_forced.h"
#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/tensor.h"

namespace qmm::cuda {

// What the planner reads of the GPU (cudaDeviceProp and the build).
struct Nf4Device {
  int cc = 0;                           // compute capability, major * 10 + minor
  int sm_count = 0;
  std::int64_t l2_bytes = 0;            // read by no rule yet
  std::int64_t smem_per_block_optin = 0;  // shared memory a block can opt into
  std::int64_t smem_per_sm = 0;
  bool sm90a_code = false;              // the library holds sm_90a machine code (QMM_CUDA_ARCHS has 90a)
  bool dev_kernels = false;             // the library holds the development kernels (src/cuda/dev/, QMM_DEV_KERNELS)
};

enum class Nf4Op { Forward, BackwardA, GateUp };
const char* nf4_op_name(Nf4Op op);

// A weight as the planner sees it: shape, format and the alignment (bytes, a power of two up to 16) of its arrays.
struct Nf4WeightFacts {
  std::int64_t rows = 0, cols = 0;  // W [N, K]
  std::int64_t block_size = 64;
  bool double_quant = false;
  int codes_align = 16, absmax_align = 16, code2_align = 16;
};
Nf4WeightFacts nf4_weight_facts(const Nf4Weight& w);

struct Nf4Problem {
  Nf4Op op = Nf4Op::Forward;
  std::int64_t m = 0;          // rows of A (forward, gate_up) or of dC (input gradient)
  Nf4WeightFacts w;            // the weight; gate_up's gate weight
  Nf4WeightFacts w_up;         // gate_up's up weight (same shape); unused otherwise
  DType act = DType::BF16;     // A or dC: F32 or BF16
  int act_align = 16;
  DType out = DType::BF16;     // C, dA or gate_up's outputs: read by no rule yet (the kernels pick their epilogue)
  float beta = 0.0f;           // read by no rule yet (the kernels take it at launch)
  Nf4Path path = Nf4Path::Auto;
};
// The problem of a call, from its tensors (alignment read from the pointers).
Nf4Problem nf4_problem(Nf4Op op, const TensorView& act, const Nf4Weight& w, const Nf4Weight* w_up, DType out,
                       const Nf4GemmOptions& opts);

// The problem of fresh (aligned) tensors: W [n, k] in blocks of 64, A [m, k] (dC [m, n]) of dtype `act`, bf16
// outputs, beta 0; gate_up's two weights alike. For `qmm bench --explain` and tests.
Nf4Problem nf4_problem_of_shape(Nf4Op op, std::int64_t m, std::int64_t n, std::int64_t k, DType act,
                                bool double_quant, Nf4Path path = Nf4Path::Auto);

enum class Nf4Kernel {
  Unsupported,     // a forced path that cannot serve the problem (or Reference): the call throws Unsupported
  DequantGemm,     // dequantize W to bf16, round an f32 A to bf16, cuBLASLt (its own heuristic picks the tiles)
  SmallMPair,      // nf4_small_m.cu: pair-table kernel (scale after the product), M <= 16
  SmallMGemv,      // nf4_small_m.cu: M = 1 GEMV on lane tables
  SmallMTable,     // nf4_small_m.cu: lane-table tensor-core kernel, M <= 32
  SmallMBackward,  // nf4_small_m.cu: input gradient, M <= 16
  FusedInLoop,     // nf4_fused.cu: wgmma, dequantization in the main loop (sm_90a)
  FusedShared,     // nf4_fused.cu: wgmma, each weight tile dequantized once per call (forced only)
  FusedMma,        // dev/nf4_fused_mma.cu: mma.sync, any GPU from sm_80 (forced only, QMM_DEV_KERNELS builds)
  SmallMSlice,     // nf4_slice.cu: the pair kernel's contract, a K slice of A per warp, M <= 16 (forward and
                   // gate_up)
};
const char* nf4_kernel_name(Nf4Kernel k);

// The fused wgmma kernels' grid: 128 x 256 output tiles, split over the reduction when they fill less than half
// the GPU.
struct Nf4FusedGrid {
  std::int64_t tiles_n = 0, tiles_m = 0, splits = 1, k_tiles_per_split = 0;
};

struct Nf4Plan {
  Nf4Kernel kernel = Nf4Kernel::Unsupported;
  int n8_tiles = 0;            // small-M kernels: the template's n8 (forward) or m8 (backward) tiles of A rows
  bool packed_a = false;       // SmallMPair: A copied in fragment order first (always for f32 A)
  Nf4FusedGrid grid;           // FusedInLoop and FusedShared
  const char* why = "";        // one line; for Unsupported the unmet condition, as the error message words it
};

// The plan for one call. Never throws; Unsupported carries the reason.
Nf4Plan plan_nf4(const Nf4Problem& p, const Nf4Device& d);

// The capabilities of ctx's GPU. Defined by the CUDA backend (nf4_gemm.cu): CUDA builds only (QMM_WITH_CUDA).
Nf4Device nf4_device(const Context& ctx);

// One line for people: the kernel, its tiles and split-K, and why.
std::string nf4_plan_summary(const Nf4Plan& plan);

}  // namespace qmm::cuda
